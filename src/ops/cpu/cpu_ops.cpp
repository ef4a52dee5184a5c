// CPU ops of ops.h other than matmul (gemm.cpp) and KDA (kda.cpp): norms, elementwise, short conv,
// MLA attention, router, AttnRes. Each op dispatches on cpu_isa(): at the SIMD levels a threaded
// driver here calls the per-ISA kernels of attn_kernels.h (work split so that every output is
// computed by one kernel call: results do not depend on the thread count); at the scalar level
// the plain loops below run (fp32 with fp64 accumulation of long sums).
// Must not: change results beyond fp32 rounding versus the fp64 twins in ops/reference.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/attn_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/scalar_dot.h"
#include "ops/cpu/scratch.h"
#include "ops/ops.h"

namespace k3::ops {

namespace {
// Below this many multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 18;

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// SIMD levels: elementwise ops are split into blocks of about this many elements, and run in
// parallel only above kElemParallelMin elements (a parallel region costs a few microseconds).
constexpr int64_t kElemBlock = 8192;
constexpr int64_t kElemParallelMin = int64_t(1) << 16;

// Calls fn(i0, i1) over [0, n) in blocks of `block`, in parallel when n * cost >= kElemParallelMin.
template <class Fn>
void for_blocks(int64_t n, int64_t block, int64_t cost, Fn&& fn) {
  block = std::max<int64_t>(1, block);
  const int64_t nb = (n + block - 1) / block;
  par::parallel_for_each(
      nb, [&](int64_t b) { fn(b * block, std::min(n, (b + 1) * block)); }, nb > 1 && n * cost >= kElemParallelMin);
}
}  // namespace

void rmsnorm(Exec ex, const float* x, int64_t T, int64_t n, const float* w, float eps, float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex)) {
    return for_blocks(T, kElemBlock / std::max<int64_t>(n, 1), n,
                      [&](int64_t r0, int64_t r1) { kern->rmsnorm_rows(x, r0, r1, n, w, eps, out); });
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xt[i]) * xt[i];
    const float inv = float(1.0 / std::sqrt(ss / double(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = (w ? w[i] : 1.0f) * (xt[i] * inv);
  }
}

void l2norm_scale(Exec ex, float* x, int64_t rows, int64_t n, float eps, float scale) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex)) {
    return for_blocks(rows, kElemBlock / std::max<int64_t>(n, 1), n,
                      [&](int64_t r0, int64_t r1) { kern->l2norm_rows(x, r0, r1, n, eps, scale); });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float f = float(double(scale) / std::sqrt(ss + eps));
    for (int64_t i = 0; i < n; ++i) xr[i] *= f;
  }
}

void situ_glu(Exec ex, const float* g, const float* u, int64_t n, float b1, float b2, float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex)) {
    return for_blocks(n, kElemBlock, 8, [&](int64_t i0, int64_t i1) { kern->situ_glu(g, u, i0, i1, b1, b2, out); });
  }
  for (int64_t i = 0; i < n; ++i) {
    const float a = b1 > 0 ? b1 * std::tanh(g[i] / b1) : g[i], c = b2 > 0 ? b2 * std::tanh(u[i] / b2) : u[i];
    out[i] = a * sigmoidf(g[i]) * c;
  }
}

