// How a split model's weights and dims are cut per rank, the plan's checks, and the rank models of
// Model::split (see parallel.h).
#include "model/parallel.h"

#include <algorithm>

#include "core/comm.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/remote.h"

namespace k3 {

void Backend::all_gather(Communicator& comm, const float* send, int64_t n, float* out) {
  sync();  // the backend's queued work on send is done (a no-op where ops complete as they return)
  comm.all_gather(send, n, out);
}

void Backend::all_gather_v(Communicator& comm, const float* send, int64_t n, float* out, const int64_t* counts) {
  sync();
  comm.all_gather_v(send, n, out, counts);
}

void Backend::moe_combine(const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, float*) {
  fail(std::string("expert parallel (--ep) is not supported on the ") + name() + " backend");
}

void Backend::broadcast(Communicator& comm, float* buf, int64_t n, int root) {
  sync();
  comm.broadcast(buf, n, root);
}

std::string ParallelPlan::str() const {
  if (!split()) return "1 rank";
  if (tp > 1 && ep > 1) return "TP" + std::to_string(tp) + " x EP" + std::to_string(ep);
  return tp > 1 ? "TP" + std::to_string(tp) : "EP" + std::to_string(ep);
}

CutRange balanced_part(int64_t n, int parts, int i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t b = i * base + std::min<int64_t>(i, extra);
  return {b, b + base + (i < extra ? 1 : 0)};
}

namespace {

void need(bool ok, const std::string& why) {
  if (!ok) fail(why);
}

// Rows [r0, r0 + n) of a matrix that may be absent (empty stays empty).
WeightMat rows_or_empty(const WeightMat& W, int64_t r0, int64_t n) { return W.empty() ? W : rows_of(W, r0, n); }
FVec slice(const FVec& v, int64_t i0, int64_t n) { return v.empty() ? v : FVec{v.p + i0, n}; }

// A GLU cut for tensor parallelism: gate/up rows of the intermediate part, down rows of the hidden part.
GluWeights cut_glu(const GluWeights& g, CutRange inter, CutRange hidden) {
  if (g.gate.empty()) return g;
  return GluWeights{rows_of(g.gate, inter.begin, inter.size()), rows_of(g.up, inter.begin, inter.size()),
                    rows_of(g.down, hidden.begin, hidden.size())};
}

std::vector<int64_t> part_sizes(int64_t n, int parts, int64_t unit = 1) {
  std::vector<int64_t> v;
  for (int i = 0; i < parts; ++i) v.push_back(balanced_part(n, parts, i).size() * unit);
  return v;
}

}  // namespace

void check_parallel_plan(const ModelDims& d, const ParallelPlan& p) {
  const std::string flags = "--tp " + std::to_string(p.tp) + " --ep " + std::to_string(p.ep);
  need(p.tp >= 1 && p.tp <= 256 && p.ep >= 1 && p.ep <= 256, flags + ": --tp and --ep must be between 1 and 256");
  need(p.tp == 1 || p.ep == 1 || p.tp == p.ep,
       flags + ": with both above 1 they must be equal (the same ranks split attention and experts)");
  const auto enough = [&](const char* flag, int n, const char* what, int64_t have) {
    need(have >= n, std::string(flag) + " " + std::to_string(n) + ": the model has " + std::to_string(have) + " " +
                        what + ", fewer than the ranks (each rank needs at least one)");
  };
  if (p.tp > 1) {
    if (d.kda_layers) enough("--tp", p.tp, "KDA heads", d.kda.heads);
    if (d.mla_layers) enough("--tp", p.tp, "MLA heads", d.mla.heads);
    if (d.dense_inter) enough("--tp", p.tp, "columns of dense FFN intermediate", d.dense_inter);
    if (d.shared_inter) enough("--tp", p.tp, "columns of shared-expert intermediate", d.shared_inter);
    enough("--tp", p.tp, "hidden rows", d.hidden);
  }
  if (p.ep > 1) {
    need(d.moe.experts > 0, "--ep " + std::to_string(p.ep) + ": the model has no routed experts");
    enough("--ep", p.ep, "routed experts", d.moe.experts);
  }
}

std::string split_description(const ModelDims& d, const ParallelPlan& p) {
  if (!p.split()) return "1 rank";
  std::string s = p.str() + " (" + std::to_string(p.world()) +
                  (process_group() ? " processes, one rank each): " : " ranks in this process): ");
  if (p.tp > 1) {
    s += "heads";
    if (d.kda_layers) s += " KDA " + std::to_string(d.kda.heads);
    if (d.mla_layers) s += " MLA " + std::to_string(d.mla.heads);
    s += ", dense FFN and shared experts cut " + std::to_string(p.tp) + " ways";
  } else {
    s += "attention and dense trunk whole on every rank";
  }
  if (d.moe.experts)
    s += p.ep > 1 ? "; routed experts " + std::to_string(d.moe.experts) + " cut " + std::to_string(p.ep) + " ways"
                  : "; routed experts whole on every rank";
  return s;
}

ModelDims rank_dims(const ModelDims& d, const ParallelPlan& p, int r) {
  ModelDims o = d;
  if (p.tp <= 1) return o;
  o.kda.heads = balanced_part(d.kda.heads, p.tp, r).size();
  o.mla.heads = balanced_part(d.mla.heads, p.tp, r).size();
  o.dense_inter = balanced_part(d.dense_inter, p.tp, r).size();
  o.shared_inter = balanced_part(d.shared_inter, p.tp, r).size();
  return o;
}

RankRole rank_role(const ModelDims& d, const ParallelPlan& p, int r) {
  RankRole role;
  role.rank = r;
  role.ranks = p.world();
  role.heads_split = p.tp > 1;
  role.experts_split = p.ep > 1;
  if (p.ep > 1) {
    role.expert_parts = part_sizes(d.moe.experts, p.ep);
    role.moe_top_k = d.moe.top_k;
    role.moe_latent = d.moe.latent;
  }
  if (p.tp > 1) {
    role.parts[RankRole::KdaCols] = part_sizes(d.kda.heads, p.tp, d.kda.head_dim);
    role.parts[RankRole::MlaCols] = part_sizes(d.mla.heads, p.tp, d.mla.v);
    role.parts[RankRole::DenseInter] = part_sizes(d.dense_inter, p.tp);
    role.parts[RankRole::SharedInter] = part_sizes(d.shared_inter, p.tp);
    role.parts[RankRole::Hidden] = part_sizes(d.hidden, p.tp);
  }
  return role;
}

ModelWeights rank_weights(const ModelDims& d, const ModelWeights& w, const ParallelPlan& p, int r) {
  ModelWeights o = w;  // views: the replicated parts as they are
  const bool tp = p.tp > 1;
  const CutRange hid = balanced_part(d.hidden, p.tp, r);
  for (LayerWeights& l : o.layers) {
    if (tp && l.is_kda) {
      KdaWeights& k = l.kda;
      const CutRange h = balanced_part(d.kda.heads, p.tp, r);
      const int64_t D = d.kda.head_dim, c0 = h.begin * D, nc = h.size() * D, K = d.kda.conv_k;
      for (WeightMat* m : {&k.q_proj, &k.k_proj, &k.v_proj, &k.f_b_proj, &k.g_proj, &k.g_b_proj})
        *m = rows_or_empty(*m, c0, nc);
      k.b_proj = rows_of(k.b_proj, h.begin, h.size());
      k.o_proj = rows_of(k.o_proj, hid.begin, hid.size());
      for (FVec* v : {&k.q_conv, &k.k_conv, &k.v_conv}) *v = slice(*v, c0 * K, nc * K);
      k.A_log = slice(k.A_log, h.begin, h.size());
      k.dt_bias = slice(k.dt_bias, c0, nc);
      // f_a_proj, g_a_proj (low-rank inputs, shared by every head) and o_norm (one per head_dim): whole
    } else if (tp) {
      MlaWeights& m = l.mla;
      const CutRange h = balanced_part(d.mla.heads, p.tp, r);
      const int64_t dq = d.mla.nope + d.mla.rope, dkv = d.mla.nope + d.mla.v, dv = d.mla.v;
      m.q_proj = rows_or_empty(m.q_proj, h.begin * dq, h.size() * dq);
      m.q_b_proj = rows_or_empty(m.q_b_proj, h.begin * dq, h.size() * dq);
      m.kv_b_proj = rows_of(m.kv_b_proj, h.begin * dkv, h.size() * dkv);
      m.g_proj = rows_or_empty(m.g_proj, h.begin * dv, h.size() * dv);
      m.o_proj = rows_of(m.o_proj, hid.begin, hid.size());
      // q_a_proj, kv_a_proj and their norms: whole (the latent is the same for every head)
    }
    if (l.dense_ffn) {
      if (tp) l.dense = cut_glu(l.dense, balanced_part(d.dense_inter, p.tp, r), hid);
      continue;
    }
    MoeWeights& e = l.moe;
    if (tp) e.shared = cut_glu(e.shared, balanced_part(d.shared_inter, p.tp, r), hid);
    if (p.ep > 1) {
      const CutRange mine = balanced_part(int64_t(e.experts.size()), p.ep, r);
      for (int64_t x = 0; x < int64_t(e.experts.size()); ++x)
        if (x < mine.begin || x >= mine.end) e.experts[size_t(x)] = GluWeights{};  // held by another rank
      e.local_begin = mine.begin;
      e.local_end = mine.end;
    }
  }
  return o;
}

SplitGroup::SplitGroup() = default;
SplitGroup::~SplitGroup() {
  if (remote) remote->close();  // the followers' loops end (before this process's rank model goes)
}

std::unique_ptr<Model> Model::make_rank(const Model& full, const ParallelPlan& p, int r, Communicator* comm) {
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = full.cfg_;
  m->dims_ = rank_dims(full.dims_, p, r);
  m->host_ = rank_weights(full.dims_, full.host_, p, r);
  m->placed_ = m->host_;
  m->backend_->place(m->placed_);
  m->max_rows_ = full.max_rows_;
  m->session_pool_opts_ = full.session_pool_opts_;
  m->role_ = rank_role(full.dims_, p, r);
  m->role_.comm = comm;
  return m;
}

void Model::check_can_split(const ParallelPlan& p) const {
  if (split_) fail("the model is already split (" + split_->plan.str() + ")");
  if (role_.comm) fail("a rank of a split model cannot be split again");
  if (on_gpu()) fail(std::string("--tp/--ep: split the model before it goes to the GPU; ") + kGpuSplitHow);
  check_parallel_plan(dims_, p);
}

void Model::split(const ParallelPlan& p) {
  if (Communicator* procs = process_group()) {
    if (!split_across(p, *procs)) throw FollowerDone{};
    return;
  }
  if (!p.split()) {  // one rank: nothing to cut (the plan's own range checks still apply)
    check_parallel_plan(dims_, p);
    return;
  }
  check_can_split(p);
  auto g = std::make_unique<SplitGroup>();
  g->plan = p;
  g->comms = make_local_group(p.world());
  for (int r = 0; r < p.world(); ++r) g->ranks.push_back(make_rank(*this, p, r, g->comms[size_t(r)].get()));
  sessions_.reset();
  work_.reset();
  split_ = std::move(g);
  ++backend_generation_;  // sessions made before hold no slots in the ranks' pools
}

bool Model::split_across(const ParallelPlan& p, Communicator& comm) {
  if (comm.size() != p.world())
    fail("k3 runs as " + std::to_string(comm.size()) + " processes (" + comm.name() + "), but " +
         (p.split() ? "--tp " + std::to_string(p.tp) + " --ep " + std::to_string(p.ep) + " ask for " +
                          std::to_string(p.world()) + " ranks"
                    : std::string("the model is not split (give --tp or --ep with the number of processes)")) +
         ": one rank per process");
  check_can_split(p);
  const int r = comm.rank();
  auto g = std::make_unique<SplitGroup>();
  g->plan = p;
  g->ranks.push_back(make_rank(*this, p, r, &comm));
  if (r == 0) {
    hello_send(comm, p.tp, p.ep, fingerprint());
    g->remote = std::make_shared<RemoteLink>(comm);
    sessions_.reset();
    work_.reset();
    split_ = std::move(g);
    ++backend_generation_;
    return true;
  }
  hello_check(comm, p.tp, p.ep, fingerprint());
  follow(*g->ranks[0], comm, *ckpt_);  // until rank 0 closes the group (or it fails: rethrown)
  return false;
}

void check_split_device(const ParallelPlan& p, bool cuda) {
  const Communicator* procs = process_group();
  if (!cuda && p.split() && procs && std::string(procs->name()) == "tcp")
    fail(
        "processes started with --rank/--world/--master split a model over GPUs (--device cuda; their data goes "
        "through NCCL); on the CPU, start the processes with mpirun");
  if (!cuda || !p.split()) return;
  if (!procs) fail(std::string("--tp/--ep with --device cuda: ") + kGpuSplitHow);
}

void Model::use_gpu_split(const GpuOptions& o) {
  SplitGroup& g = *split_;
  if (o.experts_on_cpu) fail("--cpu-experts with --tp/--ep is not supported");
  if (!o.experts_resident) fail("--ram-budget with --tp/--ep is not supported");
  sessions_.reset();  // on the ranks' CPU backends, which go now
  work_.reset();
  g.remote->use_gpu(o);  // the followers move their ranks to their GPUs too
  try {
    g.ranks[0]->use_gpu_rank(o);
  } catch (const std::exception& e) {
    g.remote->fail_group(e.what());  // the followers may be waiting for the device group
    throw;
  }
  ++backend_generation_;
}

void Model::use_gpu_rank(const GpuOptions& o) {
  if (!role_.comm || split_) fail("internal error: use_gpu_rank on a model that is not a rank of a split");
  GpuOptions r = o;
  r.graphs = false;  // a split step's NCCL calls are not recorded into CUDA graphs
  use_gpu_here(r);
  backend_->join_group(*role_.comm);
}

const ModelWeights* Model::process_rank_weights() const {
  return split_ && split_->remote ? &split_->ranks[0]->host_ : nullptr;
}

void prefault_weight_views(const io::Checkpoint& ckpt, const ModelWeights& w,
                           const std::function<void(uint64_t, uint64_t)>& progress) {
  // FP8 trunk views point at memory of their own, not the mapping: prefault_spans leaves them out.
  std::vector<std::pair<const uint8_t*, uint64_t>> spans;
  for_each_weight(
      w,
      [&](const WeightMat& m, WeightRole) {
        const auto* d = static_cast<const uint8_t*>(m.data);
        if (m.fmt == WFormat::MXFP4) {  // nibbles and E8M0 scales lie apart
          spans.emplace_back(d, uint64_t(m.rows) * uint64_t(row_bytes(m)));
          spans.emplace_back(m.scales, uint64_t(m.rows) * uint64_t(m.cols / 32));
        } else {
          spans.emplace_back(d, weight_bytes(m));
        }
      },
      [](const FVec&) {});  // decoded copies, not the mapping
  ckpt.prefault_spans(spans, progress);
}

bool Model::prefault_process_rank(const std::function<void(uint64_t, uint64_t)>& progress) const {
  const ModelWeights* mine = process_rank_weights();
  if (!mine) return false;
  split_->remote->prefault();  // the followers read in their parts meanwhile
  prefault_weight_views(*ckpt_, *mine, progress);
  return true;
}

ParallelPlan Model::parallel() const { return split_ ? split_->plan : ParallelPlan{}; }

void Model::step_split(StatePool& pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, float* logits,
                       int32_t* argmax) const {
  SplitGroup& g = *split_;
  if (opt.experts)
    fail("routed experts from an expert source (--ram-budget) are not supported with --tp/--ep (" + g.plan.str() + ")");
  if (g.remote) {  // the other ranks are processes: they get the step, then this rank runs its part
    if (pool.remote() != g.remote.get())
      fail("step: the state pool was not made by this split model (" + g.plan.str() + "): use its new_pool()");
    g.remote->step(pool.remote_id(), seqs, opt, g.ranks[0]->max_rows_);
    try {
      g.ranks[0]->step(pool, seqs, opt, logits, argmax);
    } catch (const std::exception& e) {
      g.remote->fail_group(e.what());  // the other ranks may be waiting in a collective of this step
      throw;
    }
    return;
  }
  if (pool.ranks() != int64_t(g.ranks.size()))
    fail("step: the state pool was not made by this split model (" + g.plan.str() + "): use its new_pool()");
  try {
    run_ranks(g.comms, [&](Communicator& c) {
      const int r = c.rank();
      g.ranks[size_t(r)]->step(pool.rank(r), seqs, opt, r == 0 ? logits : nullptr, r == 0 ? argmax : nullptr);
    });
  } catch (...) {
    // A rank that failed aborted the group: the next step gets a fresh one.
    g.comms = make_local_group(g.plan.world());
    for (size_t r = 0; r < g.ranks.size(); ++r) g.ranks[r]->role_.comm = g.comms[r].get();
    throw;
  }
}

}  // namespace k3
