// The byte and FLOP sizes `k3 plan` places, from the config alone (arch_stats counts, gpu_memory_plan
// state and workspace, plan_memory host buffers) and, when present, safetensors header bytes.
// Must not: count parameters or state a second way (it converts those counts to stored bytes), or
// read tensor data.
#pragma once
#include <cstdint>
#include <string>

#include "config/model_config.h"

namespace k3::plan {

struct ModelSizes {
  std::string name;          // config path
  std::string bytes_source;  // where expert / trunk byte counts came from
  int64_t layers = 0, kda_layers = 0, mla_layers = 0, dense_layers = 0, moe_layers = 0;
  int64_t experts = 0, top_k = 0, hidden = 0, latent = 0, vocab = 0;
  int64_t kda_heads = 0, mla_heads = 0, max_positions = 0;
  bool experts_mxfp4 = false;
  // Parameters (logical, arch_stats).
  double trunk_params = 0;   // every layer except routed experts + final norms (no embedding, no lm_head)
  double shared_params = 0;  // per MoE layer: the fused shared experts (what runs beside the routed ones)
  double expert_params = 0;  // one routed expert
  double router_params = 0;  // all MoE layers' router gates (part of trunk_params; bf16 in an FP8 trunk)
  double kv_b_params = 0;    // all MLA layers' kv_b_proj (part of trunk_params; fp32 in a GPU FP8 trunk)
  double lm_head_params = 0, embed_params = 0;
  // Stored bytes.
  double trunk_bytes = 0;   // bf16 (or as the headers say)
  double shared_bytes = 0;  // per MoE layer
  double embed_bytes = 0, lm_head_bytes = 0;
  double expert_bytes = 0;  // one routed expert (MXFP4: 17/32 B per weight)
  double experts_total_bytes() const { return expert_bytes * double(experts) * double(moe_layers); }
  // Per sequence, as this engine holds them (fp32; gpu_memory_plan).
  double kda_state_bytes = 0;      // recurrent + conv state
  double mla_bytes_per_token = 0;  // latent + rope key of every MLA layer
  // Weights as a whole (for the CPU memory plan).
  double weight_bytes() const { return trunk_bytes + embed_bytes + lm_head_bytes + experts_total_bytes(); }
};

// From the config (and the safetensors headers of `dir` when it has them; `dir` empty: config only).
// k3::Error when the config is not a runnable K3-family config (check_supported's message).
ModelSizes model_sizes(const ModelConfig& cfg, const std::string& dir);

// Engine buffers for a step of `rows` rows (bytes): on the GPU, gpu_memory_plan's workspace; on the
// host, plan_memory's scratch at `ctx` tokens.
double gpu_workspace_bytes(const ModelConfig& cfg, int64_t rows);
double host_scratch_bytes(const ModelConfig& cfg, int64_t ctx, int64_t rows);

// FP8 (E4M3) trunk as issue 20 defines it: the trunk matrices (attention projections, MoE latent
// down/up projections, shared experts, dense FFN) at 1 byte per weight plus one fp32 scale per
// 128 x 128 block; the router, the embedding and the lm_head stay bf16. Returns the bytes that
// replace the bf16 ones. on_gpu: as the CUDA backend holds them (gpu_weight_bytes): one fp32 scale
// per row and 128 columns, and the MLA kv_b_proj in fp32.
struct Fp8Trunk {
  double trunk_bytes = 0, shared_bytes = 0, lm_head_bytes = 0;
};
Fp8Trunk fp8_trunk(const ModelSizes& s, bool on_gpu = false);

}  // namespace k3::plan
