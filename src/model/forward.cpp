// The K3 forward pass, written once for every backend: a step of many sequences (their rows packed,
// each sequence's state in its own slot), layer order and Block AttnRes (§3.3), final norm and
// lm_head (§3.9). The sublayers are model/layers.cpp; the ops behind them are the backend's.
// Must not: branch on the backend (capabilities are checked up front, strategies live in ops).
#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "model/model.h"

namespace k3 {

namespace {

StepNumerics step_numerics(ops::Numerics n) {
  switch (n) {
    case ops::Numerics::Exact:
      return StepNumerics::Exact;
    case ops::Numerics::F32:
      return StepNumerics::F32;
    case ops::Numerics::Fast:
      return StepNumerics::Fast;
  }
  return StepNumerics::Exact;
}

int64_t depth_slots(const ModelDims& d) { return d.block_size > 0 ? d.layers / d.block_size + 2 : 1; }

// y = the layer's attention sublayer of xn (on a split model, its output projection gathers the
// ranks' heads: model/layers.h project_out).
void attention_sublayer(const StepCtx& c, const ModelDims& d, int64_t L, const LayerWeights& w, const StatePool& pool,
                        const float* xn, float* y, const ForwardOptions& opt) {
  if (w.is_kda)
    kda_sublayer(c, d.kda, w.kda, pool.kda(L), xn, opt.kda_algo, opt.kda_chunk, y);
  else
    mla_sublayer(c, d.mla, w.mla, pool.mla(L), xn, opt.mla_algo, y);
}

// y = the layer's FFN of xn: the dense SiTU FFN or the MoE.
// Then the FFN's output is pending for the next site: y, and the MoE's shared experts in
// depth.ffn_extra when the caller lent it and the MoE left them there (depth.pending2).
void ffn_sublayer(const StepCtx& c, const ModelDims& d, const LayerWeights& w, const float* xn, float* y,
                  const ForwardOptions& opt, DepthState& depth) {
  bool second = false;
  if (w.dense_ffn)
    glu_sublayer(c, w.dense, d.situ, xn, y);
  else
    second = moe_sublayer(c, d.moe, w.moe, xn, y, opt.experts, depth.ffn_extra);
  depth.pending = y;
  depth.pending2 = second ? depth.ffn_extra : nullptr;
}

// The plain pre-norm residual stream (block_size 0, Kimi Linear): h += attn(norm(h)); h += ffn(norm(h)),
// each add fused with the norm after it (the FFN's output is added by the next layer's first site).
void plain_layer(const StepCtx& c, const ModelDims& d, int64_t L, const LayerWeights& w, const StatePool& pool,
                 DepthState& depth, float* a, float* xn, float* y, const ForwardOptions& opt) {
  const int64_t H = d.hidden;
  residual_site(c, depth, depth.pending, depth.pending2, nullptr, w.input_norm.data(), H, d.eps, a, xn);
  depth.pending = depth.pending2 = nullptr;
  attention_sublayer(c, d, L, w, pool, xn, y, opt);
  residual_site(c, depth, y, nullptr, nullptr, w.post_norm.data(), H, d.eps, a, xn);
  ffn_sublayer(c, d, w, xn, y, opt, depth);
}

}  // namespace

void decoder_layer(const StepCtx& c, const ModelDims& d, int64_t L, const LayerWeights& w, const StatePool& pool,
                   DepthState& depth, float* const* spare, float* a, float* xn, float* y, const ForwardOptions& opt) {
  if (d.block_size == 0) return plain_layer(c, d, L, w, pool, depth, a, xn, y, opt);
  const int64_t H = d.hidden;
  // 1. the previous layer's FFN output into the partial sum, the attention-site mix (pass-through
  //    while no block has been snapshotted: layer 0) and the input norm, as one op
  residual_site(c, depth, depth.pending, depth.pending2, depth.blocks.empty() ? nullptr : &w.attn_res,
                w.input_norm.data(), H, d.eps, a, xn);
  depth.pending = depth.pending2 = nullptr;
  // 2. snapshot the partial sum at block starts, then start a new block
  if (L % d.block_size == 0) {
    depth.blocks.push_back(depth.partial);
    depth.partial = spare[depth.blocks.size()];
    depth.partial_empty = true;
  }
  // 3. attention sublayer
  attention_sublayer(c, d, L, w, pool, xn, y, opt);
  // 4-6. its output into the partial sum, the FFN-site mix (always) and the post norm as one op; the FFN,
  //      whose output the next site adds (the next layer's step 1, or settle_depth after the last layer)
  residual_site(c, depth, y, nullptr, &w.mlp_res, w.post_norm.data(), H, d.eps, a, xn);
  ffn_sublayer(c, d, w, xn, y, opt, depth);
}

int64_t forward_work_floats(const ModelDims& d, int64_t R) {
  const auto g = [](int64_t n) { return (n + 15) & ~int64_t(15); };
  const int64_t H = d.hidden;
  // depth slots + a, xn, y, y2 (the MoE's shared experts, pending), h + the selected rows' hidden and logits
  int64_t fixed = (depth_slots(d) + 5) * g(R * H) + g(R * H) + g(R * d.vocab);
  const int64_t attn =
      std::max(d.kda_layers ? kda_work_floats(d.kda, R) : 0, d.mla_layers ? mla_work_floats(d.mla, R) : 0);
  const int64_t ffn =
      std::max(d.dense_inter ? glu_work_floats(d.dense_inter, R) : 0,
               d.moe.experts ? moe_work_floats(d.moe, d.shared_inter, R) + glu_work_floats(d.shared_inter, R) : 0);
  return fixed + std::max(attn, ffn);
}

void Model::step(StatePool& pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, float* logits,
                 int32_t* argmax) const {
  const int64_t V = dims_.vocab, N = int64_t(seqs.size());
  if (N == 0) fail("step: no sequences");
  if (!logits && !argmax && role_.rank == 0) fail("forward: logits output is null");
  // (A split model: its rank's backend, checked here before any rank is told of the step.)
  const Backend& be = split_ ? *split_->ranks[0]->backend_ : *backend_;
  const BackendCaps caps = be.caps();
  if (opt.numerics == ops::Numerics::Exact && !caps.exact)
    fail(std::string("--numerics exact (fp64 sums) is CPU-only; on ") + be.name() +
         " use --numerics fp32 (parity mode) or fast");
  if (opt.mla_algo == MlaAlgo::Expanded && !caps.expanded_mla)
    fail(std::string("--mla expanded is CPU-only; ") + be.name() + " runs MLA in the absorbed form");
  if (opt.experts && !caps.expert_source)
    fail(std::string("routed experts from an expert source (--ram-budget) are not supported on ") + be.name());
  if (opt.kda_chunk < 1) fail("KDA chunk size must be >= 1");
  for (int64_t i = 0; i < N; ++i) {
    const SeqStep& s = seqs[size_t(i)];
    pool.check_live(s.slot);
    if (s.n <= 0) fail("forward needs at least one token");
    for (int64_t j = 0; j < i; ++j)
      if (seqs[size_t(j)].slot == s.slot) fail("step: slot " + std::to_string(s.slot) + " appears twice in one step");
    for (int64_t t = 0; t < s.n; ++t)
      if (s.ids[t] < 0 || s.ids[t] >= V)
        fail("token id " + std::to_string(s.ids[t]) + " at position " + std::to_string(t) +
             " is outside the vocabulary [0, " + std::to_string(V) + ")");
  }
  if (split_) return step_split(pool, seqs, opt, logits, argmax);
  if (pool.ranks() > 1 && !role_.comm) fail("step: this state pool belongs to a split model (--tp/--ep)");
  // The output rows of each sequence (all its tokens, or its last), in order.
  StepIndex& x = ix_;
  std::vector<int64_t>& out0 = x.out0;
  out0.assign(size_t(N) + 1, 0);
  for (int64_t i = 0; i < N; ++i)
    out0[size_t(i) + 1] = out0[size_t(i)] + (seqs[size_t(i)].all_logits ? seqs[size_t(i)].n : 1);
  // Pieces of at most max_rows_ rows: every sequence contributes what is left of it, in order.
  std::vector<int64_t>& done = x.done;
  done.assign(size_t(N), 0);
  std::vector<SeqStep>& piece = x.piece;
  std::vector<int64_t>& src = x.src;
  for (;;) {
    piece.clear();
    src.clear();
    int64_t room = max_rows_;
    for (int64_t i = 0; i < N && room > 0; ++i) {
      const SeqStep& s = seqs[size_t(i)];
      const int64_t take = std::min(s.n - done[size_t(i)], room);
      if (take <= 0) continue;
      piece.push_back({s.slot, s.ids + done[size_t(i)], take, s.all_logits});
      src.push_back(i);
      room -= take;
    }
    if (piece.empty()) break;
    // Output rows of this piece: (row in piece, logits row or -1, argmax index or -1).
    std::vector<int32_t>& sel = x.sel;
    std::vector<int64_t>&dst = x.dst, &am = x.am;
    sel.clear(), dst.clear(), am.clear();
    int64_t row = 0;
    for (size_t p = 0; p < piece.size(); ++p) {
      const int64_t i = src[p], n = piece[p].n;
      const bool ends = done[size_t(i)] + n == seqs[size_t(i)].n;
      for (int64_t t = 0; t < n; ++t) {
        const bool last = ends && t == n - 1;
        if (piece[p].all_logits || last) {
          sel.push_back(int32_t(row + t));
          dst.push_back(piece[p].all_logits ? out0[size_t(i)] + done[size_t(i)] + t : out0[size_t(i)]);
          am.push_back(last ? i : -1);
        }
      }
      row += n;
      done[size_t(i)] += n;
    }
    run_piece(pool, piece, sel, dst, am, opt, logits, argmax);
  }
}

void Model::run_piece(StatePool& pool, std::span<const SeqStep> seqs, const std::vector<int32_t>& sel,
                      const std::vector<int64_t>& dst, const std::vector<int64_t>& am, const ForwardOptions& opt,
                      float* logits, int32_t* argmax) const {
  const ModelDims& d = dims_;
  const int64_t N = int64_t(seqs.size()), H = d.hidden, V = d.vocab;
  Backend& be = *backend_;
  // The step's sequences: rows, slots, positions and the block table of each.
  StepIndex& x = ix_;
  std::vector<int32_t>&cu = x.cu, &slots = x.slots, &ids = x.ids;
  std::vector<int64_t>& pos0 = x.pos0;
  cu.assign(size_t(N) + 1, 0), slots.resize(size_t(N)), pos0.resize(size_t(N)), ids.clear();
  int64_t max_pages = 0, max_rows = 0;
  for (int64_t i = 0; i < N; ++i) {
    const SeqStep& s = seqs[size_t(i)];
    pool.reserve_append_local(s.slot, s.n);
    cu[size_t(i) + 1] = cu[size_t(i)] + int32_t(s.n);
    slots[size_t(i)] = s.slot;
    pos0[size_t(i)] = pool.position(s.slot);
    max_pages = std::max<int64_t>(max_pages, int64_t(pool.pages(s.slot).size()));
    max_rows = std::max(max_rows, s.n);
    ids.insert(ids.end(), s.ids, s.ids + s.n);
  }
  std::vector<int32_t>& table = x.table;
  // Block-table rows reserved ahead (doubling), so a step that opens a page allocates nothing.
  if (table.capacity() < size_t(N * max_pages)) table.reserve(size_t(N * std::max<int64_t>(2 * max_pages, 64)));
  table.assign(size_t(N * std::max<int64_t>(max_pages, 1)), 0);
  for (int64_t i = 0; i < N; ++i) {
    const auto& pg = pool.pages(seqs[size_t(i)].slot);
    std::copy(pg.begin(), pg.end(), table.begin() + i * max_pages);
  }
  const int64_t R = cu.back();
  const StepView view{N,
                      R,
                      cu.data(),
                      slots.data(),
                      pos0.data(),
                      table.data(),
                      max_pages,
                      pool.page_tokens(),
                      max_rows,
                      pool.slot_capacity(),
                      pool.page_capacity(),
                      &pool,
                      pool.epoch()};
  if (!work_)
    work_ = std::make_unique<Workspace>(be, forward_work_floats(d, max_rows_) + role_.gather_floats(max_rows_));
  Workspace& work = *work_;
  work.rewind(0);
  const StepCtx c{be, view, work, R, role_.comm ? &role_ : nullptr};
  const int64_t nsel = int64_t(sel.size());
  // The selected rows by sequence (all its rows, or its last one), for shape-dependent numerics.
  std::vector<int32_t>& sel_groups = x.sel_groups;
  sel_groups.assign(1, 0);
  for (int64_t r = 0, i = 0; r < nsel; ++r) {
    while (sel[size_t(r)] >= cu[size_t(i) + 1]) ++i;
    if (r + 1 == nsel || sel[size_t(r) + 1] >= cu[size_t(i) + 1]) sel_groups.push_back(int32_t(r + 1));
  }
  // Fixed buffers first, so a replayed step finds them where it recorded them.
  std::vector<float*>& spare = x.spare;
  spare.resize(size_t(depth_slots(d)));
  for (float*& p : spare) p = work.take(R * H);
  float *a = work.take(R * H), *xn = work.take(R * H), *y = work.take(R * H), *y2 = work.take(R * H),
        *h = work.take(R * H), *hs = work.take(R * H), *ls = work.take(R * V);
  try {
    // A step can be recorded for replay when its op sequence depends on its shape only: one row per
    // sequence (no host-side grouping), and no experts fetched from a source on the host.
    if (be.begin_step(view, ids.data(), step_numerics(opt.numerics), max_rows == 1 && !opt.experts)) {
      // Embedding (no scaling); it is the first partial sum and becomes block snapshot 0 at layer 0.
      DepthState depth;
      depth.partial = spare[0];
      depth.partial_empty = false;
      depth.ffn_extra = y2;
      be.embed(placed_.embed, ids.data(), R, depth.partial);
      for (int64_t L = 0; L < d.layers; ++L)
        decoder_layer(c, d, L, placed_.layers[size_t(L)], pool, depth, spare.data(), a, xn, y, opt);
      settle_depth(c, depth, H);
      // Output aggregator over B ∪ {P} (the residual stream itself without Block AttnRes), then for
      // the rows whose logits are wanted: final norm, lm_head (rank 0's alone on a split model).
      if (role_.rank == 0) {
        if (d.block_size > 0)
          attnres_site(c, placed_.output_res, depth, H, d.eps, h);
        else
          h = depth.partial;
        be.gather_rows(h, sel.data(), nsel, H, hs);
        be.rmsnorm(hs, nsel, H, placed_.final_norm.data(), d.eps, hs);
        be.matmul(placed_.lm_head, hs, nsel, ls, sel_groups.data(), int64_t(sel_groups.size()) - 1);
      }
    }
    be.end_step();
  } catch (...) {
    be.abort_step();
    throw;
  }
  for (int64_t i = 0; i < N; ++i) pool.advance_local(seqs[size_t(i)].slot, seqs[size_t(i)].n);
  if (role_.rank != 0) return;
  if (argmax) {
    std::vector<int32_t>&picks = x.picks, &rows = x.rows;
    picks.resize(size_t(nsel)), rows.clear();
    for (int64_t r = 0; r < nsel; ++r)
      if (am[size_t(r)] >= 0) rows.push_back(int32_t(r));
    // Only the last rows are needed; they are the common case of one row per sequence.
    if (int64_t(rows.size()) == nsel) {
      be.argmax_rows(ls, nsel, V, picks.data());
      for (int64_t r = 0; r < nsel; ++r) argmax[am[size_t(r)]] = picks[size_t(r)];
    } else {
      for (int32_t r : rows) be.argmax_rows(ls + int64_t(r) * V, 1, V, &argmax[am[size_t(r)]]);
    }
  }
  if (logits) {
    // Runs of rows with consecutive destinations come back in one copy.
    for (int64_t r = 0; r < nsel;) {
      int64_t e = r + 1;
      while (e < nsel && dst[size_t(e)] == dst[size_t(e) - 1] + 1) ++e;
      be.download(logits + dst[size_t(r)] * V, ls + r * V, size_t((e - r) * V) * 4);
      r = e;
    }
  }
}

void Model::forward(Session& s, const int32_t* ids, int64_t T, bool all_logits, float* logits,
                    const ForwardOptions& opt) const {
  if (s.model_ != this) fail("session belongs to another model");
  if (s.generation_ != backend_generation_)
    fail("this session was created before the model moved to the GPU; create a new session");
  if (T <= 0) fail("forward needs at least one token");
  if (opt.argmax_out && all_logits) fail("forward: argmax_out needs all_logits == false");
  const SeqStep one{s.slot_, ids, T, all_logits};
  step(session_pool(), std::span<const SeqStep>(&one, 1), opt, logits, opt.argmax_out);
}

}  // namespace k3
