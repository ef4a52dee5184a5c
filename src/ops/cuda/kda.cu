// CUDA Kimi Delta Attention (cuda_ops.h): kda_recurrent (token by token; the decode path) and
// kda_chunked (the chunkwise-parallel UT/WY form of spec §3.5, as ops/cpu/attn_kernels.inc), each
// also in a varlen form (many sequences packed, each with its own state slot; one block body serves
// both forms). All compute exactly what k3::ref::kda_recurrent defines, with an fp32 state.
// Must not: sync, allocate, or depend on anything but its arguments (decode runs inside a graph).
// Launches: programmatic dependent launch on created streams (launch() below; graph-safe).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/varlen.cuh"

namespace k3::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kCols = 32;      // state columns (value channels) per block
constexpr int kMaxDim = 256;   // Dk, Dv limit (one key channel per thread in the loads)

// The delta rule is independent per value column j (u_j, δ_j, o_j and column j of S only involve
// column j), so a head's state splits by columns across blocks: block = (head, 32 columns). That
// gives H·Dv/32 blocks for decode (384 at K3 size) and keeps each block's state slice in registers.

// ---------------------------------------------------------------- recurrent
// Thread layout: warp w, lane = (ar = lane/8, jc = lane%8). Thread holds S[a, c] for the rows
// a = 4w + ar + 32i (i < RPT) and columns c = jc + 8cc (cc < 4) of the slice: one warp load reads
// 4 rows × 8 consecutive floats per instruction (full 32-byte sectors).
// Per token (three block barriers):
//   (a) α = e^g, ka = α⊙k, qa = α⊙q into shared memory (double-buffered), k·q partials
//   (b) u = Sᵀka, w = Sᵀqa                     (= S'ᵀk and S'ᵀq with S' = Diag(α)S)
//   (c) δ = β(v − u), o = w + (k·q)δ            (= S_tᵀq: read from the UPDATED state)
//   (d) S ← Diag(α)S + kδᵀ
// The next token's q/k/g/v/β are loaded into registers while this token computes.
// One block's work: head h, columns [j0, j0 + 32) of one sequence of T tokens (q..beta, o at its
// first token, rows of H heads), its state Sh = S[h] ([Dk, Dv]). Shared by the single-sequence and
// the varlen kernels, so both compute the same bits.
template <int RPT>
__device__ __forceinline__ void kda_recurrent_block(const float* __restrict__ q, const float* __restrict__ k,
                                                    const float* __restrict__ v, const float* __restrict__ g,
                                                    const float* __restrict__ beta, int64_t T, int64_t H, int Dk,
                                                    int Dv, int64_t h, int j0, float* __restrict__ Sh,
                                                    float* __restrict__ o) {
  __shared__ float s_al[2][kMaxDim], s_ka[2][kMaxDim], s_qa[2][kMaxDim], s_k[2][kMaxDim];
  __shared__ float s_v[2][kCols], s_beta[2], s_kqp[2][8];
  __shared__ float red_u[8][kCols], red_w[8][kCols], s_dl[kCols];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, ar = lane >> 3, jc = lane & 7;

  float st[RPT][4];
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int a = warp * 4 + ar + 32 * i;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int c = j0 + jc + 8 * cc;
      st[i][cc] = (a < Dk && c < Dv) ? Sh[int64_t(a) * Dv + c] : 0.0f;
    }
  }

  float rk = 0, rq = 0, rg = 0, rv = 0, rb = 0;
  auto fetch = [&](int64_t t) {
    const int64_t row = t * H + h;
    if (tid < Dk) {
      rk = k[row * Dk + tid];
      rq = q[row * Dk + tid];
      rg = g[row * Dk + tid];
    }
    if (tid < kCols && j0 + tid < Dv) rv = v[row * Dv + j0 + tid];
    if (tid == 0) rb = beta[row];
  };
  if (T > 0) fetch(0);

  for (int64_t t = 0; t < T; ++t) {
    const int b = int(t & 1);
    // (a)
    float kq = 0;
    if (tid < Dk) {
      const float al = expf(rg);
      s_al[b][tid] = al;
      s_ka[b][tid] = al * rk;
      s_qa[b][tid] = al * rq;
      s_k[b][tid] = rk;
      kq = rk * rq;
    }
    for (int off = 16; off > 0; off >>= 1) kq += __shfl_xor_sync(0xffffffffu, kq, off);
    if (lane == 0) s_kqp[b][warp] = kq;
    if (tid < kCols) s_v[b][tid] = (j0 + tid < Dv) ? rv : 0.0f;
    if (tid == 0) s_beta[b] = rb;
    if (t + 1 < T) fetch(t + 1);
    __syncthreads();
    // (b)
    float pu[4] = {0, 0, 0, 0}, pw[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int a = warp * 4 + ar + 32 * i;
      if (a < Dk) {
        const float ka = s_ka[b][a], qa = s_qa[b][a];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          pu[cc] = fmaf(st[i][cc], ka, pu[cc]);
          pw[cc] = fmaf(st[i][cc], qa, pw[cc]);
        }
      }
    }
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      pu[cc] += __shfl_xor_sync(0xffffffffu, pu[cc], 8);
      pu[cc] += __shfl_xor_sync(0xffffffffu, pu[cc], 16);
      pw[cc] += __shfl_xor_sync(0xffffffffu, pw[cc], 8);
      pw[cc] += __shfl_xor_sync(0xffffffffu, pw[cc], 16);
    }
    if (ar == 0) {
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        red_u[warp][jc + 8 * cc] = pu[cc];
        red_w[warp][jc + 8 * cc] = pw[cc];
      }
    }
    __syncthreads();
    // (c)
    if (tid < kCols) {
      float u = 0, w = 0, kqs = 0;
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        u += red_u[x][tid];
        w += red_w[x][tid];
        kqs += s_kqp[b][x];
      }
      const float dl = s_beta[b] * (s_v[b][tid] - u);
      s_dl[tid] = dl;
      if (j0 + tid < Dv) o[(t * H + h) * Dv + j0 + tid] = fmaf(kqs, dl, w);
    }
    __syncthreads();
    // (d)
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int a = warp * 4 + ar + 32 * i;
      if (a < Dk) {
        const float al = s_al[b][a], ka = s_k[b][a];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) st[i][cc] = fmaf(ka, s_dl[jc + 8 * cc], al * st[i][cc]);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int a = warp * 4 + ar + 32 * i;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int c = j0 + jc + 8 * cc;
      if (a < Dk && c < Dv) Sh[int64_t(a) * Dv + c] = st[i][cc];
    }
  }
}

