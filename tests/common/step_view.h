// A StepView over host arrays for tests that call backend ops or sublayers outside a Model: one
// sequence per entry of rows_per_seq, each in its own slot and page, all at position 0 (for ops
// that keep no state per sequence: the MoE, the expert halves). Test-only.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/backend.h"

namespace k3test {

struct HostStep {
  std::vector<int32_t> cu, slots, table;
  std::vector<int64_t> pos0;
  int64_t rows() const { return cu.back(); }
  k3::StepView view() const {
    k3::StepView v;
    v.n_seqs = int64_t(slots.size());
    v.rows = rows();
    v.cu_rows = cu.data();
    v.slots = slots.data();
    v.pos0 = pos0.data();
    v.block_table = table.data();
    v.max_pages = 1;
    v.page_tokens = 64;
    v.n_slots = v.n_seqs;
    v.n_pages = v.n_seqs;
    for (size_t i = 0; i + 1 < cu.size(); ++i)
      v.max_rows_per_seq = std::max<int64_t>(v.max_rows_per_seq, cu[i + 1] - cu[i]);
    return v;
  }
};

inline HostStep host_step(const std::vector<int32_t>& rows_per_seq) {
  HostStep s;
  s.cu.push_back(0);
  for (size_t i = 0; i < rows_per_seq.size(); ++i) {
    s.cu.push_back(s.cu.back() + rows_per_seq[i]);
    s.slots.push_back(int32_t(i));
    s.pos0.push_back(0);
    s.table.push_back(int32_t(i));
  }
  return s;
}

}  // namespace k3test
