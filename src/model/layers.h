// The K3 decoder sublayers, written once over the Backend op interface: KDA, gated MLA, Stable
// LatentMoE, dense SiTU FFN, and Block AttnRes bookkeeping (§3). Each reads top to bottom like the
// spec, works on the R rows of a step (many sequences at once) and takes its temporaries from the
// step's planned Workspace.
// Owns: the order of operations inside each sublayer. Must not: read files, know tensor names or
// branch on the backend (a backend's strategy lives behind its ops).
#pragma once
#include <cstdint>
#include <vector>

#include "model/backend.h"
#include "model/dims.h"
#include "model/weights.h"

namespace k3 {

// Temporaries of a step: one backend allocation, handed out front to back and given back by scope.
// The size is planned (forward_work_floats), so a step never allocates.
class Workspace {
 public:
  Workspace() = default;
  Workspace(Backend& be, int64_t floats);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* take(int64_t n);  // k3::Error when the plan was too small (an engine bug, never silent)
  int64_t used() const { return used_; }
  void rewind(int64_t to) { used_ = to; }
  int64_t capacity() const { return cap_; }
  int64_t peak() const { return peak_; }

 private:
  Backend* be_ = nullptr;
  float* base_ = nullptr;
  int64_t cap_ = 0, used_ = 0, peak_ = 0;
};

// Gives back what a sublayer took when it goes out of scope.
class WorkScope {
 public:
  explicit WorkScope(Workspace& w) : w_(w), at_(w.used()) {}
  ~WorkScope() { w_.rewind(at_); }
  WorkScope(const WorkScope&) = delete;
  WorkScope& operator=(const WorkScope&) = delete;

 private:
  Workspace& w_;
  int64_t at_;
};

// Which part of a split model (model/parallel.h) this forward computes, and how it meets the other
// ranks. One rank (the default): nothing is split, no collectives.
struct RankRole {
  Communicator* comm = nullptr;  // the group of ranks; null on one rank
  int rank = 0, ranks = 1;
  bool heads_split = false;  // tensor parallel: heads, dense FFN and shared experts cut, gathered
  // expert parallel: each rank computes its own routed experts' outputs, the ranks gather them, and
  // every rank sums each row's in ascending expert id (the one rank's additions)
  bool experts_split = false;
  // How wide each rank's part is (one entry per rank) of what the ranks gather: the KDA and MLA
  // heads' outputs (heads x head_dim, heads x v), the dense FFN's and shared experts' intermediate,
  // and the rows of the output projections (hidden).
  enum Cut { KdaCols, MlaCols, DenseInter, SharedInter, Hidden, kCuts };
  std::vector<int64_t> parts[kCuts];
  std::vector<int64_t> expert_parts;       // routed experts per rank (ascending id ranges), under experts_split
  int64_t moe_top_k = 0, moe_latent = 0;   // the routed terms of a row: top_k x latent floats
  int64_t gather_floats(int64_t R) const;  // workspace a step of R rows needs for its gathers
};

// What a sublayer needs besides its weights: the backend, the step's sequences, the workspace, and
// (split models) the rank's role.
struct StepCtx {
  Backend& be;
  const StepView& seqs;
  Workspace& work;
  int64_t R;                       // rows of the step
  const RankRole* role = nullptr;  // null: one rank
  bool heads_split() const { return role && role->heads_split; }
  bool experts_split() const { return role && role->experts_split; }
};

// out[R, W.rows of the whole model] = W · x for an output projection (o_proj, a down projection)
// whose input x [R, cols] is split by heads or intermediate under tensor parallelism: the ranks
// gather x whole (cut `in`), each computes its rows of W (every output element by one rank with the
// whole dot product, so the result is the one rank's, bit for bit) and they gather the rows. One
// rank: W · x.
void project_out(const StepCtx& c, const WeightMat& W, const float* x, RankRole::Cut in, float* out);

// Where routed-expert weights come from when they are not all placed (runtime/expert_cache.h
// streams them from disk into a bounded cache). Implementations need not be thread-safe: one fetch
// at a time per source.
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  // Makes experts ids[0..n) (distinct, n <= max_batch()) of MoE layer `layer` available; out[i]
  // points at their weights (same formats and bytes as the resident views, in host memory), valid
  // until the next fetch on this source.
  virtual void fetch(int64_t layer, const int32_t* ids, int64_t n, const GluWeights** out) = 0;
  // How many experts one fetch may ask for (>= 1).
  virtual int64_t max_batch() const = 0;
};

