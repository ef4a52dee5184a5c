// ops::matmul on every CPU level (scalar, avx2, avx512; one test per level, those this machine lacks skip by name) in
// the F32 and Fast numerics (the SIMD kernels; Exact always runs the scalar kernels), against the fp64 twin
// k3::ref::matmul. Shapes cover the kernels' edges: rows not a multiple of the 4-row tile or 16-row block, column tails
// (not a multiple of 8/16/32), T = 1 (GEMV), T < 4 (exact even in Fast mode), token tiles and the 64- and 256-token
// block boundaries, and unaligned rows; FP8 (E4M3 + 128 x 128 block scales) as well: partial edge blocks, row views
// at offsets that are not multiples of 128, every byte alignment. Owns: the GEMM tolerances below (FP8 is held to
// the same ones: its kernels sum fp32 products of the dequantised weights as the other formats' do).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_levels.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/thread_pool.h"
#include "ops/cpu/gemm_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/ops.h"

namespace {

using k3::ops::CpuIsa;
using k3test::count_nan;
using k3test::nan_vec;
using k3test::rel_l2;

// F32 mode: fp32 products and sums (16-lane partial sums) vs fp64: sqrt(cols)·ulp-level, held to
// the project-wide fp32 reduction tolerance (tests/common/op_tolerances.h).
constexpr double kTolExact = k3test::kTolReduce;
// Fast mode must equal the exact product of W with the ROUNDED activations to fp32 accuracy (the
// only approximation is the rounding of X), and be near the unrounded product: bf16 keeps 8
// significant bits (<= 2^-9 relative per activation), 8-bit blocks keep |x| <= max/254 absolute;
// over random-sign sums the aggregate is ~1e-3..5e-3. 1e-2 catches a kernel that drops or
// mis-pairs terms (error O(1)).
constexpr double kTolFastVsRounded = 1e-5;
constexpr double kTolFastVsExact = 1e-2;

struct Case {
  k3::WFormat fmt;
  int64_t rows, cols, T;
};

const Case kCases[] = {
    {k3::WFormat::BF16, 1, 16, 1},
    {k3::WFormat::BF16, 7, 37, 1},
    {k3::WFormat::BF16, 37, 300, 1},
    {k3::WFormat::BF16, 33, 1000, 2},
    {k3::WFormat::BF16, 21, 64, 3},
    {k3::WFormat::BF16, 50, 96, 4},
    {k3::WFormat::BF16, 19, 129, 5},
    {k3::WFormat::BF16, 17, 200, 67},
    {k3::WFormat::BF16, 70, 512, 130},
    {k3::WFormat::F16, 13, 33, 1},
    {k3::WFormat::F16, 9, 101, 6},
    {k3::WFormat::F16, 40, 250, 65},
    {k3::WFormat::F32, 11, 65, 1},
    {k3::WFormat::F32, 23, 47, 9},
    {k3::WFormat::F32, 18, 160, 64},
    {k3::WFormat::MXFP4, 5, 32, 1},
    {k3::WFormat::MXFP4, 37, 96, 1},
    {k3::WFormat::MXFP4, 64, 1024, 1},
    {k3::WFormat::MXFP4, 7, 128, 1},
    {k3::WFormat::MXFP4, 9, 224, 1},
    {k3::WFormat::MXFP4, 33, 3584, 1},
    {k3::WFormat::MXFP4, 21, 96, 3},
    {k3::WFormat::MXFP4, 33, 160, 7},
    {k3::WFormat::MXFP4, 45, 320, 66},
    {k3::WFormat::BF16, 35, 64, 261},
    {k3::WFormat::MXFP4, 31, 64, 259},  // past the 256-token pass of the bf16 GEMM
    // FP8: one partial block (cols < 128, column tails of 16/8), several block rows and columns with
    // partial edge blocks (rows 130, 300; cols 129, 300, 1000), GEMV tiles of 8/4/1 rows, GEMMs.
    {k3::WFormat::FP8, 1, 16, 1},
    {k3::WFormat::FP8, 7, 37, 1},
    {k3::WFormat::FP8, 37, 300, 1},
    {k3::WFormat::FP8, 130, 129, 1},
    {k3::WFormat::FP8, 300, 1000, 1},
    {k3::WFormat::FP8, 13, 256, 1},
    {k3::WFormat::FP8, 9, 256, 2},
    {k3::WFormat::FP8, 50, 200, 4},
    {k3::WFormat::FP8, 140, 384, 67},
    {k3::WFormat::FP8, 19, 129, 5},
};

// Fast numerics' activations for an MXFP4 GEMV, computed independently: per 32-block, step =
// max|x| / 127, q = round-to-nearest(x / step) (ties to even, as lrint), value q * step.
std::vector<float> q8_dequant(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0;
    for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
    const float step = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    for (size_t j = 0; j < 32; ++j) r[32 * b + j] = float(std::nearbyint(x[32 * b + j] * inv)) * step;
  }
  return r;
}

}  // namespace

