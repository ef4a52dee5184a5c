// CUDA Kimi Delta Attention on the tensor cores (cuda_ops.h kda_chunked_tc_varlen): the chunked
// prefill of the `fast` numerics mode. bf16 operands, fp32 accumulation, fp32 state; the same
// function as k3::ref::kda_recurrent (tests/cuda/test_cuda_varlen.cpp holds it to the fp64 twin).
// Must not: sync, allocate (the caller lends the workspace), or read the device arrays on the host.
//
// Per chunk of C = 64 tokens of one head, with Γ_i = Σ_{j<=i} g_j counted from the chunk start
// (g <= 0: a decay), S0 the state at the chunk start (spec §3.5, in the WY/UT form):
//   A[i,j] = Σ_d k_id k_jd e^{Γ_id − Γ_jd} (j < i)      L = Diag(β)·A       T = (I + L)^-1
//   W = T·(β ⊙ K ⊙ e^Γ)      U = T·(β ⊙ V)      δ = U − W·S0           (δ: the chunk's delta-rule updates)
//   O = (Q ⊙ e^Γ)·S0 + Aqk·δ,  Aqk[i,j] = Σ_d q_id k_jd e^{Γ_id − Γ_jd} (j <= i)
//   S = Diag(e^{Γ_last})·S0 + (K ⊙ e^{Γ_last − Γ})ᵀ·δ
// Two kernels. `prep` (one block per chunk and head, all chunks in parallel) computes Aqk, T, W, U,
// Q ⊙ e^Γ, K ⊙ e^{Γ_last − Γ} and e^{Γ_last} into the workspace; `scan` (one block per head,
// value-column slice and sequence) walks the chunks in order with the state slice in registers
// (MMA accumulators), its bf16 copy in shared memory as the operand, and the next chunk's operands
// arriving by cp.async while the current one computes.
// The decayed products of A and Aqk are factored around the 16-token sub-chunks: with Γ_s(I) the
// log-decay at the token before sub-chunk I and Γ_r(J) at the last token of J,
//   x_i e^{Γ_i − Γ_j} k_j = [x_i e^{Γ_i − Γ_s(I)}] · e^{Γ_s(I) − Γ_r(J)} · [k_j e^{Γ_r(J) − Γ_j}]
// for i in I and j in J <= I: both brackets are <= |x|, |k| whatever the decay, and the middle
// factor is a per-channel table (<= 1 below the diagonal), so the MMA operands are formed with one
// multiply and nothing overflows (an underflow to 0 is the true value's own size). On the diagonal
// the middle factor is e^{span of I}: when some channel's decay over a sub-chunk exceeds kSafeSpan
// (never with K3's bounded gate, |g| < 5 over 16 steps) that block is computed directly in fp32.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
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
// [KS = K ⊙ e^{Γ_last − Γ}: C × D] [Aqk: C × C] [U: C × D], then fp32 [decay: D]. 16-byte aligned
// (cp.async); token-major throughout (the scan reads KS transposed with ldmatrix).
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
// Shared memory in phases, small enough that two blocks share a multiprocessor (one block alone
// waits on its loads and barriers with nothing to overlap them):
//   R1  fp32 Γ [C][D+4]                        then T fp32 [C][C+1] and its block-row scratch
//   R2  bf16 Ks, Qs, Kr [C][D+8] (k, q, k ⊙ e^{Γ_r − Γ}), then β ⊙ K ⊙ e^Γ (in place of Ks) and
//       β ⊙ V (where Qs was), token-major (step 7 reads them transposed with ldmatrix); past them
//       the decay tables of the factored products, later T's bf16 copy [C][C+8]
//   R3  fp32 L = Diag(β)·A [C][C+1] (Γ's partial sums before it), β, flags
template <int D>
struct PrepSmem {
  static constexpr int ldF = D + 4, ldD = D + 8, ldL = kC + 1;
  static constexpr int t_floats = kC * ldL + 3 * kSub * kSub;
  static constexpr int r1 = (kC * ldF > t_floats ? kC * ldF : t_floats) * 4;  // bytes
  static constexpr int hQ = kC * ldD, hKr = 2 * kC * ldD;                      // bf16 offsets in R2
  static constexpr int hT = 3 * kC * ldD;  // past Kr: the tables live through phase A
  static constexpr int r2h = hT + kC * kLdC;
  static constexpr int oR2 = r1, oR3 = oR2 + (r2h * 2 + 15) / 16 * 16;
  static constexpr int oBeta = oR3 + kC * ldL * 4, oFlag = oBeta + kC * 4;
  static constexpr int bytes = oFlag + 16;
  static_assert(kT <= kC * ldL, "Γ's partial sums fit in L's space");
  static constexpr int kPairTab = 0, kStartTab = kPairs * D, kLastTab = kStartTab + 4 * D, tab_floats = kLastTab + 4 * D;
  static_assert(tab_floats * 4 <= kC * kLdC * 2 && (hT * 2) % 16 == 0, "the decay tables fit in T's bf16 space");
};

