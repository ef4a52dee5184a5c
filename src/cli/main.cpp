// The `k3` command: one binary, one subcommand per job (run, chat, eval, bench, info, logits,
// generate, tokenize, detokenize, serve). Each subcommand parses its own flags (CLI11, one help format)
// and prints every failure as one line "k3 <sub>: error: <message>".
// Owns: dispatch, `k3 --help` and `k3 --version`; exit codes (0 ok, 2 bad input/usage, 1 internal
// error, 130 after Ctrl-C); the start and end of an MPI launch (`mpirun -np N k3 <sub> --tp N`: every
// process runs the subcommand, rank 0 does the job and the others follow its steps, model/remote.h).
// Must not: contain model math.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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
#include "core/comm_tcp.h"
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
// --rank R --world W --master HOST:PORT (or --name=value) taken out of argv: a rendezvous of processes
// started by hand (core/comm_tcp.h). Returns whether any was given; one-line k3::Error when incomplete.
struct Rendezvous {
  int rank = -1, world = 0;
  std::string master;
};
bool take_rendezvous(std::vector<char*>& args, Rendezvous& rv) {
  bool any = false;
  std::vector<char*> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string a = args[i];
    std::string name = a, value;
    bool inline_value = false;
    if (const auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos)
      name = a.substr(0, eq), value = a.substr(eq + 1), inline_value = true;
    if (name != "--rank" && name != "--world" && name != "--master") {
      kept.push_back(args[i]);
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) k3::fail(name + " needs a value");
      value = args[++i];
    }
    any = true;
    if (name == "--master") {
      rv.master = value;
      continue;
    }
    char* end = nullptr;
    const long x = std::strtol(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || x < 0 || x > 1024) k3::fail(name + " " + value + ": a number 0..1024");
    (name == "--rank" ? rv.rank : rv.world) = int(x);
  }
  args = kept;
  if (any && (rv.rank < 0 || rv.world < 2 || rv.master.empty()))
    k3::fail("--rank, --world (2 or more) and --master HOST:PORT go together (processes started by hand)");
  return any;
}

// The processes of this launch: MPI's (mpirun) or a rendezvous (--master), with one GPU each; null
// for one process. Throws k3::Error (one line) when they cannot start.
std::unique_ptr<k3::Communicator> start_processes(const Subcommand& s, std::vector<char*>& args, int& argc,
                                                  char**& argv) {
  Rendezvous rv;
  const bool by_hand = take_rendezvous(args, rv);
  const int mpi = k3::mpi::launched_size();
  if (!by_hand && mpi <= 1) return nullptr;
  const std::string how = by_hand ? "with --rank/--world/--master" : "by an MPI launcher";
  if (by_hand && mpi > 1) k3::fail("started by an MPI launcher and with --master: give one of them");
  if (!s.splits)
    k3::fail("started as " + std::to_string(by_hand ? rv.world : mpi) + " processes " + how + ", but k3 " + s.name +
             " runs as one process (only the subcommands that run a model split with --tp/--ep run as several)");
  // One GPU per process (its local rank's), before anything starts CUDA.
  k3::mpi::bind_local_gpu(by_hand ? rv.rank : -1);
  if (by_hand) return k3::tcp::rendezvous(rv.rank, rv.world, rv.master);
  return k3::mpi::launch(&argc, &argv);
}

int run_subcommand(const Subcommand& s, int argc, char** argv) {
  const std::string who = std::string("k3 ") + s.name;
  std::vector<char*> args(argv, argv + argc);
  std::unique_ptr<k3::Communicator> procs;
  try {
    procs = start_processes(s, args, argc, argv);
  } catch (const k3::Error& e) {
    k3::cli::print_error(who, e.what());
    return 2;
  }
  if (!procs) return s.run(int(args.size()) - 1, args.data() + 1);
  const bool mpi = std::string(procs->name()) == "mpi";
  if (mpi) args.assign(argv, argv + argc);  // as MPI_Init left them
  k3::set_process_group(procs.get());
  const int rc = s.run(int(args.size()) - 1, args.data() + 1);
  k3::set_process_group(nullptr);
  if (!mpi && rc != 0) procs->abort("k3 " + std::string(s.name) + " failed here (exit " + std::to_string(rc) + ")");
  procs.reset();
  if (mpi) k3::mpi::finish(rc);
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
