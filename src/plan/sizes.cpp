// Model byte sizes for the planner (see sizes.h): arch_stats parameter counts x the stored width,
// the engine's own state/workspace functions, and safetensors header bytes when present.
// Must not: read tensor data, or reinterpret the config beyond the one key ModelConfig does not
// carry (the routed experts' storage format, text_config.quantization_config.format).
#include "plan/sizes.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "config/arch_stats.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "runtime/memory.h"

namespace k3::plan {

namespace {

// MXFP4 (compressed-tensors "mxfp4-pack-quantized"): 4-bit codes + one E8M0 byte per 32 weights.
constexpr double kMxfp4BytesPerWeight = 0.5 + 1.0 / 32.0;
constexpr double kBf16BytesPerWeight = 2.0;

// ModelConfig does not record how the routed experts are stored; the released K3 config says it in
// text_config.quantization_config (spec §1.3). Absent: the experts are stored like the rest (bf16).
bool config_says_mxfp4(const std::string& config_path) {
  namespace fs = std::filesystem;
  fs::path p(config_path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) p /= "config.json";
  std::ifstream in(p);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object()) return false;
  const nlohmann::json& t = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  if (!t.contains("quantization_config") || !t["quantization_config"].is_object()) return false;
  const nlohmann::json& q = t["quantization_config"];
  return q.contains("format") && q["format"].is_string() && q["format"].get<std::string>() == "mxfp4-pack-quantized";
}

bool is_vision_tensor(const std::string& n) {
  return n.rfind("vision_tower.", 0) == 0 || n.rfind("mm_projector.", 0) == 0;
}

}  // namespace

ModelSizes model_sizes(const ModelConfig& cfg, const std::string& dir) {
  check_supported(cfg);  // a family member this engine does not run is refused here, in one line
  const ArchParams a = compute_arch_params(cfg);
  ModelSizes s;
  s.name = cfg.source;
  s.layers = cfg.num_hidden_layers;
  s.kda_layers = a.n_kda_layers;
  s.mla_layers = a.n_mla_layers;
  s.dense_layers = a.n_dense_layers;
  s.moe_layers = a.n_moe_layers;
  s.experts = cfg.num_experts;
  s.top_k = cfg.num_experts_per_token;
  s.hidden = cfg.hidden_size;
  s.latent = cfg.moe_kind == MoeKind::Latent ? cfg.routed_expert_hidden_size : cfg.hidden_size;
  s.vocab = cfg.vocab_size;
  s.kda_heads = cfg.kda_num_heads;
  s.mla_heads = cfg.num_attention_heads;
  s.max_positions = cfg.max_position_embeddings;
  s.trunk_params = double(a.trunk);
  s.shared_params = 3.0 * double(cfg.shared_intermediate()) * double(cfg.hidden_size);
  s.expert_params = double(a.routed_expert);
  s.router_params = double(cfg.num_experts) * double(cfg.hidden_size) * double(a.n_moe_layers);
  s.kv_b_params = double(s.mla_layers) * double(cfg.num_attention_heads) *
                  double(cfg.qk_nope_head_dim + cfg.v_head_dim) * double(cfg.kv_lora_rank);
  s.lm_head_params = double(a.lm_head);
  s.embed_params = double(a.embedding);
  s.experts_mxfp4 = config_says_mxfp4(cfg.source);
  const double ew = s.experts_mxfp4 ? kMxfp4BytesPerWeight : kBf16BytesPerWeight;
  s.trunk_bytes = s.trunk_params * kBf16BytesPerWeight;
  s.shared_bytes = s.shared_params * kBf16BytesPerWeight;
  s.embed_bytes = s.embed_params * kBf16BytesPerWeight;
  s.lm_head_bytes = s.lm_head_params * kBf16BytesPerWeight;
  s.expert_bytes = s.expert_params * ew;
  s.bytes_source = std::string("config: bf16 trunk, ") +
                   (s.experts_mxfp4 ? "MXFP4 routed experts (quantization_config mxfp4-pack-quantized, 4.25 bits)"
                                    : "bf16 routed experts (no MXFP4 quantization_config)");

  // The engine's own state sizes (fp32, as held), independent of tokens_per_call and context.
  const GpuMemoryPlan g = gpu_memory_plan(cfg, 0, GpuOptions{}, 1);
  s.kda_state_bytes = double(g.state_fixed);
  s.mla_bytes_per_token = double(g.state_per_token);

  // Stored bytes from the safetensors headers, when the directory has a complete set.
  if (!dir.empty()) {
    auto ck = io::Checkpoint::open_headers(dir);
    if (ck->tensor_count() > 0 && ck->missing_shards().empty()) {
      double experts = 0, rest = 0, embed = 0, head = 0;
      for (const std::string& n : ck->names()) {
        if (is_vision_tensor(n)) continue;  // not loaded by this engine
        const double b = double(ck->find(n)->nbytes);
        if (is_routed_expert_tensor(n))
          experts += b;
        else if (n.find("embed_tokens.") != std::string::npos)
          embed += b;
        else if (n.find("lm_head.") != std::string::npos)
          head += b;
        else
          rest += b;
      }
      const double n_experts = double(s.experts) * double(s.moe_layers);
      if (experts > 0 && n_experts > 0) s.expert_bytes = experts / n_experts;
      if (rest > 0) {
        s.shared_bytes *= rest / s.trunk_bytes;
        s.trunk_bytes = rest;
      }
      if (embed > 0) s.embed_bytes = embed;
      if (head > 0) s.lm_head_bytes = head;
      s.bytes_source = "safetensors headers of " + dir + " (" + std::to_string(ck->tensor_count()) + " tensors)";
    }
  }
  return s;
}

double gpu_workspace_bytes(const ModelConfig& cfg, int64_t rows) {
  GpuOptions o;
  o.tokens_per_call = rows;
  return double(gpu_memory_plan(cfg, 0, o, 0).workspace);
}

double host_scratch_bytes(const ModelConfig& cfg, int64_t ctx, int64_t rows) {
  return double(plan_memory(cfg, 0, ctx, rows).scratch);
}

Fp8Trunk fp8_trunk(const ModelSizes& s, bool on_gpu) {
  if (on_gpu) {
    constexpr double kFp8 = 1.0 + 4.0 / 128.0;  // E4M3 byte + an fp32 scale per row and 128 columns
    return {(s.trunk_params - s.router_params - s.kv_b_params) * kFp8 + s.kv_b_params * 4.0 +
                s.router_params * kBf16BytesPerWeight,
            s.shared_params * kFp8, s.lm_head_bytes};
  }
  constexpr double kFp8 = 1.0 + 4.0 / (128.0 * 128.0);  // E4M3 byte + an fp32 scale per 128 x 128 block
  return {(s.trunk_params - s.router_params) * kFp8 + s.router_params * kBf16BytesPerWeight, s.shared_params * kFp8,
          s.lm_head_bytes};
}

}  // namespace k3::plan