template <int D>
__global__ void __launch_bounds__(kT, 2)
    kda_tc_prep_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ g, const float* __restrict__ beta, const int32_t* __restrict__ cu_rows,
                       Win w, int64_t H, uint8_t* __restrict__ work) {
  pdl_enter();
  using L = PrepSmem<D>;
  extern __shared__ float4 smem4[];
  uint8_t* sb = reinterpret_cast<uint8_t*>(smem4);
  float *G = reinterpret_cast<float*>(sb), *Tf = G, *Xs = G + kC * L::ldL;
  uint16_t* r2 = reinterpret_cast<uint16_t*>(sb + L::oR2);
  uint16_t *Kb = r2, *Qb = r2 + L::hQ, *Kr = r2 + L::hKr, *KG = Kb, *Vb = Qb, *Tb = r2 + L::hT;
  float* tab = reinterpret_cast<float*>(Tb);  // until T's bf16 copy: the decay tables
  float *cPair = tab + L::kPairTab, *eStart = tab + L::kStartTab, *eLast = tab + L::kLastTab;
  float *Lm = reinterpret_cast<float*>(sb + L::oR3), *tot = Lm, *bt = reinterpret_cast<float*>(sb + L::oBeta);
  int* unsafe = reinterpret_cast<int*>(sb + L::oFlag);
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

  // 1. Inputs (tokens past the chunk's end are zeros: they change nothing), float4 loads in flight
  // together: g in fp32 (Γ needs it), k and q as bf16, the operands' precision.
  constexpr int V4 = D / 4, N4 = kC * V4, PER = (N4 + kT - 1) / kT;
  auto load4 = [&](const float* p, int idx) {
    const int i = idx / V4;
    if (idx >= N4 || i >= len) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return __ldg(reinterpret_cast<const float4*>(p + ((r0 + i) * H + h) * D) + idx % V4);
  };
  auto store_bf16x4 = [&](uint16_t* dst, int idx, float4 a) {
    *reinterpret_cast<uint2*>(dst + (idx / V4) * L::ldD + 4 * (idx % V4)) =
        make_uint2(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w));
  };
  if (tid < kC) bt[tid] = tid < len ? beta[(r0 + tid) * H + h] : 0.0f;
  if (tid < 4) unsafe[tid] = 0;
  {
    float4 gv[PER], kv[PER], qv[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = tid + u * kT;
      gv[u] = load4(g, idx);
      kv[u] = load4(k, idx);
      qv[u] = load4(q, idx);
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = tid + u * kT;
      if (idx >= N4) continue;
      *reinterpret_cast<float4*>(G + (idx / V4) * L::ldF + 4 * (idx % V4)) = gv[u];
      store_bf16x4(Kb, idx, kv[u]);
      store_bf16x4(Qb, idx, qv[u]);
    }
  }
  __syncthreads();
  // 2. Γ per channel (kT / D threads per channel, each scanning its share of the tokens, then the
  // shares' totals added in), and which sub-chunks' diagonal blocks must be computed directly.
  {
    constexpr int P = kT / D, span = kC / P;
    static_assert(kT % D == 0 && kC % P == 0, "cumsum split");
    const int d = tid % D, part = tid / D;
    float acc = 0;
    for (int i = part * span; i < (part + 1) * span; ++i) {
      acc += G[i * L::ldF + d];
      G[i * L::ldF + d] = acc;
    }
    tot[part * D + d] = acc;
    __syncthreads();
    float add = 0;
    for (int p = 0; p < part; ++p) add += tot[p * D + d];
    if (part > 0)
      for (int i = part * span; i < (part + 1) * span; ++i) G[i * L::ldF + d] += add;
    __syncthreads();
    // The factored products' decays, per sub-chunk I and channel (Γ_s(I): Γ at the token before
    // I, 0 for the first; Γ_r(I): at its last token): cPair[I, J] = e^{Γ_s(I) − Γ_r(J)} (J < I:
    // <= 1; J = I: e^{span of I}, the one factor that can grow), eStart = e^{Γ_s(I)},
    // eLast = e^{Γ_last − Γ_r(I)}. A sub-chunk whose span passes kSafeSpan is computed directly.
    for (int t = tid; t < (kC / kSub) * D; t += kT) {
      const int I = t / D, dd = t % D;
      const float gs = I == 0 ? 0.0f : G[(I * kSub - 1) * L::ldF + dd];
      const float gr = G[(I * kSub + kSub - 1) * L::ldF + dd];
      eStart[I * D + dd] = __expf(gs);
      eLast[I * D + dd] = __expf(G[(kC - 1) * L::ldF + dd] - gr);
      for (int J = 0; J <= I; ++J)
        cPair[(I * (I + 1) / 2 + J) * D + dd] = __expf(gs - G[(J * kSub + kSub - 1) * L::ldF + dd]);
      if (!(gs - gr <= kSafeSpan)) unsafe[I] = 1;
    }
  }
  __syncthreads();
  auto bf = [](const uint16_t* p) { return __uint_as_float(uint32_t(*p) << 16); };
  // 3. In place k -> Ks = K ⊙ e^{Γ − Γ_s}, q -> Qs = Q ⊙ e^{Γ − Γ_s} (each row scaled to its sub-chunk's
  // start), Kr = K ⊙ e^{Γ_r − Γ} (to its end); out: Q ⊙ e^Γ = Qs ⊙ eStart, KS = Kr ⊙ eLast, the decay.
  if (tid < D) gDec[tid] = __expf(G[(kC - 1) * L::ldF + tid]);
  for (int idx = tid; idx < kC * kC; idx += kT) {
    const int r = idx / kC, c = idx % kC;
    if (c / kSub > r / kSub) gAq[idx] = 0;  // blocks above the diagonal
  }
  for (int idx = tid; idx < kC * D / 2; idx += kT) {
    const int i = idx / (D / 2), d = 2 * (idx % (D / 2)), I = i / kSub;
    const float2 Gi = *reinterpret_cast<const float2*>(G + i * L::ldF + d);
    const float2 gr = *reinterpret_cast<const float2*>(G + (I * kSub + kSub - 1) * L::ldF + d);
    const float2 gs = I == 0 ? make_float2(0.0f, 0.0f) : *reinterpret_cast<const float2*>(G + (I * kSub - 1) * L::ldF + d);
    const float2 es = *reinterpret_cast<const float2*>(eStart + I * D + d);
    const float2 el = *reinterpret_cast<const float2*>(eLast + I * D + d);
    const float f0 = __expf(Gi.x - gs.x), f1 = __expf(Gi.y - gs.y);
    const float fr0 = __expf(gr.x - Gi.x), fr1 = __expf(gr.y - Gi.y);
    uint32_t* kp = reinterpret_cast<uint32_t*>(Kb + i * L::ldD + d);
    uint32_t* qp = reinterpret_cast<uint32_t*>(Qb + i * L::ldD + d);
    const uint32_t kk = *kp, qq = *qp;
    *kp = pack_bf16x2(bf16_lo(kk) * f0, bf16_hi(kk) * f1);
    *qp = pack_bf16x2(bf16_lo(qq) * f0, bf16_hi(qq) * f1);
    *reinterpret_cast<uint32_t*>(Kr + i * L::ldD + d) = pack_bf16x2(bf16_lo(kk) * fr0, bf16_hi(kk) * fr1);
    *reinterpret_cast<uint32_t*>(gWQ + (kC + i) * D + d) =
        pack_bf16x2(bf16_lo(qq) * f0 * es.x, bf16_hi(qq) * f1 * es.y);
    *reinterpret_cast<uint32_t*>(gKS + i * D + d) =
        pack_bf16x2(bf16_lo(kk) * fr0 * el.x, bf16_hi(kk) * fr1 * el.y);
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
    const uint16_t* X = isQ ? Qb : Kb;  // Qs / Ks
    const float* cp = cPair + p * D;
    const int ra = I * kSub + gq, rb = ra + 8;
    float acc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int c0 = ks * 16 + 2 * tq;
      const float2 c2a = *reinterpret_cast<const float2*>(cp + c0), c2b = *reinterpret_cast<const float2*>(cp + c0 + 8);
      auto el2 = [&](int r, int c, float2 cc) {  // xs[r][c..c+1] ⊙ e^{Γ_s(I) − Γ_r(J)}, packed
        const uint32_t xx = *reinterpret_cast<const uint32_t*>(X + r * L::ldD + c);
        return pack_bf16x2(bf16_lo(xx) * cc.x, bf16_hi(xx) * cc.y);
      };
      uint32_t a[4];
      a[0] = el2(ra, c0, c2a);
      a[1] = el2(rb, c0, c2a);
      a[2] = el2(ra, c0 + 8, c2b);
      a[3] = el2(rb, c0 + 8, c2b);
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
      const float* X = isQ ? q : k;  // the inputs again (rare: never with K3's bounded gate)
      float s = 0;
      if (c <= r && r < len)
        for (int d = 0; d < D; ++d)
          s = fmaf(X[((r0 + r) * H + h) * D + d] * k[((r0 + c) * H + h) * D + d],
                   expf(G[r * L::ldF + d] - G[c * L::ldF + d]), s);
      if (isQ)
        gAq[r * kC + c] = to_bf16_bits(c <= r ? s : 0.0f);
      else
        Lm[r * L::ldL + c] = c < r ? bt[r] * s : 0.0f;
    }
  }
  __syncthreads();
  // 5. The right-hand sides, token-major: β ⊙ K ⊙ e^Γ = β ⊙ Ks ⊙ eStart in place of Ks, β ⊙ V where
  // Qs was.
  for (int idx = tid; idx < kC * D / 2; idx += kT) {
    const int i = idx / (D / 2), d = 2 * (idx % (D / 2));
    const float2 es = *reinterpret_cast<const float2*>(eStart + (i / kSub) * D + d);
    uint32_t* kp = reinterpret_cast<uint32_t*>(KG + i * L::ldD + d);
    const uint32_t kk = *kp;
    *kp = pack_bf16x2(bt[i] * bf16_lo(kk) * es.x, bt[i] * bf16_hi(kk) * es.y);
  }
  {
    float4 vv[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) vv[u] = load4(v, tid + u * kT);
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = tid + u * kT;
      if (idx >= N4) continue;
      const float b = bt[idx / V4];
      store_bf16x4(Vb, idx, make_float4(b * vv[u].x, b * vv[u].y, b * vv[u].z, b * vv[u].w));
    }
  }
  __syncthreads();  // Γ is dead from here: T takes its space
  // 6. T = (I + L)^-1 in fp32 by 16 × 16 blocks: (a) the diagonal blocks' inverses by forward
  // substitution, one column per 4 lanes; (b) block row I from the rows above:
  // T_IJ = −T_II · Σ_{K=J}^{I−1} L_IK T_KJ. Entries above the diagonal are never read (j >= col).
  {
    const int c = tid >> 2, part = tid & 3, J0 = c & ~(kSub - 1);
    if (part == 0) Tf[c * L::ldL + c] = 1.0f;
    __syncwarp();
    for (int ii = 1; ii < kSub; ++ii) {
      const int i = J0 + ii;
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
  for (int I = 1; I < kC / kSub; ++I) {
    for (int e = tid; e < I * kSub * kSub; e += kT) {
      const int row = I * kSub + (e / kSub) % kSub, col = (e / (kSub * kSub)) * kSub + e % kSub;
      float s = 0;
      for (int j = col; j < I * kSub; ++j) s = fmaf(Lm[row * L::ldL + j], Tf[j * L::ldL + col], s);
      Xs[e] = s;
    }
    __syncthreads();
    for (int e = tid; e < I * kSub * kSub; e += kT) {
      const int r = (e / kSub) % kSub, J = e / (kSub * kSub), cc = e % kSub, row = I * kSub + r;
      float s = 0;
      for (int m = 0; m <= r; ++m) s = fmaf(Tf[row * L::ldL + I * kSub + m], Xs[J * kSub * kSub + m * kSub + cc], s);
      Tf[row * L::ldL + J * kSub + cc] = -s;
    }
    __syncthreads();
  }
  for (int idx = tid; idx < kC * kC; idx += kT) {
    const int i = idx / kC, j = idx % kC;
    Tb[i * kLdC + j] = to_bf16_bits(j <= i ? Tf[i * L::ldL + j] : 0.0f);
  }
  __syncthreads();
  // 7. W = T·(β ⊙ K ⊙ e^Γ) (warps 0-3) and U = T·(β ⊙ V) (warps 4-7), 16 rows each, in two halves
  // of the columns (register budget of two blocks per multiprocessor).
  {
    const bool isU = warp >= 4;
    const int m0 = (warp & 3) * 16;
    const uint16_t* B = isU ? Vb : KG;
    uint16_t* out = isU ? gU : gWQ;
    constexpr int HALVES = D >= 32 ? 2 : 1, NTH = D / 8 / HALVES;  // n-tiles per half (even)
#pragma unroll 1
    for (int half = 0; half < HALVES; ++half) {
      float acc[NTH][4] = {};
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        uint32_t a[4];
        frag_a(a, Tb, kLdC, m0, ks * 16, lane);
        mma_row_kmajor(acc, a, B, L::ldD, half * NTH * 8, ks * 16, lane);
      }
#pragma unroll
      for (int nt = 0; nt < NTH; ++nt) {
        const int c = (half * NTH + nt) * 8 + 2 * tq;
        *reinterpret_cast<uint32_t*>(out + (m0 + gq) * D + c) = pack_bf16x2(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<uint32_t*>(out + (m0 + gq + 8) * D + c) = pack_bf16x2(acc[nt][2], acc[nt][3]);
      }
    }
  }
}

// ---------------------------------------------------------------- scan
// A stage (bf16 elements): [W; Q ⊙ e^Γ] (2C × D), KS (C × D), Aqk (C × C), this block's columns of U
// (C × NS), then the decay (D fp32). kStages of them: chunk i + 2 arrives while chunk i computes.
constexpr int kStages = 3;
template <int D, int NS>
struct ScanSmem {
  static constexpr int ldD = D + 8, ldU = NS + 8;
  static constexpr int oKS = 2 * kC * ldD, oAq = oKS + kC * ldD, oU = oAq + kC * kLdC, oDec = oU + kC * ldU;
  static constexpr int stage = oDec + 2 * D;
  // Then the state's bf16 copy St [D][NS+8] and δ [C][NS+8], both k-major B operands (ldmatrix .trans).
  static constexpr int oSt = kStages * stage, oDt = oSt + D * ldU;
  static constexpr int bytes = (oDt + kC * ldU) * 2;
  static_assert(oU % 8 == 0 && oDec % 8 == 0 && stage % 8 == 0 && ldU % 8 == 0, "cp.async needs 16-byte rows");
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
  uint16_t *St = sh + L::oSt, *Ds = sh + L::oDt;
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
  auto put_st = [&](int u) {  // its bf16 copy St[d][c]: the B operand of W·S and Q·S
    const int d = 16 * (warp + 8 * u) + gq;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c = 8 * nt + 2 * tq;
      *reinterpret_cast<uint32_t*>(St + d * L::ldU + c) = pack_bf16x2(S[u][nt][0], S[u][nt][1]);
      *reinterpret_cast<uint32_t*>(St + (d + 8) * L::ldU + c) = pack_bf16x2(S[u][nt][2], S[u][nt][3]);
    }
  };
  // Each accumulator element's place in the fp32 state: f(element, index into Sh).
  auto each_state = [&](auto&& f) {
#pragma unroll
    for (int u = 0; u < KTW; ++u) {
      if (warp + 8 * u >= KT) continue;
      const int d = 16 * (warp + 8 * u) + gq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = c0 + 8 * nt + 2 * tq;
        f(S[u][nt][0], d * D + c);
        f(S[u][nt][1], d * D + c + 1);
        f(S[u][nt][2], (d + 8) * D + c);
        f(S[u][nt][3], (d + 8) * D + c + 1);
      }
    }
  };
  each_state([&](float& x, int i) { x = Sh[i]; });
