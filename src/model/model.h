// Model: a bound K3 checkpoint (config + typed weight views) and the whole forward pass.
// Session: per-sequence decode state (KDA recurrent + conv state, MLA latent cache, position).
// Owns: layer order, Block AttnRes snapshot/partial-sum rules (§3.3), final norm + lm_head.
// Must not: copy big weights (they stay views into the mmap'd shards) or read files after load
// (routed experts may instead arrive through ForwardOptions::experts, which runtime/ owns).
#pragma once
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.h"
#include "model/layers.h"
#include "ops/cpu/isa.h"

namespace k3 {
namespace io {
class Checkpoint;
}

// ---------------------------------------------------------------- GPU execution (model/gpu_forward.cpp)
// The CUDA backend keeps a device copy of the weights (MXFP4 experts stay 4-bit, stacked per layer)
// in a GpuModel, and each Session's KDA/conv state and MLA latent cache in a GpuSessionState.
// Both are opaque here (no CUDA headers in model/); builds without K3_CUDA fail use_gpu() clearly.
struct GpuModel;
struct GpuSessionState;
struct GpuModelDeleter {
  void operator()(GpuModel* p) const;
};
// Owns a GpuSessionState; copying a Session copies its device state on the device.
class GpuStateHandle {
 public:
  GpuStateHandle() = default;
  GpuStateHandle(const GpuStateHandle& o);
  GpuStateHandle& operator=(const GpuStateHandle& o);
  GpuStateHandle(GpuStateHandle&& o) noexcept : p(o.p) { o.p = nullptr; }
  GpuStateHandle& operator=(GpuStateHandle&& o) noexcept;
  ~GpuStateHandle();
  GpuSessionState* p = nullptr;
};

struct GpuOptions {
  bool graphs = true;            // capture single-token decode steps in CUDA graphs
  int64_t tokens_per_call = 256; // activation workspace size; longer forwards run in pieces
  int64_t initial_context = 4096;  // MLA cache capacity reserved per session (grows when needed)
};

// GPU memory a model needs (bytes), computed from the config and the bound weights (no GPU needed).
struct GpuMemoryPlan {
  size_t weights = 0;          // every weight the forward reads, in its stored format
  size_t state_fixed = 0;      // per session: KDA recurrent + conv state
  size_t state_per_token = 0;  // per session and cached token: MLA latent + rope key
  size_t workspace = 0;        // activations for tokens_per_call tokens
  int64_t context = 0;         // the context the totals below are for
  size_t total() const { return weights + workspace + state_fixed + state_per_token * size_t(context); }
};

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden] input_layernorm
  std::vector<float> post_norm;   // [hidden] post_attention_layernorm
  AttnResSite attn_res, mlp_res;  // self_attention_res_*, mlp_res_*
  bool is_kda = true;
  KdaWeights kda;
  MlaWeights mla;
  bool dense_ffn = false;
  GluWeights dense;  // layer < first_k_dense_replace
  MoeWeights moe;
};

struct LayerState {
  KdaState kda;
  MlaCache mla;
};

struct ModelDims {
  int64_t hidden = 0, vocab = 0, layers = 0, block_size = 0;
  float eps = 1e-5f;
  KdaDims kda;
  MlaDims mla;
  MoeDims moe;
  SituParams situ;
  static ModelDims from_config(const ModelConfig& c);
};

struct ForwardOptions {
  KdaAlgo kda_algo = KdaAlgo::Chunked;   // used when T > 1 (T == 1 always uses the recurrence)
  int64_t kda_chunk = 64;
  MlaAlgo mla_algo = MlaAlgo::Absorbed;
  // Routed experts come from here when set (e.g. runtime/expert_cache.h under --ram-budget);
  // nullptr = the resident mmap views. Not owned; must outlive the forward calls using it.
  ExpertSource* experts = nullptr;
  // Exact: the scalar fp64-accumulating kernels (reference grade; the library default and what the
  // gates use). F32: SIMD kernels in fp32. Fast: F32 + bf16-rounded activations in prefill GEMMs
  // and MXFP4 GEMVs (the CLI default). See ops/cpu/isa.h.
  ops::Numerics numerics = ops::Numerics::Exact;
  // GPU only, with all_logits false: the argmax of the last token's logits (ties -> lowest id) is
  // picked on the device and written here; the logits are then not copied back (logits may be
  // null). Greedy decoding without penalties uses it. Ignored on the CPU (logits are filled and
  // *argmax_out is set from them).
  int32_t* argmax_out = nullptr;
};

