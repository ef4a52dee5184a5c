// `--tp N --ep N` on the commands that run a model (issue 23): on the CPU the ranks run in the one
// process, and what the commands write is byte for byte what one rank writes (k3 logits' float32
// file, k3 generate's ids, k3 run's greedy text, k3 eval's perplexity line). Splits that cannot be
// made, and the combinations not supported yet (--device cuda, --ram-budget), are one-line errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <regex>
#include <string>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

fs::path src(const std::string& rel) { return k3test::source_path(rel); }
std::string model(const std::string& rel) { return k3test::model_flag(rel); }
fs::path tmp(const std::string& name) { return k3test::temp_path("k3par", name); }
size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }
// k3 eval's result line without its last field (the tokens per second of that run).
std::string without_speed(const std::string& line) { return line.substr(0, line.rfind(" | ")); }

void expect_error(const k3test::CmdResult& r, const std::string& sub, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("k3 " + sub + ": error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

const char* const kSplits[] = {"--tp 2", "--ep 2", "--tp 2 --ep 2"};
const char* const kIds = "--ids 3,141,59,26,5,35,89,79,32,38,46,26,43";

}  // namespace

TEST(CliParallel, LogitsFileIsTheOneRanksByteForByte) {
  for (const char* m : {"tests/fixtures/tiny", "tests/fixtures/kl-tiny", "models/k3-nano"}) {
    const fs::path one = tmp("one.f32");
    const auto r1 = run_k3("logits " + model(m) + " " + kIds + " -o " + one.string());
    ASSERT_EQ(r1.code, 0) << r1.err;
    for (const char* sp : kSplits) {
      const fs::path two = tmp("split.f32");
      const auto r2 = run_k3("logits " + model(m) + " " + kIds + " -o " + two.string() + " " + sp);
      ASSERT_EQ(r2.code, 0) << m << " " << sp << ": " << r2.err;
      EXPECT_NE(r2.err.find("k3 logits: split "), std::string::npos) << r2.err;  // says what each rank holds
      const std::string a = k3test::slurp(one), b = k3test::slurp(two);
      EXPECT_GT(a.size(), 0u);
      EXPECT_TRUE(a == b) << m << " " << sp << ": logits differ from one rank's";
      fs::remove(two);
    }
    fs::remove(one);
  }
}

TEST(CliParallel, GenerateRunAndEvalAreTheOneRanks) {
  const std::string nano = model("models/k3-nano");
  const auto g1 = run_k3("generate " + nano + " " + kIds + " -n 12 --print-ids");
  const auto r1 = run_k3("run " + nano + " -q -p 'The engine reads' -n 24 --temp 0");
  const auto e1 =
      run_k3("eval " + nano + " -q --file " + quote(src("README.md").string()) + " --ctx 128 --max-tokens 256");
  ASSERT_EQ(g1.code, 0) << g1.err;
  ASSERT_EQ(r1.code, 0) << r1.err;
  ASSERT_EQ(e1.code, 0) << e1.err;
  for (const char* sp : kSplits) {
    const auto g2 = run_k3("generate " + nano + " " + kIds + " -n 12 --print-ids " + sp);
    EXPECT_EQ(g2.code, 0) << g2.err;
    EXPECT_EQ(g2.out, g1.out) << sp;
    const auto r2 = run_k3("run " + nano + " -q -p 'The engine reads' -n 24 --temp 0 " + sp);
    EXPECT_EQ(r2.code, 0) << r2.err;
    EXPECT_EQ(r2.out, r1.out) << sp;
    const auto e2 =
        run_k3("eval " + nano + " -q --file " + quote(src("README.md").string()) + " --ctx 128 --max-tokens 256 " + sp);
    EXPECT_EQ(e2.code, 0) << e2.err;
    EXPECT_EQ(without_speed(e2.out), without_speed(e1.out)) << sp;
  }
}

TEST(CliParallel, SplitsThatCannotBeMadeAreOneLineErrors) {
  const std::string flat = model("tests/fixtures/tiny-flat"), nano = model("models/k3-nano");
  expect_error(run_k3("logits " + flat + " --ids 1,2 -o /dev/null --tp 3"), "logits",
               "--tp 3: the model has 2 KDA heads, fewer than the ranks");
  expect_error(run_k3("generate " + flat + " --ids 1,2 --ep 5"), "generate",
               "--ep 5: the model has 4 routed experts, fewer than the ranks");
  expect_error(run_k3("generate " + nano + " --ids 1,2 --tp 2 --ep 4"), "generate",
               "with both above 1 they must be equal");
  expect_error(run_k3("generate " + nano + " --ids 1,2 --tp 0"), "generate", "--tp");
  // GPUs: one process per GPU under mpirun (tests/cli/test_cli_mpi.cpp), not ranks as threads.
  expect_error(run_k3("generate " + nano + " --ids 1,2 --tp 2 --device cuda --numerics fp32"), "generate",
               "runs on GPUs as one process per GPU (mpirun -np N k3 ... --device cuda --tp N");
  expect_error(run_k3("run " + nano + " -p hi -n 2 --tp 2 --device cuda"), "run", "runs on GPUs as one process per GPU");
  expect_error(run_k3("run " + nano + " -p hi -n 2 --ep 2 --ram-budget 1G"), "run",
               "--ram-budget is not supported yet");
}

// --cpu-experts (issue 20's hybrid placement: the GPU holds the trunk, the CPU computes the routed
// experts from host RAM) goes with --device cuda; elsewhere it is a one-line error on every command
// that has it. (Its GPU behaviour is tests/cuda: CudaModel.ExpertsOnTheCpuGiveTheSameTokens.)
TEST(CliPlacement, CpuExpertsWithoutTheGpuIsAOneLineError) {
  const std::string nano = model("models/k3-nano");
  for (const std::string sub : {"run", "generate", "logits", "bench", "eval", "serve"}) {
    std::string args = sub + " " + nano + " --cpu-experts";
    if (sub == "run") args += " -p hi -n 2";
    if (sub == "generate") args += " --ids 1,2 -n 2";
    if (sub == "logits") args += " --ids 1,2 -o /dev/null";
    if (sub == "bench") args += " -p 4 -n 2 -r 1";
    if (sub == "eval") args += " -f " + quote(src("README.md").string());
    if (sub == "serve") args += " --port 0";
    expect_error(run_k3(args), sub, "--cpu-experts goes with --device cuda");
  }
}

// --hot-experts (the GPU's cache of hot experts) goes with --cpu-experts and takes a fraction in (0, 1]
// or auto; --ram-budget excludes it. One line each, before anything loads, on every command that has it.
TEST(CliPlacement, HotExpertsNeedCpuExpertsAndAFraction) {
  const std::string nano = model("models/k3-nano");
  for (const std::string sub : {"run", "bench", "serve"}) {
    std::string tail = sub == "run" ? " -p hi -n 2" : sub == "bench" ? " -p 4 -n 2 -r 1" : " --port 0";
    expect_error(run_k3(sub + " " + nano + " --hot-experts 0.5" + tail), sub, "--hot-experts goes with --cpu-experts");
    for (const std::string bad : {"1.5", "-0.25", "half", "0.5x"})
      expect_error(run_k3(sub + " " + nano + " --device cuda --cpu-experts --hot-experts " + bad + tail), sub,
                   "is not a fraction in (0, 1] or auto");
  }
  expect_error(run_k3("run " + nano + " --device cuda --cpu-experts --hot-experts auto --ram-budget 1G -p hi -n 2"),
               "run", "--hot-experts caches routed experts held in host RAM");
}

// k3 bench --prefill-experts auto|cpu|gpu (where a long prompt's routed experts run in the hybrid
// placement) goes with --cpu-experts; a bad value is one line, before anything loads.
TEST(CliPlacement, PrefillExpertsNeedCpuExpertsAndAKnownValue) {
  const std::string nano = model("models/k3-nano"), tail = " -p 16 -n 2 -r 1";
  expect_error(run_k3("bench " + nano + " --prefill-experts gpu" + tail), "bench",
               "--prefill-experts goes with --cpu-experts");
  expect_error(run_k3("bench " + nano + " --device cuda --cpu-experts --prefill-experts disk" + tail), "bench",
               "--prefill-experts: unknown value 'disk' (auto, cpu or gpu)");
  // --cpu-experts-q8 (8-bit activations for the CPU's experts) likewise, on every command that has it.
  for (const std::string sub : {"run", "bench", "serve"}) {
    const std::string t = sub == "run" ? " -p hi -n 2" : sub == "bench" ? tail : " --port 0";
    expect_error(run_k3(sub + " " + nano + " --device cuda --cpu-experts-q8" + t), sub,
                 "--cpu-experts-q8 goes with --cpu-experts");
  }
  // --gpu-mem SIZE (run, chat, serve: the GPU memory cap) goes with --device cuda and takes a size.
  for (const std::string sub : {"run", "serve"}) {
    const std::string t = sub == "run" ? " -p hi -n 2" : " --port 0";
    expect_error(run_k3(sub + " " + nano + " --gpu-mem 40G" + t), sub, "--gpu-mem goes with --device cuda");
    expect_error(run_k3(sub + " " + nano + " --device cuda --gpu-mem 40Q" + t), sub, "--gpu-mem");
    expect_error(run_k3(sub + " " + nano + " --device cuda --gpu-mem 0" + t), sub, "--gpu-mem must be a size");
  }
}

// k3 info --cpu-experts [--hot-experts F]: the GPU line leaves the routed experts in host RAM (and
// adds F of them back for the cache), says so in a line of its own; the sums agree to the printed
// precision. (That the routed bytes are the engine's own: PlanSizes.RoutedExpertBytesAreTheEnginesOwn.)
TEST(CliPlacement, InfoPlansTheHybridSplit) {
  const std::string nano = model("models/k3-nano");
  const auto gpu_weights_mib = [&](const std::string& flags, double* routed_mib) {
    const auto r = run_k3("info " + nano + flags);
    EXPECT_EQ(r.code, 0) << r.err;
    std::smatch m;
    const std::string& out = r.out;
    EXPECT_TRUE(std::regex_search(out, m, std::regex(R"(GPU memory to run[^\n]*\n(?:  routed[^\n]*\n)?  weights ([0-9.]+) MiB)")))
        << out;
    std::smatch rm;
    if (routed_mib && std::regex_search(out, rm, std::regex(R"(routed experts ([0-9.]+) MiB in host RAM)")))
      *routed_mib = std::stod(rm[1]);
    return m.size() > 1 ? std::stod(m[1]) : -1.0;
  };
  double routed = -1;
  const double all = gpu_weights_mib("", nullptr), split = gpu_weights_mib(" --cpu-experts", &routed),
               quarter = gpu_weights_mib(" --cpu-experts --hot-experts 0.25", nullptr);
  ASSERT_GT(routed, 0);
  EXPECT_NEAR(split + routed, all, 0.011);
  EXPECT_NEAR(quarter, split + 0.25 * routed, 0.011);
  const auto hot = run_k3("info " + nano + " --cpu-experts --hot-experts 0.25");
  EXPECT_NE(hot.out.find("of them cached on the GPU too"), std::string::npos) << hot.out;
  expect_error(run_k3("info " + nano + " --hot-experts 0.5"), "info", "--hot-experts goes with --cpu-experts");
}

// k3 bench --tp/--ep: the ranks as threads; the json says how it was split; --profile (one
// backend's ops) and the GPU are refused with it in one line.
TEST(CliParallel, BenchSplitsAndSaysSo) {
  const auto r = run_k3("bench " + model("tests/fixtures/tiny") +
                        " -p 8 -n 4 -r 1 -t 1 -o json --no-progress --no-roofline --tp 2 --ep 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"tp\": 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"processes\": 1"), std::string::npos) << r.out;
  expect_error(run_k3("bench " + model("tests/fixtures/tiny") + " -p 8 -n 0 --tp 2 --profile"), "bench",
               "--profile times one backend's ops");
  expect_error(run_k3("bench " + model("tests/fixtures/tiny") + " -p 8 -n 0 --ep 2 --device cuda"), "bench",
               "--tp/--ep with --device cuda");
  expect_error(run_k3("bench " + model("tests/fixtures/tiny-flat") + " -p 8 -n 0 --tp 3"), "bench",
               "--tp 3: the model has 2 KDA heads");
}

