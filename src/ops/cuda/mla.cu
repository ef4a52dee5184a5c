// CUDA MLA over the latent cache (cuda_ops.h): the cache append (normalised latent + shared k_r),
// the absorbed attention (q̃ = W_UKᵀ q_nope, softmax over [c | k_r] keys, W_UV on the latent
// output) and the device-side length counter. fp32 everywhere in both precisions. Each of append
// and attention also in a paged varlen form (many sequences, pages through a block table) sharing
// the same kernel bodies; the key ranges of a paged launch are split by a device-side plan.
// Must not: sync, allocate, or read the cache length on the host (it lives on the device so a
// captured decode graph replays with a growing cache); the grid never depends on that length.
// Launches: programmatic dependent launch on created streams (launch() below; graph-safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/varlen.cuh"

namespace k3::cuda {

namespace {

// ---------------------------------------------------------------- cache append
// One block per new token: RMSNorm of the latent (fp64 sum of squares, fp32 w·(x·inv) as the CPU
// rmsnorm) into c_dst [L], and the raw k_r copied into kr_dst [R]. The contiguous and the paged
// appends differ only in where a token's row is, so they share this body (and its bits).
__device__ __forceinline__ void append_row(const float* __restrict__ x, int64_t L, int64_t R,
                                           const float* __restrict__ w, float eps, float* __restrict__ c_dst,
                                           float* __restrict__ kr_dst) {
  __shared__ double red[32];
  double ss = 0;
  for (int64_t i = threadIdx.x; i < L; i += blockDim.x) ss += double(x[i]) * double(x[i]);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    double v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = float(1.0 / sqrt(red[0] / double(L) + double(eps)));
  for (int64_t i = threadIdx.x; i < L; i += blockDim.x) c_dst[i] = w[i] * (x[i] * inv);
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) kr_dst[i] = x[L + i];
}

// Contiguous cache: token t at row *len_dev + t of c_cache [cap, L] and kr_cache [cap, R].
__global__ void cache_append_kernel(const float* __restrict__ ckv, int64_t L, int64_t R, const float* __restrict__ w,
                                    float eps, const int32_t* __restrict__ len_dev, float* __restrict__ c_cache,
                                    float* __restrict__ kr_cache) {
  pdl_enter();
  const int64_t t = blockIdx.x, pos = int64_t(*len_dev) + t;
  append_row(ckv + t * (L + R), L, R, w, eps, c_cache + pos * L, kr_cache + pos * R);
}

// Paged cache: row r of sequence i (cu_rows[i] <= r) at position pos0[i] + r - cu_rows[i] of that
// sequence's pages. A position the table cannot place is skipped (never a stray write).
__global__ void cache_append_paged_kernel(const float* __restrict__ ckv, int64_t L, int64_t R,
                                          const float* __restrict__ w, float eps, const int32_t* __restrict__ cu_rows,
                                          int n_seqs, PagedCacheDev c) {
  pdl_enter();
  const int64_t r = blockIdx.x;
  const int i = seq_of_row(cu_rows, n_seqs, r);
  const int64_t pos = int64_t(c.pos0[i]) + r - cu_rows[i];
  float* dst = paged_row(c, c.block_table + int64_t(i) * c.max_pages, pos, L + R);
  if (dst == nullptr) return;  // the whole block: no barrier is left waiting
  append_row(ckv + r * (L + R), L, R, w, eps, dst, dst + L);
}

__global__ void advance_len_kernel(int32_t* len, int32_t T) {
  pdl_enter();
  *len += T;
}

// ---------------------------------------------------------------- per-head products with kv_b
template <int FMT>  // 0 F32, 1 F16, 2 BF16: decoded exactly as WeightMat::at
__device__ __forceinline__ float load_w(const void* p, int64_t i) {
  if constexpr (FMT == 0) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (FMT == 1) {
    return __half2float(static_cast<const __half*>(p)[i]);
  } else {
    return __uint_as_float(uint32_t(static_cast<const unsigned short*>(p)[i]) << 16);
  }
}

// For each head h (grid z): Y[t, h, n] = Σ_k X[t, h, k] · B_h(k, n), with B from kv_b:
//   NT = false (q̃ = W_UKᵀ q_nope):  B_h(k, n) = kv_b[h·per + k, n]          (k < nope, n < kv_lora)
//   NT = true  (out = W_UV o_lat):   B_h(k, n) = kv_b[h·per + nope + n, k]   (k < kv_lora, n < v)
// 32 (tokens) × 64 tile per block, 16-deep k slabs through shared memory, 2×4 outputs per thread.
// For decode (T = 1) every weight is read once; for prefill each weight tile serves 32 tokens.
constexpr int kGM = 32, kGN = 64, kGK = 16;

template <int FMT, bool NT>
__global__ void __launch_bounds__(256)
    head_gemm_kernel(const float* __restrict__ X, int64_t ldx_t, int64_t ldx_h, const void* __restrict__ W,
                     int64_t wcols, int64_t per, int64_t row_off, int64_t T, int K, int N, float* __restrict__ Y,
                     int64_t ldy_t, int64_t ldy_h) {
  pdl_enter();
  __shared__ float As[kGK][kGM + 4];
  __shared__ float Bs[kGK][kGN + 4];
  const int tid = threadIdx.x, tm = tid / 16, tn = tid % 16;
  const int64_t h = blockIdx.z, t0 = int64_t(blockIdx.y) * kGM;
  const int n0 = blockIdx.x * kGN;
  const int64_t wrow0 = h * per + row_off;
  float acc[2][4] = {};
  for (int k0 = 0; k0 < K; k0 += kGK) {
    for (int idx = tid; idx < kGM * kGK; idx += 256) {
      const int m = idx / kGK, kk = idx % kGK;
      const int64_t t = t0 + m;
      As[kk][m] = (t < T && k0 + kk < K) ? X[t * ldx_t + h * ldx_h + k0 + kk] : 0.0f;
    }
    for (int idx = tid; idx < kGK * kGN; idx += 256) {
      int kk, n;
      if (NT) {  // weight rows are n: read along k (contiguous)
        n = idx / kGK;
        kk = idx % kGK;
      } else {  // weight rows are k: read along n (contiguous)
        kk = idx / kGN;
        n = idx % kGN;
      }
      float b = 0.0f;
      if (k0 + kk < K && n0 + n < N)
        b = NT ? load_w<FMT>(W, (wrow0 + n0 + n) * wcols + k0 + kk)
               : load_w<FMT>(W, (wrow0 + k0 + kk) * wcols + n0 + n);
      Bs[kk][n] = b;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGK; ++kk) {
      const float a0 = As[kk][tm * 2], a1 = As[kk][tm * 2 + 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float b = Bs[kk][tn + 16 * j];
        acc[0][j] = fmaf(a0, b, acc[0][j]);
        acc[1][j] = fmaf(a1, b, acc[1][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t t = t0 + tm * 2 + i;
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tn + 16 * j;
      if (n < N) Y[t * ldy_t + h * ldy_h + n] = acc[i][j];
    }
  }
}

// Small T (decode): the same two products as GEMVs, every weight read once. The vector kernels
// read 16 bytes of weights per load with all of a thread's loads independent, so enough bytes are
// in flight to stream kv_b at HBM speed; the scalar kernels take any shape and alignment.
constexpr int kGemvT = 8;

template <int FMT>
struct WVec {  // 16 bytes of weights: 4 fp32 or 8 fp16/bf16, decoded exactly
  static constexpr int N = FMT == 0 ? 4 : 8;
  __device__ __forceinline__ static void load(const void* base, int64_t elem, float* out) {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + elem * (FMT == 0 ? 4 : 2));
    if constexpr (FMT == 0) {
      out[0] = __uint_as_float(u.x);
      out[1] = __uint_as_float(u.y);
      out[2] = __uint_as_float(u.z);
      out[3] = __uint_as_float(u.w);
    } else {
      const uint32_t wds[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned short lo = (unsigned short)(wds[i] & 0xffffu), hi = (unsigned short)(wds[i] >> 16);
        if constexpr (FMT == 1) {
          out[2 * i] = __half2float(__ushort_as_half(lo));
          out[2 * i + 1] = __half2float(__ushort_as_half(hi));
        } else {
          out[2 * i] = __uint_as_float(uint32_t(lo) << 16);
          out[2 * i + 1] = __uint_as_float(uint32_t(hi) << 16);
        }
      }
    }
  }
};

// q̃[t, h, l] = Σ_i q[t, h, i] · kv_b[h·per + i, l]. Block = (head h, slice of CGB column groups
// of N = 16 bytes): thread = (column group, row group), so the nope rows split over 256/CGB row
// groups and each thread keeps only a few independent 16-byte loads in flight; heads × slices
// blocks stream kv_b (one block per head left most of the GPU idle at decode). Row groups meet in
// shared memory in a fixed order (deterministic).
template <int FMT>
__global__ void __launch_bounds__(256)
    qlat_gemv_vec_kernel(const float* __restrict__ q, int64_t dq, const void* __restrict__ W, int64_t wcols,
                         int64_t per, int64_t T, int64_t heads, int nope, int L, int CGB, float* __restrict__ ql) {
  pdl_enter();
  constexpr int N = WVec<FMT>::N;
  extern __shared__ float gsm[];
  const int CG = L / N, RG = 256 / CGB, nr = (nope + RG - 1) / RG, WB = CGB * N;
  float* qs = gsm;              // [T][nope]
  float* red = gsm + T * nope;  // [RG][T][WB]
  const int64_t h = blockIdx.x;
  const int tid = threadIdx.x, cg = tid % CGB, rg = tid / CGB, cg0 = blockIdx.y * CGB;
  for (int idx = tid; idx < T * nope; idx += 256) {
    const int t = idx / nope, i = idx % nope;
    qs[idx] = q[(t * heads + h) * dq + i];
  }
  __syncthreads();
  if (rg < RG) {
    float acc[kGemvT][N];
#pragma unroll
    for (int t = 0; t < kGemvT; ++t)
#pragma unroll
      for (int u = 0; u < N; ++u) acc[t][u] = 0.0f;
    const int i0 = rg * nr, i1 = cg0 + cg < CG ? min(nope, i0 + nr) : i0;
#pragma unroll 8
    for (int i = i0; i < i1; ++i) {
      float wv[N];
      WVec<FMT>::load(W, (h * per + i) * wcols + int64_t(cg0 + cg) * N, wv);
#pragma unroll
      for (int t = 0; t < kGemvT; ++t)
        if (t < T) {
          const float qv = qs[t * nope + i];
#pragma unroll
          for (int u = 0; u < N; ++u) acc[t][u] = fmaf(qv, wv[u], acc[t][u]);
        }
    }
#pragma unroll
    for (int t = 0; t < kGemvT; ++t)
      if (t < T)
#pragma unroll
        for (int u = 0; u < N; ++u) red[(rg * T + t) * WB + cg * N + u] = acc[t][u];
  }
  __syncthreads();
  for (int idx = tid; idx < T * WB; idx += 256) {
    const int t = idx / WB, l = idx % WB;
    if (cg0 * N + l >= L) continue;
    float v = red[t * WB + l];
    for (int r = 1; r < RG; ++r) v += red[(r * T + t) * WB + l];
    ql[(t * heads + h) * L + cg0 * N + l] = v;
  }
}

// out[t, h, j] = Σ_l kv_b[h·per + nope + j, l] · o_lat[t, h, l]; a warp per (h, j), 16-byte
// weight loads along l.
template <int FMT>
__global__ void __launch_bounds__(256)
    out_gemv_vec_kernel(const float* __restrict__ ol, const void* __restrict__ W, int64_t wcols, int64_t per, int64_t T,
                        int64_t heads, int nope, int dv, int L, float* __restrict__ out) {
  pdl_enter();
  constexpr int N = WVec<FMT>::N;
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);  // (h, j) pair
  if (r >= heads * dv) return;
  const int64_t h = r / dv, j = r % dv;
  const int64_t base = (h * per + nope + j) * wcols;
  float acc[kGemvT] = {};
#pragma unroll 4
  for (int l = lane * N; l < L; l += 32 * N) {
    float wv[N];
    WVec<FMT>::load(W, base + l, wv);
#pragma unroll
    for (int t = 0; t < kGemvT; ++t)
      if (t < T) {
        const float4* o4 = reinterpret_cast<const float4*>(ol + (t * heads + h) * L + l);
#pragma unroll
        for (int u = 0; u < N / 4; ++u) {
          const float4 o = o4[u];
          acc[t] = fmaf(wv[4 * u], o.x, acc[t]);
          acc[t] = fmaf(wv[4 * u + 1], o.y, acc[t]);
          acc[t] = fmaf(wv[4 * u + 2], o.z, acc[t]);
          acc[t] = fmaf(wv[4 * u + 3], o.w, acc[t]);
        }
      }
  }
#pragma unroll
  for (int t = 0; t < kGemvT; ++t) {
    if (t >= T) break;
    float v = acc[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(t * heads + h) * dv + j] = v;
  }
}

// Any shape: thread per (h, l) column, rows in a loop.
template <int FMT>
__global__ void __launch_bounds__(256)
    qlat_gemv_kernel(const float* __restrict__ q, int64_t dq, const void* __restrict__ W, int64_t wcols, int64_t per,
                     int64_t T, int64_t heads, int nope, int L, float* __restrict__ ql) {
  pdl_enter();
  extern __shared__ float qs[];  // [T][nope]
  const int64_t h = blockIdx.y;
  const int l = blockIdx.x * 256 + threadIdx.x;
  for (int idx = threadIdx.x; idx < T * nope; idx += 256) {
    const int t = idx / nope, i = idx % nope;
    qs[idx] = q[(t * heads + h) * dq + i];
  }
  __syncthreads();
  if (l >= L) return;
  float acc[kGemvT] = {};
  const int64_t base = h * per * wcols + l;
#pragma unroll 8
  for (int i = 0; i < nope; ++i) {
    const float w = load_w<FMT>(W, base + int64_t(i) * wcols);
#pragma unroll
    for (int t = 0; t < kGemvT; ++t)
      if (t < T) acc[t] = fmaf(qs[t * nope + i], w, acc[t]);
  }
#pragma unroll
  for (int t = 0; t < kGemvT; ++t)
    if (t < T) ql[(t * heads + h) * L + l] = acc[t];
}

// Any shape: a warp per (h, j), lanes along l.
template <int FMT>
__global__ void __launch_bounds__(256)
    out_gemv_kernel(const float* __restrict__ ol, const void* __restrict__ W, int64_t wcols, int64_t per, int64_t T,
                    int64_t heads, int nope, int dv, int L, float* __restrict__ out) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);  // (h, j) pair
  if (r >= heads * dv) return;
  const int64_t h = r / dv, j = r % dv;
  const int64_t base = (h * per + nope + j) * wcols;
  float acc[kGemvT] = {};
#pragma unroll 4
  for (int l = lane; l < L; l += 32) {
    const float w = load_w<FMT>(W, base + l);
#pragma unroll
    for (int t = 0; t < kGemvT; ++t)
      if (t < T) acc[t] = fmaf(w, ol[(t * heads + h) * L + l], acc[t]);
  }
#pragma unroll
  for (int t = 0; t < kGemvT; ++t) {
    if (t >= T) break;
    float v = acc[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) out[(t * heads + h) * dv + j] = v;
  }
}

