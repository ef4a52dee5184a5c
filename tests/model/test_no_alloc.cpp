// The steady-state decode loop allocates nothing on the CPU backend (issue 16): after warm-up, 100
// decode steps (a step of the model, then the sampler) make zero heap allocations, for one
// sequence and for a batch, in the default (fast) and fp32 numerics, on the trained K3-nano
// (MXFP4 routed experts) and the tiny fixture.
// Owns: the allocation counter (this executable replaces the global operator new).
// Counted: every C++ allocation (all forms of operator new, which the standard containers use).
// Not counted: allocations before warm-up (the first step of a shape sizes the workspace, the
// kernels' per-thread scratch and the index arrays), and the kernels' per-thread scratch itself
// (ops/cpu/scratch.h, grow-only, by aligned_alloc): a pool worker that a busy machine kept out of
// every warm-up loop of some shape sizes its scratch the first time it joins one, once.
#include <gtest/gtest.h>

#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <vector>

#include "core/thread_pool.h"
#include "model/model.h"
#include "runtime/sampler.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocs{0};

thread_local bool t_in_trace = false;

// K3_NO_ALLOC_TRACE=1: the stacks of the first counted allocations go to stderr (to find them).
void trace_alloc(int64_t nth) {
  static const bool on = std::getenv("K3_NO_ALLOC_TRACE") != nullptr;
  if (!on || nth >= 3 || t_in_trace) return;
  t_in_trace = true;
  void* frames[24];
  const int n = backtrace(frames, 24);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  (void)!write(STDERR_FILENO, "----\n", 5);
  t_in_trace = false;
}