template <int RPT>
__global__ void __launch_bounds__(kThreads)
    kda_recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ g, const float* __restrict__ beta, int64_t T, int64_t H, int Dk,
                         int Dv, float* __restrict__ S, float* __restrict__ o) {
  pdl_enter();
  const int64_t h = blockIdx.y;
  kda_recurrent_block<RPT>(q, k, v, g, beta, T, H, Dk, Dv, h, blockIdx.x * kCols, S + h * int64_t(Dk) * Dv, o);
}

// The varlen kernels' block of sequence blockIdx.z: where its rows start, how many, and its
// state; false when there is nothing to do (no rows, or a bad slot: its outputs become NaN).
struct KdaSeq {
  int64_t r0, T;
  float* Sh;
};
__device__ __forceinline__ bool kda_seq(const int32_t* cu_rows, const int32_t* slots, int n_slots, int64_t H, int Dk,
                                        int Dv, float* S_pool, float* o, KdaSeq* sq) {
  const int i = blockIdx.z;
  const int64_t h = blockIdx.y;
  sq->r0 = cu_rows[i];
  sq->T = cu_rows[i + 1] - sq->r0;
  const int slot = slots[i];
  if (sq->T > 0 && (slot < 0 || slot >= n_slots)) {
    for (int64_t x = threadIdx.x; x < sq->T * kCols; x += blockDim.x) {
      const int64_t t = x / kCols;
      const int c = blockIdx.x * kCols + int(x % kCols);
      if (c < Dv) o[((sq->r0 + t) * H + h) * Dv + c] = __int_as_float(0x7fc00000);
    }
    return false;
  }
  sq->Sh = S_pool + (int64_t(slot) * H + h) * Dk * Dv;
  return sq->T > 0;
}

