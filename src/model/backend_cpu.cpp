// The CPU backend: every op on host memory through ops:: (SIMD kernels chosen at run time, or the
// scalar fp64-accumulating ones under exact numerics). Per-sequence ops run each sequence from its
// slot; the routed experts are grouped by expert over the step's rows, with row-parallel GEMVs for a
// one-row step and experts streamed from an ExpertSource on request.
// Must not: hold model state between steps beyond the numerics of the step in flight.
#include "model/backends.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/layers.h"
#include "ops/cpu/isa.h"

namespace k3 {

namespace {

ops::Numerics to_ops(StepNumerics n) {
  switch (n) {
    case StepNumerics::Exact:
      return ops::Numerics::Exact;
    case StepNumerics::F32:
      return ops::Numerics::F32;
    case StepNumerics::Fast:
      return ops::Numerics::Fast;
  }
  return ops::Numerics::Exact;
}

// agg[c] += w * y[c]: one routed expert's output added into a row's sum (the same operations on
// every path, which keeps batched rows bit-identical to alone).
void add_scaled(float* agg, float w, const float* y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) agg[c] += w * y[c];
}
void check_expert(int32_t e, int64_t E) {
  if (e < 0 || e >= E) fail("MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(E));
}

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  BackendCaps caps() const override { return {true, true, true}; }

  void* alloc(size_t bytes, const char* what) override {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) & ~size_t(63));
    if (!p) fail(std::string("out of memory allocating ") + std::to_string(bytes) + " bytes for " + what);
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void upload(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void download(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void copy(void* dst, const void* src, size_t n) override { std::memmove(dst, src, n); }
  void zero(void* dst, size_t n) override { std::memset(dst, 0, n); }
  void sync() override {}
  void place(ModelWeights&) override {}  // the mapping is read as it is

  bool begin_step(const StepView& v, const int32_t*, StepNumerics n, bool) override {
    ex_ = ops::Exec{to_ops(n)};
    step_rows_ = v.rows;
    step_cu_.assign(v.cu_rows, v.cu_rows + v.n_seqs + 1);
    // Room for every page of the longest sequence, grown ahead (a decode step allocates nothing).
    if (page_ptrs_.capacity() < size_t(v.max_pages)) page_ptrs_.reserve(std::max<size_t>(2 * size_t(v.max_pages), 64));
    return true;
  }
  void end_step() override { ex_ = ops::kExact; }
  void abort_step() noexcept override { ex_ = ops::kExact; }

  void embed(const WeightMat& E, const int32_t* ids, int64_t R, float* out) override {
    for (int64_t t = 0; t < R; ++t) ops::dequant_row(E, ids[t], out + t * E.cols);
  }
  void matmul(const WeightMat& W, const float* x, int64_t R, float* y, const int32_t* groups,
              int64_t n_groups) override {
    const WeightMat* w[] = {&W};
    const float* xs[] = {x};
    float* ys[] = {y};
    products(w, xs, 1, R, ys, nullptr, groups, n_groups);
  }
  void matmul_shared_input(const WeightMat* const* W, int64_t n, const float* x, int64_t R, float* const* y,
                           const bool* fp32) override {
    const float* xs[kMaxProducts];
    if (n > kMaxProducts) fail("matmul_shared_input: at most 8 weights");
    for (int64_t i = 0; i < n; ++i) xs[i] = x;
    products(W, xs, n, R, y, fp32, nullptr, 0);
  }
  void matmul_many(const WeightMat* const* W, const float* const* x, int64_t n, int64_t R, float* const* y) override {
    products(W, x, n, R, y, nullptr, nullptr, 0);
  }
  void rmsnorm(const float* x, int64_t R, int64_t n, const float* w, float eps, float* out) override {
    ops::rmsnorm(ex_, x, R, n, w, eps, out);
  }
  void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) override {
    ops::l2norm_scale(ex_, x, rows, n, eps, scale);
  }
  void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) override {
    ops::situ_glu(ex_, g, u, n, b1, b2, out);
  }
  void kda_gate(const float* f, int64_t R, int64_t H, int64_t D, const float* A_log, const float* dt_bias, float lb,
                float* g) override {
    ops::kda_gate(ex_, f, R, H, D, A_log, dt_bias, lb, g);
  }
  void sigmoid(float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0f / (1.0f + std::exp(-x[i]));
  }
  void sigmoid_mul(float* x, const float* gate, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  }
  void add(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
  }
  void attnres_mix(const float* const* src, int64_t n_src, int64_t R, int64_t H, const float* fold, float eps,
                   float* out) override {
    ops::attnres_mix(ex_, src, n_src, R, H, fold, eps, out);
  }
  void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst) override {
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * width, src + int64_t(rows[i]) * width, size_t(width) * 4);
  }

  void short_conv_silu(const float* x, const StepView& s, int64_t C, const float* w, int64_t K, float* state,
                       float* out) override {
    const int64_t per = C * (K - 1);
    for (int64_t i = 0; i < s.n_seqs; ++i) {
      const int64_t r0 = s.cu_rows[i], T = s.cu_rows[i + 1] - r0;
      ops::short_conv_silu(ex_, x + r0 * C, T, C, w, K, state + s.slots[i] * per, out + r0 * C);
    }
  }
  void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const StepView& s,
           int64_t H, int64_t Dk, int64_t Dv, KdaAlgo algo, int64_t chunk, float* S_pool, float* o) override {
    const int64_t per = H * Dk * Dv;
    for (int64_t i = 0; i < s.n_seqs; ++i) {
      const int64_t r0 = s.cu_rows[i], T = s.cu_rows[i + 1] - r0;
      float* S = S_pool + s.slots[i] * per;
      if (algo == KdaAlgo::Chunked && T > 1)
        ops::kda_chunked(ex_, q + r0 * H * Dk, k + r0 * H * Dk, v + r0 * H * Dv, g + r0 * H * Dk, beta + r0 * H, T, H,
                         Dk, Dv, chunk, S, o + r0 * H * Dv);
      else
        ops::kda_recurrent(ex_, q + r0 * H * Dk, k + r0 * H * Dk, v + r0 * H * Dv, g + r0 * H * Dk, beta + r0 * H, T, H,
                           Dk, Dv, S, o + r0 * H * Dv);
    }
  }
  void mla_append(const float* ckv, const StepView& s, int64_t L, int64_t rope, const float* norm_w, float eps,
                  const MlaPages& pages) override {
    const int64_t W = L + rope, P = s.page_tokens;
    for (int64_t i = 0; i < s.n_seqs; ++i)
      for (int64_t r = s.cu_rows[i]; r < s.cu_rows[i + 1]; ++r) {
        const int64_t pos = s.pos0[i] + (r - s.cu_rows[i]);
        float* dst = pages.pages + (int64_t(s.block_table[i * s.max_pages + pos / P]) * P + pos % P) * W;
        ops::rmsnorm(ex_, ckv + r * W, 1, L, norm_w, eps, dst);
        std::memcpy(dst + L, ckv + r * W + L, size_t(rope) * 4);
      }
  }
  void mla_attend(const float* q, const StepView& s, const MlaPages& pages, const WeightMat& kv_b, const MlaAttnDims& d,
                  MlaAlgo algo, float* out) override {
    const int64_t W = d.kv_lora + d.rope, P = s.page_tokens, dq = d.nope + d.rope, HV = d.heads * d.v;
    for (int64_t i = 0; i < s.n_seqs; ++i) {
      const int64_t r0 = s.cu_rows[i], T = s.cu_rows[i + 1] - r0, S = s.pos0[i] + T;
      const int64_t np = (S + P - 1) / P;
      page_ptrs_.resize(size_t(np));
      for (int64_t p = 0; p < np; ++p)
        page_ptrs_[size_t(p)] = pages.pages + int64_t(s.block_table[i * s.max_pages + p]) * P * W;
      const ops::LatentPages lp{page_ptrs_.data(), P, W};
      // Exact numerics: the reference-style forms. Otherwise Expanded runs in key tiles (bounded
      // workspace), and Auto picks by the multiply-adds of this sequence's piece.
      const bool exact = ex_.numerics == ops::Numerics::Exact;
      const float* qi = q + r0 * d.heads * dq;
      float* oi = out + r0 * HV;
      if (algo == MlaAlgo::Expanded && exact)
        mla_expanded(qi, T, lp, S, s.pos0[i], kv_b, d, oi);
      else if (!exact && (algo == MlaAlgo::Expanded || (algo == MlaAlgo::Auto && ops::mla_tiled_pays(T, S, d))))
        ops::mla_attend_tiled_paged(ex_, qi, T, lp, S, s.pos0[i], kv_b, d, oi);
      else
        ops::mla_attend_absorbed_paged(ex_, qi, T, lp, S, s.pos0[i], kv_b, d, oi);
    }
  }

  void router_topk(const float* logits, const float* bias, int64_t R, int64_t E, int64_t k, bool renorm, float scale,
                   int32_t* idx, float* w) override {
    for (int64_t t = 0; t < R; ++t)
      ops::router_topk(ex_, logits + t * E, bias, E, k, renorm, scale, idx + t * k, w + t * k);
  }
  void moe_routed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                  const float* wt, int64_t R, int64_t top_k, float* agg, ExpertSource* source, float* terms) override {
    // Terms mode runs the very same paths (same row groupings, so the same bits per expert output),
    // storing each output in its slot instead of adding it; agg then only steers pointer arithmetic.
    terms_ = terms;
    top_k_ = top_k;
    if (terms) agg = terms;
    // Under fast numerics an expert's GEMM rounds its rows when it has >= 4 of them, so each
    // sequence's rows go through the experts as they would alone; otherwise every row of the step
    // at once (each selected expert read once).
    // The one-row (decode) sequences go together through moe_decode_rows, which gives each exactly
    // its result alone while reading each expert once for all of them.
    if (!ex_.fast() || R != step_rows_) return moe_rows(w, latent, situ, z, idx, wt, R, top_k, agg, source);
    moe_.decode_rows.clear();
    for (size_t i = 0; i + 1 < step_cu_.size(); ++i) {
      const int64_t r0 = step_cu_[i], n = step_cu_[i + 1] - r0;
      if (n == 1 && !source && step_cu_.size() > 2) {
        moe_.decode_rows.push_back(int32_t(r0));
        continue;
      }
      if (terms) terms_ = terms + r0 * top_k * latent;  // moe_rows counts rows from the sequence's first
      moe_rows(w, latent, situ, z + r0 * latent, idx + r0 * top_k, wt + r0 * top_k, n, top_k, agg + r0 * latent,
               source);
    }
    terms_ = terms;
    if (!moe_.decode_rows.empty()) moe_decode_rows(w, latent, situ, z, idx, wt, top_k, agg);
  }
  void moe_decode_rows(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                       const float* wt, int64_t top_k, float* agg);
  // moe_routed's `terms` (null: sum into agg) and top_k: an expert output of (row, j) goes to
  // terms_[(row * top_k_ + j) * latent ..] instead of being added.
  float* terms_ = nullptr;
  int64_t top_k_ = 0;
  // One expert's output y for (row, j, weight): added into the row's sum, or stored as its term.
  void put_expert(float* agg, int64_t row, int64_t j, float w, const float* y, int64_t latent) {
    if (terms_)
      std::memcpy(terms_ + (row * top_k_ + j) * latent, y, size_t(latent) * sizeof(float));
    else
      add_scaled(agg + row * latent, w, y, latent);
  }
  void moe_combine(const float* terms, const int32_t* idx, const float* wt, int64_t R, int64_t top_k, int64_t latent,
                   float* agg) override {
    for (int64_t r = 0; r < R; ++r) {
      float* a = agg + r * latent;
      std::fill(a, a + latent, 0.0f);
      // the row's experts in ascending id (top-k ids are distinct): moe_routed's order of additions
      int64_t done = 0;
      int32_t last = -1;
      while (done < top_k) {
        int64_t best = -1;
        for (int64_t j = 0; j < top_k; ++j) {
          const int32_t e = idx[r * top_k + j];
          if (e > last && (best < 0 || e < idx[r * top_k + best])) best = j;
        }
        if (best < 0) fail("MoE: a row's routed experts are not distinct");
        last = idx[r * top_k + best];
        add_scaled(a, wt[r * top_k + best], terms + (r * top_k + best) * latent, latent);
        ++done;
      }
    }
  }
  void moe_rows(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                const float* wt, int64_t R, int64_t top_k, float* agg, ExpertSource* source);

  void argmax_rows(const float* logits, int64_t R, int64_t V, int32_t* out) override {
    for (int64_t r = 0; r < R; ++r)
      out[r] = int32_t(std::max_element(logits + r * V, logits + (r + 1) * V) - (logits + r * V));
  }

 private:
  // Every cached latent expanded into per-head k_nope and v (what a non-absorbed engine caches);
  // the reference-style path, so its buffers are allocated per call.
  void mla_expanded(const float* q, int64_t T, const ops::LatentPages& lp, int64_t S, int64_t pos0,
                    const WeightMat& kv_b, const MlaAttnDims& d, float* out) {
    const int64_t L = d.kv_lora, per_head = d.nope + d.v;
    std::vector<float> c(size_t(S * L)), kr(size_t(S * d.rope)), kv(size_t(S * d.heads * per_head)),
        kn(size_t(S * d.heads * d.nope)), vv(size_t(S * d.heads * d.v));
    for (int64_t t = 0; t < S; ++t) {
      const float* src = lp.pages[t / lp.page_tokens] + (t % lp.page_tokens) * lp.stride;
      std::memcpy(c.data() + t * L, src, size_t(L) * 4);
      std::memcpy(kr.data() + t * d.rope, src + L, size_t(d.rope) * 4);
    }
    ops::matmul(ex_, kv_b, c.data(), S, kv.data());
    for (int64_t t = 0; t < S; ++t)
      for (int64_t h = 0; h < d.heads; ++h) {
        const float* src = kv.data() + (t * d.heads + h) * per_head;
        std::memcpy(kn.data() + (t * d.heads + h) * d.nope, src, size_t(d.nope) * 4);
        std::memcpy(vv.data() + (t * d.heads + h) * d.v, src + d.nope, size_t(d.v) * 4);
      }
    ops::mla_attend_expanded(ex_, q, T, kn.data(), kr.data(), vv.data(), S, pos0, d, out);
  }

  // ---- fast numerics by sequence
  // Fast numerics round a GEMM's activations when it has >= 4 rows (bf16) and quantise a one-row
  // MXFP4 GEMV's (8-bit blocks), so a row's result depends on the call's shape. A batched step
  // keeps each sequence's rows in the class they have alone: chunks of >= 4 rows (rounded, several
  // such sequences in one GEMM: its rows are computed independently), single rows (fp32, MXFP4
  // GEMVs one row at a time) and 2-3 rows (fp32).
  enum class RowClass : uint8_t { Chunk, One, Few };
  struct Run {
    int64_t r0, n;
    RowClass cls;
  };
  static constexpr int64_t kMaxProducts = 8;

  const std::vector<Run>& runs(int64_t R, const int32_t* groups, int64_t ng) {
    runs_.clear();
    const int32_t one[2] = {0, int32_t(R)};
    if (!groups) {
      groups = R == step_rows_ ? step_cu_.data() : one;
      ng = R == step_rows_ ? int64_t(step_cu_.size()) - 1 : 1;
    }
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t r0 = groups[g], n = groups[g + 1] - r0;
      if (n <= 0) continue;
      const RowClass c = n >= ops::kFastMinRows ? RowClass::Chunk : n == 1 ? RowClass::One : RowClass::Few;
      if (!runs_.empty() && runs_.back().cls == c && runs_.back().r0 + runs_.back().n == r0)
        runs_.back().n += n;
      else
        runs_.push_back({r0, n, c});
    }
    return runs_;
  }

  // y[i] = W[i]·x[i] on rows [r0, r0 + k) for the weights `pick` selects, as one matmul_many call
  // in the numerics of ex.
  template <class Pick>
  static void products_on(ops::Exec ex, const WeightMat* const* W, const float* const* X, int64_t n, float* const* Y,
                          int64_t r0, int64_t k, Pick&& pick) {
    const WeightMat* w[kMaxProducts];
    const float* x[kMaxProducts];
    float* y[kMaxProducts];
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (pick(i)) {
        w[m] = W[i];
        x[m] = X[i] + r0 * W[i]->cols;
        y[m++] = Y[i] + r0 * W[i]->rows;
      }
    if (m) ops::matmul_many(ex, w, x, m, k, y);
  }

  // The products of a step, by row class under fast numerics (fp32[i]: weight i wants unrounded
  // activations whatever the numerics, as the router does).
  void products(const WeightMat* const* W, const float* const* X, int64_t n, int64_t R, float* const* Y,
                const bool* fp32, const int32_t* groups, int64_t ng) {
    if (n > kMaxProducts) fail("matmul: at most 8 products per call");
    const auto all = [](int64_t) { return true; };
    if (!ex_.fast()) return products_on(ex_, W, X, n, Y, 0, R, all);
    const auto flagged = [&](int64_t i) { return fp32 && fp32[i]; };
    const auto mx = [&](int64_t i) { return W[i]->fmt == WFormat::MXFP4; };
    for (const Run& run : runs(R, groups, ng)) {
      switch (run.cls) {
        case RowClass::Chunk:
          products_on(ex_, W, X, n, Y, run.r0, run.n, [&](int64_t i) { return !flagged(i); });
          products_on(ops::kF32, W, X, n, Y, run.r0, run.n, flagged);
          break;
        case RowClass::Few:
          products_on(ops::kF32, W, X, n, Y, run.r0, run.n, all);
          break;
        case RowClass::One:
          // fp32 GEMVs, each row exactly as alone, every weight read once for the run's rows.
          for (int64_t i = 0; i < n; ++i)
            if (!mx(i) || flagged(i))
              ops::matmul_rowwise(ops::kF32, *W[i], X[i] + run.r0 * W[i]->cols, run.n, Y[i] + run.r0 * W[i]->rows);
          for (int64_t r = run.r0; r < run.r0 + run.n; ++r)
            products_on(ex_, W, X, n, Y, r, 1, [&](int64_t i) { return mx(i) && !flagged(i); });
          break;
      }
    }
  }

  ops::Exec ex_ = ops::kExact;  // the numerics of the step in flight
  std::vector<const float*> page_ptrs_;
  int64_t step_rows_ = 0;
  std::vector<int32_t> step_cu_;
  std::vector<Run> runs_;
  // The routed-expert buffers of moe_rows, kept between calls (a steady decode step allocates
  // nothing once the largest step has run).
  struct MoeScratch {
    std::vector<int64_t> start, fill, rows, ro, io;
    std::vector<float> wts, zin, ye, g, u;
    std::vector<int32_t> selected, decode_rows, js;  // js: each of rows' place j among its row's top-k
    struct Pair {
      int32_t e, row, j;
      float w;
    };
    std::vector<Pair> pairs;
    std::vector<const GluWeights*> ew;
    std::vector<const WeightMat*> wv;
    std::vector<const float*> xv;
    std::vector<float*> yv;
  } moe_;
};

