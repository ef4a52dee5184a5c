// Model: a bound K3-family checkpoint (config, dims, typed weight views), the backend it runs on and
// the one forward pass over a step of many sequences (model/forward.cpp). Session: one sequence as a
// slot of the model's own state pool, for callers that run one sequence at a time.
// Owns: the backend choice (CPU unless use_gpu), the placed weights, the planned workspace, and the
// FP8 trunk option (quantize_trunk_fp8: the one place that decides which weights are quantised).
// Must not: copy big weights on the CPU (they stay views into the mmap'd shards; the one exception is
// the FP8 trunk of quantize_trunk_fp8, which the model then owns) or read files after load (routed
// experts may instead arrive through ForwardOptions::experts, which runtime/ owns).
// Threads: one thread at a time drives forward/step of a model (they share its workspace).
#pragma once
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.h"
#include "model/backend.h"
#include "model/dims.h"
#include "model/layers.h"
#include "model/parallel.h"
#include "model/state_pool.h"
#include "model/weights.h"
#include "ops/cpu/isa.h"

namespace k3 {
namespace io {
class Checkpoint;
}

struct GpuOptions {
  bool graphs = true;              // capture single-token decode steps in CUDA graphs
  int64_t tokens_per_call = 256;   // rows of one step; longer steps run in pieces
  int64_t initial_context = 4096;  // cache pages reserved up front per sequence (grows when needed)
  // false: routed experts stay in host memory and every step uploads the ones it selects from the
  // ForwardOptions::experts source (--ram-budget); only the trunk goes to the GPU.
  bool experts_resident = true;
  // true: routed experts stay in host memory and the CPU cores compute them (the CPU backend's
  // kernels; from the ForwardOptions::experts source when there is one): the GPU runs the trunk,
  // and each MoE layer sends its [rows x latent] activations and routing to the host and the
  // routed sum back (issue 20's hybrid placement; no CUDA-graph replay).
  bool experts_on_cpu = false;
  // With experts_on_cpu: a GPU cache of the most often routed experts (issue 20). 0: none; (0, 1]: that
  // fraction of each MoE layer's routed experts; kHotExpertsAuto: as many as the GPU memory left over
  // holds (all but 1 GiB of what is free when the cache fills). The routing of the first
  // hot_warmup_tokens tokens of each layer picks them; each step's slots of cached experts then run on
  // the GPU while the CPU computes the others, and the GPU sums both (top-k slot order).
  double hot_experts = 0;
  int64_t hot_warmup_tokens = 64;
  // With experts_on_cpu in fast numerics: the CPU's experts in its own fast numerics too (a decode
  // row's activations quantised to 8 bits per 32-block, the q8 MXFP4 GEMV of a CPU-only run), about
  // twice the CPU's expert rate; off (default): fp32 activations, so the tokens are those of all on
  // the GPU (the q8 rounding moves near-tie tokens: docs/hybrid.md).
  bool cpu_experts_q8 = false;
  static constexpr double kHotExpertsAuto = -1;
  // With experts_on_cpu, a one-sequence prefill step (more rows than the decode GEMVs take): its routed
  // experts computed by the CPU (Cpu), or copied from host memory to the GPU group by group (two
  // staging buffers of stream_staging_bytes together, each copy beside the previous group's kernels)
  // and computed there with the all-on-GPU kernels (Gpu), or Auto: the first such layer one way and
  // the next the other, each timed, then per layer whichever the two measured rates make faster.
  enum class PrefillExperts : uint8_t { Auto, Cpu, Gpu };
  // A cap on the GPU memory the engine plans to use (--gpu-mem; 0: the device's free memory). Checked
  // against the plan before the upload; fit_gpu_mem chooses the split that honours it.
  size_t gpu_mem = 0;
  PrefillExperts prefill_experts = PrefillExperts::Auto;
  size_t stream_staging_bytes = size_t(2) << 30;
  // The GPU's multiprocessors, for the memory plan alone (the absorbed MLA kernel splits short steps
  // until 16 blocks per multiprocessor run, and its workspace holds the split partials): 132 (H100 /
  // H200 SXM) unless set; the CUDA backend plans with the device's own count.
  int64_t sm_count = 132;
};
// "auto" | "cpu" | "gpu" (--prefill-experts); k3::Error otherwise.
GpuOptions::PrefillExperts parse_prefill_experts(const std::string& s);
// The streamed prefill's two staging buffers for E experts of per_expert bytes each, as the CUDA
// backend sizes them (0 where it never streams: experts_on_cpu off, prefill_experts Cpu, or steps of
// at most 8 rows).
size_t stream_staging_plan(const GpuOptions& o, int64_t E, size_t per_expert);


// GPU memory a model needs (bytes), computed from the config and the bound weights (no GPU needed).
struct GpuMemoryPlan {
  size_t weights = 0;          // every weight the forward reads, in its stored format
  size_t state_fixed = 0;      // per sequence: KDA recurrent + conv state
  size_t state_per_token = 0;  // per sequence and cached token: MLA latent + rope key
  size_t workspace = 0;        // activations for tokens_per_call rows
  int64_t context = 0;         // the context the totals below are for
  size_t total() const { return weights + workspace + state_fixed + state_per_token * size_t(context); }
};

struct ForwardOptions {
  KdaAlgo kda_algo = KdaAlgo::Chunked;  // used for chunks of more than one token
  int64_t kda_chunk = 64;
  MlaAlgo mla_algo = MlaAlgo::Auto;
  // Routed experts come from here when set (e.g. runtime/expert_cache.h under --ram-budget);
  // nullptr = the placed weights. Not owned; must outlive the forward calls using it.
  ExpertSource* experts = nullptr;
  // Exact: the scalar fp64-accumulating kernels (reference grade; the library default and what the
  // gates use; CPU only). F32: SIMD kernels in fp32 (the GPU's parity mode). Fast: F32 + rounded
  // activations in prefill GEMMs and MXFP4 GEMVs (CPU), bf16 tensor-core GEMMs (GPU). See ops/cpu/isa.h.
  ops::Numerics numerics = ops::Numerics::Exact;
  // With all_logits false: the argmax of the last token's logits (ties -> lowest id) is written here;
  // logits may then be null (the GPU then copies back 4 bytes instead of the vocabulary's logits).
  int32_t* argmax_out = nullptr;
};

// One sequence's part of a step: `n` tokens appended to state slot `slot`.
struct SeqStep {
  int32_t slot = -1;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  bool all_logits = false;  // logits of every token, else of the last one only
};

class Model;
GpuMemoryPlan gpu_memory_plan(const Model& m, const GpuOptions& o, int64_t context);
// The placement that fits o.gpu_mem (--gpu-mem): o itself where its plan fits; else, unless the
// routed experts are placed by hand already (experts_on_cpu), the routed experts in host RAM computed
// by the CPU with as large a fraction of each layer's experts cached on the GPU as the cap leaves
// (hot_experts). A one-line k3::Error when even the trunk, state and workspace exceed the cap. `how`
// (if set) gets one line saying what was chosen and why.
GpuOptions fit_gpu_mem(const Model& m, const GpuOptions& o, std::string* how = nullptr);
// "12.34 GiB": the GPU memory messages' sizes (fit_gpu_mem, the CUDA backend's fit check).
std::string gib_text(size_t bytes);
// The same from the config and the checkpoint's tensor bytes (k3 info: no weights bound).
GpuMemoryPlan gpu_memory_plan(const ModelConfig& c, size_t weight_bytes, const GpuOptions& o, int64_t context);

// The features of a K3-family config this engine does not implement (one sentence each: "<flag>
// <value> (<meaning>) is not implemented by this engine (<what it implements>)"); empty for K3.
// The one place that refuses family members (model/kimi_k3.cpp); config/ only parses the flags.
std::vector<std::string> unsupported_features(const ModelConfig& c);
// Throws k3::Error "<config path>: <first sentence>[; N more: <flags>]" (one line) unless the config
// is runnable. Model::load and the checkpoint loader call it before sizing or binding anything.
void check_supported(const ModelConfig& c);

// True for the tensors of routed experts ("...block_sparse_moe.experts.N.w1/w2/w3...", plain or
// MXFP4), the part of a checkpoint that --ram-budget streams instead of keeping resident.
bool is_routed_expert_tensor(std::string_view name);

// One decoder layer L on the step's rows (§3.3 steps 1-7): the attention-site mix, a snapshot at block
// starts (the new partial sum is spare[blocks after the snapshot]), the attention sublayer into the
// partial sum, the FFN-site mix, the FFN. Its output is left in depth.pending (y): the next layer's
// first site adds it, fused with its mix and norm; after the last layer, settle_depth. a, xn, y: [R,
// hidden] scratch.
void decoder_layer(const StepCtx& c, const ModelDims& d, int64_t L, const LayerWeights& w, const StatePool& pool,
                   DepthState& depth, float* const* spare, float* a, float* xn, float* y, const ForwardOptions& opt);

// Workspace floats of one step of up to R rows (the plan the workspace is allocated from).
int64_t forward_work_floats(const ModelDims& d, int64_t R);

// The FP8 trunk (--trunk-fp8, issue 20): what Model::quantize_trunk_fp8 quantises is every matrix
// for_each_weight visits as WeightRole::Trunk: the attention projections, the MoE latent down/up
// projections, the shared experts and the dense FFN.
// Stored bytes of those matrices as bound and in FP8 (E4M3 + fp32 block scales): the memory check
// and `k3 info --trunk-fp8` count with it before anything is quantised.
struct TrunkFp8Bytes {
  int64_t matrices = 0;
  uint64_t before = 0, after = 0;
  uint64_t after_gpu = 0;  // the same matrices on the GPU (gpu_weight_bytes: per-row scales, kv_b in fp32)
};
TrunkFp8Bytes trunk_fp8_bytes(const ModelWeights& w);

struct TrunkFp8Report {
  TrunkFp8Bytes bytes;          // what was quantised
  uint64_t released_bytes = 0;  // pages of the mapping handed back (madvise MADV_DONTNEED)
  double seconds = 0;
};

// Where quantize_trunk_fp8 puts the trunk: FP8 (the option), or the reference twin of the same
// rounding, each trunk weight replaced by its dequantised FP8 value in F32 (4 bytes a weight; tests
// and measurements compare the FP8 kernels against it).
enum class TrunkFp8Store : uint8_t { Fp8, DequantizedF32 };

class Session;
struct OpProfile;

class Model {
 public:
  // Opens and binds `dir` (config.json + safetensors). Every missing/extra/mis-shaped/mis-typed
  // tensor is collected and reported in one k3::Error.
  static std::unique_ptr<Model> load(const std::string& dir);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ModelDims& dims() const { return dims_; }
  const io::Checkpoint& checkpoint() const { return *ckpt_; }
  // Identifies the architecture and checkpoint size (not the weight values): session files saved
  // with one model refuse to load into a model with a different fingerprint.
  uint64_t fingerprint() const;