template <int RPT>
__global__ void __launch_bounds__(kThreads)
    kda_recurrent_varlen_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                const float* __restrict__ g, const float* __restrict__ beta,
                                const int32_t* __restrict__ cu_rows, const int32_t* __restrict__ slots, int n_slots,
                                int64_t H, int Dk, int Dv, float* __restrict__ S_pool, float* __restrict__ o) {
  pdl_enter();
  KdaSeq sq;
  if (!kda_seq(cu_rows, slots, n_slots, H, Dk, Dv, S_pool, o, &sq)) return;
  const int64_t r0 = sq.r0;
  kda_recurrent_block<RPT>(q + r0 * H * Dk, k + r0 * H * Dk, v + r0 * H * Dv, g + r0 * H * Dk, beta + r0 * H, sq.T, H,
                           Dk, Dv, blockIdx.y, blockIdx.x * kCols, sq.Sh, o + r0 * H * Dv);
}

// ---------------------------------------------------------------- chunked
// Chunkwise form for one head and 32 value columns, all fp32, in the factored-decay variant of the
// CPU kernel (ops/cpu/attn_kernels.inc): per chunk of C tokens with Γ_i = Σ_{j<=i} g_j counted from
// the chunk start, the chunk is cut early so that |Γ| <= kMaxLogDecay in every channel; then
// exp(Γ_i − Γ_j) = exp(Γ_i)·exp(−Γ_j) with both factors normal floats, and the intra-chunk decayed
// products become plain matrix products:
//   KQ = [K ⊙ e^Γ ; Q ⊙ e^Γ] (2C × Dk),  Kn = K ⊙ e^−Γ (C × Dk)
//   P = KQ·S (2C × 32)      A = KQ·Knᵀ (2C × C; only j < i is used)
//   Ṽ_i = β_i (v_i − P_i − Σ_{j<i} A[i,j] Ṽ_j)        (the UT transform by forward substitution)
//   O_i = P_{C+i} + Σ_{j<i} A[C+i,j] Ṽ_j + (q_i·k_i) Ṽ_i
//   S ← Diag(e^{Γ_last}) S + Σ_i (k_i ⊙ e^{Γ_last−Γ_i}) Ṽ_iᵀ   (the last token's factor is exactly k)
// A lone token whose |g| exceeds the bound forms a chunk of one (no factored product is used).
// Chunks are sequential (the state flows through them); the parallelism is over heads, column
// slices and, inside a chunk, over the matrix products (4×4 register tiles over shared memory).
constexpr float kMaxLogDecay = 80.0f;
constexpr int kMaxChunk = 64;
constexpr int kVtLd = 36;  // Ṽ row stride: conflict-free for the substitution's access pattern

struct ChunkLayout {
  int CM, Dk, ldKQ, ldKn, ldA, ldKs;
  // offsets in floats (multiples of 4: float4 access)
  int oKQ, oKn, oA, oP, oV, oVt, oS, oEl, oKl, oDg, oBeta, total;
};

__host__ __device__ inline int up4(int x) { return (x + 3) & ~3; }

__host__ __device__ inline ChunkLayout chunk_layout(int CM, int Dk) {
  ChunkLayout L{};
  L.CM = CM;
  L.Dk = Dk;
  L.ldKQ = up4(2 * CM) + 4;  // KQᵀ [Dk][2CM]: token index contiguous (k rows at 0, q rows at CM)
  L.ldKn = up4(CM) + 4;      // Knᵀ [Dk][CM]
  L.ldA = CM + 1;            // A [2CM][CM]
  L.ldKs = up4(Dk) + 4;      // Ks [CM][Dk] (reuses the KQ region once KQ is consumed)
  int o = 0;
  L.oKQ = o;
  o += up4(max(Dk * L.ldKQ, CM * L.ldKs));
  L.oKn = o;
  o += up4(Dk * L.ldKn);
  L.oA = o;
  o += up4(2 * CM * L.ldA);
  L.oP = o;
  o += 2 * CM * kCols;
  L.oV = o;
  o += CM * kCols;
  L.oVt = o;
  o += CM * kVtLd;
  L.oS = o;
  o += up4(Dk) * kCols;
  L.oEl = o;
  o += up4(Dk);
  L.oKl = o;
  o += up4(Dk);
  L.oDg = o;
  o += up4(CM);
  L.oBeta = o;
  o += up4(CM);
  L.total = o + 4;  // + the chunk length (int)
  return L;
}