#pragma unroll
  for (int u = 0; u < KTW; ++u)
    if (warp + 8 * u < KT) put_st(u);
  auto rec_of = [&](int64_t ci) { return work + ((base + ci) * H + h) * Rec<D>::bytes; };
  auto load_stage = [&](int64_t ci, int buf) {
    const uint16_t* gWQ = reinterpret_cast<const uint16_t*>(rec_of(ci));
    const uint16_t *gAq = gWQ + Rec<D>::wq + Rec<D>::ks, *gU = gAq + Rec<D>::aq, *gDec = gU + Rec<D>::u;
    uint16_t* s0 = sh + buf * L::stage;
    static_assert(L::oKS == 2 * kC * L::ldD && Rec<D>::wq == 2 * kC * D, "KS follows W and Q rows");
    for (int e = tid; e < kC * (NS / 8); e += kT) {
      const int r = e / (NS / 8), cc = e % (NS / 8);
      cp_async16(s0 + L::oU + r * L::ldU + cc * 8, gU + r * D + c0 + cc * 8);
    }
    for (int e = tid; e < D / 4; e += kT) cp_async16(s0 + L::oDec + 8 * e, gDec + 8 * e);
    for (int e = tid; e < 3 * kC * (D / 8); e += kT) {  // W, Q ⊙ e^Γ and KS: 3C rows of D, adjacent in both
      const int r = e / (D / 8), cc = e % (D / 8);
      cp_async16(s0 + r * L::ldD + cc * 8, gWQ + r * D + cc * 8);
    }
    for (int e = tid; e < kC * (kC / 8); e += kT) {
      const int r = e / (kC / 8), cc = e % (kC / 8);
      cp_async16(s0 + L::oAq + r * kLdC + cc * 8, gAq + r * kC + cc * 8);
    }
  };
  // Always one commit group per chunk (empty past the end), so "all but the newest kStages − 2 groups
  // done" means "this chunk's stage has landed".
  for (int p = 0; p < kStages - 1; ++p) {
    if (p < nch) load_stage(p, p);
    cp_async_commit();
  }

  for (int64_t ci = 0; ci < nch; ++ci) {
    const int buf = int(ci % kStages);
    const int64_t row0 = r0 + ci * kC;
    const int len = int(min(int64_t(kC), r1 - row0));
    cp_async_wait_group<kStages - 2>();
    __syncthreads();  // this chunk's operands and St are visible; the stage chunk ci − 1 used is free
    if (ci + kStages - 1 < nch) load_stage(ci + kStages - 1, int((ci + kStages - 1) % kStages));
    cp_async_commit();
    const uint16_t* WQs = sh + buf * L::stage;
    const uint16_t *KSs = WQs + L::oKS, *Aqs = WQs + L::oAq, *Us = WQs + L::oU;
    const float* decs = reinterpret_cast<const float*>(WQs + L::oDec);
    uint32_t ur[NT][2] = {};  // U (warps 0-3's token rows)
    if (warp < 4)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * tq, i = 16 * warp + gq;
        ur[nt][0] = *reinterpret_cast<const uint32_t*>(Us + i * L::ldU + c);
        ur[nt][1] = *reinterpret_cast<const uint32_t*>(Us + (i + 8) * L::ldU + c);
      }
    float dec[KTW][2];
