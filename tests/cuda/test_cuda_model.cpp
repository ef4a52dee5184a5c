// Whole-model gates on the GPU (--device cuda), the same ladder as tests/model/test_model_gates.cpp
// on the CPU: teacher-forced logits vs the fp64 reference, teacher-forced argmax, greedy ids,
// incremental decode (carried KDA state + MLA latent cache, CUDA graphs) == the full pass, in
// both GPU numerics: fp32 (parity mode) and fast (bf16 tensor-core GEMMs). Also: graphs ==
// no graphs bitwise, session copy/rollback/save/load of device state, and the fit error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/cuda_util.h"
#include "common/model_run.h"
#include "common/num_util.h"
#include "core/error.h"
#include "model/model.h"
#include "ops/cuda/runtime.h"

namespace fs = std::filesystem;
using k3test::full_pass;
using k3test::greedy;
using k3test::incremental;
using k3test::rel_l2;

namespace {

// Tolerances, stated once. fp32 parity mode: rel-L2 over all logits vs the fp64 reference (the
// issue's bar; the CPU's exact mode holds 1e-5). Paths of the same mode against each other
// (chunked vs recurrent KDA, prefill + decode vs one pass) are held to the same number.
constexpr double kFp32Tol = 1e-4;
// fast (bf16): activations rounded to bf16 in GEMMs of > 8 tokens. Gated on the trained K3-nano,
// where logits have real margins: 4e-2 over all logits, the teacher-forced argmax equal at >= 95%
// of the positions, and greedy tokens identical. Measured on the H200: 2.0e-3 with the base weights
// (2026-12-02), 3.03e-2 with the shipped chat-tuned weights (2026-12-03, no kernel change in
// between) and one flip in 48 positions (position 35, exact top-2 margin 0.47 of logits with rms
// 4.1), 1.47e-2 and no flip with the grouped expert GEMM of prefill (8ab9c46); the CPU's fast mode measures 1.6e-2 on
// the same ids, with the same flip (max |logit error| 1.39): the tuned weights are sensitive to bf16 activations, on
// either device. On the random tiny fixtures bf16 is reported, not gated: their generator only guarantees router top-k
// gaps of 1e-4, below bf16's 2^-9 rounding, so a rounded hidden state can select another expert and move the logits by
// tenths (0.29-0.43 measured, as on the CPU).
constexpr double kBf16Tol = 4e-2;
constexpr double kBf16ArgmaxAgree = 0.95;

fs::path tp_tiny() { return k3test::shared_dir_rt() / "fixtures/third-party/kimi-k3-in-c-tiny"; }
fs::path ours(const std::string& name) { return k3test::source_dir() / "tests/fixtures" / name; }
fs::path nano() { return k3test::source_dir() / "models/k3-nano"; }

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

k3::ForwardOptions mode(k3::ops::Numerics n, k3::KdaAlgo kda = k3::KdaAlgo::Chunked, int64_t chunk = 64) {
  k3::ForwardOptions o;
  o.numerics = n;
  o.kda_algo = kda;
  o.kda_chunk = chunk;
  return o;
}
const auto kF32 = k3::ops::Numerics::F32;
const auto kFast = k3::ops::Numerics::Fast;

std::unique_ptr<k3::Model> gpu_model(const fs::path& dir, bool graphs = true) {
  auto m = k3::Model::load(dir.string());
  k3::GpuOptions o;
  o.graphs = graphs;
  o.initial_context = 64;  // small: the cache must grow past it in the longer tests
  m->use_gpu(o);
  return m;
}

// The hybrid placement (issue 20): the trunk on the GPU, the routed experts in host memory computed
// by the CPU, and with hot > 0 that fraction of them also cached on the GPU after `warmup` tokens.
std::unique_ptr<k3::Model> hybrid_model(const fs::path& dir, double hot, int64_t warmup = 64) {
  auto m = k3::Model::load(dir.string());
  k3::GpuOptions o;
  o.initial_context = 64;
  o.experts_on_cpu = true;
  o.hot_experts = hot;
  o.hot_warmup_tokens = warmup;
  m->use_gpu(o);
  return m;
}

// 40 token ids spread over the vocabulary (never 0), the prompt of the placement gates.
std::vector<int32_t> ids40(const k3::Model& m) {
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(int32_t((i * 7919 + 13) % (m.dims().vocab - 1) + 1));
  return ids;
}

// Greedy with the pick made on the device (ForwardOptions::argmax_out): no logits come back.
std::vector<int32_t> greedy_on_device(const k3::Model& m, const std::vector<int32_t>& prompt, int n,
                                      k3::ForwardOptions o) {
  k3::Session s(m);
  int32_t tok = -1;
  o.argmax_out = &tok;
  m.forward(s, prompt.data(), int64_t(prompt.size()), false, nullptr, o);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(tok);
    m.forward(s, &out.back(), 1, false, nullptr, o);
  }
  return out;
}

