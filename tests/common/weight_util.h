// Random weight matrices in every WFormat that own their bytes (tests only).
// Owns: nothing the engine uses. Values are non-zero; MXFP4 scales span 2^-7..2^3.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "common/num_util.h"
#include "core/dtype.h"
#include "ops/weight.h"

namespace k3test {

// A random weight matrix in a given format that owns its bytes.
struct OwnedW {
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  std::vector<uint8_t> packed, scales;
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
  }
  return o;
}

}  // namespace k3test
