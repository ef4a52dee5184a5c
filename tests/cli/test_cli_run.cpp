// `k3 run`, `k3 chat`, `k3 info --ctx` and --help of every subcommand, driven as a user would, on
// the tiny-chat checkpoint (tiny K3 + test tokenizer + generation_config.json). Also a tmux
// session that types into `k3 chat` and reads the screen.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

std::string model() { return quote((fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny-chat").string()); }
fs::path tmp(const std::string& name) {
  return fs::temp_directory_path() / ("k3run_" + std::to_string(::getpid()) + "_" + name);
}

size_t count_lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// Exit 2 and exactly one line on stderr that contains `needle`.
void expect_one_line_error(const std::string& args, const std::string& needle) {
  const auto r = run_k3(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(count_lines(r.err), 1u) << args << "\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
}

std::vector<std::string> split_ws(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> v;
  for (std::string w; in >> w;) v.push_back(w);
  return v;
}

}  // namespace

TEST(Run, GreedyTextEqualsGreedyIdsDetokenized) {
  // The streamed text is the in-order decoding of the tokens `generate` picks for the same prompt.
  const std::string prompt = "Once upon a time";
  const auto toks = run_k3("tokenize --vocab " + model() + " --text " + quote(prompt));
  ASSERT_EQ(toks.code, 0) << toks.err;
  const auto ids = split_ws(toks.out);
  std::string csv;
  for (size_t i = 0; i < ids.size(); ++i) csv += (i ? "," : "") + ids[i];
  const auto gen = run_k3("generate -m " + model() + " --ids " + csv + " -n 20 --greedy --print-ids");
  ASSERT_EQ(gen.code, 0) << gen.err;
  // --special prints every token (so the comparison covers special ids too); --ignore-eos keeps 20.
  // Exact numerics: generate (a reference tool) always computes in the exact mode.
  const auto run =
      run_k3("run -m " + model() + " --numerics exact --temp 0 --special --ignore-eos -n 20 -q " + quote(prompt));
  ASSERT_EQ(run.code, 0) << run.err;
  std::string gen_csv;
  for (const auto& w : split_ws(gen.out)) gen_csv += (gen_csv.empty() ? "" : " ") + w;
  const auto det = run_k3("detokenize --vocab " + model() + " --ids " + quote(gen_csv));
  ASSERT_EQ(det.code, 0) << det.err;
  EXPECT_EQ(run.out, det.out.substr(0, det.out.size() - (det.out.ends_with("\n") ? 1 : 0)));
  // The summary: one line on stderr with the counts and the stop reason.
  EXPECT_NE(run.err.find("prompt " + std::to_string(ids.size()) + " tok | generated 20 tok"), std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("stop: max-tokens"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("decode "), std::string::npos);
  EXPECT_NE(run.err.find("peak RSS"), std::string::npos);
}

TEST(Run, SeedDeterminismAndGenerationConfigDefaults) {
  const std::string base = "run -m " + model() + " -n 24 --ignore-eos -q -p 'The river' ";
  const auto a = run_k3(base + "--seed 7"), b = run_k3(base + "--seed 7"), c = run_k3(base + "--seed 8");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
  EXPECT_NE(a.err.find("seed 7"), std::string::npos);
  const auto v = run_k3(base + "--seed 7 -v --top-k 5");
  EXPECT_NE(v.err.find("generation_config.json"), std::string::npos) << v.err;
  EXPECT_NE(v.err.find("temp 0.8"), std::string::npos) << v.err;  // from generation_config.json
  EXPECT_NE(v.err.find("top-k 5"), std::string::npos) << v.err;   // the flag wins
  EXPECT_NE(v.err.find("top-p 0.95"), std::string::npos) << v.err;
}

TEST(Run, StopSequenceCutsTheOutput) {
  const std::string base = "run -m " + model() + " --temp 0 --ignore-eos -n 40 -q -p 'A list of things:' ";
  const auto full = run_k3(base);
  ASSERT_EQ(full.code, 0) << full.err;
  ASSERT_GT(full.out.size(), 24u);
  // A stop string taken from the middle of the output: printing ends right before its first
  // occurrence, and the summary names the reason.
  size_t at = full.out.size() / 2;
  while (at < full.out.size() && (static_cast<unsigned char>(full.out[at]) & 0xC0) == 0x80) ++at;  // a character start
  std::string stop = full.out.substr(at, 3);
  while (!stop.empty() && (static_cast<unsigned char>(stop.back()) & 0x80)) stop.pop_back();
  if (stop.size() < 1) stop = full.out.substr(at, 1);
  const auto r = run_k3(base + "--stop " + quote(stop));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, full.out.substr(0, full.out.find(stop))) << "stop=" << stop;
  EXPECT_NE(r.err.find("stop: stop-sequence"), std::string::npos) << r.err;
}

TEST(Run, PromptFromFileAndStdinAndEcho) {
  const fs::path f = tmp("prompt.txt");
  std::ofstream(f) << "The river";
  const std::string flags = " -m " + model() + " --temp 0 -n 8 --ignore-eos -q";
  const auto a = run_k3("run" + flags + " -f " + f.string());
  const auto b = run_k3("run" + flags + " < " + f.string());
  const auto c = run_k3("run" + flags + " -f - < " + f.string());
  const auto d = run_k3("run" + flags + " 'The river'");
  const auto e = run_k3("run" + flags + " --echo 'The river'");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out, c.out);
  EXPECT_EQ(a.out, d.out);
  EXPECT_EQ(e.out, "The river" + a.out);
  fs::remove(f);
}

TEST(Run, CtrlCStopsCleanlyWithSummary) {
  // SIGINT after 1.5 s into an endless generation: exit 130, summary line, stop: interrupted.
  // (A fast machine can fill the tiny model's 4096-token context first: then exit 0, stop: context-full.)
  const auto r = k3test::run_shell("timeout --foreground --preserve-status -s INT 1.5 " + std::string(K3_BIN) +
                                   " run -m " + model() + " --ignore-eos -n 100000000 -q 'x'");
  EXPECT_NE(r.err.find("stop: "), std::string::npos) << r.err;
  const bool interrupted = r.err.find("stop: interrupted") != std::string::npos;
  EXPECT_TRUE(interrupted || r.err.find("stop: context-full") != std::string::npos) << r.err;
  EXPECT_EQ(r.code, interrupted ? 130 : 0) << r.err;
}

TEST(Run, BadInputIsOneLineAndExit2) {
  const std::string m = " -m " + model() + " -q ";
  expect_one_line_error("run -m /nonexistent/dir x", "/nonexistent/dir");
  expect_one_line_error("run" + m + "--top-p 1.5 x", "top-p");
  expect_one_line_error("run" + m + "--temp -1 x", "temp");
  expect_one_line_error("run" + m + "--min-p 2 x", "min-p");
  expect_one_line_error("run" + m + "--top-k -3 x", "top-k");
  expect_one_line_error("run" + m + "--bogus x", "bogus");
  expect_one_line_error("run" + m + "-p a b", "one way");
  expect_one_line_error("run" + m + "-p ''", "empty");
  expect_one_line_error("run" + m + "--mem-limit 1M x", "--mem-limit");
  expect_one_line_error("run" + m + "--mem-limit lots x", "--mem-limit");
  expect_one_line_error("run" + m + "-f /nonexistent/prompt.txt", "prompt file");
  expect_one_line_error("run" + m + "--ctx 999999999 x", "max_position_embeddings");
  expect_one_line_error("run -m " + quote((fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny").string()) + " x",
                        "tiktoken.model");
  expect_one_line_error("chat" + m + "--reasoning-effort extreme < /dev/null", "reasoning-effort");
  expect_one_line_error("chat" + m + "--tools /nonexistent.json < /dev/null", "nonexistent.json");
  expect_one_line_error("chat" + m + "--load /nonexistent.k3chat < /dev/null", "nonexistent.k3chat");
}

TEST(Cli, HelpForEverySubcommand) {
  for (const char* sub : {"run", "chat", "eval", "bench", "info", "logits", "generate", "tokenize", "detokenize"}) {
    const auto r = run_k3(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub << ": " << r.err;
    EXPECT_NE((r.out + r.err).find("--"), std::string::npos) << sub;
  }
  const auto top = run_k3("--help");
  for (const char* sub : {"run", "chat", "bench", "info", "tokenize"}) EXPECT_NE(top.out.find(sub), std::string::npos);
}

TEST(Info, MemoryForAContext) {
  const auto a = run_k3("info -m " + model() + " --ctx 1000"), b = run_k3("info -m " + model() + " --ctx 2000");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_NE(a.out.find("memory to run at 1000 tokens"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("MLA cache 625.00 KiB"), std::string::npos) << a.out;  // 1000 x 4 layers x 40 x 4 B
  EXPECT_NE(b.out.find("MLA cache 1.22 MiB"), std::string::npos) << b.out;
}

// ---- chat through pipes

TEST(Chat, ScriptedTurnsSaveAndLoadRoundTrip) {
  const fs::path save = tmp("s.k3chat"), in1 = tmp("in1.txt"), in2 = tmp("in2.txt");
  std::ofstream(in1) << "Hello there\n/save " << save.string() << "\nWhat next?\n";
  std::ofstream(in2) << "/load " << save.string() << "\nWhat next?\n";
  const std::string base = "chat -m " + model() + " --seed 3 -n 10 -q --system 'Be brief.' ";
  const auto a = run_k3(base + "< " + in1.string());
  ASSERT_EQ(a.code, 0) << a.err;
  const auto b = run_k3(base + "< " + in2.string());
  ASSERT_EQ(b.code, 0) << b.err;
  // The reply to "What next?" is the same whether the chat continued or was reloaded from disk.
  const auto second_reply = [](const std::string& out) {
    const size_t p =
        out.find("]\n", out.find("[saved to") != std::string::npos ? out.find("[saved to") : out.find("[loaded"));
    return out.substr(p + 2);
  };
  EXPECT_EQ(second_reply(a.out), second_reply(b.out)) << a.out << "\n----\n" << b.out;
  EXPECT_NE(a.out.find("[thinking]"), std::string::npos) << a.out;
  EXPECT_NE(b.out.find("[loaded " + save.string() + ": 3 messages"), std::string::npos) << b.out;
  EXPECT_NE(a.err.find("stop: "), std::string::npos);  // session summary
  // Scripts fail fast on a bad command.
  std::ofstream(in2) << "/frobnicate\n";
  const auto c = run_k3(base + "< " + in2.string());
  EXPECT_EQ(c.code, 2);
  EXPECT_NE(c.err.find("unknown command /frobnicate"), std::string::npos) << c.err;
  fs::remove(save);
  fs::remove(in1);
  fs::remove(in2);
}

// ---- chat in a terminal, as a person uses it

namespace {
struct Tmux {
  std::string sock;
  explicit Tmux(const std::string& tag) : sock("k3test_" + tag + "_" + std::to_string(::getpid())) {}
  ~Tmux() { k3test::run_shell("tmux -L " + sock + " kill-server"); }
  int cmd(const std::string& c) { return k3test::run_shell("tmux -L " + sock + " " + c).code; }
  std::string screen() { return k3test::run_shell("tmux -L " + sock + " capture-pane -p -t k3").out; }
  // Polls the screen until `pred` holds (up to `secs`).
  bool wait_for(const std::function<bool(const std::string&)>& pred, double secs) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < secs) {
      if (pred(screen())) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
};
// Why these tests cannot run here ("" when they can): tmux missing, or unable to start a server at
// all (seen in a container without a terminal setup: the GPU machine's host).
std::string tmux_unusable() {
  if (k3test::run_shell("command -v tmux").code != 0) return "tmux is not installed (scripts/deps.txt lists it)";
  const std::string sock = "k3test_probe_" + std::to_string(::getpid());
  const auto r = k3test::run_shell("tmux -L " + sock + " new-session -d true 2>&1");
  k3test::run_shell("tmux -L " + sock + " kill-server 2>/dev/null");
  if (r.code == 0) return "";
  std::string first = r.out.substr(0, r.out.find('\n'));
  return "tmux cannot start a session on this machine (" + (first.empty() ? "no message" : first) + ")";
}
// Lines that start with the chat prompt ">" (capture-pane trims the space after it).
size_t prompts(const std::string& screen) {
  std::istringstream in(screen);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty() && line[0] == '>';
  return n;
}
}  // namespace

TEST(Chat, TmuxSessionTypeAndReadTheScreen) {
  if (const std::string why = tmux_unusable(); !why.empty()) GTEST_SKIP() << why;
  Tmux t("chat");
  const fs::path save = tmp("tmux.k3chat");
  const fs::path status = tmp("tmux.status");
  const std::string cmd = std::string(K3_BIN) + " chat -m " + model() + " --seed 1 -n 12 --stats; echo EXIT=$? > " +
                          status.string() + "; sleep 30";
  ASSERT_EQ(t.cmd("new-session -d -s k3 -x 160 -y 50 " + quote(cmd)), 0);
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return prompts(s) >= 1; }, 60)) << t.screen();
  EXPECT_NE(t.screen().find("/help for commands"), std::string::npos) << t.screen();
  EXPECT_NE(t.screen().find("k3 chat: loading [##############################] 100%"), std::string::npos) << t.screen();
  t.cmd("send-keys -t k3 -l 'Hello, who are you?'");
  t.cmd("send-keys -t k3 Enter");
  // The reply is shown as a thinking section, then the prompt returns.
  ASSERT_TRUE(
      t.wait_for([](const std::string& s) { return prompts(s) >= 2 && s.find("[thinking]") != std::string::npos; }, 60))
      << t.screen();
  const std::string s1 = t.screen();
  EXPECT_NE(s1.find("> Hello, who are you?"), std::string::npos) << s1;
  EXPECT_NE(s1.find("decode "), std::string::npos) << s1;  // --stats line
  t.cmd("send-keys -t k3 -l '/save " + save.string() + "'");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return s.find("[saved to") != std::string::npos; }, 30))
      << t.screen();
  t.cmd("send-keys -t k3 -l '/help'");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return s.find("/reset") != std::string::npos; }, 30)) << t.screen();
  t.cmd("send-keys -t k3 -l '/exit'");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([&](const std::string&) { return fs::exists(status) && fs::file_size(status) > 0; }, 30))
      << t.screen();
  EXPECT_EQ(k3test::slurp(status), "EXIT=0\n");
  EXPECT_TRUE(fs::exists(save));
  fs::remove(save);
  fs::remove(status);
}

