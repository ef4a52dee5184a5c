// WeightMat: a read-only [rows, cols] weight matrix in its stored format (F32, F16, BF16, MXFP4, or
// FP8: E4M3 with 128 x 128 block scales, which the FP8 trunk option makes at load).
// Owns: the one place that knows how each format maps (row, col) to a value, and row views.
// Must not: copy or re-quantize weights; MXFP4 is used exactly as shipped.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "core/dtype.h"

namespace k3 {

enum class WFormat : uint8_t { F32, F16, BF16, MXFP4, FP8 };
const char* wformat_name(WFormat f);

// FP8 block scales: one fp32 scale per kFp8Block x kFp8Block block of a matrix (edge blocks partial).
constexpr int64_t kFp8Block = 128;
inline int64_t fp8_block_cols(int64_t cols) { return (cols + kFp8Block - 1) / kFp8Block; }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

struct WeightMat {
  WFormat fmt = WFormat::F32;
  int64_t rows = 0, cols = 0;
  // F32/F16/BF16: [rows, cols]; MXFP4: packed [rows, cols/2] (low nibble = even col); FP8: E4M3 bytes
  // [rows, cols] (never S.1111.111: the quantiser refuses non-finite weights, and the SIMD kernels
  // do not decode NaN codes).
  const void* data = nullptr;
  // MXFP4: E8M0 [rows, cols/32]. FP8 on the GPU only (backend_cuda's upload): fp32 [rows,
  // fp8_block_cols(cols)] as bytes, each row's copy of its block row's scales, so a view of any
  // first row finds its scales as an MXFP4 view does (block_scales is then null).
  const uint8_t* scales = nullptr;
  // FP8 only: the fp32 block scales of the whole matrix this is (a view of), [ceil(R/128),
  // fp8_block_cols(cols)] for its R rows, and this view's first row in that matrix: row r of the view
  // is in block row (row0 + r) / 128. Views may start at any row (rows_of), not only at block edges.
  const float* block_scales = nullptr;
  int64_t row0 = 0;

  bool empty() const { return data == nullptr; }
  // Exact value of W[r, c] (slow; for reference code and tests). FP8: the code's value times its
  // block's scale, one fp32 multiply (the dequantised weight every kernel uses).
  float at(int64_t r, int64_t c) const {
    // Views point into mmap'd shards whose data section need not be aligned: load via memcpy.
    const uint8_t* bytes = static_cast<const uint8_t*>(data);
    switch (fmt) {
      case WFormat::F32: {
        float f;
        std::memcpy(&f, bytes + 4 * (r * cols + c), 4);
        return f;
      }
      case WFormat::F16:
        return f16_to_f32(load_u16(bytes + 2 * (r * cols + c)));
      case WFormat::BF16:
        return bf16_to_f32(load_u16(bytes + 2 * (r * cols + c)));
      case WFormat::MXFP4: {
        const uint8_t b = static_cast<const uint8_t*>(data)[r * (cols / 2) + c / 2];
        const uint8_t code = (c & 1) ? (b >> 4) : (b & 0x0f);
        return kE2M1[code] * e8m0_to_f32(scales[r * (cols / 32) + c / 32]);
      }
      case WFormat::FP8:
        return fp8_e4m3_to_f32(bytes[r * cols + c]) *
               block_scales[((row0 + r) / kFp8Block) * fp8_block_cols(cols) + c / kFp8Block];
    }
    return 0.0f;
  }
};

// The fp32 scales of row r of an FP8 matrix (one per 128 columns).
inline const float* fp8_row_scales(const WeightMat& W, int64_t r) {
  return W.block_scales + ((W.row0 + r) / kFp8Block) * fp8_block_cols(W.cols);
}

// Bytes of one row of W's data (MXFP4: the packed nibbles; its E8M0 scales are cols / 32 more; FP8:
// the E4M3 bytes, its block scales are shared by 128 rows).
inline int64_t row_bytes(const WeightMat& W) {
  switch (W.fmt) {
    case WFormat::F32:
      return 4 * W.cols;
    case WFormat::F16:
    case WFormat::BF16:
      return 2 * W.cols;
    case WFormat::MXFP4:
      return W.cols / 2;
    case WFormat::FP8:
      return W.cols;
  }
  return 0;
}

// The GPU form's scales of an FP8 matrix (with block scales): out[r * fp8_block_cols(cols) + b] = the
// scale of row r's block b, for its `rows` rows ([rows, fp8_block_cols(cols)] fp32).
inline void fp8_row_scale_table(const WeightMat& W, float* out) {
  const int64_t nbc = fp8_block_cols(W.cols);
  for (int64_t r = 0; r < W.rows; ++r) std::memcpy(out + r * nbc, fp8_row_scales(W, r), size_t(nbc) * sizeof(float));
}

// Bytes of one row's `scales` (MXFP4: E8M0 per 32 columns; FP8 in its GPU form: fp32 per 128).
inline int64_t scale_row_bytes(const WeightMat& W) {
  return W.fmt == WFormat::MXFP4 ? W.cols / 32 : W.fmt == WFormat::FP8 ? 4 * fp8_block_cols(W.cols) : 0;
}

// Rows [r0, r0 + n) of W as a matrix of its own (a view: no copy). FP8 views keep the parent's block
// scales and record where they start in it.
inline WeightMat rows_of(const WeightMat& W, int64_t r0, int64_t n) {
  WeightMat v = W;
  v.rows = n;
  v.data = static_cast<const uint8_t*>(W.data) + r0 * row_bytes(W);
  if (W.scales) v.scales = W.scales + r0 * scale_row_bytes(W);
  v.row0 = W.row0 + r0;
  return v;
}

inline WeightMat wmat_f32(const float* data, int64_t rows, int64_t cols) {
  return WeightMat{WFormat::F32, rows, cols, data, nullptr};
}

}  // namespace k3
