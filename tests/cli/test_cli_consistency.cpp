// One flag set, one error format and one help format for every `k3` subcommand (issue 17, part 4):
// -m defaults, "k3 <sub>: error: <message>" in one line, CLI11 help everywhere, the context limit
// in generate / logits / info, --stop, --seed, UTF-8 prompts, tokenize from stdin, progress
// percentages, capped problem lists, no cuBLAS in CPU processes, and the install rules.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;
using k3test::run_shell;

namespace {

fs::path src(const std::string& rel) { return fs::path(K3_SOURCE_DIR) / rel; }
std::string nano() { return quote(src("models/k3-nano").string()); }
std::string tiny_chat() { return quote(src("tests/fixtures/tiny-chat").string()); }
fs::path tmp(const std::string& name) {
  return fs::temp_directory_path() / ("k3cons_" + std::to_string(::getpid()) + "_" + name);
}
// `k3 ARGS` with $K3_MODEL unset (or set to `model`).
k3test::CmdResult run_env(const std::string& args, const std::string& model = "") {
  const std::string env = model.empty() ? "env -u K3_MODEL " : "env K3_MODEL=" + quote(model) + " ";
  return run_shell(env + std::string(K3_BIN) + " " + args);
}
size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// Exit 2, exactly one line on stderr, starting with "k3 SUB: error: " and containing `needle`.
void expect_error(const k3test::CmdResult& r, const std::string& sub, const std::string& needle,
                  const std::string& what) {
  EXPECT_EQ(r.code, 2) << what << "\n" << r.err;
  EXPECT_EQ(lines(r.err), 1u) << what << "\n" << r.err;
  EXPECT_EQ(r.err.rfind("k3 " + sub + ": error: ", 0), 0u) << what << "\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << what << "\nstderr: " << r.err;
}

const char* const kSubcommands[] = {"run",    "chat",     "eval",     "bench",     "info",
                                    "logits", "generate", "tokenize", "detokenize"};

}  // namespace

// ---- one help format, one error format

TEST(CliConsistency, HelpFormatIsTheSameForEverySubcommand) {
  for (const char* sub : kSubcommands) {
    const auto r = run_k3(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub << ": " << r.err;
    const std::string name = std::string("k3 ") + sub;
    EXPECT_EQ(r.out.rfind(name + ": ", 0), 0u) << sub << ": " << r.out;
    EXPECT_NE(r.out.find("Usage: " + name + " [OPTIONS]"), std::string::npos) << sub << ": " << r.out;
    EXPECT_NE(r.out.find("\nOptions:\n"), std::string::npos) << sub << ": " << r.out;
    EXPECT_NE(r.out.find("-h,--help"), std::string::npos) << sub << ": " << r.out;
    EXPECT_NE(r.out.find("-m,--model"), std::string::npos) << sub << ": " << r.out;
    EXPECT_NE(r.out.find("default: $K3_MODEL, else the bundled K3-nano"), std::string::npos) << sub << ": " << r.out;
  }
}

TEST(CliConsistency, EveryErrorIsOneLineWithTheSubcommandPrefix) {
  const fs::path text = tmp("text.txt");
  std::ofstream(text) << "Some text to evaluate.";
  for (const char* sub : kSubcommands) {
    // A flag no subcommand has, and a model directory that does not exist (with the flags each
    // subcommand requires, so that the problem tested is the one reported).
    const std::string needs = std::string(sub) == "logits"       ? " --ids 1 -o /tmp/k3cons_unused"
                              : std::string(sub) == "generate"   ? " --ids 1"
                              : std::string(sub) == "tokenize"   ? " --text x"
                              : std::string(sub) == "detokenize" ? " --ids 1"
                              : std::string(sub) == "eval"       ? " -f " + text.string()
                              : std::string(sub) == "run"        ? " x"
                                                                 : "";
    expect_error(run_k3(std::string(sub) + needs + " --frobnicate < /dev/null"), sub, "frobnicate", sub);
    expect_error(run_k3(std::string(sub) + " -m /nonexistent/k3cons" + needs + " < /dev/null"), sub,
                 "/nonexistent/k3cons", std::string(sub) + " -m /nonexistent");
  }
  fs::remove(text);
  // No subcommand: the program's own prefix.
  const auto r = run_k3("frobnicate");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "k3: error: unknown subcommand 'frobnicate' (see k3 --help)\n");
}

