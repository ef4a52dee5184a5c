// CUDA Kimi Delta Attention on the tensor cores (cuda_ops.h kda_chunked_tc_varlen): the chunked
// prefill of the `fast` numerics mode. bf16 operands, fp32 accumulation, fp32 state; the same
// function as k3::ref::kda_recurrent (tests/cuda/test_cuda_kda_tc.cpp holds it to the fp64 twin).
// Must not: sync, allocate (the caller lends the workspace), or read the device arrays on the host.
//
// Per chunk of C = 64 tokens of one head, with Γ_i = Σ_{j<=i} g_j counted from the chunk start
// (g <= 0: a decay), S0 the state at the chunk start (spec §3.5, in the WY/UT form):
//   A[i,j] = Σ_d k_id k_jd e^{Γ_id − Γ_jd} (j < i)      L = Diag(β)·A       T = (I + L)^-1
//   W = T·(β ⊙ K ⊙ e^Γ)      U = T·(β ⊙ V)      δ = U − W·S0           (δ: the chunk's delta-rule updates)
//   O = (Q ⊙ e^Γ)·S0 + Aqk·δ,  Aqk[i,j] = Σ_d q_id k_jd e^{Γ_id − Γ_jd} (j <= i)
//   S = Diag(e^{Γ_last})·S0 + (K ⊙ e^{Γ_last − Γ})ᵀ·δ
// Two kernels. `prep` (one block per chunk and head, all chunks in parallel) computes Aqk, T, W, U,
// Q ⊙ e^Γ, (K ⊙ e^{Γ_last − Γ})ᵀ and e^{Γ_last} into the workspace; `scan` (one block per head,
// value-column slice and sequence) walks the chunks in order with the state slice in registers
// (MMA accumulators), its bf16 copy in shared memory as the operand, and the next chunk's operands
// arriving by cp.async while the current one computes.
// The decayed products of A and Aqk are factored around a reference point per 16-token sub-chunk J
// (r = its last token): x_i e^{Γ_i − Γ_r} times k_j e^{Γ_r − Γ_j}. For blocks below the diagonal
// (i in a later sub-chunk, j in J) both factors are <= 1, so nothing overflows whatever the decay
// (an underflow to 0 is the true value's own size). On the diagonal block the first factor grows to
// e^{span}: when some channel's decay over the sub-chunk exceeds kSafeSpan (never with K3's bounded
// gate, |g| < 5 over 15 steps), that block is computed directly in fp32 instead.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/varlen.cuh"

