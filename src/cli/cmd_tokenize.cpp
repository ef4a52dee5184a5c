// Implements `k3 tokenize [-m DIR] (--text T | -f FILE)` and `k3 detokenize [-m DIR] --ids 1,2,3`.
// The tokenizer is the model's (-m, with the default of every subcommand: $K3_MODEL, then the
// bundled model), or --tokenizer DIR; --vocab DIR is the older spelling of -m and still accepted.
// Input text is encoded as plain text (special-token names in it are not special), byte for byte.
// Must not crash on bad flags, ids or files: every problem is one line on stderr and exit status 2.
#include "cli/cmd_tokenize.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace k3::cli {

namespace {

// -m/--model (alias --vocab) and --tokenizer, as `k3 run` spells them.
struct TokenizerFlags {
  std::string model, tokenizer;
  void add(CLI::App* app) {
    add_model_option(app, model, ",--vocab");
    app->add_option("--tokenizer", tokenizer,
                    "directory with tiktoken.model + tokenizer_config.json (default: the model directory)");
  }
  tok::Tokenizer load() const {
    const std::string dir = tokenizer.empty() ? resolve_model_dir(model) : tokenizer;
    if (!fs::is_directory(dir)) fail("tokenizer directory " + dir + " does not exist");
    if (!fs::exists(fs::path(dir) / "tiktoken.model")) fail(dir + " has no tiktoken.model");
    return tok::Tokenizer::load_dir(dir);
  }
};

std::string read_text(const std::string& file) {
  if (file == "-") return std::string(std::istreambuf_iterator<char>(std::cin), {});
  if (fs::is_directory(file)) fail("cannot read --file " + file + ": it is a directory");
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open --file " + file);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<tok::TokenId> parse_token_ids(const std::string& arg) {
  std::vector<tok::TokenId> ids;
  std::string cur;
  const auto flush = [&]() {
    if (cur.empty()) return;
    if (cur.size() > 10 || cur.find_first_not_of("0123456789") != std::string::npos || std::stoull(cur) > 0xFFFFFFFFull)
      fail("--ids: '" + cur + "' is not a token id");
    ids.push_back(static_cast<tok::TokenId>(std::stoull(cur)));
    cur.clear();
  };
  for (char c : arg) {
    if (c == ',' || c == ' ')
      flush();
    else
      cur += c;
  }
  flush();
  return ids;
}

}  // namespace

int cmd_tokenize(int argc, char** argv) {
  CLI::App app{"k3 tokenize: text -> token ids (space-separated, one line on stdout)"};
  app.name("k3 tokenize");
  TokenizerFlags tf;
  std::string text, file;
  auto* text_opt = app.add_option("--text", text, "text to encode (special-token names in it stay plain text)");
  app.add_option("-f,--file", file, "read the text from FILE (- = stdin)")->excludes(text_opt);
  tf.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  return run_guarded("k3 tokenize", [&]() -> int {
    if (!app.count("--text") && !app.count("--file")) fail("give the text with --text T or --file F (- = stdin)");
    const std::string input = app.count("--text") ? text : read_text(file);
    const tok::Tokenizer tok = tf.load();
    const auto ids = tok.encode(input);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    std::printf("%s\n", line.c_str());
    return 0;
  });
}

int cmd_detokenize(int argc, char** argv) {
  CLI::App app{"k3 detokenize: token ids -> text (on stdout, then a newline)"};
  app.name("k3 detokenize");
  TokenizerFlags tf;
  std::string ids_arg;
  app.add_option("--ids", ids_arg, "token ids separated by commas or spaces")->required();
  tf.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  return run_guarded("k3 detokenize", [&]() -> int {
    const std::vector<tok::TokenId> ids = parse_token_ids(ids_arg);
    const tok::Tokenizer tok = tf.load();
    const std::string out = tok.decode(ids);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  });
}

}  // namespace k3::cli