// ---- -m defaults: $K3_MODEL, then the bundled model, for every subcommand that reads a model

// The first line of `k3 info` (architecture and the config path it read): the rest includes the
// memory this machine has available, which moves between two runs.
static std::string info_head(const std::string& out) { return out.substr(0, out.find('\n')); }

TEST(CliConsistency, ModelDefaultIsTheSameForEverySubcommand) {
  // info: the bundled model without -m, $K3_MODEL over it, -m over both.
  const auto with_m = run_env("info -m " + nano());
  ASSERT_EQ(with_m.code, 0) << with_m.err;
  EXPECT_NE(with_m.out.find("k3-nano/config.json"), std::string::npos) << with_m.out;
  EXPECT_EQ(info_head(run_env("info").out), info_head(with_m.out));
  const auto tiny = run_env("info -m " + tiny_chat());
  ASSERT_EQ(tiny.code, 0) << tiny.err;
  EXPECT_NE(info_head(tiny.out), info_head(with_m.out));
  EXPECT_EQ(info_head(run_env("info", src("tests/fixtures/tiny-chat").string()).out), info_head(tiny.out));
  EXPECT_EQ(info_head(run_env("info -m " + nano(), src("tests/fixtures/tiny-chat").string()).out),
            info_head(with_m.out));

  // generate / logits: the same ids with and without -m.
  const auto g = run_env("generate --ids 11,220,3300 -n 3 --print-ids");
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(run_env("generate -m " + nano() + " --ids 11,220,3300 -n 3 --print-ids").out, g.out);
  const fs::path a = tmp("logits_a"), b = tmp("logits_b");
  ASSERT_EQ(run_env("logits --ids 11,220 -o " + a.string()).code, 0);
  ASSERT_EQ(run_env("logits -m " + nano() + " --ids 11,220 -o " + b.string()).code, 0);
  EXPECT_EQ(k3test::slurp(a), k3test::slurp(b));
  EXPECT_EQ(fs::file_size(a), 2u * 8448 * 4);
  fs::remove(a);
  fs::remove(b);

  // $K3_MODEL is what bench and eval use without -m too (here: one that does not exist).
  expect_error(run_env("bench -p 8 -n 0", "/nonexistent/k3env"), "bench", "/nonexistent/k3env", "bench");
  const fs::path text = tmp("eval.txt");
  std::ofstream(text) << "Some text to evaluate.";
  expect_error(run_env("eval -f " + text.string(), "/nonexistent/k3env"), "eval", "/nonexistent/k3env", "eval");
  fs::remove(text);
  expect_error(run_env("generate --ids 1", "/nonexistent/k3env"), "generate", "/nonexistent/k3env", "generate");

  // tokenize / detokenize: -m (default as above), --vocab (the older spelling), --tokenizer.
  const auto t = run_env("tokenize --text 'The function returns'");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_EQ(run_env("tokenize -m " + nano() + " --text 'The function returns'").out, t.out);
  EXPECT_EQ(run_env("tokenize --vocab " + nano() + " --text 'The function returns'").out, t.out);
  EXPECT_EQ(run_env("tokenize -m " + tiny_chat() + " --tokenizer " + nano() + " --text 'The function returns'").out,
            t.out);
  std::string ids = t.out.substr(0, t.out.size() - 1);
  const auto d = run_env("detokenize --ids " + quote(ids));
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_EQ(d.out, "The function returns\n");
  EXPECT_EQ(run_env("detokenize -m " + nano() + " --ids " + quote(ids)).out, d.out);
}

// ---- context limits: generate and logits refuse as run / eval / bench do; info says so

