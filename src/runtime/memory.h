// Memory accounting for a run: what a model needs at a given context (weights as mapped, KDA
// state, MLA cache and working buffers, all as this engine holds them: fp32 state), what the
// machine has (/proc/meminfo), what the process peaked at, and "24G"-style size parsing.
// Must not: allocate model memory or decide policy (front ends refuse or proceed).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "config/model_config.h"

namespace k3 {

struct MemoryPlan {
  uint64_t weights = 0;    // checkpoint bytes mapped (resident once touched); with the FP8 trunk,
                           // its matrices count in FP8 (the bf16 pages they replace are released)
  uint64_t kda_state = 0;  // recurrent + conv state, fp32, one sequence
  uint64_t mla_cache = 0;  // latent + rope-key cache for ctx tokens, fp32
  uint64_t scratch = 0;    // activations for one ubatch + logits (estimate)
  uint64_t total() const { return weights + kda_state + mla_cache + scratch; }
};

MemoryPlan plan_memory(const ModelConfig& cfg, uint64_t weight_bytes, int64_t ctx, int64_t ubatch);

std::optional<uint64_t> mem_available_bytes();  // MemAvailable from /proc/meminfo
uint64_t peak_rss_bytes();                      // getrusage ru_maxrss
uint64_t current_rss_bytes();                   // resident pages now (/proc/self/statm); 0 if unreadable

// "123", "512K", "1.5G", "2GiB", "64MB" (binary units: K/M/G/T = 2^10..2^40). k3::Error on junk.
uint64_t parse_size(const std::string& text, const std::string& what);
std::string human_bytes(uint64_t b);  // "1.50 GiB"

}  // namespace k3