std::vector<int32_t> argmax_rows(const std::vector<float>& l, size_t V) {
  std::vector<int32_t> r;
  for (size_t t = 0; t * V < l.size(); ++t)
    r.push_back(int32_t(std::max_element(l.begin() + std::ptrdiff_t(t * V), l.begin() + std::ptrdiff_t((t + 1) * V)) -
                        (l.begin() + std::ptrdiff_t(t * V))));
  return r;
}

// Prints one line per measured error so the device run records the numbers (scripts/cuda_test.sh).
void report(const std::string& what, double err, double tol) {
  if (tol > 0)
    std::printf("[gate] %-48s rel-L2 %.3e (tol %.0e)\n", what.c_str(), err, tol);
  else
    std::printf("[gate] %-48s rel-L2 %.3e (reported, not gated)\n", what.c_str(), err);
}

// Every decode path of one numerics mode against `base` (the fp64 reference logits).
// gated = false only reports the errors (bf16 on the random fixtures, see kBf16Tol).
void check_paths(const k3::Model& m, const std::vector<int32_t>& ids, const std::vector<float>& base,
                 k3::ops::Numerics n, double tol, const std::string& name, bool gated = true) {
  const std::string tag = name + (n == kF32 ? " fp32" : " bf16");
  const auto gate = [&](const std::string& what, double e) {
    report(tag + " " + what, e, gated ? tol : 0);
    if (gated) {
      EXPECT_LT(e, tol) << tag << " " << what;
    }
  };
  const auto full = full_pass(m, ids, mode(n));
  gate("full pass", rel_l2(full, base));
  gate("recurrent KDA", rel_l2(full_pass(m, ids, mode(n, k3::KdaAlgo::Recurrent)), base));
  gate("chunk 4", rel_l2(full_pass(m, ids, mode(n, k3::KdaAlgo::Chunked, 4)), base));
  for (size_t split : {size_t(1), size_t(5), ids.size() - 1})
    gate("prefill " + std::to_string(split) + " then decode", rel_l2(incremental(m, ids, split, mode(n)), base));
  // Teacher-forced argmax: equal to the reference at every position (fp32), or at >= 95% of them
  // (bf16; the positions that differ are printed).
  if (gated) {
    const size_t V = size_t(m.dims().vocab);
    const auto got = argmax_rows(full, V), want = argmax_rows(base, V);
    size_t same = 0;
    std::string flips;
    for (size_t t = 0; t < want.size(); ++t) {
      if (got[t] == want[t]) {
        ++same;
        continue;
      }
      std::vector<float> row(base.begin() + std::ptrdiff_t(t * V), base.begin() + std::ptrdiff_t((t + 1) * V));
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
      flips += " " + std::to_string(t) + " (margin " + std::to_string(row[0] - row[1]) + ")";
    }
    std::printf("[gate] %-48s %zu of %zu%s%s\n", (tag + " teacher-forced argmax").c_str(), same, want.size(),
                flips.empty() ? "" : "; differs at", flips.c_str());
    if (n == kF32) {
      EXPECT_EQ(got, want) << tag;
    } else {
      EXPECT_GE(double(same), kBf16ArgmaxAgree * double(want.size())) << tag << ": differs at" << flips;
    }
  }
}

}  // namespace

class CudaOwnFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaOwnFixture, GatesInBothModes) {
  K3_REQUIRE_GPU();
  const fs::path dir = ours(GetParam());
  ASSERT_TRUE(fs::exists(dir / "reference.json")) << "missing fixture " << dir;
  auto m = gpu_model(dir);
  const auto ref = read_json(dir / "reference.json");
  const auto ids = ref["ids"].get<std::vector<int32_t>>();
  const size_t V = size_t(m->dims().vocab);
  std::vector<float> expect(ids.size() * V);
  std::ifstream f(dir / ref["logits_file"].get<std::string>(), std::ios::binary);
  f.read(reinterpret_cast<char*>(expect.data()), std::streamsize(expect.size() * 4));
  ASSERT_TRUE(f) << "reference logits file too short";
  const auto& g = ref["greedy"];
  const auto prompt = g["prompt"].get<std::vector<int32_t>>();
  const auto want = g["ids"].get<std::vector<int32_t>>();
  check_paths(*m, ids, expect, kF32, kFp32Tol, GetParam());
  EXPECT_EQ(greedy(*m, prompt, g["n"].get<int>(), mode(kF32)), want) << "fp32 greedy";
  check_paths(*m, ids, expect, kFast, kBf16Tol, GetParam(), /*gated=*/false);
}

INSTANTIATE_TEST_SUITE_P(Tiny, CudaOwnFixture, ::testing::Values("tiny", "tiny-flat", "tiny-chat", "kl-tiny"));

TEST(CudaThirdPartyTiny, TeacherForcedGreedyAndLogitsHead) {
  K3_REQUIRE_GPU();
  if (!fs::exists(tp_tiny())) GTEST_SKIP() << "third-party fixtures absent: " << tp_tiny();
  auto m = gpu_model(tp_tiny());
  const auto e = read_json(tp_tiny() / "expected.json");
  const auto full = e["full_ids"].get<std::vector<int32_t>>();
  const auto prompt = e["prompt_ids"].get<std::vector<int32_t>>();
  const auto tf = e["tf_pred"].get<std::vector<int32_t>>();
  const size_t V = size_t(m->dims().vocab);
  for (auto n : {kF32, kFast}) {
    // bf16 on this random fixture is reported, not gated (see kBf16Tol).
    const bool gated = n == kF32;
    const std::string tag = gated ? "fp32" : "bf16";
    const auto logits = full_pass(*m, full, mode(n));
    const auto tf_got = argmax_rows(logits, V);
    double worst = 0;
    for (size_t t = 0; t < full.size(); ++t)
      for (size_t j = 0; j < 8; ++j)
        worst = std::max(worst, std::abs(double(logits[t * V + j]) - e["logits_head"][t][j].get<double>()));
    size_t tf_same = 0;
    for (size_t t = 0; t < tf.size(); ++t) tf_same += tf_got[t] == tf[t] ? 1 : 0;
    std::printf("[gate] third-party tiny %s logits head max |diff| %.3e, teacher-forced argmax %zu/%zu\n", tag.c_str(),
                worst, tf_same, tf.size());
    const auto gen = greedy(*m, prompt, int(full.size() - prompt.size()), mode(n));
    const std::vector<int32_t> want(full.begin() + std::ptrdiff_t(prompt.size()), full.end());
    if (gated) {
      EXPECT_EQ(tf_got, tf) << tag << " teacher-forced argmax";
      EXPECT_LT(worst, 1e-4) << "fp32 logits head";  // the CPU gate's bound
      EXPECT_EQ(gen, want) << tag << " greedy";
    }
    // Incremental decode (graphs) == the full pass of the same mode.
    const auto inc = incremental(*m, full, 3, mode(n));
    const double d = rel_l2(inc, logits);
    report("third-party tiny " + tag + " prefill 3 then decode vs full", d, gated ? kFp32Tol : 0);
    if (gated) {
      EXPECT_LT(d, kFp32Tol) << tag;
    }
  }
}

