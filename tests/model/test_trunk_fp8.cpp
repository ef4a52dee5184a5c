// The FP8 trunk (Model::quantize_trunk_fp8, --trunk-fp8, issue 20) on whole models: the tiny fixtures
// (tiny, tiny-flat, tiny-chat, kl-tiny) and the trained K3-nano.
//  * Exact numerics: the FP8 model's logits are bitwise those of its reference twin, the same model
//    with every trunk weight replaced by its dequantised FP8 value in F32 (TrunkFp8Store::
//    DequantizedF32): the scalar kernels see the same weights, so any other result is a kernel bug.
//  * FP8 vs the original (bf16) weights: rel-L2 of the logits, teacher-forced argmax agreement and
//    greedy ids, printed; on K3-nano bounded by the tolerances below (measured).
//  * fp32 and fast numerics of the FP8 model vs its exact numerics on every CPU level, within the
//    gates of tests/model/test_numerics_levels.cpp (2e-5 fp32 on the fixtures, or 1.5x the F32 twin's
//    error where the twin itself is past 2e-5; 3e-2 fast on K3-nano).
//  * A split model (TP2 x EP2) with the FP8 trunk is bitwise the unsplit FP8 model: its ranks take
//    row views of the FP8 matrices at head offsets that are not multiples of 128.
//  * What is and is not quantised, the pages released (RSS before/after), and the refusals.
// Owns: the tolerances of FP8 vs the original weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/cpu_levels.h"
#include "common/model_run.h"
#include "common/num_util.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "k3/engine.h"
#include "model/model.h"
#include "runtime/memory.h"

namespace fs = std::filesystem;
using k3::ops::CpuIsa;
using k3::ops::Numerics;
using k3test::rel_l2;