// One test per CPU level (tests/common/cpu_levels.h: a level this CPU lacks is skipped by name).
class GemmLevels : public k3test::CpuLevelTest {};
INSTANTIATE_TEST_SUITE_P(Level, GemmLevels, k3test::all_cpu_levels(), k3test::cpu_level_name);

namespace {

std::string name(const Case& c) {
  return std::string(k3::wformat_name(c.fmt)) + " rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) +
         " T=" + std::to_string(c.T);
}

// The weights at an odd byte offset, as mmap'd shard data may be.
struct Unaligned {
  std::vector<uint8_t> bytes;
  k3::WeightMat w;
  Unaligned(const k3::WeightMat& src, size_t nbytes) : bytes(nbytes + 1), w(src) {
    std::memcpy(bytes.data() + 1, src.data, nbytes);
    w.data = bytes.data() + 1;
  }
};

size_t data_bytes(const k3::WeightMat& w) {
  switch (w.fmt) {
    case k3::WFormat::F32:
      return size_t(w.rows * w.cols * 4);
    case k3::WFormat::F16:
    case k3::WFormat::BF16:
      return size_t(w.rows * w.cols * 2);
    case k3::WFormat::MXFP4:
      return size_t(w.rows * w.cols / 2);
    case k3::WFormat::FP8:  // the codes (the block scales stay where they are)
      return size_t(w.rows * w.cols);
  }
  return 0;
}

}  // namespace

TEST(GemmIsa, DetectedLevelIsReported) {
  const CpuIsa best = k3::ops::cpu_isa_detected();
  std::printf("detected CPU level: %s\n", k3::ops::cpu_isa_name(best));
  EXPECT_EQ(k3::ops::parse_cpu_isa(k3::ops::cpu_isa_name(best)), best);
  EXPECT_THROW(k3::ops::parse_cpu_isa("sse9"), std::exception);
  if (best != CpuIsa::Amx) {
    EXPECT_THROW(k3::ops::set_cpu_isa(CpuIsa::Amx), std::exception);
  }
  if (int(best) < int(CpuIsa::Avx512)) {
    EXPECT_THROW(k3::ops::set_cpu_isa(CpuIsa::Avx512), std::exception);
  }
}

TEST_P(GemmLevels, F32MatchesTwin) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(77);
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(c));
    k3test::OwnedW W = k3test::make_weight(rng, c.fmt, c.rows, c.cols);
    Unaligned U(W.w, data_bytes(W.w));
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols));
    auto y = nan_vec(size_t(c.T * c.rows)), y_ref = nan_vec(size_t(c.T * c.rows));
    k3::ops::matmul(k3::ops::kF32, U.w, X.data(), c.T, y.data());
    k3::ref::matmul(W.w, X.data(), c.T, y_ref.data());
    ASSERT_EQ(count_nan(y), 0u);
    EXPECT_LT(rel_l2(y, y_ref), kTolExact);
  }
}

TEST_P(GemmLevels, FastIsExactProductOfRoundedActivations) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(78);
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(c));
    k3test::OwnedW W = k3test::make_weight(rng, c.fmt, c.rows, c.cols);
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols));
    // GEMMs: bf16-rounded activations; MXFP4 GEMVs: 8-bit (q8_0-style) activations.
    std::vector<float> Xr(X.size());
    for (size_t i = 0; i < X.size(); ++i) Xr[i] = k3::bf16_to_f32(k3::f32_to_bf16(X[i]));
    if (c.T == 1 && c.fmt == k3::WFormat::MXFP4) Xr = q8_dequant(X);
    auto y = nan_vec(size_t(c.T * c.rows)), y_rounded = nan_vec(y.size()), y_exact = nan_vec(y.size());
    k3::ops::matmul(k3::ops::kFast, W.w, X.data(), c.T, y.data());
    k3::ref::matmul(W.w, Xr.data(), c.T, y_rounded.data());
    k3::ref::matmul(W.w, X.data(), c.T, y_exact.data());
    ASSERT_EQ(count_nan(y), 0u);
    const bool rounds = k3::ops::fast_applies(k3::ops::kFast, W.w, c.T);
    EXPECT_FALSE(k3::ops::fast_applies(k3::ops::kF32, W.w, c.T));
    EXPECT_EQ(rounds, c.T >= k3::ops::kFastMinRows || (c.T == 1 && c.fmt == k3::WFormat::MXFP4));
    if (!rounds) {
      // The Fast output itself: the unrounded product, to the F32 tolerance, and the same bits as
      // the F32 call (Fast adds nothing where it does not round).
      EXPECT_LT(rel_l2(y, y_exact), kTolExact) << "below kFastMinRows the product stays exact";
      auto y_f32 = nan_vec(y.size());
      k3::ops::matmul(k3::ops::kF32, W.w, X.data(), c.T, y_f32.data());
      EXPECT_EQ(std::memcmp(y.data(), y_f32.data(), y.size() * 4), 0)
          << "Fast differs from F32 where it does not round";
    } else {
      EXPECT_LT(rel_l2(y, y_rounded), kTolFastVsRounded);
      EXPECT_LT(rel_l2(y, y_exact), kTolFastVsExact);
    }
  }
}

