// Random weight matrices in every WFormat that own their bytes (tests only).
// Owns: nothing the engine uses. Values are non-zero; MXFP4 scales span 2^-7..2^3; FP8 blocks are
// quantised from fp32 values whose blocks span 2^-6..2^6 (so their scales differ).
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/num_util.h"
#include "core/dtype.h"
#include "ops/fp8.h"
#include "ops/weight.h"

namespace k3test {

// A random weight matrix in a given format that owns its bytes.
struct OwnedW {
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  std::vector<uint8_t> packed, scales;  // MXFP4; FP8: packed holds the E4M3 codes
  std::vector<float> block_scales;      // FP8
  k3::WeightMat w;
};

inline OwnedW make_weight(std::mt19937& rng, k3::WFormat fmt, int64_t rows, int64_t cols, float amp = 1.0f) {
  OwnedW o;
  o.w.fmt = fmt;
  o.w.rows = rows;
  o.w.cols = cols;
  const size_t n = size_t(rows * cols);
  switch (fmt) {
    case k3::WFormat::F32:
      o.f32 = k3test::rand_vec(rng, n, 0.05f * amp, amp);
      o.w.data = o.f32.data();
      break;
    case k3::WFormat::F16:
    case k3::WFormat::BF16: {
      const auto v = k3test::rand_vec(rng, n, 0.05f * amp, amp);
      o.h16.resize(n);
      for (size_t i = 0; i < n; ++i) o.h16[i] = fmt == k3::WFormat::F16 ? k3::f32_to_f16(v[i]) : k3::f32_to_bf16(v[i]);
      o.w.data = o.h16.data();
      break;
    }
    case k3::WFormat::MXFP4: {
      std::uniform_int_distribution<int> byte(0, 255), sc(120, 130);
      o.packed.resize(n / 2);
      for (auto& b : o.packed) b = uint8_t(byte(rng));
      o.scales.resize(n / 32);
      for (auto& s : o.scales) s = uint8_t(sc(rng));
      o.w.data = o.packed.data();
      o.w.scales = o.scales.data();
      break;
    }
    case k3::WFormat::FP8: {
      // Random fp32 values, blocks of different magnitudes (2^-6..2^6 x amp), quantised by the engine's
      // quantiser (ops/fp8.h; tests/ops/test_fp8.cpp checks it against the definition).
      auto v = k3test::rand_vec(rng, n, 0.05f * amp, amp);
      std::uniform_int_distribution<int> mag(-6, 6);
      const int64_t nbr = (rows + k3::kFp8Block - 1) / k3::kFp8Block, nbc = k3::fp8_block_cols(cols);
      std::vector<float> block(size_t(nbr * nbc));
      for (auto& b : block) b = std::ldexp(1.0f, mag(rng));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          v[size_t(r * cols + c)] *= block[size_t((r / k3::kFp8Block) * nbc + c / k3::kFp8Block)];
      o.f32 = v;
      o.packed.resize(n);
      o.block_scales.resize(size_t(nbr * nbc));
      const k3::WeightMat src = k3::wmat_f32(o.f32.data(), rows, cols);
      for (int64_t br = 0; br < nbr; ++br)
        k3::ops::quantize_fp8_block_row(src, br, o.packed.data() + br * k3::kFp8Block * cols,
                                        o.block_scales.data() + br * nbc, "test weight");
      o.w = k3::ops::fp8_matrix(o.packed.data(), o.block_scales.data(), rows, cols);
      break;
    }
  }
  return o;
}

}  // namespace k3test
