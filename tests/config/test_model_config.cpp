// Tests for the strict config reader (src/config/model_config.*): the released nested K3 config,
// the flat kimi_linear form, the third-party tiny config, a Kimi Linear 48B-A3B config (a family
// member: its flags parse, the model binding refuses it in one line), and every rejection path.
// Must not: rely on values computed by the code under test; expectations come from the spec (§1).
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error_util.h"
#include "config/arch_stats.h"
#include "config/model_config.h"
#include "core/error.h"
#include "model/model.h"

using nlohmann::json;

namespace {

const std::string kRealConfig = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-config-only/config.json";
const std::string kTinyDir = std::string(K3_SHARED_DIR) + "/fixtures/third-party/kimi-k3-in-c-tiny";

json real_json() {
  std::ifstream in(kRealConfig);
  EXPECT_TRUE(in.good()) << "cannot open " << kRealConfig;
  return json::parse(in);
}

// Flat kimi_linear form carrying the same text keys (and the special tokens) as the nested file.
json flat_from(const json& nested) {
  json flat = nested["text_config"];
  flat["bos_token_id"] = nested["bos_token_id"];
  flat["eos_token_id"] = nested["eos_token_id"];
  flat["pad_token_id"] = nested["pad_token_id"];
  return flat;
}

k3::ModelConfig parse(const json& j) { return k3::parse_model_config(j.dump(), "cfg.json"); }

// Returns the k3::Error message, or fails the test when nothing (or something else) is thrown.
std::string error_of(const json& j) {
  return k3test::error_of_call([&] { parse(j); }, "config was accepted but should have been rejected");
}

std::string error_of_text(const std::string& text) {
  try {
    k3::parse_model_config(text, "cfg.json");
  } catch (const k3::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "text was accepted: " << text;
  return "";
}

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nmissing: " << (part)

void expect_same_text_model(const k3::ModelConfig& a, const k3::ModelConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.situ_beta, b.situ_beta);
  EXPECT_EQ(a.situ_linear_beta, b.situ_linear_beta);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.first_k_dense_replace, b.first_k_dense_replace);
  EXPECT_EQ(a.moe_layer_freq, b.moe_layer_freq);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_token, b.num_experts_per_token);
  EXPECT_EQ(a.num_shared_experts, b.num_shared_experts);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.routed_expert_hidden_size, b.routed_expert_hidden_size);
  EXPECT_EQ(a.latent_moe_use_norm, b.latent_moe_use_norm);
  EXPECT_EQ(a.moe_renormalize, b.moe_renormalize);
  EXPECT_EQ(a.routed_scaling_factor, b.routed_scaling_factor);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.kv_lora_rank, b.kv_lora_rank);
  EXPECT_EQ(a.qk_nope_head_dim, b.qk_nope_head_dim);
  EXPECT_EQ(a.qk_rope_head_dim, b.qk_rope_head_dim);
  EXPECT_EQ(a.v_head_dim, b.v_head_dim);
  EXPECT_EQ(a.mla_use_output_gate, b.mla_use_output_gate);
  EXPECT_EQ(a.mla_lora_norm_eps, b.mla_lora_norm_eps);
  EXPECT_EQ(a.attn_res_block_size, b.attn_res_block_size);
  EXPECT_EQ(a.full_attn_layers, b.full_attn_layers);
  EXPECT_EQ(a.kda_layers, b.kda_layers);
  EXPECT_EQ(a.kda_num_heads, b.kda_num_heads);
  EXPECT_EQ(a.kda_head_dim, b.kda_head_dim);
  EXPECT_EQ(a.short_conv_kernel_size, b.short_conv_kernel_size);
  EXPECT_EQ(a.gate_lower_bound, b.gate_lower_bound);
  EXPECT_EQ(a.use_full_rank_gate, b.use_full_rank_gate);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.hidden_act, b.hidden_act);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.residual, b.residual);
  EXPECT_EQ(a.moe_kind, b.moe_kind);
  EXPECT_EQ(a.router_activation_name, b.router_activation_name);
  EXPECT_EQ(a.router_activation, b.router_activation);
  EXPECT_EQ(a.topk_method, b.topk_method);
  EXPECT_EQ(a.use_grouped_topk, b.use_grouped_topk);
  EXPECT_EQ(a.num_expert_group, b.num_expert_group);
  EXPECT_EQ(a.topk_group, b.topk_group);
  EXPECT_EQ(a.mla_use_nope, b.mla_use_nope);
  EXPECT_EQ(a.mla_q_lora, b.mla_q_lora);
  EXPECT_EQ(a.kda_gate_bounded, b.kda_gate_bounded);
}

// The refusal of a parsed config by the model binding (k3::check_supported), or "" when it is runnable.
std::string refusal_of(const k3::ModelConfig& c) {
  try {
    k3::check_supported(c);
  } catch (const k3::Error& e) {
    return e.what();
  }
  return "";
}

