// The K3 decoder sublayers as functions of (dims, weights, state, input): KDA, gated MLA,
// Stable LatentMoE, dense SiTU FFN, and Block AttnRes bookkeeping (spec k3-architecture.md §3).
// Owns: the order of operations inside each sublayer. Weights arrive as WeightMat views or small
// fp32 vectors (norm gains, conv taps, biases) decoded at bind time.
// Must not: read files or know tensor names (that is model/weights.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "ops/ops.h"

namespace k3 {

// ---------------------------------------------------------------- KDA (§3.5)
struct KdaDims {
  int64_t hidden = 0, heads = 0, head_dim = 0, conv_k = 0;
  float lower_bound = -5.0f;
  float norm_eps = 1e-5f;  // o_norm (per head RMSNorm)
  int64_t dim() const { return heads * head_dim; }
};

struct KdaWeights {
  WeightMat q_proj, k_proj, v_proj;  // [heads*head_dim, hidden]
  WeightMat f_a_proj;                // [head_dim, hidden]   decay-gate low-rank A
  WeightMat f_b_proj;                // [heads*head_dim, head_dim]
  WeightMat b_proj;                  // [heads, hidden]      β logits
  WeightMat g_proj;                  // [heads*head_dim, hidden] output gate
  WeightMat o_proj;                  // [hidden, heads*head_dim]
  std::vector<float> q_conv, k_conv, v_conv;  // [heads*head_dim, conv_k] taps oldest→newest
  std::vector<float> A_log;                   // [heads] (first `heads` of the padded checkpoint vector)
  std::vector<float> dt_bias;                 // [heads*head_dim]
  std::vector<float> o_norm;                  // [head_dim] shared by all heads
};

struct KdaState {
  std::vector<float> S;                       // [heads, head_dim(k), head_dim(v)] fp32
  std::vector<float> conv_q, conv_k, conv_v;  // [heads*head_dim, conv_k-1] previous inputs oldest→newest
  void reset(const KdaDims& d);
};

enum class KdaAlgo { Recurrent, Chunked };

// out[T, hidden] = KDA(x[T, hidden]) where x is already input_layernorm-ed; state carried.
void kda_forward(const KdaDims& d, const KdaWeights& w, KdaState& st, const float* x, int64_t T, KdaAlgo algo,
                 int64_t chunk, float* out);

// ---------------------------------------------------------------- gated MLA, NoPE (§3.6)
struct MlaDims {
  int64_t hidden = 0, heads = 0, q_lora = 0, kv_lora = 0, nope = 0, rope = 0, v = 0;
  float lora_eps = 1e-6f;  // q_a_layernorm / kv_a_layernorm
  bool output_gate = true;
};

struct MlaWeights {
  WeightMat q_a_proj;    // [q_lora, hidden]
  WeightMat q_b_proj;    // [heads*(nope+rope), q_lora]
  WeightMat kv_a_proj;   // [kv_lora+rope, hidden]   rows [0,kv_lora) latent c, then shared k_r
  WeightMat kv_b_proj;   // [heads*(nope+v), kv_lora] per head: W_UK rows then W_UV rows
  WeightMat g_proj;      // [heads*v, hidden] (empty when output_gate is false)
  WeightMat o_proj;      // [hidden, heads*v]
  std::vector<float> q_a_norm;   // [q_lora]
  std::vector<float> kv_a_norm;  // [kv_lora]
};

// Latent cache of one MLA layer: per token the post-norm latent c and the raw shared k_r.
struct MlaCache {
  std::vector<float> c;   // [len, kv_lora]
  std::vector<float> kr;  // [len, rope]
  int64_t len = 0;
  void reset() { c.clear(); kr.clear(); len = 0; }
};

enum class MlaAlgo { Expanded, Absorbed };

// Appends the T new tokens to the cache and attends causally over everything cached.
void mla_forward(const MlaDims& d, const MlaWeights& w, MlaCache& cache, const float* x, int64_t T, MlaAlgo algo,
                 float* out);

// ---------------------------------------------------------------- FFNs (§3.7, §3.8)
struct SituParams {
  float beta = 4.0f, linear_beta = 25.0f;
};

struct GluWeights {
  WeightMat gate, up;  // [inter, in]
  WeightMat down;      // [out, inter]
};
// out[T, out] = down · SiTU(gate x, up x)
void glu_forward(const GluWeights& w, const SituParams& p, const float* x, int64_t T, float* out);

struct MoeDims {
  int64_t hidden = 0, latent = 0, inter = 0, experts = 0, top_k = 0;
  bool renormalize = true, latent_norm = true;
  float routed_scale = 1.0f, norm_eps = 1e-5f;
  SituParams situ;
};

struct MoeWeights {
  int64_t layer = -1;                // decoder layer index (the key an ExpertSource is asked for)
  WeightMat gate;                    // [experts, hidden] router
  std::vector<float> bias;           // [experts] e_score_correction_bias (selection only)
  WeightMat down_lat;                // [latent, hidden]
  std::vector<float> lat_norm;       // [latent]
  WeightMat up_lat;                  // [hidden, latent]
  std::vector<GluWeights> experts;   // gate=w1 [inter, latent], up=w3, down=w2 [latent, inter]
                                     // (views into the mapping; never read when an ExpertSource is given)
  GluWeights shared;                 // fused shared experts [n_shared*inter, hidden]; empty if none
};

// Where routed-expert weights come from when they are not all resident (runtime/expert_cache.h
// streams them from disk into a bounded cache). Implementations need not be thread-safe: one
// fetch at a time per source.
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  // Makes experts ids[0..n) (distinct, n <= max_batch()) of MoE layer `layer` available; out[i]
  // points at their weights (same formats and bytes as the resident views), valid until the
  // next fetch on this source.
  virtual void fetch(int64_t layer, const int32_t* ids, int64_t n, const GluWeights** out) = 0;
  // How many experts one fetch may ask for (>= 1).
  virtual int64_t max_batch() const = 0;
};

// Routed experts are computed grouped by expert, in ascending expert id, whatever `experts` is:
// nullptr = the resident views in w.experts; else the union of the experts the T tokens select is
// fetched from `experts` in batches of at most max_batch() (each distinct expert once per call).
// Same kernels on the same bytes in the same order, so both ways give bit-identical outputs.
void moe_forward(const MoeDims& d, const MoeWeights& w, const float* x, int64_t T, float* out,
                 ExpertSource* experts = nullptr);

// ---------------------------------------------------------------- Block AttnRes (§3.3)
struct AttnResSite {
  std::vector<float> fold;  // [hidden] = w_norm ⊙ w_proj, folded at bind time
};

// Per-token depth state: block snapshots B (each [T, hidden]) and the running partial sum P.
struct DepthState {
  std::vector<std::vector<float>> blocks;
  std::vector<float> partial;  // empty = ∅ (just after a snapshot)
};

// out[T, hidden] = Agg(B ∪ {P}) at one site (P omitted when empty).
void attnres_site(const AttnResSite& site, const DepthState& st, int64_t T, int64_t hidden, float eps, float* out);

}  // namespace k3