// ---------------------------------------------------------------- attention over the latent cache
// Block = (query t, group of kHG heads, key split). Keys are [c_s | k_r[s]] (kv_lora + rope wide),
// shared by every head, so a group of heads reads each key tile once. Per tile of kBS keys:
//   scores (kHG × kBS, depth kv_lora + rope): 4×4 register tiles, the depth split 16 ways across
//     thread groups, then summed in a fixed order (deterministic);
//   online softmax per head (fp32, running max m and sum z);
//   o[h, l] = o[h, l]·corr_h + Σ_s p[h, s] c_s[l]  (each thread owns kv_lora columns for all heads).
// A tile's key loads are all issued before any is stored (one memory latency per tile), and two
// blocks share an SM so one computes while the other loads.
// Keys visible to query t: s <= pos0 + t (pos0 read on the device). Splits (flash-decoding) divide
// them into contiguous ranges of at least kMinSplitKeys keys, so a short cache uses few splits;
// the partial (m, z, o) of the used splits are merged by combine_kernel. (One key tile a split
// measured worse on the whole: a 512-key decode of Kimi Linear's 32 heads went from 37.1 to 34.8 ms
// of mla_attend in 64 steps at batch 1, but from 121 to 175 ms at 32 sequences; H100,
// docs/data/kl-full-e128-h100-2026-12-05c-batch.md.)
constexpr int kHG = 16, kBS = 16, kAttThreads = 256, kXSplit = 16, kKtLd = kBS + 4;
constexpr int64_t kMinSplitKeys = 64;
constexpr int kMaxRope = 128;