namespace k3::cuda {

namespace {

constexpr int kC = 64;             // tokens per chunk
constexpr int kSub = 16;           // sub-chunk: the reference points of the factored products
constexpr int kT = 256;            // threads per block (8 warps)
constexpr int kLdC = kC + 8;       // bf16 row stride of token-indexed rows (72: conflict-free fragments)
constexpr float kSafeSpan = 80.0f;  // e^80 ≈ 5.5e34: a factor that stays finite in fp32 and bf16
constexpr int kPairs = (kC / kSub) * (kC / kSub + 1) / 2;  // sub-chunk pairs (I >= J): 10

// One chunk and head's record in the workspace: bf16 [WQ: 2C × D (W rows, then Q ⊙ e^Γ rows)]
// [KSt: D × C] [Aqk: C × C] [U: C × D], then fp32 [decay: D]. 16-byte aligned (cp.async).
template <int D>
struct Rec {
  static constexpr int64_t wq = 2 * kC * D, ks = int64_t(D) * kC, aq = kC * kC, u = int64_t(kC) * D;
  static constexpr int64_t bytes = (wq + ks + aq + u) * 2 + D * 4;
  static_assert(bytes % 16 == 0, "records must stay 16-byte aligned");
};

// Sequences [z0, z0 + nz) of a call, their rows clipped to [lo, hi): a window of the call whose
// chunks fit the workspace (a long sequence spans several windows; its state flows between them).
struct Win {
  int z0, nz;
  int64_t lo, hi;
};
__device__ __forceinline__ void win_rows(const int32_t* cu, const Win& w, int y, int64_t* r0, int64_t* r1) {
  *r0 = max(int64_t(cu[y]), w.lo);
  *r1 = max(*r0, min(int64_t(cu[y + 1]), w.hi));
}
__device__ __forceinline__ int64_t win_chunks(const int32_t* cu, const Win& w, int y) {
  int64_t a, b;
  win_rows(cu, w, y, &a, &b);
  return (b - a + kC - 1) / kC;
}

// ---------------------------------------------------------------- prep
template <int D>
struct PrepSmem {
  static constexpr int ldF = D + 4;  // fp32 rows [C][D]
  static constexpr int ldD = D + 8;  // bf16 rows [C][D]
  static constexpr int ldL = kC + 1;
  static constexpr int oG = 0, oK = oG + kC * ldF, oQ = oK + kC * ldF;  // Γ, k, q; the q region later holds T (fp32)
  static constexpr int qRegion = kC * ldF > kC * ldL ? kC * ldF : kC * ldL;
  static constexpr int oL = oQ + qRegion, oBeta = oL + kC * ldL, oFlag = oBeta + kC;
  static constexpr int floats = oFlag + 4;
  static constexpr int hBase = (floats * 4 + 15) / 16 * 16;  // bytes: bf16 arrays after the floats
  static constexpr int hKr = 0, hKG = hKr + kC * ldD, hV = hKG + D * kLdC, hT = hV + D * kLdC;
  static constexpr int halfs = hT + kC * kLdC;
  static constexpr int bytes = hBase + halfs * 2;
};

template <int D>
__global__ void __launch_bounds__(kT)
    kda_tc_prep_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ g, const float* __restrict__ beta, const int32_t* __restrict__ cu_rows,
                       Win w, int64_t H, uint8_t* __restrict__ work) {
  pdl_enter();
  using L = PrepSmem<D>;
  extern __shared__ float4 smem4[];
  float* sf = reinterpret_cast<float*>(smem4);
  uint16_t* sh = reinterpret_cast<uint16_t*>(reinterpret_cast<uint8_t*>(smem4) + L::hBase);
  float *G = sf + L::oG, *Kf = sf + L::oK, *Qf = sf + L::oQ, *Tf = sf + L::oQ, *Lm = sf + L::oL, *bt = sf + L::oBeta;
  int* unsafe = reinterpret_cast<int*>(sf + L::oFlag);
  uint16_t *Kr = sh + L::hKr, *KGt = sh + L::hKG, *Vt = sh + L::hV, *Tb = sh + L::hT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int64_t h = blockIdx.y;

  // This block's sequence and chunk: chunk x of the window, counted over its sequences in order.
  int64_t x = blockIdx.x, r0 = 0, len = 0;
  bool found = false;
  for (int y = w.z0; y < w.z0 + w.nz && !found; ++y) {
    int64_t a, b;
    win_rows(cu_rows, w, y, &a, &b);
    const int64_t n = (b - a + kC - 1) / kC;
    if (x < n) {
      r0 = a + x * kC;
      len = min(int64_t(kC), b - r0);
      found = true;
    } else {
      x -= n;
    }
  }
  if (!found) return;
  uint8_t* rec = work + (int64_t(blockIdx.x) * H + h) * Rec<D>::bytes;
  uint16_t* gWQ = reinterpret_cast<uint16_t*>(rec);
  uint16_t* gKS = gWQ + Rec<D>::wq;
  uint16_t* gAq = gKS + Rec<D>::ks;
  uint16_t* gU = gAq + Rec<D>::aq;
  float* gDec = reinterpret_cast<float*>(gU + Rec<D>::u);

  // 1. Inputs (tokens past the chunk's end are zeros: they change nothing).
  if (tid < kC) bt[tid] = tid < len ? beta[(r0 + tid) * H + h] : 0.0f;
  if (tid < 4) unsafe[tid] = 0;
  for (int idx = tid; idx < kC * D; idx += kT) {
    const int i = idx / D, d = idx % D;
    float gv = 0, kv = 0, qv = 0;
    if (i < len) {
      const int64_t r = ((r0 + i) * H + h) * D + d;
      gv = g[r];
      kv = k[r];
      qv = q[r];
    }
    G[i * L::ldF + d] = gv;
    Kf[i * L::ldF + d] = kv;
    Qf[i * L::ldF + d] = qv;
  }
  __syncthreads();
  for (int idx = tid; idx < kC * D; idx += kT) {
    const int i = idx / D, d = idx % D;
    const float vv = i < len ? v[((r0 + i) * H + h) * D + d] : 0.0f;
    Vt[d * kLdC + i] = to_bf16_bits(bt[i] * vv);
  }
  // 2. Γ per channel, and which sub-chunks' diagonal blocks must be computed directly.
  if (tid < D) {
    float acc = 0;
    for (int i = 0; i < kC; ++i) {
      acc += G[i * L::ldF + tid];
      G[i * L::ldF + tid] = acc;
    }
    for (int J = 0; J < kC / kSub; ++J) {
      const float ref = G[(J * kSub + kSub - 1) * L::ldF + tid];
      bool bad = false;
      for (int i = J * kSub; i < J * kSub + kSub; ++i) bad |= !(fabsf(G[i * L::ldF + tid] - ref) <= kSafeSpan);
      if (bad) unsafe[J] = 1;
    }
  }
  __syncthreads();
  // 3. Operands: (β ⊙ K ⊙ e^Γ)ᵀ and Kr = K ⊙ e^{Γ_r − Γ} here; Q ⊙ e^Γ, KSt and the decay out.
  for (int idx = tid; idx < kC * D; idx += kT) {
    const int i = idx / D, d = idx % D;
    const float Gi = G[i * L::ldF + d], kv = Kf[i * L::ldF + d], e = __expf(Gi);
    KGt[d * kLdC + i] = to_bf16_bits(bt[i] * kv * e);
    gWQ[(kC + i) * D + d] = to_bf16_bits(Qf[i * L::ldF + d] * e);
    Kr[i * L::ldD + d] = to_bf16_bits(kv * __expf(G[(i | (kSub - 1)) * L::ldF + d] - Gi));
  }
  for (int idx = tid; idx < kC * D; idx += kT) {
    const int d = idx / kC, i = idx % kC;
    gKS[d * kC + i] = to_bf16_bits(Kf[i * L::ldF + d] * __expf(G[(kC - 1) * L::ldF + d] - G[i * L::ldF + d]));
  }
  if (tid < D) gDec[tid] = __expf(G[(kC - 1) * L::ldF + tid]);
  for (int idx = tid; idx < kC * kC; idx += kT) {
    const int r = idx / kC, c = idx % kC;
    if (c / kSub > r / kSub) gAq[idx] = 0;  // blocks above the diagonal
  }
  __syncthreads();
  // 4. The blocks (I >= J) of A (into L = β·A, strictly lower) and of Aqk (lower with the diagonal)
  // on the tensor cores: 2 × 10 warp tasks of 16 × 16 × D, the A operand formed in registers.
  for (int task = warp; task < 2 * kPairs; task += kT / 32) {
    const bool isQ = task >= kPairs;
    const int p = isQ ? task - kPairs : task;
    int I = 0;
    while ((I + 1) * (I + 2) / 2 <= p) ++I;
    const int J = p - I * (I + 1) / 2;
    if (I == J && unsafe[J]) continue;  // computed directly below
    const float* X = isQ ? Qf : Kf;
    const float* Gr = G + (J * kSub + kSub - 1) * L::ldF;
    const int ra = I * kSub + gq, rb = ra + 8;
    float acc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int c0 = ks * 16 + 2 * tq;
      auto el = [&](int r, int c) { return X[r * L::ldF + c] * __expf(G[r * L::ldF + c] - Gr[c]); };
      uint32_t a[4];
      a[0] = pack_bf16x2(el(ra, c0), el(ra, c0 + 1));
      a[1] = pack_bf16x2(el(rb, c0), el(rb, c0 + 1));
      a[2] = pack_bf16x2(el(ra, c0 + 8), el(ra, c0 + 9));
      a[3] = pack_bf16x2(el(rb, c0 + 8), el(rb, c0 + 9));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t b[2];
        frag_b(b, Kr, L::ldD, J * kSub + nt * 8, ks * 16, lane);
        mma_bf16(acc[nt], a, b);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? ra : rb, c = J * kSub + nt * 8 + 2 * tq + (e & 1);
        if (isQ)
          gAq[r * kC + c] = to_bf16_bits(c <= r ? acc[nt][e] : 0.0f);
        else
          Lm[r * L::ldL + c] = c < r ? bt[r] * acc[nt][e] : 0.0f;
      }
  }
  // Diagonal blocks of strong decay, directly: Σ_d x_id k_jd e^{Γ_id − Γ_jd} (exponents <= 0).
  for (int J = 0; J < kC / kSub; ++J) {
    if (!unsafe[J]) continue;
    for (int e = tid; e < 2 * kSub * kSub; e += kT) {
      const bool isQ = e >= kSub * kSub;
      const int ee = isQ ? e - kSub * kSub : e, r = J * kSub + ee / kSub, c = J * kSub + ee % kSub;
      const float* X = isQ ? Qf : Kf;
      float s = 0;
      if (c <= r)
        for (int d = 0; d < D; ++d)
          s = fmaf(X[r * L::ldF + d] * Kf[c * L::ldF + d], expf(G[r * L::ldF + d] - G[c * L::ldF + d]), s);
      if (isQ)
        gAq[r * kC + c] = to_bf16_bits(c <= r ? s : 0.0f);
      else
        Lm[r * L::ldL + c] = c < r ? bt[r] * s : 0.0f;
    }
  }
  __syncthreads();
  // 5. T = (I + L)^-1 by forward substitution in fp32, one column per 4 lanes (Tf reuses q's space).
  {
    const int c = tid >> 2, part = tid & 3;
    if (part == 0) Tf[c * L::ldL + c] = 1.0f;
    __syncwarp();
    for (int i = 1; i < kC; ++i) {
      float s = 0;
      if (i > c)
        for (int j = c + part; j < i; j += 4) s = fmaf(Lm[i * L::ldL + j], Tf[j * L::ldL + c], s);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (part == 0 && i > c) Tf[i * L::ldL + c] = -s;
      __syncwarp();
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kC * kC; idx += kT) {
    const int i = idx / kC, j = idx % kC;
    Tb[i * kLdC + j] = to_bf16_bits(j <= i ? Tf[i * L::ldL + j] : 0.0f);
  }
  __syncthreads();
  // 6. W = T·(β ⊙ K ⊙ e^Γ) (warps 0-3) and U = T·(β ⊙ V) (warps 4-7), 16 rows each.
  {
    const bool isU = warp >= 4;
    const int m0 = (warp & 3) * 16;
    const uint16_t* B = isU ? Vt : KGt;
    float acc[D / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      uint32_t a[4];
      frag_a(a, Tb, kLdC, m0, ks * 16, lane);
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        uint32_t b[2];
        frag_b(b, B, kLdC, nt * 8, ks * 16, lane);
        mma_bf16(acc[nt], a, b);
      }
    }
    uint16_t* out = isU ? gU : gWQ;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const int c = nt * 8 + 2 * tq;
      *reinterpret_cast<uint32_t*>(out + (m0 + gq) * D + c) = pack_bf16x2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<uint32_t*>(out + (m0 + gq + 8) * D + c) = pack_bf16x2(acc[nt][2], acc[nt][3]);
    }
  }
}

