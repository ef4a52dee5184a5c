// The whole-model passes the gate tests run (CPU: tests/model/test_model_gates.cpp, GPU:
// tests/cuda/test_cuda_model.cpp): a full teacher-forced pass, prefill then token-by-token decode,
// and greedy generation, each with NaN-prefilled outputs checked fully written.
// Owns: nothing the engine uses; test-only.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/num_util.h"
#include "model/model.h"

namespace k3test {

// Logits [T, vocab] of one forward over all ids.
inline std::vector<float> full_pass(const k3::Model& m, const std::vector<int32_t>& ids,
                                    const k3::ForwardOptions& o = {}) {
  k3::Session s(m);
  std::vector<float> out(ids.size() * size_t(m.dims().vocab), qnan());
  m.forward(s, ids.data(), int64_t(ids.size()), true, out.data(), o);
  EXPECT_EQ(count_nan(out), 0u);
  return out;
}

// Prefill `split` tokens, then feed the rest one token at a time; logits of every position.
inline std::vector<float> incremental(const k3::Model& m, const std::vector<int32_t>& ids, size_t split,
                                      const k3::ForwardOptions& o = {}) {
  k3::Session s(m);
  const size_t V = size_t(m.dims().vocab);
  std::vector<float> out(ids.size() * V, qnan());
  m.forward(s, ids.data(), int64_t(split), true, out.data(), o);
  for (size_t t = split; t < ids.size(); ++t) m.forward(s, &ids[t], 1, true, out.data() + t * V, o);
  EXPECT_EQ(s.position(), int64_t(ids.size()));
  EXPECT_EQ(count_nan(out), 0u);
  return out;
}

// n greedy tokens after `prompt` (argmax of the host logits, first maximum on ties).
inline std::vector<int32_t> greedy(const k3::Model& m, const std::vector<int32_t>& prompt, int n,
                                   const k3::ForwardOptions& o = {}) {
  k3::Session s(m);
  const size_t V = size_t(m.dims().vocab);
  std::vector<float> l(V);
  m.forward(s, prompt.data(), int64_t(prompt.size()), false, l.data(), o);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t tok = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    out.push_back(tok);
    m.forward(s, &tok, 1, false, l.data(), o);
  }
  return out;
}

}  // namespace k3test