// Where a paged launch's blocks work (written on the device by mla_paged_plan_kernel): row t sees
// row_keys[t] keys of sequence row_seq[t], split in row_u[t] ranges held by the partial slots
// row_off[t] .. + row_u[t] - 1; slot w is split slot_j[w] of row slot_row[w] (-1: unused).
struct PagedPlan {
  int32_t *row_seq, *row_keys, *row_u, *row_off;  // [rows]
  int32_t *slot_row, *slot_j;                     // [slots]
};

struct AttnArgs {
  const float* q;   // [T, heads, nope + rope]
  const float* ql;  // [T, heads, L]  q̃ (and, with one split, the normalised output o_lat in place)
  // Keys: contiguous (pc.pages == null): c [S, L], kr [S, R], query t sees *len + t + 1 of them,
  // the block grid (T, head groups, nsplit) with split_plan; paged: pc and the plan, grid (slots, head groups).
  const float* c;
  const float* kr;
  const int32_t* len;
  PagedCacheDev pc;
  PagedPlan plan;
  float* out;                       // direct: o_lat [T, heads, L] (== ql)
  float *part_o, *part_m, *part_z;  // else: [partial slot, heads, L] and [partial slot, heads]
  int64_t T, heads, nope, rope, L;
  int nsplit;
  bool direct;  // one block per (row, head group): the normalised output written in place
  bool vec;     // L and rope multiples of 4 (and the keys 16-byte aligned): 16-byte key loads
  float scale;
};

// Splits in use for a query that sees n keys, and the keys per split (whole tiles).
__device__ __forceinline__ void split_plan(int64_t n, int nsplit, int* used, int64_t* per) {
  int64_t u = (n + kMinSplitKeys - 1) / kMinSplitKeys;
  u = u < nsplit ? u : nsplit;
  *used = int(u);
  *per = ((n + u - 1) / u + kBS - 1) / kBS * kBS;
}

// shared memory: QT [X][kHG] | KT [X][kKtLd] | partial scores [kXSplit][kHG*kBS] | pT [kBS][kHG] |
// corr, m, z [kHG]
__host__ __device__ inline size_t att_smem_floats(int L, int R) {
  const int X = L + R;
  return size_t(X) * kHG + size_t(X) * kKtLd + size_t(kXSplit) * kHG * kBS + kBS * kHG + 3 * kHG;
}

