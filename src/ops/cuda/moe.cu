// CUDA MoE routing and combine (cuda_ops.h): router_topk (sigmoid scores, biased selection,
// unbiased renormalised weights, as k3::ref::router_topk) and moe_combine (weighted expert sum).
// The expert GEMMs themselves are gemm.cu's (expert_matmul).
// Must not: sync, allocate, or move the selected ids to the host (graphs replay the routing).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"

namespace k3::cuda {

namespace {

constexpr int kRouterThreads = 256;
constexpr int64_t kMaxExperts = 2048;  // 2 doubles each in shared memory (32 KiB)

// (value, index) order of a stable descending sort: larger value first, equal values by lower index.
__device__ __forceinline__ bool before(double va, int ia, double vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// One block per token, in fp64 like the reference so that the selection (and a near-tie in it) is
// the reference's: s = σ(logit), sel = s + bias. Then k rounds of a block-wide argmax under the
// stable-sort order above; round j's winner is output j (the reference's order, ties to the
// lower index) and leaves the candidate set. Each thread owns experts tid, tid + 256, ... and keeps
// the best of them in registers; only the owner of a round's winner rescans. One barrier a round
// (the per-warp candidates are double-buffered).
__global__ void __launch_bounds__(kRouterThreads) router_kernel(const float* __restrict__ logits,
                                                                const float* __restrict__ bias, int E, int k,
                                                                bool renorm, float scale, int32_t* __restrict__ idx,
                                                                float* __restrict__ w) {
  extern __shared__ double rsm[];
  double* s = rsm;      // [E] unbiased scores
  double* key = s + E;  // [E] selection scores; -inf once selected
  __shared__ double cv[2][kRouterThreads / 32];
  __shared__ int ci[2][kRouterThreads / 32];
  __shared__ int order[256];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* lg = logits + t * E;
  for (int e = tid; e < E; e += kRouterThreads) {
    const double se = 1.0 / (1.0 + exp(-double(lg[e])));
    s[e] = se;
    key[e] = se + (bias ? double(bias[e]) : 0.0);
  }
  // Own experts are read back by the same thread only, so no barrier is needed before the scan.
  double bv = -INFINITY;
  int bi = INT_MAX;
  auto rescan = [&] {
    bv = -INFINITY;
    bi = INT_MAX;
    for (int e = tid; e < E; e += kRouterThreads)
      if (before(key[e], e, bv, bi)) {
        bv = key[e];
        bi = e;
      }
  };
  rescan();
  for (int j = 0; j < k; ++j) {
    double v = bv;
    int i = bi;
    for (int o = 16; o > 0; o >>= 1) {
      const double ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (before(ov, oi, v, i)) {
        v = ov;
        i = oi;
      }
    }
    const int b = j & 1;
    if (lane == 0) {
      cv[b][warp] = v;
      ci[b][warp] = i;
    }
    __syncthreads();
    v = cv[b][0];
    i = ci[b][0];
    for (int x = 1; x < kRouterThreads / 32; ++x)
      if (before(cv[b][x], ci[b][x], v, i)) {
        v = cv[b][x];
        i = ci[b][x];
      }
    if (tid == 0) order[j] = i;
    if (i == bi) {  // this thread owned the winner: drop it and find its next best
      key[i] = -INFINITY;
      rescan();
    }
  }
  __syncthreads();
  if (tid == 0) {
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s[order[j]];
    for (int j = 0; j < k; ++j) {
      const double sj = s[order[j]];
      idx[t * k + j] = order[j];
      w[t * k + j] = float((renorm ? sj / (sum + 1e-20) : sj) * double(scale));
    }
  }
}

// agg[t, c] = Σ_j w[t, j] · y[t·k + j, c], j ascending, fp32.
__global__ void combine_kernel(const float* __restrict__ y, const float* __restrict__ w, int64_t T, int64_t k,
                               int64_t n, float* __restrict__ agg) {
  const int64_t total = T * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / n, c = i % n;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) acc = fmaf(w[t * k + j], y[(t * k + j) * n + c], acc);
    agg[i] = acc;
  }
}

}  // namespace

void router_topk(const float* logits, const float* bias, int64_t T, int64_t E, int64_t k, bool renorm, float scale,
                 int32_t* idx, float* w, Stream s) {
  if (E < 1 || E > kMaxExperts || k < 1 || k > E || k > 256)
    fail("router_topk: " + std::to_string(E) + " experts, top-" + std::to_string(k) + " is outside what the GPU kernel takes (E <= " +
         std::to_string(kMaxExperts) + ", k <= min(E, 256))");
  if (T <= 0) return;
  const size_t smem = size_t(2 * E) * sizeof(double);
  router_kernel<<<unsigned(T), kRouterThreads, smem, s>>>(logits, bias, int(E), int(k), renorm, scale, idx, w);
  check_launch("router_topk");
}

void moe_combine(const float* y, const float* w, int64_t T, int64_t k, int64_t n, float* agg, Stream s) {
  const int64_t total = T * n;
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 132 * 16);
  combine_kernel<<<unsigned(blocks), 256, 0, s>>>(y, w, T, k, n, agg);
  check_launch("moe_combine");
}

}  // namespace k3::cuda