void short_conv_silu(Exec ex, const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state,
                     float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex); kern && K >= 1 && K <= 16) {
    // One token (decode): straight from the [C, K] weights and [C, K-1] state, no transposes.
    if (T == 1) return kern->short_conv_step(x, C, w, K, state, 0, C, out);
    // Transposed weights [K, C] and history [K-1, C] so the kernel runs along channels.
    const int64_t P = K - 1;
    float* const wT = cpu::scratch<float>(cpu::ScratchId::ConvWeightsT, K * C);
    float* const hist = cpu::scratch<float>(cpu::ScratchId::ConvHistory, std::max<int64_t>(P, 1) * C);
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < K; ++j) wT[j * C + c] = w[c * K + j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < P; ++j) hist[j * C + c] = state[c * P + j];
    for_blocks(C, std::max<int64_t>(64, kElemBlock / std::max<int64_t>(T * K, 1)) / 64 * 64, T * K,
               [&](int64_t c0, int64_t c1) { kern->short_conv_silu(x, T, C, wT, K, hist, c0, c1, out); });
    // The new state: the last K-1 inputs of the window [hist | x], oldest first.
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < P; ++j) {
        const int64_t idx = T + j;
        state[c * P + j] = idx < P ? hist[idx * C + c] : x[(idx - P) * C + c];
      }
    return;
  }
  const int64_t P = K - 1;
  par::parallel_for(
      C, par::balanced_grain(C),
      [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          float win[16];  // K <= 16 enforced by the model binding
          for (int64_t j = 0; j < P; ++j) win[j] = state[c * P + j];
          const float* wc = w + c * K;
          for (int64_t t = 0; t < T; ++t) {
            win[P] = x[t * C + c];
            float acc = 0;
            for (int64_t j = 0; j < K; ++j) acc += wc[j] * win[j];
            out[t * C + c] = acc * sigmoidf(acc);
            for (int64_t j = 0; j < P; ++j) win[j] = win[j + 1];
          }
          for (int64_t j = 0; j < P; ++j) state[c * P + j] = win[j];
        }
      },
      C * T * K > kParallelMin);
}

void kda_gate(Exec ex, const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
              float lower_bound, float* g) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex)) {
    float* const a = cpu::scratch<float>(cpu::ScratchId::KdaGateA, H);
    for (int64_t h = 0; h < H; ++h) a[h] = std::exp(A_log[h]);
    return for_blocks(T * H, kElemBlock / std::max<int64_t>(D, 1), D * 8,
                      [&](int64_t r0, int64_t r1) { kern->kda_gate(f, r0, r1, H, D, a, dt_bias, lower_bound, g); });
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = t * H * D + h * D + d;
        const float x = f[i] + dt_bias[h * D + d];
        g[i] = lower_bound != 0 ? lower_bound * sigmoidf(a * x) : -a * (x > 20.0f ? x : std::log1p(std::exp(x)));
      }
    }
}

namespace {
// In-place softmax of n scores (max-subtracted), returns nothing; fp32 with double normaliser.
void softmax(float* sc, int64_t n) {
  float m = sc[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, sc[i]);
  double z = 0;
  for (int64_t i = 0; i < n; ++i) z += (sc[i] = std::exp(sc[i] - m));
  const float inv = float(1.0 / z);
  for (int64_t i = 0; i < n; ++i) sc[i] *= inv;
}
}  // namespace

