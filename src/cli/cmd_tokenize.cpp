// Implements `k3 tokenize --vocab DIR (--text T | --file F)` and `k3 detokenize --vocab DIR --ids 1,2,3`.
// Input text is encoded as plain text (special-token names in it are not special). Must not crash on
// bad flags, ids or files: every problem is one line on stderr and exit status 2.
#include "cli/cmd_tokenize.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

struct Flags {
  std::string vocab, text, file, ids;
  bool has_text = false, has_file = false, has_ids = false;
  bool help = false;
};

const char* kTokenizeHelp =
    "k3 tokenize: text -> token ids (space-separated, one line)\n"
    "Usage: k3 tokenize --vocab DIR (--text T | --file F)\n"
    "  --vocab DIR   directory with tiktoken.model (+ tokenizer_config.json); a model directory works\n"
    "  --text T      text to encode (special-token names in it stay plain text)\n"
    "  --file F      read the text from F\n";
const char* kDetokenizeHelp =
    "k3 detokenize: token ids -> text\n"
    "Usage: k3 detokenize --vocab DIR --ids 1,2,3\n"
    "  --vocab DIR   directory with tiktoken.model (+ tokenizer_config.json)\n"
    "  --ids LIST    ids separated by commas or spaces\n";

Flags parse_flags(int argc, char** argv, bool detok) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      f.help = true;
      return f;
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw k3::Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--vocab")
      f.vocab = value();
    else if (a == "--text" && !detok)
      f.text = value(), f.has_text = true;
    else if (a == "--file" && !detok)
      f.file = value(), f.has_file = true;
    else if (a == "--ids" && detok)
      f.ids = value(), f.has_ids = true;
    else
      throw k3::Error("unknown flag '" + a + "'");
  }
  if (f.vocab.empty()) throw k3::Error("--vocab DIR is required");
  if (!detok && f.has_text == f.has_file) throw k3::Error("give exactly one of --text T or --file F");
  if (detok && !f.has_ids) throw k3::Error("--ids 1,2,3 is required");
  return f;
}

int fail(const char* cmd, const std::string& msg, int code) {
  std::fprintf(stderr, "k3 %s: error: %s\n", cmd, msg.c_str());
  return code;
}

}  // namespace

int cmd_tokenize(int argc, char** argv) {
  try {
    const Flags f = parse_flags(argc, argv, false);
    if (f.help) return std::fputs(kTokenizeHelp, stdout), 0;
    std::string text = f.text;
    if (f.has_file) {
      std::ifstream in(f.file, std::ios::binary);
      if (!in) throw k3::Error("cannot open --file " + f.file);
      std::ostringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    const auto tok = k3::tok::Tokenizer::load_dir(f.vocab);
    const auto ids = tok.encode(text);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    std::printf("%s\n", line.c_str());
    return 0;
  } catch (const k3::Error& e) {
    return fail("tokenize", e.what(), e.exit_code());
  } catch (const std::exception& e) {
    return fail("tokenize", e.what(), 2);
  }
}

int cmd_detokenize(int argc, char** argv) {
  try {
    const Flags f = parse_flags(argc, argv, true);
    if (f.help) return std::fputs(kDetokenizeHelp, stdout), 0;
    std::vector<k3::tok::TokenId> ids;
    std::string cur;
    auto flush = [&]() {
      if (cur.empty()) return;
      if (cur.size() > 10 || cur.find_first_not_of("0123456789") != std::string::npos ||
          std::stoull(cur) > 0xFFFFFFFFull)
        throw k3::Error("--ids: '" + cur + "' is not a token id");
      ids.push_back(static_cast<k3::tok::TokenId>(std::stoull(cur)));
      cur.clear();
    };
    for (char c : f.ids) {
      if (c == ',' || c == ' ')
        flush();
      else
        cur += c;
    }
    flush();
    const auto tok = k3::tok::Tokenizer::load_dir(f.vocab);
    const std::string text = tok.decode(ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  } catch (const k3::Error& e) {
    return fail("detokenize", e.what(), e.exit_code());
  } catch (const std::exception& e) {
    return fail("detokenize", e.what(), 2);
  }
}
