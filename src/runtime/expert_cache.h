// Memory tiers (--ram-budget): routed experts read from the shard files on demand (pread, or
// O_DIRECT with aligned spans into aligned buffers) into a bounded LRU cache, while the trunk
// (everything else) stays mapped and resident. Owns the cache, the reads and their counters.
// Must not: touch expert bytes through the mapping (they would count in RSS), or change the
// bytes: cached experts are the checkpoint's bytes verbatim, so outputs are bit-identical.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/model.h"

namespace k3 {

struct ExpertCacheStats {
  uint64_t bytes_read = 0;  // bytes requested from the shard files (O_DIRECT: incl. alignment padding)
  uint64_t reads = 0;       // read requests: one per contiguous byte range of a fetched expert
  uint64_t hits = 0;        // experts asked for that were cached
  uint64_t misses = 0;      // experts read from disk
  uint64_t evictions = 0;   // cached experts dropped to make room
  uint64_t fetches = 0;     // fetch() calls (batches)
  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0.0; }
  ExpertCacheStats operator-(const ExpertCacheStats& o) const {
    return {bytes_read - o.bytes_read, reads - o.reads,         hits - o.hits,
            misses - o.misses,         evictions - o.evictions, fetches - o.fetches};
  }
};

struct ExpertCacheOptions {
  uint64_t capacity_bytes = 0;  // the cache's buffers never exceed this
  bool direct_io = false;       // open the shards with O_DIRECT (bypasses the page cache)
};

// Routed experts of a loaded model, streamed. An expert's tensors that are adjacent in the file
// are one read; in the slot each tensor keeps its file offset's alignment modulo 64 (buffered) or
// 4096 (O_DIRECT) bytes, as it has in the mapping. The cache holds fixed-size slots (slot_bytes():
// the largest expert's bytes with alignment), allocated on first use, at most
// capacity_bytes / slot_bytes of them; the least recently used expert not in the current batch
// is evicted. fetch() is not thread-safe (one at a time); the weights it returns stay valid
// until the next fetch. Errors (short read, a shard that changed size, a read error, a capacity
// below min_experts() slots) are one-line k3::Errors.
class ExpertCache final : public ExpertSource {
 public:
  ExpertCache(const Model& m, const ExpertCacheOptions& opt);
  ~ExpertCache() override;
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  void fetch(int64_t layer, const int32_t* ids, int64_t n, const GluWeights** out) override;
  int64_t max_batch() const override { return max_slots_; }

  ExpertCacheStats stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t capacity_bytes() const { return uint64_t(max_slots_) * slot_bytes_; }  // <= the option
  uint64_t allocated_bytes() const { return uint64_t(slots_.size()) * slot_bytes_; }
  uint64_t expert_bytes() const { return expert_bytes_; }  // tensor bytes of all routed experts
  int64_t expert_count() const { return expert_count_; }
  int64_t min_experts() const { return min_experts_; }  // num_experts_per_token
  // Bytes one cached expert takes for this model and I/O mode (what capacity is counted in).
  static uint64_t slot_bytes_for(const Model& m, bool direct_io);

 private:
  struct ReadOp {
    int32_t fd = 0;       // index into fds_
    uint64_t offset = 0;  // file offset of the read (aligned for O_DIRECT)
    uint64_t length = 0;  // bytes requested (aligned for O_DIRECT)
    uint64_t needed = 0;  // bytes that must arrive (the span's meaningful end; may pass EOF by padding only)
    uint64_t dst = 0;     // offset in the slot
  };
  struct Plan {  // one routed expert
    std::vector<ReadOp> ops;
    GluWeights tmpl;       // formats and shapes; pointers hold slot offsets (below)
    uint64_t off[6] = {};  // gate.data, gate.scales, up.data, up.scales, down.data, down.scales
  };
  struct Slot {
    uint8_t* buf = nullptr;
    int64_t key = -1;  // layer * experts + id, or -1 when empty / being filled
    uint64_t last_use = 0;
    GluWeights w;
  };
  struct Shard;

  // The read plan of every routed expert of `m`; returns the slot size. ReadOp::fd indexes
  // `shards` (one location per shard holding experts: its path and mapped size).
  static uint64_t build_plans(const Model& m, bool direct_io, std::vector<Plan>& plans,
                              std::vector<io::TensorLocation>& shards, uint64_t& expert_bytes, int64_t& count);
  void load(Slot& s, int64_t key);
  [[noreturn]] void short_read(const ReadOp& op, uint64_t got) const;

  const Model& model_;
  bool direct_;
  int64_t experts_ = 0, min_experts_ = 0, expert_count_ = 0, max_slots_ = 0;
  uint64_t slot_bytes_ = 0, expert_bytes_ = 0, clock_ = 0;
  std::vector<Plan> plans_;       // [layers * experts], empty ops for dense layers
  std::vector<int32_t> slot_of_;  // [layers * experts] -> slot index or -1
  std::vector<Slot> slots_;
  std::vector<std::unique_ptr<Shard>> fds_;
  ExpertCacheStats stats_;
};

// --ram-budget accounting from checkpoint headers (works before the weights are mapped).
struct ExpertTensorTotals {
  uint64_t trunk_bytes = 0;       // every tensor that is not a routed expert (kept resident)
  uint64_t expert_bytes = 0;      // all routed experts
  uint64_t max_expert_bytes = 0;  // the largest single expert (w1 + w2 + w3 with scales)
  int64_t experts = 0;            // routed experts in the checkpoint (layers x experts)
};
ExpertTensorTotals expert_tensor_totals(const io::Checkpoint& ck);

// The expert-cache capacity a budget leaves: budget - trunk. k3::Error (one line, naming the
// numbers) when that is below `top_k` experts of `slot_bytes` each.
uint64_t ram_budget_cache_bytes(uint64_t budget, const ExpertTensorTotals& t, int64_t top_k, uint64_t slot_bytes);

// The cache for `--ram-budget budget` on a loaded model (checks as ram_budget_cache_bytes).
std::unique_ptr<ExpertCache> make_budget_expert_cache(const Model& m, uint64_t budget, bool direct_io);

}  // namespace k3