// The trained K3-nano (the embedded default): GPU vs the CPU exact path computed here.
TEST(CudaK3Nano, MatchesCpuExact) {
  K3_REQUIRE_GPU();
  if (!fs::exists(nano() / "config.json")) GTEST_SKIP() << "K3-nano absent: " << nano();
  auto cpu = k3::Model::load(nano().string());
  auto gpu = gpu_model(nano());
  std::vector<int32_t> ids;
  for (int i = 0; i < 48; ++i) ids.push_back(int32_t((i * 7919 + 13) % 2000 + 100));
  const auto base = full_pass(*cpu, ids, mode(k3::ops::Numerics::Exact));
  check_paths(*gpu, ids, base, kF32, kFp32Tol, "k3-nano");
  check_paths(*gpu, ids, base, kFast, kBf16Tol, "k3-nano");
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 12);
  const auto want = greedy(*cpu, prompt, 24, mode(k3::ops::Numerics::Exact));
  EXPECT_EQ(greedy(*gpu, prompt, 24, mode(kF32)), want) << "fp32 greedy";
  EXPECT_EQ(greedy(*gpu, prompt, 24, mode(kFast)), want) << "bf16 greedy";
  EXPECT_EQ(greedy_on_device(*gpu, prompt, 24, mode(kF32)), want) << "fp32 greedy, argmax on the device";
  EXPECT_EQ(greedy_on_device(*gpu, prompt, 24, mode(kFast)), want) << "bf16 greedy, argmax on the device";
}

// Issue 20's hybrid placement: the trunk on the GPU, the routed experts computed by the CPU from
// host memory (GpuOptions::experts_on_cpu). Against the CPU exact path: the fp32 gate in fp32, the
// bf16 gate in fast numerics, greedy ids identical; and against the all-GPU model, greedy ids
// identical.
TEST(CudaModel, ExpertsOnTheCpuGiveTheSameTokens) {
  K3_REQUIRE_GPU();
  for (const fs::path& dir : {ours("tiny"), nano()}) {
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << "absent: " << dir;
    SCOPED_TRACE(dir.filename().string());
    auto cpu = k3::Model::load(dir.string());
    auto all_gpu = gpu_model(dir);
    auto hybrid = hybrid_model(dir, 0);
    const std::vector<int32_t> ids = ids40(*cpu);
    const auto base = full_pass(*cpu, ids, mode(k3::ops::Numerics::Exact));
    const bool trained = dir == nano();  // the bf16 gate holds on the trained model (random tiny: reported)
    check_paths(*hybrid, ids, base, kF32, kFp32Tol, "experts on the CPU");
    check_paths(*hybrid, ids, base, kFast, kBf16Tol, "experts on the CPU", trained);
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 10);
    EXPECT_EQ(greedy(*hybrid, prompt, 16, mode(kF32)), greedy(*all_gpu, prompt, 16, mode(kF32)))
        << "fp32 greedy: experts on the CPU vs all on the GPU";
    if (!trained) continue;
    EXPECT_EQ(greedy(*hybrid, prompt, 16, mode(kF32)), greedy(*cpu, prompt, 16, mode(k3::ops::Numerics::Exact)))
        << "fp32 greedy, experts on the CPU, vs the CPU exact path";
    EXPECT_EQ(greedy(*hybrid, prompt, 16, mode(kFast)), greedy(*all_gpu, prompt, 16, mode(kFast)))
        << "bf16 greedy: experts on the CPU vs all on the GPU";
  }
}

// The hybrid placement's long prompts with their routed experts streamed to the GPU
// (GpuOptions::prefill_experts = Gpu): the experts a step selects copied from host memory in groups
// through two staging buffers and computed with the all-on-GPU kernels and tiles, so a prefill's
// logits are those of the all-GPU model bit for bit, in fp32 and in fast numerics, with the staging
// holding every expert of a layer or only 3 (many groups, both buffers in turn); then decode steps
// (on the CPU) continue to the same greedy ids as all on the GPU.
TEST(CudaModel, StreamedPrefillExpertsEqualAllOnTheGpu) {
  K3_REQUIRE_GPU();
  for (const fs::path& dir : {ours("tiny"), nano()}) {
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << "absent: " << dir;
    SCOPED_TRACE(dir.filename().string());
    auto all_gpu = gpu_model(dir);
    const std::vector<int32_t> ids = ids40(*all_gpu);
    size_t per_expert = 0;
    for (const k3::LayerWeights& l : all_gpu->weights().layers)
      if (!l.dense_ffn && !l.moe.experts.empty()) {
        const k3::GluWeights& f = l.moe.experts.front();
        per_expert = size_t(k3::weight_bytes(f.gate) + k3::weight_bytes(f.up) + k3::weight_bytes(f.down));
        break;
      }
    ASSERT_GT(per_expert, 0u);
    for (size_t staging : {size_t(2) << 30, 6 * per_expert}) {
      auto m = k3::Model::load(dir.string());
      k3::GpuOptions o;
      o.initial_context = 64;
      o.experts_on_cpu = true;
      o.prefill_experts = k3::GpuOptions::PrefillExperts::Gpu;
      o.stream_staging_bytes = staging;
      m->use_gpu(o);
      const std::string tag = "staging of " + std::to_string(staging / per_expert / 2) + " experts";
      for (auto n : {kF32, kFast}) {
        const auto a = full_pass(*m, ids, mode(n)), b = full_pass(*all_gpu, ids, mode(n));
        EXPECT_TRUE(a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0)
            << tag << (n == kF32 ? " fp32" : " bf16") << ": streamed prefill vs all on the GPU";
      }
      const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 20);
      EXPECT_EQ(greedy(*m, prompt, 12, mode(kF32)), greedy(*all_gpu, prompt, 12, mode(kF32)))
          << tag << ": fp32 greedy after a streamed prefill";
    }
  }
}

