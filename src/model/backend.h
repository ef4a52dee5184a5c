// The op interface the one K3 forward (model/forward.cpp, model/layers.cpp) is written against, and
// the step description its per-sequence ops read. A backend (model/backend_cpu.cpp, backend_cuda.cpp)
// implements every op on its own memory (host RAM or device memory), including its own strategy for
// the routed experts (moe_routed), and says what it supports (BackendCaps); the forward refuses in one
// line what the chosen backend does not offer. Ops only enqueue work where the backend is asynchronous.
// Must not: carry layer order or sublayer math (that is the forward's), or know tensor names.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "model/dims.h"
#include "model/weights.h"
#include "ops/ops.h"

namespace k3 {

class ExpertSource;
class Communicator;
enum class KdaAlgo { Recurrent, Chunked };
// MLA attention: Expanded (per-head keys and values from the latent cache), Absorbed (attention in
// the latent space), Auto (per sequence and step, whichever takes fewer multiply-adds on this backend:
// on the CPU, at fp32/fast numerics, the expanded form in key tiles for long prefill pieces, absorbed
// otherwise; absorbed on the GPU and under exact numerics).
enum class MlaAlgo { Expanded, Absorbed, Auto };

// Numerics of a step (the CPU's levels; the GPU maps Fast to bf16 tensor-core GEMMs and F32 to its fp32
// parity mode, and has no Exact).
enum class StepNumerics : uint8_t { Exact = 0, F32 = 1, Fast = 2 };

struct BackendCaps {
  bool exact = false;          // StepNumerics::Exact (fp64 sums)
  bool expanded_mla = false;   // MlaAlgo::Expanded
  bool expert_source = false;  // routed experts from an ExpertSource (streamed) instead of placed weights
};

// The sequences of one step, as the per-sequence ops see them (host arrays; a backend that needs them
// on a device copies them in begin_step). Rows [cu_rows[i], cu_rows[i+1]) of every activation belong
// to sequence i, whose state is slot slots[i] of the state pool; its first row sits at absolute
// position pos0[i]. The MLA latent cache is paged: position p of sequence i is in page
// block_table[i * max_pages + p / page_tokens] (the table covers every position up to this step's end).
struct StepView {
  int64_t n_seqs = 0, rows = 0;
  const int32_t* cu_rows = nullptr;      // [n_seqs + 1]
  const int32_t* slots = nullptr;        // [n_seqs]
  const int64_t* pos0 = nullptr;         // [n_seqs]
  const int32_t* block_table = nullptr;  // [n_seqs, max_pages]
  int64_t max_pages = 0, page_tokens = 0;
  int64_t max_rows_per_seq = 0;      // the longest sequence of the step
  int64_t n_slots = 0, n_pages = 0;  // the state pool's capacities (slot and page ids are below)
  // Which pool and which of its allocations: device pointers recorded for a step of this shape
  // (a CUDA graph) stay valid while both are unchanged.
  const void* pool = nullptr;
  uint64_t pool_epoch = 0;
};

// Per-layer views of the state pool (backend memory): KDA recurrent state and conv history of every
// slot, and the pages of an MLA layer's latent cache (per token: normed latent c, then raw k_r).
struct KdaPool {
  float* S = nullptr;                            // [slots, H, Dk, Dv]
  float* conv[3] = {nullptr, nullptr, nullptr};  // q, k, v: [slots, C, K-1]
};
struct MlaPages {
  float* pages = nullptr;  // [pages, page_tokens, kv_lora + rope]
};

// The inputs of the KDA recurrence from the sublayer's raw projections (layers.cpp kda_sublayer):
// q, k, v = SiLU(causal conv(qh, kh, vh)) with each sequence's carried history (conv_state pools),
// q ← q·q_scale/‖q‖ and k ← k/‖k‖ per head (eps), the decay gate g from f, and β ← σ(β) in place.
struct KdaPrepare {
  const float *qh, *kh, *vh;
  float *q, *k, *v;
  const float* conv_w[3];
  float* conv_state[3];
  int64_t C, H, D, K;
  float q_scale, eps;
  const float *f, *A_log, *dt_bias;
  float lower_bound;
  float *g, *beta;
};

// One residual site of a layer as one op (Backend::residual_norm): the pending sublayer output y
// enters the partial sum first (partial ← partial + y, or partial ← y when the sum is empty; with a
// second part y2, y + y2 enters: the sum the FFN would have formed itself, in the same order), then
// a = Agg(blocks ∪ {partial}) with the site's folded scores (Block AttnRes, ops.h attnres_mix; with
// fold null, a = partial: the plain pre-norm stream), then xn = RMSNorm(a) ⊙ norm_w.
struct ResidualNorm {
  float* partial = nullptr;  // [R, H]
  float* y = nullptr;        // [R, H] to add first, or null
  const float* y2 = nullptr;  // [R, H] its second part, or null: y + y2 enters (a backend may add it into y first)
  bool y_replaces = false;   // partial ← y (the partial sum was empty)
  const float* const* blocks = nullptr;
  int64_t n_blocks = 0;
  const float* fold = nullptr;  // null: no mix
  float mix_eps = 0;
  const float* norm_w = nullptr;
  float norm_eps = 0;
  float* a = nullptr;  // [R, H] the mix, for a backend that composes the op from the separate ones
  float* xn = nullptr;  // [R, H]
};

// The MoE's two elementwise tails after the routed experts, independent of each other, as one op
// (Backend::moe_tail): agg [R, latent] <- RMSNorm(agg) (x) norm_w (norm_w null: no norm) and the shared
// experts' GLU g <- situ_glu(g, u) over n_situ elements (0: none).
struct MoeTail {
  float* agg = nullptr;
  int64_t latent = 0;
  const float* norm_w = nullptr;
  float eps = 0;
  float* g = nullptr;
  const float* u = nullptr;
  int64_t n_situ = 0;
  float b1 = 0, b2 = 0;
};

// The GPU's cache of hot experts, summed over MoE layers (Backend::hot_expert_stats).
struct HotExpertStats {
  int64_t layers = 0, experts = 0, cached = 0;  // MoE layers filled, routed experts of them, experts cached
  int64_t slots = 0, hits = 0;                  // routed (token, expert) slots since the fill, and those cached
  uint64_t bytes = 0;                           // device memory of the cached experts
  double hit_rate() const { return slots ? double(hits) / double(slots) : 0.0; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // "cpu" | "cuda"
  virtual BackendCaps caps() const = 0;

  // ---- memory of this backend (host RAM on the CPU, device memory on CUDA)
  virtual void* alloc(size_t bytes, const char* what) = 0;  // k3::Error naming `what` on failure
  virtual void release(void* p) noexcept = 0;
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;  // waits for the data
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void sync() = 0;

  // Puts the bound (host) weights where this backend reads them, rewriting the views of `w` in place
  // (the CPU reads the mapping as it is).
  virtual void place(ModelWeights& w) = 0;

  // CUDA-graph replay of decode steps (benchmarks); false where the backend has no such thing.
  virtual bool set_graphs(bool on) { return false; }

  // Device timing of ops (k3 bench --profile): mark() records a point in the backend's queue of
  // work and returns its handle, or -1 where ops complete before they return (the CPU: time them
  // with the host clock); seconds_between waits for mark b and gives the device time from a to b.
  // reset_marks() lets the handles be reused.
  virtual int64_t mark() { return -1; }
  virtual double seconds_between(int64_t a, int64_t b) {
    (void)a, (void)b;
    return 0;
  }
  virtual void reset_marks() {}

  // ---- a step
  // Before and after the ops of one step. `ids` [rows] are its token ids (host). When begin_step
  // returns false the backend has already run the whole step's ops again as they were recorded for
  // a step of the same shape (a CUDA graph), with this step's ids and sequences: the forward then
  // enqueues nothing until end_step. `replayable` says the forward's op sequence depends only on the
  // step's shape (one row per sequence), which is what recording needs.
  virtual bool begin_step(const StepView& s, const int32_t* ids, StepNumerics n, bool replayable) = 0;
  virtual void end_step() = 0;
  virtual void abort_step() noexcept = 0;  // an op of the step threw: drop what was being recorded

  // ---- row ops (R rows of every sequence together; weights read once for all of them)
  // Products whose numerics depend on the shape of the call (the CPU's fast mode rounds activations
  // of GEMMs of >= 4 rows, and not of a decode GEMV) keep each sequence's rows as they would be
  // alone: `groups` (host, [n_groups + 1] row offsets) says which rows belong together; null means
  // the step's sequences (R == the step's rows).
  virtual void embed(const WeightMat& E, const int32_t* host_ids, int64_t R, float* out) = 0;
  virtual void matmul(const WeightMat& W, const float* x, int64_t R, float* y, const int32_t* groups = nullptr,
                      int64_t n_groups = 0) = 0;
  // y[i] = W[i]·x for n weights sharing x. fp32[i] (may be null) asks for unrounded activations for
  // weight i whatever the numerics (the MoE router: a rounded input can flip a near-tie in the top-k).
  virtual void matmul_shared_input(const WeightMat* const* W, int64_t n, const float* x, int64_t R, float* const* y,
                                   const bool* fp32) = 0;
  // y[i] = W[i]·x[i] for n weights, each with its own input.
  virtual void matmul_many(const WeightMat* const* W, const float* const* x, int64_t n, int64_t R, float* const* y) = 0;
  virtual void rmsnorm(const float* x, int64_t R, int64_t n, const float* w, float eps, float* out) = 0;
  // out = RMSNorm(x) ⊙ w, then out ← out · σ(gate) (gate [R, n]; out may be x). Default: the two ops.
  virtual void rmsnorm_gate(const float* x, int64_t R, int64_t n, const float* w, float eps, const float* gate,
                            float* out) {
    rmsnorm(x, R, n, w, eps, out);
    sigmoid_mul(out, gate, R * n);
  }
  virtual void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) = 0;
  virtual void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) = 0;
  // MoeTail for R rows. Default: the two ops (the reference for a fused version: the same bits).
  virtual void moe_tail(const MoeTail& p, int64_t R) {
    if (p.norm_w) rmsnorm(p.agg, R, p.latent, p.norm_w, p.eps, p.agg);
    if (p.n_situ > 0) situ_glu(p.g, p.u, p.n_situ, p.b1, p.b2, p.g);
  }
  virtual void kda_gate(const float* f, int64_t R, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
                        float lower_bound, float* g) = 0;
  virtual void sigmoid(float* x, int64_t n) = 0;                         // x ← σ(x)
  virtual void sigmoid_mul(float* x, const float* gate, int64_t n) = 0;  // x ← x · σ(gate)
  virtual void add(float* y, const float* x, int64_t n) = 0;             // y ← y + x
  // dst[i] = src[rows[i]] for n rows of `width` floats; rows is host memory.
  virtual void gather_rows(const float* src, const int32_t* host_rows, int64_t n, int64_t width, float* dst) = 0;
  // Block AttnRes over n_src arrays [R, H] (ops.h attnres_mix); the pointer list is host memory.
  virtual void attnres_mix(const float* const* src, int64_t n_src, int64_t R, int64_t H, const float* fold, float eps,
                           float* out) = 0;
  // ResidualNorm for R rows of H. Default: add (or copy), attnres_mix, rmsnorm in that order (the
  // reference for a fused version, which may differ only in the order of the norms' fp64 sums).
  virtual void residual_norm(const ResidualNorm& p, int64_t R, int64_t H);

