// `k3 eval`: perplexity of a model over a text file with the sliding-window protocol of
// docs/eval.md (argv[0] is the subcommand name). Result line on stdout, progress on stderr,
// optional --json FILE. Errors print "k3 eval: error: ..." and return 2; Ctrl-C returns 130
// after printing the partial result.
#pragma once
#include <cstdint>
#include <vector>

namespace k3::cli {

int cmd_eval(int argc, char** argv);

// The windows of the protocol for n_tokens tokens, --ctx and --stride (exposed for tests and
// documentation; see docs/eval.md). A window feeds tokens [start, start + ctx) to a fresh session
// and scores tokens first_target..last_target (inclusive), token t from the logits at window
// position t - 1 - start.
struct EvalWindow {
  int64_t start = 0, first_target = 0, last_target = 0;
};
// ctx is the effective window (<= n_tokens - 1); 1 <= stride <= ctx. n_tokens >= 2.
std::vector<EvalWindow> eval_windows(int64_t n_tokens, int64_t ctx, int64_t stride);

}  // namespace k3::cli
