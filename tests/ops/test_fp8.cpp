// The FP8 quantiser (ops/fp8.h) against its definition, computed independently here from
// WeightMat::at and core/dtype.h: per 128 x 128 block, scale = max|w| / 448 (a zero block: 1), code =
// e4m3(w / scale) (round to nearest even, saturating); the rounding error bound that follows; the
// one-line refusals; and the byte counts of FP8 matrices and their row views (model/weights.h).
// Owns: nothing the engine uses; test-only.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/num_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/weights.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace {

struct Quantised {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  k3::WeightMat w;
};

Quantised quantise(const k3::WeightMat& src) {
  Quantised q;
  const int64_t nbr = (src.rows + 127) / 128, nbc = k3::fp8_block_cols(src.cols);
  q.codes.assign(size_t(src.rows * src.cols), 0xaa);
  q.scales.assign(size_t(nbr * nbc), k3test::qnan());
  for (int64_t br = 0; br < nbr; ++br)
    k3::ops::quantize_fp8_block_row(src, br, q.codes.data() + br * 128 * src.cols, q.scales.data() + br * nbc, "W");
  q.w = k3::ops::fp8_matrix(q.codes.data(), q.scales.data(), src.rows, src.cols);
  return q;
}

// The definition, block by block, for a source in any dense format.
void expect_definition(const k3::WeightMat& src, const Quantised& q) {
  const int64_t nbc = k3::fp8_block_cols(src.cols);
  for (int64_t br = 0; br * 128 < src.rows; ++br)
    for (int64_t bc = 0; bc < nbc; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min(src.rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(src.cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(src.at(r, c)));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      ASSERT_EQ(q.scales[size_t(br * nbc + bc)], s) << "block " << br << ", " << bc;
      bool saw_max = false;
      for (int64_t r = br * 128; r < std::min(src.rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(src.cols, bc * 128 + 128); ++c) {
          const float w = src.at(r, c);
          const uint8_t code = q.codes[size_t(r * src.cols + c)];
          ASSERT_EQ(code, k3::f32_to_fp8_e4m3(w / s)) << r << ", " << c;
          ASSERT_NE(code & 0x7f, 0x7f) << "a NaN code";
          saw_max = saw_max || (amax > 0 && (code & 0x7f) == 0x7e && std::fabs(w) == amax);
          // Round to nearest: half a step of the 3-bit mantissa (2^-4 relative) in the normal range,
          // half the subnormal step (2^-10 x scale) below it.
          const double err = std::fabs(double(q.w.at(r, c)) - double(w));
          const double bound = std::fabs(w / s) >= std::ldexp(1.0, -6)
                                   ? std::ldexp(std::fabs(double(w)), -4) * 1.0000001
                                   : std::ldexp(double(s), -10) * 1.0000001;
          ASSERT_LE(err, bound) << r << ", " << c;
        }
      if (amax > 0) {
        EXPECT_TRUE(saw_max) << "the block maximum is not +-448 in block " << br << ", " << bc;
      }
    }
}

}  // namespace

TEST(Fp8Quantiser, MatchesTheDefinitionForEveryDenseFormat) {
  std::mt19937 rng(5);
  const int64_t rows = 300, cols = 200;  // 3 x 2 blocks, the last of each partial
  auto v = k3test::rand_vec(rng, size_t(rows * cols), -3.0f, 3.0f);
  for (int64_t i = 0; i < rows * cols; i += 7) v[size_t(i)] *= 1e-3f;  // values in the subnormal range of their block
  std::vector<uint16_t> h(v.size());
  for (auto fmt : {k3::WFormat::F32, k3::WFormat::BF16, k3::WFormat::F16}) {
    SCOPED_TRACE(k3::wformat_name(fmt));
    k3::WeightMat src = k3::wmat_f32(v.data(), rows, cols);
    if (fmt != k3::WFormat::F32) {
      for (size_t i = 0; i < v.size(); ++i)
        h[i] = fmt == k3::WFormat::BF16 ? k3::f32_to_bf16(v[i]) : k3::f32_to_f16(v[i]);
      src.fmt = fmt;
      src.data = h.data();
    }
    const Quantised q = quantise(src);
    expect_definition(src, q);
  }
}

TEST(Fp8Quantiser, ZeroBlockHasScaleOneAndZeroCodes) {
  std::mt19937 rng(6);
  const int64_t rows = 200, cols = 260;
  auto v = k3test::rand_vec(rng, size_t(rows * cols), -1.0f, 1.0f);
  for (int64_t r = 128; r < 200; ++r)
    for (int64_t c = 128; c < 256; ++c) v[size_t(r * cols + c)] = (r + c) % 2 ? 0.0f : -0.0f;
  const k3::WeightMat src = k3::wmat_f32(v.data(), rows, cols);
  const Quantised q = quantise(src);
  EXPECT_EQ(q.scales[size_t(1 * 3 + 1)], 1.0f);
  for (int64_t r = 128; r < 200; ++r)
    for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(q.codes[size_t(r * cols + c)] & 0x7f, 0) << r << ", " << c;
  expect_definition(src, q);
}

TEST(Fp8Quantiser, RefusesNonFiniteWeightsAndOtherFormats) {
  std::vector<float> v(size_t(130 * 10), 0.5f);
  v[size_t(129 * 10 + 3)] = std::numeric_limits<float>::infinity();
  const k3::WeightMat src = k3::wmat_f32(v.data(), 130, 10);
  std::vector<uint8_t> codes(v.size());
  float scales[1];
  k3::ops::quantize_fp8_block_row(src, 0, codes.data(), scales, "W");  // block row 0 is finite
  try {
    k3::ops::quantize_fp8_block_row(src, 1, codes.data() + 128 * 10, scales, "model.layers.0.mlp.up_proj.weight");
    FAIL() << "an infinite weight was quantised";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "model.layers.0.mlp.up_proj.weight: weight [129, 3] is infinite; FP8 (E4M3) holds finite values only");
  }
  v[size_t(129 * 10 + 3)] = std::nanf("");
  EXPECT_THROW(k3::ops::quantize_fp8_block_row(src, 1, codes.data() + 128 * 10, scales, "W"), k3::Error);
  k3::WeightMat mx = src;
  mx.fmt = k3::WFormat::MXFP4;
  try {
    k3::ops::quantize_fp8_block_row(mx, 0, codes.data(), scales, "expert");
    FAIL();
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()), "expert: FP8 quantisation takes F32, F16 or BF16 weights, not MXFP4");
  }
}