namespace {
// ---- MLA at the SIMD levels ------------------------------------------------------------------
// Attention runs over "groups" of query rows that share their keys (absorbed: the heads of one
// token, which all read the same latent cache; expanded: consecutive tokens of one head). When
// there are few groups (decode) the keys are also split into parts so that every thread has work;
// each (group, part) runs an online softmax (cpu::AttendPart) and the parts are merged in order.
// The split depends only on the shapes, never on the thread count.
constexpr int64_t kAbsorbedHeadGroup = 16;
constexpr int64_t kExpandedTokenGroup = 8;
constexpr int64_t kTiledTokenGroup = 32;  // query rows (consecutive tokens of one head) per tiled item
// mla_tiled_pays weighs the tiled form's multiply-adds by this: the absorbed kernels' rate over the
// tiled kernels' (k3_ops_bench, docs/data/cpu-ops-bench.txt: within ~10% of each other either way).
constexpr double kTiledCostWeight = 1.0;
constexpr int64_t kMinItems = 64;      // split keys into parts until there are this many items
constexpr int64_t kMinPartKeys = 512;  // ... but never below this many keys per part

// setup(g, a) fills rows, q1/q2, k1/k2, val/vdim, lim and scale of group g; dst(g) is where the
// normalised outputs of its rows go (row stride ldo).
template <class Setup, class Dst>
void attend_groups(const cpu::AttnKernels& kern, int64_t n_groups, int64_t max_rows, int64_t S, int64_t vdim,
                   int64_t work, Setup&& setup, Dst&& dst, int64_t ldo) {
  int64_t np = 1;
  if (n_groups < kMinItems)
    np = std::clamp((kMinItems + n_groups - 1) / n_groups, int64_t(1), (S + kMinPartKeys - 1) / kMinPartKeys);
  const int64_t sp = std::max<int64_t>(1, (S + np - 1) / np);
  np = std::max<int64_t>(1, (S + sp - 1) / sp);
  const int64_t items = n_groups * np;
  float *pacc = nullptr, *pm = nullptr, *pz = nullptr;
  if (np > 1) {
    pacc = cpu::scratch<float>(cpu::ScratchId::AttnPartAcc, items * max_rows * vdim);
    pm = cpu::scratch<float>(cpu::ScratchId::AttnPartM, items * max_rows);
    pz = cpu::scratch<float>(cpu::ScratchId::AttnPartZ, items * max_rows);
  }
  const bool parallel = items > 1 && work >= kParallelMin;
  const auto buffers = [&] {
    return std::array<float*, 3>{cpu::scratch<float>(cpu::ScratchId::AttnBlock, max_rows * (K3_ATT_BLOCK + 4)),
                                 cpu::scratch<float>(cpu::ScratchId::AttnM, max_rows),
                                 cpu::scratch<float>(cpu::ScratchId::AttnZ, max_rows)};
  };
  par::parallel_for_each_setup(
      items, buffers,
      [&](int64_t it) {
        const auto [scratch, m, z] = buffers();
        const int64_t gi = it / np, p = it % np;
        cpu::AttendPart a;
        setup(gi, a);
        a.s0 = p * sp;
        a.s1 = std::min(S, a.s0 + sp);
        a.scratch = scratch;
        if (np == 1) {
          a.m = m;
          a.z = z;
          a.acc = dst(gi);
          a.ldacc = ldo;
          kern.attend_part(a);
          for (int64_t r = 0; r < a.rows; ++r) {
            const float inv = z[r] > 0 ? 1.0f / z[r] : 0.0f;
            float* o = a.acc + r * ldo;
            for (int64_t j = 0; j < vdim; ++j) o[j] *= inv;
          }
        } else {
          a.m = pm + it * max_rows;
          a.z = pz + it * max_rows;
          a.acc = pacc + it * max_rows * vdim;
          a.ldacc = vdim;
          kern.attend_part(a);
        }
      },
      parallel);
  if (np > 1) {
    par::parallel_for_each(
        n_groups,
        [&](int64_t gi) {
          cpu::AttendPart a;
          setup(gi, a);
          float* out = dst(gi);
          for (int64_t r = 0; r < a.rows; ++r) {
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t p = 0; p < np; ++p) mx = std::max(mx, pm[(gi * np + p) * max_rows + r]);
            double zt = 0;
            for (int64_t p = 0; p < np; ++p) {
              const int64_t i = (gi * np + p) * max_rows + r;
              if (pz[i] > 0) zt += double(pz[i]) * std::exp(double(pm[i]) - mx);
            }
            float* o = out + r * ldo;
            std::fill(o, o + vdim, 0.0f);
            for (int64_t p = 0; p < np; ++p) {
              const int64_t i = (gi * np + p) * max_rows + r;
              if (!(pz[i] > 0)) continue;
              const float wgt = float(std::exp(double(pm[i]) - mx) / zt);
              const float* src = pacc + ((gi * np + p) * max_rows + r) * vdim;
              for (int64_t j = 0; j < vdim; ++j) o[j] += wgt * src[j];
            }
          }
        },
        parallel);
  }
}

void mla_expanded_simd(const cpu::AttnKernels& kern, const float* q, int64_t T, const float* k_nope, const float* k_r,
                       const float* v, int64_t S, int64_t pos0, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope, TG = kExpandedTokenGroup, ntg = (T + TG - 1) / TG;
  int64_t* const lim = cpu::scratch<int64_t>(cpu::ScratchId::MlaLimits, T);
  for (int64_t t = 0; t < T; ++t) lim[t] = std::min(S, pos0 + t + 1);
  auto setup = [&](int64_t gi, cpu::AttendPart& a) {
    const int64_t h = gi / ntg, t0 = (gi % ntg) * TG;
    a.rows = std::min(TG, T - t0);
    a.q1 = q + (t0 * d.heads + h) * dq;
    a.ldq1 = d.heads * dq;
    a.k1dim = d.nope;
    a.q2 = a.q1 + d.nope;
    a.ldq2 = a.ldq1;
    a.k2dim = d.rope;
    a.k1 = k_nope + h * d.nope;
    a.ldk1 = d.heads * d.nope;
    a.k2 = k_r;
    a.ldk2 = d.rope;
    a.val = v + h * d.v;
    a.ldv = d.heads * d.v;
    a.vdim = d.v;
    a.lim = lim + t0;
    a.scale = d.scale;
  };
  auto dst = [&](int64_t gi) { return out + ((gi % ntg) * TG * d.heads + gi / ntg) * d.v; };
  attend_groups(kern, d.heads * ntg, TG, S, d.v, T * S * d.heads * (dq + d.v), setup, dst, d.heads * d.v);
}