// Processes started by hand (--rank/--world/--master, core/comm_tcp.h): they meet at rank 0's port,
// then a CPU split refuses in one line on both (their data would need host collectives: mpirun), and
// the start-up flags that do not go together are one-line errors.
TEST(CliRendezvous, ProcessesMeetAndCpuRanksAreSentToMpirun) {
  const int port = 20000 + int(::getpid() % 20000);
  const std::string master = " --world 2 --master 127.0.0.1:" + std::to_string(port);
  const std::string cmd = "logits " + model("tests/fixtures/tiny") + " --ids 1,2 -o /dev/null --tp 2";
  const fs::path err1 = tmp("rank1.err");
  const auto r = k3test::run_shell(std::string(K3_BIN) + " " + cmd + " --rank 1" + master + " 2>" + err1.string() +
                                   " & " + K3_BIN + " " + cmd + " --rank 0" + master + "; s=$?; wait $!; echo rank1=$?; exit $s");
  expect_error(r, "logits", "processes started with --rank/--world/--master split a model over GPUs");
  const std::string e1 = k3test::slurp(err1);
  EXPECT_NE(r.out.find("rank1=2"), std::string::npos) << r.out << e1;
  EXPECT_NE(e1.find("on the CPU, start the processes with mpirun"), std::string::npos) << e1;
  fs::remove(err1);
  expect_error(run_k3(cmd + " --rank 0 --world 2"), "logits", "--rank, --world (2 or more) and --master HOST:PORT go together");
  expect_error(run_k3("info " + model("tests/fixtures/tiny") + " --rank 0 --world 2 --master 127.0.0.1:1"), "info",
               "k3 info runs as one process");
  expect_error(run_k3(cmd + " --rank 1 --world 2 --master nonsense"), "logits", "--master nonsense: give HOST:PORT");
}