// Kimi Linear 48B-A3B-Instruct's config.json (the flat kimi_linear form), written from its published
// keys and values: SiLU, no query LoRA, no Block AttnRes / latent MoE / MLA output gate keys, a
// linear_attn_config without gate_lower_bound or use_full_rank_gate, model_max_length for the context.
json kimi_linear_48b() {
  json full = json::array(), kda = json::array();
  for (int l = 1; l <= 27; ++l) (l % 4 == 0 || l == 27 ? full : kda).push_back(l);
  return json{{"architectures", {"KimiLinearForCausalLM"}},
              {"model_type", "kimi_linear"},
              {"bos_token_id", 163584},
              {"eos_token_id", 163586},
              {"pad_token_id", 163839},
              {"dtype", "bfloat16"},
              {"vocab_size", 163840},
              {"hidden_size", 2304},
              {"head_dim", 72},
              {"intermediate_size", 9216},
              {"num_hidden_layers", 27},
              {"num_attention_heads", 32},
              {"num_key_value_heads", 32},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"rms_norm_eps", 1e-5},
              {"model_max_length", 1048576},
              {"rope_theta", 10000.0},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", false},
              {"use_cache", true},
              {"first_k_dense_replace", 1},
              {"moe_layer_freq", 1},
              {"num_experts", 256},
              {"num_experts_per_token", 8},
              {"num_shared_experts", 1},
              {"moe_intermediate_size", 1024},
              {"moe_renormalize", true},
              {"moe_router_activation_func", "sigmoid"},
              {"routed_scaling_factor", 2.446},
              {"use_grouped_topk", true},
              {"num_expert_group", 1},
              {"topk_group", 1},
              {"q_lora_rank", nullptr},
              {"kv_lora_rank", 512},
              {"qk_nope_head_dim", 128},
              {"qk_rope_head_dim", 64},
              {"v_head_dim", 128},
              {"mla_use_nope", true},
              {"num_nextn_predict_layers", 0},
              {"linear_attn_config",
               {{"full_attn_layers", full},
                {"kda_layers", kda},
                {"head_dim", 128},
                {"num_heads", 32},
                {"short_conv_kernel_size", 4}}}};
}

// Every text_config key the engine requires of the released config (spec §1.2), relative to text_config.
// (latent_moe_use_norm only with routed_expert_hidden_size, the SiTU caps only with hidden_act "situ";
// the family keys whose absence is a flag are in FamilyKeysAbsentAreFlags.)
// clang-format off
const std::vector<std::string> kRequiredTextKeys = {
    "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "num_experts", "num_experts_per_token", "num_shared_experts",
    "moe_intermediate_size", "latent_moe_use_norm", "moe_renormalize", "moe_router_activation_func",
    "routed_scaling_factor", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope"};
// clang-format on
const std::vector<std::string> kRequiredLinearKeys = {"full_attn_layers", "kda_layers", "num_heads", "head_dim",
                                                      "short_conv_kernel_size"};

}  // namespace

TEST(ModelConfig, RealReleasedConfigValues) {
  const k3::ModelConfig c = k3::load_model_config(kRealConfig);
  EXPECT_EQ(c.source, kRealConfig);
  EXPECT_EQ(c.model_type, "kimi_k3");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 93);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_DOUBLE_EQ(c.situ_beta, 4.0);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, 25.0);
  EXPECT_EQ(c.intermediate_size, 33792);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.num_experts_per_token, 16);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.moe_intermediate_size, 3072);
  EXPECT_EQ(c.shared_intermediate(), 6144);
  EXPECT_EQ(c.routed_expert_hidden_size, 3584);
  EXPECT_TRUE(c.latent_moe_use_norm);
  EXPECT_TRUE(c.moe_renormalize);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.num_attention_heads, 96);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.mla_qk_head_dim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_TRUE(c.mla_use_output_gate);
  EXPECT_DOUBLE_EQ(c.mla_lora_norm_eps, 1e-6);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_EQ(c.full_attn_layers.size(), 24u);
  EXPECT_EQ(c.kda_layers.size(), 69u);
  EXPECT_EQ(c.kda_num_heads, 96);
  EXPECT_EQ(c.kda_head_dim, 128);
  EXPECT_EQ(c.kda_dim(), 12288);
  EXPECT_EQ(c.short_conv_kernel_size, 4);
  EXPECT_DOUBLE_EQ(c.gate_lower_bound, -5.0);
  EXPECT_TRUE(c.use_full_rank_gate);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_id, 163586);
  EXPECT_EQ(c.pad_token_id, 163839);
  // The family flags of K3 itself, which the engine runs.
  EXPECT_EQ(c.hidden_act, "situ");
  EXPECT_EQ(c.activation, k3::FfnActivation::SiTU);
  EXPECT_EQ(c.residual, k3::ResidualKind::BlockAttnRes);
  EXPECT_EQ(c.moe_kind, k3::MoeKind::Latent);
  EXPECT_EQ(c.router_activation_name, "sigmoid");
  EXPECT_EQ(c.router_activation, k3::RouterActivation::Sigmoid);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_TRUE(c.use_grouped_topk);
  EXPECT_EQ(c.num_expert_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_TRUE(c.mla_use_nope);
  EXPECT_TRUE(c.mla_q_lora);
  EXPECT_TRUE(c.kda_gate_bounded);
  EXPECT_TRUE(k3::unsupported_features(c).empty());
  EXPECT_EQ(refusal_of(c), "");
}

