// Checkpoint loading for generation: checks, memory plan, tokenizer, binding, expert cache (see loader.h).
#include "runtime/loader.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "runtime/memory.h"

namespace fs = std::filesystem;

namespace k3 {

LoadedCheckpoint load_checkpoint(const LoadRequest& r) {
  const LoadOptionNames& nm = r.names;
  LoadedCheckpoint lc;
  lc.dir = r.dir;
  if (!fs::is_directory(lc.dir)) fail("model directory " + lc.dir + " does not exist");
  const ModelConfig cfg = load_model_config(lc.dir);
  check_supported(cfg);  // before anything is sized for a family member this engine cannot run
  if (r.ctx_limit > cfg.max_position_embeddings)
    fail(nm.ctx + " " + std::to_string(r.ctx_limit) + " exceeds the model's max_position_embeddings (" +
         std::to_string(cfg.max_position_embeddings) + ")");
  lc.ctx_tokens = r.ctx_tokens ? r.ctx_tokens : std::min<int64_t>(cfg.max_position_embeddings, 32768);
  if (lc.ctx_tokens > cfg.max_position_embeddings)
    fail("context of " + std::to_string(lc.ctx_tokens) + " tokens exceeds the model's max_position_embeddings (" +
         std::to_string(cfg.max_position_embeddings) + ")");

  // Memory check before anything is mapped: weights (resident once read) + state at ctx. Under a
  // RAM budget the resident weights are the trunk plus the expert cache.
  uint64_t budget = 0;
  if (!r.ram_budget.empty()) budget = parse_size(r.ram_budget, nm.ram_budget);
  if (r.cuda && r.numerics == ops::Numerics::Exact)
    fail(nm.numerics_exact + " (fp64 sums) is CPU-only; with " + nm.device_cuda +
         " use fp32 (parity mode) or fast (bf16)");
  if (r.direct_io && !budget) fail(nm.direct_io + " needs " + nm.ram_budget + " (it is how streamed experts are read)");
  check_split_device(r.parallel, r.cuda);  // GPUs: one process per GPU, tensor parallel only
  if (r.parallel.split() && budget)
    fail(nm.split + " with " + nm.ram_budget + " is not supported yet (the ranks would share one expert cache)");
  lc.ram_budget = budget;
  ExpertTensorTotals totals;
  {
    auto heads = io::Checkpoint::open_headers(lc.dir);
    lc.weight_bytes = heads->total_tensor_bytes();
    // Whether the budget holds the trunk plus top_k experts is checked exactly (slot alignment
    // included) once the model is bound, still before any weight is read.
    if (budget) totals = expert_tensor_totals(*heads);
  }
  uint64_t limit = 0;
  std::string limit_src;
  if (!r.mem_limit.empty()) {
    limit = parse_size(r.mem_limit, nm.mem_limit);
    limit_src = nm.mem_limit;
  } else if (auto avail = mem_available_bytes()) {
    limit = *avail;
    limit_src = "MemAvailable";
  }
  // The weights resident once read: all of them, or under a RAM budget the trunk plus the expert
  // cache; `trunk_saved` is what the FP8 trunk saves (bf16 bytes - FP8 bytes of the trunk matrices).
  const auto check_fit = [&](uint64_t trunk_saved) {
    uint64_t resident = lc.weight_bytes - trunk_saved;
    if (budget) {
      lc.trunk_bytes = totals.trunk_bytes - trunk_saved;
      const uint64_t cache = budget > lc.trunk_bytes ? budget - lc.trunk_bytes : 0;
      resident = lc.trunk_bytes + std::min(cache, totals.expert_bytes);
    }
    MemoryPlan plan = plan_memory(cfg, resident, lc.ctx_tokens, r.ubatch);
    plan.mla_cache *= uint64_t(r.parallel.world());  // a split model's ranks each hold the whole latent cache
    if (limit && plan.total() > limit && !r.cuda)    // on the GPU the state lives in GPU memory (checked there)
      fail("model needs " + human_bytes(plan.total()) + " (weights " + human_bytes(plan.weights) +
           (trunk_saved ? " with the FP8 trunk" : "") + ", state and cache for " + std::to_string(lc.ctx_tokens) +
           " tokens " + human_bytes(plan.kda_state + plan.mla_cache) + ", buffers " + human_bytes(plan.scratch) +
           ") but only " + human_bytes(limit) + " is available (" + limit_src +
           (budget ? "); lower " + nm.ctx + " or " + nm.ram_budget
                   : "); lower " + nm.ctx + ", raise " + nm.mem_limit + " or set " + nm.ram_budget));
  };
  // With the FP8 trunk the check waits for the bound weights (binding maps the shards and reads only
  // the small vectors), whose trunk it counts in FP8; otherwise it runs before anything is mapped.
  if (!r.trunk_fp8) check_fit(0);

  lc.tokenizer_dir = r.tokenizer_dir.empty() ? lc.dir : r.tokenizer_dir;
  if (r.need_tokenizer) {
    if (!fs::exists(fs::path(lc.tokenizer_dir) / "tiktoken.model"))
      fail(lc.tokenizer_dir + " has no tiktoken.model: " + nm.no_tokenizer);
    lc.tok = std::make_unique<tok::Tokenizer>(tok::Tokenizer::load_dir(lc.tokenizer_dir));
  }

  const auto t0 = std::chrono::steady_clock::now();
  lc.model = Model::load(lc.dir);
  if (lc.tok && int64_t(lc.tok->vocab_size()) > lc.model->dims().vocab)
    fail("the tokenizer in " + lc.tokenizer_dir + " has " + std::to_string(lc.tok->vocab_size()) +
         " ids but the model's vocabulary is " + std::to_string(lc.model->dims().vocab));
  if (r.trunk_fp8) {
    const TrunkFp8Bytes fp8 = trunk_fp8_bytes(lc.model->weights());
    check_fit(fp8.before > fp8.after ? fp8.before - fp8.after : 0);
    lc.fp8 = lc.model->quantize_trunk_fp8();  // before the split: its ranks take views of the FP8 trunk
    lc.trunk_fp8 = true;
  }
  if (budget && r.trunk_fp8) {
    // make_budget_expert_cache's capacity, from the trunk as it now is (FP8).
    ExpertTensorTotals t = totals;
    t.trunk_bytes = lc.trunk_bytes;
    const int64_t top_k = std::min(lc.model->dims().moe.top_k, lc.model->dims().moe.experts);
    const uint64_t cap = ram_budget_cache_bytes(budget, t, top_k, ExpertCache::slot_bytes_for(*lc.model, r.direct_io));
    lc.experts = std::make_unique<ExpertCache>(*lc.model, ExpertCacheOptions{cap, r.direct_io});
  } else if (budget) {
    lc.experts = make_budget_expert_cache(*lc.model, budget, r.direct_io);
  }
  // Also with one rank: under an MPI launch split() refuses a plan that does not match the processes.
  lc.model->split(r.parallel);
  lc.bind_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return lc;
}

bool prefault_process_rank(const Model& m, const std::function<void(uint64_t, uint64_t)>& progress) {
  return m.prefault_process_rank(progress);
}

void prefault_weights(const LoadedCheckpoint& lc, const std::function<void(uint64_t, uint64_t)>& progress) {
  const Model& m = *lc.model;
  if (prefault_process_rank(m, progress)) return;
  if (lc.ram_budget || lc.trunk_fp8)
    m.checkpoint().prefault(progress, [&](std::string_view name) {
      return (lc.ram_budget && is_routed_expert_tensor(name)) || m.replaced_by_trunk_fp8(name);
    });
  else
    m.checkpoint().prefault(progress);
}

std::string trunk_fp8_summary(const TrunkFp8Report& r) {
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.2f s", r.seconds);
  return "trunk in FP8 (E4M3, 128 x 128 block scales): " + std::to_string(r.bytes.matrices) + " matrices, " +
         human_bytes(r.bytes.before) + " -> " + human_bytes(r.bytes.after) + ", " + human_bytes(r.released_bytes) +
         " of mapped pages released, in " + secs;
}

GpuOptions gpu_options_for(bool graphs, int64_t tokens_per_call, int64_t ctx_tokens, bool experts_resident,
                           bool experts_on_cpu, double hot_experts) {
  GpuOptions o;
  o.graphs = graphs;
  o.experts_resident = experts_resident;
  o.experts_on_cpu = experts_on_cpu;
  o.hot_experts = hot_experts;
  o.tokens_per_call = std::clamp<int64_t>(tokens_per_call, 1, kGpuMaxTokensPerCall);
  o.initial_context = std::clamp<int64_t>(ctx_tokens, 16, 32768);
  return o;
}

void check_gpu_mem(const std::string& value, bool cuda) {
  if (value.empty()) return;
  if (!cuda) fail("--gpu-mem goes with --device cuda (it caps the GPU memory the model may use)");
  if (parse_size(value, "--gpu-mem") == 0) fail("--gpu-mem must be more than 0");
}

void check_cpu_experts_q8(bool q8, bool experts_on_cpu) {
  if (q8 && !experts_on_cpu)
    fail("--cpu-experts-q8 goes with --cpu-experts (the numerics of the routed experts the CPU computes)");
}

double parse_hot_experts(const std::string& value, bool experts_on_cpu) {
  if (value.empty() || value == "0") return 0;
  if (!experts_on_cpu)
    fail("--hot-experts goes with --cpu-experts (a GPU cache for the routed experts the CPU computes; without "
         "--cpu-experts every routed expert is on the GPU already)");
  if (value == "auto") return GpuOptions::kHotExpertsAuto;
  char* end = nullptr;
  const double f = std::strtod(value.c_str(), &end);
  if (end == value.c_str() || *end != '\0' || !(f > 0 && f <= 1))
    fail("--hot-experts: '" + value + "' is not a fraction in (0, 1] or auto");
  return f;
}

std::vector<int32_t> eos_ids_from_dir(const Model& m, const std::string& dir) {
  std::vector<int32_t> ids;
  const auto add = [&](int64_t id) {
    if (id >= 0 && id < m.dims().vocab && std::find(ids.begin(), ids.end(), int32_t(id)) == ids.end())
      ids.push_back(int32_t(id));
  };
  add(m.config().eos_token_id);
  std::ifstream f(fs::path(dir) / "generation_config.json");
  if (f) {
    const auto j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_object() && j.contains("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) add(e.get<int64_t>());
      if (e.is_array())
        for (const auto& x : e)
          if (x.is_number_integer()) add(x.get<int64_t>());
    }
  }
  return ids;
}

}  // namespace k3