#pragma unroll
    for (int u = 0; u < KTW; ++u) {
      const int d = min(16 * (warp + 8 * u) + gq, D - 9);
      dec[u][0] = decs[d];
      dec[u][1] = decs[d + 8];
    }
    // (a) P = [W; Q ⊙ e^Γ]·S0: warp w's 16 rows.
    float P[NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      frag_a(a, WQs, L::ldD, 16 * warp, 16 * ks, lane);
      mma_row_kmajor(P, a, St, L::ldU, 0, 16 * ks, lane);
    }
    // (b) δ = U − W·S0 (warps 0-3), in bf16: Ds[i][c].
    if (warp < 4) {
      const int i = 16 * warp + gq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * tq;
        *reinterpret_cast<uint32_t*>(Ds + i * L::ldU + c) =
            pack_bf16x2(bf16_lo(ur[nt][0]) - P[nt][0], bf16_hi(ur[nt][0]) - P[nt][1]);
        *reinterpret_cast<uint32_t*>(Ds + (i + 8) * L::ldU + c) =
            pack_bf16x2(bf16_lo(ur[nt][1]) - P[nt][2], bf16_hi(ur[nt][1]) - P[nt][3]);
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
        mma_row_kmajor(P, a, Ds, L::ldU, 0, 16 * ks, lane);
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
    // (d) S = Diag(e^{Γ_last})·S0 + KSᵀ·δ (KS = K ⊙ e^{Γ_last − Γ}), then its bf16 copy.
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
        frag_a_kmajor(a, KSs, L::ldD, 16 * (warp + 8 * u), 16 * ks, lane);  // KSᵀ: m = key row, k = token
        mma_row_kmajor(S[u], a, Ds, L::ldU, 0, 16 * ks, lane);
      }
      put_st(u);
    }
  }
  each_state([&](float& x, int i) { Sh[i] = x; });
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