// ---------------------------------------------------------------- scan
template <int D, int NS>
struct ScanSmem {
  static constexpr int ldD = D + 8;
  static constexpr int oKS = 2 * kC * ldD, oAq = oKS + D * kLdC, stage = oAq + kC * kLdC;  // bf16 elements
  static constexpr int oSt = 2 * stage, oDt = oSt + NS * ldD;
  static constexpr int bytes = (oDt + NS * kLdC) * 2;
};

template <int D, int NS>
__global__ void __launch_bounds__(kT)
    kda_tc_scan_kernel(const int32_t* __restrict__ cu_rows, const int32_t* __restrict__ slots, int n_slots, Win w,
                       int64_t H, const uint8_t* __restrict__ work, float* __restrict__ S_pool, float* __restrict__ o) {
  pdl_enter();
  using L = ScanSmem<D, NS>;
  constexpr int KT = D / 16, KTW = (KT + 7) / 8, NT = NS / 8;
  extern __shared__ float4 smem4[];
  uint16_t* sh = reinterpret_cast<uint16_t*>(smem4);
  uint16_t *St = sh + L::oSt, *Dt = sh + L::oDt;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int64_t h = blockIdx.y;
  const int c0 = blockIdx.x * NS, y = w.z0 + int(blockIdx.z);

  int64_t base = 0;  // the window's chunks before this sequence's
  for (int z = w.z0; z < y; ++z) base += win_chunks(cu_rows, w, z);
  int64_t r0, r1;
  win_rows(cu_rows, w, y, &r0, &r1);
  if (r1 <= r0) return;
  const int slot = slots[y];
  if (slot < 0 || slot >= n_slots) {  // a bad slot: its outputs become NaN, no state is touched
    for (int64_t e = tid; e < (r1 - r0) * NS; e += kT)
      o[((r0 + e / NS) * H + h) * D + c0 + e % NS] = __int_as_float(0x7fc00000);
    return;
  }
  float* Sh = S_pool + (int64_t(slot) * H + h) * D * D;
  const int64_t nch = (r1 - r0 + kC - 1) / kC;

  // The state slice S[d][c0 + c]: warp w holds key rows of tiles w, w + 8, ... as MMA accumulators.
  float S[KTW][NT][4];
  auto put_st = [&](int u) {  // its bf16 copy, transposed (St[c][d]: the B operand of W·S and Q·S)
    const int d = 16 * (warp + 8 * u) + gq;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c = 8 * nt + 2 * tq;
      St[c * L::ldD + d] = to_bf16_bits(S[u][nt][0]);
      St[(c + 1) * L::ldD + d] = to_bf16_bits(S[u][nt][1]);
      St[c * L::ldD + d + 8] = to_bf16_bits(S[u][nt][2]);
      St[(c + 1) * L::ldD + d + 8] = to_bf16_bits(S[u][nt][3]);
    }
  };