// A block's share of the work: query row t, keys [s_begin, s_end), the partial slot its (m, z, o)
// go to when not direct, and (paged) its sequence's block-table row.
struct AttnWork {
  int64_t t, s_begin, s_end, pslot;
  const int32_t* bt;
};
__device__ __forceinline__ bool attn_work(const AttnArgs& a, AttnWork* w) {
  int64_t nkeys, per;
  if (a.pc.pages == nullptr) {
    w->t = blockIdx.x;
    const int sp = blockIdx.z;
    nkeys = int64_t(*a.len) + w->t + 1;  // causal: keys 0..pos0+t
    int used;
    split_plan(nkeys, a.nsplit, &used, &per);
    if (sp >= used) return false;  // a split this query does not need (never merged)
    w->s_begin = int64_t(sp) * per;
    w->pslot = int64_t(sp) * a.T + w->t;
    w->bt = nullptr;
  } else {
    const int64_t slot = blockIdx.x;
    const int r = a.plan.slot_row[slot];
    if (r < 0) return false;  // a slot the plan left unused (never merged)
    const int u = a.plan.row_u[r];
    nkeys = a.plan.row_keys[r];
    per = ((nkeys + u - 1) / u + kBS - 1) / kBS * kBS;
    w->t = r;
    w->s_begin = int64_t(a.plan.slot_j[slot]) * per;
    w->pslot = slot;
    w->bt = a.pc.block_table + int64_t(a.plan.row_seq[r]) * a.pc.max_pages;
  }
  w->s_end = w->s_begin + per < nkeys ? w->s_begin + per : nkeys;
  return true;
}

// Where one key's latent row c [L] and rope row k_r [R] are; paged: null when the block table
// cannot place it (the key then reads as NaN).
struct KeyRow {
  const float *c, *kr;
};
__device__ __forceinline__ KeyRow key_row(const AttnArgs& a, const int32_t* bt, int64_t key) {
  if (bt == nullptr) return KeyRow{a.c + key * a.L, a.kr + key * a.rope};
  const float* p = paged_row(a.pc, bt, key, a.L + a.rope);
  return KeyRow{p, p ? p + a.L : nullptr};
}

// Key-tile items: (key s, 4 consecutive depth columns x0..x0+3), s fastest, so a warp's transposed
// stores KT[x][s] hit 32 different banks and its loads read 16 keys × 32 contiguous bytes.
__device__ __forceinline__ float4 load_key4(const AttnArgs& a, const KeyRow& k, int x0) {
  const int L = int(a.L), R = int(a.rope);
  if (k.c == nullptr) return make_float4(NAN, NAN, NAN, NAN);
  if (a.vec) {
    if (x0 < L) return *reinterpret_cast<const float4*>(k.c + x0);
    return *reinterpret_cast<const float4*>(k.kr + (x0 - L));
  }
  float v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int x = x0 + u;
    v[u] = x < L ? k.c[x] : x < L + R ? k.kr[x - L] : 0.0f;
  }
  return make_float4(v[0], v[1], v[2], v[3]);
}