// The hybrid placement with a GPU cache of hot experts (GpuOptions::hot_experts): half of each MoE
// layer's routed experts chosen from the first 16 tokens' routing, then every decode step runs the
// cached experts' slots on the GPU while the CPU computes the others (MoeWeights::elsewhere; the
// host half is HotExperts.HostHalfLeavesTheCachedSlotsAndTheHalvesMakeTheWhole). Every decode path
// against the CPU exact path at the fp32 gate, greedy ids identical to all-GPU; the cache's stats:
// every layer filled with half its experts, some slots hit and some not.
TEST(CudaModel, HotExpertCacheGivesTheSameTokens) {
  K3_REQUIRE_GPU();
  for (const fs::path& dir : {ours("tiny"), nano()}) {
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << "absent: " << dir;
    SCOPED_TRACE(dir.filename().string());
    auto cpu = k3::Model::load(dir.string());
    auto all_gpu = gpu_model(dir);
    auto hot = hybrid_model(dir, 0.5, 16);
    const std::vector<int32_t> ids = ids40(*cpu);
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 20);  // fills the cache (>= 16 tokens)
    const auto want = greedy(*all_gpu, prompt, 16, mode(kF32));
    EXPECT_EQ(greedy(*hot, prompt, 16, mode(kF32)), want) << "fp32 greedy: hot experts vs all on the GPU";
    const k3::HotExpertStats st = hot->backend().hot_expert_stats();
    int64_t moe_layers = 0, experts = 0, half = 0;
    for (const k3::LayerWeights& l : cpu->weights().layers)
      if (!l.dense_ffn && !l.moe.experts.empty()) {
        ++moe_layers;
        experts += int64_t(l.moe.experts.size());
        half += int64_t(std::llround(0.5 * double(l.moe.experts.size())));
      }
    std::printf("[gate] hot experts %-40s %lld of %lld experts cached in %lld layers, %lld of %lld slots hit (%.1f%%)\n",
                dir.filename().string().c_str(), (long long)st.cached, (long long)st.experts, (long long)st.layers,
                (long long)st.hits, (long long)st.slots, 100.0 * st.hit_rate());
    EXPECT_EQ(st.layers, moe_layers);
    EXPECT_EQ(st.experts, experts);
    EXPECT_EQ(st.cached, half);
    EXPECT_GT(st.slots, 0);
    EXPECT_GT(st.hits, 0);
    EXPECT_LT(st.hits, st.slots);
    // Decode paths through the filled cache, against the CPU exact path (the fp32 gate).
    const auto base = full_pass(*cpu, ids, mode(k3::ops::Numerics::Exact));
    for (size_t split : {size_t(1), size_t(20), ids.size() - 1}) {
      const double e = rel_l2(incremental(*hot, ids, split, mode(kF32)), base);
      report("hot experts fp32 prefill " + std::to_string(split) + " then decode", e, kFp32Tol);
      EXPECT_LT(e, kFp32Tol);
    }
    if (dir == nano()) {
      EXPECT_EQ(greedy(*hot, prompt, 16, mode(kFast)), greedy(*all_gpu, prompt, 16, mode(kFast)))
          << "bf16 greedy: hot experts vs all on the GPU";
    }
  }
}