  // ---- per-sequence ops (each sequence of the step from its own slot)
  virtual void short_conv_silu(const float* x, const StepView& s, int64_t C, const float* w, int64_t K,
                               float* state_pool, float* out) = 0;
  // KdaPrepare for the step's R rows. Default: the separate ops in that order (the reference for any
  // fused version, which must give the same result).
  virtual void kda_prepare(const KdaPrepare& p, const StepView& s, int64_t R) {
    short_conv_silu(p.qh, s, p.C, p.conv_w[0], p.K, p.conv_state[0], p.q);
    short_conv_silu(p.kh, s, p.C, p.conv_w[1], p.K, p.conv_state[1], p.k);
    short_conv_silu(p.vh, s, p.C, p.conv_w[2], p.K, p.conv_state[2], p.v);
    l2norm_scale(p.q, R * p.H, p.D, p.eps, p.q_scale);
    l2norm_scale(p.k, R * p.H, p.D, p.eps, 1.0f);
    kda_gate(p.f, R, p.H, p.D, p.A_log, p.dt_bias, p.lower_bound, p.g);
    sigmoid(p.beta, R * p.H);
  }
  // Gated delta rule: q, k, g [R,H,Dk], v, o [R,H,Dv], beta [R,H]; S_pool [slots,H,Dk,Dv]. A sequence
  // with more than one row uses `algo` (chunk size `chunk`); one row always the recurrence.
  virtual void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const StepView& s,
                   int64_t H, int64_t Dk, int64_t Dv, KdaAlgo algo, int64_t chunk, float* S_pool, float* o) = 0;
  // Appends the step's rows to the pages: c = RMSNorm(ckv[:, :kv_lora]) ⊙ norm_w, k_r = ckv[:, kv_lora:].
  virtual void mla_append(const float* ckv, const StepView& s, int64_t kv_lora, int64_t rope, const float* norm_w,
                          float eps, const MlaPages& pages) = 0;
  // Causal MLA of every row over its sequence's cache (after mla_append). q [R,heads,nope+rope] → out [R,heads,v].
  virtual void mla_attend(const float* q, const StepView& s, const MlaPages& pages, const WeightMat& kv_b,
                          const MlaAttnDims& d, MlaAlgo algo, float* out) = 0;

  // ---- MoE
  // Per row: σ(logits), top-k of σ + bias, weights from the unbiased σ (ops.h router_topk). idx/w [R, k].
  virtual void router_topk(const float* logits, const float* bias, int64_t R, int64_t E, int64_t k, bool renorm,
                           float scale, int32_t* idx, float* w) = 0;
  // agg[R, latent] = Σ_j w[r, j] · GLU_{idx[r, j]}(z[r]) over the routed experts in ascending expert
  // id, from the placed weights or, when `source` is set, from it.
  // terms set (a rank of an expert-parallel split, model/layers.cpp): no sum; terms[(r * top_k + j) *
  // latent ..] = GLU_{idx[r, j]}(z[r]) for the experts w.is_local() holds (the other slots are left
  // as they are), each the same bits the sum would add; agg is not touched.
  virtual void moe_routed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z,
                          const int32_t* idx, const float* wt, int64_t R, int64_t top_k, float* agg,
                          ExpertSource* source, float* terms = nullptr) = 0;
  // agg[r] = Σ_j w[r, j] · terms[r, j] from zero, in the order this backend's moe_routed adds them
  // (CPU: ascending expert id idx[r, j]; CUDA: top-k slot order j), so the sum of an expert-parallel
  // split's gathered terms is one rank's sum.
  // (Default: a one-line error; backends that run expert-parallel splits implement it.)
  virtual void moe_combine(const float* terms, const int32_t* idx, const float* wt, int64_t R, int64_t top_k,
                           int64_t latent, float* agg);

  // ---- collectives (a model split over ranks, model/parallel.h), on this backend's memory
  // Defaults: the communicator's own calls after this backend's queued work, right for backends
  // whose memory is host RAM; a device backend overrides them (NCCL) or refuses in one line.
  // out[r*n .. (r+1)*n) <- rank r's send[0 .. n).
  virtual void all_gather(Communicator& comm, const float* send, int64_t n, float* out);
  // out <- every rank's part, rank order; counts[r] floats from rank r (the same array on every rank).
  virtual void all_gather_v(Communicator& comm, const float* send, int64_t n, float* out, const int64_t* counts);
  // A rank of a model split over processes joins its group's device collectives, every rank at the
  // same point (the CUDA backend creates its NCCL communicator: rank 0's unique id goes to the others
  // through comm.broadcast_bytes). Default: nothing (host memory: comm itself serves).
  virtual void join_group(Communicator& comm) {}
  // buf[0 .. n) <- rank root's.
  virtual void broadcast(Communicator& comm, float* buf, int64_t n, int root);

  // ---- output
  // host_out[r] = argmax of row r of logits [R, V] (lowest id on ties).
  virtual void argmax_rows(const float* logits, int64_t R, int64_t V, int32_t* host_out) = 0;

  // ---- placement reports
  // The GPU's cache of hot experts (GpuOptions::hot_experts); all zero without one.
  virtual HotExpertStats hot_expert_stats() const { return {}; }
};

}  // namespace k3