// Two blocks per SM where the shared memory allows it (kv_lora <= 512), so cap the registers there.
template <int LM>  // kv_lora columns per thread (L <= 256·LM)
__global__ void __launch_bounds__(kAttThreads, LM <= 2 ? 2 : 1) mla_attend_kernel(AttnArgs a) {
  pdl_enter();
  // Key items per thread per tile: 16 keys × (L + R)/4 column groups / 256 threads.
  constexpr int NR = (kBS * ((LM * 256 + kMaxRope) / 4) + kAttThreads - 1) / kAttThreads;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int L = int(a.L), R = int(a.rope), X = L + R, NX = (X + 3) / 4, items = kBS * NX;
  float* QT = sm;                        // [X][kHG]
  float* KT = QT + size_t(X) * kHG;      // [X][kKtLd]
  float* SP = KT + size_t(X) * kKtLd;    // [kXSplit][kHG * kBS]
  float* PT = SP + kXSplit * kHG * kBS;  // [kBS][kHG]
  float* corr = PT + kBS * kHG;
  float* mrun = corr + kHG;
  float* zrun = mrun + kHG;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hg0 = blockIdx.y * kHG;
  AttnWork wk;
  if (!attn_work(a, &wk)) return;  // the whole block
  const int64_t t = wk.t, s_begin = wk.s_begin, s_end = wk.s_end;

  // q̃ and q_rope of the group's heads, transposed (depth-major) for float4 reads along heads;
  // heads fastest across lanes (conflict-free stores).
  for (int idx = tid; idx < kHG * X; idx += kAttThreads) {
    const int hh = idx % kHG, x = idx / kHG, h = hg0 + hh;
    float v = 0.0f;
    if (h < a.heads)
      v = x < L ? a.ql[(t * a.heads + h) * L + x] : a.q[(t * a.heads + h) * (a.nope + R) + a.nope + (x - L)];
    QT[x * kHG + hh] = v;
  }
  if (tid < kHG) {
    mrun[tid] = -INFINITY;
    zrun[tid] = 0.0f;
  }
  float acc[kHG][LM];
#pragma unroll
  for (int hh = 0; hh < kHG; ++hh)
#pragma unroll
    for (int m = 0; m < LM; ++m) acc[hh][m] = 0.0f;

  // Score micro-tile of this thread: heads 4·ht.., keys 4·st.., depth slice xs.
  const int tile = lane & 15, xs = warp * 2 + (lane >> 4);
  const int ht = tile / 4, st = tile % 4;
  const int xper = (X + kXSplit - 1) / kXSplit, xa = xs * xper, xb = min(X, xa + xper);

  // Every item of a thread is the same key of the tile (kAttThreads is a multiple of kBS), so a
  // thread finds one key row per tile, and finds the next tile's while this tile's loads are in
  // flight (a paged block-table read then costs no latency of its own).
  static_assert(kAttThreads % kBS == 0, "a thread's tile items must share one key");
  const int my_key = tid % kBS;
  KeyRow krow{};
  if (s_begin + my_key < s_end) krow = key_row(a, wk.bt, s_begin + my_key);
  for (int64_t sb = s_begin; sb < s_end; sb += kBS) {
    const int nb = int(s_end - sb < kBS ? s_end - sb : kBS);
    {
      float4 pre[NR];  // keys sb .. sb+15 (zero beyond s_end): every load issued, then stored
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const int it = tid + r * kAttThreads;
        pre[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (it < items && my_key < nb) pre[r] = load_key4(a, krow, (it / kBS) * 4);
      }
      if (sb + kBS + my_key < s_end) krow = key_row(a, wk.bt, sb + kBS + my_key);
      __syncthreads();  // the previous tile's KT / PT are no longer read
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const int it = tid + r * kAttThreads, s = it % kBS, x0 = (it / kBS) * 4;
        if (it < items) {
          const float v[4] = {pre[r].x, pre[r].y, pre[r].z, pre[r].w};
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (x0 + u < X) KT[(x0 + u) * kKtLd + s] = v[u];
        }
      }
    }
    __syncthreads();
    {
      float sc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[i][j] = 0.0f;
#pragma unroll 4
      for (int x = xa; x < xb; ++x) {
        const float4 qv = *reinterpret_cast<const float4*>(QT + x * kHG + ht * 4);
        const float4 kv = *reinterpret_cast<const float4*>(KT + x * kKtLd + st * 4);
        const float qa[4] = {qv.x, qv.y, qv.z, qv.w}, ka[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(qa[i], ka[j], sc[i][j]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
        *reinterpret_cast<float4*>(SP + xs * (kHG * kBS) + (ht * 4 + i) * kBS + st * 4) =
            make_float4(sc[i][0], sc[i][1], sc[i][2], sc[i][3]);
    }
    __syncthreads();
    // Online softmax: warp w handles heads 2w and 2w+1, lanes = keys (16 per head).
    {
      const int hh = warp * 2 + (lane >> 4), s = lane & 15;
      float v = 0.0f;
#pragma unroll
      for (int x = 0; x < kXSplit; ++x) v += SP[x * (kHG * kBS) + hh * kBS + s];
      v = s < nb ? v * a.scale : -INFINITY;
      float mx = v;
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mold = mrun[hh], mnew = fmaxf(mold, mx);
      const float p = s < nb ? expf(v - mnew) : 0.0f;
      float ps = p;
      for (int off = 8; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
      PT[s * kHG + hh] = p;
      __syncwarp();
      if (s == 0) {
        const float cf = expf(mold - mnew);  // 0 while nothing was seen (mold = -inf)
        corr[hh] = cf;
        zrun[hh] = zrun[hh] * cf + ps;
        mrun[hh] = mnew;
      }
    }
    __syncthreads();
    // o ← o·corr + P·C over this tile.
    {
#pragma unroll
      for (int hh = 0; hh < kHG; ++hh) {
        const float cf = corr[hh];
#pragma unroll
        for (int m = 0; m < LM; ++m) acc[hh][m] *= cf;
      }
      // Keys 4 at a time: float4 reads of KT along s (8 lanes cover all 32 banks); keys >= nb
      // have p = 0 and zero-filled KT, so whole groups are safe.
      for (int s0 = 0; s0 < nb; s0 += 4) {
        float cv[LM][4];
#pragma unroll
        for (int m = 0; m < LM; ++m) {
          const int l = tid + 256 * m;
          float4 c4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (l < L) c4 = *reinterpret_cast<const float4*>(KT + l * kKtLd + s0);
          cv[m][0] = c4.x;
          cv[m][1] = c4.y;
          cv[m][2] = c4.z;
          cv[m][3] = c4.w;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int h4 = 0; h4 < kHG / 4; ++h4) {
            const float4 pv = *reinterpret_cast<const float4*>(PT + (s0 + u) * kHG + h4 * 4);
            const float pa[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int m = 0; m < LM; ++m) acc[h4 * 4 + i][m] = fmaf(pa[i], cv[m][u], acc[h4 * 4 + i][m]);
          }
      }
    }
  }
  __syncthreads();
  // Results. One split: the normalised o_lat (over this block's own q̃ rows, already in shared
  // memory). Several: the unnormalised partial with its (m, z); a used split without keys writes
  // m = -inf, z = 0, o = 0 so the merge gives it weight 0.
#pragma unroll
  for (int hh = 0; hh < kHG; ++hh) {
    const int h = hg0 + hh;
    if (h >= a.heads) continue;
    const int64_t row = t * a.heads + h;
    if (a.direct) {
      const float inv = 1.0f / zrun[hh];
#pragma unroll
      for (int m = 0; m < LM; ++m) {
        const int l = tid + 256 * m;
        if (l < L) a.out[row * L + l] = acc[hh][m] * inv;
      }
    } else {
      const int64_t prow = wk.pslot * a.heads + h;
#pragma unroll
      for (int m = 0; m < LM; ++m) {
        const int l = tid + 256 * m;
        if (l < L) a.part_o[prow * L + l] = acc[hh][m];
      }
      if (tid == 0) {
        a.part_m[prow] = mrun[hh];
        a.part_z[prow] = zrun[hh];
      }
    }
  }
}

// Which partial slots hold a query row's splits: contiguous (row_u == null): split sp of row t in
// slot sp·T + t, the splits used from split_plan; paged: slots row_off[t] .. + row_u[t] - 1.
struct SplitMap {
  const int32_t* len;
  int nsplit;
  int64_t T;
  const int32_t *row_u, *row_off;
};

// Merge of the used splits' partials: o_lat[t, h] = Σ e^{m_sp − M} o_sp / Σ e^{m_sp − M} z_sp.
// Block = (t, h) row; warp 0 computes the split weights (lane = splits lane and lane + 32; max and
// sum by a fixed shuffle tree, so deterministic) into shared memory, then the columns.
constexpr int kMaxSplits = 64;
__global__ void combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_m,
                               const float* __restrict__ part_z, SplitMap map, int64_t heads, int64_t L,
                               float* __restrict__ out) {
  pdl_enter();
  __shared__ float wsp[kMaxSplits];
  __shared__ float s_inv;
  const int64_t row = blockIdx.x, t = row / heads, h = row % heads;
  int used;
  int64_t slot0, stride;
  if (map.row_u == nullptr) {
    int64_t per;
    split_plan(int64_t(*map.len) + t + 1, map.nsplit, &used, &per);
    slot0 = t;
    stride = map.T;
  } else {
    used = map.row_u[t];
    slot0 = map.row_off[t];
    stride = 1;
  }
  const auto prow = [&](int sp) { return (slot0 + sp * stride) * heads + h; };
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, sa = lane, sb = lane + 32;
    const float ma = sa < used ? part_m[prow(sa)] : -INFINITY;
    const float mb = sb < used ? part_m[prow(sb)] : -INFINITY;
    const float za = sa < used ? part_z[prow(sa)] : 0.0f;
    const float zb = sb < used ? part_z[prow(sb)] : 0.0f;
    float M = fmaxf(ma, mb);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float wa = ma == -INFINITY ? 0.0f : expf(ma - M), wb = mb == -INFINITY ? 0.0f : expf(mb - M);
    wsp[sa] = wa;
    wsp[sb] = wb;
    float Z = wa * za + wb * zb;
    for (int o = 16; o > 0; o >>= 1) Z += __shfl_xor_sync(0xffffffffu, Z, o);
    if (lane == 0) s_inv = 1.0f / Z;
  }
  __syncthreads();
  for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
    float acc = 0.0f;
    for (int sp = 0; sp < used; ++sp)
      if (wsp[sp] != 0.0f) acc = fmaf(wsp[sp], part_o[prow(sp) * L + l], acc);
    out[row * L + l] = acc * s_inv;
  }
}