// Issue 20's FP8 trunk on the GPU (--trunk-fp8: E4M3 codes with an fp32 scale per row and 128
// columns, the MLA kv_b_proj decoded to fp32): the same ladder as MatchesCpuExact against the CPU's
// exact path on the same FP8 model (quantised by the same Model::quantize_trunk_fp8), greedy ids
// identical; and the plan counts the FP8 weights as uploaded.
TEST(CudaModel, TrunkFp8MatchesTheCpu) {
  K3_REQUIRE_GPU();
  for (const fs::path& dir : {ours("tiny"), nano()}) {
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << "absent: " << dir;
    SCOPED_TRACE(dir.filename().string());
    auto cpu = k3::Model::load(dir.string());
    cpu->quantize_trunk_fp8();
    auto gpu = k3::Model::load(dir.string());
    const k3::TrunkFp8Report rep = gpu->quantize_trunk_fp8();
    k3::GpuOptions o;
    o.initial_context = 64;
    o.sm_count = k3::cuda::sm_count();
    k3::cuda::sync();
    const size_t before = k3::cuda::dev_bytes_live();
    gpu->use_gpu(o);
    const size_t placed = k3::cuda::dev_bytes_live() - before;
    const k3::GpuMemoryPlan plan = k3::gpu_memory_plan(*gpu, o, o.initial_context);
    std::printf("[gate] FP8 trunk %-36s %lld matrices, host %llu B -> GPU %llu B; plan weights %zu B, placed %zu B\n",
                dir.filename().string().c_str(), (long long)rep.bytes.matrices,
                (unsigned long long)rep.bytes.after, (unsigned long long)rep.bytes.after_gpu, plan.weights, placed);
    EXPECT_GT(rep.bytes.matrices, 0);
    EXPECT_LE(double(plan.weights), double(placed));  // placed = weights (+ 256-byte alignment) + workspace
    const std::vector<int32_t> ids = ids40(*cpu);
    const auto base = full_pass(*cpu, ids, mode(k3::ops::Numerics::Exact));
    const bool trained = dir == nano();  // the bf16 gate holds on the trained model (random tiny: reported)
    check_paths(*gpu, ids, base, kF32, kFp32Tol, "FP8 trunk");
    check_paths(*gpu, ids, base, kFast, kBf16Tol, "FP8 trunk", trained);
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 10);
    const auto want = greedy(*cpu, prompt, 16, mode(k3::ops::Numerics::Exact));
    EXPECT_EQ(greedy(*gpu, prompt, 16, mode(kF32)), want) << "fp32 greedy vs the CPU's FP8 model";
    if (trained) {
      EXPECT_EQ(greedy(*gpu, prompt, 16, mode(kFast)), want) << "bf16 greedy vs the CPU's FP8 model";
    }
  }
}

TEST(CudaModel, GraphsEqualNoGraphsBitwise) {
  K3_REQUIRE_GPU();
  auto m = gpu_model(ours("tiny"));
  std::vector<int32_t> ids;
  for (int i = 0; i < 80; ++i) ids.push_back(int32_t((i * 31 + 7) % m->dims().vocab));
  for (auto n : {kF32, kFast}) {
    m->set_gpu_graphs(true);
    const auto with = incremental(*m, ids, 4, mode(n));  // 76 decode steps: the cache grows past 64
    m->set_gpu_graphs(false);
    const auto without = incremental(*m, ids, 4, mode(n));
    EXPECT_EQ(0, std::memcmp(with.data(), without.data(), with.size() * 4)) << "graph replay differs from launches";
  }
}