TEST_P(GemmLevels, ResultDoesNotDependOnThreadCount) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(79);
  for (const Case& c : {Case{k3::WFormat::BF16, 301, 512, 1}, Case{k3::WFormat::MXFP4, 300, 512, 1},
                        Case{k3::WFormat::BF16, 130, 256, 70}, Case{k3::WFormat::MXFP4, 99, 256, 33},
                        Case{k3::WFormat::FP8, 301, 700, 1}, Case{k3::WFormat::FP8, 200, 300, 33}}) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(c));
    k3test::OwnedW W = k3test::make_weight(rng, c.fmt, c.rows, c.cols);
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols));
    std::vector<std::vector<float>> outs;
    for (int threads : {1, 2, 3}) {
      const k3::par::FixedThreads fixed(threads);
      for (auto num : {k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
        outs.push_back(nan_vec(size_t(c.T * c.rows)));
        k3::ops::matmul(k3::ops::Exec{num}, W.w, X.data(), c.T, outs.back().data());
      }
    }
    for (size_t i = 2; i < outs.size(); ++i)
      EXPECT_EQ(std::memcmp(outs[i].data(), outs[i % 2].data(), outs[i].size() * 4), 0) << "run " << i;
  }
}

// The fast GEMM computes each output as one chain over the columns: a token's outputs are the same
// bits whatever the other tokens of the call (T >= kFastMinRows), so a prefill's result does not
// depend on how its tokens are grouped once every group takes the GEMM path.
TEST_P(GemmLevels, FastGemmTokenDoesNotDependOnBatch) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(80);
  // (and on the amx level: partial 32-row groups, one or two 16-token tiles, BF16 rows read in place)
  for (const Case& c : {Case{k3::WFormat::BF16, 75, 200, 20}, Case{k3::WFormat::MXFP4, 70, 256, 20},
                        Case{k3::WFormat::BF16, 77, 256, 70}, Case{k3::WFormat::MXFP4, 45, 288, 70}}) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(c));
    k3test::OwnedW W = k3test::make_weight(rng, c.fmt, c.rows, c.cols);
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols));
    auto all = nan_vec(size_t(c.T * c.rows));
    k3::ops::matmul(k3::ops::kFast, W.w, X.data(), c.T, all.data());
    ASSERT_EQ(count_nan(all), 0u);
    // Tokens [3, 3 + n) alone, for n = 4 (a short tile), 9 (a full tile and a short one), 17.
    for (int64_t n : {4, 9, 17, 40, 67}) {
      if (3 + n > c.T) continue;
      auto part = nan_vec(size_t(n * c.rows));
      k3::ops::matmul(k3::ops::kFast, W.w, X.data() + 3 * c.cols, n, part.data());
      EXPECT_EQ(std::memcmp(part.data(), all.data() + 3 * c.rows, part.size() * 4), 0) << "n = " << n;
    }
  }
}

// The fast GEMM over a grid of shapes (row groups and token tiles cut everywhere, column tails, the
// 256-token passes): every output within kTolFastVsRounded of the product of the rounded activations.
TEST_P(GemmLevels, FastGemmMatchesRoundedTwinOverShapes) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(90);
  for (auto fmt : {k3::WFormat::BF16, k3::WFormat::MXFP4})
    for (int64_t rows : {16, 33, 96, 130})
      for (int64_t cols : {64, 96, 200, 576, 1024})
        for (int64_t T : {4, 16, 31, 48, 100, 300}) {
          if (fmt == k3::WFormat::MXFP4 && cols % 32 != 0) continue;
          SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(Case{fmt, rows, cols, T}));
          k3test::OwnedW W = k3test::make_weight(rng, fmt, rows, cols);
          const auto X = k3test::rand_vec(rng, size_t(T * cols));
          std::vector<float> Xr(X.size());
          for (size_t i = 0; i < X.size(); ++i) Xr[i] = k3::bf16_to_f32(k3::f32_to_bf16(X[i]));
          auto y = nan_vec(size_t(T * rows)), y_rounded = nan_vec(y.size());
          k3::ops::matmul(k3::ops::kFast, W.w, X.data(), T, y.data());
          k3::ref::matmul(W.w, Xr.data(), T, y_rounded.data());
          ASSERT_EQ(count_nan(y), 0u);
          ASSERT_LT(rel_l2(y, y_rounded), kTolFastVsRounded);
        }
}

