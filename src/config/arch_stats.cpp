// Architecture statistics (see arch_stats.h): parameter counts from the §2 tensor shapes, §5 state
// sizes, and the `k3 info` report text.
// Must not: do file I/O or depend on checkpoint contents; every count is derived from ModelConfig.
// All arithmetic is overflow-checked so an absurd (but validated) config fails with a named error.
#include "config/arch_stats.h"

#include <cstdio>

#include "core/error.h"

namespace k3 {

namespace {

int64_t mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail("architecture statistics: size overflows int64");
  return r;
}
int64_t mul(int64_t a, int64_t b, int64_t c) { return mul(mul(a, b), c); }
int64_t mul(int64_t a, int64_t b, int64_t c, int64_t d) { return mul(mul(a, b, c), d); }
int64_t add(std::initializer_list<int64_t> xs) {
  int64_t r = 0;
  for (int64_t x : xs) {
    if (__builtin_add_overflow(r, x, &r)) fail("architecture statistics: size overflows int64");
  }
  return r;
}

int64_t count_kda(const ModelConfig& c) {
  int64_t n = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) n += c.is_kda(l) ? 1 : 0;
  return n;
}

std::string join_layers(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s.empty() ? "none" : s;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// "28,991,029,248 B (27.00 GiB)"
std::string bytes_str(int64_t b) {
  std::string s = format_thousands(b) + " B";
  if (b >= (int64_t{1} << 30)) {
    s += " (" + fmt("%.2f", double(b) / double(int64_t{1} << 30)) + " GiB)";
  } else if (b >= (int64_t{1} << 20)) {
    s += " (" + fmt("%.2f", double(b) / double(int64_t{1} << 20)) + " MiB)";
  }
  return s;
}

// "104,189,614,848 (104.19 B)"
std::string params_str(int64_t p) {
  std::string s = format_thousands(p);
  if (p >= 1000000000000LL) {
    s += " (" + fmt("%.3f", double(p) / 1e12) + " T)";
  } else if (p >= 1000000000LL) {
    s += " (" + fmt("%.2f", double(p) / 1e9) + " B)";
  } else if (p >= 1000000LL) {
    s += " (" + fmt("%.2f", double(p) / 1e6) + " M)";
  }
  return s;
}

std::string row(const std::string& label, const std::string& value) {
  std::string l = "  " + label;
  if (l.size() < 28)
    l.resize(28, ' ');
  else
    l += ' ';
  return l + value + "\n";
}

}  // namespace

std::string format_thousands(int64_t v) {
  const bool neg = v < 0;
  // Work on the unsigned magnitude so INT64_MIN is formatted without overflow.
  uint64_t m = neg ? uint64_t(0) - uint64_t(v) : uint64_t(v);
  std::string digits = std::to_string(m);
  std::string out;
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    out += digits[i];
    const size_t left = n - 1 - i;
    if (left > 0 && left % 3 == 0) out += ',';
  }
  return neg ? "-" + out : out;
}