#pragma unroll
  for (int u = 0; u < KTW; ++u) {
    if (warp + 8 * u >= KT) continue;
    const int d = 16 * (warp + 8 * u) + gq;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c = c0 + 8 * nt + 2 * tq;
      S[u][nt][0] = Sh[d * D + c];
      S[u][nt][1] = Sh[d * D + c + 1];
      S[u][nt][2] = Sh[(d + 8) * D + c];
      S[u][nt][3] = Sh[(d + 8) * D + c + 1];
    }
    put_st(u);
  }
  auto rec_of = [&](int64_t ci) { return work + ((base + ci) * H + h) * Rec<D>::bytes; };
  auto load_stage = [&](int64_t ci, int buf) {
    const uint16_t* gWQ = reinterpret_cast<const uint16_t*>(rec_of(ci));
    const uint16_t *gKS = gWQ + Rec<D>::wq, *gAq = gKS + Rec<D>::ks;
    uint16_t* s0 = sh + buf * L::stage;
    for (int e = tid; e < 2 * kC * (D / 8); e += kT) {
      const int r = e / (D / 8), cc = e % (D / 8);
      cp_async16(s0 + r * L::ldD + cc * 8, gWQ + r * D + cc * 8);
    }
    for (int e = tid; e < D * (kC / 8); e += kT) {
      const int r = e / (kC / 8), cc = e % (kC / 8);
      cp_async16(s0 + L::oKS + r * kLdC + cc * 8, gKS + r * kC + cc * 8);
    }
    for (int e = tid; e < kC * (kC / 8); e += kT) {
      const int r = e / (kC / 8), cc = e % (kC / 8);
      cp_async16(s0 + L::oAq + r * kLdC + cc * 8, gAq + r * kC + cc * 8);
    }
    cp_async_commit();
  };
  load_stage(0, 0);

  for (int64_t ci = 0; ci < nch; ++ci) {
    const int buf = int(ci & 1);
    const int64_t row0 = r0 + ci * kC;
    const int len = int(min(int64_t(kC), r1 - row0));
    const uint16_t* gU = reinterpret_cast<const uint16_t*>(rec_of(ci)) + Rec<D>::wq + Rec<D>::ks + Rec<D>::aq;
    const float* gDec = reinterpret_cast<const float*>(gU + Rec<D>::u);
    // Loads to registers before the wait: U (warps 0-3's token rows) and the decay of the S rows.
    uint32_t ur[NT][2] = {};
    if (warp < 4)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = c0 + 8 * nt + 2 * tq, i = 16 * warp + gq;
        ur[nt][0] = *reinterpret_cast<const uint32_t*>(gU + i * D + c);
        ur[nt][1] = *reinterpret_cast<const uint32_t*>(gU + (i + 8) * D + c);
      }
    float dec[KTW][2];
