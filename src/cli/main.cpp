// The `k3` command: one binary, one subcommand per job (run, chat, eval, bench, info, logits,
// generate, tokenize, detokenize, serve). Each subcommand parses its own flags (CLI11, one help format)
// and prints every failure as one line "k3 <sub>: error: <message>".
// Owns: dispatch, `k3 --help` and `k3 --version`; exit codes (0 ok, 2 bad input/usage, 1 internal
// error, 130 after Ctrl-C); the start and end of an MPI launch (`mpirun -np N k3 <sub> --tp N`: every
// process runs the subcommand, rank 0 does the job and the others follow its steps, model/remote.h).
// Must not: contain model math.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "cli/cli_common.h"
#include "cli/cmd_bench.h"
#include "cli/cmd_eval.h"
#include "cli/cmd_ids.h"
#include "cli/cmd_plan.h"
#include "cli/cmd_run.h"
#include "cli/cmd_serve.h"
#include "cli/cmd_tokenize.h"
#include "core/comm.h"
#include "core/comm_mpi.h"
#include "core/error.h"
#include "k3/version.h"

namespace {

struct Subcommand {
  const char* name;
  const char* description;
  int (*run)(int, char**);
  bool splits;  // runs a model that --tp/--ep can split (so it can run as the processes of an MPI launch)
};

const Subcommand kSubcommands[] = {
    {"run", "raw text completion streamed to stdout", k3::cli::cmd_run, true},
    {"chat", "interactive multi-turn chat in the K3 format", k3::cli::cmd_chat, true},
    {"eval", "perplexity of a model over a text file", k3::cli::cmd_eval, true},
    {"bench", "prefill/decode throughput at several context depths", k3::cli::cmd_bench, true},
    {"info", "architecture, parameter counts, state/cache sizes, weight bytes, memory at --ctx N", k3::cli::cmd_info,
     false},
    {"logits", "one prefill over token ids; float32 logits [T, vocab]", k3::cli::cmd_logits, true},
    {"generate", "greedy decoding from token ids", k3::cli::cmd_generate, true},
    {"tokenize", "text -> token ids", k3::cli::cmd_tokenize, false},
    {"detokenize", "token ids -> text", k3::cli::cmd_detokenize, false},
    {"serve", "OpenAI-compatible HTTP server with continuous batching and a prefix cache", k3::cli::cmd_serve, true},
    {"plan", "placement on GPUs / host RAM / disk and predicted t/s from the config and the machine", k3::cli::cmd_plan,
     false},
};

// A subcommand in this process. Under an MPI launch (mpirun -np N) MPI starts first, the subcommand
// must be one that splits a model, and the launch ends with MPI_Finalize, or MPI_Abort after a
// failure so no process waits for a failed one.
int run_subcommand(const Subcommand& s, int argc, char** argv) {
  if (k3::mpi::launched_size() <= 1) return s.run(argc - 1, argv + 1);
  const std::string who = std::string("k3 ") + s.name;
  std::unique_ptr<k3::Communicator> procs;
  try {
    if (!s.splits)
      k3::fail(std::string("started as ") + std::to_string(k3::mpi::launched_size()) +
               " processes by an MPI launcher, but k3 " + s.name +
               " runs as one process (only the subcommands that run a model split with --tp/--ep run as several)");
    procs = k3::mpi::launch(&argc, &argv);
  } catch (const k3::Error& e) {
    k3::cli::print_error(who, e.what());
    return 2;
  }
  k3::set_process_group(procs.get());
  const int rc = s.run(argc - 1, argv + 1);
  k3::set_process_group(nullptr);
  procs.reset();
  k3::mpi::finish(rc);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1)
    for (const Subcommand& s : kSubcommands)
      if (argv[1] == std::string(s.name)) return run_subcommand(s, argc, argv);

  // No subcommand: `k3 --help`, `k3 --version`, or a usage error.
  CLI::App app{"k3: inference engine for Kimi K3-architecture models (k3 <subcommand> --help for its flags)"};
  app.name("k3");
  app.set_version_flag("--version", std::string("k3 ") + k3::version());
  for (const Subcommand& s : kSubcommands) app.add_subcommand(s.name, s.description);
  app.require_subcommand(1);
  if (argc > 1 && argv[1][0] != '-') {
    k3::cli::print_error("k3", "unknown subcommand '" + std::string(argv[1]) + "' (see k3 --help)");
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    k3::cli::print_error("k3", std::string(e.what()) + " (see k3 --help)");
    return 2;
  }
  return 0;  // not reached: every subcommand returned above
}