// Exact numerics run the scalar kernels on every level: bit-identical results to the scalar level.
TEST_P(GemmLevels, ExactIsTheScalarLevel) {
  const CpuIsa level = GetParam();
  EXPECT_EQ(k3::ops::kExact.level(), CpuIsa::Scalar);
  EXPECT_EQ(k3::ops::kF32.level(), level);
  std::mt19937 rng(81);
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + name(c));
    k3test::OwnedW W = k3test::make_weight(rng, c.fmt, c.rows, c.cols);
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols));
    auto y = nan_vec(size_t(c.T * c.rows)), y_scalar = nan_vec(y.size());
    k3::ops::matmul(k3::ops::kExact, W.w, X.data(), c.T, y.data());
    k3::ops::set_cpu_isa(CpuIsa::Scalar);
    k3::ops::matmul(k3::ops::kExact, W.w, X.data(), c.T, y_scalar.data());
    k3::ops::set_cpu_isa(level);
    ASSERT_EQ(count_nan(y), 0u);
    EXPECT_EQ(std::memcmp(y.data(), y_scalar.data(), y.size() * 4), 0);
  }
}

TEST(GemmIsa, NumericsNamesAreValidated) {
  EXPECT_EQ(k3::ops::parse_numerics("exact"), k3::ops::Numerics::Exact);
  EXPECT_EQ(k3::ops::parse_numerics("fp32"), k3::ops::Numerics::F32);
  EXPECT_EQ(k3::ops::parse_numerics("fast"), k3::ops::Numerics::Fast);
  EXPECT_THROW(k3::ops::parse_numerics("fastest"), std::exception);
}

TEST_P(GemmLevels, ForcedLevelIsTheActiveLevel) {
  EXPECT_EQ(k3::ops::cpu_isa(), GetParam());
  EXPECT_EQ(k3::ops::parse_cpu_isa(k3::ops::cpu_isa_name(GetParam())), GetParam());
}

// Fast MXFP4 GEMV: rows whose E8M0 scales include 0 (2^-127, subnormal) take the per-block
// path; the result must still be the exact product with the 8-bit activations. 255 (NaN) must
// come out as NaN in that row only.
TEST_P(GemmLevels, FastMxfp4GemvSpecialScales) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(80);
  k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::MXFP4, 9, 224);
  W.scales[1 * 7 + 2] = 0;    // row 1
  W.scales[4 * 7 + 6] = 140;  // row 4, a large scale in a tail block (224 = one 128-group + 3 blocks)
  W.scales[6 * 7 + 0] = 255;  // row 6: NaN
  const auto x = k3test::rand_vec(rng, 224, 0.05f, 1.0f);
  const std::vector<float> xr = q8_dequant(x);
  auto y = nan_vec(9), y_ref = nan_vec(9);
  k3::ops::matmul(k3::ops::kFast, W.w, x.data(), 1, y.data());
  k3::ref::matmul(W.w, xr.data(), 1, y_ref.data());
  for (int r = 0; r < 9; ++r) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " row " + std::to_string(r));
    if (r == 6) {
      EXPECT_TRUE(std::isnan(y[6]));
    } else {
      EXPECT_NEAR(y[size_t(r)], y_ref[size_t(r)], 1e-5 * (1.0 + std::fabs(y_ref[size_t(r)])));
    }
  }
}

// The same special scales in the fast GEMM (T = 6: bf16 activations): a zero scale (2^-127, whose
// products are subnormal: zero in the bf16 dot product, negligible in the reference) and a large one
// stay exact, a NaN scale makes that row's outputs NaN for every token and no other row's.
TEST_P(GemmLevels, FastMxfp4GemmSpecialScales) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(81);
  const int64_t rows = 9, cols = 224, T = 6;
  k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::MXFP4, rows, cols);
  W.scales[1 * 7 + 2] = 0;
  W.scales[4 * 7 + 6] = 140;
  W.scales[6 * 7 + 0] = 255;
  const auto X = k3test::rand_vec(rng, size_t(T * cols), 0.05f, 1.0f);
  std::vector<float> Xr(X.size());
  for (size_t i = 0; i < X.size(); ++i) Xr[i] = k3::bf16_to_f32(k3::f32_to_bf16(X[i]));
  auto y = nan_vec(size_t(T * rows)), y_ref = nan_vec(size_t(T * rows));
  k3::ops::matmul(k3::ops::kFast, W.w, X.data(), T, y.data());
  k3::ref::matmul(W.w, Xr.data(), T, y_ref.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " token " + std::to_string(t) + " row " +
                   std::to_string(r));
      const float v = y[size_t(t * rows + r)], ref = y_ref[size_t(t * rows + r)];
      if (r == 6) {
        EXPECT_TRUE(std::isnan(v));
      } else {
        EXPECT_NEAR(v, ref, 1e-5 * (1.0 + std::fabs(ref)));
      }
    }
}

