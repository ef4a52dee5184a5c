// `k3 plan` (cmd_plan.cpp): placement and predicted throughput of a checkpoint on a machine, and
// `k3 plan --calibrate` (measured rates). argv[0] is the subcommand name.
#pragma once

namespace k3::cli {
int cmd_plan(int argc, char** argv);
}  // namespace k3::cli
