// Loading a checkpoint for generation, shared by every front end (the `k3` command, the public
// API in src/api): option checks, the memory check before anything is mapped, the tokenizer from
// the model directory, binding, the expert cache under a RAM budget, GPU options, prefaulting.
// Must not: print, parse command lines or know a front end's spelling of its options (messages
// name options through LoadOptionNames).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "ops/cpu/isa.h"
#include "runtime/expert_cache.h"
#include "tokenizer/tokenizer.h"

namespace k3 {

// How messages name the options (the defaults are the `k3` command's flags).
struct LoadOptionNames {
  std::string ctx = "--ctx";
  std::string mem_limit = "--mem-limit";
  std::string ram_budget = "--ram-budget";
  std::string direct_io = "--direct-io";
  std::string device_cuda = "--device cuda";
  std::string numerics_exact = "--numerics exact";
  std::string split = "--tp/--ep";
  std::string trunk_fp8 = "--trunk-fp8";
  // What to do about a directory without tiktoken.model (after "DIR has no tiktoken.model: ").
  std::string no_tokenizer =
      "text commands need the model's tokenizer (pass --tokenizer DIR, or use `k3 generate --ids` for token-id runs)";
};

struct LoadRequest {
  std::string dir;             // checkpoint directory (config.json + safetensors)
  std::string tokenizer_dir;   // "" = dir
  bool need_tokenizer = true;  // false: no tokenizer is loaded (token-id use)
  int64_t ctx_limit = 0;       // the context limit the user asked for (0 = none); must fit the model
  int64_t ctx_tokens = 0;      // the context the memory check counts state and cache for;
                               // 0 = min(max_position_embeddings, 32768) (LoadedCheckpoint::ctx_tokens)
  int64_t ubatch = 512;        // rows of one prefill piece (activation buffers in the memory check)
  std::string mem_limit;       // size text ("24G"); "" = MemAvailable
  std::string ram_budget;      // size text; "" = every weight resident
  bool direct_io = false;      // with ram_budget: O_DIRECT expert reads
  bool cuda = false;           // the model goes to the GPU (the caller moves it: gpu_options_for)
  ops::Numerics numerics = ops::Numerics::Fast;
  ParallelPlan parallel;   // split over ranks in this process (CPU; model/parallel.h)
  bool trunk_fp8 = false;  // quantise the trunk to FP8 after binding, before the split (CPU only)
  LoadOptionNames names;
};

struct LoadedCheckpoint {
  std::unique_ptr<Model> model;
  std::unique_ptr<tok::Tokenizer> tok;   // null when !need_tokenizer
  std::unique_ptr<ExpertCache> experts;  // set under a RAM budget (declared after model: destroyed first)
  std::string dir, tokenizer_dir;
  uint64_t weight_bytes = 0;  // every tensor of the checkpoint
  uint64_t trunk_bytes = 0;   // under a RAM budget: the resident part (with the FP8 trunk: in FP8)
  uint64_t ram_budget = 0;    // bytes; 0 = none
  int64_t ctx_tokens = 0;     // the context the memory check counted
  double bind_seconds = 0;    // Model::load, the FP8 trunk and the expert cache
  bool trunk_fp8 = false;     // the trunk was quantised (fp8 says what it did)
  TrunkFp8Report fp8;
};

// The load-time line of the FP8 trunk: "trunk in FP8 (E4M3, 128 x 128 block scales): 84 matrices,
// 25.10 MiB -> 12.61 MiB, 25.10 MiB of mapped pages released, in 0.05 s".
std::string trunk_fp8_summary(const TrunkFp8Report& r);

// Checks the request (option combinations, context vs the config, memory: weights + state at
// ctx_tokens vs mem_limit or MemAvailable, CPU only), loads the tokenizer, binds the model, with
// trunk_fp8 quantises its trunk (Model::quantize_trunk_fp8; the memory check then counts the FP8
// trunk, from the bound weights, before any weight is read), splits it and, under a RAM budget,
// creates the expert cache. Nothing is prefaulted or moved to the GPU. Every failure is one
// k3::Error line.
LoadedCheckpoint load_checkpoint(const LoadRequest& r);

// Reads the resident weights in (the trunk only under a RAM budget; never the tensors the FP8 trunk
// replaced, whose pages it released; one rank of a model split over processes: that rank's rows and
// experts only): progress(done, total) bytes.
void prefault_weights(const LoadedCheckpoint& lc, const std::function<void(uint64_t, uint64_t)>& progress);
// The last case alone: true (after reading them in) when m holds one rank of a model split over
// processes (Model::process_rank_weights), false (nothing read) otherwise.
bool prefault_process_rank(const Model& m, const std::function<void(uint64_t, uint64_t)>& progress);

// The most rows a GPU step takes (--ubatch above it runs in pieces of this many): every workspace
// grows with it (k3 info --ubatch shows the sum; use_gpu refuses what does not fit).
constexpr int64_t kGpuMaxTokensPerCall = 8192;
// GPU options for steps of up to tokens_per_call rows (clamped to 1..kGpuMaxTokensPerCall) and sequences expected to
// reach ctx_tokens (cache pages reserved up front: clamped to 16..32768; the cache grows).
// experts_resident false (--ram-budget): only the trunk goes to the GPU; each step uploads the
// routed experts it selects from the expert cache.
// experts_on_cpu (--cpu-experts): the routed experts stay in host memory and the CPU computes them.
// hot_experts (--hot-experts, with experts_on_cpu): GpuOptions::hot_experts.
GpuOptions gpu_options_for(bool graphs, int64_t tokens_per_call, int64_t ctx_tokens, bool experts_resident = true,
                           bool experts_on_cpu = false, double hot_experts = 0);
// --hot-experts VALUE: "" or "0" -> 0 (none), "auto" -> GpuOptions::kHotExpertsAuto, a fraction in
// (0, 1]; a one-line error otherwise, or without experts_on_cpu.
double parse_hot_experts(const std::string& value, bool experts_on_cpu);
// --cpu-experts-q8 (GpuOptions::cpu_experts_q8) without --cpu-experts: k3::Error (one line).
void check_cpu_experts_q8(bool q8, bool experts_on_cpu);
// --gpu-mem SIZE (GpuOptions::gpu_mem): a one-line k3::Error without --device cuda or for a bad size.
void check_gpu_mem(const std::string& value, bool cuda);

// End-of-sequence ids: config.json's eos_token_id and generation_config.json's eos_token_id (an int
// or a list), those inside the model's vocabulary, without repeats, in that order.
std::vector<int32_t> eos_ids_from_dir(const Model& m, const std::string& dir);

}  // namespace k3
