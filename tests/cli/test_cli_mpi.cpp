// Ranks as processes, for real: `mpirun -np N k3 <sub> --tp/--ep ...` (core/comm_mpi.h,
// model/remote.h; issue 23's one process per rank and its multi-node start-up). Every process runs
// the command, rank 0 does the job and the others follow its steps over Open MPI; what the command
// writes is byte for byte what one process writes (k3 logits' float32 file, k3 generate's ids,
// k3 run's greedy text, k3 eval's perplexity, k3 serve's completion). Launches that cannot work are
// one-line errors and end every process (no hang). Skips with a message when k3 was built without
// MPI or mpirun is absent.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;
using k3test::run_shell;

namespace {

fs::path src(const std::string& rel) { return k3test::source_path(rel); }
std::string model(const std::string& rel) { return k3test::model_flag(rel); }
fs::path tmp(const std::string& name) { return k3test::temp_path("k3mpi", name); }

#ifdef K3_MPIEXEC
const char* const kMpiexec = K3_MPIEXEC;
#else
const char* const kMpiexec = "";
#endif

// mpirun with N processes of k3 on this machine: as root too (CI), more processes than cores, the
// shared-memory transport without the cross-process copy that containers may forbid, and the MPI
// progress loop yielding when idle (2 cores shared by the ranks).
std::string mpirun(int n) {
  return std::string("OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rtc=^hwloc ") +
         kMpiexec +
         " --allow-run-as-root --oversubscribe -np " + std::to_string(n) + " ";
}
k3test::CmdResult run_mpi(int n, const std::string& args) { return run_shell(mpirun(n) + K3_BIN + " " + args); }

bool have_mpi() { return *kMpiexec && fs::exists(kMpiexec); }
#define NEED_MPI()                                                                                         \
  if (!have_mpi()) GTEST_SKIP() << "k3 was built without MPI (libopenmpi-dev) or mpirun is absent: skipped"

// mpirun ends the job's last line of text with a newline of its own when the program did not.
std::string trimmed(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}
std::string without_speed(const std::string& line) { return line.substr(0, line.rfind(" | ")); }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const char* const kIds = "--ids 3,141,59,26,5,35,89,79,32,38,46,26,43";

}  // namespace

TEST(CliMpi, LogitsFileIsOneProcessOutputByteForByte) {
  NEED_MPI();
  struct Run {
    const char* model;
    int procs;
    const char* split;
  };
  for (const Run& c : {Run{"tests/fixtures/tiny", 2, "--tp 2"}, Run{"tests/fixtures/tiny", 2, "--ep 2"},
                       Run{"tests/fixtures/tiny", 3, "--tp 3 --ep 3"}, Run{"tests/fixtures/kl-tiny", 2, "--tp 2 --ep 2"},
                       Run{"models/k3-nano", 2, "--tp 2 --ep 2"}}) {
    SCOPED_TRACE(std::string(c.model) + " " + c.split);
    const fs::path one = tmp("one.f32"), two = tmp("procs.f32");
    const auto r1 = run_k3("logits " + model(c.model) + " " + kIds + " -o " + one.string());
    ASSERT_EQ(r1.code, 0) << r1.err;
    const auto r2 =
        run_mpi(c.procs, "logits " + model(c.model) + " " + kIds + " -o " + two.string() + " -t 1 " + c.split);
    ASSERT_EQ(r2.code, 0) << r2.err;
    EXPECT_TRUE(contains(r2.err, "processes, one rank each")) << r2.err;
    const std::string a = k3test::slurp(one), b = k3test::slurp(two);
    EXPECT_GT(a.size(), 0u);
    EXPECT_TRUE(a == b) << "logits differ from one process's";
    fs::remove(one);
    fs::remove(two);
  }
}