#pragma unroll
    for (int u = 0; u < KTW; ++u) {
      const int d = min(16 * (warp + 8 * u) + gq, D - 9);
      dec[u][0] = gDec[d];
      dec[u][1] = gDec[d + 8];
    }
    cp_async_wait_all();
    __syncthreads();  // this chunk's operands and St are visible; the other buffer is free
    if (ci + 1 < nch) load_stage(ci + 1, buf ^ 1);
    const uint16_t* WQs = sh + buf * L::stage;
    const uint16_t *KSs = WQs + L::oKS, *Aqs = WQs + L::oAq;
    // (a) P = [W; Q ⊙ e^Γ]·S0: warp w's 16 rows.
    float P[NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      frag_a(a, WQs, L::ldD, 16 * warp, 16 * ks, lane);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t b[2];
        frag_b(b, St, L::ldD, 8 * nt, 16 * ks, lane);
        mma_bf16(P[nt], a, b);
      }
    }
    // (b) δ = U − W·S0 (warps 0-3), stored transposed in bf16: Dt[c][i].
    if (warp < 4) {
      const int i = 16 * warp + gq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * tq;
        Dt[c * kLdC + i] = to_bf16_bits(bf16_lo(ur[nt][0]) - P[nt][0]);
        Dt[(c + 1) * kLdC + i] = to_bf16_bits(bf16_hi(ur[nt][0]) - P[nt][1]);
        Dt[c * kLdC + i + 8] = to_bf16_bits(bf16_lo(ur[nt][1]) - P[nt][2]);
        Dt[(c + 1) * kLdC + i + 8] = to_bf16_bits(bf16_hi(ur[nt][1]) - P[nt][3]);
      }
    }
    __syncthreads();
    // (c) O = Q ⊙ e^Γ·S0 + Aqk·δ (warps 4-7).
    if (warp >= 4) {
      const int m0 = 16 * (warp - 4);
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        uint32_t a[4];
        frag_a(a, Aqs, kLdC, m0, 16 * ks, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[2];
          frag_b(b, Dt, kLdC, 8 * nt, 16 * ks, lane);
          mma_bf16(P[nt], a, b);
        }
      }
      const int i = m0 + gq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = c0 + 8 * nt + 2 * tq;
        if (i < len) *reinterpret_cast<float2*>(o + ((row0 + i) * H + h) * D + c) = make_float2(P[nt][0], P[nt][1]);
        if (i + 8 < len)
          *reinterpret_cast<float2*>(o + ((row0 + i + 8) * H + h) * D + c) = make_float2(P[nt][2], P[nt][3]);
      }
    }
    // (d) S = Diag(e^{Γ_last})·S0 + KStᵀ... i.e. (K ⊙ e^{Γ_last − Γ})ᵀ·δ, then its bf16 copy.
