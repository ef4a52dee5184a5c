// The FP8 quantiser (see fp8.h).
#include "ops/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/ops.h"

namespace k3::ops {

void quantize_fp8_block_row(const WeightMat& src, int64_t br, uint8_t* codes, float* scales, const std::string& what) {
  if (src.fmt != WFormat::F32 && src.fmt != WFormat::F16 && src.fmt != WFormat::BF16)
    fail(what + ": FP8 quantisation takes F32, F16 or BF16 weights, not " + wformat_name(src.fmt));
  const int64_t cols = src.cols, nbc = fp8_block_cols(cols);
  const int64_t r0 = br * kFp8Block, r1 = std::min(src.rows, r0 + kFp8Block);
  // Two passes over the block row's rows, one decoded row at a time (a buffer of one row, not of 128:
  // a load quantises thousands of block rows on every thread): the blocks' max|w|, then the codes.
  std::vector<float> row(static_cast<size_t>(cols));
  std::vector<float> amax(static_cast<size_t>(nbc), 0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    dequant_row(src, r, row.data());
    for (int64_t c = 0; c < cols; ++c) {
      const float w = row[size_t(c)];
      if (!std::isfinite(w))
        fail(what + ": weight [" + std::to_string(r) + ", " + std::to_string(c) + "] is " +
             (std::isnan(w) ? "NaN" : "infinite") + "; FP8 (E4M3) holds finite values only");
      float& m = amax[size_t(c / kFp8Block)];
      m = std::max(m, std::fabs(w));
    }
  }
  // max|w| maps to 448, the largest E4M3 value (DeepSeek-V3's recipe: per-block absmax scaling).
  // A zero block keeps scale 1 (its codes are all +0); a block below 448 x FLT_MIN (1e-35, no real
  // weight) gets FLT_MIN, so no scale is 0 or subnormal.
  for (int64_t b = 0; b < nbc; ++b) {
    const float a = amax[size_t(b)];
    scales[b] = a > 0.0f ? std::max(a / 448.0f, std::numeric_limits<float>::min()) : 1.0f;
  }
  for (int64_t r = r0; r < r1; ++r) {
    dequant_row(src, r, row.data());
    uint8_t* out = codes + (r - r0) * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = f32_to_fp8_e4m3(row[size_t(c)] / scales[c / kFp8Block]);
  }
}

WeightMat fp8_matrix(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols) {
  WeightMat w;
  w.fmt = WFormat::FP8;
  w.rows = rows;
  w.cols = cols;
  w.data = codes;
  w.block_scales = scales;
  w.row0 = 0;
  return w;
}

}  // namespace k3::ops