TEST(ModelConfig, RealConfigLayerPredicates) {
  const k3::ModelConfig c = k3::load_model_config(std::filesystem::path(kRealConfig).parent_path().string());
  // Spec §3.4: MLA at zero-based 3,7,...,87 (every fourth) plus 91 and 92; everything else KDA.
  std::vector<int64_t> want_mla;
  for (int64_t l = 3; l <= 91; l += 4) want_mla.push_back(l);
  want_mla.push_back(92);
  std::vector<int64_t> got_mla;
  int n_kda = 0;
  for (int64_t l = 0; l < 93; ++l) {
    EXPECT_NE(c.is_kda(l), c.is_mla(l)) << l;
    if (c.is_mla(l)) got_mla.push_back(l);
    if (c.is_kda(l)) ++n_kda;
  }
  EXPECT_EQ(got_mla, want_mla);
  EXPECT_EQ(n_kda, 69);
  EXPECT_EQ(got_mla.size(), 24u);
  EXPECT_TRUE(c.is_mla(91));
  EXPECT_TRUE(c.is_mla(92));  // the last two layers are both MLA (trap §6.4.1)
  EXPECT_TRUE(c.is_kda(90));
  EXPECT_TRUE(c.is_kda(0));
  EXPECT_TRUE(c.is_mla(3));
  EXPECT_TRUE(c.is_kda(4));
  EXPECT_TRUE(c.is_dense_ffn(0));
  EXPECT_FALSE(c.is_dense_ffn(1));
  EXPECT_FALSE(c.is_dense_ffn(92));
}

TEST(ModelConfig, FlatAndNestedParseIdentically) {
  const json nested = real_json();
  const k3::ModelConfig a = parse(nested);
  const k3::ModelConfig b = parse(flat_from(nested));
  EXPECT_EQ(a.model_type, "kimi_k3");
  EXPECT_EQ(b.model_type, "kimi_linear");
  expect_same_text_model(a, b);
  // Special tokens may also live in text_config only (nested form without wrapper copies).
  json inner_only = nested;
  inner_only["text_config"]["bos_token_id"] = 163584;
  inner_only.erase("bos_token_id");
  EXPECT_EQ(parse(inner_only).bos_token_id, 163584);
  // Special tokens are optional.
  json no_tokens = nested;
  no_tokens.erase("bos_token_id");
  no_tokens.erase("eos_token_id");
  no_tokens.erase("pad_token_id");
  const k3::ModelConfig d = parse(no_tokens);
  EXPECT_EQ(d.bos_token_id, -1);
  EXPECT_EQ(d.eos_token_id, -1);
  EXPECT_EQ(d.pad_token_id, -1);
}

TEST(ModelConfig, UnusedKeysAreIgnored) {
  json j = real_json();
  j["text_config"]["head_dim"] = 74;  // transformers-5 artefact, not a model dimension
  j["text_config"]["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "default"}};
  j["text_config"]["some_future_key"] = json::array({1, "x", nullptr});
  j["vision_config"] = "not even an object";
  j["quantization_config"] = 12;
  j.erase("auto_map");
  const k3::ModelConfig c = parse(j);
  expect_same_text_model(c, parse(real_json()));
  // The flat form ignores the same keys.
  json flat = flat_from(real_json());
  flat["head_dim"] = 74;
  flat["vision_config"] = json::object();
  expect_same_text_model(parse(flat), c);
}

TEST(ModelConfig, ThirdPartyTinyConfig) {
  if (!std::filesystem::exists(kTinyDir + "/config.json")) GTEST_SKIP() << "third-party fixture absent: " << kTinyDir;
  const k3::ModelConfig c = k3::load_model_config(kTinyDir);
  EXPECT_EQ(c.model_type, "kimi_k3");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 13);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_token, 2);
  EXPECT_EQ(c.attn_res_block_size, 3);
  EXPECT_EQ(c.kda_num_heads, 4);
  EXPECT_EQ(c.kda_head_dim, 16);
  std::vector<int64_t> mla;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_mla(l)) mla.push_back(l);
  }
  EXPECT_EQ(mla, (std::vector<int64_t>{3, 7, 11, 12}));
  EXPECT_EQ(c.bos_token_id, -1);  // the tiny config carries no special tokens
}

TEST(ModelConfig, TwoMissingKeysNamedInOneError) {
  json j = real_json();
  j["text_config"].erase("hidden_size");
  j["text_config"]["linear_attn_config"].erase("num_heads");
  EXPECT_EQ(error_of(j),
            "cfg.json: 2 problems: missing key text_config.hidden_size; missing key "
            "text_config.linear_attn_config.num_heads");
}

