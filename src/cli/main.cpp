// The `k3` command: one binary, one subcommand per job (run, chat, eval, bench, info, logits,
// generate, tokenize, detokenize, serve). Each subcommand parses its own flags (CLI11, one help format)
// and prints every failure as one line "k3 <sub>: error: <message>".
// Owns: dispatch, `k3 --help` and `k3 --version`; exit codes (0 ok, 2 bad input/usage, 1 internal
// error, 130 after Ctrl-C). Must not: contain model math.
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
#include "k3/version.h"

namespace {

struct Subcommand {
  const char* name;
  const char* description;
  int (*run)(int, char**);
};

const Subcommand kSubcommands[] = {
    {"run", "raw text completion streamed to stdout", k3::cli::cmd_run},
    {"chat", "interactive multi-turn chat in the K3 format", k3::cli::cmd_chat},
    {"eval", "perplexity of a model over a text file", k3::cli::cmd_eval},
    {"bench", "prefill/decode throughput at several context depths", k3::cli::cmd_bench},
    {"info", "architecture, parameter counts, state/cache sizes, weight bytes, memory at --ctx N", k3::cli::cmd_info},
    {"logits", "one prefill over token ids; float32 logits [T, vocab]", k3::cli::cmd_logits},
    {"generate", "greedy decoding from token ids", k3::cli::cmd_generate},
    {"tokenize", "text -> token ids", k3::cli::cmd_tokenize},
    {"detokenize", "token ids -> text", k3::cli::cmd_detokenize},
    {"serve", "OpenAI-compatible HTTP server with continuous batching and a prefix cache", k3::cli::cmd_serve},
    {"plan", "placement on GPUs / host RAM / disk and predicted t/s from the config and the machine", k3::cli::cmd_plan},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1)
    for (const Subcommand& s : kSubcommands)
      if (argv[1] == std::string(s.name)) return s.run(argc - 1, argv + 1);

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