// Rows [r0, r0 + n) of W decoded to fp32 (vector kernels for F32/F16/BF16, dequant_row for MXFP4).
void decode_rows(const cpu::AttnKernels& kern, const WeightMat& W, int64_t r0, int64_t n, float* out) {
  const int fmt = W.fmt == WFormat::F32 ? 0 : W.fmt == WFormat::F16 ? 1 : W.fmt == WFormat::BF16 ? 2 : -1;
  if (fmt >= 0) return kern.widen_rows(W.data, fmt, W.cols, r0, n, out);
  for (int64_t i = 0; i < n; ++i) dequant_row(W, r0 + i, out + i * W.cols);
}

// The latent cache as the absorbed kernels read it: contiguous c [S, kv_lora] and k_r [S, rope], or
// pages of interleaved rows (c then k_r per token).
struct Latent {
  const float* c = nullptr;
  const float* kr = nullptr;
  const float* const* pages = nullptr;
  int64_t P = 0, stride = 0, L = 0, rope = 0;
  const float* c_at(int64_t s) const { return pages ? pages[s / P] + (s % P) * stride : c + s * L; }
  const float* kr_at(int64_t s) const { return pages ? pages[s / P] + (s % P) * stride + L : kr + s * rope; }
};

void mla_absorbed_simd(const cpu::AttnKernels& kern, const float* q, int64_t T, const Latent& lat, int64_t S,
                       int64_t pos0, const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope, per_head = d.nope + d.v, L = d.kv_lora, H = d.heads;
  const int64_t HG = kAbsorbedHeadGroup, nhg = (H + HG - 1) / HG;
  // Tokens in blocks whose latent queries / contexts ([Tb, H, L] each) stay within ~16 MB.
  const int64_t TB = std::clamp<int64_t>((int64_t(1) << 22) / std::max<int64_t>(H * L, 1), 1, std::max<int64_t>(T, 1));
  float* const Qt = cpu::scratch<float>(cpu::ScratchId::MlaQt, std::min(TB, T) * H * L);
  float* const Ch = cpu::scratch<float>(cpu::ScratchId::MlaCh, std::min(TB, T) * H * L);
  int64_t* const lim = cpu::scratch<int64_t>(cpu::ScratchId::MlaLimits, std::min(TB, T) * HG);
  const bool par_heads = H > 1 && H * per_head * L >= (int64_t(1) << 16);
  for (int64_t tb0 = 0; tb0 < T; tb0 += TB) {
    const int64_t Tb = std::min(TB, T - tb0);
    // A: q̃[t,h] = W_UK_hᵀ q_nope[t,h]; W_UK_h decoded once for the block's tokens.
    const auto w_uk = [&] { return cpu::scratch<float>(cpu::ScratchId::MlaW, std::max(d.nope, d.v) * L); };
    par::parallel_for_each_setup(
        H, w_uk,
        [&](int64_t h) {
          float* const W = w_uk();
          decode_rows(kern, kv_b, h * per_head, d.nope, W);
          kern.gemm_nn(Tb, L, d.nope, q + (tb0 * H + h) * dq, H * dq, W, L, Qt + h * L, H * L, 0, nullptr);
        },
        par_heads);
    // B: softmax attention of each token's heads over the shared latent cache, in latent space.
    for (int64_t t = 0; t < Tb; ++t)
      for (int64_t r = 0; r < HG; ++r) lim[t * HG + r] = std::min(S, pos0 + tb0 + t + 1);
    auto setup = [&](int64_t gi, cpu::AttendPart& a) {
      const int64_t t = gi / nhg, h0 = (gi % nhg) * HG;
      a.rows = std::min(HG, H - h0);
      a.q1 = Qt + (t * H + h0) * L;
      a.ldq1 = L;
      a.k1dim = L;
      a.q2 = q + ((tb0 + t) * H + h0) * dq + d.nope;
      a.ldq2 = dq;
      a.k2dim = d.rope;
      if (lat.pages) {
        a.pages = lat.pages;
        a.page_tokens = lat.P;
        a.ldk1 = a.ldk2 = a.ldv = lat.stride;
        a.k2_off = L;
      } else {
        a.k1 = lat.c;
        a.ldk1 = L;
        a.k2 = lat.kr;
        a.ldk2 = d.rope;
        a.val = lat.c;
        a.ldv = L;
      }
      a.vdim = L;
      a.lim = lim + t * HG;
      a.scale = d.scale;
    };
    auto dst = [&](int64_t gi) { return Ch + ((gi / nhg) * H + (gi % nhg) * HG) * L; };
    attend_groups(kern, Tb * nhg, HG, S, L, Tb * S * H * (2 * L + d.rope), setup, dst, L);
    // C: a[t,h] = W_UV_h ĉ[t,h]; W_UV_h decoded once for the block's tokens. One token (decode):
    // a GEMV straight from the stored rows (fp32 products, whatever the step's numerics), without
    // widening W_UV to a buffer first.
    if (Tb == 1) {
      par::parallel_for_each(
          H,
          [&](int64_t h) {
            matmul(kF32, rows_of(kv_b, h * per_head + d.nope, d.v), Ch + h * L, 1, out + (tb0 * H + h) * d.v);
          },
          par_heads);
      continue;
    }
    par::parallel_for_each_setup(
        H, w_uk,
        [&](int64_t h) {
          float* const W = w_uk();
          decode_rows(kern, kv_b, h * per_head + d.nope, d.v, W);
          kern.gemm_nt(Tb, d.v, L, Ch + h * L, H * L, W, L, out + (tb0 * H + h) * d.v, H * d.v, 1.0f);
        },
        par_heads);
  }
}
}  // namespace

