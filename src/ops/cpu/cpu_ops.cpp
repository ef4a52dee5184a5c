// CPU kernels of ops.h in fp32 with OpenMP over rows/heads. Straightforward loops the compiler
// vectorizes; SIMD-specific kernels with runtime dispatch come later (issue: CPU performance).
// Must not: change results beyond fp32 rounding versus the fp64 twins in ops/reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "ops/ops.h"

namespace k3::ops {

namespace {
// Below this many multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 18;

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// fp32 products, fp64 accumulation in 8 lanes: long dot products (up to 33792 terms in K3) would
// otherwise lose ~1e-6 relative per layer, which a deep model amplifies.
inline float dot(const float* a, const float* b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(a[i + j] * b[i + j]);
  double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += double(a[i] * b[i]);
  return float(s);
}
}  // namespace

void rmsnorm(const float* x, int64_t T, int64_t n, const float* w, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xt[i]) * xt[i];
    const float inv = float(1.0 / std::sqrt(ss / double(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = (w ? w[i] : 1.0f) * (xt[i] * inv);
  }
}

void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float f = float(double(scale) / std::sqrt(ss + eps));
    for (int64_t i = 0; i < n; ++i) xr[i] *= f;
  }
}

void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = (b1 * std::tanh(g[i] / b1) * sigmoidf(g[i])) * (b2 * std::tanh(u[i] / b2));
}