TEST(Chat, TmuxCtrlCStopsAReplyThenCtrlDLeaves) {
  if (const std::string why = tmux_unusable(); !why.empty()) GTEST_SKIP() << why;
  Tmux t("intr");
  const fs::path status = tmp("intr.status");
  const std::string cmd = std::string(K3_BIN) + " chat -m " + model() +
                          " --seed 2 -n 1000000 --no-color; echo EXIT=$? > " + status.string() + "; sleep 30";
  ASSERT_EQ(t.cmd("new-session -d -s k3 -x 160 -y 50 " + quote(cmd)), 0);
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return prompts(s) >= 1; }, 60)) << t.screen();
  t.cmd("send-keys -t k3 -l 'Tell me a very long story.'");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return s.find("[thinking]") != std::string::npos; }, 60))
      << t.screen();
  t.cmd("send-keys -t k3 C-c");
  ASSERT_TRUE(t.wait_for(
      [](const std::string& s) { return s.find("[interrupted]") != std::string::npos && prompts(s) >= 2; }, 30))
      << t.screen();
  t.cmd("send-keys -t k3 C-d");
  ASSERT_TRUE(t.wait_for([&](const std::string&) { return fs::exists(status) && fs::file_size(status) > 0; }, 30))
      << t.screen();
  EXPECT_EQ(k3test::slurp(status), "EXIT=0\n");
  EXPECT_NE(t.screen().find("k3 chat: prompt"), std::string::npos) << t.screen();  // the closing summary
  fs::remove(status);
}