  // One step of many sequences: seqs (distinct live slots of `pool`) each append their tokens.
  // logits (host) receives, sequence by sequence, n rows if all_logits else 1 row of [vocab]; it
  // may be null when argmax (host, [n_seqs]: the argmax of each sequence's last row) is given.
  // Steps of more rows than the workspace holds run in pieces. Each sequence's results equal the
  // same tokens run alone (bitwise on the CPU in exact numerics).
  void step(StatePool& pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, float* logits,
            int32_t* argmax = nullptr) const;

  // Runs T tokens of one session (a step of one sequence). logits: [T, vocab] when all_logits,
  // else [1, vocab] for the last token only.
  void forward(Session& s, const int32_t* ids, int64_t T, bool all_logits, float* logits,
               const ForwardOptions& opt = {}) const;

  // Rows of one step on the CPU (default 512): longer steps run in pieces of this many rows.
  void set_max_step_rows(int64_t rows);
  int64_t max_step_rows() const { return max_rows_; }

  // The state pool Sessions of this model live in (created on first use, on the current backend).
  StatePool& session_pool() const;
  // A fresh pool on this model's backend (a server's own; sessions are not in it).
  std::unique_ptr<StatePool> new_pool(const StatePoolOptions& o = {}) const;

  // Splits the model over p.world() ranks (model/parallel.h): tensor parallel (p.tp), expert
  // parallel (p.ep) or both, the ranks as threads of this process on the CPU backend. Steps, pools
  // and sessions then run on every rank; logits are rank 0's. One-line k3::Error when the model
  // cannot be cut so, or is on the GPU. Sessions created before refuse to run. A plan of one rank
  // changes nothing.
  // Under an MPI launch (process_group(), core/comm.h) the ranks are the launch's processes instead:
  // split_across(p, *process_group()), and on ranks > 0 it throws FollowerDone when rank 0 is done.
  void split(const ParallelPlan& p);
  // Splits over ranks in other processes (model/remote.h): this process is rank comm.rank() of
  // comm.size() == p.world() (a one-line k3::Error otherwise). Rank 0 returns true with a split model
  // that drives the others (steps, pools and sessions as with split()); ranks > 0 follow rank 0's
  // steps until it closes the group (its model is destroyed), then return false. Every rank must
  // load the same checkpoint with the same options and call this with the same plan.
  bool split_across(const ParallelPlan& p, Communicator& comm);
  ParallelPlan parallel() const;  // how the model is split (one rank: tp = ep = 1)
  // The weights this process reads when it holds one rank of a model split over processes
  // (split_across): that rank's views (row slices, its experts); null otherwise (this process reads
  // every weight it holds). Loading reads in only these (prefault_weights).
  const ModelWeights* process_rank_weights() const;
  // Reads in this process's rank's weights (process_rank_weights) with progress(done, total bytes),
  // and tells the other processes to read in theirs at the same time; false (nothing read) when
  // this process does not hold one rank of a model split over processes.
  bool prefault_process_rank(const std::function<void(uint64_t, uint64_t)>& progress) const;

