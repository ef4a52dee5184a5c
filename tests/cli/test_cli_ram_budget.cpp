// `--ram-budget` / `--direct-io` driven as a user would, on tiny-chat (MXFP4 experts, 1.73 MiB of
// trunk, 306 KiB of routed experts): greedy `k3 run` prints the same text with the experts
// streamed through a cache far smaller than they are (buffered and O_DIRECT), the summary line
// reports the expert reads, `k3 eval` gives the same perplexity, `k3 chat` works, and budgets too
// small or malformed are one line with exit code 2.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

std::string model() { return quote((fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny-chat").string()); }
fs::path tmp(const std::string& name) {
  return fs::temp_directory_path() / ("k3rb_" + std::to_string(::getpid()) + "_" + name);
}
size_t count_lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// Trunk 1,809,104 B + 3 experts (top_k) of one 4 KiB slot each = 1,821,392 B at the least;
// 1.75 MiB leaves a 24 KiB cache (6 of the 96 experts).
constexpr const char* kBudget = "1.75M";

void expect_one_line_error(const std::string& args, const std::string& needle) {
  const auto r = run_k3(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(count_lines(r.err), 1u) << args << "\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
}

}  // namespace

TEST(RamBudget, GreedyRunPrintsTheSameText) {
  // Exact numerics: Fast rounds activations only in GEMMs of >= 4 rows, so --ubatch 3 would change
  // the arithmetic (and this random fixture amplifies any change); streaming must change nothing.
  const std::string base = "run -m " + model() + " --numerics exact --temp 0 --ignore-eos -n 32 ";
  const std::string prompt = quote("Once upon a time, in a land far away");
  const auto ref = run_k3(base + "-q " + prompt);
  ASSERT_EQ(ref.code, 0) << ref.err;
  ASSERT_FALSE(ref.out.empty());
  EXPECT_EQ(ref.err.find("experts:"), std::string::npos) << ref.err;  // no budget, no expert figures
  for (const std::string extra : {"", " --direct-io", " --ubatch 3"}) {
    const auto r = run_k3(base + "--ram-budget " + kBudget + extra + " " + prompt);
    ASSERT_EQ(r.code, 0) << extra << "\n" << r.err;
    EXPECT_EQ(r.out, ref.out) << extra;
    // The loading line names the split, the summary line (the last) the reads.
    EXPECT_NE(r.err.find("trunk 1.73 MiB resident; routed experts 306.00 KiB streamed through a 24.00 KiB cache"),
              std::string::npos)
        << r.err;
    const std::string last = r.err.substr(r.err.rfind('\n', r.err.size() - 2) + 1);
    EXPECT_NE(last.find("k3 run: prompt "), std::string::npos) << last;
    EXPECT_NE(last.find("| experts: read "), std::string::npos) << last;
    EXPECT_NE(last.find(" decode, hit "), std::string::npos) << last;
    EXPECT_NE(last.find(" evictions"), std::string::npos) << last;
  }
  // Decode reads top_k experts per MoE layer per token when nothing is cached across tokens:
  // 12 layers x 3 x 3,264 B = 114.75 KiB per token (6 slots < 8 experts of a layer: LRU misses all).
  const auto r = run_k3(base + "-q -v --ram-budget " + kBudget + " " + prompt);
  EXPECT_NE(r.err.find("114.75 KiB/tok decode"), std::string::npos) << r.err;
  // -v: the exact counts; 31 tokens fed in decode (the 32nd is sampled, never fed).
  EXPECT_NE(r.err.find("expert cache 24576 bytes (6 slots of 4096) for 313344 bytes of experts"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("decode 31 tok: " + std::to_string(31 * 12 * 3 * 3264) + " bytes read"), std::string::npos)
      << r.err;
  // A budget above the model size streams too, and reads each expert at most once.
  const auto big = run_k3(base + "-q --ram-budget 1G " + prompt);
  ASSERT_EQ(big.code, 0) << big.err;
  EXPECT_EQ(big.out, ref.out);
  EXPECT_NE(big.err.find(" 0 evictions"), std::string::npos) << big.err;
}

TEST(RamBudget, EvalAndChatRunUnderABudget) {
  const fs::path text = tmp("text.txt");
  std::ofstream(text) << "The quick brown fox jumps over the lazy dog. Once upon a time there was a river "
                         "that ran through a quiet valley, and people came from far away to see it.\n";
  const std::string ev = "eval -m " + model() + " -q -t 1 -f " + text.string() + " --ctx 16 --stride 8";
  const auto a = run_k3(ev), b = run_k3(ev + " --ram-budget " + kBudget);
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  const auto ppl = [](const std::string& out) {
    return out.substr(0, out.find(" | "));
  };  // "perplexity X over N tokens ..."
  EXPECT_EQ(ppl(a.out), ppl(b.out));

  const fs::path in = tmp("chat.txt");
  std::ofstream(in) << "Hello there\n";
  const std::string ch = "chat -m " + model() + " --seed 3 -n 10 -q < " + in.string();
  const auto c = run_k3(ch);
  ASSERT_EQ(c.code, 0) << c.err;
  const auto e = run_k3("chat --ram-budget " + std::string(kBudget) + ch.substr(4));
  ASSERT_EQ(e.code, 0) << e.err;
  EXPECT_EQ(c.out, e.out);
  EXPECT_NE(e.err.find("| experts: read "), std::string::npos) << e.err;
  expect_one_line_error("eval -m " + model() + " --ram-budget 12Q -f " + text.string(),
                        "--ram-budget must be a size like");
  fs::remove(text);
  fs::remove(in);
}

TEST(RamBudget, TooSmallOrMalformedBudgetsAreOneLine) {
  const std::string base = "run -m " + model() + " --temp 0 -n 4 ";
  expect_one_line_error(base + "--ram-budget 1.7M x", "--ram-budget 1.70 MiB is too small");
  expect_one_line_error(base + "--ram-budget 1.7M x", "the smallest budget is 1.74 MiB (1821392 bytes)");
  expect_one_line_error(base + "--ram-budget 1821391 x", "too small");
  expect_one_line_error(base + "--ram-budget 100K x", "resident trunk takes 1.73 MiB");
  expect_one_line_error(base + "--ram-budget abc x", "--ram-budget must be a size like");
  expect_one_line_error(base + "--ram-budget 0 x", "--ram-budget must be a size like");
  expect_one_line_error(base + "--direct-io x", "--direct-io needs --ram-budget");
  expect_one_line_error("chat -m " + model() + " --ram-budget 1K < /dev/null", "too small");
  // Exactly the least budget runs.
  const auto r = run_k3(base + "-q --ram-budget 1821392 x");
  EXPECT_EQ(r.code, 0) << r.err;
}
