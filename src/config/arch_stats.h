// Architecture statistics of a ModelConfig: parameter counts per block and in total (from the
// tensor shapes of spec k3-architecture.md §2), active parameters per token, decode-state and
// MLA-cache bytes (§5), the layer map, AttnRes snapshot layers and the `k3 info` text report.
// Must not: read files or tensors (pure functions of ModelConfig). Counts are logical parameters
// (an MXFP4 weight counts as one parameter; its scale bytes are not parameters).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/model_config.h"

namespace k3 {

struct ArchParams {
  // Per-block logical parameter counts.
  int64_t kda_attention = 0;    // one KDA attention block (q/k/v, convs, f_a/f_b, A_log, dt_bias, b, g, o_norm, o)
  int64_t mla_attention = 0;    // one gated MLA block (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, g, o)
  int64_t moe_excl_routed = 0;  // router gate + correction bias + latent down/norm/up + fused shared experts
  int64_t dense_ffn = 0;        // gate + up + down of a dense layer
  int64_t routed_expert = 0;    // w1 + w3 + w2 of one routed expert
  int64_t layer_norms = 0;      // per layer: input/post-attention norms + two AttnRes (norm, proj) pairs
  // Model-level tensors.
  int64_t embedding = 0;        // embed_tokens
  int64_t lm_head = 0;          // untied head
  int64_t final_norm = 0;       // norm
  int64_t output_attn_res = 0;  // output_attn_res_norm + output_attn_res_proj
  // Layer counts.
  int64_t n_kda_layers = 0, n_mla_layers = 0, n_dense_layers = 0, n_moe_layers = 0;
  // Aggregates.
  int64_t trunk = 0;                 // every layer except routed experts, + final norm + output AttnRes
  int64_t always_active = 0;         // trunk + embedding + lm_head
  int64_t routed_experts_total = 0;  // n_moe_layers * num_experts * routed_expert
  int64_t total = 0;                 // always_active + routed_experts_total
  int64_t active_per_token = 0;      // trunk + lm_head + top_k experts per MoE layer (embedding lookup excluded)
};

// Throws k3::Error if a count does not fit in int64 (only possible for absurd configs).
ArchParams compute_arch_params(const ModelConfig& c);

// Decode-state sizes (§5).
int64_t kda_recurrent_state_bytes(const ModelConfig& c);  // fp32 S: n_kda * H * D * D * 4, per sequence
int64_t kda_conv_state_bytes(const ModelConfig& c);       // fp32: n_kda * 3 * (H*D) * (K-1) * 4, per sequence
// Absorbed MLA latent cache: n_mla * (kv_lora_rank + qk_rope_head_dim) * bytes_per_value.
int64_t mla_cache_bytes_per_token(const ModelConfig& c, int64_t bytes_per_value = 2);
int64_t mla_cache_bytes(const ModelConfig& c, int64_t tokens, int64_t bytes_per_value = 2);

// Zero-based layer sets.
std::vector<int64_t> mla_layers_zero_based(const ModelConfig& c);
std::vector<int64_t> kda_layers_zero_based(const ModelConfig& c);
std::vector<int64_t> attn_res_snapshot_layers(const ModelConfig& c);  // L with L % block == 0

// One character per layer ('K' KDA, 'M' MLA), a space after every AttnRes block,
// e.g. "KKKMKKKMKKKM KKKM... KKKMKKKMKKMM" for K3 (block size 12).
std::string layer_map_string(const ModelConfig& c);

// 1234567 -> "1,234,567".
std::string format_thousands(int64_t v);

// Multi-line human-readable summary for `k3 info` (ends with a newline).
std::string format_arch_report(const ModelConfig& c, int64_t ctx_tokens);

}  // namespace k3
