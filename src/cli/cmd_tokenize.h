// `k3 tokenize` / `k3 detokenize` subcommands (argv[0] is the subcommand name). Text in, ids out
// (space-separated, one line) and back. Errors print "k3 tokenize: error: ..." and return 2.
// Owns flag parsing and printing only; tokenization lives in src/tokenizer.
#pragma once

namespace k3::cli {
int cmd_tokenize(int argc, char** argv);
int cmd_detokenize(int argc, char** argv);
}  // namespace k3::cli