TEST(CliMpi, GenerateRunAndEvalAreOneProcessOutputs) {
  NEED_MPI();
  const std::string nano = model("models/k3-nano");
  const std::string eval = "eval " + nano + " -q --file " + quote(src("README.md").string()) + " --ctx 128 --max-tokens 256";
  const auto g1 = run_k3("generate " + nano + " " + kIds + " -n 12 --print-ids");
  const auto r1 = run_k3("run " + nano + " -q -p 'The engine reads' -n 24 --temp 0");
  const auto e1 = run_k3(eval);
  ASSERT_EQ(g1.code, 0) << g1.err;
  ASSERT_EQ(r1.code, 0) << r1.err;
  ASSERT_EQ(e1.code, 0) << e1.err;
  const std::string sp = " -t 1 --tp 2 --ep 2";
  const auto g2 = run_mpi(2, "generate " + nano + " " + kIds + " -n 12 --print-ids" + sp);
  EXPECT_EQ(g2.code, 0) << g2.err;
  EXPECT_EQ(trimmed(g2.out), trimmed(g1.out));
  const auto r2 = run_mpi(2, "run " + nano + " -q -p 'The engine reads' -n 24 --temp 0" + sp);
  EXPECT_EQ(r2.code, 0) << r2.err;
  EXPECT_EQ(trimmed(r2.out), trimmed(r1.out));
  EXPECT_GT(trimmed(r1.out).size(), 20u);
  const auto e2 = run_mpi(2, eval + sp);
  EXPECT_EQ(e2.code, 0) << e2.err;
  EXPECT_EQ(without_speed(trimmed(e2.out)), without_speed(trimmed(e1.out)));
}

// Loading reads in what the process's rank reads, not the whole checkpoint: rank 0 of TP2 x EP2 on
// K3-nano reads its heads' rows, half the routed experts and the replicated parts (embedding,
// lm_head, router, norms), less than one process reads; the ids are still one process's.
TEST(CliMpi, EachProcessReadsInItsRanksWeightsOnly) {
  NEED_MPI();
  // "k3 run: loading: 100% 43.21 MiB / 43.21 MiB" -> 43.21
  const auto loaded_mib = [](const std::string& err) {
    const auto at = err.find("loading: 100% ");
    if (at == std::string::npos) return -1.0;
    const auto slash = err.find(" / ", at);
    return std::stod(err.substr(slash + 3));
  };
  const std::string args = "run " + model("models/k3-nano") + " -p 'The engine reads' -n 8 --temp 0 -t 1";
  const auto one = run_k3(args);
  const auto two = run_mpi(2, args + " --tp 2 --ep 2");
  ASSERT_EQ(one.code, 0) << one.err;
  ASSERT_EQ(two.code, 0) << two.err;
  const double a = loaded_mib(one.err), b = loaded_mib(two.err);
  std::printf("loaded: one process %.2f MiB, rank 0 of TP2 x EP2 %.2f MiB\n", a, b);
  EXPECT_GT(a, 0) << one.err;
  EXPECT_GT(b, 0.3 * a) << two.err;
  EXPECT_LT(b, 0.8 * a) << two.err;
  EXPECT_EQ(trimmed(two.out), trimmed(one.out));
}

// k3 bench as two processes (TP2 x EP2, a depth filled with random values on every rank): rank 0
// writes the report, the settings say how it was split and run.
TEST(CliMpi, BenchRunsAsProcesses) {
  NEED_MPI();
  const auto r = run_mpi(2, "bench " + model("models/k3-nano") +
                                " -p 16 -n 4 -d 0,64 --depth-fill random -r 1 -t 1 -o json --no-progress --no-roofline"
                                " --tp 2 --ep 2");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["settings"]["tp"], 2);
  EXPECT_EQ(j["settings"]["ep"], 2);
  EXPECT_EQ(j["settings"]["processes"], 2);
  ASSERT_EQ(j["results"].size(), 4u);
  for (const auto& res : j["results"]) EXPECT_GT(res["avg_ts"].get<double>(), 0.0) << res.dump();
}