#pragma unroll
    for (int u = 0; u < KTW; ++u) {
      if (warp + 8 * u >= KT) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        S[u][nt][0] *= dec[u][0];
        S[u][nt][1] *= dec[u][0];
        S[u][nt][2] *= dec[u][1];
        S[u][nt][3] *= dec[u][1];
      }
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        uint32_t a[4];
        frag_a(a, KSs, kLdC, 16 * (warp + 8 * u), 16 * ks, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t b[2];
          frag_b(b, Dt, kLdC, 8 * nt, 16 * ks, lane);
          mma_bf16(S[u][nt], a, b);
        }
      }
      put_st(u);
    }
  }
#pragma unroll
  for (int u = 0; u < KTW; ++u) {
    if (warp + 8 * u >= KT) continue;
    const int d = 16 * (warp + 8 * u) + gq;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c = c0 + 8 * nt + 2 * tq;
      Sh[d * D + c] = S[u][nt][0];
      Sh[d * D + c + 1] = S[u][nt][1];
      Sh[(d + 8) * D + c] = S[u][nt][2];
      Sh[(d + 8) * D + c + 1] = S[u][nt][3];
    }
  }
}

// ---------------------------------------------------------------- host
// Windows of the call whose chunks fit `cap` records (per head), from the host copy of cu_rows.
std::vector<Win> windows(const int32_t* cu, int64_t n, int64_t cap) {
  std::vector<Win> out;
  int64_t lo = cu[0], used = 0;
  int z0 = 0;
  for (int y = 0; y < int(n); ++y) {
    int64_t r = std::max<int64_t>(cu[y], lo);
    const int64_t end = cu[y + 1];
    while (end > r) {
      const int64_t need = (end - r + kC - 1) / kC;
      if (used + need <= cap) {
        used += need;
        break;
      }
      const int64_t hi = r + (cap - used) * kC;  // the rows that still fit
      out.push_back({z0, y - z0 + 1, lo, hi});
      lo = r = hi;
      used = 0;
      z0 = y;
    }
  }
  if (used > 0) out.push_back({z0, int(n) - z0, lo, int64_t(cu[n])});
  return out;
}

