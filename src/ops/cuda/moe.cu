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
#include "ops/cuda/launch.cuh"

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
__global__ void __launch_bounds__(kRouterThreads)
    router_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k, bool renorm,
                  float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  pdl_enter();
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

// Fast path for E <= 1024 experts and k <= 32 (every K3 router, decode included): the same fp64
// scores and the same (value, index) order, but no block-wide round per output. Warp w owns the
// experts [128w, 128w + 128), 4 per lane (coalesced: expert 128w + lane + 32m), sorted in registers.
//   1. Each warp extracts its own top k by k warp-argmax rounds (shuffles only; the winning lane
//      shifts its sorted list), into shared memory in order.
//   2. Warp 0 merges the (up to 8) sorted lists: lane l holds list l's head, k more rounds.
//   3. Lane j of warp 0 holds output j: fp64 sum of the k unbiased scores in output order (as the
//      reference), then the weights.
// The order is total (indices are distinct; a NaN key is taken as −inf, so it sorts last instead of
// poisoning the comparisons), hence every lane of a butterfly ends with the same winner. Spent list
// slots hold (−inf, INT_MAX), which loses to every expert.
constexpr int kFastMaxE = 1024, kFastMaxK = 32, kFastPerLane = 4, kFastWarps = kFastMaxE / (32 * kFastPerLane);

__device__ __forceinline__ void cswap_desc(double& va, int& ia, double& vb, int& ib) {
  if (before(vb, ib, va, ia)) {
    const double tv = va;
    va = vb;
    vb = tv;
    const int ti = ia;
    ia = ib;
    ib = ti;
  }
}

// Winner of (v, i) over the lanes xor-reachable with offsets < width (a power of two <= 32).
__device__ __forceinline__ void warp_best(double& v, int& i, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

__global__ void __launch_bounds__(32 * kFastWarps)
    router_fast_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k, bool renorm,
                       float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  __shared__ double s_score[kFastMaxE];  // unbiased σ(logit) per expert
  __shared__ double cv[kFastWarps][kFastMaxK];
  __shared__ int ci[kFastWarps][kFastMaxK];
  __shared__ double s_sel[kFastMaxK];
  pdl_enter();
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const float* lg = logits + t * E;
  double kv[kFastPerLane];
  int ki[kFastPerLane];
#pragma unroll
  for (int m = 0; m < kFastPerLane; ++m) {
    const int e = warp * 32 * kFastPerLane + lane + 32 * m;
    kv[m] = -INFINITY;
    ki[m] = INT_MAX;
    if (e < E) {
      const double se = 1.0 / (1.0 + exp(-double(lg[e])));
      const double key = se + (bias ? double(bias[e]) : 0.0);
      s_score[e] = se;
      kv[m] = key == key ? key : -INFINITY;
      ki[m] = e;
    }
  }
  cswap_desc(kv[0], ki[0], kv[1], ki[1]);
  cswap_desc(kv[2], ki[2], kv[3], ki[3]);
  cswap_desc(kv[0], ki[0], kv[2], ki[2]);
  cswap_desc(kv[1], ki[1], kv[3], ki[3]);
  cswap_desc(kv[1], ki[1], kv[2], ki[2]);
  // 1. This warp's top k (lane j keeps output j when this warp is the only one).
  int mine = INT_MAX;
  for (int j = 0; j < k; ++j) {
    double v = kv[0];
    int i = ki[0];
    warp_best(v, i, 32);
    if (ki[0] == i) {  // this lane's head won: drop it
#pragma unroll
      for (int m = 0; m + 1 < kFastPerLane; ++m) {
        kv[m] = kv[m + 1];
        ki[m] = ki[m + 1];
      }
      kv[kFastPerLane - 1] = -INFINITY;
      ki[kFastPerLane - 1] = INT_MAX;
    }
    if (lane == j) mine = i;
    if (lane == 0) {
      cv[warp][j] = v;
      ci[warp][j] = i;
    }
  }
  if (nw > 1) {
    __syncthreads();
    if (warp != 0) return;
    // 2. Merge of the nw sorted lists; lanes >= nw hold nothing.
    int pos = 0;
    double v = lane < nw ? cv[lane][0] : -INFINITY;
    int i = lane < nw ? ci[lane][0] : INT_MAX;
    for (int j = 0; j < k; ++j) {
      double bv = v;
      int bi = i;
      warp_best(bv, bi, kFastWarps);         // lanes 0..7 agree
      bi = __shfl_sync(0xffffffffu, bi, 0);  // and tell the rest
      if (lane < nw && i == bi) {
        ++pos;
        v = pos < k ? cv[lane][pos] : -INFINITY;
        i = pos < k ? ci[lane][pos] : INT_MAX;
      }
      if (lane == j) mine = bi;
    }
  } else {
    __syncwarp();  // s_score was written by other lanes
  }
  // 3. Weights (warp 0).
  const double sj = lane < k ? s_score[mine] : 0.0;
  if (lane < k) s_sel[lane] = sj;
  __syncwarp();
  if (lane < k) {
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s_sel[j];
    idx[t * k + lane] = mine;
    w[t * k + lane] = float((renorm ? sj / (sum + 1e-20) : sj) * double(scale));
  }
}

// agg[t, c] = Σ_j w[t, j] · y[t·k + j, c], j ascending, fp32.
__global__ void combine_kernel(const float* __restrict__ y, const float* __restrict__ w, int64_t T, int64_t k,
                               int64_t n, float* __restrict__ agg) {
  pdl_enter();
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
    fail("router_topk: " + std::to_string(E) + " experts, top-" + std::to_string(k) +
         " is outside what the GPU kernel takes (E <= " + std::to_string(kMaxExperts) + ", k <= min(E, 256))");
  if (T <= 0) return;
  if (E <= kFastMaxE && k <= kFastMaxK) {
    const int warps = int((E + 32 * kFastPerLane - 1) / (32 * kFastPerLane));
    launch(router_fast_kernel, unsigned(T), 32 * warps, 0, s, logits, bias, int(E), int(k), renorm, scale, idx, w);
    check_launch("router_topk");
    return;
  }
  const size_t smem = size_t(2 * E) * sizeof(double);
  launch(router_kernel, unsigned(T), kRouterThreads, smem, s, logits, bias, int(E), int(k), renorm, scale, idx, w);
  check_launch("router_topk");
}

void moe_combine(const float* y, const float* w, int64_t T, int64_t k, int64_t n, float* agg, Stream s) {
  const int64_t total = T * n;
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 132 * 16);
  launch(combine_kernel, unsigned(blocks), 256, 0, s, y, w, T, k, n, agg);
  check_launch("moe_combine");
}

}  // namespace k3::cuda