ArchParams compute_arch_params(const ModelConfig& c) {
  ArchParams a;
  const int64_t H = c.hidden_size;
  const int64_t N = c.num_hidden_layers;

  // KDA (§2.5). K3's A_log ships as [head_dim] (per-head values padded to head_dim: 128 for 96
  // heads), Kimi Linear's (the flat kimi_linear form) as [1, 1, heads, 1]; f_a_proj has rank
  // head_dim. The output gate is the full-rank g_proj [P, H] (K3) or g_b · g_a of rank head_dim.
  const int64_t P = mul(c.kda_num_heads, c.kda_head_dim);
  const int64_t hd = c.kda_head_dim;
  const bool flat = c.model_type == "kimi_linear";
  a.kda_attention = add({mul(3, P, H),                                                // q_proj, k_proj, v_proj
                         mul(3, P, c.short_conv_kernel_size),                         // q/k/v_conv1d [P, 1, K]
                         mul(hd, H), mul(P, hd),                                      // f_a_proj, f_b_proj
                         flat ? c.kda_num_heads : hd, P,                              // A_log, dt_bias
                         mul(c.kda_num_heads, H),                                     // b_proj
                         c.use_full_rank_gate ? mul(P, H) : add({mul(hd, H), mul(P, hd)}),  // g_proj | g_a, g_b
                         hd,                                                          // o_norm (shared by heads)
                         mul(H, P)});                                                 // o_proj

  // Gated MLA (§2.6); without a query LoRA a direct q_proj.
  const int64_t nq = c.num_attention_heads;
  const int64_t attn_out = mul(nq, c.v_head_dim);
  a.mla_attention = add({mul(c.q_lora_rank, H), c.q_lora_rank,                        // q_a_proj, q_a_layernorm
                         c.mla_q_lora ? mul(nq, c.mla_qk_head_dim(), c.q_lora_rank)  // q_b_proj
                                      : mul(nq, c.mla_qk_head_dim(), H),              // | q_proj
                         mul(c.kv_lora_rank + c.qk_rope_head_dim, H),                 // kv_a_proj_with_mqa
                         c.kv_lora_rank,                                              // kv_a_layernorm
                         mul(nq, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank),  // kv_b_proj
                         c.mla_use_output_gate ? mul(attn_out, H) : 0,                // g_proj
                         mul(H, attn_out)});                                          // o_proj

  // Stable LatentMoE (§2.8) or experts in the hidden space (Kimi Linear), without routed experts.
  const bool latent = c.moe_kind == MoeKind::Latent;
  const int64_t R = latent ? c.routed_expert_hidden_size : H;
  a.moe_excl_routed = add({mul(c.num_experts, H), c.num_experts,  // gate.weight, e_score_correction_bias
                           latent ? add({mul(R, H), c.latent_moe_use_norm ? R : 0, mul(H, R)}) : 0,  // down, norm, up
                           mul(3, c.shared_intermediate(), H)});  // fused shared experts gate/up/down
  a.dense_ffn = mul(3, c.intermediate_size, H);
  a.routed_expert = mul(3, c.moe_intermediate_size, R);  // w1 [I,R], w3 [I,R], w2 [R,I]
  // input, post_attention (+ self_attention_res_{norm,proj}, mlp_res_{norm,proj} with Block AttnRes)
  const bool attn_res = c.residual == ResidualKind::BlockAttnRes;
  a.layer_norms = mul(attn_res ? 6 : 2, H);

  a.embedding = mul(c.vocab_size, H);
  a.lm_head = c.tie_word_embeddings ? 0 : mul(c.vocab_size, H);
  a.final_norm = H;
  a.output_attn_res = attn_res ? mul(2, H) : 0;

  a.n_kda_layers = count_kda(c);
  a.n_mla_layers = N - a.n_kda_layers;
  a.n_dense_layers = c.first_k_dense_replace < N ? c.first_k_dense_replace : N;
  a.n_moe_layers = N - a.n_dense_layers;

  a.trunk = add({mul(a.n_kda_layers, a.kda_attention), mul(a.n_mla_layers, a.mla_attention),
                 mul(a.n_dense_layers, a.dense_ffn), mul(a.n_moe_layers, a.moe_excl_routed), mul(N, a.layer_norms),
                 a.final_norm, a.output_attn_res});
  a.always_active = add({a.trunk, a.embedding, a.lm_head});
  a.routed_experts_total = mul(a.n_moe_layers, c.num_experts, a.routed_expert);
  a.total = add({a.always_active, a.routed_experts_total});
  a.active_per_token = add({a.trunk, a.lm_head, mul(a.n_moe_layers, c.num_experts_per_token, a.routed_expert)});
  return a;
}

int64_t kda_recurrent_state_bytes(const ModelConfig& c) {
  return mul(mul(count_kda(c), c.kda_num_heads), c.kda_head_dim, c.kda_head_dim, 4);
}

int64_t kda_conv_state_bytes(const ModelConfig& c) {
  const int64_t taps = c.short_conv_kernel_size > 0 ? c.short_conv_kernel_size - 1 : 0;
  return mul(mul(count_kda(c), 3), c.kda_dim(), taps, 4);
}

int64_t mla_cache_bytes_per_token(const ModelConfig& c, int64_t bytes_per_value) {
  const int64_t n_mla = c.num_hidden_layers - count_kda(c);
  return mul(n_mla, c.kv_lora_rank + c.qk_rope_head_dim, bytes_per_value);
}

int64_t mla_cache_bytes(const ModelConfig& c, int64_t tokens, int64_t bytes_per_value) {
  return mul(mla_cache_bytes_per_token(c, bytes_per_value), tokens);
}

std::vector<int64_t> mla_layers_zero_based(const ModelConfig& c) {
  std::vector<int64_t> v;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_mla(l)) v.push_back(l);
  }
  return v;
}

std::vector<int64_t> kda_layers_zero_based(const ModelConfig& c) {
  std::vector<int64_t> v;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_kda(l)) v.push_back(l);
  }
  return v;
}

std::vector<int64_t> attn_res_snapshot_layers(const ModelConfig& c) {
  std::vector<int64_t> v;
  if (c.attn_res_block_size <= 0) return v;
  for (int64_t l = 0; l < c.num_hidden_layers; l += c.attn_res_block_size) v.push_back(l);
  return v;
}

std::string layer_map_string(const ModelConfig& c) {
  std::string s;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (l > 0 && c.attn_res_block_size > 0 && l % c.attn_res_block_size == 0) s += ' ';
    s += c.is_kda(l) ? 'K' : 'M';
  }
  return s;
}

