// Synthetic weights for measurements (the true-width layer bench, `k3 plan --calibrate`): random BF16
// and MXFP4 matrices whose values are finite, non-zero and of trained-model magnitude, and fp32
// vectors; the arena owns every byte it hands out as views. Seeded: the same seed, the same weights.
// Must not: be used for anything a model computes with (measurements only).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <vector>

#include "model/weights.h"

namespace k3 {

struct SyntheticWeights {
  explicit SyntheticWeights(uint64_t seed) : rng(seed) {}
  std::vector<std::unique_ptr<uint8_t[]>> bufs;
  std::deque<std::vector<float>> kept;  // the vectors the FVec views point at
  std::mt19937_64 rng;

  uint8_t* alloc(size_t n) {
    bufs.emplace_back(new uint8_t[n]);
    return bufs.back().get();
  }
  // BF16 values with random sign/mantissa and exponents giving |w| in [2^-9, 2^-5).
  WeightMat bf16(int64_t rows, int64_t cols) {
    const size_t n = size_t(rows * cols);
    auto* p = reinterpret_cast<uint16_t*>(alloc(2 * n));
    for (size_t i = 0; i < n; i += 4) {
      const uint64_t r = rng();
      for (size_t j = 0; j < 4 && i + j < n; ++j) {
        const uint16_t b = uint16_t(r >> (16 * j));
        p[i + j] = uint16_t((b & 0x807f) | uint16_t((118 + (b >> 8) % 4) << 7));
      }
    }
    return WeightMat{WFormat::BF16, rows, cols, p, nullptr};
  }
  // MXFP4: random nibbles, E8M0 scales 2^-9 .. 2^-6.
  WeightMat mxfp4(int64_t rows, int64_t cols) {
    const size_t n = size_t(rows * cols);
    uint8_t* p = alloc(n / 2);
    uint8_t* s = alloc(n / 32);
    for (size_t i = 0; i < n / 2; i += 8) {
      const uint64_t r = rng();
      std::memcpy(p + i, &r, std::min<size_t>(8, n / 2 - i));
    }
    for (size_t i = 0; i < n / 32; ++i) s[i] = uint8_t(118 + rng() % 4);
    return WeightMat{WFormat::MXFP4, rows, cols, p, s};
  }
  // n values uniform in base +- spread.
  std::vector<float> floats(int64_t n, float base, float spread) {
    std::uniform_real_distribution<float> u(-spread, spread);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = base + u(rng);
    return v;
  }
  FVec vec(int64_t n, float base, float spread) {
    kept.push_back(floats(n, base, spread));
    return FVec{kept.back().data(), n};
  }
};

}  // namespace k3