void mla_attend_expanded(Exec ex, const float* q, int64_t T, const float* k_nope, const float* k_r, const float* v,
                         int64_t S, int64_t pos0, const MlaAttnDims& d, float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex))
    return mla_expanded_simd(*kern, q, T, k_nope, k_r, v, S, pos0, d, out);
  const int64_t dq = d.nope + d.rope;
  par::parallel_for_each(
      d.heads * T,
      [&](int64_t ht) {
        const int64_t h = ht / T, t = ht % T;
        const int64_t n = std::min(S, pos0 + t + 1);
        std::vector<float> sc(static_cast<size_t>(n));
        const float* qh = q + (t * d.heads + h) * dq;
        for (int64_t s = 0; s < n; ++s)
          sc[size_t(s)] = (dot_f64acc(qh, k_nope + (s * d.heads + h) * d.nope, d.nope) +
                           dot_f64acc(qh + d.nope, k_r + s * d.rope, d.rope)) *
                          d.scale;
        softmax(sc.data(), n);
        float* oh = out + (t * d.heads + h) * d.v;
        std::fill(oh, oh + d.v, 0.0f);
        for (int64_t s = 0; s < n; ++s) {
          const float* vs = v + (s * d.heads + h) * d.v;
          for (int64_t j = 0; j < d.v; ++j) oh[j] += sc[size_t(s)] * vs[j];
        }
      },
      T * S * d.heads * (d.nope + d.v) > kParallelMin);
}

