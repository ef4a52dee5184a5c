// Shared pieces of the varlen (continuous-batching) kernels in kda.cu, elementwise.cu and mla.cu:
// finding a row's sequence in the device cu_rows array, and the host checks of a VarlenDev /
// PagedCacheDev (one-line k3::Error on bad arguments, before anything is enqueued).
// Must not: read the device arrays on the host (a captured graph replays with new contents), or be
// included by host-only code (it is CUDA source).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"

namespace k3::cuda {
namespace {

// The largest i in [0, n) with key(i) <= x, for a non-decreasing key with key(0) <= x (binary
// search; the threads of a block ask the same question, so the loads are broadcasts).
template <class Key>
__device__ __forceinline__ int last_le(int n, Key key, int64_t x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (key(mid) <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The sequence holding `row` (cu_rows[i] <= row < cu_rows[i+1]); with empty sequences the last one
// starting at or before the row, which is the one that holds it.
__device__ __forceinline__ int seq_of_row(const int32_t* cu_rows, int n_seqs, int64_t row) {
  return last_le(
      n_seqs, [cu_rows](int i) { return int64_t(cu_rows[i]); }, row);
}

// Host checks shared by the varlen ops. `slots`: whether the op reads per-sequence state slots.
inline void check_varlen(const char* what, const VarlenDev& b, bool slots) {
  if (b.n_seqs < 1 || b.n_seqs > 65535)
    fail(std::string(what) + ": n_seqs " + std::to_string(b.n_seqs) + " outside the GPU kernels' 1..65535");
  if (b.rows < 0 || b.rows > INT32_MAX)
    fail(std::string(what) + ": rows " + std::to_string(b.rows) + " outside 0.." + std::to_string(INT32_MAX));
  if (b.cu_rows == nullptr) fail(std::string(what) + ": cu_rows is null");
  if (slots && b.slots == nullptr) fail(std::string(what) + ": slots is null");
  if (slots && (b.n_slots < 1 || b.n_slots > INT32_MAX))
    fail(std::string(what) + ": n_slots " + std::to_string(b.n_slots) + " outside 1.." + std::to_string(INT32_MAX));
}

inline void check_paged(const char* what, const PagedCacheDev& c) {
  if (c.pages == nullptr) fail(std::string(what) + ": pages is null");
  if (c.block_table == nullptr) fail(std::string(what) + ": block_table is null");
  if (c.pos0 == nullptr) fail(std::string(what) + ": pos0 is null");
  if (c.page_tokens < 1) fail(std::string(what) + ": page_tokens " + std::to_string(c.page_tokens) + " < 1");
  if (c.max_pages < 1) fail(std::string(what) + ": max_pages " + std::to_string(c.max_pages) + " < 1");
  if (c.n_pages < 1 || c.n_pages > INT32_MAX)
    fail(std::string(what) + ": n_pages " + std::to_string(c.n_pages) + " outside 1.." + std::to_string(INT32_MAX));
  if (c.max_pages * c.page_tokens > INT32_MAX)
    fail(std::string(what) + ": max_pages x page_tokens = " + std::to_string(c.max_pages * c.page_tokens) +
         " positions exceed int32");
}

// Where position `pos` of a sequence lives (its block-table row `bt`): the first float of its
// token row in the pool, or null when the table points outside the pool or past its own length.
__device__ __forceinline__ float* paged_row(const PagedCacheDev& c, const int32_t* bt, int64_t pos, int64_t width) {
  const int64_t pi = pos / c.page_tokens;
  if (pos < 0 || pi >= c.max_pages) return nullptr;
  const int32_t page = bt[pi];
  if (page < 0 || page >= c.n_pages) return nullptr;
  return c.pages + (int64_t(page) * c.page_tokens + (pos - pi * c.page_tokens)) * width;
}

}  // namespace
}  // namespace k3::cuda