// Bytes: the codes and one fp32 per block; a row view counts the scales of the block rows it touches
// (rows 96..159 touch block rows 0 and 1).
TEST(Fp8Quantiser, ByteCountsOfMatricesAndViews) {
  std::vector<float> v(size_t(300 * 200), 0.25f);
  const Quantised q = quantise(k3::wmat_f32(v.data(), 300, 200));
  EXPECT_EQ(k3::fp8_matrix_bytes(300, 200), uint64_t(300 * 200 + 4 * 3 * 2));
  EXPECT_EQ(k3::weight_bytes(q.w), k3::fp8_matrix_bytes(300, 200));
  EXPECT_EQ(k3::row_bytes(q.w), 200);
  EXPECT_EQ(k3::weight_bytes(k3::rows_of(q.w, 96, 64)), uint64_t(64 * 200 + 4 * 2 * 2));
  EXPECT_EQ(k3::weight_bytes(k3::rows_of(q.w, 128, 128)), uint64_t(128 * 200 + 4 * 1 * 2));
  EXPECT_EQ(k3::weight_bytes(k3::rows_of(q.w, 127, 2)), uint64_t(2 * 200 + 4 * 2 * 2));
  EXPECT_EQ(k3::wformat_name(k3::WFormat::FP8), std::string("FP8"));
}
