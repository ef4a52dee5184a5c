// Elementwise activations shared by the kernels that apply them (elementwise.cu's situ_glu and
// gemm.cu's fused expert GLU), so that every path computes the same bits.
// Must not: be included by host-only code (it is CUDA source).
#pragma once

namespace k3::cuda {

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiTU GLU of one element (ops.h situ_glu): b1·tanh(g/b1)·σ(g) · b2·tanh(u/b2); a cap of 0 means
// none, so b1 = b2 = 0 is the SiLU GLU g·σ(g)·u (Kimi Linear).
__device__ __forceinline__ float situ_glu_value(float g, float u, float b1, float b2) {
  const float a = (b1 > 0.0f ? b1 * tanhf(g / b1) : g) * sigmoidf_(g);
  const float c = b2 > 0.0f ? b2 * tanhf(u / b2) : u;
  return a * c;
}

}  // namespace k3::cuda