namespace {
void mla_absorbed(Exec ex, const float* q, int64_t T, const Latent& lat, int64_t S, int64_t pos0, const WeightMat& kv_b,
                  const MlaAttnDims& d, float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex))
    return mla_absorbed_simd(*kern, q, T, lat, S, pos0, kv_b, d, out);
  const int64_t dq = d.nope + d.rope, per_head = d.nope + d.v, L = d.kv_lora;
  par::parallel_for_each(
      d.heads,
      [&](int64_t h) {
        // This head's W_UK [nope, L] and W_UV [v, L], decoded once for all T queries.
        std::vector<float> wuk(static_cast<size_t>(d.nope * L)), wuv(static_cast<size_t>(d.v * L)),
            qt(static_cast<size_t>(L)), ch(static_cast<size_t>(L));
        for (int64_t i = 0; i < d.nope; ++i) dequant_row(kv_b, h * per_head + i, wuk.data() + i * L);
        for (int64_t j = 0; j < d.v; ++j) dequant_row(kv_b, h * per_head + d.nope + j, wuv.data() + j * L);
        std::vector<float> sc(static_cast<size_t>(S));
        for (int64_t t = 0; t < T; ++t) {
          const float* qh = q + (t * d.heads + h) * dq;
          std::fill(qt.begin(), qt.end(), 0.0f);
          for (int64_t i = 0; i < d.nope; ++i)
            for (int64_t l = 0; l < L; ++l) qt[size_t(l)] += wuk[size_t(i * L + l)] * qh[i];
          const int64_t n = std::min(S, pos0 + t + 1);
          for (int64_t s = 0; s < n; ++s)
            sc[size_t(s)] =
                (dot_f64acc(qt.data(), lat.c_at(s), L) + dot_f64acc(qh + d.nope, lat.kr_at(s), d.rope)) * d.scale;
          softmax(sc.data(), n);
          std::fill(ch.begin(), ch.end(), 0.0f);
          for (int64_t s = 0; s < n; ++s) {
            const float* cs = lat.c_at(s);
            for (int64_t l = 0; l < L; ++l) ch[size_t(l)] += sc[size_t(s)] * cs[l];
          }
          float* oh = out + (t * d.heads + h) * d.v;
          for (int64_t j = 0; j < d.v; ++j) oh[j] = dot_f64acc(wuv.data() + j * L, ch.data(), L);
        }
      },
      (T + per_head) * S * d.heads * L > kParallelMin);
}

}  // namespace

void mla_attend_absorbed(Exec ex, const float* q, int64_t T, const float* c, const float* k_r, int64_t S, int64_t pos0,
                         const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
  Latent lat;
  lat.c = c;
  lat.kr = k_r;
  lat.L = d.kv_lora;
  lat.rope = d.rope;
  mla_absorbed(ex, q, T, lat, S, pos0, kv_b, d, out);
}

void mla_attend_absorbed_paged(Exec ex, const float* q, int64_t T, const LatentPages& cache, int64_t S, int64_t pos0,
                               const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
  if (cache.page_tokens < 1 || cache.stride < d.kv_lora + d.rope) fail("MLA: bad latent cache page layout");
  Latent lat;
  lat.pages = cache.pages;
  lat.P = cache.page_tokens;
  lat.stride = cache.stride;
  lat.L = d.kv_lora;
  lat.rope = d.rope;
  mla_absorbed(ex, q, T, lat, S, pos0, kv_b, d, out);
}

int64_t mla_tiled_key_tile(const MlaAttnDims&) {
  // The same for every head count, so a model whose heads are split over ranks (tensor parallel)
  // cuts the keys at the same places and each head's softmax runs its sums in the same order (the
  // split stays bitwise the one-rank model). K3's 96 heads: 256 x 96 x 256 floats = 24 MiB.
  return 4 * K3_ATT_BLOCK;
}

bool mla_tiled_pays(int64_t T, int64_t S, const MlaAttnDims& d) {
  if (T < 2 || S < T) return false;
  const double H = double(d.heads), L = double(d.kv_lora), pos0 = double(S - T);
  const double vis = double(T) * pos0 + double(T) * double(T + 1) / 2;  // causal (query, key) pairs
  const double absorbed = double(T) * H * double(d.nope + d.v) * L + vis * H * (2 * L + double(d.rope));
  const double tiled = double(S) * H * double(d.nope + d.v) * L + vis * H * double(d.nope + d.rope + d.v);
  return tiled * kTiledCostWeight < absorbed;
}