// ---------------------------------------------------------------- paged plan
// One block lays out a paged launch's work from the device arrays (so a replayed graph follows
// them): row t of sequence i sees n_t = pos0[i] + t - cu_rows[i] + 1 keys and gets
//   u_t = min(1 + floor(n_t · B / Σn), ceil(n_t / kMinSplitKeys), kMaxSplits)
// splits, B = slots - rows the spare slots: proportional to its keys, so rows of any mix of lengths
// finish together. Σ u_t <= rows + B = slots. Slots are handed out in row order (prefix sums).
constexpr int kPlanThreads = 1024;

// Exclusive prefix sum of one value per thread over the block (kPlanThreads), and the block total.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total, int64_t* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();  // red is free (a previous call's readers are done)
  if (lane == 31) red[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kPlanThreads / 32 ? red[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    red[lane] = w;  // inclusive sums of the warps' totals
  }
  __syncthreads();
  *total = red[kPlanThreads / 32 - 1];
  return x - v + (warp > 0 ? red[warp - 1] : 0);
}

__global__ void __launch_bounds__(kPlanThreads)
    mla_paged_plan_kernel(const int32_t* __restrict__ cu_rows, const int32_t* __restrict__ pos0,
                          const int32_t* __restrict__ skip, int n_seqs, int64_t rows, int64_t slots, PagedPlan p) {
  pdl_enter();
  __shared__ int64_t red[32];
  int64_t sum_keys = 0, part = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kPlanThreads) {
    const int i = seq_of_row(cu_rows, n_seqs, r);
    const int64_t n = skip != nullptr && skip[i] != 0 ? 1 : int64_t(pos0[i]) + r - cu_rows[i] + 1;
    p.row_seq[r] = i;
    p.row_keys[r] = int32_t(n);
    part += n;
  }
  block_exclusive_scan(part, &sum_keys, red);
  const int64_t spare = slots - rows;
  int64_t base = 0;  // slots handed out to the rows before this round
  for (int64_t r0 = 0; r0 < rows; r0 += kPlanThreads) {
    const int64_t r = r0 + threadIdx.x;
    int64_t u = 0;
    if (r < rows) {
      const int64_t n = p.row_keys[r];
      u = 1 + (sum_keys > 0 ? n * spare / sum_keys : 0);
      const int64_t most = (n + kMinSplitKeys - 1) / kMinSplitKeys;
      u = u < most ? u : most;
      u = u < kMaxSplits ? u : kMaxSplits;
      u = u > 1 ? u : 1;
    }
    int64_t round_total;
    const int64_t off = base + block_exclusive_scan(u, &round_total, red);
    if (r < rows) {
      p.row_u[r] = int32_t(u);
      p.row_off[r] = int32_t(off);
      for (int j = 0; j < u; ++j) {
        p.slot_row[off + j] = int32_t(r);
        p.slot_j[off + j] = j;
      }
    }
    base += round_total;
  }
  for (int64_t w = base + threadIdx.x; w < slots; w += kPlanThreads) p.slot_row[w] = -1;
}

// Key splits by T: decode needs them to spread a long cache over the GPU (one wave of two blocks
// per SM: 44 splits for 96 heads on 132 SMs), prefill has T·heads/16 blocks already. A function of
// T and the head count only (1..64), so the workspace size and the grid are fixed per T.
int mla_splits(int64_t T, int64_t heads) {
  if (T <= 2) {
    const int64_t blocks = T * ((heads + kHG - 1) / kHG);
    return int(std::max<int64_t>(1, std::min<int64_t>(64, 2 * sm_count() / std::max<int64_t>(1, blocks))));
  }
  return T <= 8 ? 16 : T <= 32 ? 4 : 1;
}

constexpr int kMaxAttSmem = 200 * 1024;
constexpr int kMaxGemvSmem = 48 * 1024;

// q̃ = W_UKᵀ q_nope (nt = false) or out = W_UV o_lat (nt = true) for every head.
template <int FMT>
void head_products_fmt(bool nt, const float* X, const WeightMat& W, const MlaAttnDims& d, int64_t T, float* Y,
                       Stream s) {
  const int64_t per = d.nope + d.v, dq = d.nope + d.rope, L = d.kv_lora, H = d.heads;
  if (T <= kGemvT) {
    constexpr int N = WVec<FMT>::N;
    const bool vec = L % N == 0 && L / N <= 256 && reinterpret_cast<uintptr_t>(W.data) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(X) % 16 == 0;
    if (nt) {
      const unsigned blocks = unsigned((H * d.v + 7) / 8);
      if (vec)
        launch(out_gemv_vec_kernel<FMT>, blocks, 256, 0, s, X, W.data, W.cols, per, T, H, int(d.nope), int(d.v), int(L),
               Y);
      else
        launch(out_gemv_kernel<FMT>, blocks, 256, 0, s, X, W.data, W.cols, per, T, H, int(d.nope), int(d.v), int(L), Y);
    } else {
      // 16 column groups per block (16 row groups of nope/16 rows): H · L/(16N) blocks.
      const int64_t CG = L / N, CGB = std::min<int64_t>(CG, 16);
      const size_t vsmem = size_t(T * d.nope + (256 / std::max<int64_t>(1, CGB)) * T * CGB * N) * 4;
      if (vec && vsmem <= size_t(kMaxGemvSmem)) {
        const dim3 grid(unsigned(H), unsigned((CG + CGB - 1) / CGB));
        launch(qlat_gemv_vec_kernel<FMT>, grid, 256, vsmem, s, X, dq, W.data, W.cols, per, T, H, int(d.nope), int(L),
               int(CGB), Y);
      } else {
        const dim3 grid(unsigned((L + 255) / 256), unsigned(H));
        launch(qlat_gemv_kernel<FMT>, grid, 256, size_t(T * d.nope) * 4, s, X, dq, W.data, W.cols, per, T, H,
               int(d.nope), int(L), Y);
      }
    }
    return;
  }
  if (nt) {
    const dim3 grid(unsigned((d.v + kGN - 1) / kGN), unsigned((T + kGM - 1) / kGM), unsigned(H));
    launch(head_gemm_kernel<FMT, true>, grid, 256, 0, s, X, H * L, L, W.data, W.cols, per, d.nope, T, int(L), int(d.v),
           Y, H * d.v, d.v);
  } else {
    const dim3 grid(unsigned((L + kGN - 1) / kGN), unsigned((T + kGM - 1) / kGM), unsigned(H));
    launch(head_gemm_kernel<FMT, false>, grid, 256, 0, s, X, H * dq, dq, W.data, W.cols, per, 0, T, int(d.nope), int(L),
           Y, H * L, L);
  }
}