// out[m][n] = Σ_k AT[k][m] · BT[k][n] for the 4×4 tile at (m0, n0); AT/BT rows are k.
__device__ __forceinline__ void tile_tn(int K, const float* AT, int lda, const float* BT, int ldb, int m0, int n0,
                                        float acc[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
  for (int kk = 0; kk < K; ++kk) {
    const float4 a = *reinterpret_cast<const float4*>(AT + kk * lda + m0);
    const float4 b = *reinterpret_cast<const float4*>(BT + kk * ldb + n0);
    const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

// Rows of KQ / P / A: k rows i at i, q rows i at CQ + i where CQ = the chunk's upper bound (the
// tokens are staged before the cut is known; rows between C and CQ are unused when cut early).
// One block's work (head h, columns [j0, j0 + 32), state Sh = S[h]) as in kda_recurrent_block.
__device__ __forceinline__ void kda_chunked_block(const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ beta, int64_t T, int64_t H, int Dk, int Dv,
                                                  int CM, int64_t h, int j0, float* __restrict__ Sh,
                                                  float* __restrict__ o) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const ChunkLayout L = chunk_layout(CM, Dk);
  float *KQ = sm + L.oKQ, *Kn = sm + L.oKn, *A = sm + L.oA, *P = sm + L.oP, *V = sm + L.oV, *Vt = sm + L.oVt,
        *Ss = sm + L.oS, *El = sm + L.oEl, *Kl = sm + L.oKl, *dg = sm + L.oDg, *bt = sm + L.oBeta;
  float* Ks = KQ;
  int* s_len = reinterpret_cast<int*>(sm + L.total - 4);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int i = tid; i < Dk * kCols; i += kThreads) {
    const int d = i / kCols, c = i % kCols;
    Ss[i] = (j0 + c < Dv) ? Sh[int64_t(d) * Dv + j0 + c] : 0.0f;
  }

  for (int64_t t0 = 0; t0 < T;) {
    const int CQ = int(T - t0 < CM ? T - t0 : CM);
    if (tid == 0) *s_len = CQ;
    __syncthreads();  // also: the previous chunk's state update is complete
    // 1a. Stage g (into Kn, as Γᵀ to be), raw k and q (into KQ), v and β for up to CQ tokens, with
    // every global load independent (no load waits on another).
    // Batches of 4 elements per thread: all 12 loads in flight before any store.
    for (int base = 0; base < CQ * Dk; base += 4 * kThreads) {
      float gv[4], kv[4], qv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int idx = base + u * kThreads + tid;
        if (idx < CQ * Dk) {
          const int64_t r = ((t0 + idx / Dk) * H + h) * Dk + idx % Dk;
          gv[u] = g[r];
          kv[u] = k[r];
          qv[u] = q[r];
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int idx = base + u * kThreads + tid;
        if (idx < CQ * Dk) {
          const int i = idx / Dk, d = idx % Dk;
          Kn[d * L.ldKn + i] = gv[u];
          KQ[d * L.ldKQ + i] = kv[u];
          KQ[d * L.ldKQ + CQ + i] = qv[u];
        }
      }
    }
#pragma unroll 4
    for (int idx = tid; idx < CQ * kCols; idx += kThreads) {
      const int i = idx / kCols, c = idx % kCols;
      V[idx] = (j0 + c < Dv) ? v[((t0 + i) * H + h) * Dv + j0 + c] : 0.0f;
    }
    if (tid < CQ) bt[tid] = beta[(t0 + tid) * H + h];
    __syncthreads();
    // 1b. Γ per channel in place, and where the chunk must be cut; q_i·k_i per token.
    if (tid < Dk) {
      float acc = 0;
      int cut = CQ;
      float* Gd = Kn + tid * L.ldKn;
      for (int i = 0; i < CQ; ++i) {
        acc += Gd[i];
        Gd[i] = acc;
        if (i > 0 && fabsf(acc) > kMaxLogDecay) {
          cut = i;
          break;
        }
      }
      if (cut < CQ) atomicMin(s_len, cut);
    }
    for (int i = warp; i < CQ; i += kThreads / 32) {
      float s = 0;
      for (int d = lane; d < Dk; d += 32) s = fmaf(KQ[d * L.ldKQ + i], KQ[d * L.ldKQ + CQ + i], s);
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) dg[i] = s;
    }
    __syncthreads();
    const int C = *s_len;
    // 2. Factored operands in place.
    for (int idx = tid; idx < C * Dk; idx += kThreads) {
      const int i = idx / Dk, d = idx % Dk;
      const float G = Kn[d * L.ldKn + i], e = expf(G);
      const float kv = KQ[d * L.ldKQ + i], qv = KQ[d * L.ldKQ + CQ + i];
      KQ[d * L.ldKQ + i] = kv * e;
      KQ[d * L.ldKQ + CQ + i] = qv * e;
      Kn[d * L.ldKn + i] = kv * expf(-G);
      if (i == C - 1) {
        El[d] = e;
        Kl[d] = kv;
      }
    }
    __syncthreads();
    // 3. P = KQ·S and the needed part of A = KQ·Knᵀ, as one list of 4×4 tiles.
    {
      const int R = CQ + C;  // rows 0..R-1 (k rows < C, q rows in [CQ, CQ + C))
      const int mt = (R + 3) / 4;
      const int pt = mt * (kCols / 4), nt = (C + 3) / 4, total = pt + mt * nt;
      for (int tI = tid; tI < total; tI += kThreads) {
        float acc[4][4];
        const bool isP = tI < pt;
        const int u = isP ? tI : tI - pt;
        const int m0 = (isP ? u / (kCols / 4) : u / nt) * 4, n0 = (isP ? u % (kCols / 4) : u % nt) * 4;
        // Columns p of A needed by row r: p < r (k rows) or p < r − CQ (q rows).
        int need = 0;
        bool any = false;
        for (int i = 0; i < 4; ++i) {
          const int r = m0 + i;
          if (r < C) {
            need = max(need, r);
            any = true;
          } else if (r >= CQ && r < R) {
            need = max(need, r - CQ);
            any = true;
          }
        }
        if (!any || (!isP && n0 >= need)) continue;
        if (isP) {
          tile_tn(Dk, KQ, L.ldKQ, Ss, kCols, m0, n0, acc);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (m0 + i < R)
#pragma unroll
              for (int j = 0; j < 4; ++j) P[(m0 + i) * kCols + n0 + j] = acc[i][j];
        } else {
          tile_tn(Dk, KQ, L.ldKQ, Kn, L.ldKn, m0, n0, acc);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (m0 + i < R)
#pragma unroll
              for (int j = 0; j < 4; ++j)
                if (n0 + j < C) A[(m0 + i) * L.ldA + n0 + j] = acc[i][j];
        }
      }
    }
    __syncthreads();
    // 4a. KQ is consumed: Ks[i][d] = k_i ⊙ e^{Γ_last − Γ_i} (= Kn·El; exactly k for the last token),
    // row-major for the state update's float4 reads.
    for (int idx = tid; idx < C * Dk; idx += kThreads) {
      const int i = idx / Dk, d = idx % Dk;
      Ks[i * L.ldKs + d] = i == C - 1 ? Kl[d] : Kn[d * L.ldKn + i] * El[d];
    }
    // 4b. Forward substitution: 8 lanes per column (same warp), each summing every 8th earlier
    // token; the partial sums meet by shuffles, so a token costs only a warp-level sync.
    {
      const int c = warp * 4 + (lane >> 3), part = lane & 7;
      for (int i = 0; i < C; ++i) {
        float sx = 0, sy = 0;
        for (int p = part; p < i; p += 8) {
          const float vp = Vt[p * kVtLd + c];
          sx = fmaf(A[i * L.ldA + p], vp, sx);
          sy = fmaf(A[(CQ + i) * L.ldA + p], vp, sy);
        }
        for (int off = 1; off < 8; off <<= 1) {
          sx += __shfl_xor_sync(0xffffffffu, sx, off);
          sy += __shfl_xor_sync(0xffffffffu, sy, off);
        }
        const float x = bt[i] * (V[i * kCols + c] - P[i * kCols + c] - sx);
        if (part == 0) {
          Vt[i * kVtLd + c] = x;
          if (j0 + c < Dv) o[((t0 + i) * H + h) * Dv + j0 + c] = fmaf(dg[i], x, P[(CQ + i) * kCols + c] + sy);
        }
        __syncwarp();
      }
    }
    __syncthreads();
    // 5. S ← Diag(El)·S + Ksᵀ·Ṽ, 4×4 tiles over [Dk × 32] (Ks columns past Dk are never stored).
    for (int tI = tid; tI < ((Dk + 3) / 4) * (kCols / 4); tI += kThreads) {
      const int d0 = (tI / (kCols / 4)) * 4, c0 = (tI % (kCols / 4)) * 4;
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
      for (int i = 0; i < C; ++i) {
        const float4 a = *reinterpret_cast<const float4*>(Ks + i * L.ldKs + d0);
        const float4 b = *reinterpret_cast<const float4*>(Vt + i * kVtLd + c0);
        const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
          for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x)
        if (d0 + x < Dk)
#pragma unroll
          for (int y = 0; y < 4; ++y) {
            float* sp = Ss + (d0 + x) * kCols + c0 + y;
            *sp = fmaf(El[d0 + x], *sp, acc[x][y]);
          }
    }
    t0 += C;
  }
  __syncthreads();
  for (int i = tid; i < Dk * kCols; i += kThreads) {
    const int d = i / kCols, c = i % kCols;
    if (j0 + c < Dv) Sh[int64_t(d) * Dv + j0 + c] = Ss[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    kda_chunked_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ g, const float* __restrict__ beta, int64_t T, int64_t H, int Dk,
                       int Dv, int CM, float* __restrict__ S, float* __restrict__ o) {
  pdl_enter();
  const int64_t h = blockIdx.y;
  kda_chunked_block(q, k, v, g, beta, T, H, Dk, Dv, CM, h, blockIdx.x * kCols, S + h * int64_t(Dk) * Dv, o);
}

__global__ void __launch_bounds__(kThreads)
    kda_chunked_varlen_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                              const float* __restrict__ g, const float* __restrict__ beta,
                              const int32_t* __restrict__ cu_rows, const int32_t* __restrict__ slots, int n_slots,
                              int64_t H, int Dk, int Dv, int CM, float* __restrict__ S_pool, float* __restrict__ o) {
  pdl_enter();
  KdaSeq sq;
  if (!kda_seq(cu_rows, slots, n_slots, H, Dk, Dv, S_pool, o, &sq)) return;
  const int64_t r0 = sq.r0;
  kda_chunked_block(q + r0 * H * Dk, k + r0 * H * Dk, v + r0 * H * Dv, g + r0 * H * Dk, beta + r0 * H, sq.T, H, Dk, Dv,
                    CM, blockIdx.y, blockIdx.x * kCols, sq.Sh, o + r0 * H * Dv);
}

void check_dims(const char* what, int64_t Dk, int64_t Dv) {
  if (Dk < 1 || Dv < 1 || Dk > kMaxDim || Dv > kMaxDim)
    fail(std::string(what) + ": head dims Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) +
         " outside the GPU kernel's 1.." + std::to_string(kMaxDim));
}

// Calls f(std::integral_constant<int, RPT>) with the state rows per thread the recurrent kernel
// needs for Dk (Dk <= 32·RPT).
template <class F>
void with_rpt(int64_t Dk, F&& f) {
  if (Dk <= 32)
    f(std::integral_constant<int, 1>{});
  else if (Dk <= 64)
    f(std::integral_constant<int, 2>{});
  else if (Dk <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

constexpr int kMaxSmem = 200 * 1024;

// The chunked kernels' chunk length and dynamic shared memory: `chunk` is a hint (<= 0: the
// default 64), capped at kMaxChunk and at what fits in shared memory for this Dk; the kernel also
// cuts chunks early under strong decay.
int chunk_len(int64_t chunk, int64_t Dk, size_t* smem) {
  int CM = int(chunk <= 0 ? kMaxChunk : std::min<int64_t>(chunk, kMaxChunk));
  while (CM > 1 && size_t(chunk_layout(CM, int(Dk)).total) * 4 > size_t(kMaxSmem)) CM /= 2;
  *smem = size_t(chunk_layout(CM, int(Dk)).total) * 4;
  return CM;
}

// Opt a kernel in to > 48 KiB of dynamic shared memory, at the largest size it can ask for (a
// host-side attribute: fine before or during graph capture). Callers keep the result in a static.
bool allow_max_smem(const void* kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem) == cudaSuccess;
}
void require_smem(bool ok, const char* what) {
  if (!ok)
    fail(std::string(what) + ": this GPU cannot give " + std::to_string(kMaxSmem) +
         " bytes of shared memory per block");
}

}  // namespace

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int64_t H, int64_t Dk, int64_t Dv, float* S, float* o, Stream s) {
  check_dims("kda_recurrent", Dk, Dv);
  if (T <= 0 || H <= 0) return;
  const dim3 grid(unsigned((Dv + kCols - 1) / kCols), unsigned(H));
  with_rpt(Dk, [&](auto rpt) {
    launch(kda_recurrent_kernel<decltype(rpt)::value>, grid, kThreads, 0, s, q, k, v, g, beta, T, H, int(Dk), int(Dv),
           S, o);
  });
  check_launch("kda_recurrent");
}

