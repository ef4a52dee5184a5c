// Per-thread grow-only scratch (see scratch.h).
#include "ops/cpu/scratch.h"

#include <cstdlib>
#include <new>

namespace k3::ops::cpu {

namespace {
struct Buffers {
  void* p[size_t(ScratchId::kCount)] = {};
  size_t cap[size_t(ScratchId::kCount)] = {};
  ~Buffers() {
    for (void* q : p) std::free(q);
  }
};
thread_local Buffers t_buffers;
}  // namespace

void* scratch_bytes(ScratchId id, size_t bytes) {
  Buffers& b = t_buffers;
  const auto i = size_t(id);
  if (b.cap[i] < bytes) {
    // Grow by at least half again, so a slowly growing shape (decode at a rising position) costs
    // a logarithmic number of reallocations, then none.
    size_t cap = b.cap[i] + b.cap[i] / 2;
    if (cap < bytes) cap = bytes;
    cap = (cap + 63) & ~size_t(63);
    void* q = std::aligned_alloc(64, cap);
    if (!q) throw std::bad_alloc();
    std::free(b.p[i]);
    b.p[i] = q;
    b.cap[i] = cap;
  }
  return b.p[i];
}

}  // namespace k3::ops::cpu
