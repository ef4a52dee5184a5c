// Roofline probes for the GPU bench (see runtime.h): HBM copy bandwidth and cuBLAS bf16 GEMM rate,
// both on the device the engine uses, on random (non-zero) data, timed with CUDA events.
// Must not: be used on the forward path.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/error.h"
#include "ops/cuda/runtime.h"

namespace k3::cuda {

namespace {
__global__ void fill_random_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffff) / 65536.0f - 0.5f + 1e-3f);
  }
}
}  // namespace

double measure_copy_gbs(size_t bytes) {
  DevBuf a(bytes, "bandwidth probe"), b(bytes, "bandwidth probe");
  fill_random_bf16<<<1024, 256>>>(a.as<__nv_bfloat16>(), bytes / 2, 1);
  check_launch("fill_random_bf16");
  sync();
  EventTimer t;
  double best = 1e30;
  for (int i = 0; i < 8; ++i) {
    t.start(nullptr);
    d2d(b.get(), a.get(), bytes);
    t.stop(nullptr);
    const double ms = t.ms();
    if (i > 0) best = std::min(best, ms);  // the first copy warms up
  }
  return 2.0 * double(bytes) / (best * 1e-3) / 1e9;
}

double measure_bf16_gemm_tflops(int n) {
  load_cublas();
  const size_t nn = size_t(n) * size_t(n);
  DevBuf A(nn * 2, "GEMM probe"), B(nn * 2, "GEMM probe"), C(nn * 4, "GEMM probe");
  fill_random_bf16<<<1024, 256>>>(A.as<__nv_bfloat16>(), nn, 2);
  fill_random_bf16<<<1024, 256>>>(B.as<__nv_bfloat16>(), nn, 3);
  check_launch("fill_random_bf16");
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: cannot create a handle for the GEMM probe");
  const float one = 1.0f, zero = 0.0f;
  const auto gemm = [&] {
    const cublasStatus_t st =
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, A.get(), CUDA_R_16BF, n, B.get(), CUDA_R_16BF, n,
                     &zero, C.get(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(h);
      fail("cuBLAS: GEMM probe failed (status " + std::to_string(int(st)) + ")");
    }
  };
  for (int i = 0; i < 3; ++i) gemm();
  EventTimer t;
  const int reps = 10;
  t.start(nullptr);
  for (int i = 0; i < reps; ++i) gemm();
  t.stop(nullptr);
  const double ms = t.ms() / reps;
  cublasDestroy(h);
  return 2.0 * double(n) * n * n / (ms * 1e-3) / 1e12;
}

}  // namespace k3::cuda
