// Sublayer forward passes over the Backend ops (see layers.h); each reads top to bottom like spec §3.
#include "model/layers.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace k3 {

// ---------------------------------------------------------------- split models
int64_t RankRole::gather_floats(int64_t R) const {
  const auto g = [](int64_t n) { return (n + 15) & ~int64_t(15); };
  // moe_routed_expert_parallel: the terms, this rank's packed for sending, everyone's gathered.
  const int64_t ep = experts_split ? 3 * g(R * moe_top_k * moe_latent) : 0;
  if (!heads_split) return ep;
  // project_out: the gathered input, this rank's output rows, and a gather's send and receive
  // buffers (each rank's part padded to the widest), for the widest cut.
  int64_t widest = 0, part = 0;
  for (const auto& p : parts) {
    int64_t sum = 0;
    for (int64_t w : p) sum += w, part = std::max(part, w);
    widest = std::max(widest, sum);
  }
  // (the MoE and the output projections run one after the other: the larger of the two)
  return std::max(ep, g(R * widest) + g(R * part) + g(R * part) + g(int64_t(ranks) * R * part));
}

namespace {
// x [R, parts[rank]] on every rank -> out [R, Σ parts] on every rank, rank q's columns after rank
// q-1's (one all-gather of each rank's part padded to the widest, then the columns put in place).
void gather_columns(const StepCtx& c, const float* x, const std::vector<int64_t>& parts, float* out) {
  const RankRole& role = *c.role;
  const int64_t R = c.R, mine = parts[size_t(role.rank)];
  int64_t wide = 0, total = 0;
  for (int64_t w : parts) wide = std::max(wide, w), total += w;
  const WorkScope scope(c.work);
  float *send = c.work.take(R * wide), *recv = c.work.take(int64_t(parts.size()) * R * wide);
  for (int64_t r = 0; r < R; ++r) c.be.copy(send + r * wide, x + r * mine, size_t(mine) * 4);
  c.be.all_gather(*role.comm, send, R * wide, recv);
  int64_t off = 0;
  for (size_t q = 0; q < parts.size(); ++q) {
    for (int64_t r = 0; r < R; ++r)
      c.be.copy(out + r * total + off, recv + (int64_t(q) * R + r) * wide, size_t(parts[q]) * 4);
    off += parts[q];
  }
}
}  // namespace