// The SIMD quantiser of the fast MXFP4 GEMV's activations is bit-identical to its scalar twin
// (every output array, including the tail blocks beyond the last whole 128-column group).
TEST(GemmIsa, Q8QuantiserMatchesScalarTwin) {
#if defined(__x86_64__)  // where src/ops builds the x86 kernels
  if (int(k3::ops::cpu_isa_detected()) < int(CpuIsa::Avx512))
    GTEST_SKIP() << "this CPU lacks the avx512 level (best: " << k3::ops::cpu_isa_name(k3::ops::cpu_isa_detected())
                 << ")";
  std::mt19937 rng(83);
  for (int64_t cols : {32, 128, 224, 1024, 3584 + 96}) {
    SCOPED_TRACE("cols=" + std::to_string(cols));
    auto x = k3test::rand_vec(rng, size_t(cols), -3.0f, 3.0f);
    std::fill(x.begin() + 32, x.begin() + std::min<int64_t>(cols, 64), 0.0f);  // an all-zero block (step 0)
    x[0] = 1e-30f;                                                             // a tiny value beside large ones
    const int64_t ng = cols / 128;
    std::vector<int8_t> q1(size_t(ng * 128), 99), q2(size_t(ng * 128), 77);
    std::vector<int32_t> c1(size_t(ng * 16), 99), c2(size_t(ng * 16), 77);
    auto s1 = nan_vec(size_t(ng * 16)), s2 = nan_vec(size_t(ng * 16)), r1 = nan_vec(size_t(cols)),
         r2 = nan_vec(size_t(cols));
    k3::ops::cpu::quantize_q8_scalar(x.data(), cols, q1.data(), c1.data(), s1.data(), r1.data());
    k3::ops::cpu::avx512::kGemm.quantize_q8(x.data(), cols, q2.data(), c2.data(), s2.data(), r2.data());
    EXPECT_EQ(count_nan(r1), 0u);
    EXPECT_EQ(count_nan(s1), 0u);
    EXPECT_EQ(q1, q2);
    EXPECT_EQ(c1, c2);
    EXPECT_TRUE(s1.empty() || std::memcmp(s1.data(), s2.data(), s1.size() * 4) == 0);
    EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size() * 4), 0);
  }
#else
  GTEST_SKIP() << "built without the x86 SIMD kernels";
#endif
}

// matmul_shared_input gives exactly what one matmul per weight gives, on every level and
// numerics, for decode (one parallel region) and prefill shapes, mixed formats included.
TEST_P(GemmLevels, SharedInputEqualsSeparateMatmuls) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(84);
  for (int64_t T : {1, 3, 9}) {
    const int64_t cols = 416;  // three 128-column groups and a 32-column tail block
    std::vector<k3test::OwnedW> W;
    W.push_back(k3test::make_weight(rng, k3::WFormat::MXFP4, 37, cols));
    W.push_back(k3test::make_weight(rng, k3::WFormat::BF16, 130, cols));
    W.push_back(k3test::make_weight(rng, k3::WFormat::MXFP4, 8, cols));
    W.push_back(k3test::make_weight(rng, k3::WFormat::F32, 3, cols));
    W.push_back(k3test::make_weight(rng, k3::WFormat::FP8, 140, cols));
    const auto X = k3test::rand_vec(rng, size_t(T * cols));
    for (auto num : {k3::ops::Numerics::Exact, k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
      SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " T=" + std::to_string(T) + " numerics " +
                   k3::ops::numerics_name(num));
      const k3::ops::Exec ex{num};
      std::vector<const k3::WeightMat*> ws;
      std::vector<std::vector<float>> sep, fused;
      std::vector<float*> ys;
      for (auto& w : W) {
        ws.push_back(&w.w);
        sep.push_back(nan_vec(size_t(T * w.w.rows)));
        fused.push_back(nan_vec(size_t(T * w.w.rows)));
        k3::ops::matmul(ex, w.w, X.data(), T, sep.back().data());
      }
      for (auto& f : fused) ys.push_back(f.data());
      k3::ops::matmul_shared_input(ex, ws.data(), int64_t(ws.size()), X.data(), T, ys.data());
      for (size_t i = 0; i < W.size(); ++i) {
        EXPECT_EQ(count_nan(fused[i]), 0u) << "weight " << i;
        EXPECT_EQ(std::memcmp(fused[i].data(), sep[i].data(), sep[i].size() * 4), 0) << "weight " << i;
      }
    }
  }
}