void head_products(bool nt, const float* X, const WeightMat& W, const MlaAttnDims& d, int64_t T, float* Y, Stream s) {
  switch (W.fmt) {
    case WFormat::F32:
      head_products_fmt<0>(nt, X, W, d, T, Y, s);
      break;
    case WFormat::F16:
      head_products_fmt<1>(nt, X, W, d, T, Y, s);
      break;
    case WFormat::BF16:
      head_products_fmt<2>(nt, X, W, d, T, Y, s);
      break;
    case WFormat::MXFP4:
      fail("mla_attend_absorbed: kv_b_proj in MXFP4 is not supported on the GPU (F32/F16/BF16 only)");
    case WFormat::FP8:
      fail("mla_attend_absorbed: kv_b_proj in FP8 (--trunk-fp8) is not supported on the GPU yet (F32/F16/BF16 only)");
  }
}

template <int LM>
void launch_attend(const AttnArgs& a, dim3 grid, size_t smem, Stream s) {
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(mla_attend_kernel<LM>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxAttSmem) ==
           cudaSuccess;
  }();
  if (!attr_set)
    fail("mla_attend_absorbed: this GPU cannot give " + std::to_string(kMaxAttSmem) +
         " bytes of shared memory per block");
  launch(mla_attend_kernel<LM>, grid, kAttThreads, smem, s, a);
}

// The attention stage for either key source: a's keys, splits and outputs are filled in; the grid
// is (gx, head groups, gz). The partials (when not direct) are merged by `merge`.
void attend_and_merge(const AttnArgs& a, unsigned gx, unsigned gz, const SplitMap& merge, float* ql, Stream s) {
  const size_t smem = att_smem_floats(int(a.L), int(a.rope)) * 4;
  const dim3 grid(gx, unsigned((a.heads + kHG - 1) / kHG), gz);
  if (a.L <= 256)
    launch_attend<1>(a, grid, smem, s);
  else if (a.L <= 512)
    launch_attend<2>(a, grid, smem, s);
  else
    launch_attend<4>(a, grid, smem, s);
  check_launch("mla_attend_absorbed (attend)");
  if (!a.direct) {
    launch(combine_kernel, unsigned(a.T * a.heads), 128, 0, s, a.part_o, a.part_m, a.part_z, merge, a.heads, a.L, ql);
    check_launch("mla_attend_absorbed (combine)");
  }
}

// Shape checks of both forms (one-line k3::Error).
void check_absorbed(const char* what, const WeightMat& kv_b, const MlaAttnDims& d) {
  const int64_t L = d.kv_lora, per = d.nope + d.v;
  if (kv_b.rows != d.heads * per || kv_b.cols != L)
    fail(std::string(what) + ": kv_b is " + std::to_string(kv_b.rows) + "x" + std::to_string(kv_b.cols) +
         ", expected " + std::to_string(d.heads * per) + "x" + std::to_string(L));
  if (L > 1024 || d.rope > kMaxRope)
    fail(std::string(what) + ": kv_lora " + std::to_string(L) + " / rope " + std::to_string(d.rope) +
         " beyond the GPU kernel's 1024 / " + std::to_string(kMaxRope));
  if (att_smem_floats(int(L), int(d.rope)) * 4 > size_t(kMaxAttSmem))
    fail(std::string(what) + ": kv_lora + rope = " + std::to_string(L + d.rope) +
         " needs more shared memory than a block has");
}

AttnArgs attn_args(const float* q, const float* ql, int64_t T, const MlaAttnDims& d) {
  AttnArgs a{};
  a.q = q;
  a.ql = ql;
  a.out = const_cast<float*>(ql);  // direct: o_lat over q̃ (each block reads its own q̃ rows first)
  a.T = T;
  a.heads = d.heads;
  a.nope = d.nope;
  a.rope = d.rope;
  a.L = d.kv_lora;
  a.scale = d.scale;
  return a;
}

// Partial slots of a paged launch: one per row, plus what brings the attention grid to about eight
// waves of two blocks per SM when the rows alone are fewer (decode), so every row's key range can
// be split in proportion to its length and the longest split stays a small part of the step.
static_assert(kHG == kMlaPagedHeadGroup, "ops.h sizes the paged kernel's workspace with this head group");
int64_t paged_slots(int64_t rows, int64_t heads) { return paged_mla_slots(rows, heads, sm_count()); }

// Work layout of a paged launch (floats; the plan's int32 arrays at the end):
// q̃/o_lat [rows, heads, L] | part_o [slots, heads, L] | part_m, part_z [slots, heads] (only when
// slots > rows) | row_seq, row_keys, row_u, row_off [rows] | slot_row, slot_j [slots]; its size is ops.h
// paged_mla_work_floats (the memory plan uses it too).
int64_t paged_parts(int64_t rows, int64_t slots, const MlaAttnDims& d) { return slots > rows ? slots * d.heads : 0; }
struct PagedWork {
  float *ql, *part_o, *part_m, *part_z;
  PagedPlan plan;
};
PagedWork paged_work(float* work, int64_t rows, int64_t slots, const MlaAttnDims& d) {
  PagedWork w{};
  const int64_t L = d.kv_lora, parts = paged_parts(rows, slots, d);
  w.ql = work;
  w.part_o = w.ql + rows * d.heads * L;
  w.part_m = w.part_o + parts * L;
  w.part_z = w.part_m + parts;
  int32_t* ip = reinterpret_cast<int32_t*>(w.part_z + parts);
  w.plan.row_seq = ip;
  w.plan.row_keys = ip + rows;
  w.plan.row_u = ip + 2 * rows;
  w.plan.row_off = ip + 3 * rows;
  w.plan.slot_row = ip + 4 * rows;
  w.plan.slot_j = ip + 4 * rows + slots;
  return w;
}

}  // namespace

