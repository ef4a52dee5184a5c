// The built `k3 plan` binary: on K3-nano (this machine) and on the released K3 config with
// described machines, text and JSON forms, a calibration round trip (measured on this machine, at
// small sizes), and every bad input as one line on stderr with exit code 2, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/run_cmd.h"

namespace fs = std::filesystem;
using k3test::quote;
using k3test::run_k3;

namespace {

const std::string kNano = std::string(K3_SOURCE_DIR) + "/models/k3-nano";
const std::string kK3 = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-config-only";
const std::string kRecorded = std::string(K3_SOURCE_DIR) + "/docs/data/calibration-h200-recorded.json";
const std::string kServerA = " --gpus 1xH200 --ram 1.5T --cpu-bw 921.6G --cores 96 --disk 7G";

// One line on stderr naming the problem, exit code 2, nothing on stdout.
void expect_one_line_error(const std::string& args, const std::string& part) {
  const k3test::CmdResult r = run_k3("plan " + args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
  EXPECT_EQ(r.out, "") << args;
  ASSERT_FALSE(r.err.empty()) << args;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  EXPECT_EQ(r.err.rfind("k3 plan: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(part), std::string::npos) << r.err;
}

nlohmann::json plan_json(const std::string& args) {
  const k3test::CmdResult r = run_k3("plan --json " + args);
  EXPECT_EQ(r.code, 0) << r.err;
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST(CliPlan, K3NanoOnThisMachine) {
  const k3test::CmdResult r = run_k3("plan -m " + quote(kNano));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("k3 plan: "), std::string::npos);
  EXPECT_NE(r.out.find("\nrates: nominal (no calibration)\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("placement "), std::string::npos);
  EXPECT_NE(r.out.find("=> "), std::string::npos);
  EXPECT_NE(r.out.find("safetensors headers"), std::string::npos);
  const nlohmann::json j = plan_json("-m " + quote(kNano) + " --batch 4");
  EXPECT_TRUE(j["plan"]["fits"].get<bool>());
  EXPECT_GT(j["plan"]["decode_batch1"]["tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["plan"]["decode_batch"]["batch"].get<int>(), 4);
  EXPECT_GT(j["plan"]["prefill"]["tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["rates"]["mode"], "nominal (no calibration)");
}

TEST(CliPlan, K3ConfigOnAGpuServerIsHybrid) {
  const nlohmann::json j = plan_json("--config " + quote(kK3) + kServerA + " --calibration " + quote(kRecorded));
  const auto& p = j["plan"];
  EXPECT_EQ(p["kind"], "hybrid");
  EXPECT_TRUE(p["fits"].get<bool>());
  EXPECT_NE(j["rates"]["mode"].get<std::string>().find("1xH200 (from the recorded runs)"), std::string::npos);
  // The rates the plan used are the calibration's.
  EXPECT_NE(j["rates"]["gpu_trunk_gemv_Bps"]["source"].get<std::string>().find("k3-layer-bench-gpu.json"),
            std::string::npos);
  // The step is the sum its terms say.
  const auto& d = p["decode_batch1"];
  const double beside = d["gpu_shared_s"].get<double>() + d["gpu_experts_s"].get<double>();
  const double serial = d["gpu_total_s"].get<double>() - beside + std::max(beside, d["cpu_total_s"].get<double>()) +
                        d["pcie_s"].get<double>() + d["sync_s"].get<double>();
  EXPECT_NEAR(d["step_s"].get<double>(), serial, 1e-12 * serial);
  // The human form shows the same placement and the arithmetic.
  const k3test::CmdResult t = run_k3("plan --config " + quote(kK3) + kServerA);
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("placement hybrid: GPU trunk + routed experts in host RAM"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("CPU experts = max("), std::string::npos);
  EXPECT_NE(t.out.find("all on GPUs: does not fit"), std::string::npos);
  // The plan says which k3 command runs the placement.
  EXPECT_NE(t.out.find("hybrid runs as: k3 run --device cuda --cpu-experts --hot-experts auto"), std::string::npos)
      << t.out;
}

TEST(CliPlan, Fp8TrunkAndMultiGpu) {
  const k3test::CmdResult r =
      run_k3("plan --config " + quote(kK3) + " --gpus 1xH100-80G --ram 1.5T --cpu-bw 921.6G --cores 96 --trunk-fp8");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("FP8 trunk (--trunk-fp8): trunk matrices at 1 B/weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("placement hybrid"), std::string::npos);
  const nlohmann::json j = plan_json("--config " + quote(kK3) +
                                     " --nodes 2 --gpus 8xH200 --tp 16 --ep 16 --calibration " + quote(kRecorded));
  EXPECT_EQ(j["plan"]["kind"], "gpu");
  EXPECT_EQ(j["plan"]["tp"], 16);
  EXPECT_GT(j["plan"]["decode_batch1"]["collectives_s"].get<double>(), 0);
}

// --cpu-isa amx: the cores' prefill GEMMs at the amx level's per-core rates (the 1-thread amx
// calibration record), decode unchanged (its rows run as GEMVs); the prefill of a CPU-only plan is
// faster by what the rates say, and the machine line names the level and its source.
TEST(CliPlan, AmxCoresSpeedUpPrefillOnly) {
  const std::string cpu = "--config " + quote(kK3) + " --gpus none --ram 1.5T --cpu-bw 614.4G --cores 112 --batch 1";
  const nlohmann::json a = plan_json(cpu + " --cpu-isa avx512"), x = plan_json(cpu + " --cpu-isa amx");
  EXPECT_EQ(a["machine"]["cpu_isa"]["value"], "avx512");
  EXPECT_EQ(x["machine"]["cpu_isa"]["value"], "amx");
  EXPECT_EQ(x["machine"]["cpu_isa"]["source"], "--cpu-isa amx");
  EXPECT_DOUBLE_EQ(x["plan"]["decode_batch1"]["tokens_per_s"].get<double>(),
                   a["plan"]["decode_batch1"]["tokens_per_s"].get<double>());
  const double pa = a["plan"]["prefill"]["tokens_per_s"].get<double>(),
               px = x["plan"]["prefill"]["tokens_per_s"].get<double>();
  EXPECT_GT(px, 2.5 * pa) << "avx512 " << pa << " t/s, amx " << px << " t/s";
  EXPECT_NE(x["rates"]["cpu_expert_prefill_gemm_flops"]["source"].get<std::string>().find(
                "calibration-devvm-1thread-amx.json"),
            std::string::npos);
  EXPECT_EQ(a["rates"]["cpu_expert_prefill_gemm_flops"]["value"], a["rates"]["cpu_expert_gemm_flops"]["value"]);
  // A described machine without the flag is avx512, and says so.
  EXPECT_EQ(plan_json(cpu)["machine"]["cpu_isa"]["value"], "avx512");
  expect_one_line_error(cpu + " --cpu-isa sse2", "--cpu-isa sse2: expected avx512 or amx");
}

// --hot-experts F plans the hybrid placement as `k3 run --cpu-experts --hot-experts F` runs it: K3-nano
// fits one H200 whole, so the hybrid would otherwise cache every expert (the same as 'gpu'); with
// 0 every routed expert is the CPU's, with 0.5 half are cached, and the decode prediction orders
// accordingly. The flag belongs to the hybrid placement alone.
TEST(CliPlan, HotExpertsSetTheHybridCache) {
  const std::string base = "-m " + quote(kNano) + " --gpus 1xH200 --ram 64G --cores 16 --placement hybrid";
  const nlohmann::json none = plan_json(base + " --hot-experts 0"), half = plan_json(base + " --hot-experts 0.5"),
                       full = plan_json(base);
  EXPECT_EQ(none["plan"]["expert_hit"].get<double>(), 0.0);
  EXPECT_NEAR(half["plan"]["expert_hit"].get<double>(), 0.5, 0.05);
  EXPECT_EQ(full["plan"]["expert_hit"].get<double>(), 1.0);
  const auto ts = [](const nlohmann::json& j) { return j["plan"]["decode_batch1"]["tokens_per_s"].get<double>(); };
  EXPECT_LT(ts(none), ts(half));
  EXPECT_LT(ts(half), ts(full));
  EXPECT_EQ(none["request"]["hot_experts"].get<double>(), 0.0);
  expect_one_line_error("-m " + quote(kNano) + " --gpus 1xH200 --placement gpu --hot-experts 0.5",
                        "--placement hybrid");
  expect_one_line_error(base + " --hot-experts 1.5", "--hot-experts");
}

// The GPU's per-layer work besides the weight reads: 72 us by default (measured on the H200), the
// calibration's gpu.layer_s where it records one (0 in the recorded H200 file, whose decode rate is
// whole layers' time), --layer-us over both; the decode step carries layers x that.
TEST(CliPlan, GpuLayerTermFromDefaultCalibrationOrFlag) {
  const std::string k3 = "--config " + quote(kK3) + kServerA + " --placement hybrid";
  const nlohmann::json def = plan_json(k3), cal = plan_json(k3 + " --calibration " + quote(kRecorded)),
                       flag = plan_json(k3 + " --calibration " + quote(kRecorded) + " --layer-us 10");
  EXPECT_DOUBLE_EQ(def["rates"]["gpu_layer_s"]["value"].get<double>(), 72e-6);
  EXPECT_NE(def["rates"]["gpu_layer_s"]["source"].get<std::string>().find("measured on the H200"), std::string::npos);
  EXPECT_DOUBLE_EQ(cal["rates"]["gpu_layer_s"]["value"].get<double>(), 0.0);
  EXPECT_NE(cal["rates"]["gpu_layer_s"]["source"].get<std::string>().find("gpu.layer_s"), std::string::npos);
  EXPECT_DOUBLE_EQ(flag["rates"]["gpu_layer_s"]["value"].get<double>(), 1e-5);
  EXPECT_NEAR(def["plan"]["decode_batch1"]["gpu_layers_s"].get<double>(), 93 * 72e-6, 1e-12);
  EXPECT_NEAR(flag["plan"]["decode_batch1"]["gpu_layers_s"].get<double>(), 93 * 1e-5, 1e-12);
  EXPECT_EQ(cal["plan"]["decode_batch1"]["gpu_layers_s"].get<double>(), 0.0);
  expect_one_line_error(k3 + " --layer-us -3", "--layer-us");
  // A calibration file with a bad gpu.layer_s is refused in one line.
  std::ifstream in(kRecorded);
  nlohmann::json c = nlohmann::json::parse(in);
  c["gpu"]["layer_s"] = -1;
  const fs::path bad = fs::temp_directory_path() / ("k3plan_layer_" + std::to_string(::getpid()) + ".json");
  std::ofstream(bad) << c.dump();
  expect_one_line_error(k3 + " --calibration " + quote(bad.string()), "gpu.layer_s");
  fs::remove(bad);
}

// The hybrid's handoff per MoE layer: 20 us assumed by default, the calibration's gpu.handoff_s where
// it records one (k3 plan --calibrate measures it on a GPU machine), --sync-us over both; a bad value
// in the file is one line.
TEST(CliPlan, HandoffFromCalibrationOrFlag) {
  const std::string k3 = "--config " + quote(kK3) + kServerA + " --placement hybrid";
  std::ifstream in(kRecorded);
  nlohmann::json c = nlohmann::json::parse(in);
  c["gpu"]["handoff_s"] = 1.5e-4;
  const fs::path with = fs::temp_directory_path() / ("k3plan_handoff_" + std::to_string(::getpid()) + ".json");
  std::ofstream(with) << c.dump();
  const nlohmann::json def = plan_json(k3), cal = plan_json(k3 + " --calibration " + quote(with.string())),
                       flag = plan_json(k3 + " --calibration " + quote(with.string()) + " --sync-us 50");
  EXPECT_DOUBLE_EQ(def["rates"]["sync_s"]["value"].get<double>(), 20e-6);
  EXPECT_DOUBLE_EQ(cal["rates"]["sync_s"]["value"].get<double>(), 1.5e-4);
  EXPECT_NE(cal["rates"]["sync_s"]["source"].get<std::string>().find("gpu.handoff_s"), std::string::npos);
  EXPECT_DOUBLE_EQ(flag["rates"]["sync_s"]["value"].get<double>(), 50e-6);
  EXPECT_NEAR(cal["plan"]["decode_batch1"]["sync_s"].get<double>(), 92 * 1.5e-4, 1e-12);
  c["gpu"]["handoff_s"] = "soon";
  std::ofstream(with) << c.dump();
  expect_one_line_error(k3 + " --calibration " + quote(with.string()), "gpu.handoff_s");
  fs::remove(with);
}

TEST(CliPlan, BadInputsAreOneLineErrors) {
  const std::string k3 = "--config " + quote(kK3);
  expect_one_line_error(k3 + " --gpus 8xB300", "unknown GPU 'B300'");
  expect_one_line_error(k3 + " --gpus 1xH200 --cpu-bw 5X", "--cpu-bw must be a rate like 55G or 4.8T");
  expect_one_line_error(k3 + " --gpus 1xH200 --pcie -5G", "--pcie must be positive");
  expect_one_line_error(k3 + " --ram 1.5Q", "--ram must be a size like 512M");
  expect_one_line_error(k3 + kServerA + " --placement gpu", "nothing fits: all on GPUs: per GPU trunk");
  expect_one_line_error(k3 + " --gpus 1xH100-80G --ram 64G --placement hybrid", "over by");
  expect_one_line_error(k3 + " --gpus 8xH200 --tp 3", "--tp 3 does not divide the 8 GPUs");
  expect_one_line_error(k3 + " --ctx 2000000", "exceeds the model's max_position_embeddings");
  expect_one_line_error(k3 + " --gpus 1xH100-80G --calibration " + quote(kRecorded),
                        "was measured on NVIDIA H200 (H200), but the planned GPU is H100-80G");
  expect_one_line_error(k3 + " --calibration /nonexistent/cal.json", "calibration file not found");
  expect_one_line_error(k3 + " --gpu-mem 80G", "--gpu-mem 80G given, but there is no GPU");
  // A config that is not a K3-family config.
  const fs::path dir = fs::temp_directory_path() / ("k3plan_llama_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32})";
  expect_one_line_error("--config " + quote((dir / "config.json").string()), "config.json");
  fs::remove_all(dir);
}

TEST(CliPlan, CalibrateWritesAFileThatPlanUses) {
  const fs::path out = fs::temp_directory_path() / ("k3plan_cal_" + std::to_string(::getpid()) + ".json");
  const k3test::CmdResult r = run_k3("plan --calibrate --out " + quote(out.string()) +
                                     " --calibrate-mem 64M --disk-size 16M --no-gpu-calibration");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote the calibration to " + out.string()), std::string::npos) << r.out;
  std::ifstream in(out);
  const nlohmann::json c = nlohmann::json::parse(in);
  for (const char* k : {"expert_gemv_Bps", "expert_gemm_flops", "bf16_gemv_Bps", "bf16_gemm_flops", "mem_read_Bps"})
    EXPECT_GT(c["cpu"][k].get<double>(), 0) << k;
  EXPECT_GT(c["disk"]["seq_read_Bps"].get<double>(), 0);
  EXPECT_TRUE(c["gpu"].is_null());
  const nlohmann::json j = plan_json("-m " + quote(kNano) + " --calibration " + quote(out.string()));
  EXPECT_DOUBLE_EQ(j["rates"]["cpu_expert_gemv_Bps"]["value"].get<double>(), c["cpu"]["expert_gemv_Bps"].get<double>());
  fs::remove(out);
  // The GPU part, required, refuses in one line where there is no GPU (or no CUDA backend).
  const k3test::CmdResult g = run_k3("plan --calibrate --calibrate-gpu --out " + quote(out.string()));
  if (g.code == 0) GTEST_SKIP() << "a GPU is present: the refusal is not testable here";
  EXPECT_EQ(g.code, 2);
  EXPECT_EQ(g.err.rfind("k3 plan: error: --calibrate-gpu: ", 0), 0u) << g.err;
  EXPECT_EQ(g.err.find('\n'), g.err.size() - 1) << g.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST(CliPlan, HelpAndErrorsHaveTheFormatOfEverySubcommand) {
  const k3test::CmdResult h = run_k3("plan --help");
  EXPECT_EQ(h.code, 0) << h.err;
  EXPECT_EQ(h.out.rfind("k3 plan: ", 0), 0u) << h.out;
  EXPECT_NE(h.out.find("Usage: k3 plan [OPTIONS]"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("-m,--model"), std::string::npos);
  EXPECT_NE(h.out.find("default: $K3_MODEL, else the bundled K3-nano"), std::string::npos);
  for (const char* flag :
       {"--gpus", "--gpu-mem", "--ram", "--ram-budget", "--cpu-bw", "--cores", "--pcie", "--disk", "--net", "--tp",
        "--ep", "--expert-hit", "--trunk-fp8", "--calibrate", "--calibration", "--json", "--batch", "--ctx"})
    EXPECT_NE(h.out.find(flag), std::string::npos) << flag;
  expect_one_line_error("--frobnicate", "frobnicate");
  expect_one_line_error("-m /nonexistent/k3plan", "/nonexistent/k3plan");
  expect_one_line_error("--out /tmp/x.json", "--out requires --calibrate");
  const k3test::CmdResult top = run_k3("--help");
  EXPECT_NE(top.out.find("plan"), std::string::npos) << top.out;
}
