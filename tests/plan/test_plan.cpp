// Tests of the planner library (src/plan): parsing, GPU names, the distinct-expert and busiest-shard
// formulas against simulated routing, the decode / prefill arithmetic on hand-made machines and
// rates, fit boundaries, calibration files and every one-line error.
// Must not: compare against numbers the code under test printed (expectations derive from inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "config/model_config.h"
#include "core/error.h"
#include "plan/calibration.h"
#include "plan/machine.h"
#include "plan/planner.h"
#include "plan/rates.h"
#include "plan/sizes.h"
#include "plan/units.h"
#include "runtime/memory.h"

namespace fs = std::filesystem;
using namespace k3::plan;

namespace {

const std::string kK3Config = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-config-only";

const k3::ModelConfig& k3cfg() {
  static const k3::ModelConfig c = k3::load_model_config(kK3Config);
  return c;
}
const ModelSizes& k3sizes() {
  static const ModelSizes s = model_sizes(k3cfg(), "");
  return s;
}

// Expects `fn` to throw k3::Error whose message contains `part` and is one line.
template <class F>
void expect_error(F&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const k3::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(part), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

Sourced<double> v(double x) { return {x, "test"}; }

// One H200-like GPU (capacity given), a big host; round rates.
Machine one_gpu(double gpu_mem, uint64_t ram = uint64_t(2) << 40) {
  Machine m;
  m.description = "test";
  m.gpus_per_node = 1;
  m.gpu = find_gpu("H200");
  m.gpu_mem = {uint64_t(gpu_mem), "test"};
  m.ram = {ram, "test"};
  m.cores = {64, "test"};
  m.cpu_bw = v(900e9);
  m.pcie = v(64e9);
  m.disk = v(7e9);
  m.nvlink = v(450e9);
  m.net = v(50e9);
  return m;
}

Rates round_rates() {
  Rates r;
  r.mode = "test";
  r.gpu_trunk_Bps = v(2e12);
  r.gpu_expert_Bps = v(1e12);
  r.gpu_decode_flops = v(1e14);
  r.gpu_gemm_flops = v(5e13);
  r.gpu_expert_gemm_flops = v(2.5e13);
  r.pcie_Bps = v(5e10);
  r.nvlink_Bps = v(4e11);
  r.net_Bps = v(4e10);
  r.cpu_expert_Bps = v(5e11);
  r.cpu_expert_f32_Bps = v(2.5e11);  // the hybrid's CPU experts (fp32 activations)
  r.cpu_expert_flops = v(1e13);
  r.cpu_bf16_Bps = v(4e11);
  r.cpu_bf16_flops = v(5e12);
  r.cpu_expert_prefill_flops = r.cpu_expert_flops;  // (cores without AMX tiles: the same GEMMs)
  r.cpu_bf16_prefill_flops = r.cpu_bf16_flops;
  r.cpu_mem_Bps = v(4e11);
  r.disk_Bps = v(5e9);
  r.lat = {v(2e-5), v(7e-5), v(1.5e-5), v(3e-5)};
  return r;
}

void near_rel(double got, double want, double tol = 1e-12) {
  EXPECT_NEAR(got, want, std::fabs(want) * tol + 1e-300) << "got " << got << " want " << want;
}

}  // namespace

// ---------------------------------------------------------------- units

TEST(PlanUnits, RatesAreDecimalBytesPerSecond) {
  EXPECT_DOUBLE_EQ(parse_rate("55G", "--pcie"), 55e9);
  EXPECT_DOUBLE_EQ(parse_rate("4.8T", "r"), 4.8e12);
  EXPECT_DOUBLE_EQ(parse_rate("7.5GB/s", "r"), 7.5e9);
  EXPECT_DOUBLE_EQ(parse_rate("900M/s", "r"), 900e6);
  EXPECT_DOUBLE_EQ(parse_rate("12k", "r"), 12e3);
  EXPECT_DOUBLE_EQ(parse_rate("640", "r"), 640);
  EXPECT_DOUBLE_EQ(parse_rate("400GB", "r"), 400e9);
}

TEST(PlanUnits, BadRatesAreOneLineErrors) {
  expect_error([] { parse_rate("-5G", "--pcie"); }, "--pcie must be positive (bytes/s), got '-5G'");
  expect_error([] { parse_rate("0G", "--disk"); }, "--disk must be a rate like 55G");
  expect_error([] { parse_rate("5X", "--cpu-bw"); }, "--cpu-bw must be a rate like 55G or 4.8T");
  expect_error([] { parse_rate("", "--net"); }, "--net must be a rate");
  expect_error([] { parse_rate("1.2.3G", "--net"); }, "got '1.2.3G'");
  expect_error([] { parse_rate("G", "--net"); }, "got 'G'");
}

TEST(PlanUnits, SizesUseBinaryUnitsLikeRamBudget) {
  // k3 plan's sizes go through k3::parse_size, so --ram 1.5T means 1.5 TiB.
  EXPECT_EQ(k3::parse_size("1.5T", "--ram"), uint64_t(1.5 * double(uint64_t(1) << 40)));
  expect_error([] { k3::parse_size("80Q", "--gpu-mem"); }, "--gpu-mem must be a size like 512M");
}

TEST(PlanUnits, MicrosecondFlags) {
  EXPECT_DOUBLE_EQ(parse_micros("15", "--sync-us"), 15);
  EXPECT_DOUBLE_EQ(parse_micros("2.5us", "--sync-us"), 2.5);
  expect_error([] { parse_micros("-1", "--sync-us"); }, "--sync-us must be positive");
  expect_error([] { parse_micros("5ms", "--coll-us"); }, "--coll-us must be a positive number of microseconds");
}

// ---------------------------------------------------------------- machine

TEST(PlanMachine, GpuCountsAndKinds) {
  const GpuCount a = parse_gpus("8xH200");
  EXPECT_EQ(a.count, 8);
  EXPECT_EQ(a.spec->name, "H200");
  const GpuCount b = parse_gpus("2xH100-80G");
  EXPECT_EQ(b.count, 2);
  EXPECT_EQ(b.spec->name, "H100-80G");
  EXPECT_EQ(b.spec->hbm_bytes, 80'000'000'000ULL);
  EXPECT_EQ(parse_gpus("h200").count, 1);
  EXPECT_EQ(parse_gpus("none").count, 0);
  EXPECT_EQ(parse_gpus("0").count, 0);
  for (const GpuSpec& g : known_gpus()) {
    EXPECT_GT(g.hbm_bytes, 0u) << g.name;
    EXPECT_GT(g.hbm_Bps, 0) << g.name;
    EXPECT_GT(g.bf16_flops, 0) << g.name;
    EXPECT_GT(g.pcie_Bps, 0) << g.name;
    EXPECT_NE(g.source.find("datasheet"), std::string::npos) << g.name;
  }
  EXPECT_EQ(gpu_table_key("NVIDIA H200"), "H200");
  EXPECT_EQ(gpu_table_key("NVIDIA H100 PCIe"), "H100-PCIE");
  EXPECT_EQ(gpu_table_key("NVIDIA H100 80GB HBM3"), "H100-80G");
  EXPECT_EQ(gpu_table_key("NVIDIA GeForce RTX 4090"), "");
}

TEST(PlanMachine, BadGpuSpecsAreOneLineErrors) {
  expect_error([] { parse_gpus("8xB300"); }, "unknown GPU 'B300' (known: H200, H100-80G, H100-PCIE, A100-80G");
  expect_error([] { parse_gpus("0xH200"); }, "--gpus count (in 0xH200) must be a whole number 1..64, got '0'");
  expect_error([] { parse_gpus("99xH200"); }, "must be a whole number 1..64, got '99'");
  expect_error([] { parse_gpus("RTX6000"); }, "unknown GPU 'RTX6000'");
}

TEST(PlanMachine, FlagsOverDetectedOverDefaults) {
  DetectedMachine here;
  here.cores = 2;
  here.ram_bytes = uint64_t(24) << 30;
  MachineFlags f;
  Machine m = build_machine(f, here);
  EXPECT_EQ(m.gpus_per_node, 0);
  EXPECT_EQ(m.cores.value, 2);
  EXPECT_EQ(m.ram.value, uint64_t(24) << 30);
  EXPECT_DOUBLE_EQ(m.cpu_bw.value, kDefaultCpuBw);
  EXPECT_NE(m.cpu_bw.source.find("assumed"), std::string::npos);
  f.gpus = "2xH100-80G";
  f.ram = "1.5T";
  f.cpu_bw = "921.6G";
  f.cores = "96";
  f.gpu_mem = "64G";
  f.pcie = "55G";
  m = build_machine(f, here);
  EXPECT_EQ(m.gpus_per_node, 2);
  EXPECT_EQ(m.gpu_mem.value, uint64_t(64) << 30);  // the cap, below 80 GB
  EXPECT_EQ(m.ram.value, k3::parse_size("1.5T", "r"));
  EXPECT_DOUBLE_EQ(m.cpu_bw.value, 921.6e9);
  EXPECT_EQ(m.cores.value, 96);
  EXPECT_DOUBLE_EQ(m.pcie.value, 55e9);
  EXPECT_DOUBLE_EQ(m.net.value, kDefaultNet);
  f.gpu_mem = "200G";  // above the GPU's memory: capped at it
  EXPECT_EQ(build_machine(f, here).gpu_mem.value, 80'000'000'000ULL);
}

TEST(PlanMachine, BadMachineFlagsAreOneLineErrors) {
  DetectedMachine here;
  here.cores = 2;
  here.ram_bytes = uint64_t(24) << 30;
  const auto with = [&](auto set) {
    MachineFlags f;
    set(f);
    return [f, here] { build_machine(f, here); };
  };
  expect_error(with([](MachineFlags& f) { f.gpu_mem = "80G"; }), "--gpu-mem 80G given, but there is no GPU");
  expect_error(with([](MachineFlags& f) { f.nodes = 2; }), "--nodes 2 needs --gpus");
  expect_error(with([](MachineFlags& f) { f.ram_budget = "100G"; }),
               "--ram-budget 100G (100.00 GiB) exceeds the host RAM");
  expect_error(with([](MachineFlags& f) { f.cores = "many"; }), "--cores must be a whole number 1..4096, got 'many'");
  expect_error(with([](MachineFlags& f) { f.cpu_bw = "fast"; }), "--cpu-bw must be a rate");
  expect_error(with([](MachineFlags& f) { f.pcie = "55G"; }), "--pcie 55G given, but there is no GPU");
  expect_error(with([](MachineFlags& f) { f.gpus = "4xV100"; }), "unknown GPU 'V100'");
  expect_error(with([](MachineFlags& f) { f.ram = "lots"; }), "--ram must be a size like 512M");
}

// ---------------------------------------------------------------- sizes

TEST(PlanSizes, K3SizesComeFromArchStats) {
  const ModelSizes& s = k3sizes();
  EXPECT_EQ(s.layers, 93);
  EXPECT_EQ(s.moe_layers, 92);
  EXPECT_EQ(s.experts, 896);
  EXPECT_EQ(s.top_k, 16);
  EXPECT_TRUE(s.experts_mxfp4);
  // MXFP4: 4-bit codes + one E8M0 byte per 32 weights (spec §2.9: 17,547,264 B per expert).
  EXPECT_DOUBLE_EQ(s.expert_bytes, s.expert_params * (0.5 + 1.0 / 32));
  EXPECT_DOUBLE_EQ(s.expert_bytes, 17547264.0);
  EXPECT_DOUBLE_EQ(s.trunk_bytes, 2 * s.trunk_params);
  // The engine's fp32 state (spec §5: 464,633,856 B of KDA state, 27,648 B/token bf16 MLA = 55,296 fp32).
  EXPECT_DOUBLE_EQ(s.kda_state_bytes, 464633856.0);
  EXPECT_DOUBLE_EQ(s.mla_bytes_per_token, 55296.0);
  // FP8 trunk: 1 B + an fp32 scale per 128 x 128 block for the trunk matrices; the router
  // (896 x 7168 per MoE layer) and the lm_head stay bf16.
  const Fp8Trunk f = fp8_trunk(s);
  const double router = 896.0 * 7168 * 92;
  EXPECT_DOUBLE_EQ(s.router_params, router);
  EXPECT_DOUBLE_EQ(f.trunk_bytes, (s.trunk_params - router) * (1 + 4.0 / 16384) + 2 * router);
  EXPECT_DOUBLE_EQ(f.lm_head_bytes, s.lm_head_bytes);
  EXPECT_GT(f.trunk_bytes / s.trunk_bytes, 0.5);
  EXPECT_LT(f.trunk_bytes / s.trunk_bytes, 0.52);
  // On a GPU (gpu_weight_bytes): a scale per row and 128 columns, and the 24 MLA layers' kv_b_proj
  // (96 heads x (128 + 128) x 512) in fp32.
  const double kv_b = 24.0 * 96 * 256 * 512;
  EXPECT_DOUBLE_EQ(s.kv_b_params, kv_b);
  const Fp8Trunk g = fp8_trunk(s, true);
  EXPECT_DOUBLE_EQ(g.trunk_bytes, (s.trunk_params - router - kv_b) * (1 + 4.0 / 128) + 4 * kv_b + 2 * router);
  EXPECT_DOUBLE_EQ(g.shared_bytes, s.shared_params * (1 + 4.0 / 128));
}

TEST(PlanSizes, HeadersGiveStoredBytesWhenPresent) {
  const std::string nano = std::string(K3_SOURCE_DIR) + "/models/k3-nano";
  const k3::ModelConfig c = k3::load_model_config(nano);
  const ModelSizes cfg_only = model_sizes(c, ""), with_headers = model_sizes(c, nano);
  EXPECT_NE(with_headers.bytes_source.find("safetensors headers"), std::string::npos);
  // K3-nano stores its trunk in bf16 and experts in MXFP4, so both ways agree closely (fp32 vectors differ).
  EXPECT_NEAR(with_headers.expert_bytes / cfg_only.expert_bytes, 1.0, 1e-9);
  EXPECT_NEAR(with_headers.trunk_bytes / cfg_only.trunk_bytes, 1.0, 0.05);
}

// ---------------------------------------------------------------- formulas vs simulation

TEST(PlanFormula, DistinctExpertsMatchUniformRoutingSimulation) {
  std::mt19937_64 rng(5);
  const int64_t E = 896, k = 16;
  std::vector<int> ids(E);
  for (const int64_t B : {1, 2, 8, 32, 128}) {
    double sum = 0;
    const int trials = 400;
    for (int t = 0; t < trials; ++t) {
      std::vector<char> seen(E, 0);
      for (int64_t b = 0; b < B; ++b) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int64_t j = 0; j < k; ++j) {  // k distinct experts per token (partial Fisher-Yates)
          std::uniform_int_distribution<int64_t> pick(j, E - 1);
          std::swap(ids[size_t(j)], ids[size_t(pick(rng))]);
          seen[size_t(ids[size_t(j)])] = 1;
        }
      }
      sum += double(std::count(seen.begin(), seen.end(), 1));
    }
    const double sim = sum / trials, formula = expected_distinct_experts(E, k, double(B));
    EXPECT_NEAR(formula, sim, 0.01 * sim) << "B = " << B;
  }
  EXPECT_NEAR(expected_distinct_experts(E, k, 1), double(k), 1e-12);
  EXPECT_DOUBLE_EQ(expected_distinct_experts(E, k, 0), 0);
  EXPECT_NEAR(expected_distinct_experts(E, k, 1e5), double(E), 1e-6);
}

TEST(PlanFormula, BusiestShardMatchesSimulation) {
  std::mt19937_64 rng(9);
  const int64_t E = 896;
  for (const auto& [ranks, picks] : std::vector<std::pair<int64_t, int64_t>>{{16, 16}, {16, 393}, {8, 16}, {2, 100}}) {
    const int64_t per = E / ranks;
    std::vector<int> ids(E);
    double sum = 0;
    const int trials = 4000;
    for (int t = 0; t < trials; ++t) {
      std::iota(ids.begin(), ids.end(), 0);
      std::vector<int> load(size_t(ranks), 0);
      for (int64_t j = 0; j < picks; ++j) {
        std::uniform_int_distribution<int64_t> pick(j, E - 1);
        std::swap(ids[size_t(j)], ids[size_t(pick(rng))]);
        ++load[size_t(ids[size_t(j)] / per)];
      }
      sum += *std::max_element(load.begin(), load.end());
    }
    const double sim = sum / trials, formula = expected_max_shard_load(E, ranks, double(picks));
    // The formula treats the shards' counts as independent: within 5% of the simulation here.
    EXPECT_NEAR(formula, sim, 0.05 * sim) << ranks << " ranks, " << picks << " picks";
    EXPECT_GE(formula, double(picks) / double(ranks));
  }
  EXPECT_DOUBLE_EQ(expected_max_shard_load(E, 1, 16), 16);
}

// ---------------------------------------------------------------- arithmetic

TEST(PlanArithmetic, HybridDecodeBatch1IsTheDocumentedFormula) {
  const ModelSizes& s = k3sizes();
  const Machine m = one_gpu(141e9);
  const Rates r = round_rates();
  PlanRequest q;
  q.ctx = 4096;
  const Plan p = evaluate(k3cfg(), s, m, r, q, "hybrid", 1, 1);
  ASSERT_TRUE(p.fits) << p.why_not;
  const DecodeTerms& d = p.decode1;
  const double nm = 92, eb = s.expert_bytes, E = 896;
  // GPU budget: trunk + embedding + lm_head + one sequence's state + workspace + reserve; the rest caches experts.
  const double state = s.kda_state_bytes + 4096 * s.mla_bytes_per_token;
  const double base = s.trunk_bytes + s.embed_bytes + s.lm_head_bytes + state + p.gpu_workspace + p.gpu_reserve;
  near_rel(p.gpu_cache, 141e9 - base);
  const double hit = std::floor(p.gpu_cache / eb) * eb / (nm * E * eb);
  near_rel(p.hit, hit);
  near_rel(d.gpu_trunk, (s.trunk_bytes + s.lm_head_bytes) / 2e12);  // bytes-bound at one row
  near_rel(d.gpu_shared, d.gpu_trunk * (nm * s.shared_bytes) / (s.trunk_bytes + s.lm_head_bytes));
  near_rel(d.gpu_state, (2 * s.kda_state_bytes + 4096 * s.mla_bytes_per_token) / 2e12);
  EXPECT_NEAR(d.distinct, 16, 1e-12);
  near_rel(d.gpu_experts, nm * hit * 16 * (eb / 1e12));
  near_rel(d.cpu_experts, std::max(nm * (1 - hit) * 16 * eb / 2.5e11, 2 * 16 * (1 - hit) * s.expert_params * nm / 1e13));
  {  // --cpu-experts-q8: the fast (8-bit activation) expert GEMV rate instead of the fp32 one
    PlanRequest q8 = q;
    q8.cpu_experts_q8 = true;
    const Plan p8 = evaluate(k3cfg(), s, m, r, q8, "hybrid", 1, 1);
    near_rel(p8.decode1.cpu_experts,
             std::max(nm * (1 - hit) * 16 * eb / 5e11, 2 * 16 * (1 - hit) * s.expert_params * nm / 1e13));
  }
  EXPECT_DOUBLE_EQ(d.disk, 0);  // 2 TiB of RAM holds every expert
  near_rel(d.pcie, nm * (2 * 3584 * 4 + 16 * 8) / 5e10);
  near_rel(d.sync, nm * 2e-5);
  near_rel(d.gpu_layers, 93 * 7e-5);  // every decoder layer's work besides its weight reads
  const double gpu = d.gpu_trunk + d.gpu_state + d.gpu_experts + d.gpu_layers,
               beside = d.gpu_shared + d.gpu_experts;
  near_rel(d.gpu_total, gpu);
  near_rel(d.serial, gpu - beside + std::max(beside, d.cpu_experts) + d.pcie + d.sync);
  near_rel(d.ideal, std::max(gpu, d.cpu_experts) + d.pcie + d.sync);
  EXPECT_DOUBLE_EQ(d.step, d.serial);  // one sequence: no second micro-batch to overlap with
  near_rel(d.tokens_per_s, 1 / d.step);
  EXPECT_FALSE(d.arithmetic.empty());
}

TEST(PlanArithmetic, BatchedDecodeTakesTheFasterOfOneOrTwoMicroBatches) {
  const ModelSizes& s = k3sizes();
  const Rates r = round_rates();
  PlanRequest q;
  q.ctx = 1024;
  q.batch = 32;
  const Plan p = evaluate(k3cfg(), s, one_gpu(141e9), r, q, "hybrid", 1, 1);
  ASSERT_TRUE(p.fits) << p.why_not;
  const DecodeTerms& d = p.decodeB;
  near_rel(d.distinct, 896 * (1 - std::pow(1 - 16.0 / 896, 32)));
  // 32 rows: the trunk is compute-bound at 1e14 FLOP/s only if 2 x params x 32 / 1e14 > bytes / 2e12.
  const double tb = s.trunk_bytes + s.lm_head_bytes, tp = s.trunk_params + s.lm_head_params;
  near_rel(d.gpu_trunk, std::max(tb / 2e12, 2 * tp * 32 / 1e14));
  // Two micro-batches of 16: each reads the trunk once, so the overlapped form costs at least two
  // trunk passes of 16 rows on the GPU side.
  ASSERT_GT(d.overlapped, 0);
  EXPECT_GE(d.overlapped, 2 * std::max(tb / 2e12, 2 * tp * 16 / 1e14));
  EXPECT_DOUBLE_EQ(d.step, std::min(d.serial, d.overlapped));
  near_rel(d.tokens_per_s, 32 / d.step);
}

TEST(PlanArithmetic, CpuOnlyDecodeAndPrefill) {
  const ModelSizes& s = k3sizes();
  Machine m = one_gpu(141e9);
  m.ram = {uint64_t(1) << 40, "test"};  // 1 TiB: the routed experts do not all fit
  const Rates r = round_rates();
  PlanRequest q;
  q.ctx = 4096;
  const Plan p = evaluate(k3cfg(), s, m, r, q, "cpu", 1, 1);
  ASSERT_TRUE(p.fits) << p.why_not;
  const double budget = double(uint64_t(1) << 40) - double(uint64_t(32) << 30);  // 5% > 32 GiB: 32 GiB kept
  near_rel(p.host_budget, budget);
  const double fixed = s.trunk_bytes + s.lm_head_bytes + s.embed_bytes + s.kda_state_bytes +
                       4096 * s.mla_bytes_per_token + k3::plan::host_scratch_bytes(k3cfg(), 4096, 512);
  const double total = s.experts_total_bytes(), f_ram = (budget - fixed) / total;
  near_rel(p.frac_ram, f_ram);
  const DecodeTerms& d = p.decode1;
  const double trunk =
      std::max((s.trunk_bytes + s.lm_head_bytes) / 4e11, 2 * (s.trunk_params + s.lm_head_params) / 5e12);
  const double state = (2 * s.kda_state_bytes + 4096 * s.mla_bytes_per_token) / 4e11;
  const double bytes = 92 * 16 * s.expert_bytes;
  const double experts = std::max(bytes / 5e11, 2 * 16 * s.expert_params * 92 / 1e13);
  const double disk = bytes * (1 - f_ram) / 5e9;
  near_rel(d.step, trunk + state + experts + disk, 1e-9);
  // Prefill: 4096 tokens in one chunk, compute + the chunk's expert reads from disk.
  const PrefillTerms& f = p.prefill;
  EXPECT_EQ(f.chunk, 4096);
  const double flops_trunk = 2 * s.trunk_params + 2 * s.lm_head_params / 4096;
  const double flops_exp = 2 * 16 * s.expert_params * 92;
  const double D = 896 * (1 - std::pow(1 - 16.0 / 896, 4096));
  near_rel(f.seconds, 4096 * (flops_trunk / 5e12 + flops_exp / 1e13) + 92 * D * s.expert_bytes * (1 - f_ram) / 5e9,
           1e-9);
}

TEST(PlanArithmetic, PrefillPicksStreamingOrCpuExpertsByTheRates) {
  const ModelSizes& s = k3sizes();
  PlanRequest q;
  q.ctx = 1024;
  q.prompt = 4096;
  Rates r = round_rates();
  // A large GPU (room for the chunk's workspace and the staging) and a slow CPU: streaming wins.
  r.cpu_expert_flops = r.cpu_expert_prefill_flops = v(1e11);
  const Plan a = evaluate(k3cfg(), s, one_gpu(400e9), r, q, "hybrid", 1, 1);
  ASSERT_TRUE(a.fits);
  EXPECT_TRUE(a.prefill.b_possible);
  EXPECT_LT(a.prefill.b_total, a.prefill.a_total);
  EXPECT_DOUBLE_EQ(a.prefill.seconds, a.prefill.b_total);
  EXPECT_NE(a.prefill.choice.find("stream experts to the GPU"), std::string::npos) << a.prefill.choice;
  // B per chunk = max(compute, stream, disk); stream = layers x distinct/EP x misses x bytes / PCIe.
  const double D = 896 * (1 - std::pow(1 - 16.0 / 896, double(a.prefill.chunk)));
  near_rel(a.prefill.b_stream, 92 * D * (1 - a.hit) * s.expert_bytes / 5e10);
  // A fast CPU and a slow PCIe link: the CPU computes the experts.
  r = round_rates();
  r.pcie_Bps = v(1e9);
  const Plan b = evaluate(k3cfg(), s, one_gpu(400e9), r, q, "hybrid", 1, 1);
  EXPECT_DOUBLE_EQ(b.prefill.seconds, b.prefill.a_total);
  EXPECT_NE(b.prefill.choice.find("CPU computes experts"), std::string::npos) << b.prefill.choice;
  // A: chunks x max(GPU, CPU) + min(GPU, CPU) + chunks x (PCIe + sync).
  const PrefillTerms& f = b.prefill;
  near_rel(f.a_total, f.chunks * std::max(f.a_gpu, f.a_cpu) + std::min(f.a_gpu, f.a_cpu) + f.chunks * f.a_pcie);
}

TEST(PlanArithmetic, TensorAndExpertParallelOverTwoNodes) {
  const ModelSizes& s = k3sizes();
  Machine m = one_gpu(141e9);
  m.nodes = 2;
  m.gpus_per_node = 8;
  const Rates r = round_rates();
  PlanRequest q;
  q.ctx = 4096;
  q.tp = 16;
  q.ep = 16;
  const PlanResult res = make_plan(k3cfg(), s, m, r, q);
  const Plan& p = res.best;
  EXPECT_EQ(p.kind, "gpu");
  EXPECT_EQ(p.world, 16);
  const double per_gpu = (s.trunk_bytes + s.embed_bytes + s.lm_head_bytes) / 16 + s.experts_total_bytes() / 16;
  near_rel(p.gpu_weights, per_gpu);
  const DecodeTerms& d = p.decode1;
  near_rel(d.gpu_trunk, (s.trunk_bytes + s.lm_head_bytes) / 16 / 2e12);
  near_rel(d.max_shard, expected_max_shard_load(896, 16, 16));
  // All-reduce across nodes: latency + 2 (8-1)/8 x bytes / NVLink + 2 (2-1)/2 x (bytes / 8) / network.
  const double ar_bytes = 7168 * 2;
  const double ar = 3e-5 + 2.0 * 7 / 8 * ar_bytes / 4e11 + 2.0 * 1 / 2 * (ar_bytes / 8) / 4e10;
  // All-to-all: each rank sends 1/16 of a token's 16 latents; 7/16 of it inside the node, 8/16 across.
  const double a2a_bytes = 1.0 / 16 * 16 * 3584 * 2;
  const double a2a = 3e-5 + std::max(a2a_bytes * 7 / 16 / 4e11, a2a_bytes * 8 / 16 / 4e10);
  near_rel(d.comm, 2 * 93 * ar + 2 * 92 * a2a, 1e-9);
  near_rel(d.gpu_layers, 93 * 7e-5);
  near_rel(d.step, d.gpu_trunk + d.gpu_state + d.gpu_experts + d.comm + d.gpu_layers, 1e-9);
}

// ---------------------------------------------------------------- fits

TEST(PlanFit, GpuTrunkBoundaryIsExact) {
  const ModelSizes& s = k3sizes();
  const Rates r = round_rates();
  PlanRequest q;
  const Plan big = evaluate(k3cfg(), s, one_gpu(1e12), r, q, "hybrid", 1, 1);
  const double base = big.gpu_weights + big.gpu_state + big.gpu_workspace + big.gpu_reserve;
  EXPECT_TRUE(evaluate(k3cfg(), s, one_gpu(std::ceil(base)), r, q, "hybrid", 1, 1).fits);
  const Plan tight = evaluate(k3cfg(), s, one_gpu(std::floor(base) - 1000), r, q, "hybrid", 1, 1);
  EXPECT_FALSE(tight.fits);
  EXPECT_NE(tight.why_not.find("GPU trunk: trunk + embedding + lm_head"), std::string::npos) << tight.why_not;
  EXPECT_NE(tight.why_not.find("over by 1.00 KB"), std::string::npos) << tight.why_not;
  // The FP8 trunk halves what the GPU must hold: it fits an 80 GB GPU where bf16 does not.
  q.trunk_fp8 = true;
  EXPECT_TRUE(evaluate(k3cfg(), s, one_gpu(80e9), r, q, "hybrid", 1, 1).fits);
  q.trunk_fp8 = false;
  EXPECT_FALSE(evaluate(k3cfg(), s, one_gpu(80e9), r, q, "hybrid", 1, 1).fits);
}

TEST(PlanFit, RamBudgetSendsExpertsToDisk) {
  const ModelSizes& s = k3sizes();
  Machine m = one_gpu(141e9);
  m.ram_budget = uint64_t(512) << 30;
  const Plan p = evaluate(k3cfg(), s, m, round_rates(), PlanRequest{}, "hybrid", 1, 1);
  ASSERT_TRUE(p.fits);
  const double need = s.experts_total_bytes() * (1 - p.frac_gpu);
  near_rel(p.frac_disk, (1 - p.frac_gpu) * (1 - double(uint64_t(512) << 30) / need));
  EXPECT_GT(p.decode1.disk, 0);
}

TEST(PlanFit, ForcedPlacementsThatDoNotFitSayBy) {
  const ModelSizes& s = k3sizes();
  PlanRequest q;
  q.placement = "gpu";
  expect_error([&] { make_plan(k3cfg(), s, one_gpu(141e9), round_rates(), q); },
               "nothing fits: all on GPUs: per GPU trunk");
  Machine small = one_gpu(80e9, uint64_t(64) << 30);
  q.placement = "auto";
  expect_error([&] { make_plan(k3cfg(), s, small, round_rates(), q); }, "nothing fits: all on GPUs: per GPU trunk");
  expect_error([&] { make_plan(k3cfg(), s, small, round_rates(), q); }, "; GPU trunk: trunk + embedding + lm_head");
  expect_error([&] { make_plan(k3cfg(), s, small, round_rates(), q); }, "; CPU only: trunk + embedding + lm_head");
  q.placement = "cpu";
  expect_error([&] { make_plan(k3cfg(), s, small, round_rates(), q); }, "of host budget");
}

// ---------------------------------------------------------------- requests

TEST(PlanErrors, BadRequestsAreOneLineErrors) {
  const ModelSizes& s = k3sizes();
  const Rates r = round_rates();
  Machine eight = one_gpu(141e9);
  eight.gpus_per_node = 8;
  const auto plan = [&](const Machine& m, auto set) {
    PlanRequest q;
    set(q);
    return [&, q] { make_plan(k3cfg(), s, m, r, q); };
  };
  expect_error(plan(eight, [](PlanRequest& q) { q.ctx = 2000000; }),
               "--ctx 2000000 exceeds the model's max_position_embeddings (1048576)");
  expect_error(plan(eight, [](PlanRequest& q) { q.tp = 3; }), "--tp 3 does not divide the 8 GPUs");
  expect_error(plan(eight, [](PlanRequest& q) { q.ep = 5; }), "--ep 5 does not divide the 8 GPUs");
  Machine ten = eight;
  ten.gpus_per_node = 10;
  expect_error(plan(ten, [](PlanRequest& q) { q.tp = 5; }), "--tp 5: the 96 MLA / 96 KDA heads do not split 5 ways");
  expect_error(plan(ten, [](PlanRequest& q) { q.ep = 10; }), "--ep 10: the 896 experts do not split 10 ways");
  Machine none = one_gpu(141e9);
  none.gpus_per_node = 0;
  none.gpu.reset();
  expect_error(plan(none, [](PlanRequest& q) { q.placement = "hybrid"; }), "--placement hybrid needs a GPU");
  expect_error(plan(none, [](PlanRequest& q) { q.tp = 2; }), "--tp/--ep need GPUs");
  expect_error(plan(eight, [](PlanRequest& q) { q.expert_hit = 1.5; }), "--expert-hit must be a fraction 0..1");
  expect_error(plan(eight, [](PlanRequest& q) { q.placement = "tpu"; }),
               "--placement must be auto, gpu, hybrid or cpu");
}

TEST(PlanErrors, ExpertHitOverridesTheUniformEstimate) {
  PlanRequest q;
  q.expert_hit = 0.5;
  const Plan p = evaluate(k3cfg(), k3sizes(), one_gpu(141e9), round_rates(), q, "hybrid", 1, 1);
  EXPECT_DOUBLE_EQ(p.hit, 0.5);
  EXPECT_NE(p.hit_source.find("--expert-hit 0.5"), std::string::npos);
  near_rel(p.decode1.gpu_experts, 92 * 0.5 * 16 * k3sizes().expert_bytes / 1e12);
}

// ---------------------------------------------------------------- calibration files and rates

namespace {
Calibration sample_calibration() {
  Calibration c;
  c.label = "test";
  c.date = "2026-12-04";
  CpuCalibration cpu;
  cpu.threads = 4;
  cpu.isa = "avx512";
  cpu.numerics = "fast";
  cpu.expert_gemv_Bps = 1.1e11;
  cpu.expert_gemm_flops = 2.2e12;
  cpu.expert_gemm_rows = 64;
  cpu.bf16_gemv_Bps = 1.3e11;
  cpu.bf16_gemm_flops = 1.4e12;
  cpu.mem_read_Bps = 1.5e11;
  cpu.mem_copy_Bps = 0.7e11;
  c.cpu = cpu;
  DiskCalibration d;
  d.seq_read_Bps = 3.3e9;
  d.method = "O_DIRECT";
  d.file_bytes = 1 << 20;
  c.disk = d;
  GpuCalibration g;
  g.name = "NVIDIA H200";
  g.table_name = "H200";
  g.hbm_copy_Bps = 4e12;
  g.trunk_gemv_Bps = 2.5e12;
  g.expert_gemv_Bps = 2.4e12;
  g.decode_flops = 2e13;
  g.gemm_flops = 5e13;
  g.expert_gemm_flops = 4e13;
  c.gpu = g;
  c.sources["gpu.trunk_gemv_Bps"] = "a record";
  return c;
}
std::string tmp(const std::string& tag) {
  return (fs::temp_directory_path() / ("k3plan_" + tag + "_" + std::to_string(::getpid()) + ".json")).string();
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
}  // namespace

TEST(PlanCalibration, RoundTripAndRatesFromIt) {
  const std::string path = tmp("roundtrip");
  write_calibration(sample_calibration(), path);
  const Calibration c = read_calibration(path);
  fs::remove(path);
  ASSERT_TRUE(c.cpu && c.disk && c.gpu);
  EXPECT_DOUBLE_EQ(c.cpu->expert_gemv_Bps, 1.1e11);
  EXPECT_EQ(c.cpu->expert_gemm_rows, 64);
  EXPECT_DOUBLE_EQ(c.disk->seq_read_Bps, 3.3e9);
  EXPECT_DOUBLE_EQ(c.gpu->expert_gemm_flops, 4e13);
  EXPECT_DOUBLE_EQ(c.gpu->pcie_h2d_Bps, 0);  // not measured: the machine's nominal PCIe is used
  const Rates r = derive_rates(one_gpu(141e9), &c, default_latencies());
  EXPECT_DOUBLE_EQ(r.gpu_trunk_Bps.value, 2.5e12);
  EXPECT_NE(r.gpu_trunk_Bps.source.find("gpu.trunk_gemv_Bps (a record)"), std::string::npos);
  EXPECT_DOUBLE_EQ(r.cpu_expert_Bps.value, 1.1e11);
  EXPECT_DOUBLE_EQ(r.disk_Bps.value, 3.3e9);
  EXPECT_DOUBLE_EQ(r.pcie_Bps.value, 64e9 * kEffPcie.value);
  EXPECT_NE(r.mode.find("gpu from it, cpu from it, disk from it"), std::string::npos) << r.mode;
}

TEST(PlanCalibration, NominalRatesAreFiguresTimesStatedEfficiencies) {
  Machine m = one_gpu(141e9);
  const Rates r = derive_rates(m, nullptr, default_latencies());
  EXPECT_EQ(r.mode, "nominal (no calibration)");
  EXPECT_DOUBLE_EQ(r.gpu_trunk_Bps.value, 4.8e12 * kEffGpuGemv.value);
  EXPECT_DOUBLE_EQ(r.gpu_gemm_flops.value, 989.5e12 * kEffGpuGemm.value);
  EXPECT_DOUBLE_EQ(r.pcie_Bps.value, 64e9 * kEffPcie.value);
  // 64 cores x 12.4 GB/s > 900 GB/s x 0.70: the memory bound.
  EXPECT_DOUBLE_EQ(r.cpu_expert_Bps.value, 900e9 * kEffCpuMem.value);
  m.cores = {8, "test"};  // 8 x 12.4 GB/s < 630 GB/s: the cores bound
  EXPECT_DOUBLE_EQ(derive_rates(m, nullptr, default_latencies()).cpu_expert_Bps.value, 8 * kCpuCoreExpertBps.value);
}

TEST(PlanCalibration, BadFilesAreOneLineErrors) {
  const std::string path = tmp("bad");
  expect_error([&] { read_calibration(path); }, path + ": calibration file not found");
  write_text(path, "[1, 2");
  expect_error([&] { read_calibration(path); }, ": not a JSON object");
  write_text(path, R"({"label": "x"})");
  expect_error([&] { read_calibration(path); }, "not a k3 plan calibration file");
  write_text(path, R"({"k3_calibration": 9, "label": "x"})");
  expect_error([&] { read_calibration(path); }, "calibration version 9");
  std::string good = calibration_json(sample_calibration());
  const auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    t.replace(at, from.size(), to);
    write_text(path, t);
  };
  edit("\"trunk_gemv_Bps\": 2500000000000.0", "\"trunk_gemv_Bps\": -1");
  expect_error([&] { read_calibration(path); }, "gpu.trunk_gemv_Bps must be positive, got -1");
  edit("\"expert_gemv_Bps\": 110000000000.0,", "");
  expect_error([&] { read_calibration(path); }, "cpu.expert_gemv_Bps is missing");
  edit("\"pcie_h2d_Bps\": null", "\"pcie_h2d_Bps\": 5e10");
  expect_error([&] { read_calibration(path); }, "gpu.pcie_h2d_Bps and gpu.pcie_d2h_Bps come together");
  fs::remove(path);
  // A calibration of one GPU kind used for another.
  const Calibration c = sample_calibration();
  Machine h100 = one_gpu(80e9);
  h100.gpu = find_gpu("H100-80G");
  expect_error([&] { derive_rates(h100, &c, default_latencies()); },
               "was measured on NVIDIA H200 (H200), but the planned GPU is H100-80G");
}

TEST(PlanCalibration, DefaultPathFollowsXdg) {
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  setenv("XDG_CACHE_HOME", "/tmp/xdg-test", 1);
  EXPECT_EQ(default_calibration_path(), "/tmp/xdg-test/k3/calibration.json");
  unsetenv("XDG_CACHE_HOME");
  if (const char* h = std::getenv("HOME")) {
    EXPECT_EQ(default_calibration_path(), std::string(h) + "/.cache/k3/calibration.json");
  }
  if (!saved.empty()) setenv("XDG_CACHE_HOME", saved.c_str(), 1);
}

TEST(PlanSizes, NotRunnableFamilyMembersAreRefused) {
  // A family member the engine does not implement (tied embeddings) is refused by check_supported.
  std::ifstream in(kK3Config + "/config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const auto at = text.find("\"tie_word_embeddings\": false");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, std::string("\"tie_word_embeddings\": false").size(), "\"tie_word_embeddings\": true");
  const k3::ModelConfig c = k3::parse_model_config(text, "tied.json");
  expect_error([&] { model_sizes(c, ""); }, "tied.json: ");
}

#include "model/model.h"

namespace {

// The routed-expert bytes `k3 plan` and `k3 info --cpu-experts` place (model_sizes, from the headers)
// are the engine's own: every weight the bound model visits as WeightRole::RoutedExpert, which is
// what gpu_memory_plan leaves on the host with GpuOptions::experts_on_cpu.
TEST(PlanSizes, RoutedExpertBytesAreTheEnginesOwn) {
  for (const std::string rel : {"models/k3-nano", "tests/fixtures/tiny", "tests/fixtures/tiny-flat"}) {
    SCOPED_TRACE(rel);
    const std::string dir = std::string(K3_SOURCE_DIR) + "/" + rel;
    const auto m = k3::Model::load(dir);
    uint64_t routed = 0;
    k3::for_each_weight(
        m->weights(),
        [&](const k3::WeightMat& w, k3::WeightRole role) {
          if (role == k3::WeightRole::RoutedExpert) routed += k3::weight_bytes(w);
        },
        [](const k3::FVec&) {});
    const ModelSizes s = model_sizes(m->config(), dir);
    EXPECT_GT(routed, 0u);
    EXPECT_EQ(uint64_t(s.experts_total_bytes()), routed);
  }
}

}  // namespace