// Fast numerics, the rows of the step's one-row sequences (decode_rows): every (expert, row)
// product is the GEMV that row's run_token does alone, on the same prepared input, but all of them
// go through two matmul_many regions ordered by expert, so an expert's weights come from memory once
// and from cache for its other rows. Each row then adds its experts in ascending id, as alone:
// every sequence's output is bit-identical to the sequence run alone.
void CpuBackend::moe_decode_rows(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z,
                                 const int32_t* idx, const float* wt, int64_t top_k, float* agg) {
  MoeScratch& m = moe_;
  const int64_t E = int64_t(w.experts.size());
  m.pairs.clear();
  for (int32_t r : m.decode_rows) {
    if (!terms_) std::fill(agg + r * latent, agg + (r + 1) * latent, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = idx[r * top_k + j];
      check_expert(e, E);
      if (w.is_local(e)) m.pairs.push_back({e, r, int32_t(j), wt[r * top_k + j]});
    }
  }
  std::sort(m.pairs.begin(), m.pairs.end(), [](const MoeScratch::Pair& a, const MoeScratch::Pair& b) {
    return a.e < b.e || (a.e == b.e && a.row < b.row);
  });
  const auto P = int64_t(m.pairs.size());
  m.io.assign(size_t(P + 1), 0);
  for (int64_t p = 0; p < P; ++p)
    m.io[size_t(p + 1)] = m.io[size_t(p)] + w.experts[size_t(m.pairs[size_t(p)].e)].gate.rows;
  m.g.resize(size_t(m.io.back()));
  m.u.resize(size_t(m.io.back()));
  m.ye.resize(size_t(P * latent));
  m.wv.clear(), m.xv.clear(), m.yv.clear();
  for (int64_t p = 0; p < P; ++p) {
    const auto& pr = m.pairs[size_t(p)];
    const GluWeights& ew = w.experts[size_t(pr.e)];
    const float* x = z + int64_t(pr.row) * latent;
    m.wv.push_back(&ew.gate), m.xv.push_back(x), m.yv.push_back(m.g.data() + m.io[size_t(p)]);
    m.wv.push_back(&ew.up), m.xv.push_back(x), m.yv.push_back(m.u.data() + m.io[size_t(p)]);
  }
  ops::matmul_many(ex_, m.wv.data(), m.xv.data(), 2 * P, 1, m.yv.data());
  ops::situ_glu(ex_, m.g.data(), m.u.data(), m.io[size_t(P)], situ.beta, situ.linear_beta, m.g.data());
  m.wv.clear(), m.xv.clear(), m.yv.clear();
  for (int64_t p = 0; p < P; ++p) {
    m.wv.push_back(&w.experts[size_t(m.pairs[size_t(p)].e)].down);
    m.xv.push_back(m.g.data() + m.io[size_t(p)]);
    m.yv.push_back(m.ye.data() + p * latent);
  }
  ops::matmul_many(ex_, m.wv.data(), m.xv.data(), P, 1, m.yv.data());
  for (int64_t p = 0; p < P; ++p) {  // ascending expert: each row's order alone
    const auto& pr = m.pairs[size_t(p)];
    put_expert(agg, pr.row, pr.j, pr.w, m.ye.data() + p * latent, latent);
  }
}