namespace {

// FP8 vs the original weights on K3-nano, rel-L2 over all teacher-forced logits (80 ids, exact
// numerics, so the same on every CPU): measured 8.42e-2. The trunk's weights themselves move by
// 2.65e-2 (rel-L2 over all of them, printed by QuantisesTheTrunkOnly: E4M3 keeps 3 mantissa bits,
// at most 2^-4 relative per weight); eight layers of a 48M-parameter model amplify that about 3x.
// 1.5e-1 leaves 1.8x. The random fixtures are reported, not gated (measured 0.78 tiny, 0.61
// tiny-flat, 0.65 tiny-chat, 0.27 kl-tiny: their router gaps are ~1e-4, so any perturbation of the
// trunk re-routes tokens, as test_numerics_levels.cpp says of fast numerics); their gate is the
// dequantised twin's, bitwise.
constexpr double kFp8VsOriginalTol = 1.5e-1;
// Teacher-forced argmax of FP8 vs original on K3-nano where the original's top-2 margin is at least
// kMargin: measured 84.6% (66 of 78 positions; the 12 flips had margins 0.095-0.72); at least 75%.
constexpr double kMargin = 0.05;
constexpr double kMinAgreement = 0.75;
// The SIMD numerics on the FP8 model vs its exact numerics, with the gates of
// test_numerics_levels.cpp: fp32 2e-5 (measured on the FP8 fixtures: at most 1.16e-5 full pass and
// 1.75e-5 prefill + decode, avx2 on tiny; the dequantised twin through the F32 kernels measures the
// same 1.16e-5 and 2.04e-5, so it is the perturbed model's sensitivity, not the FP8 kernels) and fast
// 3e-2 (measured on the FP8 K3-nano: scalar 2.54e-2 / 2.39e-2, avx2 2.56e-2 / 2.56e-2, avx512 1.67e-2 /
// 1.25e-2; the original weights measure 1.8e-2). Fast also keeps the argmax at >= 90% of the
// positions with margin >= kMargin (measured 94.5% to 99%: flips at margins 0.065 and 0.273 on
// avx512; the original weights keep all of them).
constexpr double kFp32Tol = 2e-5;
constexpr double kFastTol = 3e-2;
// ... except where the same weights through the F32 kernels (the dequantised twin in fp32) are
// already past it: the FP8-rounded tiny model amplifies fp32 rounding more than the original (twin
// measured 1.16e-5 full pass, 2.04e-5 prefill + decode on avx2, release build; 2.12e-5 full pass in
// the -O1 sanitizer build), so there the FP8 kernels may add at most half again the twin's error
// (measured: full passes equal the twin's bit for bit, both widen the same rows; prefill + decode
// 0.69-1.05x the twin's on the four fixtures, avx2 and avx512).
constexpr double kTwinFactor = 1.5;
constexpr double kFastMinAgreement = 0.90;

std::string dir_of(const std::string& name) {
  const fs::path src(K3_SOURCE_DIR);
  return (name == "k3-nano" ? src / "models" / name : src / "tests" / "fixtures" / name).string();
}

k3::ForwardOptions with(Numerics n) {
  k3::ForwardOptions o;
  o.numerics = n;
  return o;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// The ids a fixture's reference uses, or 80 spread ids for K3-nano (as test_numerics_levels.cpp).
std::vector<int32_t> ids_of(const std::string& name) {
  if (name == "k3-nano") {
    std::vector<int32_t> ids;
    for (int i = 0; i < 80; ++i) ids.push_back(int32_t((uint32_t(i) * 2654435761u >> 7) % 8192u));
    return ids;
  }
  std::ifstream f(fs::path(dir_of(name)) / "reference.json");
  return nlohmann::json::parse(f)["ids"].get<std::vector<int32_t>>();
}

std::unique_ptr<k3::Model> fp8_model(const std::string& name, k3::TrunkFp8Store store = k3::TrunkFp8Store::Fp8) {
  auto m = k3::Model::load(dir_of(name));
  m->quantize_trunk_fp8(store);
  return m;
}

// Share of positions whose argmax agrees, among those where `ref`'s top-2 margin is >= kMargin.
double argmax_agreement(const std::vector<float>& got, const std::vector<float>& ref, size_t V, size_t* checked) {
  size_t same = 0, n = 0;
  for (size_t t = 0; t < ref.size() / V; ++t) {
    const auto r = ref.begin() + std::ptrdiff_t(t * V), g = got.begin() + std::ptrdiff_t(t * V);
    std::vector<float> row(r, r + std::ptrdiff_t(V));
    std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
    if (row[0] - row[1] < kMargin) continue;
    ++n;
    same += (std::max_element(g, g + std::ptrdiff_t(V)) - g) == (std::max_element(r, r + std::ptrdiff_t(V)) - r);
  }
  if (checked) *checked = n;
  return n ? double(same) / double(n) : 1.0;
}

class Fixture : public ::testing::TestWithParam<std::string> {};
std::string fixture_name(const ::testing::TestParamInfo<std::string>& i) {
  std::string n = i.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

}  // namespace

// Exact numerics: FP8 kernels == the dequantised weights through the fp64 kernels, bit for bit; and
// FP8 vs the original weights within kFp8VsOriginalTol on K3-nano (reported on the fixtures).
TEST_P(Fixture, ExactEqualsDequantisedTwinAndIsCloseToOriginal) {
  const std::string name = GetParam();
  auto orig = k3::Model::load(dir_of(name));
  auto fp8 = fp8_model(name);
  auto twin = fp8_model(name, k3::TrunkFp8Store::DequantizedF32);
  const auto ids = ids_of(name);
  const auto o = with(Numerics::Exact);
  const auto l_orig = k3test::full_pass(*orig, ids, o);
  const auto l_fp8 = k3test::full_pass(*fp8, ids, o);
  const auto l_twin = k3test::full_pass(*twin, ids, o);
  const double e_twin = rel_l2(l_fp8, l_twin), e_orig = rel_l2(l_fp8, l_orig);
  std::printf("%s exact: FP8 vs dequantised twin rel-L2 %.3g%s; FP8 vs original %.4g (%zu ids)\n", name.c_str(), e_twin,
              same_bits(l_fp8, l_twin) ? " (bitwise)" : "", e_orig, ids.size());
  EXPECT_TRUE(same_bits(l_fp8, l_twin)) << "FP8 kernels differ from the dequantised weights in exact numerics";
  if (name == "k3-nano") {
    EXPECT_LT(e_orig, kFp8VsOriginalTol);
  }
  EXPECT_GT(e_orig, 1e-3) << "the trunk was not quantised";
  // Prefill then decode (the GEMV path at T = 1) gives the twin's logits too.
  EXPECT_TRUE(same_bits(k3test::incremental(*fp8, ids, 5, o), k3test::incremental(*twin, ids, 5, o)));
}

INSTANTIATE_TEST_SUITE_P(Models, Fixture, ::testing::Values("tiny", "tiny-flat", "tiny-chat", "kl-tiny", "k3-nano"),
                         fixture_name);

// K3-nano: teacher-forced argmax and greedy ids of the FP8 trunk vs the original weights (exact).
TEST(TrunkFp8, K3NanoArgmaxAndGreedyVsOriginal) {
  auto orig = k3::Model::load(dir_of("k3-nano"));
  auto fp8 = fp8_model("k3-nano");
  const auto ids = ids_of("k3-nano");
  const size_t V = size_t(orig->dims().vocab);
  const auto o = with(Numerics::Exact);
  const auto l_orig = k3test::full_pass(*orig, ids, o), l_fp8 = k3test::full_pass(*fp8, ids, o);
  size_t checked = 0;
  const double agree = argmax_agreement(l_fp8, l_orig, V, &checked);
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 8);
  const auto g_orig = k3test::greedy(*orig, prompt, 32, o), g_fp8 = k3test::greedy(*fp8, prompt, 32, o);
  size_t prefix = 0;
  while (prefix < g_orig.size() && g_orig[prefix] == g_fp8[prefix]) ++prefix;
  std::printf(
      "k3-nano FP8 vs original (exact): argmax agrees at %.1f%% of %zu positions with margin >= %.2f; greedy "
      "32 ids: first %zu equal\n",
      100 * agree, checked, kMargin, prefix);
  EXPECT_GT(checked, ids.size() / 2);
  EXPECT_GE(agree, kMinAgreement);
}

// fp32 on the FP8 fixtures and fast on the FP8 K3-nano vs their exact numerics, on every CPU level.
class Fp8Levels : public k3test::CpuLevelTest {};

TEST_P(Fp8Levels, Fp32AndFastCloseToExact) {
  for (const std::string name : {"tiny", "tiny-flat", "tiny-chat", "kl-tiny"}) {
    auto m = fp8_model(name);
    auto twin = fp8_model(name, k3::TrunkFp8Store::DequantizedF32);
    const auto ids = ids_of(name);
    const auto exact = k3test::full_pass(*m, ids, with(Numerics::Exact));  // bitwise the twin's
    const auto full = k3test::full_pass(*m, ids, with(Numerics::F32));
    const auto inc = k3test::incremental(*m, ids, 5, with(Numerics::F32));
    const double e_full = rel_l2(full, exact), e_inc = rel_l2(inc, exact);
    const double t_full = rel_l2(k3test::full_pass(*twin, ids, with(Numerics::F32)), exact);
    const double t_inc = rel_l2(k3test::incremental(*twin, ids, 5, with(Numerics::F32)), exact);
    std::printf("%s %s FP8 fp32 vs exact: full pass %.3g, prefill 5 + decode %.3g (the F32 twin: %.3g, %.3g)\n",
                k3::ops::cpu_isa_name(GetParam()), name.c_str(), e_full, e_inc, t_full, t_inc);
    EXPECT_LT(e_full, std::max(kFp32Tol, kTwinFactor * t_full)) << name;
    EXPECT_LT(e_inc, std::max(kFp32Tol, kTwinFactor * t_inc)) << name;
  }
  auto m = fp8_model("k3-nano");
  const auto ids = ids_of("k3-nano");
  const size_t V = size_t(m->dims().vocab);
  const auto exact = k3test::full_pass(*m, ids, with(Numerics::Exact));
  for (Numerics n : {Numerics::F32, Numerics::Fast}) {
    const auto full = k3test::full_pass(*m, ids, with(n));
    const auto inc = k3test::incremental(*m, ids, 64, with(n));
    const double e_full = rel_l2(full, exact), e_inc = rel_l2(inc, exact);
    size_t c1 = 0, c2 = 0;
    const double a1 = argmax_agreement(full, exact, V, &c1), a2 = argmax_agreement(inc, exact, V, &c2);
    std::printf("k3-nano %s FP8 %s vs exact: full pass %.3g, prefill 64 + decode %.3g; argmax %.0f%% / %.0f%%\n",
                k3::ops::cpu_isa_name(GetParam()), k3::ops::numerics_name(n), e_full, e_inc, 100 * a1, 100 * a2);
    const double tol = n == Numerics::F32 ? kFp32Tol : kFastTol;
    EXPECT_LT(e_full, tol) << k3::ops::numerics_name(n);
    EXPECT_LT(e_inc, tol) << k3::ops::numerics_name(n);
    const double min_agree = n == Numerics::F32 ? 1.0 : kFastMinAgreement;
    EXPECT_GE(a1, min_agree) << k3::ops::numerics_name(n);
    EXPECT_GE(a2, min_agree) << k3::ops::numerics_name(n);
  }
}

INSTANTIATE_TEST_SUITE_P(Level, Fp8Levels, k3test::all_cpu_levels(), k3test::cpu_level_name);

// A split model takes row views of the FP8 matrices (K3-nano TP2: KDA rows from 192, MLA kv_b rows
// from 288; tiny: rows from 32), and must still be bitwise the unsplit FP8 model in every numerics.
TEST(TrunkFp8, SplitModelIsBitwiseTheUnsplitFp8Model) {
  for (const std::string name : {"tiny", "k3-nano"}) {
    auto one = fp8_model(name);
    auto split = fp8_model(name);
    split->split({2, 2});
    const auto ids = ids_of(name);
    for (Numerics n : {Numerics::Exact, Numerics::F32, Numerics::Fast}) {
      SCOPED_TRACE(name + " " + k3::ops::numerics_name(n));
      const auto o = with(n);
      EXPECT_TRUE(same_bits(k3test::full_pass(*split, ids, o), k3test::full_pass(*one, ids, o))) << "teacher-forced";
      EXPECT_TRUE(same_bits(k3test::incremental(*split, ids, 5, o), k3test::incremental(*one, ids, 5, o)))
          << "prefill 5 then decode";
      EXPECT_EQ(k3test::greedy(*split, ids, 8, o), k3test::greedy(*one, ids, 8, o));
    }
  }
}

// What is quantised: every WeightRole::Trunk matrix, into FP8; nothing else moves (the router, the
// MXFP4 experts, the embedding, lm_head keep their format and their place in the mapping); the host
// and placed weights agree; the replaced tensors are named by the checkpoint.
TEST(TrunkFp8, QuantisesTheTrunkOnly) {
  auto orig = k3::Model::load(dir_of("k3-nano"));
  auto m = k3::Model::load(dir_of("k3-nano"));
  const k3::TrunkFp8Bytes planned = k3::trunk_fp8_bytes(m->weights());
  const k3::TrunkFp8Report r = m->quantize_trunk_fp8();
  EXPECT_TRUE(m->trunk_fp8());
  EXPECT_EQ(r.bytes.matrices, planned.matrices);
  EXPECT_EQ(r.bytes.before, planned.before);
  EXPECT_EQ(r.bytes.after, planned.after);
  EXPECT_LT(r.bytes.after * 100, r.bytes.before * 51) << "FP8 is about half of bf16";
  std::vector<const k3::WeightMat*> a, b, c;
  std::vector<k3::WeightRole> roles;
  k3::for_each_weight(
      orig->weights(), [&](const k3::WeightMat& w, k3::WeightRole role) { a.push_back(&w), roles.push_back(role); },
      [](const k3::FVec&) {});
  k3::for_each_weight(
      m->weights(), [&](const k3::WeightMat& w, k3::WeightRole) { b.push_back(&w); }, [](const k3::FVec&) {});
  k3::for_each_weight(
      m->placed(), [&](const k3::WeightMat& w, k3::WeightRole) { c.push_back(&w); }, [](const k3::FVec&) {});
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(b.size(), c.size());
  int64_t trunk = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]->data, c[i]->data) << "placed weights not rewritten, matrix " << i;
    EXPECT_EQ(b[i]->rows, a[i]->rows);
    EXPECT_EQ(b[i]->cols, a[i]->cols);
    if (roles[i] == k3::WeightRole::Trunk) {
      ++trunk;
      EXPECT_EQ(b[i]->fmt, k3::WFormat::FP8) << i;
      EXPECT_NE(b[i]->block_scales, nullptr);
    } else {
      EXPECT_EQ(b[i]->fmt, a[i]->fmt) << "matrix " << i << " of role " << int(roles[i]) << " changed format";
      EXPECT_NE(b[i]->fmt, k3::WFormat::FP8);
    }
  }
  EXPECT_EQ(trunk, r.bytes.matrices);
  // The trunk's weights moved by E4M3's rounding: rel-L2 over all of them (2^-4 relative at most per
  // weight in the normal range; about 2^-4 / sqrt(3) rms over uniform mantissas and offsets, less for
  // mantissas near the top of a binade).
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (roles[i] == k3::WeightRole::Trunk)
      for (int64_t row = 0; row < a[i]->rows; ++row)
        for (int64_t col = 0; col < a[i]->cols; ++col) {
          const double w = a[i]->at(row, col), q = b[i]->at(row, col);
          num += (q - w) * (q - w), den += w * w;
        }
  std::printf("k3-nano trunk weights: FP8 vs original rel-L2 %.4f (%lld matrices)\n", std::sqrt(num / den),
              (long long)trunk);
  EXPECT_LT(std::sqrt(num / den), 0.0625 / std::sqrt(3.0));
  EXPECT_TRUE(m->replaced_by_trunk_fp8("language_model.model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(m->replaced_by_trunk_fp8("language_model.model.layers.3.self_attn.kv_b_proj.weight"));
  EXPECT_TRUE(m->replaced_by_trunk_fp8("language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"));
  EXPECT_FALSE(m->replaced_by_trunk_fp8("language_model.model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_FALSE(m->replaced_by_trunk_fp8("language_model.model.embed_tokens.weight"));
  EXPECT_FALSE(m->replaced_by_trunk_fp8("language_model.lm_head.weight"));
  EXPECT_FALSE(m->replaced_by_trunk_fp8("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"));
  EXPECT_FALSE(m->replaced_by_trunk_fp8("no.such.tensor"));
}

// The bf16 pages of the replaced tensors go back to the kernel: with every page of the mapping read
// in first, the resident set shrinks by about what was released, less the FP8 copy it now holds.
// What the FP8 trunk takes on the GPU (TrunkFp8Bytes::after_gpu, and so the GPU memory plan and
// k3 info): every FP8 matrix as E4M3 codes plus an fp32 scale per row and 128 columns, except an MLA
// layer's kv_b_proj, uploaded in fp32; counted here from the shapes, on K3-nano and Kimi Linear.
TEST(TrunkFp8, GpuBytesArePerRowScalesAndKvBInFp32) {
  for (const std::string name : {"k3-nano", "kl-tiny"}) {
    SCOPED_TRACE(name);
    auto base = k3::Model::load(dir_of(name));
    const k3::GpuMemoryPlan before = k3::gpu_memory_plan(*base, k3::GpuOptions{}, 64);
    auto m = k3::Model::load(dir_of(name));
    const k3::TrunkFp8Report rep = m->quantize_trunk_fp8();
    uint64_t want = 0;
    int64_t kv_b = 0;
    std::vector<const void*> seen;
    for (const k3::LayerWeights& l : m->weights().layers)
      if (!l.is_kda && l.mla.kv_b_proj.fmt == k3::WFormat::FP8) ++kv_b;
    k3::for_each_weight(
        m->weights(),
        [&](const k3::WeightMat& w, k3::WeightRole) {
          if (w.fmt != k3::WFormat::FP8 || std::find(seen.begin(), seen.end(), w.data) != seen.end()) return;
          seen.push_back(w.data);
          const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols);
          want += k3::is_mla_kv_b(m->weights(), w) ? 4 * n : n + 4 * uint64_t(w.rows) * uint64_t((w.cols + 127) / 128);
        },
        [](const k3::FVec&) {});
    EXPECT_GT(kv_b, 0);
    EXPECT_EQ(rep.bytes.after_gpu, want);
    EXPECT_EQ(k3::trunk_fp8_bytes(base->weights()).after_gpu, want);  // (counted before quantising, as k3 info does)
    // The plan's weights move by exactly the trunk's bf16 bytes against its GPU form.
    const k3::GpuMemoryPlan after = k3::gpu_memory_plan(*m, k3::GpuOptions{}, 64);
    EXPECT_EQ(after.weights, before.weights - rep.bytes.before + rep.bytes.after_gpu);
  }
}

TEST(TrunkFp8, ReleasesTheReplacedPages) {
  auto m = k3::Model::load(dir_of("k3-nano"));
  m->checkpoint().prefault([](uint64_t, uint64_t) {});
  const uint64_t before = k3::current_rss_bytes();
  const k3::TrunkFp8Report r = m->quantize_trunk_fp8();
  const uint64_t after = k3::current_rss_bytes();
  std::printf(
      "k3-nano: RSS %.2f MiB -> %.2f MiB; trunk %.2f MiB -> %.2f MiB FP8, %.2f MiB of mapped pages released, "
      "%.3f s\n",
      double(before) / 1048576, double(after) / 1048576, double(r.bytes.before) / 1048576,
      double(r.bytes.after) / 1048576, double(r.released_bytes) / 1048576, r.seconds);
  ASSERT_GT(before, 0u) << "/proc/self/statm unreadable";
  EXPECT_GT(double(r.released_bytes), 0.95 * double(r.bytes.before)) << "most of the replaced pages released";
  EXPECT_LE(r.released_bytes, r.bytes.before);
  // after ~= before - released + FP8 copy (+ a few MiB of heap and thread stacks the loop may touch).
  EXPECT_LT(double(after), double(before) - double(r.released_bytes) + double(r.bytes.after) + 4.0 * 1048576);
  EXPECT_LT(after + r.bytes.before / 4, before) << "the resident set did not shrink";
}

TEST(TrunkFp8, RefusesTwiceAndAfterSplit) {
  auto m = fp8_model("tiny");
  try {
    m->quantize_trunk_fp8();
    FAIL() << "quantised twice";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()), "--trunk-fp8: the trunk is already quantised");
  }
  auto s = k3::Model::load(dir_of("tiny"));
  s->split({2, 1});
  try {
    s->quantize_trunk_fp8();
    FAIL() << "quantised a split model";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "--trunk-fp8: the model is already split over ranks (TP2); quantise the trunk before Model::split");
  }
}