// matmul_many gives exactly what one matmul per weight gives: weights of different widths, each
// with its own input or sharing one (prepared once), mixed formats in either order (a BF16 weight
// first must not change how the MXFP4 ones after it treat their input), on every level/numerics.
TEST_P(GemmLevels, ManyInputsEqualSeparateMatmuls) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(86);
  for (int64_t T : {1, 5}) {
    std::vector<k3test::OwnedW> W;
    W.push_back(k3test::make_weight(rng, k3::WFormat::BF16, 40, 256));
    W.push_back(k3test::make_weight(rng, k3::WFormat::MXFP4, 33, 256));
    W.push_back(k3test::make_weight(rng, k3::WFormat::MXFP4, 24, 416));
    W.push_back(k3test::make_weight(rng, k3::WFormat::MXFP4, 17, 256));
    W.push_back(k3test::make_weight(rng, k3::WFormat::F16, 9, 160));
    W.push_back(k3test::make_weight(rng, k3::WFormat::FP8, 21, 256));
    const auto Xa = k3test::rand_vec(rng, size_t(T * 256));
    const auto Xb = k3test::rand_vec(rng, size_t(T * 416));
    const auto Xc = k3test::rand_vec(rng, size_t(T * 256));
    const auto Xd = k3test::rand_vec(rng, size_t(T * 160));
    // Weights 0 and 1 share Xa (and FP8 weight 5 too); weight 3 has the same width but its own input.
    const std::vector<const float*> xs = {Xa.data(), Xa.data(), Xb.data(), Xc.data(), Xd.data(), Xa.data()};
    for (auto num : {k3::ops::Numerics::Exact, k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
      SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " T=" + std::to_string(T) + " numerics " +
                   k3::ops::numerics_name(num));
      const k3::ops::Exec ex{num};
      std::vector<const k3::WeightMat*> ws;
      std::vector<std::vector<float>> sep, many;
      std::vector<float*> ys;
      for (size_t i = 0; i < W.size(); ++i) {
        ws.push_back(&W[i].w);
        sep.push_back(nan_vec(size_t(T * W[i].w.rows)));
        many.push_back(nan_vec(size_t(T * W[i].w.rows)));
        k3::ops::matmul(ex, W[i].w, xs[i], T, sep.back().data());
      }
      for (auto& m : many) ys.push_back(m.data());
      k3::ops::matmul_many(ex, ws.data(), xs.data(), int64_t(ws.size()), T, ys.data());
      for (size_t i = 0; i < W.size(); ++i) {
        EXPECT_EQ(count_nan(many[i]), 0u) << "weight " << i;
        EXPECT_EQ(std::memcmp(many[i].data(), sep[i].data(), sep[i].size() * 4), 0) << "weight " << i;
      }
      // The shared-input form with a BF16 weight first, then MXFP4 ones.
      std::vector<float> a = nan_vec(size_t(T * W[0].w.rows)), b = nan_vec(size_t(T * W[1].w.rows));
      const k3::WeightMat* pair[] = {&W[0].w, &W[1].w};
      float* pys[] = {a.data(), b.data()};
      k3::ops::matmul_shared_input(ex, pair, 2, Xa.data(), T, pys);
      EXPECT_EQ(std::memcmp(a.data(), sep[0].data(), a.size() * 4), 0);
      EXPECT_EQ(std::memcmp(b.data(), sep[1].data(), b.size() * 4), 0);
    }
  }
}