void CpuBackend::moe_rows(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z,
                          const int32_t* idx, const float* wt, int64_t R, int64_t top_k, float* agg,
                          ExpertSource* source) {
  MoeScratch& m = moe_;
  const int64_t E = int64_t(w.experts.size()), RK = R * top_k;
  if (!terms_) std::fill(agg, agg + R * latent, 0.0f);
  // Per selected expert (ascending id): the rows routed to it (ascending) and their weights, as
  // runs of one flat array (a counting sort of the step's R * top_k choices).
  m.start.assign(size_t(E + 1), 0);
  for (int64_t i = 0; i < RK; ++i) {
    const int32_t e = idx[i];
    check_expert(e, E);
    ++m.start[size_t(e) + 1];
  }
  m.selected.clear();  // the union, ascending: the accumulation order into agg (this rank's experts)
  for (int64_t e = 0; e < E; ++e) {
    if (m.start[size_t(e) + 1] > 0 && w.is_local(e)) m.selected.push_back(int32_t(e));
    m.start[size_t(e) + 1] += m.start[size_t(e)];
  }
  m.fill.assign(m.start.begin(), m.start.end() - 1);
  m.rows.resize(size_t(RK));
  m.js.resize(size_t(RK));
  m.wts.resize(size_t(RK));
  for (int64_t t = 0; t < R; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = idx[t * top_k + j];
      const int64_t at = m.fill[size_t(e)]++;
      m.rows[size_t(at)] = t;
      m.js[size_t(at)] = int32_t(j);
      m.wts[size_t(at)] = wt[t * top_k + j];
    }
  const auto n_rows = [&](int32_t e) { return m.start[size_t(e) + 1] - m.start[size_t(e)]; };
  // Buffers of a batch of experts (n of them, their weights ew): expert i's rows live at row
  // offset ro[i] (gathered inputs, outputs) and its intermediate at io[i]; sized once, kept.
  const auto plan = [&](const int32_t* ids, int64_t n, const GluWeights* const* ew) {
    m.ro.assign(size_t(n + 1), 0);
    m.io.assign(size_t(n + 1), 0);
    for (int64_t i = 0; i < n; ++i) {
      m.ro[size_t(i + 1)] = m.ro[size_t(i)] + n_rows(ids[i]);
      m.io[size_t(i + 1)] = m.io[size_t(i)] + n_rows(ids[i]) * ew[i]->gate.rows;
    }
    m.zin.resize(size_t(m.ro.back() * latent));
    m.ye.resize(size_t(m.ro.back() * latent));
    m.g.resize(size_t(m.io.back()));
    m.u.resize(size_t(m.io.back()));
  };
  // One expert on the rows routed to it (gathered) into its slice of ye.
  const auto expert_out = [&](int64_t i, int32_t e, const GluWeights& ew) {
    const int64_t n = n_rows(e), I = ew.gate.rows;
    const int64_t* r = m.rows.data() + m.start[size_t(e)];
    float *zin = m.zin.data() + m.ro[size_t(i)] * latent, *ye = m.ye.data() + m.ro[size_t(i)] * latent;
    float *g = m.g.data() + m.io[size_t(i)], *u = m.u.data() + m.io[size_t(i)];
    for (int64_t k = 0; k < n; ++k) std::memcpy(zin + k * latent, z + r[k] * latent, size_t(latent) * 4);
    const WeightMat* wv[] = {&ew.gate, &ew.up};
    float* yv[] = {g, u};
    ops::matmul_shared_input(ex_, wv, 2, zin, n, yv);
    ops::situ_glu(ex_, g, u, n * I, situ.beta, situ.linear_beta, g);
    ops::matmul(ex_, ew.down, g, n, ye);
  };
  const auto add_expert = [&](int64_t i, int32_t e) {
    const int64_t n = n_rows(e), s0 = m.start[size_t(e)];
    const float* ye = m.ye.data() + m.ro[size_t(i)] * latent;
    for (int64_t k = 0; k < n; ++k)
      put_expert(agg, m.rows[size_t(s0 + k)], m.js[size_t(s0 + k)], m.wts[size_t(s0 + k)], ye + k * latent, latent);
  };
  // One row: every selected expert reads the same z, so the gate/up products of all of them are
  // one shared-input GEMV region and their down products one more (each on its own activation).
  // The rows of all the experts are handed out in chunks, so the threads finish together, and z is
  // quantised once, not once per expert. Same kernels and per-row arithmetic as expert_out.
  const auto run_token = [&](const int32_t* ids, int64_t n, const GluWeights* const* ew) {
    m.wv.clear(), m.xv.clear(), m.yv.clear();
    for (int64_t i = 0; i < n; ++i) {
      m.wv.push_back(&ew[i]->gate), m.wv.push_back(&ew[i]->up);
      m.yv.push_back(m.g.data() + m.io[size_t(i)]), m.yv.push_back(m.u.data() + m.io[size_t(i)]);
    }
    ops::matmul_shared_input(ex_, m.wv.data(), 2 * n, z, 1, m.yv.data());
    ops::situ_glu(ex_, m.g.data(), m.u.data(), m.io[size_t(n)], situ.beta, situ.linear_beta, m.g.data());
    m.wv.clear(), m.yv.clear();
    for (int64_t i = 0; i < n; ++i) {
      m.wv.push_back(&ew[i]->down);
      m.xv.push_back(m.g.data() + m.io[size_t(i)]);
      m.yv.push_back(m.ye.data() + i * latent);
    }
    ops::matmul_many(ex_, m.wv.data(), m.xv.data(), n, 1, m.yv.data());
    for (int64_t i = 0; i < n; ++i) add_expert(i, ids[i]);
  };
  // A batch of experts runs either one after another (each expert's matmuls split across the
  // threads) or, when there are enough experts to keep every thread busy, whole experts in
  // parallel (their matmuls then run single-threaded inside: a loop inside a loop runs inline). Outputs are
  // always added into agg in ascending expert order, so both ways give bit-identical results.
  const auto run_batch = [&](const int32_t* ids, int64_t n, const GluWeights* const* ew) {
    plan(ids, n, ew);
    if (R == 1) return run_token(ids, n, ew);
    if (n < 2 * int64_t(par::max_threads()) || par::in_parallel()) {
      for (int64_t i = 0; i < n; ++i) {
        expert_out(i, ids[i], *ew[i]);
        add_expert(i, ids[i]);
      }
      return;
    }
    // Which thread takes which expert varies from step to step, so every thread that joins the loop
    // sizes its GEMM buffers for the largest expert of the batch first (a repeated step then
    // allocates nothing).
    int64_t most = 0, widest = latent;
    bool bf16 = false;
    for (int64_t i = 0; i < n; ++i) {
      most = std::max(most, n_rows(ids[i]));
      widest = std::max(widest, ew[i]->gate.rows);
      bf16 = bf16 || ew[i]->gate.fmt == WFormat::BF16 || ew[i]->down.fmt == WFormat::BF16;
    }
    par::parallel_for_each_setup(
        n, [&] { ops::reserve_matmul(most, 2, widest, widest, bf16); },
        [&](int64_t i) { expert_out(i, ids[i], *ew[i]); });
    for (int64_t i = 0; i < n; ++i) add_expert(i, ids[i]);
  };
  const auto nsel = int64_t(m.selected.size());
  if (!source) {
    m.ew.clear();
    for (int32_t e : m.selected) m.ew.push_back(&w.experts[size_t(e)]);
    run_batch(m.selected.data(), nsel, m.ew.data());
  } else {
    const int64_t batch = std::max<int64_t>(1, source->max_batch());
    m.ew.resize(size_t(std::min(batch, nsel)));
    for (int64_t b = 0; b < nsel; b += batch) {
      const int64_t n = std::min(batch, nsel - b);
      source->fetch(w.layer, m.selected.data() + b, n, m.ew.data());
      run_batch(m.selected.data() + b, n, m.ew.data());
    }
  }
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace k3
