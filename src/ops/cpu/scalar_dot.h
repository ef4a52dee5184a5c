// The scalar level's dot product: fp32 products accumulated in fp64 over 8 lanes. Long dot products
// (up to 33,792 terms in K3) would otherwise lose ~1e-6 relative per layer, which a deep model
// amplifies; Numerics::Exact relies on it. Shared by the scalar GEMM (gemm.cpp) and the scalar
// attention ops (cpu_ops.cpp). Must not: be included by the per-ISA kernel files.
#pragma once
#include <cstdint>

namespace k3::ops {

inline float dot_f64acc(const float* a, const float* b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(a[i + j] * b[i + j]);
  double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += double(a[i] * b[i]);
  return float(s);
}

}  // namespace k3::ops