// matmul_rowwise gives each row exactly what its own one-row matmul gives (the decode rows of a
// batched step equal each sequence alone), for every format, level and numerics, with row counts
// that leave partial tiles, widths with tail columns, and BF16 rows at every head offset.
TEST_P(GemmLevels, RowwiseEqualsOneRowMatmuls) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(87);
  for (const auto& [fmt, rows, cols] :
       {std::tuple{k3::WFormat::BF16, 37, 416}, std::tuple{k3::WFormat::BF16, 9, 200},
        std::tuple{k3::WFormat::F32, 13, 100}, std::tuple{k3::WFormat::F16, 6, 160},
        std::tuple{k3::WFormat::MXFP4, 11, 256}, std::tuple{k3::WFormat::FP8, 140, 300}}) {
    k3test::OwnedW W = k3test::make_weight(rng, fmt, rows, cols);
    // BF16: the same rows at several base offsets (each gives another head column).
    std::vector<uint8_t> bytes(data_bytes(W.w) + 128);
    const auto base = (reinterpret_cast<uintptr_t>(bytes.data()) + 63) / 64 * 64;
    for (int off : fmt == k3::WFormat::BF16 ? std::vector<int>{0, 2, 20, 48} : std::vector<int>{0}) {
      k3::WeightMat w = W.w;
      if (fmt == k3::WFormat::BF16) {
        auto* p = reinterpret_cast<uint8_t*>(base + uintptr_t(off));
        std::memcpy(p, W.w.data, data_bytes(W.w));
        w.data = p;
      }
      for (int64_t T : {1, 2, 3, 5, 8, 13}) {
        const auto X = k3test::rand_vec(rng, size_t(T * cols));
        for (auto num : {k3::ops::Numerics::Exact, k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
          SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + k3::wformat_name(fmt) + " offset=" +
                       std::to_string(off) + " T=" + std::to_string(T) + " " + k3::ops::numerics_name(num));
          const k3::ops::Exec ex{num};
          auto one = nan_vec(size_t(T * rows)), all = nan_vec(size_t(T * rows));
          for (int64_t t = 0; t < T; ++t) k3::ops::matmul(ex, w, X.data() + t * cols, 1, one.data() + t * rows);
          k3::ops::matmul_rowwise(ex, w, X.data(), T, all.data());
          ASSERT_EQ(count_nan(one), 0u);
          EXPECT_EQ(std::memcmp(all.data(), one.data(), all.size() * 4), 0);
        }
      }
    }
  }
}

// BF16 GEMVs read rows from their first 64-byte boundary where every row starts equally aligned
// (cols % 32 == 0, 4-byte aligned data) and fall back to unaligned loads otherwise: every base
// offset a mmap'd shard can give (0..62 bytes) must give the same product (to fp32 rounding).
TEST_P(GemmLevels, Bf16GemvAnyAlignment) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(85);
  for (int64_t cols : {64, 96, 1024, 200}) {
    const int64_t rows = 29;
    k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::BF16, rows, cols);
    const auto x = k3test::rand_vec(rng, size_t(cols), -1.0f, 1.0f);
    auto y_ref = nan_vec(size_t(rows));
    k3::ref::matmul(W.w, x.data(), 1, y_ref.data());
    std::vector<uint8_t> bytes(size_t(rows * cols * 2) + 128);
    const auto base = (reinterpret_cast<uintptr_t>(bytes.data()) + 63) / 64 * 64;
    for (int off = 0; off < 64; off += 2) {
      SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " cols=" + std::to_string(cols) +
                   " offset=" + std::to_string(off));
      auto* p = reinterpret_cast<uint8_t*>(base + uintptr_t(off));
      std::memcpy(p, W.w.data, size_t(rows * cols * 2));
      k3::WeightMat w = W.w;
      w.data = p;
      auto y = nan_vec(size_t(rows));
      k3::ops::matmul(k3::ops::kFast, w, x.data(), 1, y.data());  // BF16 GEMVs stay fp32 in fast mode
      EXPECT_EQ(count_nan(y), 0u);
      EXPECT_LT(rel_l2(y, y_ref), kTolExact);
    }
  }
}

// ---------------------------------------------------------------- FP8 (E4M3, 128 x 128 block scales)
namespace {
// Y rows [r0, r0 + n) of a product of the whole matrix, for comparing a view's product with.
std::vector<float> rows_slice(const std::vector<float>& Y, int64_t T, int64_t rows, int64_t r0, int64_t n) {
  std::vector<float> out(size_t(T * n));
  for (int64_t t = 0; t < T; ++t) std::memcpy(out.data() + t * n, Y.data() + t * rows + r0, size_t(n) * 4);
  return out;
}
}  // namespace