void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* out) {
  const int64_t P = K - 1;
#pragma omp parallel for schedule(static) if (C * T * K > kParallelMin)
  for (int64_t c = 0; c < C; ++c) {
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
}

void kda_gate(const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
              float lower_bound, float* g) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = t * H * D + h * D + d;
        g[i] = lower_bound * sigmoidf(a * (f[i] + dt_bias[h * D + d]));
      }
    }
}

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int64_t H, int64_t Dk, int64_t Dv, float* S, float* o) {
  // The state is held in fp64 within a call (fp32 between calls, as the session stores it), the
  // same internal precision as kda_chunked, so prefill and decode paths agree to fp32 rounding.
#pragma omp parallel for schedule(static) if (T * H * Dk * Dv > kParallelMin)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> s(S + h * Dk * Dv, S + (h + 1) * Dk * Dv), u(static_cast<size_t>(Dv)), ot(static_cast<size_t>(Dv));
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + (t * H + h) * Dk;
      const float* kt = k + (t * H + h) * Dk;
      const float* vt = v + (t * H + h) * Dv;
      const float* gt = g + (t * H + h) * Dk;
      const double b = beta[t * H + h];
      // decay -> read prediction -> delta write -> read output from the updated state
      std::fill(u.begin(), u.end(), 0.0);
      for (int64_t a = 0; a < Dk; ++a) {
        const double al = std::exp(double(gt[a]));
        double* row = &s[size_t(a * Dv)];
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] *= al;
          u[size_t(j)] += row[j] * kt[a];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) u[size_t(j)] = b * (vt[j] - u[size_t(j)]);
      std::fill(ot.begin(), ot.end(), 0.0);
      for (int64_t a = 0; a < Dk; ++a) {
        double* row = &s[size_t(a * Dv)];
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] += kt[a] * u[size_t(j)];
          ot[size_t(j)] += row[j] * qt[a];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) o[(t * H + h) * Dv + j] = float(ot[size_t(j)]);
    }
    for (int64_t i = 0; i < Dk * Dv; ++i) S[h * Dk * Dv + i] = float(s[size_t(i)]);
  }
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o) {
  // Chunkwise form (spec §3.5), per head and chunk of C tokens, with Γ_i = Σ_{j<=i} g_j in the chunk:
  //   R  = V − (exp(Γ) ⊙ K)·S                      (what the incoming state predicts is removed)
  //   Ṽ  = (I + M)⁻¹ Diag(β) R, M[i,j] = β_i Σ_d k_i k_j exp(Γ_i−Γ_j), j < i   (the UT transform,
  //        applied by forward substitution; equals U − W·S with U = T·V, W = T·(exp(Γ)⊙K))
  //   O  = (Q ⊙ exp(Γ))·S + (A_qk ⊙ causal-incl-diag)·Ṽ
  //   S ← Diag(exp(Γ_C))·S + Σ_i (exp(Γ_C − Γ_i) ⊙ k_i) ṽ_iᵀ
  // Decay factors are always formed from differences Γ_i − Γ_j <= 0 (never exp(Γ_i)·exp(−Γ_j)).
  // Intra-chunk math runs in fp64: the substitution can amplify rounding.
  if (chunk <= 0) chunk = 64;
#pragma omp parallel for schedule(static) if (T * H * Dk * Dv * 4 > kParallelMin)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> s(static_cast<size_t>(Dk * Dv));
    for (int64_t i = 0; i < Dk * Dv; ++i) s[size_t(i)] = S[h * Dk * Dv + i];
    std::vector<double> G(static_cast<size_t>(chunk * Dk)), Vt(static_cast<size_t>(chunk * Dv)), A(static_cast<size_t>(chunk * chunk));
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
      const int64_t C = std::min(chunk, T - t0);
      auto K_ = [&](int64_t i, int64_t d) { return double(k[((t0 + i) * H + h) * Dk + d]); };
      auto Q_ = [&](int64_t i, int64_t d) { return double(q[((t0 + i) * H + h) * Dk + d]); };
      for (int64_t d = 0; d < Dk; ++d) {
        double acc = 0;
        for (int64_t i = 0; i < C; ++i) {
          acc += g[((t0 + i) * H + h) * Dk + d];
          G[size_t(i * Dk + d)] = acc;
        }
      }
      // R = V − (exp(Γ) ⊙ K)·S, then forward substitution for Ṽ.
      for (int64_t i = 0; i < C; ++i) {
        const double bi = beta[(t0 + i) * H + h];
        double* vt = &Vt[size_t(i * Dv)];
        for (int64_t j = 0; j < Dv; ++j) vt[j] = v[((t0 + i) * H + h) * Dv + j];
        for (int64_t d = 0; d < Dk; ++d) {
          const double kd = K_(i, d) * std::exp(G[size_t(i * Dk + d)]);
          const double* srow = &s[size_t(d * Dv)];
          for (int64_t j = 0; j < Dv; ++j) vt[j] -= kd * srow[j];
        }
        for (int64_t j = 0; j < Dv; ++j) vt[j] *= bi;
        for (int64_t p = 0; p < i; ++p) {
          double m = 0;
          for (int64_t d = 0; d < Dk; ++d) m += K_(i, d) * K_(p, d) * std::exp(G[size_t(i * Dk + d)] - G[size_t(p * Dk + d)]);
          m *= bi;
          const double* vp = &Vt[size_t(p * Dv)];
          for (int64_t j = 0; j < Dv; ++j) vt[j] -= m * vp[j];
        }
      }
      // O = (Q ⊙ exp(Γ))·S + (A_qk ⊙ causal)·Ṽ
      for (int64_t i = 0; i < C; ++i) {
        float* ot = o + ((t0 + i) * H + h) * Dv;
        std::vector<double> acc(size_t(Dv), 0.0);
        for (int64_t d = 0; d < Dk; ++d) {
          const double qd = Q_(i, d) * std::exp(G[size_t(i * Dk + d)]);
          const double* srow = &s[size_t(d * Dv)];
          for (int64_t j = 0; j < Dv; ++j) acc[size_t(j)] += qd * srow[j];
        }
        for (int64_t p = 0; p <= i; ++p) {
          double a = 0;
          for (int64_t d = 0; d < Dk; ++d) a += Q_(i, d) * K_(p, d) * std::exp(G[size_t(i * Dk + d)] - G[size_t(p * Dk + d)]);
          const double* vp = &Vt[size_t(p * Dv)];
          for (int64_t j = 0; j < Dv; ++j) acc[size_t(j)] += a * vp[j];
        }
        for (int64_t j = 0; j < Dv; ++j) ot[j] = float(acc[size_t(j)]);
      }
      // S ← Diag(exp(Γ_C))·S + Σ_i (exp(Γ_C − Γ_i) ⊙ k_i) ṽ_iᵀ
      const double* GC = &G[size_t((C - 1) * Dk)];
      for (int64_t d = 0; d < Dk; ++d) {
        double* srow = &s[size_t(d * Dv)];
        const double dec = std::exp(GC[d]);
        for (int64_t j = 0; j < Dv; ++j) srow[j] *= dec;
        for (int64_t i = 0; i < C; ++i) {
          const double kd = K_(i, d) * std::exp(GC[d] - G[size_t(i * Dk + d)]);
          const double* vi = &Vt[size_t(i * Dv)];
          for (int64_t j = 0; j < Dv; ++j) srow[j] += kd * vi[j];
        }
      }
    }
    for (int64_t i = 0; i < Dk * Dv; ++i) S[h * Dk * Dv + i] = float(s[size_t(i)]);
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