void* counted_alloc(std::size_t n, std::size_t align) {
  if (g_counting.load(std::memory_order_relaxed)) trace_alloc(g_allocs.fetch_add(1, std::memory_order_relaxed));
  if (n == 0) n = 1;
  void* p =
      align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align) : std::malloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, std::size_t(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace fs = std::filesystem;

namespace {

struct Case {
  const char* model;  // under the source tree
  k3::ops::Numerics numerics;
  int64_t n_seqs;
};

std::string name_of(const ::testing::TestParamInfo<Case>& i) {
  std::string m = fs::path(i.param.model).filename().string();
  for (char& c : m)
    if (c == '-') c = '_';
  return m + "_" + k3::ops::numerics_name(i.param.numerics) + "_N" + std::to_string(i.param.n_seqs);
}

class NoAllocDecode : public ::testing::TestWithParam<Case> {};

// Prefill, warm-up, then 100 counted decode steps: the model's step and, per sequence, the
// sampler's draw and accept (temperature, top-k, top-p and a repetition penalty all on).
TEST_P(NoAllocDecode, HundredStepsAllocateNothing) {
  const Case c = GetParam();
  // Every worker in every loop: the adaptive team (core/thread_pool.h) could leave a worker out of
  // the warm-up on a busy machine (ctest -j) and let it size its per-thread buffers while counted.
  // K3_TEST_THREADS=N: N threads (more than this machine's cores emulates a larger machine).
  const char* nt = std::getenv("K3_TEST_THREADS");
  const k3::par::FixedThreads fixed(nt ? std::atoi(nt) : k3::par::max_threads());
  auto m = k3::Model::load((fs::path(K3_SOURCE_DIR) / c.model).string());
  const int64_t V = m->dims().vocab, N = c.n_seqs;
  k3::StatePoolOptions po;
  po.initial_slots = N + 1;
  po.initial_pages = 4 * N + 1;  // enough for 200 tokens each: the pool never grows while counted
  auto pool = m->new_pool(po);
  k3::ForwardOptions o;
  o.numerics = c.numerics;
  k3::SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 40;
  sp.top_p = 0.95f;
  sp.repetition_penalty = 1.1f;
  sp.penalty_last_n = 64;
  std::vector<k3::Sampler> samplers;
  std::vector<int32_t> slots, feed(size_t(N), 0);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(N));
  std::vector<k3::SeqStep> batch;
  for (int64_t i = 0; i < N; ++i) {
    sp.seed = uint64_t(11 + i);
    samplers.emplace_back(sp, V);
    slots.push_back(pool->alloc());
    for (int64_t t = 0; t < 9 + 5 * i; ++t) prompts[size_t(i)].push_back(int32_t((t * 37 + 11 * i + 1) % V));
    for (int32_t id : prompts[size_t(i)]) samplers.back().accept(id);
    batch.push_back({slots.back(), prompts[size_t(i)].data(), int64_t(prompts[size_t(i)].size()), false});
  }
  std::vector<float> logits(static_cast<size_t>(N * V));
  const auto decode = [&](int64_t steps) {
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < N; ++i) batch[size_t(i)] = {slots[size_t(i)], &feed[size_t(i)], 1, false};
      m->step(*pool, batch, o, logits.data());
      for (int64_t i = 0; i < N; ++i) {
        feed[size_t(i)] = samplers[size_t(i)].sample(logits.data() + i * V);
        samplers[size_t(i)].accept(feed[size_t(i)]);
      }
    }
  };
  m->step(*pool, batch, o, logits.data());  // prefill
  for (int64_t i = 0; i < N; ++i) feed[size_t(i)] = samplers[size_t(i)].sample(logits.data() + i * V);
  decode(20);  // warm-up: workspace, per-thread scratch, index arrays at their decode sizes
  const uint64_t epoch = pool->epoch();
  g_allocs = 0;
  g_counting = true;
  decode(100);
  g_counting = false;
  EXPECT_EQ(g_allocs.load(), 0) << "heap allocations in 100 steady-state decode steps";
  EXPECT_EQ(pool->epoch(), epoch) << "the pool grew while counted (the test's pool is too small)";
  // A prefill chunk of a shape seen before allocates nothing either (the same path as decode, with
  // the chunked kernels): a second sequence prefilled twice with 40 tokens, the second time counted.
  {
    std::vector<int32_t> chunk(40);
    for (size_t t = 0; t < chunk.size(); ++t) chunk[t] = int32_t((t * 13 + 5) % size_t(V));
    const int32_t a = pool->alloc();
    const k3::SeqStep pre{a, chunk.data(), int64_t(chunk.size()), false};
    // Warm-ups: a loop closes when its ranges are done, so on a busy machine a worker that wakes
    // late misses it (and the per-thread buffers its setup sizes) even under FixedThreads. On a
    // 2-core VM with two other busy processes, 2 warm-ups left such a worker for the counted run 14
    // times in 30, 8 warm-ups 0 times in 30. The counted run must still allocate nothing.
    for (int warm = 0; warm < 8; ++warm) {
      m->step(*pool, std::span(&pre, 1), o, logits.data());
      pool->reset(a);
    }
    g_allocs = 0;
    g_counting = true;
    m->step(*pool, std::span(&pre, 1), o, logits.data());
    g_counting = false;
    EXPECT_EQ(g_allocs.load(), 0) << "heap allocations in a repeated 40-token prefill";
    pool->free(a);
  }
  // The counter counts: one vector is one allocation.
  g_allocs = 0;
  g_counting = true;
  { std::vector<int> probe(3); }
  g_counting = false;
  EXPECT_EQ(g_allocs.load(), 1);
  // Every sequence decoded past a page boundary (64 tokens) while counted.
  for (int64_t i = 0; i < N; ++i) EXPECT_GT(pool->position(slots[size_t(i)]), 64);
}

// A full penalty window whose tokens are all distinct, then more distinct tokens: each accept()
// counts the new token before the oldest leaves (n + 1 distinct for a moment), without allocating.
TEST(NoAllocSampler, FullWindowOfDistinctTokens) {
  k3::SamplingParams sp;
  sp.repetition_penalty = 1.1f;
  sp.penalty_last_n = 8;
  k3::Sampler s(sp, 1000);
  for (int32_t t = 0; t < 8; ++t) s.accept(t);
  g_allocs = 0;
  g_counting = true;
  for (int32_t t = 8; t < 200; ++t) s.accept(t);
  g_counting = false;
  EXPECT_EQ(g_allocs.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, NoAllocDecode,
                         ::testing::Values(Case{"models/k3-nano", k3::ops::Numerics::Fast, 1},
                                           Case{"models/k3-nano", k3::ops::Numerics::Fast, 4},
                                           Case{"models/k3-nano", k3::ops::Numerics::F32, 1},
                                           Case{"models/k3-nano", k3::ops::Numerics::F32, 4},
                                           Case{"tests/fixtures/tiny", k3::ops::Numerics::Fast, 3}),
                         name_of);

}  // namespace
