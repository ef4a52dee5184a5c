// The subcommands of the `k3` command besides run / chat / eval / bench: `k3 logits`, `k3 generate`
// (token-id tools, cmd_ids.cpp) and `k3 info` (cmd_info.cpp); argv[0] is the subcommand name.
// Errors print "k3 <sub>: error: ..." (one line) and return 2.
#pragma once

namespace k3::cli {
int cmd_logits(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_info(int argc, char** argv);
}  // namespace k3::cli
