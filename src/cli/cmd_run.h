// `k3 run` (raw completion) and `k3 chat` (interactive XTML chat); argv[0] is the subcommand name.
// Errors print "k3 run: error: ..." / "k3 chat: error: ..." and return 2.
#pragma once

namespace k3::cli {
int cmd_run(int argc, char** argv);
int cmd_chat(int argc, char** argv);
}  // namespace k3::cli