namespace {
// Expert parallel routed experts: each rank computes its experts' outputs for the rows routed to
// them (moe_routed's terms), the ranks gather every term (each (row, j) from the rank that holds its
// expert), and every rank sums each row's terms in ascending expert id (moe_combine): the additions
// of one rank, so the same bits, with the experts of the ranks computed at the same time.
void moe_routed_expert_parallel(const StepCtx& c, const MoeDims& d, const MoeWeights& w, const float* z,
                                const int32_t* idx, const float* wt, float* agg, ExpertSource* experts) {
  const RankRole& role = *c.role;
  Backend& be = c.be;
  const int64_t R = c.R, K = d.top_k, L = d.latent, RK = R * K;
  const WorkScope scope(c.work);
  float *terms = c.work.take(RK * L), *send = c.work.take(RK * L), *recv = c.work.take(RK * L);
  // Host-side plan (kept per thread: a rank of a split over processes steps on one thread, so a steady
  // step allocates nothing there):
  // who holds each (row, j), this rank's slots in (row, j) order, and where each slot arrives.
  thread_local std::vector<int32_t> ids, mine, from, seen;
  thread_local std::vector<int64_t> first, counts;
  const auto Q = int64_t(role.expert_parts.size());
  first.assign(size_t(Q + 1), 0);
  for (int64_t q = 0; q < Q; ++q) first[size_t(q + 1)] = first[size_t(q)] + role.expert_parts[size_t(q)];
  ids.resize(size_t(RK));
  be.download(ids.data(), idx, size_t(RK) * sizeof(int32_t));
  const auto owner = [&](int32_t e) {
    const auto it = std::upper_bound(first.begin(), first.end(), int64_t(e));
    if (e < 0 || it == first.end())
      fail("MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(first.back()));
    return int64_t(it - first.begin()) - 1;
  };
  counts.assign(size_t(Q), 0);
  mine.clear();
  from.resize(size_t(RK));
  for (int64_t s = 0; s < RK; ++s) {
    const int64_t q = owner(ids[size_t(s)]);
    from[size_t(s)] = int32_t(counts[size_t(q)]);  // its place among rank q's, made absolute below
    ++counts[size_t(q)];
    if (q == role.rank) mine.push_back(int32_t(s));
  }
  seen.assign(size_t(Q), 0);
  for (int64_t q = 1; q < Q; ++q) seen[size_t(q)] = seen[size_t(q - 1)] + int32_t(counts[size_t(q - 1)]);
  for (int64_t s = 0; s < RK; ++s) from[size_t(s)] += seen[size_t(owner(ids[size_t(s)]))];
  for (int64_t& n : counts) n *= L;
  be.moe_routed(w, L, d.situ, z, idx, wt, R, K, agg, experts, terms);
  be.gather_rows(terms, mine.data(), int64_t(mine.size()), L, send);
  be.all_gather_v(*role.comm, send, int64_t(mine.size()) * L, recv, counts.data());
  be.gather_rows(recv, from.data(), RK, L, terms);
  be.moe_combine(terms, idx, wt, R, K, L, agg);
}
}  // namespace

void project_out(const StepCtx& c, const WeightMat& W, const float* x, RankRole::Cut in, float* out) {
  if (!c.heads_split()) return c.be.matmul(W, x, c.R, out);
  const RankRole& role = *c.role;
  const WorkScope scope(c.work);
  int64_t cols = 0;
  for (int64_t w : role.parts[in]) cols += w;
  if (W.cols != cols) fail("internal error: a split output projection whose input is not its columns");
  float* xf = c.work.take(c.R * cols);
  gather_columns(c, x, role.parts[in], xf);
  float* y = c.work.take(c.R * W.rows);
  c.be.matmul(W, xf, c.R, y);
  gather_columns(c, y, role.parts[RankRole::Hidden], out);
}

// ---------------------------------------------------------------- workspace
Workspace::Workspace(Backend& be, int64_t floats) : be_(&be), cap_(floats) {
  base_ = static_cast<float*>(be.alloc(size_t(std::max<int64_t>(floats, 1)) * 4, "activation workspace"));
}
Workspace::~Workspace() {
  if (be_) be_->release(base_);
}
float* Workspace::take(int64_t n) {
  // 16-float (64-byte) granules keep every buffer cache-line aligned for the SIMD kernels.
  const int64_t need = (n + 15) & ~int64_t(15);
  if (used_ + need > cap_)
    fail("internal error: activation workspace overrun (" + std::to_string(used_ + need) + " > " +
         std::to_string(cap_) + " floats planned)");
  float* p = base_ + used_;
  used_ += need;
  peak_ = std::max(peak_, used_);
  return p;
}

namespace {
int64_t granule(int64_t n) { return (n + 15) & ~int64_t(15); }
}  // namespace

int64_t kda_work_floats(const KdaDims& d, int64_t R) {
  const int64_t C = d.dim();
  return 10 * granule(R * C) + 2 * granule(R * d.head_dim) + granule(R * d.heads);
}
int64_t mla_work_floats(const MlaDims& d, int64_t R) {
  const int64_t HV = d.heads * d.v;
  return granule(R * d.q_lora) + granule(R * d.heads * (d.nope + d.rope)) + granule(R * (d.kv_lora + d.rope)) +
         2 * granule(R * HV);
}
int64_t glu_work_floats(int64_t inter, int64_t R) { return 2 * granule(R * inter); }
int64_t moe_work_floats(const MoeDims& d, int64_t shared_inter, int64_t R) {
  return granule(R * d.experts) + 2 * granule(R * d.top_k) + 2 * granule(R * d.latent) + 2 * granule(R * shared_inter) +
         granule(R * d.hidden);
}

// ---------------------------------------------------------------- KDA
void kda_sublayer(const StepCtx& c, const KdaDims& d, const KdaWeights& w, const KdaPool& st, const float* x,
                  KdaAlgo algo, int64_t chunk, float* out) {
  const WorkScope scope(c.work);
  Backend& be = c.be;
  const int64_t R = c.R, C = d.dim(), H = d.heads, D = d.head_dim;
  float *qh = c.work.take(R * C), *kh = c.work.take(R * C), *vh = c.work.take(R * C), *fa = c.work.take(R * D),
        *f = c.work.take(R * C), *b = c.work.take(R * H), *r = c.work.take(R * C), *ga = c.work.take(R * D);
  // Projections from the same normed x; the output gate is full rank (K3) or low rank (g_b · g_a x).
  {
    const WeightMat* ws[] = {&w.q_proj,   &w.k_proj, &w.v_proj,
                             &w.f_a_proj, &w.b_proj, d.low_rank_gate ? &w.g_a_proj : &w.g_proj};
    float* ys[] = {qh, kh, vh, fa, b, d.low_rank_gate ? ga : r};
    be.matmul_shared_input(ws, 6, x, R, ys, nullptr);
  }
  if (d.low_rank_gate) {
    const WeightMat* wv[] = {&w.f_b_proj, &w.g_b_proj};
    const float* xv[] = {fa, ga};
    float* yv[] = {f, r};
    be.matmul_many(wv, xv, 2, R, yv);
  } else {
    be.matmul(w.f_b_proj, fa, R, f);
  }
  // Causal short conv + SiLU with carried history, then L2 norm of q and k (q also × D^-1/2); the
  // decay gate (bounded below for K3, unbounded for Kimi Linear: d.lower_bound 0) and β.
  float *q = c.work.take(R * C), *k = c.work.take(R * C), *v = c.work.take(R * C), *g = c.work.take(R * C);
  be.kda_prepare(KdaPrepare{qh,
                            kh,
                            vh,
                            q,
                            k,
                            v,
                            {w.q_conv.data(), w.k_conv.data(), w.v_conv.data()},
                            {st.conv[0], st.conv[1], st.conv[2]},
                            C,
                            H,
                            D,
                            d.conv_k,
                            float(1.0 / std::sqrt(double(D))),
                            1e-6f,
                            f,
                            w.A_log.data(),
                            w.dt_bias.data(),
                            d.lower_bound,
                            g,
                            b},
                 c.seqs, R);
  // Delta-rule recurrence per sequence (chunked for multi-row chunks; both give the same numbers).
  float* o = c.work.take(R * C);
  be.kda(q, k, v, g, b, c.seqs, H, D, D, algo, chunk, st.S, o);
  // Per-head RMSNorm first, then the sigmoid gate, then o_proj (§6.4 trap 6).
  be.rmsnorm_gate(o, R * H, D, w.o_norm.data(), d.norm_eps, r, o);
  project_out(c, w.o_proj, o, RankRole::KdaCols, out);
}

// ---------------------------------------------------------------- MLA
void mla_sublayer(const StepCtx& c, const MlaDims& d, const MlaWeights& w, const MlaPages& cache, const float* x,
                  MlaAlgo algo, float* out) {
  const WorkScope scope(c.work);
  Backend& be = c.be;
  const int64_t R = c.R, dq = d.nope + d.rope, HV = d.heads * d.v, kva = d.kv_lora + d.rope;
  float *qa = c.work.take(R * d.q_lora), *q = c.work.take(R * d.heads * dq), *ckv = c.work.take(R * kva),
        *a = c.work.take(R * HV), *gt = c.work.take(R * HV);
  // The projections of x: W_qa x (or q = W_q x without a query LoRA), W_kva x and (gated) the
  // output gate W_g x.
  {
    const bool lora = d.q_lora > 0;
    const WeightMat* ws[] = {lora ? &w.q_a_proj : &w.q_proj, &w.kv_a_proj, &w.g_proj};
    float* ys[] = {lora ? qa : q, ckv, gt};
    be.matmul_shared_input(ws, d.output_gate ? 3 : 2, x, R, ys, nullptr);
  }
  // q = W_qb · RMSNorm_{1e-6}(W_qa x)
  if (d.q_lora > 0) {
    be.rmsnorm(qa, R, d.q_lora, w.q_a_norm.data(), d.lora_eps, qa);
    be.matmul(w.q_b_proj, qa, R, q);
  }
  // c = RMSNorm_{1e-6}(ckv[:kv_lora]) ; k_r = ckv[kv_lora:] (raw, unrotated, shared), into the cache.
  be.mla_append(ckv, c.seqs, d.kv_lora, d.rope, w.kv_a_norm.data(), d.lora_eps, cache);
  const MlaAttnDims ad{d.heads, d.nope, d.rope, d.v, d.kv_lora, float(1.0 / std::sqrt(double(dq)))};
  be.mla_attend(q, c.seqs, cache, w.kv_b_proj, ad, algo, a);
  // Output gate before o_proj, no norm.
  if (d.output_gate) be.sigmoid_mul(a, gt, R * HV);
  project_out(c, w.o_proj, a, RankRole::MlaCols, out);
}

// ---------------------------------------------------------------- FFNs
void glu_sublayer(const StepCtx& c, const GluWeights& w, const SituParams& p, const float* x, float* out) {
  const WorkScope scope(c.work);
  const int64_t I = w.gate.rows;
  float *g = c.work.take(c.R * I), *u = c.work.take(c.R * I);
  {
    const WeightMat* ws[] = {&w.gate, &w.up};
    float* ys[] = {g, u};
    c.be.matmul_shared_input(ws, 2, x, c.R, ys, nullptr);
  }
  c.be.situ_glu(g, u, c.R * I, p.beta, p.linear_beta, g);
  project_out(c, w.down, g, RankRole::DenseInter, out);
}

bool moe_sublayer(const StepCtx& c, const MoeDims& d, const MoeWeights& w, const float* x, float* out,
                  ExpertSource* experts, float* shared_out) {
  const WorkScope scope(c.work);
  Backend& be = c.be;
  const int64_t R = c.R;
  const bool shared = !w.shared.gate.empty();
  const int64_t Is = shared ? w.shared.gate.rows : 0;
  float *logits = c.work.take(R * d.experts), *wt = c.work.take(R * d.top_k), *z = c.work.take(R * d.latent),
        *agg = c.work.take(R * d.latent), *sg = c.work.take(R * Is), *su = c.work.take(R * Is),
        *sh = c.work.take(R * d.hidden);
  auto* idx = reinterpret_cast<int32_t*>(c.work.take(R * d.top_k));
  // The products of x: router logits, the latent down-projection and the shared experts' gate/up.
  // The router reads unrounded activations in every numerics: a bf16-rounded input can flip a
  // near-tie in the top-k selection, which changes the output by a whole expert. Experts in the
  // hidden space (Kimi Linear) read x itself and add into `out` directly.
  const bool lat = d.latent_proj;
  if (!lat) z = const_cast<float*>(x), agg = out;  // read only / written by moe_routed
  {
    const WeightMat* ws[] = {&w.gate, &w.shared.gate, &w.shared.up, &w.down_lat};
    float* ys[] = {logits, sg, su, z};
    const bool fp32[] = {true, false, false, false};
    // (gate, shared gate, shared up, latent down) with the absent ones left out
    const WeightMat* wsel[4];
    float* ysel[4];
    bool fsel[4];
    int64_t n = 0;
    for (int i = 0; i < 4; ++i) {
      if ((i == 1 || i == 2) && !shared) continue;
      if (i == 3 && !lat) continue;
      wsel[n] = ws[i], ysel[n] = ys[i], fsel[n] = fp32[i], ++n;
    }
    be.matmul_shared_input(wsel, n, x, R, ysel, fsel);
  }
  // Router: sigmoid scores, bias for selection only, renormalised unbiased weights.
  be.router_topk(logits, w.bias.empty() ? nullptr : w.bias.data(), R, d.experts, d.top_k, d.renormalize, d.routed_scale,
                 idx, wt);
  // Routed experts in the latent space (the backend's strategy: grouped by expert, streamed, ...).
  // Split by expert over ranks: moe_routed_expert_parallel (the same bits as one rank).
  if (!c.experts_split())
    be.moe_routed(w, d.latent, d.situ, z, idx, wt, R, d.top_k, agg, experts);
  else
    moe_routed_expert_parallel(c, d, w, z, idx, wt, agg, experts);
  const int64_t n = R * d.hidden;
  // RMSNorm on the aggregate, then up to full width; the shared experts' down-projection on the
  // full-width input alongside, added unweighted.
  {
    MoeTail t;
    if (d.latent_norm) t.agg = agg, t.latent = d.latent, t.norm_w = w.lat_norm.data(), t.eps = d.norm_eps;
    if (shared) t.g = sg, t.u = su, t.n_situ = R * Is, t.b1 = d.situ.beta, t.b2 = d.situ.linear_beta;
    be.moe_tail(t, R);
  }
  if (!lat) {  // the routed sum is already in `out`; the shared experts are added to it
    if (shared) {
      project_out(c, w.shared.down, sg, RankRole::SharedInter, sh);
      be.add(out, sh, n);
    }
    return false;
  }
  if (shared && c.heads_split()) {  // the shared experts' intermediate is cut: their own projection
    be.matmul(w.up_lat, agg, R, out);
    project_out(c, w.shared.down, sg, RankRole::SharedInter, sh);
    be.add(out, sh, n);
    return false;
  }
  // The shared experts' down-projection into shared_out when the caller takes it (its add then
  // happens in the next residual site), else into sh and added here.
  const bool leave = shared && shared_out;
  {
    const WeightMat* wv[] = {&w.up_lat, &w.shared.down};
    const float* xv[] = {agg, sg};
    float* yv[] = {out, leave ? shared_out : sh};
    be.matmul_many(wv, xv, shared ? 2 : 1, R, yv);
  }
  if (shared && !leave) be.add(out, sh, n);
  return leave;
}

// ---------------------------------------------------------------- AttnRes
void BlockList::push_back(const float* p) {
  if (n == kMaxBlocks) fail("Block AttnRes: more than 63 block snapshots are not supported");
  at[n++] = p;
}

void attnres_site(const StepCtx& c, const AttnResSite& site, const DepthState& st, int64_t hidden, float eps,
                  float* out) {
  const float* src[64];
  size_t n = 0;
  if (st.blocks.size() + 1 > 64) fail("Block AttnRes: more than 63 block snapshots are not supported");
  for (const float* b : st.blocks) src[n++] = b;
  if (!st.partial_empty) src[n++] = st.partial;
  c.be.attnres_mix(src, int64_t(n), c.R, hidden, site.fold.data(), eps, out);
}

void residual_site(const StepCtx& c, DepthState& st, float* y, const float* y2, const AttnResSite* mix,
                   const float* norm_w, int64_t hidden, float eps, float* a, float* xn) {
  if (!y && st.partial_empty) fail("internal error: a residual site over an empty partial sum");
  if (y2 && !y) fail("internal error: a residual site's second part without the first");
  ResidualNorm p;
  p.partial = st.partial;
  p.y = y;
  p.y2 = y2;
  p.y_replaces = st.partial_empty;
  if (mix) {
    p.blocks = st.blocks.begin();
    p.n_blocks = int64_t(st.blocks.size());
    p.fold = mix->fold.data();
    p.mix_eps = eps;
  }
  p.norm_w = norm_w;
  p.norm_eps = eps;
  p.a = a;
  p.xn = xn;
  c.be.residual_norm(p, c.R, hidden);
  st.partial_empty = false;
}

void settle_depth(const StepCtx& c, DepthState& st, int64_t hidden) {
  if (!st.pending) return;
  const int64_t n = c.R * hidden;
  if (st.pending2) c.be.add(st.pending, st.pending2, n);  // the FFN's own add, as without the second part
  st.pending2 = nullptr;
  if (st.partial_empty)
    c.be.copy(st.partial, st.pending, size_t(n) * 4);
  else
    c.be.add(st.partial, st.pending, n);
  st.pending = nullptr;
  st.partial_empty = false;
}

void Backend::residual_norm(const ResidualNorm& p, int64_t R, int64_t H) {
  const int64_t n = R * H;
  if (p.y2) add(p.y, p.y2, n);  // the FFN's own add (y = out, y2 = the shared experts), then as before
  if (p.y) {
    if (p.y_replaces)
      copy(p.partial, p.y, size_t(n) * 4);
    else
      add(p.partial, p.y, n);
  }
  const float* x = p.partial;
  if (p.fold) {
    const float* src[BlockList::kMaxBlocks + 1];
    if (p.n_blocks < 0 || p.n_blocks > int64_t(BlockList::kMaxBlocks))
      fail("Block AttnRes: more than 63 block snapshots are not supported");
    for (int64_t j = 0; j < p.n_blocks; ++j) src[j] = p.blocks[j];
    src[p.n_blocks] = p.partial;
    attnres_mix(src, p.n_blocks + 1, R, H, p.fold, p.mix_eps, p.a);
    x = p.a;
  }
  rmsnorm(x, R, H, p.norm_w, p.norm_eps, p.xn);
}

}  // namespace k3
