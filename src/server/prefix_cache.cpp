// Radix tree of snapshots over token ids (see prefix_cache.h). Nodes without a snapshot exist only as
// branch points; a node left with no snapshot and one child is merged into that child.
#include "server/prefix_cache.h"

#include <algorithm>

namespace k3::server {

PrefixCache::PrefixCache(uint64_t budget_bytes, std::function<void(int32_t)> release,
                         std::function<uint64_t(int64_t, int64_t)> bytes_of)
    : budget_(budget_bytes),
      release_(std::move(release)),
      bytes_of_(std::move(bytes_of)),
      root_(std::make_unique<Node>()) {}

PrefixCache::~PrefixCache() { clear(); }

PrefixHit PrefixCache::lookup(std::span<const int32_t> ids, int64_t max_depth) {
  PrefixHit best;
  Node* best_node = nullptr;
  Node* n = root_.get();
  size_t pos = 0;
  for (;;) {
    if (n->seq >= 0 && n->depth <= max_depth) best_node = n;
    if (pos >= ids.size()) break;
    auto it = n->children.find(ids[pos]);
    if (it == n->children.end()) break;
    Node* c = it->second.get();
    if (c->depth > max_depth || pos + c->edge.size() > ids.size()) break;
    if (!std::equal(c->edge.begin(), c->edge.end(), ids.begin() + std::ptrdiff_t(pos))) break;
    pos += c->edge.size();
    n = c;
  }
  if (best_node) {
    lru_.splice(lru_.begin(), lru_, best_node->lru);
    best.seq = best_node->seq;
    best.depth = best_node->depth;
  }
  return best;
}

int64_t PrefixCache::snapshot_ancestor_depth(const Node* n) const {
  for (const Node* a = n->parent; a; a = a->parent)
    if (a->seq >= 0) return a->depth;
  return 0;
}

bool PrefixCache::insert(std::span<const int32_t> ids, int32_t seq) {
  if (!enabled() || ids.empty()) {
    release_(seq);
    return false;
  }
  Node* n = root_.get();
  size_t pos = 0;
  while (pos < ids.size()) {
    auto it = n->children.find(ids[pos]);
    if (it == n->children.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->edge.assign(ids.begin() + std::ptrdiff_t(pos), ids.end());
      leaf->parent = n;
      leaf->depth = int64_t(ids.size());
      Node* raw = leaf.get();
      n->children[ids[pos]] = std::move(leaf);
      ++st_.nodes;
      n = raw;
      pos = ids.size();
      break;
    }
    Node* c = it->second.get();
    size_t k = 0;
    while (k < c->edge.size() && pos + k < ids.size() && c->edge[k] == ids[pos + k]) ++k;
    if (k == c->edge.size()) {
      n = c;
      pos += k;
      continue;
    }
    // Split c's edge at k: mid holds edge[0, k), c keeps the rest.
    auto mid = std::make_unique<Node>();
    mid->edge.assign(c->edge.begin(), c->edge.begin() + std::ptrdiff_t(k));
    mid->parent = n;
    mid->depth = n->depth + int64_t(k);
    std::unique_ptr<Node> child = std::move(it->second);
    child->edge.erase(child->edge.begin(), child->edge.begin() + std::ptrdiff_t(k));
    child->parent = mid.get();
    const int32_t first = child->edge.front();
    mid->children[first] = std::move(child);
    Node* raw = mid.get();
    it->second = std::move(mid);
    ++st_.nodes;
    n = raw;
    pos += k;
  }
  if (n->seq >= 0) {  // the same tokens are cached already: keep the older snapshot
    release_(seq);
    ++st_.replaced;
    lru_.splice(lru_.begin(), lru_, n->lru);
    return false;
  }
  n->seq = seq;
  n->bytes = bytes_of_(n->depth, snapshot_ancestor_depth(n));
  lru_.push_front(n);
  n->lru = lru_.begin();
  ++st_.snapshots;
  ++st_.inserted;
  st_.bytes += n->bytes;
  evict_to_budget();
  // The new snapshot may itself have been evicted (it alone exceeds the budget).
  for (Node* s : lru_)
    if (s->seq == seq) return true;
  return false;
}

void PrefixCache::drop_snapshot(Node* n) {
  release_(n->seq);
  n->seq = -1;
  st_.bytes -= n->bytes;
  n->bytes = 0;
  --st_.snapshots;
  lru_.erase(n->lru);
  prune(n);
}

void PrefixCache::prune(Node* n) {
  while (n != root_.get() && n->seq < 0) {
    Node* p = n->parent;
    if (n->children.empty()) {
      p->children.erase(n->edge.front());  // destroys n
      --st_.nodes;
      n = p;
      continue;
    }
    if (n->children.size() == 1) {  // pass-through: merge into the child
      std::unique_ptr<Node> child = std::move(n->children.begin()->second);
      child->edge.insert(child->edge.begin(), n->edge.begin(), n->edge.end());
      child->parent = p;
      const int32_t first = n->edge.front();
      p->children[first] = std::move(child);  // destroys n
      --st_.nodes;
    }
    break;
  }
}

void PrefixCache::evict_to_budget() {
  while (st_.bytes > budget_ && !lru_.empty()) {
    drop_snapshot(lru_.back());
    ++st_.evicted;
  }
}

void PrefixCache::clear() {
  while (!lru_.empty()) drop_snapshot(lru_.back());
}

PrefixCacheStats PrefixCache::stats() const { return st_; }

}  // namespace k3::server
