// Sublayer forward passes (see layers.h); each reads top to bottom like spec §3.
#include "model/layers.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/cpu/isa.h"

namespace k3 {

namespace {
using Buf = std::vector<float>;
Buf buf(int64_t n) { return Buf(static_cast<size_t>(n)); }
}  // namespace

// ---------------------------------------------------------------- KDA
void KdaState::reset(const KdaDims& d) {
  S.assign(static_cast<size_t>(d.heads * d.head_dim * d.head_dim), 0.0f);
  const auto conv = static_cast<size_t>(d.dim() * (d.conv_k - 1));
  conv_q.assign(conv, 0.0f);
  conv_k.assign(conv, 0.0f);
  conv_v.assign(conv, 0.0f);
}

void kda_forward(const KdaDims& d, const KdaWeights& w, KdaState& st, const float* x, int64_t T, KdaAlgo algo,
                 int64_t chunk, float* out) {
  const int64_t C = d.dim(), H = d.heads, D = d.head_dim;
  if (st.S.empty()) st.reset(d);
  // Projections from the same normed x.
  Buf qh = buf(T * C), kh = buf(T * C), vh = buf(T * C), fa = buf(T * D), f = buf(T * C), b = buf(T * H),
      r = buf(T * C);
  {
    const WeightMat* ws[] = {&w.q_proj, &w.k_proj, &w.v_proj, &w.f_a_proj, &w.b_proj, &w.g_proj};
    float* ys[] = {qh.data(), kh.data(), vh.data(), fa.data(), b.data(), r.data()};
    ops::matmul_shared_input(ws, 6, x, T, ys);
  }
  ops::matmul(w.f_b_proj, fa.data(), T, f.data());
  // Causal short conv + SiLU with carried history, then L2 norm of q and k (q also × D^-1/2).
  Buf q = buf(T * C), k = buf(T * C), v = buf(T * C);
  ops::short_conv_silu(qh.data(), T, C, w.q_conv.data(), d.conv_k, st.conv_q.data(), q.data());
  ops::short_conv_silu(kh.data(), T, C, w.k_conv.data(), d.conv_k, st.conv_k.data(), k.data());
  ops::short_conv_silu(vh.data(), T, C, w.v_conv.data(), d.conv_k, st.conv_v.data(), v.data());
  ops::l2norm_scale(q.data(), T * H, D, 1e-6f, float(1.0 / std::sqrt(double(D))));
  ops::l2norm_scale(k.data(), T * H, D, 1e-6f, 1.0f);
  // Lower-bound decay gate and β.
  Buf g = buf(T * C);
  ops::kda_gate(f.data(), T, H, D, w.A_log.data(), w.dt_bias.data(), d.lower_bound, g.data());
  for (float& bi : b) bi = 1.0f / (1.0f + std::exp(-bi));
  // Delta-rule recurrence (the chunked form is used for prefill; both give the same numbers).
  Buf o = buf(T * C);
  if (algo == KdaAlgo::Chunked && T > 1)
    ops::kda_chunked(q.data(), k.data(), v.data(), g.data(), b.data(), T, H, D, D, chunk, st.S.data(), o.data());
  else
    ops::kda_recurrent(q.data(), k.data(), v.data(), g.data(), b.data(), T, H, D, D, st.S.data(), o.data());
  // Per-head RMSNorm first, then the sigmoid gate, then o_proj (§6.4 trap 6).
  ops::rmsnorm(o.data(), T * H, D, w.o_norm.data(), d.norm_eps, o.data());
  for (int64_t i = 0; i < T * C; ++i) o[size_t(i)] *= 1.0f / (1.0f + std::exp(-r[size_t(i)]));
  ops::matmul(w.o_proj, o.data(), T, out);
}

// ---------------------------------------------------------------- MLA
void mla_forward(const MlaDims& d, const MlaWeights& w, MlaCache& cache, const float* x, int64_t T, MlaAlgo algo,
                 float* out) {
  const int64_t dq = d.nope + d.rope, HV = d.heads * d.v;
  // The projections of x: W_qa x, W_kva x and (gated) the output gate W_g x.
  const int64_t kva = d.kv_lora + d.rope;
  Buf qa = buf(T * d.q_lora), q = buf(T * d.heads * dq), ckv = buf(T * kva), gt = buf(d.output_gate ? T * HV : 0);
  {
    const WeightMat* ws[] = {&w.q_a_proj, &w.kv_a_proj, &w.g_proj};
    float* ys[] = {qa.data(), ckv.data(), gt.data()};
    ops::matmul_shared_input(ws, d.output_gate ? 3 : 2, x, T, ys);
  }
  // q = W_qb · RMSNorm_{1e-6}(W_qa x)
  ops::rmsnorm(qa.data(), T, d.q_lora, w.q_a_norm.data(), d.lora_eps, qa.data());
  ops::matmul(w.q_b_proj, qa.data(), T, q.data());
  // c = RMSNorm_{1e-6}(ckv[:kv_lora]) ; k_r = ckv[kv_lora:] (raw, unrotated, shared)
  const int64_t pos0 = cache.len;
  cache.c.resize(static_cast<size_t>((pos0 + T) * d.kv_lora));
  cache.kr.resize(static_cast<size_t>((pos0 + T) * d.rope));
  for (int64_t t = 0; t < T; ++t) {
    ops::rmsnorm(ckv.data() + t * kva, 1, d.kv_lora, w.kv_a_norm.data(), d.lora_eps,
                 cache.c.data() + (pos0 + t) * d.kv_lora);
    std::memcpy(cache.kr.data() + (pos0 + t) * d.rope, ckv.data() + t * kva + d.kv_lora, size_t(d.rope) * 4);
  }
  cache.len = pos0 + T;
  const int64_t S = cache.len;

  MlaAttnDims ad{d.heads, d.nope, d.rope, d.v, d.kv_lora, float(1.0 / std::sqrt(double(dq)))};
  Buf a = buf(T * HV);
  if (algo == MlaAlgo::Absorbed) {
    ops::mla_attend_absorbed(q.data(), T, cache.c.data(), cache.kr.data(), S, pos0, w.kv_b_proj, ad, a.data());
  } else {
    // Expand every cached latent into per-head k_nope and v (what a non-absorbed engine caches).
    const int64_t per_head = d.nope + d.v;
    Buf kv = buf(S * d.heads * per_head), kn = buf(S * d.heads * d.nope), vv = buf(S * HV);
    ops::matmul(w.kv_b_proj, cache.c.data(), S, kv.data());
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < d.heads; ++h) {
        const float* src = kv.data() + (s * d.heads + h) * per_head;
        std::memcpy(kn.data() + (s * d.heads + h) * d.nope, src, size_t(d.nope) * 4);
        std::memcpy(vv.data() + (s * d.heads + h) * d.v, src + d.nope, size_t(d.v) * 4);
      }
    ops::mla_attend_expanded(q.data(), T, kn.data(), cache.kr.data(), vv.data(), S, pos0, ad, a.data());
  }
  // Output gate before o_proj, no norm.
  if (d.output_gate) {
    for (int64_t i = 0; i < T * HV; ++i) a[size_t(i)] *= 1.0f / (1.0f + std::exp(-gt[size_t(i)]));
  }
  ops::matmul(w.o_proj, a.data(), T, out);
}

