// `k3 info`: architecture, parameter counts, state/cache sizes and weight bytes by dtype of a
// checkpoint (config.json alone is enough), and the memory a run at --ctx N needs with the verdict
// `k3 run` / `k3 chat` would reach: fits, does not fit, or refused past max_position_embeddings;
// with --trunk-fp8, counting the trunk matrices in FP8 (which needs the shards: it binds them).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "cli/cmd_ids.h"
#include "config/arch_stats.h"
#include "config/model_config.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "ops/cpu/isa.h"
#include "plan/sizes.h"
#include "runtime/loader.h"
#include "runtime/memory.h"

namespace k3::cli {

namespace {

// Why run / chat / eval refuse --ctx N on this model ("" when they do not): the check of
// runtime/loader.cpp, worded for a report.
std::string ctx_refusal(const ModelConfig& cfg, int64_t ctx) {
  if (ctx <= cfg.max_position_embeddings) return "";
  return "refused: --ctx " + std::to_string(ctx) + " exceeds the model's max_position_embeddings (" +
         std::to_string(cfg.max_position_embeddings) + "); k3 run, chat and eval refuse it";
}

// --cpu-experts / --hot-experts: where the GPU line puts the routed experts.
struct ExpertPlacementFlags {
  bool cpu = false;
  std::string hot;
};

int run_info(const std::string& model_flag, int64_t ctx, int64_t ubatch, bool trunk_fp8,
             const ExpertPlacementFlags& ex) {
  const double hot = parse_hot_experts(ex.hot, ex.cpu);  // (a bad value: its one-line error, before any output)
  const std::string dir = resolve_model_dir(model_flag);
  const ModelConfig cfg = load_model_config(dir);
  std::string report = format_arch_report(cfg, ctx);
  std::printf("%s", report.c_str());
  // The engine is text-only: kimi_k3.cpp skips the vision tower and projector when binding.
  std::printf(
      "input: text only (this engine does not implement the vision tower: vision_tower.* and "
      "mm_projector.* tensors are not loaded, images are not accepted)\n");
  const std::vector<std::string> unsupported = unsupported_features(cfg);
  if (!unsupported.empty()) {
    std::printf("engine support: this engine cannot run this family member (the counts above assume K3's tensors)\n");
    for (const std::string& u : unsupported) std::printf("  %s\n", u.c_str());
  }
  const std::string refused = ctx_refusal(cfg, ctx);
  // Weights on disk, from safetensors headers only (works on a config + index without shards).
  auto ck = io::Checkpoint::open_headers(dir);
  if (ck->tensor_count() == 0 && ck->missing_shards().empty()) {
    std::printf("checkpoint: no safetensors files (config only)\n");
    if (trunk_fp8) std::printf("FP8 trunk (--trunk-fp8): not counted: no safetensors files (counting binds them)\n");
    if (!refused.empty()) std::printf("context: %s\n", refused.c_str());
    return 0;
  }
  std::printf("checkpoint: %zu tensors in %zu shard(s)%s\n", ck->tensor_count(), ck->shard_paths().size(),
              ck->has_index() ? " (indexed)" : "");
  if (!ck->missing_shards().empty())
    std::printf("  %zu shard(s) absent: tensor byte counts below cover the present shards only\n",
                ck->missing_shards().size());
  for (const auto& [dt, bytes] : ck->bytes_by_dtype())
    std::printf("  %-8s %20llu B  (%s)\n", dtype_name(dt), (unsigned long long)bytes, human_bytes(bytes).c_str());
  std::printf("  %-8s %20llu B  (%s)\n", "total", (unsigned long long)ck->total_tensor_bytes(),
              human_bytes(ck->total_tensor_bytes()).c_str());
  // --trunk-fp8: the weights as run/chat/eval/serve then hold them (the trunk matrices in FP8), counted
  // from the bound weights (Model::load maps the shards and reads only the small vectors).
  uint64_t weights = ck->total_tensor_bytes(), gpu_fp8_extra = 0;
  if (trunk_fp8 && !ck->missing_shards().empty()) {
    std::printf("FP8 trunk (--trunk-fp8): not counted: %zu shard(s) absent (counting binds the shards)\n",
                ck->missing_shards().size());
  } else if (trunk_fp8) {
    const TrunkFp8Bytes t = trunk_fp8_bytes(Model::load(dir)->weights());
    weights = weights - t.before + t.after;
    gpu_fp8_extra = t.after_gpu - t.after;
    std::printf(
        "FP8 trunk (--trunk-fp8): %lld trunk matrices (attention, latent projections, shared experts, dense FFN) "
        "%s -> %s in FP8 (E4M3 + 128 x 128 fp32 block scales); weights held %s (%s as stored)\n",
        (long long)t.matrices, human_bytes(t.before).c_str(), human_bytes(t.after).c_str(),
        human_bytes(weights).c_str(), human_bytes(ck->total_tensor_bytes()).c_str());
  }
  if (!ck->missing_shards().empty()) {
    if (!refused.empty()) std::printf("context: %s\n", refused.c_str());
  } else {
    // What `k3 run` / `k3 chat` will check against MemAvailable (fp32 state, as this engine holds it).
    const int64_t at = ctx > 0 ? ctx : std::min<int64_t>(cfg.max_position_embeddings, 32768);
    const MemoryPlan p = plan_memory(cfg, weights, at, ubatch);
    std::printf("memory to run at %lld tokens (k3, fp32 state, ubatch %lld%s)%s\n", (long long)at, (long long)ubatch,
                trunk_fp8 ? ", --trunk-fp8" : "", ctx > 0 ? "" : " [--ctx N to change]");
    std::printf("  weights %s + KDA state %s + MLA cache %s + buffers ~%s = %s\n", human_bytes(p.weights).c_str(),
                human_bytes(p.kda_state).c_str(), human_bytes(p.mla_cache).c_str(), human_bytes(p.scratch).c_str(),
                human_bytes(p.total()).c_str());
    if (!refused.empty())
      std::printf("  %s\n", refused.c_str());
    else if (auto avail = mem_available_bytes())
      std::printf("  this machine: %s available (%s)\n", human_bytes(*avail).c_str(),
                  p.total() <= *avail ? "fits" : "does NOT fit: lower --ctx");

    // What `--device cuda` needs in GPU memory (weights as stored, MXFP4 experts stay 4-bit).
    const int64_t gat = ctx > 0 ? ctx : 4096;
    GpuOptions go;
    go.tokens_per_call = ubatch;
    go.experts_on_cpu = ex.cpu;
    go.hot_experts = hot;
    go.sm_count = gpu_sm_count();
    // With --cpu-experts the routed experts stay in host RAM (the CPU computes them): the GPU holds
    // the rest, plus the hot-expert cache's fraction of them (--hot-experts F; auto is not planned).
    size_t gpu_weights = weights + gpu_fp8_extra;
    double routed = 0;
    if (ex.cpu) {
      routed = plan::model_sizes(cfg, dir).experts_total_bytes();
      gpu_weights = size_t(std::max(0.0, double(weights) - routed + (hot > 0 ? hot * routed : 0.0)));
    }
    const GpuMemoryPlan g = gpu_memory_plan(cfg, gpu_weights, go, gat);
    std::printf(
        "GPU memory to run at %lld tokens (--device cuda%s%s)\n", (long long)gat,
        ex.cpu ? (hot > 0 ? " --cpu-experts --hot-experts " + ex.hot : hot < 0 ? std::string(" --cpu-experts --hot-experts auto") : std::string(" --cpu-experts")).c_str() : "",
        trunk_fp8 ? ", --trunk-fp8: the FP8 matrices with per-row scales, an MLA kv_b_proj in fp32" : "");
    if (ex.cpu)
      std::printf("  routed experts %s in host RAM, computed by the CPU cores%s\n", human_bytes(uint64_t(routed)).c_str(),
                  hot > 0   ? ("; " + human_bytes(uint64_t(hot * routed)) + " of them cached on the GPU too").c_str()
                  : hot < 0 ? "; a GPU cache of hot ones fills the memory left over (not planned)"
                            : "");
    std::printf("  weights %s + state %s + MLA cache %s + workspace %s = %s\n", human_bytes(g.weights).c_str(),
                human_bytes(g.state_fixed).c_str(), human_bytes(g.state_per_token * size_t(gat)).c_str(),
                human_bytes(g.workspace).c_str(), human_bytes(g.total()).c_str());
    // (docs/data/long-prefill-cuda-1048512.json: nvidia-smi's peak for the process less the engine's own)
    std::printf("  the CUDA runtime (context, cuBLAS) comes on top: about 0.6 GiB (629 MB measured on an H200, "
                "CUDA 13)\n");
    std::printf("  %s\n", refused.empty() ? gpu_fit_line(g.total()).c_str() : refused.c_str());
  }
  std::printf("CPU kernels: %s (best on this CPU: %s; K3_CPU_ISA=scalar|avx2|avx512|amx to choose)\n",
              ops::cpu_isa_name(ops::cpu_isa()), ops::cpu_isa_name(ops::cpu_isa_detected()));
  return 0;
}

}  // namespace

int cmd_info(int argc, char** argv) {
  CLI::App app{
      "k3 info: architecture, parameter counts, state/cache sizes, weight bytes by dtype, and the memory a run "
      "at --ctx N needs (config.json alone is enough)"};
  app.name("k3 info");
  std::string model;
  int64_t ctx = 0, ubatch = 512;
  bool trunk_fp8 = false;
  add_model_option(&app, model);
  app.add_flag("--trunk-fp8", trunk_fp8,
               "count the weights as --trunk-fp8 holds them (the trunk matrices in FP8; binds the checkpoint)");
  app.add_option("--ctx", ctx,
                 "size the MLA cache and the memory plan for this many tokens (default: "
                 "min(max_position_embeddings, 32768)); past max_position_embeddings it is reported as refused")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  app.add_option("--ubatch", ubatch, "prefill tokens per step the plan is sized for, as `k3 run --ubatch` (default 512)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  ExpertPlacementFlags ex;
  app.add_flag("--cpu-experts", ex.cpu,
               "plan the GPU line for --device cuda --cpu-experts: the routed experts in host RAM, computed by the CPU");
  add_hot_experts_option(&app, ex.hot);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  return run_guarded("k3 info", [&] { return run_info(model, ctx, ubatch, trunk_fp8, ex); });
}

}  // namespace k3::cli