void kda_recurrent_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          const VarlenDev& b, int64_t H, int64_t Dk, int64_t Dv, float* S_pool, float* o, Stream s) {
  check_dims("kda_recurrent_varlen", Dk, Dv);
  check_varlen("kda_recurrent_varlen", b, true);
  if (b.rows <= 0 || H <= 0) return;
  const dim3 grid(unsigned((Dv + kCols - 1) / kCols), unsigned(H), unsigned(b.n_seqs));
  with_rpt(Dk, [&](auto rpt) {
    launch(kda_recurrent_varlen_kernel<decltype(rpt)::value>, grid, kThreads, 0, s, q, k, v, g, beta, b.cu_rows,
           b.slots, int(b.n_slots), H, int(Dk), int(Dv), S_pool, o);
  });
  check_launch("kda_recurrent_varlen");
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o, Stream s) {
  check_dims("kda_chunked", Dk, Dv);
  if (T <= 0 || H <= 0) return;
  size_t smem = 0;
  const int CM = chunk_len(chunk, Dk, &smem);
  static const bool attr_set = allow_max_smem(reinterpret_cast<const void*>(kda_chunked_kernel));
  require_smem(attr_set, "kda_chunked");
  const dim3 grid(unsigned((Dv + kCols - 1) / kCols), unsigned(H));
  launch(kda_chunked_kernel, grid, kThreads, smem, s, q, k, v, g, beta, T, H, int(Dk), int(Dv), CM, S, o);
  check_launch("kda_chunked");
}

void kda_chunked_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const VarlenDev& b, int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S_pool, float* o,
                        Stream s) {
  check_dims("kda_chunked_varlen", Dk, Dv);
  check_varlen("kda_chunked_varlen", b, true);
  if (b.rows <= 0 || H <= 0) return;
  size_t smem = 0;
  const int CM = chunk_len(chunk, Dk, &smem);
  static const bool attr_set = allow_max_smem(reinterpret_cast<const void*>(kda_chunked_varlen_kernel));
  require_smem(attr_set, "kda_chunked_varlen");
  const dim3 grid(unsigned((Dv + kCols - 1) / kCols), unsigned(H), unsigned(b.n_seqs));
  launch(kda_chunked_varlen_kernel, grid, kThreads, smem, s, q, k, v, g, beta, b.cu_rows, b.slots, int(b.n_slots), H,
         int(Dk), int(Dv), CM, S_pool, o);
  check_launch("kda_chunked_varlen");
}

}  // namespace k3::cuda
