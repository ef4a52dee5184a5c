// `--trunk-fp8` on the commands that load a model to run it (issue 20): k3 run, generate, logits,
// eval and bench take it, say in one line what was quantised, and give the FP8 model's output (a
// split FP8 model's, byte for byte); the memory check and `k3 info --trunk-fp8` count the trunk in
// FP8; with --device cuda it is taken as on the CPU (on a machine without a GPU: the same refusal as
// without it).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

const std::string kNano = "-m " + quote((fs::path(K3_SOURCE_DIR) / "models/k3-nano").string());
const char* const kIds = "--ids 3,141,59,26,5,35,89,79,32,38,46,26,43";

fs::path tmp(const std::string& name) {
  return fs::temp_directory_path() / ("k3fp8_" + std::to_string(::getpid()) + "_" + name);
}
size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }


// "trunk in FP8 (E4M3, 128 x 128 block scales): 98 matrices, 14.99 MiB -> 7.50 MiB, ..." for K3-nano.
const std::regex kLine(
    "k3 [a-z]+: trunk in FP8 \\(E4M3, 128 x 128 block scales\\): 98 matrices, 14\\.99 MiB -> 7\\.50 MiB, "
    "[0-9.]+ MiB of mapped pages released, in [0-9.]+ s\n");

}  // namespace

TEST(CliTrunkFp8, RunSaysWhatWasQuantisedAndChangesTheText) {
  // Sampled with a fixed seed in exact numerics (the same on every CPU): the README's sample prompt.
  const std::string args = " -p 'The function returns' -n 30 --seed 2 --numerics exact";
  const auto plain = run_k3("run " + kNano + " -q" + args);
  const auto fp8 = run_k3("run " + kNano + args + " --trunk-fp8");
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(fp8.code, 0) << fp8.err;
  EXPECT_TRUE(std::regex_search(fp8.err, kLine)) << fp8.err;
  EXPECT_EQ(fp8.out.rfind("The function returns", 0), std::string::npos) << "no --echo: only the completion";
  EXPECT_FALSE(fp8.out.empty());
  // The FP8 model's text: itself again (deterministic), and split TP2 x EP2 the same bytes.
  const auto again = run_k3("run " + kNano + " -q" + args + " --trunk-fp8");
  const auto split = run_k3("run " + kNano + " -q" + args + " --trunk-fp8 --tp 2 --ep 2");
  EXPECT_EQ(again.out, fp8.out);
  EXPECT_EQ(split.code, 0) << split.err;
  EXPECT_EQ(split.out, fp8.out);
  EXPECT_NE(fp8.out, plain.out) << "the FP8 trunk's text is the original's (was it quantised?)";
}

TEST(CliTrunkFp8, GenerateAndLogitsOfTheFp8ModelSplitOrNot) {
  const auto g = run_k3("generate " + kNano + " " + kIds + " -n 12 --print-ids --trunk-fp8");
  const auto g_plain = run_k3("generate " + kNano + " " + kIds + " -n 12 --print-ids");
  const auto g_split = run_k3("generate " + kNano + " " + kIds + " -n 12 --print-ids --trunk-fp8 --tp 2 --ep 2");
  ASSERT_EQ(g.code, 0) << g.err;
  ASSERT_EQ(g_split.code, 0) << g_split.err;
  EXPECT_TRUE(std::regex_search(g.err, kLine)) << g.err;
  EXPECT_EQ(g_split.out, g.out);
  EXPECT_EQ(lines(g.out), 1u);
  EXPECT_EQ(g_plain.code, 0);
  const fs::path a = tmp("fp8.f32"), b = tmp("split.f32"), c = tmp("plain.f32");
  ASSERT_EQ(run_k3("logits " + kNano + " " + kIds + " -o " + a.string() + " --trunk-fp8").code, 0);
  ASSERT_EQ(run_k3("logits " + kNano + " " + kIds + " -o " + b.string() + " --trunk-fp8 --tp 2 --ep 2").code, 0);
  ASSERT_EQ(run_k3("logits " + kNano + " " + kIds + " -o " + c.string()).code, 0);
  const std::string la = k3test::slurp(a), lb = k3test::slurp(b), lc = k3test::slurp(c);
  EXPECT_EQ(la.size(), size_t(13 * 8448 * 4));
  EXPECT_TRUE(la == lb) << "split FP8 logits differ from the unsplit FP8 model's";
  EXPECT_FALSE(la == lc) << "FP8 logits equal the original's";
  for (const auto& p : {a, b, c}) fs::remove(p);
}