// out[R, hidden] = KDA(x[R, hidden]) where x is already input_layernorm-ed; state carried per slot.
void kda_sublayer(const StepCtx& c, const KdaDims& d, const KdaWeights& w, const KdaPool& st, const float* x,
                  KdaAlgo algo, int64_t chunk, float* out);
// Appends the step's rows to the latent cache and attends causally over each sequence's cache.
void mla_sublayer(const StepCtx& c, const MlaDims& d, const MlaWeights& w, const MlaPages& cache, const float* x,
                  MlaAlgo algo, float* out);
// out[R, out] = down · SiTU(gate x, up x)
void glu_sublayer(const StepCtx& c, const GluWeights& w, const SituParams& p, const float* x, float* out);
// Stable LatentMoE: router, latent down-projection, routed experts (the backend's moe_routed), latent
// norm, up-projection, plus the shared experts. With `shared_out` ([R, hidden], may be null) the
// shared experts' down-projection is left there for the caller to add (the next residual site adds
// out + shared_out: Backend::residual_norm's y2) where the layer's shape allows it; returns whether
// it did (false: `out` holds the whole sum, as without shared_out).
bool moe_sublayer(const StepCtx& c, const MoeDims& d, const MoeWeights& w, const float* x, float* out,
                  ExpertSource* experts, float* shared_out = nullptr);

// Per-row depth state of Block AttnRes (§3.3): block snapshots and the running partial sum, each an
// [R, hidden] array in the workspace.
// The snapshots of a step (at most kMaxBlocks: a fixed array, so a step allocates nothing).
struct BlockList {
  static constexpr size_t kMaxBlocks = 63;
  const float* at[kMaxBlocks] = {};
  size_t n = 0;
  bool empty() const { return n == 0; }
  size_t size() const { return n; }
  void push_back(const float* p);  // k3::Error past kMaxBlocks
  const float* operator[](size_t i) const { return at[i]; }
  const float* const* begin() const { return at; }
  const float* const* end() const { return at + n; }
};
struct DepthState {
  BlockList blocks;
  float* partial = nullptr;
  bool partial_empty = true;   // ∅ just after a snapshot
  float* pending = nullptr;    // a sublayer output not yet added to partial (the next site adds it)
  float* pending2 = nullptr;   // a second part of it (the MoE's shared experts): pending + pending2 is added
  float* ffn_extra = nullptr;  // [R, hidden] the caller lends for pending2, or null (the FFN adds its parts)
};
// out[R, hidden] = Agg(B ∪ {P}) at one site (P omitted when empty). Call settle_depth first.
void attnres_site(const StepCtx& c, const AttnResSite& site, const DepthState& st, int64_t hidden, float eps,
                  float* out);
// One site as one backend op (Backend::residual_norm): y (+ y2; either may be null) into the partial
// sum, then xn = RMSNorm(Agg(B ∪ {P})) ⊙ norm_w, or RMSNorm(P) ⊙ norm_w without `mix`.
void residual_site(const StepCtx& c, DepthState& st, float* y, const float* y2, const AttnResSite* mix,
                   const float* norm_w, int64_t hidden, float eps, float* a, float* xn);
// Adds st.pending (+ st.pending2) into the partial sum (the last layer's FFN output, before the output site).
void settle_depth(const StepCtx& c, DepthState& st, int64_t hidden);

// Workspace floats one sublayer of each kind takes for R rows (the plan; forward_work_floats sums up).
int64_t kda_work_floats(const KdaDims& d, int64_t R);
int64_t mla_work_floats(const MlaDims& d, int64_t R);
int64_t glu_work_floats(int64_t inter, int64_t R);
int64_t moe_work_floats(const MoeDims& d, int64_t shared_inter, int64_t R);

}  // namespace k3