TEST(ModelConfig, AllMissingKeysAreNamed) {
  json j = real_json();
  for (const auto& k : kRequiredTextKeys) j["text_config"].erase(k);
  for (const auto& k : kRequiredLinearKeys) j["text_config"]["linear_attn_config"].erase(k);
  j["text_config"].erase("tie_word_embeddings");
  j.erase("tie_word_embeddings");
  const std::string msg = error_of(j);
  const size_t n = kRequiredTextKeys.size() + kRequiredLinearKeys.size() + 1;
  ASSERT_GT(n, 8u);
  // Every problem is counted; the first 8 are listed, then how many more (one readable line; each
  // key alone is named by EachRequiredKeyAloneIsNamed).
  EXPECT_EQ(msg.rfind("cfg.json: " + std::to_string(n) + " problems: ", 0), 0u) << msg;
  size_t listed = 0;
  for (size_t at = msg.find("missing key "); at != std::string::npos; at = msg.find("missing key ", at + 1)) ++listed;
  EXPECT_EQ(listed, 8u) << msg;
  EXPECT_TRUE(msg.ends_with("; and " + std::to_string(n - 8) + " more")) << msg;
  EXPECT_HAS(msg, "missing key text_config." + kRequiredTextKeys.front());
  EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(ModelConfig, EachRequiredKeyAloneIsNamed) {
  for (const auto& k : kRequiredTextKeys) {
    json j = real_json();
    j["text_config"].erase(k);
    EXPECT_HAS(error_of(j), "missing key text_config." + k);
    json flat = flat_from(real_json());
    if (k == "model_type") continue;  // the flat form needs it to be recognised at all
    flat.erase(k);
    EXPECT_EQ(error_of(flat), "cfg.json: 1 problem: missing key " + k);
  }
  for (const auto& k : kRequiredLinearKeys) {
    json j = real_json();
    j["text_config"]["linear_attn_config"].erase(k);
    EXPECT_EQ(error_of(j), "cfg.json: 1 problem: missing key text_config.linear_attn_config." + k);
  }
  json j = real_json();
  j["text_config"].erase("linear_attn_config");
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: missing key text_config.linear_attn_config");
  j = real_json();
  j.erase("text_config");
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: missing key text_config");
  j = real_json();
  j.erase("model_type");
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: missing key model_type");
}

TEST(ModelConfig, TieWordEmbeddingsMayBeAtEitherLevel) {
  json j = real_json();
  j["text_config"].erase("tie_word_embeddings");
  EXPECT_FALSE(parse(j).tie_word_embeddings);
  j = real_json();
  j.erase("tie_word_embeddings");
  EXPECT_FALSE(parse(j).tie_word_embeddings);
}

TEST(ModelConfig, WrongTypes) {
  json j = real_json();
  j["text_config"]["hidden_size"] = "7168";
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.hidden_size must be an integer, got \"7168\"");
  j = real_json();
  j["text_config"]["hidden_size"] = 7168.5;
  EXPECT_HAS(error_of(j), "text_config.hidden_size must be an integer, got 7168.5");
  j = real_json();
  j["text_config"]["rms_norm_eps"] = "1e-5";
  EXPECT_HAS(error_of(j), "text_config.rms_norm_eps must be a number, got \"1e-5\"");
  j = real_json();
  j["text_config"]["mla_use_output_gate"] = 1;
  EXPECT_HAS(error_of(j), "text_config.mla_use_output_gate must be a boolean, got 1");
  j = real_json();
  j["text_config"]["hidden_act"] = nullptr;
  EXPECT_HAS(error_of(j), "text_config.hidden_act must be a string, got null");
  j = real_json();
  j["text_config"]["linear_attn_config"]["kda_layers"] = "1,2,3";
  EXPECT_HAS(error_of(j), "text_config.linear_attn_config.kda_layers must be an array of integers, got \"1,2,3\"");
  j = real_json();
  j["text_config"]["linear_attn_config"]["full_attn_layers"][2] = "12";
  EXPECT_HAS(error_of(j), "text_config.linear_attn_config.full_attn_layers[2] must be an integer, got \"12\"");
  j = real_json();
  j["text_config"]["linear_attn_config"] = json::array();
  EXPECT_HAS(error_of(j), "text_config.linear_attn_config must be an object, got []");
  j = real_json();
  j["text_config"] = 5;
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config must be an object, got 5");
  j = real_json();
  j["text_config"]["vocab_size"] = 18446744073709551615ull;
  EXPECT_HAS(error_of(j), "text_config.vocab_size = 18446744073709551615 is out of range");
  j = real_json();
  j["bos_token_id"] = "163584";
  EXPECT_HAS(error_of(j), "bos_token_id must be an integer, got \"163584\"");
}

TEST(ModelConfig, ValueRanges) {
  json j = real_json();
  j["text_config"]["hidden_size"] = 0;
  j["text_config"]["kv_lora_rank"] = -512;
  j["text_config"]["linear_attn_config"]["head_dim"] = 0;
  std::string msg = error_of(j);
  EXPECT_HAS(msg, "cfg.json: 3 problems:");
  EXPECT_HAS(msg, "text_config.hidden_size = 0 is outside 1..");
  EXPECT_HAS(msg, "text_config.kv_lora_rank = -512 is outside 1..");
  EXPECT_HAS(msg, "text_config.linear_attn_config.head_dim = 0 is outside 1..");

  j = real_json();
  j["text_config"]["num_experts_per_token"] = 897;
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.num_experts_per_token = 897 exceeds num_experts 896");
  j = real_json();
  j["text_config"]["first_k_dense_replace"] = 94;
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.first_k_dense_replace = 94 exceeds num_hidden_layers 93");
  j = real_json();
  j["text_config"]["rms_norm_eps"] = 0.0;
  EXPECT_HAS(error_of(j), "text_config.rms_norm_eps = 0 must be in (0, 1)");
  j = real_json();
  j["text_config"]["linear_attn_config"]["gate_lower_bound"] = 5.0;
  EXPECT_HAS(error_of(j), "text_config.linear_attn_config.gate_lower_bound = 5 must be < 0");
  j = real_json();
  j["eos_token_id"] = 163840;
  EXPECT_HAS(error_of(j), "eos_token_id = 163840 is outside 0..163839");
  j = real_json();
  j["text_config"]["eos_token_id"] = 163585;
  EXPECT_HAS(error_of(j), "eos_token_id 163586 disagrees with text_config.eos_token_id 163585");
}