TEST(CliConsistency, GenerateAndLogitsRefusePastMaxPositions) {
  // K3-nano: max_position_embeddings 4096.
  expect_error(run_k3("generate -m " + nano() + " --ids 1 -n 5000"), "generate",
               "--ids: prompt 1 + generated 5000 = 5001 tokens exceeds the model's max_position_embeddings (4096)",
               "generate");
  expect_error(run_k3("generate -m " + nano() + " --ids 1,2 -n 4095"), "generate", "4097 tokens exceeds", "edge");
  const fs::path ids = tmp("ids"), lines_file = tmp("ids_lines");
  {
    std::ofstream f(ids);
    for (int i = 0; i < 4097; ++i) f << (i ? "," : "") << (i % 100 + 1);
  }
  expect_error(run_k3("logits -m " + nano() + " --ids @" + ids.string() + " -o /tmp/k3cons_unused"), "logits",
               "the prompt is 4097 tokens, which exceeds the model's max_position_embeddings (4096)", "logits");
  {
    std::ofstream f(lines_file);
    f << "1,2\n" << k3test::slurp(ids) << "\n";
  }
  expect_error(run_k3("generate -m " + nano() + " --ids-file " + lines_file.string() + " -n 1"), "generate",
               lines_file.string() + ":2: prompt 4097 + generated 1", "ids-file");
  fs::remove(ids);
  fs::remove(lines_file);
}