// Row views of an FP8 matrix at any row offset (model/parallel.cpp cuts by heads, e.g. rows 96..159;
// the GEMV driver cuts row chunks): a view's row r uses block row (row0 + r) / 128 of its parent's
// scales. Every numerics on every level: the view's product is the parent's rows, bit for bit (each
// output is one kernel call's per-row arithmetic, whatever the tile), and the fp64 twin of the view
// (WeightMat::at with row0) is the twin of the parent's rows; views of views too.
TEST_P(GemmLevels, Fp8RowViewsAtAnyOffset) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(90);
  const int64_t rows = 400, cols = 300;
  k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::FP8, rows, cols);
  for (int64_t T : {1, 3, 70}) {
    const auto X = k3test::rand_vec(rng, size_t(T * cols));
    auto y_ref = nan_vec(size_t(T * rows));
    k3::ref::matmul(W.w, X.data(), T, y_ref.data());
    for (auto num : {k3::ops::Numerics::Exact, k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
      const k3::ops::Exec ex{num};
      auto y_all = nan_vec(size_t(T * rows));
      k3::ops::matmul(ex, W.w, X.data(), T, y_all.data());
      for (const auto& [r0, n] : {std::pair<int64_t, int64_t>{96, 64},
                                  {1, 9},
                                  {127, 2},
                                  {128, 128},
                                  {129, 200},
                                  {250, 150},
                                  {0, 400},
                                  {383, 17}}) {
        SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " " + k3::ops::numerics_name(num) +
                     " T=" + std::to_string(T) + " rows " + std::to_string(r0) + "+" + std::to_string(n));
        const k3::WeightMat v = k3::rows_of(W.w, r0, n);
        EXPECT_EQ(v.row0, r0);
        auto y = nan_vec(size_t(T * n)), y_vref = nan_vec(size_t(T * n));
        k3::ops::matmul(ex, v, X.data(), T, y.data());
        ASSERT_EQ(count_nan(y), 0u);
        EXPECT_EQ(std::memcmp(y.data(), rows_slice(y_all, T, rows, r0, n).data(), y.size() * 4), 0);
        if (num == k3::ops::Numerics::Exact) {
          k3::ref::matmul(v, X.data(), T, y_vref.data());
          EXPECT_EQ(std::memcmp(y_vref.data(), rows_slice(y_ref, T, rows, r0, n).data(), y.size() * 4), 0);
        }
        // A view of the view: rows [r0 + 5, r0 + 5 + m) of the parent.
        if (n > 10) {
          const int64_t m = n - 7;
          const k3::WeightMat vv = k3::rows_of(v, 5, m);
          EXPECT_EQ(vv.row0, r0 + 5);
          auto yy = nan_vec(size_t(T * m));
          k3::ops::matmul(ex, vv, X.data(), T, yy.data());
          EXPECT_EQ(std::memcmp(yy.data(), rows_slice(y_all, T, rows, r0 + 5, m).data(), yy.size() * 4), 0);
        }
      }
    }
  }
}

// The FP8 codes at every byte offset (rows of odd widths start anywhere; a view's data pointer is
// wherever its first row is): the same products, to the F32 tolerance, GEMV and GEMM.
TEST_P(GemmLevels, Fp8AnyAlignment) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(91);
  for (int64_t cols : {128, 200, 1024, 37}) {
    const int64_t rows = 29;
    k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::FP8, rows, cols);
    for (int64_t T : {1, 6}) {
      const auto X = k3test::rand_vec(rng, size_t(T * cols));
      auto y_ref = nan_vec(size_t(T * rows));
      k3::ref::matmul(W.w, X.data(), T, y_ref.data());
      std::vector<uint8_t> bytes(size_t(rows * cols) + 128);
      const auto base = (reinterpret_cast<uintptr_t>(bytes.data()) + 63) / 64 * 64;
      for (int off = 0; off < 64; ++off) {
        SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " cols=" + std::to_string(cols) +
                     " T=" + std::to_string(T) + " offset=" + std::to_string(off));
        auto* p = reinterpret_cast<uint8_t*>(base + uintptr_t(off));
        std::memcpy(p, W.w.data, size_t(rows * cols));
        k3::WeightMat w = W.w;
        w.data = p;
        auto y = nan_vec(size_t(T * rows));
        k3::ops::matmul(k3::ops::kF32, w, X.data(), T, y.data());
        ASSERT_EQ(count_nan(y), 0u);
        EXPECT_LT(rel_l2(y, y_ref), kTolExact);
      }
    }
  }
}

// The dequantised rows every FP8 path multiplies by are the same values: dequant_row (the scalar
// kernels, WeightMat::at) and the SIMD widening of the GEMM (checked through a T = 2 product in F32
// with unit inputs: e_c picks column c, so Y = the weights themselves, exact in any sum order).
TEST_P(GemmLevels, Fp8DequantisedWeightsAreOneValue) {
  const CpuIsa level = GetParam();
  std::mt19937 rng(92);
  const int64_t rows = 150, cols = 200;
  k3test::OwnedW W = k3test::make_weight(rng, k3::WFormat::FP8, rows, cols);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    k3::ops::dequant_row(W.w, r, row.data());
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(row[size_t(c)], W.w.at(r, c)) << r << ", " << c;
  }
  for (int64_t c : {0, 1, 127, 128, 199}) {
    SCOPED_TRACE(std::string(k3::ops::cpu_isa_name(level)) + " column " + std::to_string(c));
    std::vector<float> X(size_t(2 * cols), 0.0f);
    X[size_t(c)] = 1.0f;
    X[size_t(cols + c)] = 1.0f;
    for (int64_t T : {1, 2}) {
      auto y = nan_vec(size_t(T * rows));
      k3::ops::matmul(k3::ops::kF32, W.w, X.data(), T, y.data());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(y[size_t(t * rows + r)], W.w.at(r, c)) << "row " << r;
    }
  }
}