TEST(ModelConfig, LayerListOutOfRange) {
  json j = real_json();
  j["text_config"]["linear_attn_config"]["full_attn_layers"][23] = 94;  // was 93
  EXPECT_EQ(error_of(j),
            "cfg.json: 2 problems: text_config.linear_attn_config.full_attn_layers[23] = 94 is outside 1..93 "
            "(layer lists are one-based); layer 93 is in neither text_config.linear_attn_config.full_attn_layers "
            "nor kda_layers (one-based)");
  j = real_json();
  j["text_config"]["linear_attn_config"]["kda_layers"][0] = 0;  // was 1: a zero-based entry
  EXPECT_HAS(error_of(j), "text_config.linear_attn_config.kda_layers[0] = 0 is outside 1..93");
}

TEST(ModelConfig, ZeroBasedListsAreRejected) {
  // Someone "fixes" the lists to zero-based: MLA 3,7,...,91,92 and KDA 0,1,2,4,...
  json j = real_json();
  json full = json::array(), kda = json::array();
  for (int64_t l = 0; l < 93; ++l) ((l + 1) % 4 == 0 || l == 92 ? full : kda).push_back(l);
  j["text_config"]["linear_attn_config"]["full_attn_layers"] = full;
  j["text_config"]["linear_attn_config"]["kda_layers"] = kda;
  const std::string msg = error_of(j);
  EXPECT_HAS(msg, "kda_layers[0] = 0 is outside 1..93 (layer lists are one-based)");
  EXPECT_HAS(msg, "in neither");
}

TEST(ModelConfig, LayerListDuplicateOverlapUncovered) {
  json j = real_json();
  j["text_config"]["linear_attn_config"]["kda_layers"].push_back(5);
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.linear_attn_config.kda_layers lists layer 5 more than once");

  j = real_json();
  j["text_config"]["linear_attn_config"]["kda_layers"].push_back(4);
  j["text_config"]["linear_attn_config"]["kda_layers"].push_back(8);
  EXPECT_EQ(error_of(j),
            "cfg.json: 1 problem: layers 4, 8 are in both text_config.linear_attn_config.full_attn_layers and "
            "kda_layers");

  j = real_json();
  auto& full = j["text_config"]["linear_attn_config"]["full_attn_layers"];
  full.erase(full.size() - 1);  // drop 93
  EXPECT_EQ(error_of(j),
            "cfg.json: 1 problem: layer 93 is in neither text_config.linear_attn_config.full_attn_layers nor "
            "kda_layers (one-based)");

  j = real_json();
  j["text_config"]["linear_attn_config"]["kda_layers"] = json::array({1, 2, 3});
  const std::string msg = error_of(j);
  EXPECT_HAS(msg, "layers 5-7, 9-11, ");  // ranges are compressed
  EXPECT_HAS(msg, "85-87, 89-91 are in neither");
}

