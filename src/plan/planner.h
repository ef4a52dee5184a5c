// The cost model of `k3 plan` (docs/hybrid.md states every formula): where each part of a model
// goes (GPUs with tensor/expert parallelism, host RAM, disk), whether it fits, and the predicted
// decode step time and prefill time with every term of the arithmetic kept for the report.
// Pure functions of (ModelConfig, ModelSizes, Machine, Rates, PlanRequest): no I/O, no timing.
// Must not: measure, print, or change a rate it was given.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "plan/machine.h"
#include "plan/rates.h"
#include "plan/sizes.h"

namespace k3::plan {

// Expected distinct experts of one MoE layer for a batch of `batch` tokens under uniform routing:
// E * (1 - (1 - k/E)^B).
double expected_distinct_experts(int64_t experts, int64_t top_k, double batch);
// Expected largest number of the `picks` distinct experts (drawn uniformly without replacement from
// `experts`) that falls on one of `ranks` equal shards (hypergeometric per shard; the shards taken
// as independent for the maximum). picks may be fractional (interpolated).
double expected_max_shard_load(int64_t experts, int64_t ranks, double picks);

struct PlanRequest {
  int64_t ctx = 4096;                // context per sequence (MLA cache) the placement must hold
  int64_t batch = 1;                 // decode sequences for the aggregate figure (batch 1 is always reported)
  int64_t prompt = 4096;             // prefill length
  std::optional<double> expert_hit;  // --expert-hit: fraction of routed-expert reads the GPU cache serves
  // --hot-experts F (hybrid): the GPU caches this fraction of the routed experts, as `k3 run
  // --cpu-experts --hot-experts F` does (0: none, as --cpu-experts alone); unset: the spare GPU memory fills.
  std::optional<double> hot_experts;
  int tp = 0, ep = 0;                // 0: the planner chooses
  bool trunk_fp8 = false;            // plan the trunk in FP8 (--trunk-fp8)
  // Hybrid: the CPU's experts with 8-bit activations (--cpu-experts-q8: the fast expert GEMV rate);
  // else fp32 activations, the engine's default (cpu_expert_f32_Bps).
  bool cpu_experts_q8 = false;
  std::string placement = "auto";    // auto | gpu | hybrid | cpu
};

// One row of the placement table.
struct PlacementItem {
  std::string what, where;
  double bytes = 0;  // in total (all ranks / nodes)
  std::string note;
};

struct DecodeTerms {
  int64_t batch = 1;
  double distinct = 0;     // distinct experts per MoE layer in the step (EP group)
  double max_shard = 0;    // distinct experts on the busiest GPU (EP), per MoE layer
  double gpu_trunk = 0;    // s: trunk (+ lm_head) weights of one rank, once per step
  double gpu_shared = 0;   // s: the part of gpu_trunk that is shared experts (runs beside routed ones)
  double gpu_state = 0;    // s: KDA state (read + written) and MLA cache of the rank's sequences
  double gpu_experts = 0;  // s: routed experts served on the GPU (resident or hot-cached)
  double comm = 0;         // s: TP all-reduces + EP all-to-alls
  double gpu_layers = 0;   // s: per-layer GPU work besides the weight reads (layers x Latencies::gpu_layer)
  double cpu_experts = 0;  // s: routed experts computed on the CPU (from RAM)
  double disk = 0;         // s: routed experts read from disk
  double pcie = 0;         // s: activations to the CPU and back, every MoE layer
  double sync = 0;         // s: per-layer GPU <-> CPU handoffs
  double gpu_total = 0, cpu_total = 0;
  double serial = 0;                    // s: one micro-batch (the dependency chain of a token)
  double overlapped = 0;                // s: two micro-batches in flight (0: not applicable)
  double ideal = 0;                     // s: max(GPU, CPU) + PCIe + sync (issue 20's overlap bound)
  double step = 0;                      // s: the prediction
  double tokens_per_s = 0;              // batch / step
  std::string how;                      // which of serial / overlapped is the prediction, and why
  std::vector<std::string> arithmetic;  // each term: "name = formula = numbers = seconds"
};

struct PrefillTerms {
  int64_t prompt = 0, chunk = 0, chunks = 0;
  double flops_trunk = 0, flops_experts = 0;  // per token
  // Option A: the CPU computes the routed experts (GPU trunk); option B: expert weights streamed
  // to the GPU over PCIe, layer by layer, overlapped with its compute. Per chunk, seconds.
  double a_gpu = 0, a_cpu = 0, a_pcie = 0, a_total = 0;
  double b_compute = 0, b_stream = 0, b_disk = 0, b_total = 0;
  bool b_possible = false;
  double gpu = 0, comm = 0, cpu = 0, disk = 0;  // all-GPU or CPU-only placements
  double seconds = 0, tokens_per_s = 0;
  std::string choice;  // what the prediction uses, and why
  std::vector<std::string> arithmetic;
};

struct Plan {
  std::string kind;  // "gpu" | "hybrid" | "cpu"
  int tp = 1, ep = 1, dp = 1, world = 0;
  bool fits = false;
  std::string why_not;  // when it does not fit: what, how much, over by how much
  std::vector<PlacementItem> items;
  // Memory per GPU (bytes) and per node (host).
  double gpu_budget = 0, gpu_weights = 0, gpu_state = 0, gpu_workspace = 0, gpu_reserve = 0, gpu_cache = 0;
  double host_budget = 0, host_used = 0;
  double frac_gpu = 0, frac_ram = 0, frac_disk = 0;  // of all routed-expert bytes
  double hit = 0;                                    // fraction of routed-expert reads served on the GPU
  std::string hit_source;
  DecodeTerms decode1, decodeB;
  PrefillTerms prefill;
  std::vector<std::string> notes;
};

struct PlanResult {
  Plan best;
  std::vector<Plan> considered;  // every placement evaluated (best included), fitting or not
  std::vector<std::string> notes;
};

// Evaluates one placement kind at one (tp, ep). Never throws for "does not fit" (fits = false).
Plan evaluate(const ModelConfig& cfg, const ModelSizes& s, const Machine& m, const Rates& r, const PlanRequest& q,
              const std::string& kind, int tp, int ep);

// The placement to use: the forced one (--placement, --tp/--ep) or the fastest fitting one.
// k3::Error (one line) when the forced placement does not fit (what, by how much), when nothing
// fits, or on an invalid request (--tp/--ep that do not divide, a context past the model's limit).
PlanResult make_plan(const ModelConfig& cfg, const ModelSizes& s, const Machine& m, const Rates& r,
                     const PlanRequest& q);

// Host bytes the weights may use: --ram-budget when given, else RAM less 5% of it kept for the OS
// and the process (at least 4 GiB, at most 32 GiB).
double host_weight_budget(const Machine& m);

}  // namespace k3::plan