constexpr int kMaxSmem = 227 * 1024;

template <int D>
void run_tc(const float* q, const float* k, const float* v, const float* g, const float* beta, const VarlenDev& b,
            const int32_t* cu_host, int64_t H, float* S_pool, float* o, void* work, int64_t work_chunks, Stream s) {
  constexpr int NS = D < 32 ? D : 32;
  using P = PrepSmem<D>;
  using Q = ScanSmem<D, NS>;
  static_assert(P::bytes <= kMaxSmem && Q::bytes <= kMaxSmem, "shared memory");
  static const bool attr =
      cudaFuncSetAttribute(kda_tc_prep_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, P::bytes) ==
          cudaSuccess &&
      cudaFuncSetAttribute(kda_tc_scan_kernel<D, NS>, cudaFuncAttributeMaxDynamicSharedMemorySize, Q::bytes) ==
          cudaSuccess;
  if (!attr) fail("kda_chunked_tc_varlen: this GPU cannot give " + std::to_string(P::bytes) + " bytes of shared memory");
  const int64_t cap = work_chunks;
  for (const Win& w : windows(cu_host, b.n_seqs, cap)) {
    int64_t chunks = 0;
    for (int y = w.z0; y < w.z0 + w.nz; ++y) {
      const int64_t a = std::max<int64_t>(cu_host[y], w.lo), e = std::max(a, std::min<int64_t>(cu_host[y + 1], w.hi));
      chunks += (e - a + kC - 1) / kC;
    }
    if (chunks == 0) continue;
    launch(kda_tc_prep_kernel<D>, dim3(unsigned(chunks), unsigned(H)), kT, P::bytes, s, q, k, v, g, beta, b.cu_rows, w,
           H, static_cast<uint8_t*>(work));
    launch(kda_tc_scan_kernel<D, NS>, dim3(unsigned(D / NS), unsigned(H), unsigned(w.nz)), kT, Q::bytes, s, b.cu_rows,
           b.slots, int(b.n_slots), w, H, static_cast<const uint8_t*>(work), S_pool, o);
  }
}

}  // namespace