class Model;
GpuMemoryPlan gpu_memory_plan(const Model& m, const GpuOptions& o, int64_t context);
// The same from the config and the checkpoint's tensor bytes (k3 info: no weights bound).
GpuMemoryPlan gpu_memory_plan(const ModelConfig& c, size_t weight_bytes, const GpuOptions& o, int64_t context);

// True for the tensors of routed experts ("...block_sparse_moe.experts.N.w1/w2/w3...", plain or
// MXFP4), the part of a checkpoint that --ram-budget streams instead of keeping resident.
bool is_routed_expert_tensor(std::string_view name);

// One decoder layer L on T tokens of the depth state (§3.3 steps 1-7).
void decoder_layer(const ModelDims& d, int64_t L, const LayerWeights& w, LayerState& st, DepthState& depth, int64_t T,
                   const ForwardOptions& opt);

class Session;

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

  // Runs T tokens through the model, appending to the session's state. logits: [T, vocab] when
  // all_logits, else [1, vocab] for the last token only.
  void forward(Session& s, const int32_t* ids, int64_t T, bool all_logits, float* logits,
               const ForwardOptions& opt = {}) const;

  // Uploads the weights to the GPU (after checking they fit, with one-line errors); from then on
  // forward() runs there for sessions created afterwards. Numerics on the GPU: Fast = bf16
  // tensor-core GEMMs, F32 = fp32 parity mode; Exact (fp64 sums) is CPU-only and refused.
  void use_gpu(const GpuOptions& o = {});
  bool on_gpu() const { return gpu_ != nullptr; }
  void set_gpu_graphs(bool on) const;  // CUDA-graph replay of decode steps (default on); for benchmarks
  GpuModel* gpu() const { return gpu_.get(); }

  // Output-side pieces, public for tests.
  WeightMat embed, lm_head;            // [vocab, hidden]
  std::vector<float> final_norm;       // [hidden]
  AttnResSite output_res;              // output_attn_res_*
  std::vector<LayerWeights> layers;

 private:
  Model() = default;
  ModelConfig cfg_;
  ModelDims dims_;
  std::unique_ptr<io::Checkpoint> ckpt_;
  std::unique_ptr<GpuModel, GpuModelDeleter> gpu_;
};

class Session {
 public:
  explicit Session(const Model& m);
  void reset();
  int64_t position() const { return pos_; }
  // KDA fp32 recurrent + conv state bytes, and MLA latent cache bytes (fp32 as held here).
  size_t state_bytes() const;

  // A rollback point. KDA state cannot be un-applied, so a mark copies it (fixed size); the MLA
  // cache is only truncated back to the marked length, never copied.
  struct Mark {
    int64_t pos = 0;
    std::vector<KdaState> kda;      // per layer (empty for MLA layers)
    std::vector<int64_t> mla_len;   // per layer
  };
  Mark mark() const;
  void rollback(const Mark& m);  // k3::Error if the session no longer extends the mark

  // Exact binary image of the state (little-endian fp32), tagged with the model fingerprint.
  void save(std::ostream& out) const;
  void load(std::istream& in);  // k3::Error on a different model, bad magic or truncation

 private:
  friend class Model;
  friend struct GpuSessionState;
  const Model* model_;
  // Host state. While the model runs on the GPU the live state is on the device and this is only
  // a staging image (filled by gpu_pull for mark/save), hence mutable.
  mutable std::vector<LayerState> layers_;
  int64_t pos_ = 0;
  GpuStateHandle gpu_;              // device state when the model runs on the GPU
  // Device <-> host copies of the state (mark/rollback/save/load go through the host image).
  void gpu_pull(bool with_mla) const;  // KDA state + MLA lengths (+ cache contents if with_mla)
  void gpu_push(bool with_mla);
};

}  // namespace k3