// k3 serve as two processes: rank 0 listens and schedules, rank 1 follows; a greedy completion is the
// one-process server's, and SIGTERM to mpirun ends both processes cleanly.
TEST(CliMpi, ServeAnswersAsTheOneProcessServer) {
  NEED_MPI();
  const auto serve_and_ask = [](const std::string& launcher, const std::string& split) {
    const fs::path out = tmp("serve.out"), err = tmp("serve.err");
    const std::string cmd = launcher + K3_BIN + " serve " + model("models/k3-nano") + " --port 0 -t 1" + split +
                            " >" + out.string() + " 2>" + err.string() + " & echo $!";
    const auto started = run_shell(cmd);
    const std::string pid = trimmed(started.out);
    std::string url;
    for (int i = 0; i < 600 && url.empty(); ++i) {  // "k3 serve: ready: http://HOST:PORT (model ...)"
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const std::string o = k3test::slurp(out);
      const auto at = o.find("k3 serve: ready: ");
      if (at != std::string::npos) url = o.substr(at + 17, o.find(' ', at + 17) - at - 17);
    }
    std::string answer = "(no ready line) " + k3test::slurp(err);
    if (!url.empty()) {
      const auto r = run_shell(
          "python3 -c \"import json,sys,urllib.request as u; "
          "q=u.Request(sys.argv[1]+'/v1/completions', data=json.dumps({'prompt':'The engine reads','max_tokens':20,"
          "'temperature':0}).encode(), headers={'Content-Type':'application/json'}); "
          "print(json.load(u.urlopen(q, timeout=120))['choices'][0]['text'])\" " +
          url);
      answer = r.code == 0 ? r.out : "(request failed) " + r.err;
    }
    const auto killed = run_shell("kill -TERM " + pid + "; for i in $(seq 300); do kill -0 " + pid +
                                  " 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL " + pid + "; exit 1");
    EXPECT_EQ(killed.code, 0) << "the server did not end within 30 s of SIGTERM";
    fs::remove(out);
    fs::remove(err);
    return answer;
  };
  const std::string one = serve_and_ask("", "");
  const std::string two = serve_and_ask(mpirun(2), " --tp 2 --ep 2");
  EXPECT_FALSE(contains(one, "(no ready line)") || contains(one, "(request failed)")) << one;
  EXPECT_GT(one.size(), 1u);
  EXPECT_EQ(two, one);
}

// A launch that cannot work ends every process with the one-line reason (and a non-zero status).
TEST(CliMpi, LaunchesThatCannotWorkAreOneLineErrors) {
  NEED_MPI();
  const std::string tiny = model("tests/fixtures/tiny");
  const fs::path o = tmp("x.f32");
  auto r = run_mpi(2, "logits " + tiny + " --ids 1,2 -o " + o.string());
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "k3 logits: error: k3 runs as 2 processes (mpi), but the model is not split")) << r.err;
  r = run_mpi(3, "logits " + tiny + " --ids 1,2 -o " + o.string() + " --tp 2");
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "k3 runs as 3 processes (mpi), but --tp 2 --ep 1 ask for 2 ranks")) << r.err;
  r = run_mpi(2, "info " + tiny);
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "k3 info: error: started as 2 processes by an MPI launcher, but k3 info runs as one"))
      << r.err;
  // Ranks started with different flags or models (mpirun's MPMD form): rank 1 refuses rank 0's first
  // message and the launch ends.
  r = run_shell(mpirun(1) + K3_BIN + " logits " + tiny + " --ids 1,2 -o " + o.string() + " --tp 2 : -np 1 " + K3_BIN +
                " logits " + tiny + " --ids 1,2 -o " + o.string() + " --ep 2");
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "rank 1 was started with --tp 1 --ep 2, rank 0 with --tp 2 --ep 1")) << r.err;
  r = run_shell(mpirun(1) + K3_BIN + " logits " + tiny + " --ids 1,2 -o " + o.string() + " --tp 2 : -np 1 " + K3_BIN +
                " logits " + model("tests/fixtures/tiny-flat") + " --ids 1,2 -o " + o.string() + " --tp 2");
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "rank 1 loaded a different model than rank 0")) << r.err;
  fs::remove(o);
}
