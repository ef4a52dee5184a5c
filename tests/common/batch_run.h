// Batch equivalence harness (CPU: tests/model/test_batch.cpp; GPU: tests/cuda/test_cuda_batch.cpp):
// N sequences of mixed lengths start at staggered steps; each step gives every running sequence
// either its next prefill chunk or one decode token (teacher-forced), in one Model::step. Each
// sequence's logits are compared with the same sequence run alone with the same chunks.
// Owns: nothing the engine uses; test-only.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/num_util.h"
#include "model/model.h"

namespace k3test {

struct BatchSeq {
  std::vector<int32_t> ids;       // every token the sequence feeds
  int64_t prompt = 1, chunk = 1;  // ids[0, prompt) in chunks of <= chunk tokens, then one token per step
  int64_t start = 0;              // first step it takes part in
};

// N sequences with prompts of 1..~40 tokens, chunk sizes 1..16, decode tails, staggered starts.
inline std::vector<BatchSeq> mixed_sequences(int64_t N, int32_t vocab, uint32_t seed) {
  std::vector<BatchSeq> v(static_cast<size_t>(N));
  uint32_t x = seed * 2654435761u + 12345u;
  const auto next = [&]() { return x = x * 1664525u + 1013904223u, x >> 8; };
  for (int64_t i = 0; i < N; ++i) {
    BatchSeq& s = v[size_t(i)];
    s.prompt = 1 + int64_t(next() % 40);
    s.chunk = 1 + int64_t(next() % 16);
    const int64_t decode = 1 + int64_t(next() % 12);
    s.start = int64_t(next() % 6);
    for (int64_t t = 0; t < s.prompt + decode; ++t) s.ids.push_back(int32_t(next() % uint32_t(vocab)));
  }
  return v;
}

// The pieces sequence i feeds, in order: (offset, length).
inline std::vector<std::pair<int64_t, int64_t>> pieces_of(const BatchSeq& s) {
  std::vector<std::pair<int64_t, int64_t>> p;
  for (int64_t o = 0; o < s.prompt; o += s.chunk) p.push_back({o, std::min(s.chunk, s.prompt - o)});
  for (int64_t o = s.prompt; o < int64_t(s.ids.size()); ++o) p.push_back({o, 1});
  return p;
}

// Logits [ids, vocab] of every sequence, all run together in steps of one pool.
inline std::vector<std::vector<float>> run_batched(const k3::Model& m, const std::vector<BatchSeq>& seqs,
                                                   const k3::ForwardOptions& o, k3::StatePool& pool) {
  const size_t V = size_t(m.dims().vocab);
  std::vector<std::vector<float>> out(seqs.size());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> plan(seqs.size());
  std::vector<int32_t> slot(seqs.size(), -1);
  std::vector<size_t> next(seqs.size(), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    out[i].assign(seqs[i].ids.size() * V, qnan());
    plan[i] = pieces_of(seqs[i]);
  }
  for (int64_t step = 0;; ++step) {
    std::vector<k3::SeqStep> batch;
    std::vector<size_t> who;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (step < seqs[i].start || next[i] >= plan[i].size()) continue;
      if (slot[i] < 0) slot[i] = pool.alloc();
      const auto [off, len] = plan[i][next[i]];
      batch.push_back({slot[i], seqs[i].ids.data() + off, len, true});
      who.push_back(i);
    }
    if (batch.empty()) {
      bool left = false;
      for (size_t i = 0; i < seqs.size(); ++i) left |= next[i] < plan[i].size();
      if (!left) break;
      continue;
    }
    int64_t rows = 0;
    for (const auto& b : batch) rows += b.n;
    std::vector<float> logits(size_t(rows) * V, qnan());
    m.step(pool, batch, o, logits.data());
    int64_t r = 0;
    for (size_t j = 0; j < batch.size(); ++j) {
      const size_t i = who[j];
      const int64_t off = plan[i][next[i]].first;
      std::copy_n(logits.begin() + r * int64_t(V), batch[j].n * int64_t(V), out[i].begin() + off * int64_t(V));
      r += batch[j].n;
      if (++next[i] == plan[i].size()) {  // done: its slot goes back (and may be reused)
        pool.free(slot[i]);
        slot[i] = -1;
      }
    }
  }
  return out;
}

// The same sequence alone, with the same pieces.
inline std::vector<float> run_alone(const k3::Model& m, const BatchSeq& s, const k3::ForwardOptions& o) {
  const size_t V = size_t(m.dims().vocab);
  std::vector<float> out(s.ids.size() * V, qnan());
  k3::Session session(m);
  for (const auto& [off, len] : pieces_of(s))
    m.forward(session, s.ids.data() + off, len, true, out.data() + off * int64_t(V), o);
  return out;
}

}  // namespace k3test
