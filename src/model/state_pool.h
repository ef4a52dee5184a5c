// Per-sequence decode state of many sequences: a pool of slots, each with the KDA recurrent state and
// conv histories of every KDA layer, and a paged MLA latent cache (fixed pages of tokens, a block
// table per slot, pages shared copy-on-write between forked slots). Memory is the backend's; the
// pool grows by doubling (slot and page ids stay valid; epoch() counts the reallocations, after
// which device pointers captured earlier, e.g. in a CUDA graph, are stale).
// Owns: slot/page bookkeeping, fork, snapshot/restore. Must not: compute (the forward does).
// A split model's pool (model/parallel.h) is rank 0's, holding the pools of the other ranks as
// shards: every slot and page operation is applied to each of them in the same order, so slot and
// page ids agree on every rank; each rank's step reads its own shard.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/backend.h"
#include "model/dims.h"

namespace k3 {

class RemoteLink;
struct RemoteSnapshot;

struct StatePoolOptions {
  int64_t page_tokens = 64;   // tokens per MLA cache page (a multiple of the CPU attention block, 64)
  int64_t initial_slots = 1;  // grows by doubling
  int64_t initial_pages = 8;  // grows by doubling
};

class StatePool {
 public:
  // is_kda[L] says which layers hold KDA state (the others hold an MLA cache).
  StatePool(Backend& be, const ModelDims& d, std::vector<bool> is_kda, const StatePoolOptions& o = {});
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  int32_t alloc();                           // an empty sequence (zero state, no cached tokens)
  void free(int32_t slot);                   // k3::Error for a slot that is not live
  int32_t fork(int32_t src);                 // a copy of src: state copied, cache pages shared until written
  void reset(int32_t slot);                  // back to empty (pages released)
  void copy_into(int32_t dst, int32_t src);  // dst becomes a copy of src (both stay live)
  bool live(int32_t slot) const;
  int64_t position(int32_t slot) const;  // tokens the slot has seen
  void check_live(int32_t slot) const;

  // A step appends n tokens to `slot`: pages for them (a shared last page is copied first), then
  // advance() after the step.
  void reserve_append(int32_t slot, int64_t n);
  void advance(int32_t slot, int64_t n);
  // The same on this pool alone, not its shards: the forward's own calls (a split model's ranks
  // each step their own shard, on threads of their own).
  void reserve_append_local(int32_t slot, int64_t n) { reserve_append_here(slot, n); }
  void advance_local(int32_t slot, int64_t n);
  const std::vector<int32_t>& pages(int32_t slot) const;  // block table
  int64_t page_tokens() const { return opt_.page_tokens; }

  // Whether `layer` holds KDA state (else an MLA cache).
  bool is_kda_layer(int64_t layer) const { return is_kda_.at(size_t(layer)); }
  KdaPool kda(int64_t layer) const;   // layer must be a KDA layer
  MlaPages mla(int64_t layer) const;  // layer must be an MLA layer
  uint64_t epoch() const { return epoch_; }
  int64_t slot_capacity() const { return int64_t(slots_.size()); }
  int64_t page_capacity() const { return int64_t(page_refs_.size()); }

  // KDA + conv state of every KDA layer of a slot in host memory, and its position: a rollback point
  // (the cache is not copied: restore() only shortens it back).
  struct Snapshot {
    int64_t pos = 0;
    std::vector<float> kda;                     // per KDA layer: S, conv q, conv k, conv v
    std::vector<std::vector<float>> shard_kda;  // the same of every shard (a split model's other ranks)
    std::shared_ptr<const RemoteSnapshot> remote;  // the other processes' parts (model/remote.h)
  };
  Snapshot snapshot(int32_t slot) const;
  void restore(int32_t slot, const Snapshot& s);  // k3::Error if the slot no longer extends it

