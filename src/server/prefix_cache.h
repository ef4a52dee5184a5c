// The server's prefix cache: a radix tree over token ids whose nodes may hold a snapshot (an engine
// sequence holding exactly the node's tokens: KDA + conv state copied, MLA cache pages shared), LRU
// eviction under a byte budget. Owns the tree and the snapshot bookkeeping only. Must not: call the
// engine (sequences are released through the callback) or decide when snapshots are taken (the
// scheduler does).
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <vector>

namespace k3::server {

struct PrefixHit {
  int32_t seq = -1;   // the snapshot's sequence (fork it: it stays in the cache); -1 = no hit
  int64_t depth = 0;  // tokens it holds (a prefix of the looked-up ids)
};

struct PrefixCacheStats {
  int64_t snapshots = 0;
  uint64_t bytes = 0;  // charged bytes of the snapshots held
  int64_t nodes = 0;
  uint64_t inserted = 0, evicted = 0, replaced = 0;
};

class PrefixCache {
 public:
  // release(seq) frees a snapshot's sequence. bytes_of(depth, shared_depth) is the charge of a
  // snapshot of `depth` tokens whose first shared_depth tokens are also held by an ancestor snapshot.
  PrefixCache(uint64_t budget_bytes, std::function<void(int32_t)> release,
              std::function<uint64_t(int64_t depth, int64_t shared_depth)> bytes_of);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  bool enabled() const { return budget_ > 0; }
  // The deepest snapshot whose tokens are a prefix of ids[0, max_depth); it becomes most recently used.
  PrefixHit lookup(std::span<const int32_t> ids, int64_t max_depth);
  // Gives `seq` (holding exactly ids) to the cache. If the node already has a snapshot, the new one is
  // released and the old one kept. Evicts least recently used snapshots while over budget (possibly
  // the new one, when it alone is over budget). Returns false when seq was released at once.
  bool insert(std::span<const int32_t> ids, int32_t seq);
  void clear();  // releases every snapshot
  PrefixCacheStats stats() const;
  uint64_t budget() const { return budget_; }

 private:
  struct Node {
    std::vector<int32_t> edge;  // tokens from the parent to this node
    Node* parent = nullptr;
    std::map<int32_t, std::unique_ptr<Node>> children;  // by first token of the child's edge
    int64_t depth = 0;                                  // tokens from the root through edge
    int32_t seq = -1;                                   // snapshot held here, -1 = none
    uint64_t bytes = 0;
    std::list<Node*>::iterator lru;
  };
  void drop_snapshot(Node* n);  // releases and prunes
  void prune(Node* n);          // removes empty nodes upward, merges pass-through nodes
  void evict_to_budget();
  int64_t snapshot_ancestor_depth(const Node* n) const;

  uint64_t budget_;
  std::function<void(int32_t)> release_;
  std::function<uint64_t(int64_t, int64_t)> bytes_of_;
  std::unique_ptr<Node> root_;
  std::list<Node*> lru_;  // front = most recently used snapshot
  PrefixCacheStats st_;
};

}  // namespace k3::server