template <int D, int NS>
void launch_scan(const VarlenDev& b, const Win& w, int64_t H, const void* work, float* S_pool, float* o, Stream s) {
  using Q = ScanSmem<D, NS>;
  static_assert(Q::bytes <= kMaxSmem, "shared memory");
  static const bool attr =
      cudaFuncSetAttribute(kda_tc_scan_kernel<D, NS>, cudaFuncAttributeMaxDynamicSharedMemorySize, Q::bytes) ==
      cudaSuccess;
  if (!attr) fail("kda_chunked_tc_varlen: this GPU cannot give " + std::to_string(Q::bytes) + " bytes of shared memory");
  launch(kda_tc_scan_kernel<D, NS>, dim3(unsigned(D / NS), unsigned(H), unsigned(w.nz)), kT, Q::bytes, s, b.cu_rows,
         b.slots, int(b.n_slots), w, H, static_cast<const uint8_t*>(work), S_pool, o);
}

template <int D>
void run_tc(const float* q, const float* k, const float* v, const float* g, const float* beta, const VarlenDev& b,
            const int32_t* cu_host, int64_t H, float* S_pool, float* o, void* work, int64_t work_chunks, Stream s) {
  using P = PrepSmem<D>;
  static_assert(P::bytes <= kMaxSmem, "shared memory");
  static const bool attr =
      cudaFuncSetAttribute(kda_tc_prep_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, P::bytes) ==
          cudaSuccess &&
      cudaFuncSetAttribute(kda_tc_prep_kernel<D>, cudaFuncAttributePreferredSharedMemoryCarveout, 100) == cudaSuccess;
  if (!attr) fail("kda_chunked_tc_varlen: this GPU cannot give " + std::to_string(P::bytes) + " bytes of shared memory");
  for (const Win& w : windows(cu_host, b.n_seqs, work_chunks)) {
    int64_t chunks = 0;
    for (int y = w.z0; y < w.z0 + w.nz; ++y) {
      const int64_t a = std::max<int64_t>(cu_host[y], w.lo), e = std::max(a, std::min<int64_t>(cu_host[y + 1], w.hi));
      chunks += (e - a + kC - 1) / kC;
    }
    if (chunks == 0) continue;
    launch(kda_tc_prep_kernel<D>, dim3(unsigned(chunks), unsigned(H)), kT, P::bytes, s, q, k, v, g, beta, b.cu_rows, w,
           H, static_cast<uint8_t*>(work));
    // The scan's blocks are (value-column slice, head, sequence): 32 columns each, or 16 when that
    // would leave SMs idle (few heads and sequences: a chunk's step is then latency, not throughput).
    if constexpr (D >= 32) {
      if ((D / 32) * H * w.nz >= sm_count()) {
        launch_scan<D, 32>(b, w, H, work, S_pool, o, s);
        continue;
      }
    }
    launch_scan<D, 16>(b, w, H, work, S_pool, o, s);
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
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                        static_cast<const void*>(g), static_cast<const void*>(work)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
      fail("kda_chunked_tc_varlen: q, k, v, g and the workspace must be 16-byte aligned (float4 loads)");
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
