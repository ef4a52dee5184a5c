// WeightMat: a read-only [rows, cols] weight matrix in its stored format (F32, F16, BF16 or MXFP4).
// Owns: the one place that knows how each format maps (row, col) to a value.
// Must not: copy or re-quantize weights; MXFP4 is used exactly as shipped.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "core/dtype.h"

namespace k3 {

enum class WFormat : uint8_t { F32, F16, BF16, MXFP4 };
const char* wformat_name(WFormat f);

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

struct WeightMat {
  WFormat fmt = WFormat::F32;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;       // F32/F16/BF16: [rows, cols]; MXFP4: packed [rows, cols/2] (low nibble = even col)
  const uint8_t* scales = nullptr;  // MXFP4 only: E8M0 [rows, cols/32]

  bool empty() const { return data == nullptr; }
  // Exact value of W[r, c] (slow; for reference code and tests).
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
    }
    return 0.0f;
  }
};

// Bytes of one row of W's data (MXFP4: the packed nibbles; its E8M0 scales are cols / 32 more).
inline int64_t row_bytes(const WeightMat& W) {
  return W.fmt == WFormat::MXFP4 ? W.cols / 2 : W.fmt == WFormat::F32 ? 4 * W.cols : 2 * W.cols;
}

// Rows [r0, r0 + n) of W as a matrix of its own (a view: no copy).
inline WeightMat rows_of(const WeightMat& W, int64_t r0, int64_t n) {
  WeightMat v = W;
  v.rows = n;
  v.data = static_cast<const uint8_t*>(W.data) + r0 * row_bytes(W);
  if (W.scales) v.scales = W.scales + r0 * (W.cols / 32);
  return v;
}

inline WeightMat wmat_f32(const float* data, int64_t rows, int64_t cols) {
  return WeightMat{WFormat::F32, rows, cols, data, nullptr};
}

}  // namespace k3
