// `k3 bench`: llama-bench-style prefill/decode throughput at several context depths (argv[0] is
// the subcommand name). Owns flag parsing, timing and the table/JSON output; no model math.
#pragma once

namespace k3::cli {
int cmd_bench(int argc, char** argv);
}  // namespace k3::cli