// A feature this engine does not implement parses into its flag; the model binding refuses it in
// one line that names the flag and its value.
TEST(ModelConfig, UnsupportedFeaturesParseAndAreRefusedByTheBinding) {
  struct Case {
    const char* key;
    json value;
    std::string refusal;  // after "cfg.json: "
  };
  const std::vector<Case> cases = {
      {"hidden_act", "gelu",
       "hidden_act \"gelu\" is not implemented by this engine (it implements the SiTU-GLU of "
       "K3, \"situ\", and the SiLU-GLU of Kimi Linear, \"silu\")"},
      {"moe_router_activation_func", "softmax",
       "moe_router_activation_func \"softmax\" is not implemented by this engine (it implements \"sigmoid\")"},
      {"topk_method", "greedy",
       "topk_method \"greedy\" is not implemented by this engine (it implements \"noaux_tc\", the bias-corrected "
       "top-k)"},
      {"num_expert_group", 8,
       "num_expert_group 8 (grouped top-k) is not implemented by this engine (it implements one group)"},
      {"mla_use_nope", false,
       "mla_use_nope false (RoPE in MLA) is not implemented by this engine (it implements the NoPE MLA of K3)"},
      {"tie_word_embeddings", true,
       "tie_word_embeddings true is not implemented by this engine (it implements the separate lm_head K3 and "
       "Kimi Linear ship)"},
      {"moe_layer_freq", 2,
       "moe_layer_freq 2 is not implemented by this engine (it implements 1: every layer from "
       "first_k_dense_replace on is MoE)"},
  };
  for (const auto& cs : cases) {
    json j = real_json();
    j["text_config"][cs.key] = cs.value;
    const k3::ModelConfig c = parse(j);  // a well-formed family member parses
    EXPECT_EQ(refusal_of(c), "cfg.json: " + cs.refusal) << cs.key;
    ASSERT_EQ(k3::unsupported_features(c).size(), 1u) << cs.key;
    EXPECT_EQ(k3::unsupported_features(c)[0], cs.refusal);
  }
  json j = real_json();
  j["text_config"]["hidden_act"] = "silu";
  k3::ModelConfig c = parse(j);
  EXPECT_EQ(c.activation, k3::FfnActivation::SiLU);
  EXPECT_DOUBLE_EQ(c.situ_beta, 4.0);  // present caps are still read (and checked)
  j["text_config"]["moe_router_activation_func"] = "softmax";
  EXPECT_EQ(parse(j).router_activation, k3::RouterActivation::Softmax);
  j = real_json();
  j["text_config"]["q_lora_rank"] = nullptr;
  c = parse(j);
  EXPECT_FALSE(c.mla_q_lora);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(refusal_of(c), "");  // a direct q_proj is implemented (Kimi Linear)
  j = real_json();
  j["text_config"]["linear_attn_config"]["use_full_rank_gate"] = false;
  c = parse(j);
  EXPECT_FALSE(c.use_full_rank_gate);
  EXPECT_EQ(refusal_of(c), "");  // the low-rank output gate is implemented (Kimi Linear)
  j = real_json();
  j["text_config"]["linear_attn_config"]["short_conv_kernel_size"] = 17;
  EXPECT_EQ(refusal_of(parse(j)),
            "cfg.json: linear_attn_config.short_conv_kernel_size 17 is not implemented by this engine (it "
            "implements 1..16)");
  j = real_json();
  j["tie_word_embeddings"] = true;  // wrapper level only
  EXPECT_TRUE(parse(j).tie_word_embeddings);
  EXPECT_HAS(refusal_of(parse(j)), "tie_word_embeddings true is not implemented by this engine");
  // Two features: the first sentence, then the other flags by name, still one line.
  j = real_json();
  j["text_config"]["hidden_act"] = "gelu";
  j["text_config"]["mla_use_nope"] = false;
  j["text_config"]["num_expert_group"] = 8;
  const std::string msg = refusal_of(parse(j));
  EXPECT_EQ(msg,
            "cfg.json: hidden_act \"gelu\" is not implemented by this engine (it implements the SiTU-GLU of K3, "
            "\"situ\", and the SiLU-GLU of Kimi Linear, \"silu\"); 2 more: num_expert_group 8, mla_use_nope false");
  // Grouped top-k keys are optional; absent means ungrouped.
  j = real_json();
  j["text_config"].erase("topk_method");
  j["text_config"].erase("num_expert_group");
  j["text_config"].erase("topk_group");
  j["text_config"].erase("use_grouped_topk");
  c = parse(j);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.topk_method, "");
  EXPECT_EQ(c.num_expert_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_FALSE(c.use_grouped_topk);
  EXPECT_EQ(refusal_of(c), "");
}

// A family key left out selects the member without the feature (not a "missing key").
TEST(ModelConfig, FamilyKeysAbsentAreFlags) {
  json j = real_json();
  j["text_config"].erase("attn_res_block_size");
  k3::ModelConfig c = parse(j);
  EXPECT_EQ(c.residual, k3::ResidualKind::PlainSum);
  EXPECT_EQ(c.attn_res_block_size, 0);
  EXPECT_EQ(refusal_of(c), "");  // the plain residual sum is implemented (Kimi Linear)

  j = real_json();
  j["text_config"].erase("routed_expert_hidden_size");
  j["text_config"].erase("latent_moe_use_norm");
  c = parse(j);
  EXPECT_EQ(c.moe_kind, k3::MoeKind::Hidden);
  EXPECT_EQ(c.routed_expert_hidden_size, 0);
  EXPECT_FALSE(c.latent_moe_use_norm);
  EXPECT_EQ(refusal_of(c), "");  // experts in the hidden space are implemented (Kimi Linear)

  j = real_json();
  j["text_config"].erase("mla_use_output_gate");
  c = parse(j);
  EXPECT_FALSE(c.mla_use_output_gate);
  EXPECT_EQ(refusal_of(c), "");  // an ungated MLA is implemented

  j = real_json();
  j["text_config"]["linear_attn_config"].erase("gate_lower_bound");
  c = parse(j);
  EXPECT_FALSE(c.kda_gate_bounded);
  EXPECT_EQ(refusal_of(c), "");  // the unbounded decay gate is implemented (Kimi Linear)

  j = real_json();
  j["text_config"]["linear_attn_config"].erase("use_full_rank_gate");
  c = parse(j);
  EXPECT_FALSE(c.use_full_rank_gate);
  EXPECT_EQ(refusal_of(c), "");  // the low-rank output gate is implemented (Kimi Linear)

  // SiLU needs no caps; model_max_length stands in for an absent max_position_embeddings.
  j = real_json();
  j["text_config"]["hidden_act"] = "silu";
  j["text_config"].erase("activation_situ_beta");
  j["text_config"].erase("activation_situ_linear_beta");
  j["text_config"].erase("max_position_embeddings");
  j["text_config"]["model_max_length"] = 65536;
  c = parse(j);
  EXPECT_EQ(c.situ_beta, 0.0);
  EXPECT_EQ(c.situ_linear_beta, 0.0);
  EXPECT_EQ(c.max_position_embeddings, 65536);
  j["text_config"]["max_position_embeddings"] = 4096;  // both given: max_position_embeddings wins
  EXPECT_EQ(parse(j).max_position_embeddings, 4096);
}