void mla_cache_append(const float* ckv, int64_t T, int64_t kv_lora, int64_t rope, const float* norm_w, float eps,
                      const int32_t* len_dev, float* c_cache, float* kr_cache, Stream s) {
  if (T <= 0) return;
  launch(cache_append_kernel, unsigned(T), 256, 0, s, ckv, kv_lora, rope, norm_w, eps, len_dev, c_cache, kr_cache);
  check_launch("mla_cache_append");
}

void mla_cache_append_paged(const float* ckv, const VarlenDev& b, const PagedCacheDev& c, int64_t kv_lora, int64_t rope,
                            const float* norm_w, float eps, Stream s) {
  check_varlen("mla_cache_append_paged", b, false);
  check_paged("mla_cache_append_paged", c);
  if (b.rows <= 0) return;
  launch(cache_append_paged_kernel, unsigned(b.rows), 256, 0, s, ckv, kv_lora, rope, norm_w, eps, b.cu_rows,
         int(b.n_seqs), c);
  check_launch("mla_cache_append_paged");
}

int64_t mla_absorbed_work_floats(int64_t T, const MlaAttnDims& d) {
  const int64_t rows = T * d.heads, ns = mla_splits(T, d.heads);
  return rows * d.kv_lora + (ns > 1 ? ns * rows * (d.kv_lora + 2) : 0);
}

void mla_attend_absorbed(const float* q, int64_t T, const float* c, const float* k_r, const int32_t* len_dev,
                         const WeightMat& kv_b, const MlaAttnDims& d, float* work, float* out, Precision p, Stream s) {
  (void)p;  // fp32 in both precisions (the BF16 mode keeps this op in fp32: it is not a GEMM of activations)
  if (T <= 0) return;
  check_absorbed("mla_attend_absorbed", kv_b, d);
  const int64_t L = d.kv_lora;
  const int ns = mla_splits(T, d.heads);
  const int64_t rows = T * d.heads;
  float* ql = work;  // [T, heads, L]: q̃, then o_lat
  // 1. q̃[t, h] = W_UK[h]ᵀ q_nope[t, h]
  head_products(false, q, kv_b, d, T, ql, s);
  check_launch("mla_attend_absorbed (q_lat)");
  // 2. attention over the latent cache
  AttnArgs a = attn_args(q, ql, T, d);
  a.c = c;
  a.kr = k_r;
  a.len = len_dev;
  a.part_o = work + rows * L;
  a.part_m = a.part_o + int64_t(ns) * rows * L;
  a.part_z = a.part_m + int64_t(ns) * rows;
  a.nsplit = ns;
  a.direct = ns == 1;
  a.vec = L % 4 == 0 && d.rope % 4 == 0 && reinterpret_cast<uintptr_t>(c) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(k_r) % 16 == 0;
  SplitMap merge{};
  merge.len = len_dev;
  merge.nsplit = ns;
  merge.T = T;
  attend_and_merge(a, unsigned(T), unsigned(ns), merge, ql, s);
  // 3. out[t, h] = W_UV[h] o_lat[t, h]
  head_products(true, ql, kv_b, d, T, out, s);
  check_launch("mla_attend_absorbed (out)");
}

int64_t mla_paged_work_floats(int64_t rows, int64_t n_seqs, const MlaAttnDims& d) {
  (void)n_seqs;  // the layout depends on the rows only (n_seqs is kept for the callers' one call shape)
  return paged_mla_work_floats(rows, d, sm_count());  // (ops.h, shared with the memory plan; paged_work lays it out)
}

void mla_attend_absorbed_paged(const float* q, const VarlenDev& b, const PagedCacheDev& c, const WeightMat& kv_b,
                               const MlaAttnDims& d, float* work, float* out, Precision p, Stream s,
                               const int32_t* skip) {
  (void)p;  // fp32 in both precisions, as mla_attend_absorbed
  check_varlen("mla_attend_absorbed_paged", b, false);
  check_paged("mla_attend_absorbed_paged", c);
  check_absorbed("mla_attend_absorbed_paged", kv_b, d);
  if (b.rows <= 0) return;
  const int64_t rows = b.rows, L = d.kv_lora, slots = paged_slots(rows, d.heads);
  const PagedWork w = paged_work(work, rows, slots, d);
  // 1. the device plan: each row's keys and split count, the slot → (row, split) map
  launch(mla_paged_plan_kernel, 1, kPlanThreads, 0, s, b.cu_rows, c.pos0, skip, int(b.n_seqs), rows, slots, w.plan);
  check_launch("mla_attend_absorbed_paged (plan)");
  // 2. q̃[t, h] = W_UK[h]ᵀ q_nope[t, h]
  head_products(false, q, kv_b, d, rows, w.ql, s);
  check_launch("mla_attend_absorbed_paged (q_lat)");
  // 3. attention over each row's pages, merged
  AttnArgs a = attn_args(q, w.ql, rows, d);
  a.pc = c;
  a.plan = w.plan;
  a.part_o = w.part_o;
  a.part_m = w.part_m;
  a.part_z = w.part_z;
  a.nsplit = 1;
  a.direct = slots == rows;
  a.vec = L % 4 == 0 && d.rope % 4 == 0 && reinterpret_cast<uintptr_t>(c.pages) % 16 == 0;
  SplitMap merge{};
  merge.row_u = w.plan.row_u;
  merge.row_off = w.plan.row_off;
  attend_and_merge(a, unsigned(slots), 1, merge, w.ql, s);
  // 4. out[t, h] = W_UV[h] o_lat[t, h]
  head_products(true, w.ql, kv_b, d, rows, out, s);
  check_launch("mla_attend_absorbed_paged (out)");
}

void advance_len(int32_t* len_dev, int64_t T, Stream s) {
  launch(advance_len_kernel, 1, 1, 0, s, len_dev, int32_t(T));
  check_launch("advance_len");
}

}  // namespace k3::cuda