// ---------------------------------------------------------------- FFNs
void glu_forward(const GluWeights& w, const SituParams& p, const float* x, int64_t T, float* out) {
  const int64_t I = w.gate.rows;
  Buf g = buf(T * I), u = buf(T * I);
  {
    const WeightMat* ws[] = {&w.gate, &w.up};
    float* ys[] = {g.data(), u.data()};
    ops::matmul_shared_input(ws, 2, x, T, ys);
  }
  ops::situ_glu(g.data(), u.data(), T * I, p.beta, p.linear_beta, g.data());
  ops::matmul(w.down, g.data(), T, out);
}

void moe_forward(const MoeDims& d, const MoeWeights& w, const float* x, int64_t T, float* out, ExpertSource* experts) {
  // The products of x: router logits, the latent down-projection and the shared experts' gate/up.
  // Router (fp32): sigmoid scores, bias for selection only, renormalised unbiased weights. Never on
  // rounded activations: a bf16-rounded input can flip a near-tie in the top-k selection, which
  // changes the output by a whole expert (engines keep the router in fp32 for the same reason).
  // A decode step's non-MXFP4 router is fp32 in every numerics (fast_applies), so it joins the
  // others there; otherwise it runs alone with Fast -> F32 (Exact stays Exact).
  const bool shared = !w.shared.gate.empty();
  const int64_t Is = shared ? w.shared.gate.rows : 0;
  Buf logits = buf(T * d.experts), z = buf(T * d.latent), agg(static_cast<size_t>(T * d.latent), 0.0f),
      sg = buf(T * Is), su = buf(T * Is);
  const bool router_joins = T == 1 && w.gate.fmt != WFormat::MXFP4;
  {
    const WeightMat* ws[] = {&w.gate, &w.down_lat, &w.shared.gate, &w.shared.up};
    float* ys[] = {logits.data(), z.data(), sg.data(), su.data()};
    const int first = router_joins ? 0 : 1;
    ops::matmul_shared_input(ws + first, (shared ? 4 : 2) - first, x, T, ys + first);
  }
  if (!router_joins) {
    const ops::NumericsScope router(ops::current_numerics() == ops::Numerics::Fast ? ops::Numerics::F32
                                                                                  : ops::current_numerics());
    ops::matmul(w.gate, x, T, logits.data());
  }
  std::vector<int32_t> idx(static_cast<size_t>(T * d.top_k));
  Buf wt = buf(T * d.top_k);
  for (int64_t t = 0; t < T; ++t)
    ops::router_topk(logits.data() + t * d.experts, w.bias.empty() ? nullptr : w.bias.data(), d.experts, d.top_k,
                     d.renormalize, d.routed_scale, idx.data() + t * d.top_k, wt.data() + t * d.top_k);
  // Routed experts in the latent space; grouped by expert so each expert's weights are read once.
  // Per selected expert (ascending id): the token rows routed to it and their weights.
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(d.experts));
  std::vector<Buf> ws(static_cast<size_t>(d.experts));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d.top_k; ++j) {
      const int32_t e = idx[size_t(t * d.top_k + j)];
      rows[size_t(e)].push_back(t);
      ws[size_t(e)].push_back(wt[size_t(t * d.top_k + j)]);
    }
  std::vector<int32_t> selected;  // the union, ascending: the accumulation order into agg
  for (int64_t e = 0; e < d.experts; ++e)
    if (!rows[size_t(e)].empty()) selected.push_back(int32_t(e));
  // One expert on the token rows routed to it (gathered), and its weighted add into agg.
  const auto expert_out = [&](int32_t e, const GluWeights& ew) {
    const std::vector<int64_t>& r = rows[size_t(e)];
    const auto n = int64_t(r.size());
    Buf zin = buf(n * d.latent), ye = buf(n * d.latent);
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(zin.data() + i * d.latent, z.data() + r[size_t(i)] * d.latent, size_t(d.latent) * 4);
    glu_forward(ew, d.situ, zin.data(), n, ye.data());
    return ye;
  };
  const auto add_expert = [&](int32_t e, const float* ye) {
    const std::vector<int64_t>& r = rows[size_t(e)];
    for (size_t i = 0; i < r.size(); ++i)
      for (int64_t c = 0; c < d.latent; ++c)
        agg[size_t(r[i] * d.latent + c)] += ws[size_t(e)][i] * ye[i * size_t(d.latent) + size_t(c)];
  };
  // One token: every selected expert reads the same z, so the gate/up products of all of them are
  // one shared-input GEMV region and their down products one more (each on its own activation).
  // The rows of all the experts are handed out in chunks, so the threads finish together (whole
  // experts per thread left one thread waiting up to an expert's read at the end), and z is
  // quantised once, not once per expert. Same kernels and per-row arithmetic as expert_out.
  const auto run_token = [&](const int32_t* ids, int64_t n, const GluWeights* const* ew) {
    std::vector<int64_t> off(static_cast<size_t>(n + 1), 0);  // of each expert's intermediate
    for (int64_t i = 0; i < n; ++i) off[size_t(i + 1)] = off[size_t(i)] + ew[i]->gate.rows;
    Buf h = buf(off.back()), u = buf(off.back()), ye = buf(n * d.latent);
    std::vector<const WeightMat*> wv;
    std::vector<const float*> xv;
    std::vector<float*> yv;
    for (int64_t i = 0; i < n; ++i) {
      wv.insert(wv.end(), {&ew[i]->gate, &ew[i]->up});
      yv.insert(yv.end(), {h.data() + off[size_t(i)], u.data() + off[size_t(i)]});
    }
    ops::matmul_shared_input(wv.data(), 2 * n, z.data(), 1, yv.data());
    ops::situ_glu(h.data(), u.data(), off.back(), d.situ.beta, d.situ.linear_beta, h.data());
    wv.clear(), yv.clear();
    for (int64_t i = 0; i < n; ++i) {
      wv.push_back(&ew[i]->down);
      xv.push_back(h.data() + off[size_t(i)]);
      yv.push_back(ye.data() + i * d.latent);
    }
    ops::matmul_many(wv.data(), xv.data(), n, 1, yv.data());
    for (int64_t i = 0; i < n; ++i) add_expert(ids[i], ye.data() + i * d.latent);
  };
  // A batch of experts runs either one after another (each expert's matmuls split across the
  // threads) or, when there are enough experts to keep every thread busy, whole experts in
  // parallel (their matmuls then run single-threaded inside: OpenMP nesting is off). Decode is the
  // second case: top-k GEMVs are each too small to split well. Outputs are always added into agg
  // in ascending expert order, so both ways give bit-identical results.
  const auto run_batch = [&](const int32_t* ids, int64_t n, const GluWeights* const* ew) {
    if (T == 1) return run_token(ids, n, ew);
    if (n < 2 * int64_t(omp_get_max_threads()) || omp_in_parallel()) {
      for (int64_t i = 0; i < n; ++i) add_expert(ids[i], expert_out(ids[i], *ew[i]).data());
      return;
    }
    std::vector<Buf> ye(static_cast<size_t>(n));
    const ops::Numerics numerics = ops::current_numerics();  // thread-local: hand it to the workers
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const ops::NumericsScope scope(numerics);
      ye[size_t(i)] = expert_out(ids[i], *ew[i]);
    }
    for (int64_t i = 0; i < n; ++i) add_expert(ids[i], ye[size_t(i)].data());
  };
  if (!experts) {
    std::vector<const GluWeights*> all;
    for (int32_t e : selected) all.push_back(&w.experts[size_t(e)]);
    run_batch(selected.data(), int64_t(selected.size()), all.data());
  } else {
    const auto nsel = int64_t(selected.size());
    const int64_t batch = std::max<int64_t>(1, experts->max_batch());
    std::vector<const GluWeights*> got(static_cast<size_t>(std::min(batch, nsel)));
    for (int64_t b = 0; b < nsel; b += batch) {
      const int64_t n = std::min(batch, nsel - b);
      experts->fetch(w.layer, selected.data() + b, n, got.data());
      run_batch(selected.data() + b, n, got.data());
    }
  }
  // RMSNorm on the aggregate, then up to full width; the shared experts' down-projection on the
  // full-width input alongside (one parallel region at decode), added unweighted.
  if (d.latent_norm) ops::rmsnorm(agg.data(), T, d.latent, w.lat_norm.data(), d.norm_eps, agg.data());
  Buf sh = buf(shared ? T * d.hidden : 0);
  if (shared) ops::situ_glu(sg.data(), su.data(), T * Is, d.situ.beta, d.situ.linear_beta, sg.data());
  {
    const WeightMat* wv[] = {&w.up_lat, &w.shared.down};
    const float* xv[] = {agg.data(), sg.data()};
    float* yv[] = {out, sh.data()};
    ops::matmul_many(wv, xv, shared ? 2 : 1, T, yv);
  }
  if (shared)
    for (int64_t i = 0; i < T * d.hidden; ++i) out[i] += sh[size_t(i)];
}

// ---------------------------------------------------------------- AttnRes
void attnres_site(const AttnResSite& site, const DepthState& st, int64_t T, int64_t hidden, float eps, float* out) {
  std::vector<const float*> src;
  for (const auto& b : st.blocks) src.push_back(b.data());
  if (!st.partial.empty()) src.push_back(st.partial.data());
  ops::attnres_mix(src.data(), int64_t(src.size()), T, hidden, site.fold.data(), eps, out);
}

}  // namespace k3