TEST(Chat, TmuxLineEditingHistoryAndCtrlCAtThePrompt) {
  // libedit at a terminal: the cursor keys edit the line, Up recalls the last one, Ctrl-C at the
  // prompt leaves with the summary.
  if (const std::string why = tmux_unusable(); !why.empty()) GTEST_SKIP() << why;
  Tmux t("edit");
  const fs::path status = tmp("edit.status");
  const std::string cmd = std::string(K3_BIN) + " chat -m " + model() + " --seed 1 -n 4 --no-color; echo EXIT=$? > " +
                          status.string() + "; sleep 30";
  ASSERT_EQ(t.cmd("new-session -d -s k3 -x 160 -y 50 " + quote(cmd)), 0);
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return prompts(s) >= 1; }, 60)) << t.screen();
  const auto help_shown = [](const std::string& s) {
    size_t n = 0;
    for (size_t at = s.find("/reset "); at != std::string::npos; at = s.find("/reset ", at + 1)) ++n;
    return n;
  };
  // "/hlp", two steps left, "e": "/help" (without line editing the escape sequences would be sent).
  t.cmd("send-keys -t k3 -l '/hlp'");
  t.cmd("send-keys -t k3 Left Left");
  t.cmd("send-keys -t k3 -l 'e'");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([&](const std::string& s) { return help_shown(s) == 1; }, 30)) << t.screen();
  EXPECT_EQ(t.screen().find("unknown command"), std::string::npos) << t.screen();
  // Up: the line before, again.
  t.cmd("send-keys -t k3 Up");
  t.cmd("send-keys -t k3 Enter");
  ASSERT_TRUE(t.wait_for([&](const std::string& s) { return help_shown(s) == 2; }, 30)) << t.screen();
  // Ctrl-C with half a line typed: leaves, exit 0, with the closing summary.
  t.cmd("send-keys -t k3 -l 'half a li'");
  t.cmd("send-keys -t k3 C-c");
  ASSERT_TRUE(t.wait_for([&](const std::string&) { return fs::exists(status) && fs::file_size(status) > 0; }, 30))
      << t.screen();
  EXPECT_EQ(k3test::slurp(status), "EXIT=0\n");
  EXPECT_NE(t.screen().find("k3 chat: prompt"), std::string::npos) << t.screen();
  fs::remove(status);
}

TEST(Chat, ReasoningEffortNoneOpensTheAnswer) {
  const fs::path in = tmp("effort.txt");
  std::ofstream(in) << "Hi\n";
  const auto r = run_k3("chat -m " + model() + " --seed 4 -n 6 -q --reasoning-effort none < " + in.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("[answer]"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[thinking]"), std::string::npos) << r.out;
  const auto t = run_k3("chat -m " + model() + " --seed 4 -n 6 -q --reasoning-effort high < " + in.string());
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("[thinking]"), std::string::npos) << t.out;
  fs::remove(in);
}

TEST(Run, LoadingProgressAndLoadedLine) {
  // stderr is a file here: plain progress lines (a terminal gets one redrawn bar, see the tmux test).
  const auto r = run_k3("run -m " + model() + " -n 2 --seed 1 x");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("k3 run: loading: 100%"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("k3 run: loaded "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\r'), std::string::npos);
  const auto q = run_k3("run -m " + model() + " -n 2 --seed 1 -q x");
  EXPECT_EQ(q.err.find("loading"), std::string::npos) << q.err;
}