void mla_attend_tiled_paged(Exec ex, const float* q, int64_t T, const LatentPages& cache, int64_t S, int64_t pos0,
                            const WeightMat& kv_b, const MlaAttnDims& d, float* out, int64_t key_tile) {
  if (cache.page_tokens < 1 || cache.stride < d.kv_lora + d.rope) fail("MLA: bad latent cache page layout");
  const int64_t L = d.kv_lora, H = d.heads, R = d.rope, dq = d.nope + R, ph = d.nope + d.v, HV = H * d.v;
  if (kv_b.rows != H * ph || kv_b.cols != L)
    fail("MLA: kv_b_proj is " + std::to_string(kv_b.rows) + " x " + std::to_string(kv_b.cols) + ", expected " +
         std::to_string(H * ph) + " x " + std::to_string(L));
  const cpu::AttnKernels* kern = cpu::attn_kernels(ex);
  if (!kern || T < 1) return mla_attend_absorbed_paged(ex, q, T, cache, S, pos0, kv_b, d, out);
  if (key_tile < 0 || key_tile % K3_ATT_BLOCK != 0)
    fail("MLA: key tile " + std::to_string(key_tile) + " is not a multiple of " + std::to_string(K3_ATT_BLOCK));
  const int64_t KT = key_tile ? key_tile : mla_tiled_key_tile(d), TG = kTiledTokenGroup, ntg = (T + TG - 1) / TG;
  // The tile's latents as rows [n, L] and transposed [L, n], k_r transposed [rope, n]; per head the
  // keys transposed [nope, n] (then the shared k_r rows) and the values [n, v].
  float* const lat = cpu::scratch<float>(cpu::ScratchId::MlaTileLatent, KT * L);
  float* const latT = cpu::scratch<float>(cpu::ScratchId::MlaTileLatentT, L * KT);
  float* const krT = cpu::scratch<float>(cpu::ScratchId::MlaTileRope, R * KT);
  float* const kT = cpu::scratch<float>(cpu::ScratchId::MlaTileKeys, H * d.nope * KT);
  float* const vals = cpu::scratch<float>(cpu::ScratchId::MlaTileValues, H * KT * d.v);
  float* const m = cpu::scratch<float>(cpu::ScratchId::MlaRunM, H * T);  // [head, token]
  float* const z = cpu::scratch<float>(cpu::ScratchId::MlaRunZ, H * T);
  int64_t* const lim = cpu::scratch<int64_t>(cpu::ScratchId::MlaLimits, T);
  std::fill(m, m + H * T, -std::numeric_limits<float>::infinity());
  std::fill(z, z + H * T, 0.0f);
  std::fill(out, out + T * HV, 0.0f);  // the running (unnormalised) sums
  // A head's W_UK [nope, L] and W_UV transposed [L, v], in fp32 (whatever the step's numerics).
  const auto wbuf = [&] { return cpu::scratch<float>(cpu::ScratchId::MlaW, 2 * ph * L); };
  const auto sbuf = [&] { return cpu::scratch<float>(cpu::ScratchId::AttnBlock, TG * (K3_ATT_BLOCK + 4)); };
  for (int64_t s0 = 0; s0 < S; s0 += KT) {
    const int64_t n = std::min(KT, S - s0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = s0 + j;
      const float* src = cache.pages[s / cache.page_tokens] + (s % cache.page_tokens) * cache.stride;
      std::memcpy(lat + j * L, src, size_t(L) * sizeof(float));
      for (int64_t i = 0; i < L; ++i) latT[i * n + j] = src[i];
      for (int64_t i = 0; i < R; ++i) krT[i * n + j] = src[L + i];
    }
    // Expand: k_nope_hᵀ = W_UK_h · cᵀ, v_h = c · W_UV_hᵀ.
    par::parallel_for_each_setup(
        H, wbuf,
        [&](int64_t h) {
          float* const wuk = wbuf();
          float* const wuvT = wuk + d.nope * L;
          float* const wuv = wuvT + L * d.v;
          decode_rows(*kern, kv_b, h * ph, d.nope, wuk);
          decode_rows(*kern, kv_b, h * ph + d.nope, d.v, wuv);
          for (int64_t j = 0; j < d.v; ++j)
            for (int64_t i = 0; i < L; ++i) wuvT[i * d.v + j] = wuv[j * L + i];
          kern->gemm_nn(d.nope, n, L, wuk, L, latT, n, kT + h * d.nope * KT, n, 0, nullptr);
          kern->gemm_nn(n, d.v, L, lat, L, wuvT, d.v, vals + h * KT * d.v, d.v, 0, nullptr);
        },
        n * H * ph * L >= kParallelMin);
    // Query t (absolute position pos0 + t) sees this tile's keys j < pos0 + t + 1 - s0.
    for (int64_t t = 0; t < T; ++t) lim[t] = std::min(S, pos0 + t + 1) - s0;
    const int64_t g0 = std::max<int64_t>(0, s0 - pos0) / TG, ng = ntg - g0;  // groups that see a key
    par::parallel_for_each_setup(
        H * ng, sbuf,
        [&](int64_t it) {
          const int64_t h = it / ng, t0 = (g0 + it % ng) * TG;
          cpu::AttendPart a;
          a.rows = std::min(TG, T - t0);
          a.q1 = q + (t0 * H + h) * dq;
          a.ldq1 = H * dq;
          a.k1dim = d.nope;
          a.q2 = a.q1 + d.nope;
          a.ldq2 = a.ldq1;
          a.k2dim = R;
          a.keys_t = true;
          a.k1 = kT + h * d.nope * KT;
          a.ldk1 = n;
          a.k2 = krT;
          a.ldk2 = n;
          a.val = vals + h * KT * d.v;
          a.ldv = d.v;
          a.vdim = d.v;
          a.lim = lim + t0;
          a.s0 = 0;
          a.s1 = n;
          a.scale = d.scale;
          a.m = m + h * T + t0;
          a.z = z + h * T + t0;
          a.acc = out + (t0 * H + h) * d.v;
          a.ldacc = HV;
          a.scratch = sbuf();
          a.resume = true;
          kern->attend_part(a);
        },
        n * (T - g0 * TG) * H * (dq + d.v) >= kParallelMin);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float zr = z[h * T + t], inv = zr > 0 ? 1.0f / zr : 0.0f;
      float* o = out + (t * H + h) * d.v;
      for (int64_t j = 0; j < d.v; ++j) o[j] *= inv;
    }
}