// Family keys that are present must still be well formed.
TEST(ModelConfig, FamilyKeysMalformed) {
  const auto with = [](const char* key, const json& v) {
    json j = real_json();
    j["text_config"][key] = v;
    return j;
  };
  EXPECT_EQ(error_of(with("attn_res_block_size", 0)),
            "cfg.json: 1 problem: text_config.attn_res_block_size = 0 is outside 1..65536");
  EXPECT_EQ(error_of(with("attn_res_block_size", nullptr)),
            "cfg.json: 1 problem: text_config.attn_res_block_size must be an integer, got null");
  EXPECT_HAS(error_of(with("routed_expert_hidden_size", -1)), "text_config.routed_expert_hidden_size = -1 is outside");
  EXPECT_EQ(error_of(with("mla_use_output_gate", "yes")),
            "cfg.json: 1 problem: text_config.mla_use_output_gate must be a boolean, got \"yes\"");
  EXPECT_EQ(error_of(with("use_grouped_topk", 1)),
            "cfg.json: 1 problem: text_config.use_grouped_topk must be a boolean, got 1");
  EXPECT_EQ(error_of(with("topk_method", 3)), "cfg.json: 1 problem: text_config.topk_method must be a string, got 3");
  EXPECT_EQ(error_of(with("moe_router_activation_func", false)),
            "cfg.json: 1 problem: text_config.moe_router_activation_func must be a string, got false");
  EXPECT_EQ(error_of(with("q_lora_rank", "1536")),
            "cfg.json: 1 problem: text_config.q_lora_rank must be an integer, got \"1536\"");
  EXPECT_EQ(error_of(with("moe_layer_freq", 0)),
            "cfg.json: 1 problem: text_config.moe_layer_freq = 0 is outside 1..65536");
  EXPECT_EQ(error_of(with("num_expert_group", 0)),
            "cfg.json: 1 problem: text_config.num_expert_group = 0 must be >= 1");
  EXPECT_EQ(error_of(with("num_expert_group", 3)),
            "cfg.json: 1 problem: text_config.num_expert_group = 3 does not divide num_experts 896");
  EXPECT_EQ(error_of(with("topk_group", 4)),
            "cfg.json: 1 problem: text_config.topk_group = 4 exceeds num_expert_group 1");
  EXPECT_EQ(error_of(with("topk_group", 0)), "cfg.json: 1 problem: text_config.topk_group = 0 must be >= 1");
  EXPECT_EQ(error_of(with("activation_situ_beta", 0.0)),
            "cfg.json: 1 problem: text_config.activation_situ_beta = 0 must be > 0");
  json j = with("hidden_act", "silu");
  j["text_config"]["activation_situ_linear_beta"] = -1.0;  // optional for SiLU, but checked when present
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.activation_situ_linear_beta = -1 must be > 0");
  j = real_json();
  j["text_config"]["linear_attn_config"]["gate_lower_bound"] = "low";
  EXPECT_EQ(error_of(j),
            "cfg.json: 1 problem: text_config.linear_attn_config.gate_lower_bound must be a number, got \"low\"");
  j = real_json();
  j["text_config"]["linear_attn_config"]["use_full_rank_gate"] = nullptr;
  EXPECT_EQ(error_of(j),
            "cfg.json: 1 problem: text_config.linear_attn_config.use_full_rank_gate must be a boolean, got null");
  j = real_json();
  j["text_config"].erase("latent_moe_use_norm");  // required with the latent MoE
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: missing key text_config.latent_moe_use_norm");
  j = real_json();
  j["text_config"].erase("max_position_embeddings");
  j["text_config"]["model_max_length"] = 0;
  EXPECT_EQ(error_of(j), "cfg.json: 1 problem: text_config.model_max_length = 0 is outside 1..1099511627776");
}

// The sibling Kimi Linear 48B-A3B: its flat config parses into the family flags, every one of which
// this engine implements; building a model from a directory with only the config then fails in one
// line at the checkpoint, not at the config.
TEST(ModelConfig, KimiLinear48BConfigParsesAndIsSupported) {
  const k3::ModelConfig c = parse(kimi_linear_48b());
  EXPECT_EQ(c.model_type, "kimi_linear");
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.max_position_embeddings, 1048576);  // from model_max_length
  EXPECT_EQ(c.intermediate_size, 9216);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_token, 8);
  EXPECT_EQ(c.num_shared_experts, 1);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.kda_num_heads, 32);
  EXPECT_EQ(c.kda_head_dim, 128);
  EXPECT_EQ(c.short_conv_kernel_size, 4);
  EXPECT_EQ(c.kda_layers.size(), 20u);
  EXPECT_TRUE(c.is_mla(26));  // one-based 27, the last layer
  EXPECT_TRUE(c.is_mla(23));
  EXPECT_TRUE(c.is_kda(24));
  EXPECT_EQ(c.eos_token_id, 163586);
  // Its family flags.
  EXPECT_EQ(c.activation, k3::FfnActivation::SiLU);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.residual, k3::ResidualKind::PlainSum);
  EXPECT_EQ(c.moe_kind, k3::MoeKind::Hidden);
  EXPECT_EQ(c.router_activation, k3::RouterActivation::Sigmoid);
  EXPECT_EQ(c.topk_method, "");
  EXPECT_TRUE(c.use_grouped_topk);
  EXPECT_EQ(c.num_expert_group, 1);
  EXPECT_TRUE(c.mla_use_nope);
  EXPECT_FALSE(c.mla_q_lora);
  EXPECT_FALSE(c.mla_use_output_gate);
  EXPECT_FALSE(c.kda_gate_bounded);
  EXPECT_FALSE(c.use_full_rank_gate);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(k3::unsupported_features(c).empty());
  EXPECT_EQ(refusal_of(c), "");
  // Parameter counts from the config equal the count over the released layout's tensor inventory
  // (tools/gen/gen_kimi_linear.py --preset kl-full --dry-run: total 49,122,681,728; active per token
  // 3,484,459,904 with the input embedding, 3,106,972,544 without, which is what k3 info reports).
  const k3::ArchParams a = k3::compute_arch_params(c);
  EXPECT_EQ(a.total, 49122681728);
  EXPECT_EQ(a.active_per_token, 3106972544);

  // Building the model from a directory holding only the config: one line about the checkpoint.
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("k3_kimi_linear_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << kimi_linear_48b().dump(2);
  const std::string msg =
      k3test::error_of_call([&] { k3::Model::load(dir.string()); }, "Model::load accepted Kimi Linear");
  EXPECT_EQ(msg, "no model.safetensors.index.json or model.safetensors in " + dir.string());
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  fs::remove_all(dir);
}