  // Host copies of one layer's state of a slot (session files): KDA S/conv, or the cached tokens of
  // an MLA layer as c [len, kv_lora] and k_r [len, rope]. write_* replace them (MLA: the slot must be
  // empty or have exactly len tokens reserved via set_position).
  void read_kda(int32_t slot, int64_t layer, std::vector<float>& S, std::vector<float> conv[3]) const;
  void write_kda(int32_t slot, int64_t layer, const std::vector<float>& S, const std::vector<float> conv[3]);
  void read_mla(int32_t slot, int64_t layer, std::vector<float>& c, std::vector<float>& kr) const;
  void write_mla(int32_t slot, int64_t layer, const std::vector<float>& c, const std::vector<float>& kr);
  void set_position(int32_t slot, int64_t pos);  // reset + pages for pos tokens (contents undefined)
  // A stand-in context of pos tokens without a forward (benchmarks of decode at depths a prefill
  // would take hours to reach): set_position, then every MLA layer's cached latents and rope keys
  // and every KDA layer's state filled with values from `seed` (latents of unit RMS, as the cache's
  // RMSNorm leaves them before its weight; KDA S in +-0.01, conv history in +-1). Same seed, same
  // values. Work done per page: no host buffer of the whole cache.
  void fill_random(int32_t slot, int64_t pos, uint64_t seed);

  // The pools of ranks 1.. of a split model (model/parallel.h), created by the model with the same
  // options and empty; from then on every operation above is applied to them too.
  void add_shard(std::unique_ptr<StatePool> shard);
  int64_t ranks() const { return 1 + int64_t(shards_.size()); }
  StatePool& rank(int64_t r);  // 0: this pool
  // Rank 0's pool of a split model whose other ranks are processes (model/remote.h): from then on
  // every operation above is also sent to them (under pool id `id`), with the next step.
  void attach_remote(std::shared_ptr<RemoteLink> link, uint32_t id);
  const RemoteLink* remote() const { return remote_.get(); }
  uint32_t remote_id() const { return remote_id_; }

  int64_t live_slots() const;
  int64_t live_pages() const;  // pages referenced by some slot
  uint64_t bytes() const;      // backend memory the pool holds now

 private:
  static constexpr size_t kReservedPages = 64;  // block-table entries reserved per slot (4096 tokens at 64)
  struct Slot {
    bool live = false;
    int64_t pos = 0;
    std::vector<int32_t> pages;
  };
  // The operations on this pool alone (the public ones apply them to every shard as well).
  int32_t alloc_here();
  void free_here(int32_t slot);
  void reset_here(int32_t slot);
  void copy_into_here(int32_t dst, int32_t src);
  void reserve_append_here(int32_t slot, int64_t n);
  void restore_here(int32_t slot, int64_t pos, const std::vector<float>& kda);
  void set_position_here(int32_t slot, int64_t pos);
  void fill_random_here(int32_t slot, int64_t pos, uint64_t seed);
  void refuse_split(const char* what) const;  // per-layer state of one rank is not the model's
  int32_t new_page();
  void unref(int32_t page);
  void grow_slots();
  void grow_pages();
  void copy_state(int32_t dst, int32_t src);
  void zero_state(int32_t slot);
  float* page_ptr(int64_t mla_ordinal, int32_t page) const;

  Backend& be_;
  ModelDims d_;
  std::vector<bool> is_kda_;
  std::vector<int64_t> ordinal_;  // layer -> index among its kind
  StatePoolOptions opt_;
  std::vector<KdaPool> kda_;  // per KDA layer, [slot_cap] each
  std::vector<float*> mla_;   // per MLA layer, [page_cap, page_tokens, kv_lora + rope]
  std::vector<Slot> slots_;
  std::vector<int32_t> free_slots_;
  std::vector<int32_t> page_refs_;
  std::vector<int32_t> free_pages_;
  uint64_t epoch_ = 0;
  std::vector<std::unique_ptr<StatePool>> shards_;
  std::shared_ptr<RemoteLink> remote_;
  uint32_t remote_id_ = 0;
};

}  // namespace k3