void mla_attend_expanded(const float* q, int64_t T, const float* k_nope, const float* k_r, const float* v, int64_t S,
                         int64_t pos0, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope;
#pragma omp parallel for collapse(2) schedule(static) if (T * S * d.heads * (d.nope + d.v) > kParallelMin)
  for (int64_t h = 0; h < d.heads; ++h)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = std::min(S, pos0 + t + 1);
      std::vector<float> sc(static_cast<size_t>(n));
      const float* qh = q + (t * d.heads + h) * dq;
      for (int64_t s = 0; s < n; ++s)
        sc[size_t(s)] = (dot(qh, k_nope + (s * d.heads + h) * d.nope, d.nope) + dot(qh + d.nope, k_r + s * d.rope, d.rope)) * d.scale;
      softmax(sc.data(), n);
      float* oh = out + (t * d.heads + h) * d.v;
      std::fill(oh, oh + d.v, 0.0f);
      for (int64_t s = 0; s < n; ++s) {
        const float* vs = v + (s * d.heads + h) * d.v;
        for (int64_t j = 0; j < d.v; ++j) oh[j] += sc[size_t(s)] * vs[j];
      }
    }
}

void mla_attend_absorbed(const float* q, int64_t T, const float* c, const float* k_r, int64_t S, int64_t pos0,
                         const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope, per_head = d.nope + d.v, L = d.kv_lora;
#pragma omp parallel for schedule(static) if ((T + per_head) * S * d.heads * L > kParallelMin)
  for (int64_t h = 0; h < d.heads; ++h) {
    // This head's W_UK [nope, L] and W_UV [v, L], decoded once for all T queries.
    std::vector<float> wuk(static_cast<size_t>(d.nope * L)), wuv(static_cast<size_t>(d.v * L)), qt(static_cast<size_t>(L)), ch(static_cast<size_t>(L));
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
        sc[size_t(s)] = (dot(qt.data(), c + s * L, L) + dot(qh + d.nope, k_r + s * d.rope, d.rope)) * d.scale;
      softmax(sc.data(), n);
      std::fill(ch.begin(), ch.end(), 0.0f);
      for (int64_t s = 0; s < n; ++s)
        for (int64_t l = 0; l < L; ++l) ch[size_t(l)] += sc[size_t(s)] * c[s * L + l];
      float* oh = out + (t * d.heads + h) * d.v;
      for (int64_t j = 0; j < d.v; ++j) oh[j] = dot(wuv.data() + j * L, ch.data(), L);
    }
  }
}

void router_topk(const float* logits, const float* bias, int64_t E, int64_t k, bool renorm, float scale,
                 int32_t* idx, float* w) {
  std::vector<float> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    s[size_t(e)] = sigmoidf(logits[e]);
    sel[size_t(e)] = s[size_t(e)] + (bias ? bias[e] : 0.0f);  // bias steers selection only
  }
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return sel[size_t(a)] > sel[size_t(b)] || (sel[size_t(a)] == sel[size_t(b)] && a < b);
  });
  double sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += s[size_t(order[size_t(j)])];
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = order[size_t(j)];
    const double sj = s[size_t(order[size_t(j)])];  // weights from the UNBIASED scores
    w[j] = float((renorm ? sj / (sum + 1e-20) : sj) * scale);
  }
}

void attnres_mix(const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold, float eps,
                 float* out) {
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
