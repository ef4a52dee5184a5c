// Many sequences per step on the GPU (--device cuda): every sequence's logits equal the same
// sequence run alone (fp32 parity mode, N in {1, 3, 8, 32}, prefill chunks and decode tokens
// mixed in the same steps, slots freed and reused), and greedy ids of a K3-nano batch in the
// default (bf16) numerics equal each prompt's alone, with decode steps replayed as CUDA graphs.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/batch_run.h"
#include "common/cuda_util.h"
#include "common/num_util.h"
#include "core/error.h"
#include "model/model.h"
#include "runtime/expert_cache.h"

namespace fs = std::filesystem;

namespace {

constexpr double kBatchTolF32 = 1e-5;  // rel-L2 per sequence, fp32 parity mode (issue 16)

std::unique_ptr<k3::Model> on_gpu(const fs::path& dir, bool graphs = true, int64_t rows = 256) {
  auto m = k3::Model::load(dir.string());
  k3::GpuOptions o;
  o.graphs = graphs;
  o.tokens_per_call = rows;
  o.initial_context = 64;  // small: pools grow during the tests
  m->use_gpu(o);
  return m;
}

// The random tiny fixture in fp32, reported and not gated (as bf16 on it is, tests/cuda/
// test_cuda_model.cpp): a batched step computes decode rows with other kernels than alone (an fp32
// GEMM past 8 rows instead of GEMVs: another order of sums, ~1e-7), which this fixture amplifies
// to ~1e-5 (the CPU's fp32 SIMD path measures the same there) and, at a router near-tie its
// generator allows (top-k gaps >= 1e-4), into another expert for one sequence (measured on the
// H200: N=32, one sequence of 32 at 0.62, the other 31 at <= 4.2e-5). Checked here: every value
// written, the same with and without graphs and steps split into pieces, no slot or page left;
// the gate is K3-nano below.
class CudaBatch : public ::testing::TestWithParam<std::tuple<int64_t, bool, int64_t>> {};

TEST_P(CudaBatch, EachSequenceVsAloneFp32Reported) {
  K3_REQUIRE_GPU();
  const auto [N, graphs, rows] = GetParam();
  auto m = on_gpu(k3test::source_dir() / "tests/fixtures/tiny", graphs, rows);
  const auto seqs = k3test::mixed_sequences(N, int32_t(m->dims().vocab), uint32_t(N));
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::F32;
  auto pool = m->new_pool();
  const auto batched = k3test::run_batched(*m, seqs, o, *pool);
  double worst = 0;
  std::string errs;
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(k3test::count_nan(batched[i]), 0u);
    const double e = k3test::rel_l2(batched[i], k3test::run_alone(*m, seqs[i], o));
    worst = std::max(worst, e);
    char b[32];
    std::snprintf(b, sizeof b, " %.1e", e);
    errs += b;
  }
  std::printf("[gate] per-sequence:%s\n", errs.c_str());
  if (N == 1) {
    EXPECT_EQ(worst, 0.0) << "one sequence is the same computation alone and batched";
  }
  std::printf(
      "[gate] GPU batch tiny N=%-3lld graphs %d rows/step %-4lld fp32 worst rel-L2 batched vs alone %.3e "
      "(reported, not gated)\n",
      (long long)N, int(graphs), (long long)rows, worst);
  EXPECT_EQ(pool->live_slots(), 0);
  EXPECT_EQ(pool->live_pages(), 0);
}

INSTANTIATE_TEST_SUITE_P(Sequences, CudaBatch,
                         ::testing::Combine(::testing::Values(1, 3, 8, 32), ::testing::Bool(),
                                            ::testing::Values(int64_t(16), int64_t(512))));

// The trained K3-nano (well-conditioned: fp32 rounding is not amplified as on the random tiny
// fixtures), with the default GPU options.
TEST(CudaBatchNano, EachSequenceEqualsItselfAloneFp32) {
  K3_REQUIRE_GPU();
  auto m = on_gpu(k3test::source_dir() / "models/k3-nano");
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::F32;
  for (int64_t N : {1, 3, 8, 32}) {
    const auto seqs = k3test::mixed_sequences(N, int32_t(m->dims().vocab), uint32_t(100 + N));
    auto pool = m->new_pool();
    const auto batched = k3test::run_batched(*m, seqs, o, *pool);
    double worst = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const double e = k3test::rel_l2(batched[i], k3test::run_alone(*m, seqs[i], o));
      worst = std::max(worst, e);
      EXPECT_LE(e, kBatchTolF32) << "N " << N << " sequence " << i;
    }
    EXPECT_EQ(pool->live_slots(), 0);
    EXPECT_EQ(pool->live_pages(), 0);
    std::printf("[gate] GPU batch K3-nano N=%-3lld fp32 worst rel-L2 batched vs alone %.3e (tol %.0e)\n", (long long)N,
                worst, kBatchTolF32);
  }
}