TEST(CliTrunkFp8, EvalAndBench) {
  const std::string text = quote((fs::path(K3_SOURCE_DIR) / "README.md").string());
  const auto e = run_k3("eval " + kNano + " -q --trunk-fp8 --file " + text + " --ctx 128 --max-tokens 256");
  ASSERT_EQ(e.code, 0) << e.err;
  EXPECT_NE(e.out.find("perplexity"), std::string::npos) << e.out;
  const fs::path j = tmp("bench.json");
  const auto b = run_k3("bench " + kNano +
                        " -p 0 -n 4 -r 1 --no-roofline --no-progress -o json --trunk-fp8 --json-out " + j.string());
  ASSERT_EQ(b.code, 0) << b.err;
  const auto doc = nlohmann::json::parse(k3test::slurp(j));
  EXPECT_EQ(doc["settings"]["trunk_fp8"], true);
  EXPECT_EQ(doc["settings"]["trunk_fp8_bytes"]["matrices"], 98);
  const uint64_t before = doc["settings"]["trunk_fp8_bytes"]["before"],
                 after = doc["settings"]["trunk_fp8_bytes"]["after"];
  // K3-nano's 98 trunk matrices: 7,858,560 weights, 15,717,120 B in bf16; in FP8 one byte each plus
  // 736 fp32 block scales.
  EXPECT_EQ(before, 15717120u);
  EXPECT_EQ(after, 7858560u + 4 * 736u);
  ASSERT_FALSE(doc["results"].empty());
  EXPECT_EQ(doc["results"][0]["trunk_fp8"], true);
  // The weights as held: the checkpoint's 43.00 MiB less the 14.99 MiB replaced plus 7.50 MiB of FP8.
  const uint64_t bytes = doc["results"][0]["model_bytes"].get<uint64_t>();
  EXPECT_LT(bytes, uint64_t(36.0 * 1048576));
  EXPECT_GT(bytes, uint64_t(35.0 * 1048576));
  fs::remove(j);
}

// The memory check counts the trunk in FP8 (what the refusal names), as k3 info --trunk-fp8 does.
TEST(CliTrunkFp8, MemoryCheckAndInfoCountTheFp8Trunk) {
  const auto plain = run_k3("run " + kNano + " -q -p hi -n 1 --mem-limit 1M");
  const auto fp8 = run_k3("run " + kNano + " -q -p hi -n 1 --mem-limit 1M --trunk-fp8");
  EXPECT_EQ(plain.code, 2);
  EXPECT_EQ(fp8.code, 2);
  EXPECT_NE(plain.err.find("(weights 43.00 MiB, "), std::string::npos) << plain.err;
  EXPECT_NE(fp8.err.find("(weights 35.51 MiB with the FP8 trunk, "), std::string::npos) << fp8.err;
  EXPECT_EQ(lines(fp8.err), 1u) << fp8.err;
  const auto info = run_k3("info " + kNano + " --trunk-fp8");
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_NE(info.out.find("FP8 trunk (--trunk-fp8): 98 trunk matrices"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("14.99 MiB -> 7.50 MiB in FP8"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("weights 35.51 MiB + KDA state"), std::string::npos) << info.out;
  const auto info_plain = run_k3("info " + kNano);
  EXPECT_NE(info_plain.out.find("weights 43.00 MiB + KDA state"), std::string::npos) << info_plain.out;
  EXPECT_EQ(info_plain.out.find("FP8 trunk"), std::string::npos);
  // Without the shards (a config and index only) it says it cannot count, rather than guessing.
  const auto cfg_only =
      run_k3("info -m " + quote((fs::path(K3_SOURCE_DIR) / "tests/fixtures/k3-config-only").string()) + " --trunk-fp8");
  EXPECT_EQ(cfg_only.code, 0) << cfg_only.err;
  EXPECT_NE(cfg_only.out.find("FP8 trunk (--trunk-fp8): not counted: no safetensors files"), std::string::npos)
      << cfg_only.out;
}

// The error line of a k3 run ("k3 SUB: error: ..."), or "" when there is none.
std::string error_line(const k3test::CmdResult& r) {
  const size_t at = r.err.find(": error: ");
  if (at == std::string::npos) return "";
  const size_t b = r.err.rfind('\n', at), e = r.err.find('\n', at);
  return r.err.substr(b == std::string::npos ? 0 : b + 1, e == std::string::npos ? std::string::npos : e - b - 1);
}

TEST(CliTrunkFp8, GpuTakesItAsTheCpuDoes) {
  // Every command that runs a model takes --trunk-fp8 with --device cuda: on a machine without a
  // usable GPU it fails exactly as it does without the option (one error line, same exit code); on a
  // GPU machine both run, and the FP8 one says what it quantised.
  for (const std::string& cmd : {"run " + kNano + " -q -p hi -n 1 --device cuda",
                                  "generate " + kNano + " " + kIds + " -n 2 --device cuda",
                                  "logits " + kNano + " " + kIds + " -o /dev/null --device cuda",
                                  "bench " + kNano + " -p 0 -n 2 -r 1 --device cuda"}) {
    const auto plain = run_k3(cmd), fp8 = run_k3(cmd + " --trunk-fp8");
    EXPECT_EQ(fp8.code, plain.code) << cmd << "\n" << fp8.err;
    EXPECT_EQ(error_line(fp8), error_line(plain)) << cmd;
    EXPECT_EQ(fp8.err.find("not built yet"), std::string::npos) << fp8.err;
    if (plain.code == 0) {
      EXPECT_NE(fp8.err.find("trunk in FP8"), std::string::npos) << cmd << "\n" << fp8.err;
    }
  }
}
