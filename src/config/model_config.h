// ModelConfig: the whole text architecture of a Kimi K3-family (kimi_linear) model in one strict struct.
// Owns: reading config.json (nested `text_config` of the released `kimi_k3` wrapper, or the flat
// `kimi_linear` form of e.g. Kimi Linear 48B-A3B), validating it, recording which family member it
// describes (the family flags below) and answering layer-type questions.
// Must not: guess, or refuse a well-formed family member. A missing key, a value of the wrong type,
// an out-of-range number or an inconsistent layer list is a k3::Error that lists every problem; a
// feature this engine does not implement (SiLU, plain residual, grouped top-k...) parses into its flag
// and is refused in one place, check_supported() in model/kimi_k3.cpp, when a model is built.
// Absent family keys mean the member without the feature (documented field by field below).
// Keys the engine does not use (vision_config, rope_theta, head_dim, ...) are ignored.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3 {

// Family flags (what a K3-family member's config selects). K3 itself is the first value of each.
enum class FfnActivation { SiTU, SiLU, Other };           // hidden_act "situ" / "silu" / anything else
enum class ResidualKind { BlockAttnRes, PlainSum };       // attn_res_block_size present / absent
enum class MoeKind { Latent, Hidden };                    // routed_expert_hidden_size present / absent
enum class RouterActivation { Sigmoid, Softmax, Other };  // moe_router_activation_func

struct ModelConfig {
  std::string source;      // path it was read from (for messages)
  std::string model_type;  // wrapper type ("kimi_k3") or "kimi_linear" for the flat form

  // --- trunk
  int64_t hidden_size = 0;           // H (7168)
  int64_t num_hidden_layers = 0;     // 93
  int64_t vocab_size = 0;            // 163840
  double rms_norm_eps = 0;           // 1e-5: every norm except the MLA LoRA norms
  bool tie_word_embeddings = false;  // K3: false (a separate lm_head); true is refused by check_supported
  // max_position_embeddings, or model_max_length when only that is given (Kimi Linear's config).
  int64_t max_position_embeddings = 0;

  // --- FFN: GLU with the activation of hidden_act
  std::string hidden_act;  // as written ("situ" for K3, "silu" for Kimi Linear)
  FfnActivation activation = FfnActivation::SiTU;
  double situ_beta = 0;               // activation_situ_beta (4.0): gate cap; required for SiTU, else 0 when absent
  double situ_linear_beta = 0;        // activation_situ_linear_beta (25.0): up-branch cap; likewise
  int64_t intermediate_size = 0;      // dense FFN width (layers < first_k_dense_replace)
  int64_t first_k_dense_replace = 0;  // 1
  int64_t moe_layer_freq = 1;         // >= 1; K3: 1 (every layer from first_k_dense_replace on is MoE)

  // --- MoE: Stable LatentMoE (K3) or experts in the hidden space (routed_expert_hidden_size absent)
  int64_t num_experts = 0;            // 896
  int64_t num_experts_per_token = 0;  // top-k 16
  int64_t num_shared_experts = 0;     // 2, fused into one MLP of width n * moe_intermediate_size
  int64_t moe_intermediate_size = 0;  // 3072
  MoeKind moe_kind = MoeKind::Latent;
  int64_t routed_expert_hidden_size = 0;  // latent width 3584 (0 when moe_kind is Hidden)
  bool latent_moe_use_norm = true;        // required for Latent; false when Hidden and absent
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;
  std::string router_activation_name;  // moe_router_activation_func as written ("sigmoid")
  RouterActivation router_activation = RouterActivation::Sigmoid;
  // Expert selection: topk_method (empty when absent: plain bias-corrected top-k), and grouped
  // top-k (num_expert_group groups, the best topk_group of them searched; 1 and 1 when absent).
  std::string topk_method;
  bool use_grouped_topk = false;  // informational (false when absent); groups == 1 is ungrouped either way
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;

  // --- MLA (K3: gated, NoPE, with a query LoRA)
  int64_t num_attention_heads = 0;  // 96
  bool mla_use_nope = true;         // false: RoPE on the rope slot (refused by check_supported)
  bool mla_q_lora = true;           // false when q_lora_rank is null (a direct q_proj; then q_lora_rank is 0)
  int64_t q_lora_rank = 0;          // 1536
  int64_t kv_lora_rank = 0;         // 512
  int64_t qk_nope_head_dim = 0;     // 128
  int64_t qk_rope_head_dim = 0;     // 64 (present and cached, never rotated)
  int64_t v_head_dim = 0;           // 128
  bool mla_use_output_gate = true;  // false when absent (Kimi Linear's MLA has no output gate)
  // Not a config key: the first-party code builds q_a/kv_a layernorms with KimiRMSNorm's default.
  double mla_lora_norm_eps = 1e-6;

  // --- residual stream: Block AttnRes (K3) or the plain residual sum (attn_res_block_size absent)
  ResidualKind residual = ResidualKind::BlockAttnRes;
  int64_t attn_res_block_size = 0;  // 12 (0 when residual is PlainSum)

  // --- KDA (text_config.linear_attn_config)
  std::vector<int64_t> full_attn_layers;  // ONE-based, as in the file
  std::vector<int64_t> kda_layers;        // ONE-based
  int64_t kda_num_heads = 0;              // 96
  int64_t kda_head_dim = 0;               // 128 (d_k = d_v)
  int64_t short_conv_kernel_size = 0;     // 4
  bool kda_gate_bounded = true;           // gate_lower_bound present (K3); absent: the unbounded decay gate
  double gate_lower_bound = 0;            // -5.0 (0 when absent)
  bool use_full_rank_gate = true;         // false when absent: the low-rank output gate pair (Kimi Linear)

  // --- special tokens (wrapper level in the nested form; optional)
  int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;

  // Zero-based layer predicates.
  bool is_kda(int64_t layer) const;  // (layer+1) in kda_layers
  bool is_mla(int64_t layer) const { return !is_kda(layer); }
  bool is_dense_ffn(int64_t layer) const { return layer < first_k_dense_replace; }
  int64_t kda_dim() const { return kda_num_heads * kda_head_dim; }
  int64_t mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t shared_intermediate() const { return num_shared_experts * moe_intermediate_size; }
  // The family flags in one line ("situ 4/25, Block AttnRes 12, latent MoE 3584, ..."; for k3 info).
  std::string family_summary() const;
};

// Reads `<dir>/config.json` (or the file itself when `path` names a file).
ModelConfig load_model_config(const std::string& path);
// Parses config JSON text; `label` prefixes error messages.
ModelConfig parse_model_config(const std::string& json_text, const std::string& label);

}  // namespace k3