bool kda_tc_supported(int64_t Dk, int64_t Dv) {
  return Dk == Dv && (Dk == 16 || Dk == 32 || Dk == 64 || Dk == 128);
}

size_t kda_tc_work_bytes(int64_t chunks, int64_t H, int64_t D) {
  int64_t rec = 0;
  switch (D) {
    case 16: rec = Rec<16>::bytes; break;
    case 32: rec = Rec<32>::bytes; break;
    case 64: rec = Rec<64>::bytes; break;
    case 128: rec = Rec<128>::bytes; break;
    default: fail("kda_tc_work_bytes: head dim " + std::to_string(D) + " is not 16, 32, 64 or 128");
  }
  return size_t(std::max<int64_t>(chunks, 1) * std::max<int64_t>(H, 1) * rec);
}

int64_t kda_tc_chunks(const int32_t* cu_rows_host, int64_t n_seqs) {
  int64_t n = 0;
  for (int64_t i = 0; i < n_seqs; ++i) n += (int64_t(cu_rows_host[i + 1]) - cu_rows_host[i] + kC - 1) / kC;
  return n;
}

void kda_chunked_tc_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                           const VarlenDev& b, const int32_t* cu_rows_host, int64_t H, int64_t Dk, int64_t Dv,
                           float* S_pool, float* o, void* work, int64_t work_chunks, Stream s) {
  if (!kda_tc_supported(Dk, Dv))
    fail("kda_chunked_tc_varlen: head dims Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) +
         " (the tensor-core kernel takes Dk = Dv in {16, 32, 64, 128})");
  check_varlen("kda_chunked_tc_varlen", b, true);
  if (cu_rows_host == nullptr) fail("kda_chunked_tc_varlen: the host copy of cu_rows is null");
  if (work == nullptr || work_chunks < 1) fail("kda_chunked_tc_varlen: no workspace");
  if (H < 1 || H > 65535) fail("kda_chunked_tc_varlen: heads " + std::to_string(H) + " outside 1..65535");
  if (b.rows <= 0) return;
  switch (Dk) {
    case 16: run_tc<16>(q, k, v, g, beta, b, cu_rows_host, H, S_pool, o, work, work_chunks, s); break;
    case 32: run_tc<32>(q, k, v, g, beta, b, cu_rows_host, H, S_pool, o, work, work_chunks, s); break;
    case 64: run_tc<64>(q, k, v, g, beta, b, cu_rows_host, H, S_pool, o, work, work_chunks, s); break;
    default: run_tc<128>(q, k, v, g, beta, b, cu_rows_host, H, S_pool, o, work, work_chunks, s); break;
  }
  check_launch("kda_chunked_tc_varlen");
}

}  // namespace k3::cuda