TEST(ModelConfig, UnknownModelType) {
  json j = real_json();
  j["model_type"] = "llama";
  EXPECT_EQ(error_of(j),
            "cfg.json: unsupported model_type \"llama\" (expected \"kimi_k3\" with a text_config, or a flat "
            "\"kimi_linear\" config)");
}

TEST(ModelConfig, BadJson) {
  const std::string msg = error_of_text("{\"model_type\": \"kimi_k3\", ");
  EXPECT_EQ(msg.rfind("cfg.json: invalid JSON: ", 0), 0u) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  EXPECT_EQ(error_of_text("[1, 2]"), "cfg.json: config must be a JSON object, got array");
  EXPECT_EQ(error_of_text("").rfind("cfg.json: invalid JSON: ", 0), 0u);
}

TEST(ModelConfig, FileErrors) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("k3_cfg_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Directory without config.json.
  try {
    k3::load_model_config(dir.string());
    ADD_FAILURE() << "missing config accepted";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()), (dir / "config.json").string() + ": config file not found");
  }
  // A path that does not exist at all.
  try {
    k3::load_model_config((dir / "nope.json").string());
    ADD_FAILURE() << "missing file accepted";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()), (dir / "nope.json").string() + ": config file not found");
  }
  // Invalid JSON on disk: the message starts with the file path.
  { std::ofstream(dir / "config.json") << "{ not json"; }
  try {
    k3::load_model_config(dir.string());
    ADD_FAILURE() << "bad JSON accepted";
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind((dir / "config.json").string() + ": invalid JSON: ", 0), 0u) << msg;
  }
  // A valid file on disk loads by directory and by file path, with the same result.
  { std::ofstream(dir / "config.json") << real_json().dump(); }
  const k3::ModelConfig by_dir = k3::load_model_config(dir.string());
  const k3::ModelConfig by_file = k3::load_model_config((dir / "config.json").string());
  expect_same_text_model(by_dir, by_file);
  EXPECT_EQ(by_dir.source, (dir / "config.json").string());
  // Problems from a file carry the path too.
  {
    json j = real_json();
    j["text_config"].erase("vocab_size");
    std::ofstream(dir / "config.json") << j.dump();
  }
  try {
    k3::load_model_config(dir.string());
    ADD_FAILURE() << "missing key accepted";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              (dir / "config.json").string() + ": 1 problem: missing key text_config.vocab_size");
  }
  fs::remove_all(dir);
}

// Robustness: every key of text_config / linear_attn_config replaced by every odd value either
// parses or fails with k3::Error whose message starts with the label (never another exception).
TEST(ModelConfig, HostileValuesOnlyRaiseK3Error) {
  const json base = real_json();
  const std::vector<json> odd = {nullptr,
                                 -1,
                                 0,
                                 1,
                                 "x",
                                 json::array(),
                                 json::object(),
                                 1e300,
                                 -1e300,
                                 true,
                                 9223372036854775807LL,
                                 json::array({0, 94, -3}),
                                 0.5};
  int rejected = 0, total = 0;
  auto try_one = [&](const json& j) {
    ++total;
    try {
      parse(j);
    } catch (const k3::Error& e) {
      ++rejected;
      EXPECT_EQ(std::string(e.what()).rfind("cfg.json: ", 0), 0u) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-k3 exception: " << e.what() << " for " << j.dump().substr(0, 200);
    }
  };
  for (const auto& [key, unused] : base["text_config"].items()) {
    for (const json& v : odd) {
      json j = base;
      j["text_config"][key] = v;
      try_one(j);
    }
  }
  for (const auto& [key, unused] : base["text_config"]["linear_attn_config"].items()) {
    for (const json& v : odd) {
      json j = base;
      j["text_config"]["linear_attn_config"][key] = v;
      try_one(j);
    }
  }
  for (const char* key : {"model_type", "text_config", "bos_token_id", "tie_word_embeddings"}) {
    for (const json& v : odd) {
      json j = base;
      j[key] = v;
      try_one(j);
    }
  }
  EXPECT_GT(rejected, total / 2);  // most of these values are invalid for the keys the engine uses
}
