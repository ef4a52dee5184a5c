// ModelConfig: the whole text architecture of a Kimi K3 (kimi_linear) model in one strict struct.
// Owns: reading config.json (nested `text_config` of the released `kimi_k3` wrapper, or the flat
// `kimi_linear` form), validating it, and answering layer-type questions.
// Must not: guess. A missing key, a value of the wrong type, an out-of-range layer list or an
// unsupported value (activation, router, grouped top-k...) is a k3::Error that lists every problem.
// Keys the engine does not use (vision_config, rope_theta, head_dim, ...) are ignored.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3 {

struct ModelConfig {
  std::string source;  // path it was read from (for messages)
  std::string model_type;  // wrapper type ("kimi_k3") or "kimi_linear" for the flat form

  // --- trunk
  int64_t hidden_size = 0;          // H (7168)
  int64_t num_hidden_layers = 0;    // 93
  int64_t vocab_size = 0;           // 163840
  double rms_norm_eps = 0;          // 1e-5: every norm except the MLA LoRA norms
  bool tie_word_embeddings = false;  // must be false (K3 ships a separate lm_head)
  int64_t max_position_embeddings = 0;

  // --- FFN (SiTU-GLU everywhere)
  double situ_beta = 0;          // activation_situ_beta (4.0): gate cap
  double situ_linear_beta = 0;   // activation_situ_linear_beta (25.0): up-branch cap
  int64_t intermediate_size = 0;      // dense FFN width (layers < first_k_dense_replace)
  int64_t first_k_dense_replace = 0;  // 1
  int64_t moe_layer_freq = 1;

  // --- Stable LatentMoE
  int64_t num_experts = 0;              // 896
  int64_t num_experts_per_token = 0;    // top-k 16
  int64_t num_shared_experts = 0;       // 2, fused into one MLP of width n * moe_intermediate_size
  int64_t moe_intermediate_size = 0;    // 3072
  int64_t routed_expert_hidden_size = 0;  // latent width 3584
  bool latent_moe_use_norm = true;
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;

  // --- gated MLA (NoPE)
  int64_t num_attention_heads = 0;  // 96
  int64_t q_lora_rank = 0;          // 1536
  int64_t kv_lora_rank = 0;         // 512
  int64_t qk_nope_head_dim = 0;     // 128
  int64_t qk_rope_head_dim = 0;     // 64 (present and cached, never rotated)
  int64_t v_head_dim = 0;           // 128
  bool mla_use_output_gate = true;
  // Not a config key: the first-party code builds q_a/kv_a layernorms with KimiRMSNorm's default.
  double mla_lora_norm_eps = 1e-6;

  // --- Block AttnRes
  int64_t attn_res_block_size = 0;  // 12

  // --- KDA (text_config.linear_attn_config)
  std::vector<int64_t> full_attn_layers;  // ONE-based, as in the file
  std::vector<int64_t> kda_layers;        // ONE-based
  int64_t kda_num_heads = 0;              // 96
  int64_t kda_head_dim = 0;               // 128 (d_k = d_v)
  int64_t short_conv_kernel_size = 0;     // 4
  double gate_lower_bound = 0;            // -5.0
  bool use_full_rank_gate = true;

  // --- special tokens (wrapper level in the nested form; optional)
  int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;

  // Zero-based layer predicates.
  bool is_kda(int64_t layer) const;    // (layer+1) in kda_layers
  bool is_mla(int64_t layer) const { return !is_kda(layer); }
  bool is_dense_ffn(int64_t layer) const { return layer < first_k_dense_replace; }
  int64_t kda_dim() const { return kda_num_heads * kda_head_dim; }
  int64_t mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t shared_intermediate() const { return num_shared_experts * moe_intermediate_size; }
};

// Reads `<dir>/config.json` (or the file itself when `path` names a file).
ModelConfig load_model_config(const std::string& path);
// Parses config JSON text; `label` prefixes error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& label);

}  // namespace k3