  // --trunk-fp8: quantises every trunk matrix (trunk_fp8_bytes) from its stored format into FP8
  // (E4M3, one fp32 scale per 128 x 128 block: ops/fp8.h) held by this model, in parallel on the
  // engine's thread pool, rewrites the host and placed views to it, and releases the mapping's pages
  // of the tensors it replaced (they are read once, here). The router, the routed experts (MXFP4,
  // used as shipped), the embedding and lm_head stay as they are. Call after load, before split()
  // or use_gpu(): a one-line k3::Error on a model already split, on the GPU, or already quantised
  // (and on a non-finite trunk weight, naming the tensor).
  TrunkFp8Report quantize_trunk_fp8(TrunkFp8Store store = TrunkFp8Store::Fp8);
  bool trunk_fp8() const { return trunk_fp8_; }
  // True for a checkpoint tensor the FP8 trunk replaced (prefaulting skips it: its pages were released).
  bool replaced_by_trunk_fp8(std::string_view tensor_name) const;

  // Moves the model to the GPU (uploads the weights after checking they fit, with one-line errors);
  // sessions created before refuse to run. Numerics on the GPU: Fast = bf16 tensor-core GEMMs,
  // F32 = fp32 parity mode; Exact (fp64 sums) is CPU-only and refused.
  // A model split over processes (split_across) moves every rank to its process's GPU (one GPU per
  // process, tensor parallel only; the ranks' device collectives over NCCL); split with ranks as
  // threads it is refused in one line.
  void use_gpu(const GpuOptions& o = {});
  // A rank of a model split over processes moves to this process's GPU and joins its group's device
  // collectives (rank 0 from use_gpu, the followers from rank 0's message: model/remote.h).
  void use_gpu_rank(const GpuOptions& o);
  bool on_gpu() const;
  void set_gpu_graphs(bool on) const;
  // Per-op wall time of the steps that follow into `sink` (null: stop timing); see
  // model/backend_profile.h. Call after use_gpu (which replaces the backend).
  void set_op_profile(OpProfile* sink);  // CUDA-graph replay of decode steps (default on); for benchmarks
  Backend& backend() const { return *backend_; }
  const ModelWeights& placed() const { return placed_; }  // the weights as the backend reads them