// A session of the FP8 model is not one of the checkpoint's: its file refuses to load into the
// original model (and the other way round), while two FP8 loads of one checkpoint agree.
TEST(TrunkFp8, SessionFilesDoNotCrossBetweenFp8AndOriginal) {
  auto fp8 = fp8_model("tiny");
  auto orig = k3::Model::load(dir_of("tiny"));
  EXPECT_NE(fp8->fingerprint(), orig->fingerprint());
  EXPECT_EQ(fp8->fingerprint(), fp8_model("tiny")->fingerprint());
  const int32_t ids[] = {3, 1, 4, 1, 5};
  std::vector<float> l(size_t(fp8->dims().vocab));
  k3::Session s(*fp8);
  fp8->forward(s, ids, 5, false, l.data());
  std::stringstream file;
  s.save(file);
  k3::Session t(*orig);
  try {
    t.load(file);
    FAIL() << "an FP8 session loaded into the original model";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("different model"), std::string::npos) << e.what();
  }
}

// The public API's EngineOptions::trunk_fp8: the engine's logits are the FP8 model's (exact numerics),
// and with device=cuda it is the one-line refusal, in the API's names.
TEST(TrunkFp8, EngineOptionRunsTheFp8Model) {
  k3::EngineOptions eo;
  eo.model_dir = dir_of("k3-nano");
  eo.numerics = "exact";
  eo.need_tokenizer = false;
  eo.prefault = true;
  eo.trunk_fp8 = true;
  auto engine = k3::Engine::load(eo);
  const auto ids = ids_of("k3-nano");
  const int32_t seq = engine->new_sequence();
  std::vector<float> logits;
  engine->step({k3::StepInput{seq, ids.data(), int64_t(ids.size()), true}}, &logits, nullptr);
  EXPECT_TRUE(same_bits(logits, k3test::full_pass(*fp8_model("k3-nano"), ids, with(Numerics::Exact))));
  // On the GPU the option is taken as on the CPU: where this machine has no usable GPU, the refusal
  // is the one without it (the GPU's own FP8 gate is CudaModel.TrunkFp8MatchesTheCpu).
  eo.device = "cuda";
  eo.numerics = "fp32";  // (exact is refused on the GPU first)
  const auto error_of = [&](bool fp8) -> std::string {
    eo.trunk_fp8 = fp8;
    try {
      k3::Engine::load(eo);
      return "";
    } catch (const k3::Error& e) {
      return e.what();
    }
  };
  const std::string plain = error_of(false), fp8 = error_of(true);
  EXPECT_EQ(fp8, plain);
  EXPECT_EQ(fp8.find("FP8"), std::string::npos) << fp8;
}
