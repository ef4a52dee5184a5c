// The dimensions and scalar hyper-parameters of a K3-family model, per sublayer kind, derived once
// from the ModelConfig; and the state sizes they imply (the one place that computes them).
// Must not: hold weights or state.
#pragma once
#include <algorithm>
#include <cstdint>

namespace k3 {

struct ModelConfig;

// ---------------------------------------------------------------- KDA (§3.5)
struct KdaDims {
  int64_t hidden = 0, heads = 0, head_dim = 0, conv_k = 0;
  float lower_bound = -5.0f;  // the bounded gate lb·σ(...) of K3; 0: the unbounded −exp(A_log)·softplus (Kimi Linear)
  float norm_eps = 1e-5f;     // o_norm (per head RMSNorm)
  bool low_rank_gate = false;  // output gate g_b(g_a x) (Kimi Linear) instead of the full-rank g_proj x (K3)
  int64_t dim() const { return heads * head_dim; }
  int64_t state_floats() const { return heads * head_dim * head_dim; }  // S [H, Dk, Dv], per sequence
  int64_t conv_floats() const { return dim() * (conv_k - 1); }          // one of q/k/v conv history
  // The GPU's tensor-core chunked KDA (ops/cuda/kda_tc.cu, bf16 prefill): whether it takes these
  // heads, and its workspace for a step of `rows` tokens (one record per 64-token chunk and head:
  // bf16 W and Q rows [2C x D], KS [C x D], Aqk [C x C], U [C x D], fp32 decay [D]; longer steps run in
  // windows of these chunks).
  bool tc_supported() const { return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128; }
  static constexpr int64_t kTcChunk = 64;
  int64_t tc_record_bytes() const {
    const int64_t D = head_dim, C = kTcChunk;
    return (2 * C * D + D * C + C * C + C * D) * 2 + D * 4;
  }
  int64_t tc_work_chunks(int64_t rows) const { return (rows + kTcChunk - 1) / kTcChunk + 8; }
  uint64_t tc_work_bytes(int64_t rows) const {
    return tc_supported() ? uint64_t(tc_work_chunks(rows)) * uint64_t(heads) * uint64_t(tc_record_bytes()) : 0;
  }
};

// ---------------------------------------------------------------- gated MLA, NoPE (§3.6)
struct MlaDims {
  int64_t hidden = 0, heads = 0, q_lora = 0, kv_lora = 0, nope = 0, rope = 0, v = 0;  // q_lora 0: a direct q_proj
  float lora_eps = 1e-6f;  // q_a_layernorm / kv_a_layernorm
  bool output_gate = true;
  int64_t cache_floats_per_token() const { return kv_lora + rope; }  // normed latent c + raw k_r
};

// ---------------------------------------------------------------- FFNs (§3.7, §3.8)
// SiTU-GLU caps; {0, 0} is the SiLU-GLU g·σ(g)·u (hidden_act "silu", Kimi Linear).
struct SituParams {
  float beta = 4.0f, linear_beta = 25.0f;
};

struct MoeDims {
  int64_t hidden = 0, latent = 0, inter = 0, experts = 0, top_k = 0;
  bool renormalize = true, latent_norm = true;
  bool latent_proj = true;  // false: experts in the hidden space (latent == hidden, no down/up projection)
  float routed_scale = 1.0f, norm_eps = 1e-5f;
  SituParams situ;
};

struct ModelDims {
  int64_t hidden = 0, vocab = 0, layers = 0;
  int64_t block_size = 0;                     // Block AttnRes block size; 0: the plain residual sum
  int64_t kda_layers = 0, mla_layers = 0;     // how many of each attention kind
  int64_t dense_inter = 0, shared_inter = 0;  // dense FFN / fused shared experts intermediate (0 = none)
  float eps = 1e-5f;
  KdaDims kda;
  MlaDims mla;
  MoeDims moe;
  SituParams situ;
  static ModelDims from_config(const ModelConfig& c);
  // Fixed state of one sequence: KDA recurrent state + conv histories of every KDA layer (fp32 bytes).
  uint64_t kda_state_bytes() const {
    return uint64_t(kda_layers) * 4 * uint64_t(kda.state_floats() + 3 * kda.conv_floats());
  }
  // MLA latent cache of one sequence per cached token, all MLA layers (fp32 bytes).
  uint64_t mla_bytes_per_token() const { return uint64_t(mla_layers) * 4 * uint64_t(mla.cache_floats_per_token()); }
  // The widest input of a dense product (the GPU's bf16 copy of a step's activations holds rows x this).
  int64_t widest_product_input() const {
    return std::max({hidden, kda.dim(), mla.heads * mla.v, mla.q_lora, dense_inter, shared_inter, moe.latent,
                     moe.inter});
  }
};

}  // namespace k3