  // The bound weights (host views into the mapping).
  const ModelWeights& weights() const { return host_; }
  const WeightMat& embed = host_.embed;
  const WeightMat& lm_head = host_.lm_head;
  const FVec& final_norm = host_.final_norm;
  const AttnResSite& output_res = host_.output_res;
  const std::vector<LayerWeights>& layers = host_.layers;

 private:
  friend std::unique_ptr<Model> bind_kimi_k3(const std::string& dir);
  friend class Session;
  Model();
  // One piece of a step (at most max_rows_ rows): sel are the rows whose logits go to logits rows dst
  // (am: the argmax index of the row's sequence when it is the sequence's last row, else -1).
  void run_piece(StatePool& pool, std::span<const SeqStep> seqs, const std::vector<int32_t>& sel,
                 const std::vector<int64_t>& dst, const std::vector<int64_t>& am, const ForwardOptions& opt,
                 float* logits, int32_t* argmax) const;
  // A split model's step: every rank's step on its own shard of `pool`, on threads of their own.
  void step_split(StatePool& pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, float* logits,
                  int32_t* argmax) const;
  // Rank r of `full` split by p (model/parallel.cpp), talking to the others through comm.
  void check_can_split(const ParallelPlan& p) const;
  void use_gpu_here(const GpuOptions& o);
  void use_gpu_split(const GpuOptions& o);
  static std::unique_ptr<Model> make_rank(const Model& full, const ParallelPlan& p, int r, Communicator* comm);
  ModelConfig cfg_;
  ModelDims dims_;
  std::unique_ptr<io::Checkpoint> ckpt_;
  std::vector<std::unique_ptr<float[]>> vec_store_;  // the decoded small vectors the host views point at
  ModelWeights host_;
  ModelWeights placed_;
  std::unique_ptr<Backend> backend_;
  // A split model's ranks (null otherwise); on a rank model, its place in the group.
  std::unique_ptr<SplitGroup> split_;
  RankRole role_;
  int64_t max_rows_ = 512;              // rows of one step (workspace plan)
  StatePoolOptions session_pool_opts_;  // the sessions' pool (GPU: pages for initial_context)
  mutable std::unique_ptr<Workspace> work_;
  // The host-side index arrays of a step (rows, slots, block tables, selected rows), kept between
  // steps so that a steady decode step allocates nothing.
  struct StepIndex {
    std::vector<int64_t> out0, done, src, dst, am, pos0;
    std::vector<SeqStep> piece;
    std::vector<int32_t> sel, cu, slots, ids, table, sel_groups, picks, rows;
    std::vector<float*> spare;
  };
  mutable StepIndex ix_;
  mutable std::unique_ptr<StatePool> sessions_;
  uint64_t backend_generation_ = 0;  // bumped by use_gpu: older sessions refuse to run
  // The FP8 trunk: the memory its views point at (codes and block scales, or the dequantised F32 twin)
  // and the data pointers of the tensors it replaced, sorted.
  bool trunk_fp8_ = false;
  std::unique_ptr<uint8_t[]> trunk_fp8_store_;
  std::vector<const void*> trunk_fp8_sources_;
};

class Session {
 public:
  explicit Session(const Model& m);
  ~Session();
  Session(const Session& o);             // a fork: same state, cache pages shared until written
  Session& operator=(const Session& o);  // becomes a copy of o (keeps its own slot)
  void reset();
  int64_t position() const;
  int32_t slot() const { return slot_; }
  // KDA fp32 recurrent + conv state bytes, and MLA latent cache bytes (fp32 as held here).
  size_t state_bytes() const;

  // A rollback point. KDA state cannot be un-applied, so a mark copies it (fixed size); the MLA
  // cache is only shortened back to the marked length, never copied.
  using Mark = StatePool::Snapshot;
  Mark mark() const;
  void rollback(const Mark& m);  // k3::Error if the session no longer extends the mark

  // Exact binary image of the state (little-endian fp32), tagged with the model fingerprint.
  void save(std::ostream& out) const;
  void load(std::istream& in);  // k3::Error on a different model, bad magic or truncation

 private:
  friend class Model;
  StatePool& pool() const;
  const Model* model_;
  int32_t slot_ = -1;
  uint64_t generation_ = 0;
};

}  // namespace k3
