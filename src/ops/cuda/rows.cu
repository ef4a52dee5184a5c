// Row gather/scatter on the GPU (cuda_ops.h): the data movement of MoE prefill grouped by expert
// (gpu_forward.cpp). Plain copies, so grouping changes no value.
// Must not: sync or allocate.
#include <cuda_runtime.h>

#include "ops/cuda/cuda_ops.h"

namespace k3::cuda {

namespace {
// One block per row; when `gather` the source row is rows[i], else the destination row is.
__global__ void move_rows(const float* __restrict__ src, const int32_t* __restrict__ rows, int64_t width,
                          float* __restrict__ dst, bool gather) {
  const int64_t i = blockIdx.x;
  const int64_t from = gather ? rows[i] : i, to = gather ? i : rows[i];
  const float* s = src + from * width;
  float* d = dst + to * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}
// Block i copies row i when ids[i] >= 0.
__global__ void copy_where(const float* __restrict__ src, const int32_t* __restrict__ ids, int64_t width,
                           float* __restrict__ dst) {
  const int64_t i = blockIdx.x;
  if (ids[i] < 0) return;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[i * width + c] = src[i * width + c];
}
}  // namespace

void copy_rows_where(const float* src, const int32_t* ids, int64_t n, int64_t width, float* dst, Stream s) {
  if (n <= 0) return;
  copy_where<<<unsigned(n), 256, 0, s>>>(src, ids, width, dst);
  check_launch("copy_rows_where");
}

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst, Stream s) {
  if (n <= 0) return;
  move_rows<<<unsigned(n), 256, 0, s>>>(src, rows, width, dst, true);
  check_launch("gather_rows");
}

void scatter_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst, Stream s) {
  if (n <= 0) return;
  move_rows<<<unsigned(n), 256, 0, s>>>(src, rows, width, dst, false);
  check_launch("scatter_rows");
}

}  // namespace k3::cuda