void router_topk(Exec ex, const float* logits, const float* bias, int64_t E, int64_t k, bool renorm, float scale,
                 int32_t* idx, float* w) {
  float* const s = cpu::scratch<float>(cpu::ScratchId::RouterScores, E);
  float* const sel = cpu::scratch<float>(cpu::ScratchId::RouterSelect, E);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = sigmoidf(logits[e]);
    sel[e] = s[e] + (bias ? bias[e] : 0.0f);  // bias steers selection only
  }
  int32_t* const order = cpu::scratch<int32_t>(cpu::ScratchId::RouterOrder, E);
  std::iota(order, order + E, 0);
  std::partial_sort(order, order + k, order + E,
                    [&](int32_t a, int32_t b) { return sel[a] > sel[b] || (sel[a] == sel[b] && a < b); });
  double sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += s[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = order[j];
    const double sj = s[order[j]];  // weights from the UNBIASED scores
    w[j] = float((renorm ? sj / (sum + 1e-20) : sj) * scale);
  }
}

void attnres_mix(Exec ex, const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold, float eps,
                 float* out) {
  if (const cpu::AttnKernels* kern = cpu::attn_kernels(ex); kern && n_src >= 1 && n_src <= 64) {
    return for_blocks(T, kElemBlock / std::max<int64_t>(H * n_src, 1), H * n_src,
                      [&](int64_t t0, int64_t t1) { kern->attnres_mix(src, n_src, t0, t1, H, fold, eps, out); });
  }
  for (int64_t t = 0; t < T; ++t) {
    float sc[64];  // n_src <= 64 enforced by the model (K3 needs at most 9)
    for (int64_t j = 0; j < n_src; ++j) {
      const float* x = src[j] + t * H;
      double dt = 0, ss = 0;
      for (int64_t i = 0; i < H; ++i) {
        dt += double(x[i]) * fold[i];
        ss += double(x[i]) * x[i];
      }
      sc[j] = float(dt / std::sqrt(ss / double(H) + eps));
    }
    softmax(sc, n_src);
    float* ot = out + t * H;
    for (int64_t i = 0; i < H; ++i) {
      float acc = 0;
      for (int64_t j = 0; j < n_src; ++j) acc += sc[j] * src[j][t * H + i];  // RAW sources
      ot[i] = acc;
    }
  }
}

}  // namespace k3::ops
