// Reference twins of every op in ops.h: plain scalar loops in fp64, written to read like the
// spec (k3-architecture.md §3). Slow by design; the fast CPU kernels are tested against these.
// Must not: share code paths with ops/cpu (a twin that calls the kernel it checks proves nothing).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/ops.h"

namespace k3::ref {

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

void dequant_row(const WeightMat& W, int64_t r, float* out) {
  for (int64_t c = 0; c < W.cols; ++c) out[c] = W.at(r, c);
}

void matmul(const WeightMat& W, const float* X, int64_t T, float* Y) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < W.rows; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < W.cols; ++c) acc += double(W.at(r, c)) * X[t * W.cols + c];
      Y[t * W.rows + r] = float(acc);
    }
}

void matmul_shared_input(const WeightMat* const* W, int64_t n, const float* X, int64_t T, float* const* Y) {
  for (int64_t i = 0; i < n; ++i) matmul(*W[i], X, T, Y[i]);
}

void matmul_many(const WeightMat* const* W, const float* const* X, int64_t n, int64_t T, float* const* Y) {
  for (int64_t i = 0; i < n; ++i) matmul(*W[i], X[i], T, Y[i]);
}

void rmsnorm(const float* x, int64_t T, int64_t n, const float* w, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[t * n + i]) * x[t * n + i];
    const double inv = 1.0 / std::sqrt(ss / double(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = float((w ? w[i] : 1.0) * x[t * n + i] * inv);
  }
}

void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double f = double(scale) / std::sqrt(ss + eps);
    for (int64_t i = 0; i < n; ++i) x[r * n + i] = float(x[r * n + i] * f);
  }
}

void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g[i], ui = u[i];
    const double a = b1 > 0 ? b1 * std::tanh(gi / b1) : gi, c = b2 > 0 ? b2 * std::tanh(ui / b2) : ui;
    out[i] = float(a * sigmoid(gi) * c);
  }
}

void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* out) {
  // Window for token t: [state (K-1 oldest→newest), x[0..T)] ; output uses the K most recent inputs.
  for (int64_t c = 0; c < C; ++c) {
    std::vector<double> hist(static_cast<size_t>(K - 1 + T));
    for (int64_t j = 0; j < K - 1; ++j) hist[size_t(j)] = state[c * (K - 1) + j];
    for (int64_t t = 0; t < T; ++t) hist[size_t(K - 1 + t)] = x[t * C + c];
    for (int64_t t = 0; t < T; ++t) {
      double acc = 0;
      for (int64_t j = 0; j < K; ++j) acc += double(w[c * K + j]) * hist[size_t(t + j)];
      out[t * C + c] = float(acc * sigmoid(acc));
    }
    for (int64_t j = 0; j < K - 1; ++j) state[c * (K - 1) + j] = float(hist[size_t(T + j)]);
  }
}

void kda_gate(const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
              float lower_bound, float* g) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = h * D + d;
        const double a = std::exp(double(A_log[h])), x = double(f[t * H * D + i]) + dt_bias[i];
        g[t * H * D + i] = lower_bound != 0 ? float(lower_bound * sigmoid(a * x))
                                            : float(-a * (x > 20 ? x : std::log1p(std::exp(x))));
      }
}

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int64_t H, int64_t Dk, int64_t Dv, float* S, float* o) {
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> s(static_cast<size_t>(Dk * Dv));
    for (int64_t i = 0; i < Dk * Dv; ++i) s[size_t(i)] = S[h * Dk * Dv + i];
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + (t * H + h) * Dk;
      const float* kt = k + (t * H + h) * Dk;
      const float* vt = v + (t * H + h) * Dv;
      const float* gt = g + (t * H + h) * Dk;
      const double b = beta[t * H + h];
      // 1. decay each key row; 2. read prediction u = Sᵀk; 3. delta write; 4. read output with q.
      for (int64_t a = 0; a < Dk; ++a)
        for (int64_t j = 0; j < Dv; ++j) s[size_t(a * Dv + j)] *= std::exp(double(gt[a]));
      for (int64_t j = 0; j < Dv; ++j) {
        double u = 0;
        for (int64_t a = 0; a < Dk; ++a) u += s[size_t(a * Dv + j)] * kt[a];
        const double delta = b * (vt[j] - u);
        for (int64_t a = 0; a < Dk; ++a) s[size_t(a * Dv + j)] += kt[a] * delta;
      }
      for (int64_t j = 0; j < Dv; ++j) {
        double acc = 0;
        for (int64_t a = 0; a < Dk; ++a) acc += s[size_t(a * Dv + j)] * qt[a];
        o[(t * H + h) * Dv + j] = float(acc);
      }
    }
    for (int64_t i = 0; i < Dk * Dv; ++i) S[h * Dk * Dv + i] = float(s[size_t(i)]);
  }
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o) {
  // The twin of the chunked algorithm is the recurrence itself: both must give the same numbers.
  (void)chunk;
  kda_recurrent(q, k, v, g, beta, T, H, Dk, Dv, S, o);
}