std::string format_arch_report(const ModelConfig& c, int64_t ctx_tokens) {
  const ArchParams a = compute_arch_params(c);
  std::string r;
  r += "architecture: " + c.model_type + (c.model_type == "kimi_linear" ? "" : " (text model kimi_linear)") +
       (c.source.empty() ? "" : ", config " + c.source) + "\n";
  r += row("family", c.family_summary());
  r += row("layers", std::to_string(c.num_hidden_layers) + ": " + std::to_string(a.n_kda_layers) + " KDA, " +
                         std::to_string(a.n_mla_layers) + " MLA; " + std::to_string(a.n_dense_layers) + " dense FFN, " +
                         std::to_string(a.n_moe_layers) + " MoE");
  r += row("layer map", layer_map_string(c) + (c.residual == ResidualKind::BlockAttnRes
                                                   ? "  (K = KDA, M = MLA, groups = AttnRes blocks of " +
                                                         std::to_string(c.attn_res_block_size) + ")"
                                                   : "  (K = KDA, M = MLA; plain residual sum, no AttnRes blocks)"));
  r += row("MLA layers (0-based)", join_layers(mla_layers_zero_based(c)));
  r += row("AttnRes snapshots", join_layers(attn_res_snapshot_layers(c)));
  r += row("hidden / vocab", std::to_string(c.hidden_size) + " / " + std::to_string(c.vocab_size));
  r += row("KDA", std::to_string(c.kda_num_heads) + " heads x " + std::to_string(c.kda_head_dim) + " (" +
                      std::to_string(c.kda_dim()) + "), short conv " + std::to_string(c.short_conv_kernel_size) +
                      (c.kda_gate_bounded ? ", gate lower bound " + fmt("%g", c.gate_lower_bound)
                                          : std::string(", unbounded decay gate")));
  r += row("MLA", std::to_string(c.num_attention_heads) + " heads, q_lora " + std::to_string(c.q_lora_rank) +
                      ", kv_lora " + std::to_string(c.kv_lora_rank) + ", qk " + std::to_string(c.qk_nope_head_dim) +
                      "+" + std::to_string(c.qk_rope_head_dim) + " (NoPE), v " + std::to_string(c.v_head_dim) +
                      (c.mla_use_output_gate ? ", output gate" : ", no output gate"));
  r += row("dense FFN", "width " + std::to_string(c.intermediate_size) + " (layers < " +
                            std::to_string(c.first_k_dense_replace) + ")");
  r += row("MoE", std::to_string(c.num_experts) + " routed experts, top-" + std::to_string(c.num_experts_per_token) +
                      ", expert width " + std::to_string(c.moe_intermediate_size) +
                      (c.moe_kind == MoeKind::Latent ? ", latent " + std::to_string(c.routed_expert_hidden_size)
                                                     : std::string(", in the hidden space")) +
                      ", " + std::to_string(c.num_shared_experts) +
                      " shared (fused width " + std::to_string(c.shared_intermediate()) + ")");
  r += row("activation", c.activation == FfnActivation::SiTU
                             ? "SiTU-GLU beta " + fmt("%g", c.situ_beta) + " / " + fmt("%g", c.situ_linear_beta)
                             : "hidden_act \"" + c.hidden_act + "\" (GLU)");
  r += "parameters\n";
  r += row("KDA attention block", format_thousands(a.kda_attention));
  r += row("MLA attention block", format_thousands(a.mla_attention));
  r += row("MoE block excl. routed", format_thousands(a.moe_excl_routed));
  r += row("dense FFN", format_thousands(a.dense_ffn));
  r += row("one routed expert", format_thousands(a.routed_expert));
  r += row(c.residual == ResidualKind::BlockAttnRes ? "norms + AttnRes / layer" : "norms / layer",
           format_thousands(a.layer_norms));
  r += row("embedding", format_thousands(a.embedding));
  r += row("lm_head", format_thousands(a.lm_head));
  r += row("always active", params_str(a.always_active) + "  (trunk + embedding + lm_head)");
  r += row("routed experts", params_str(a.routed_experts_total));
  r += row("total", params_str(a.total));
  r += row("active per token", params_str(a.active_per_token) + "  (trunk + lm_head + top-" +
                                   std::to_string(c.num_experts_per_token) + " experts; embedding excluded)");
  r += "decode state\n";
  const int64_t rec = kda_recurrent_state_bytes(c), conv = kda_conv_state_bytes(c);
  r += row("KDA recurrent / seq", bytes_str(rec) + "  (fp32)");
  r += row("KDA conv / seq", bytes_str(conv) + "  (fp32, " + std::to_string(c.short_conv_kernel_size - 1) + " taps)");
  r += row("MLA cache / token", format_thousands(mla_cache_bytes_per_token(c, 2)) + " B bf16, " +
                                    format_thousands(mla_cache_bytes_per_token(c, 4)) + " B fp32");
  auto at = [&](int64_t tokens, const std::string& note) {
    r += row("at " + format_thousands(tokens) + " tokens" + note,
             "MLA cache " + bytes_str(mla_cache_bytes(c, tokens, 2)) + " bf16; with KDA state " +
                 bytes_str(add({mla_cache_bytes(c, tokens, 2), rec, conv})) + " per sequence");
  };
  if (ctx_tokens > 0) at(ctx_tokens, "");
  if (c.max_position_embeddings > 0 && c.max_position_embeddings != ctx_tokens) at(c.max_position_embeddings, " (max)");
  return r;
}

}  // namespace k3