TEST(CliConsistency, InfoSaysWhenRunWouldRefuseTheContext) {
  const auto r = run_k3("info -m " + nano() + " --ctx 100000");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string refused =
      "refused: --ctx 100000 exceeds the model's max_position_embeddings (4096); k3 run, chat and eval refuse it";
  EXPECT_NE(r.out.find("memory to run at 100000 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  " + refused + "\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("(fits)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("does NOT fit"), std::string::npos) << r.out;
  // ... and run does refuse it, naming the same limit.
  expect_error(run_k3("run -m " + nano() + " -q --ctx 100000 x"), "run", "max_position_embeddings (4096)", "run");
  // At the limit nothing is refused.
  const auto ok = run_k3("info -m " + nano() + " --ctx 4096");
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(ok.out.find("refused"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("this machine: "), std::string::npos) << ok.out;
  // A config alone (no weights) says it too.
  const auto cfg = run_k3("info -m " + quote(src("tests/fixtures/k3-config-only").string()) + " --ctx 2000000");
  ASSERT_EQ(cfg.code, 0) << cfg.err;
  EXPECT_NE(cfg.out.find("context: refused: --ctx 2000000 exceeds the model's max_position_embeddings (1048576)"),
            std::string::npos)
      << cfg.out;
}

// ---- generate: --greedy is the default

TEST(CliConsistency, GenerateIsGreedyWithoutTheFlag) {
  const std::string base = "generate -m " + nano() + " --ids 11,220,3300,4,57 -n 6 --print-ids";
  const auto a = run_k3(base), b = run_k3(base + " --greedy");
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(lines(a.out), 1u);
}

// ---- --stop takes one value per occurrence

TEST(CliConsistency, StopDoesNotSwallowThePrompt) {
  const std::string base = "run -m " + nano() + " -q --seed 2 -n 12 --ignore-eos ";
  const auto ref = run_k3(base + "--stop . -p 'The function returns'");
  ASSERT_EQ(ref.code, 0) << ref.err;
  for (const char* form :
       {"--stop . 'The function returns'", "--stop=. 'The function returns'", "'The function returns' --stop ."}) {
    const auto r = run_k3(base + form);
    EXPECT_EQ(r.code, 0) << form << ": " << r.err;
    EXPECT_EQ(r.out, ref.out) << form;
    EXPECT_NE(r.err.find("prompt 3 tok"), std::string::npos) << form << ": " << r.err;
  }
  // Repeatable: every occurrence is a stop sequence of its own.
  const auto two = run_k3(base + "--stop xyzzy --stop . 'The function returns'");
  EXPECT_EQ(two.code, 0) << two.err;
  EXPECT_EQ(two.out, ref.out);
  // Without a value it is a usage error, not the prompt.
  expect_error(run_k3(base + "--stop"), "run", "--stop", "--stop without a value");
}

// ---- --seed: negative seeds are refused

TEST(CliConsistency, NegativeAndOutOfRangeSeedsAreRefused) {
  for (const char* sub : {"run", "chat"}) {
    const std::string base = std::string(sub) + " -m " + tiny_chat() + " -q -n 2 ";
    const std::string end = std::string(sub) == "run" ? " x" : " < /dev/null";
    expect_error(run_k3(base + "--seed -1" + end), sub, "--seed: '-1' is negative", "-1");
    expect_error(run_k3(base + "--seed=-5" + end), sub, "'-5' is negative", "-5");
    expect_error(run_k3(base + "--seed 1.5" + end), sub, "'1.5' is not a whole number", "1.5");
    expect_error(run_k3(base + "--seed 18446744073709551616" + end), sub, "is too large", "2^64");
  }
  const auto max = run_k3("run -m " + tiny_chat() + " -q -n 2 --seed 18446744073709551615 x");
  EXPECT_EQ(max.code, 0) << max.err;
  EXPECT_NE(max.err.find("seed 18446744073709551615"), std::string::npos) << max.err;
  expect_error(run_k3("bench -m " + tiny_chat() + " --seed -1"), "bench", "--seed: '-1' is negative", "bench");
}

// ---- UTF-8 prompts

TEST(CliConsistency, InvalidUtf8PromptsAreRefusedWithTheOffset) {
  const fs::path bad = tmp("bad.txt"), lone = tmp("lone.txt"), chat_in = tmp("chat.txt");
  std::ofstream(bad, std::ios::binary) << "The function \xC3\x28 returns";  // C3 needs a continuation
  std::ofstream(lone, std::ios::binary) << "\x80"
                                        << "abc";  // a lone continuation byte
  const std::string base = "run -m " + tiny_chat() + " -q -n 2 --seed 1 ";
  expect_error(run_k3(base + "-f " + bad.string()), "run",
               "the prompt in " + bad.string() + " is not valid UTF-8: malformed sequence at byte offset 13 (0xC3)",
               "-f");
  expect_error(run_k3(base + "< " + lone.string()), "run", "byte offset 0 (0x80)", "stdin");
  expect_error(run_k3(base + "-f - < " + lone.string()), "run", "byte offset 0 (0x80)", "-f -");
  expect_error(run_k3(base + "\"$(cat " + bad.string() + ")\""), "run", "byte offset 13", "argument");
  expect_error(run_k3(base + "-p \"$(cat " + bad.string() + ")\""), "run", "byte offset 13", "-p");
  // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8 either.
  for (const std::string& s : {std::string("\xC0\xAF"), std::string("ab\xED\xA0\x80"), std::string("\xF4\x90\x80\x80"),
                               std::string("abc\xE2\x82")}) {
    std::ofstream(bad, std::ios::binary) << s;
    const auto r = run_k3(base + "-f " + bad.string());
    expect_error(r, "run", "is not valid UTF-8", "bytes of length " + std::to_string(s.size()));
  }
  // Valid multibyte text (2, 3 and 4 bytes) passes.
  std::ofstream(bad, std::ios::binary) << "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x99\x82";
  EXPECT_EQ(run_k3(base + "-f " + bad.string()).code, 0);
  // Chat: a message line, and the system prompt.
  std::ofstream(chat_in, std::ios::binary) << "hello \xFF there\n";
  expect_error(run_k3("chat -m " + tiny_chat() + " -q -n 2 --seed 1 < " + chat_in.string()), "chat",
               "the message is not valid UTF-8: malformed sequence at byte offset 6 (0xFF)", "chat line");
  expect_error(run_k3("chat -m " + tiny_chat() + " -q -n 2 --system-file " + lone.string() + " < /dev/null"), "chat",
               "the system prompt in " + lone.string() + " is not valid UTF-8", "system");
  fs::remove(bad);
  fs::remove(lone);
  fs::remove(chat_in);
}

// ---- tokenize --file - reads stdin

TEST(CliConsistency, TokenizeFileDashReadsStdin) {
  const fs::path f = tmp("text.txt");
  std::ofstream(f, std::ios::binary) << "Once upon a time\nthere was a river";
  const auto from_file = run_k3("tokenize -m " + nano() + " --file " + f.string());
  ASSERT_EQ(from_file.code, 0) << from_file.err;
  EXPECT_EQ(run_k3("tokenize -m " + nano() + " --file - < " + f.string()).out, from_file.out);
  EXPECT_EQ(run_k3("tokenize -m " + nano() + " -f - < " + f.string()).out, from_file.out);
  EXPECT_EQ(run_shell("cat " + f.string() + " | " + std::string(K3_BIN) + " tokenize -m " + nano() + " -f -").out,
            from_file.out);
  expect_error(run_k3("tokenize -m " + nano() + " < " + f.string()), "tokenize", "--text T or --file F", "no text");
  expect_error(run_k3("tokenize -m " + nano() + " --text a --file -"), "tokenize", "excludes", "both");
  fs::remove(f);
}

// ---- progress: the percentage is the one of the count printed beside it

TEST(CliConsistency, ProgressPercentageMatchesTheCount) {
  std::string prompt;
  for (int i = 0; i < 120; ++i) prompt += "The function returns a value. ";
  const fs::path f = tmp("long.txt");
  std::ofstream(f) << prompt;
  const auto r = run_k3("run -m " + nano() + " -n 1 --seed 1 --ubatch 64 -f " + f.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const std::regex line("k3 run: prefill: (\\d+)% (\\d+)/(\\d+) tokens");
  size_t seen = 0;
  for (auto it = std::sregex_iterator(r.err.begin(), r.err.end(), line); it != std::sregex_iterator(); ++it) {
    const long pct = std::stol((*it)[1]), done = std::stol((*it)[2]), total = std::stol((*it)[3]);
    EXPECT_EQ(pct, done * 100 / total) << (*it)[0];
    ++seen;
  }
  EXPECT_GE(seen, 3u) << r.err;  // a line per quarter passed, the last at 100%
  EXPECT_NE(r.err.find("100% "), std::string::npos) << r.err;
  fs::remove(f);
}

// ---- a checkpoint far from its config: the problem list is capped

TEST(CliConsistency, ManyProblemsAreCappedInOneLine) {
  const fs::path dir = tmp("mismatch");
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(src("models/k3-nano")))
    if (e.path().filename() != "config.json") fs::create_symlink(e.path(), dir / e.path().filename());
  nlohmann::json j;
  {
    std::ifstream in(src("models/k3-nano/config.json"));
    j = nlohmann::json::parse(in);
  }
  // Every dense MLP and expert tensor is now mis-shaped: over a thousand problems.
  j["text_config"]["intermediate_size"] = 1792;
  j["text_config"]["moe_intermediate_size"] = 640;
  std::ofstream(dir / "config.json") << j.dump(1);
  const auto r = run_k3("generate -m " + quote(dir.string()) + " --ids 1 -n 1");
  expect_error(r, "generate", "checkpoint does not match config: ", "mismatch");
  EXPECT_TRUE(std::regex_search(r.err, std::regex("\\d+ problems: "))) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex("; and \\d+ more\n$"))) << r.err;
  EXPECT_LT(r.err.size(), 2000u) << r.err.size();
  fs::remove_all(dir);
}