TEST(CudaBatchGreedy, K3NanoBf16SameIdsAsAlone) {
  K3_REQUIRE_GPU();
  auto m = on_gpu(k3test::source_dir() / "models/k3-nano");
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::Fast;
  const int64_t N = 12, n_gen = 24;  // N > 8: decode rows past the GEMV width
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t t = 0; t < 3 + 5 * i; ++t)
      prompts[size_t(i)].push_back(int32_t((uint32_t(t + 17 * i) * 2654435761u >> 9) % 8192u));
  auto pool = m->new_pool();
  std::vector<k3::SeqStep> batch;
  for (const auto& p : prompts) batch.push_back({pool->alloc(), p.data(), int64_t(p.size()), false});
  std::vector<int32_t> pick(static_cast<size_t>(N)), feed;
  std::vector<std::vector<int32_t>> got(static_cast<size_t>(N));
  m->step(*pool, batch, o, nullptr, pick.data());
  for (int64_t g = 0; g < n_gen; ++g) {
    for (int64_t i = 0; i < N; ++i) got[size_t(i)].push_back(pick[size_t(i)]);
    feed = pick;
    for (int64_t i = 0; i < N; ++i) batch[size_t(i)] = {batch[size_t(i)].slot, &feed[size_t(i)], 1, false};
    m->step(*pool, batch, o, nullptr, pick.data());
  }
  // Every prompt's ids identical to alone. Batched rows are not bitwise the rows alone (fp32 parity
  // above: ~2e-7), so a failure prints, for each prompt that differs, the alone run's margin (its top
  // logit minus the batched pick's) at the first difference: a near tie there says bf16 rounding
  // flipped it, a large margin a real batching bug.
  const size_t V = size_t(m->dims().vocab);
  int same = 0;
  std::string ties;
  for (int64_t i = 0; i < N; ++i) {
    const auto& prompt = prompts[size_t(i)];
    k3::Session s(*m);
    int32_t tok = -1;
    k3::ForwardOptions so = o;
    so.argmax_out = &tok;
    m->forward(s, prompt.data(), int64_t(prompt.size()), false, nullptr, so);
    std::vector<int32_t> alone;
    for (int64_t g = 0; g < n_gen; ++g) {
      alone.push_back(tok);
      m->forward(s, &alone.back(), 1, false, nullptr, so);
    }
    if (got[size_t(i)] == alone) {
      ++same;
      continue;
    }
    size_t p = 0;
    while (got[size_t(i)][p] == alone[p]) ++p;
    k3::Session s2(*m);  // alone again, to the step that picks token p: its logits
    std::vector<float> lg(V);
    m->forward(s2, prompt.data(), int64_t(prompt.size()), false, p == 0 ? lg.data() : nullptr, p == 0 ? o : so);
    for (size_t t = 0; t < p; ++t)
      m->forward(s2, &alone[t], 1, false, t + 1 == p ? lg.data() : nullptr, t + 1 == p ? o : so);
    const float margin = lg[size_t(alone[p])] - lg[size_t(got[size_t(i)][p])];
    ties += " prompt " + std::to_string(i) + " at " + std::to_string(p) + " (margin " + std::to_string(margin) + ")";
    ADD_FAILURE() << "prompt " << i << ": batched ids differ from alone at " << p << " (alone's margin there "
                  << margin << ")";
  }
  std::printf("[gate] GPU batch K3-nano bf16 greedy: %d of %lld prompts identical to alone%s%s\n", same,
              (long long)N, ties.empty() ? "" : "; first differences:", ties.c_str());
}

}  // namespace

namespace {

// --device cuda --ram-budget: routed experts stay on the host and stream from disk through the
// expert cache; each step uploads the experts it selects. Same greedy tokens (and logits) as with
// every expert resident in GPU memory, on the tiny fixtures and K3-nano, in both GPU numerics.
std::vector<int32_t> greedy_ids(const k3::Model& m, const std::vector<int32_t>& prompt, int n, k3::ForwardOptions o,
                                std::vector<float>* last_logits) {
  k3::Session s(m);
  std::vector<float> l(size_t(m.dims().vocab));
  int32_t tok = -1;
  o.argmax_out = &tok;
  m.forward(s, prompt.data(), int64_t(prompt.size()), false, l.data(), o);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(tok);
    m.forward(s, &out.back(), 1, false, l.data(), o);
  }
  if (last_logits) *last_logits = l;
  return out;
}

TEST(CudaExpertSource, StreamedEqualsResident) {
  K3_REQUIRE_GPU();
  for (const char* dir : {"tests/fixtures/tiny", "tests/fixtures/tiny-chat", "tests/fixtures/kl-tiny", "models/k3-nano"}) {
    const fs::path p = k3test::source_dir() / dir;
    auto resident = on_gpu(p);
    auto streamed = k3::Model::load(p.string());
    k3::GpuOptions go;
    go.experts_resident = false;
    streamed->use_gpu(go);
    // The smallest cache the budget allows (top_k experts): evictions in every step.
    const auto totals = k3::expert_tensor_totals(streamed->checkpoint());
    const uint64_t slot = k3::ExpertCache::slot_bytes_for(*streamed, false);
    auto cache = k3::make_budget_expert_cache(*streamed,
                                              totals.trunk_bytes + uint64_t(streamed->dims().moe.top_k) * slot, false);
    std::vector<int32_t> prompt;
    for (int t = 0; t < 20; ++t) prompt.push_back(int32_t((t * 37 + 5) % int(resident->dims().vocab)));
    for (auto num : {k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
      k3::ForwardOptions o;
      o.numerics = num;
      std::vector<float> la, lb;
      const auto a = greedy_ids(*resident, prompt, 12, o, &la);
      o.experts = cache.get();
      const auto b = greedy_ids(*streamed, prompt, 12, o, &lb);
      EXPECT_EQ(a, b) << dir;
      EXPECT_EQ(la, lb) << dir << ": logits differ";
    }
    EXPECT_GT(cache->stats().misses, 0u);
    // Without the source the streamed model refuses in one line (its experts are not on the GPU).
    k3::Session s(*streamed);
    std::vector<float> l(size_t(streamed->dims().vocab));
    k3::ForwardOptions no_source;
    no_source.numerics = k3::ops::Numerics::F32;
    EXPECT_THROW(streamed->forward(s, prompt.data(), 3, false, l.data(), no_source), k3::Error);
  }
}

}  // namespace