namespace {
// Softmax-weighted sum over keys s = 0..n-1 with scores sc; returns weights in p.
void softmax_inplace(std::vector<double>& sc) {
  const double m = *std::max_element(sc.begin(), sc.end());
  double z = 0;
  for (double& x : sc) z += (x = std::exp(x - m));
  for (double& x : sc) x /= z;
}
}  // namespace

void mla_attend_expanded(const float* q, int64_t T, const float* k_nope, const float* k_r, const float* v, int64_t S,
                         int64_t pos0, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t n = std::min(S, pos0 + t + 1);
      std::vector<double> sc(static_cast<size_t>(n));
      const float* qh = q + (t * d.heads + h) * dq;
      for (int64_t s = 0; s < n; ++s) {
        double acc = 0;
        for (int64_t i = 0; i < d.nope; ++i) acc += double(qh[i]) * k_nope[(s * d.heads + h) * d.nope + i];
        for (int64_t i = 0; i < d.rope; ++i) acc += double(qh[d.nope + i]) * k_r[s * d.rope + i];
        sc[size_t(s)] = acc * d.scale;
      }
      softmax_inplace(sc);
      for (int64_t j = 0; j < d.v; ++j) {
        double acc = 0;
        for (int64_t s = 0; s < n; ++s) acc += sc[size_t(s)] * v[(s * d.heads + h) * d.v + j];
        out[(t * d.heads + h) * d.v + j] = float(acc);
      }
    }
}

void mla_attend_absorbed(const float* q, int64_t T, const float* c, const float* k_r, int64_t S, int64_t pos0,
                         const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
  const int64_t dq = d.nope + d.rope, per_head = d.nope + d.v;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < d.heads; ++h) {
      const float* qh = q + (t * d.heads + h) * dq;
      // q̃ = W_UKᵀ q_nope  (kv_lora)
      std::vector<double> qt(size_t(d.kv_lora), 0.0);
      for (int64_t i = 0; i < d.nope; ++i)
        for (int64_t l = 0; l < d.kv_lora; ++l) qt[size_t(l)] += double(kv_b.at(h * per_head + i, l)) * qh[i];
      const int64_t n = std::min(S, pos0 + t + 1);
      std::vector<double> sc(static_cast<size_t>(n));
      for (int64_t s = 0; s < n; ++s) {
        double acc = 0;
        for (int64_t l = 0; l < d.kv_lora; ++l) acc += qt[size_t(l)] * c[s * d.kv_lora + l];
        for (int64_t i = 0; i < d.rope; ++i) acc += double(qh[d.nope + i]) * k_r[s * d.rope + i];
        sc[size_t(s)] = acc * d.scale;
      }
      softmax_inplace(sc);
      std::vector<double> ch(size_t(d.kv_lora), 0.0);
      for (int64_t s = 0; s < n; ++s)
        for (int64_t l = 0; l < d.kv_lora; ++l) ch[size_t(l)] += sc[size_t(s)] * c[s * d.kv_lora + l];
      for (int64_t j = 0; j < d.v; ++j) {
        double acc = 0;
        for (int64_t l = 0; l < d.kv_lora; ++l) acc += double(kv_b.at(h * per_head + d.nope + j, l)) * ch[size_t(l)];
        out[(t * d.heads + h) * d.v + j] = float(acc);
      }
    }
}

void router_topk(const float* logits, const float* bias, int64_t E, int64_t k, bool renorm, float scale, int32_t* idx,
                 float* w) {
  std::vector<double> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    s[size_t(e)] = sigmoid(logits[e]);
    sel[size_t(e)] = s[size_t(e)] + (bias ? bias[e] : 0.0);
  }
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sel[size_t(a)] > sel[size_t(b)]; });
  double sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += s[size_t(order[size_t(j)])];
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = order[size_t(j)];
    const double sj = s[size_t(order[size_t(j)])];
    w[j] = float((renorm ? sj / (sum + 1e-20) : sj) * scale);
  }
}

void attnres_mix(const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold, float eps,
                 float* out) {
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> sc(static_cast<size_t>(n_src));
    for (int64_t j = 0; j < n_src; ++j) {
      const float* x = src[j] + t * H;
      double dot = 0, ss = 0;
      for (int64_t i = 0; i < H; ++i) {
        dot += double(x[i]) * fold[i];
        ss += double(x[i]) * x[i];
      }
      sc[size_t(j)] = dot / std::sqrt(ss / double(H) + eps);
    }
    softmax_inplace(sc);
    for (int64_t i = 0; i < H; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < n_src; ++j) acc += sc[size_t(j)] * src[j][t * H + i];
      out[t * H + i] = float(acc);
    }
  }
}

}  // namespace k3::ref