// ---- CUDA libraries: never loaded by a process that stays on the CPU

TEST(CliConsistency, CpuProcessesDoNotLoadCublas) {
  // In a K3_CUDA build the binary does not link cuBLAS (ops/cuda/cublas_lazy.cpp opens it for
  // --device cuda); in a CPU-only build this holds trivially.
  const auto needed = run_shell("readelf -d " + std::string(K3_BIN));
  if (needed.code == 0) {
    EXPECT_EQ(needed.out.find("libcublas"), std::string::npos) << needed.out;
  }
  for (const std::string& args :
       {"tokenize -m " + nano() + " --text hi", "info -m " + nano(), "run -m " + nano() + " -q -n 2 --seed 1 hi",
        "generate -m " + nano() + " --ids 1 -n 2"}) {
    const auto r = run_shell("LD_DEBUG=libs " + std::string(K3_BIN) + " " + args);
    EXPECT_EQ(r.code, 0) << args << "\n" << r.err.substr(r.err.size() > 2000 ? r.err.size() - 2000 : 0);
    EXPECT_NE(r.err.find("calling init"), std::string::npos) << "LD_DEBUG had no effect";
    EXPECT_EQ(r.err.find("libcublas"), std::string::npos) << args;
    EXPECT_EQ(r.err.find("libcudart.so"), std::string::npos) << args;
  }
}