TEST(CudaModel, SessionCopyRollbackSaveLoad) {
  K3_REQUIRE_GPU();
  auto m = gpu_model(ours("tiny"));
  const size_t V = size_t(m->dims().vocab);
  const std::vector<int32_t> ids{5, 9, 2, 7, 11, 3, 8, 1};
  const auto o = mode(kF32);
  k3::Session s(*m);
  std::vector<float> l(V), a(V), b(V);
  m->forward(s, ids.data(), 4, false, l.data(), o);
  const k3::Session copy = s;  // device state copied on the device
  const auto mk = s.mark();
  m->forward(s, ids.data() + 4, 3, false, a.data(), o);
  s.rollback(mk);
  EXPECT_EQ(s.position(), 4);
  m->forward(s, ids.data() + 4, 3, false, b.data(), o);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), V * 4)) << "rollback";
  k3::Session c2 = copy;
  m->forward(c2, ids.data() + 4, 3, false, b.data(), o);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), V * 4)) << "session copy";
  std::stringstream img;
  copy.save(img);
  k3::Session loaded(*m);
  loaded.load(img);
  EXPECT_EQ(loaded.position(), 4);
  m->forward(loaded, ids.data() + 4, 3, false, b.data(), o);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), V * 4)) << "save/load";
}

// The GPU memory plan (k3 info's GPU line, gpu_memory_plan) counts what the engine allocates: after
// a bf16 prefill of a whole 512-row step and decode steps inside the reserved context (so no pool
// grows), the peak of the engine's own device allocations (cuda::dev_bytes_peak: weights, state
// pool, workspaces, cuBLAS's; not the CUDA context) is within [0.95, 1.01] of the plan. A buffer the
// plan forgets, or one it counts and the backend never makes, fails it.
TEST(CudaModel, MemoryPlanCountsTheEnginesAllocations) {
  K3_REQUIRE_GPU();
  auto m = k3::Model::load(nano().string());
  k3::GpuOptions o;
  o.tokens_per_call = 512;
  o.initial_context = 1024;
  o.sm_count = k3::cuda::sm_count();
  k3::cuda::sync();
  k3::cuda::dev_reset_peak();
  const size_t before = k3::cuda::dev_bytes_live();
  m->use_gpu(o);
  {
    k3::Session s(*m);
    std::vector<int32_t> ids;
    for (int i = 0; i < 512; ++i) ids.push_back(int32_t((i * 37 + 11) % m->dims().vocab));
    int32_t tok = -1;
    k3::ForwardOptions f = mode(kFast);
    f.argmax_out = &tok;
    m->forward(s, ids.data(), int64_t(ids.size()), false, nullptr, f);
    for (int i = 0; i < 200; ++i) m->forward(s, &tok, 1, false, nullptr, f);
    k3::cuda::sync();
  }
  const size_t peak = k3::cuda::dev_bytes_peak() - before;
  const k3::GpuMemoryPlan p = k3::gpu_memory_plan(*m, o, o.initial_context);
  std::printf("[gate] GPU memory plan K3-nano 512 rows, 1024 tokens: engine peak %zu B, plan %zu B (weights %zu, "
              "workspace %zu, state %zu): %.4fx\n",
              peak, p.total(), p.weights, p.workspace, p.total() - p.weights - p.workspace,
              double(peak) / double(p.total()));
  std::string by;  // what the peak was made of (before use_gpu: the loaded model's share, if any)
  for (const auto& [what, bytes] : k3::cuda::dev_peak_breakdown()) by += " " + what + " " + std::to_string(bytes) + ";";
  std::printf("[gate] GPU memory at the peak by buffer:%s\n", by.c_str());
  EXPECT_LE(double(peak), 1.01 * double(p.total()));
  EXPECT_GE(double(peak), 0.95 * double(p.total()));
}

TEST(CudaModel, RefusesWhatTheGpuCannotDo) {
  K3_REQUIRE_GPU();
  auto m = gpu_model(ours("tiny"));
  k3::Session s(*m);
  std::vector<float> l(size_t(m->dims().vocab));
  const int32_t id = 1;
  auto o = mode(k3::ops::Numerics::Exact);
  EXPECT_THROW(m->forward(s, &id, 1, false, l.data(), o), k3::Error);
  o = mode(kF32);
  o.mla_algo = k3::MlaAlgo::Expanded;
  EXPECT_THROW(m->forward(s, &id, 1, false, l.data(), o), k3::Error);
  // A reservation no GPU can hold fails with one line naming the need and the free memory.
  auto big = k3::Model::load(ours("tiny").string());
  k3::GpuOptions go;
  go.initial_context = int64_t(1) << 40;
  try {
    big->use_gpu(go);
    FAIL() << "a 2^40-token reservation fit";
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("needs"), std::string::npos) << msg;
    EXPECT_NE(msg.find("free"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}
