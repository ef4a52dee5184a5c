// Many sequences per step (Model::step over a StatePool): every sequence's logits equal the same
// sequence run alone, for N in {1, 3, 8, 32} sequences mixing prefill chunks and decode tokens in
// the same steps; slot fork (copy-on-write cache pages), free, reuse and snapshots; bad steps.
// Owns: the batch-equivalence tolerance on the CPU (exact numerics).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <algorithm>
#include <filesystem>

#include "common/batch_run.h"
#include "common/num_util.h"
#include "core/error.h"
#include "model/model.h"

namespace fs = std::filesystem;

namespace {

constexpr double kBatchTol = 1e-6;  // rel-L2 per sequence, exact numerics (issue 16)

fs::path ours(const char* name) { return fs::path(K3_SOURCE_DIR) / "tests/fixtures" / name; }
fs::path nano() { return fs::path(K3_SOURCE_DIR) / "models/k3-nano"; }

class BatchEquivalence : public ::testing::TestWithParam<int64_t> {};

TEST_P(BatchEquivalence, EachSequenceEqualsItselfAlone) {
  const int64_t N = GetParam();
  auto m = k3::Model::load(ours("tiny").string());
  const auto seqs = k3test::mixed_sequences(N, int32_t(m->dims().vocab), uint32_t(N));
  k3::ForwardOptions o;  // exact
  auto pool = m->new_pool();
  const auto batched = k3test::run_batched(*m, seqs, o, *pool);
  double worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto alone = k3test::run_alone(*m, seqs[i], o);
    EXPECT_EQ(k3test::count_nan(batched[i]), 0u) << "sequence " << i;
    const double e = k3test::rel_l2(batched[i], alone);
    worst = std::max(worst, e);
    EXPECT_LE(e, kBatchTol) << "sequence " << i << " (prompt " << seqs[i].prompt << ", chunk " << seqs[i].chunk << ")";
  }
  std::printf("N=%lld: worst rel-L2 batched vs alone %.3g\n", (long long)N, worst);
  // Every sequence gave its slot back: nothing is left allocated.
  EXPECT_EQ(pool->live_slots(), 0);
  EXPECT_EQ(pool->live_pages(), 0);
}

INSTANTIATE_TEST_SUITE_P(Sequences, BatchEquivalence, ::testing::Values(1, 3, 8, 32));

// The third-party fixture too (a different shape: its own layer pattern and block size).
TEST(BatchEquivalenceThirdParty, EightSequences) {
  const fs::path dir = fs::path(K3_SHARED_DIR) / "fixtures/third-party/kimi-k3-in-c-tiny";
  if (!fs::exists(dir)) GTEST_SKIP() << "shared/ third-party fixtures absent: " << dir;
  auto m = k3::Model::load(dir.string());
  const auto seqs = k3test::mixed_sequences(8, int32_t(m->dims().vocab), 7);
  auto pool = m->new_pool();
  const auto batched = k3test::run_batched(*m, seqs, {}, *pool);
  for (size_t i = 0; i < seqs.size(); ++i)
    EXPECT_LE(k3test::rel_l2(batched[i], k3test::run_alone(*m, seqs[i], {})), kBatchTol) << "sequence " << i;
}

// Greedy decoding of 8 prompts together in the default (fast) numerics on the trained K3-nano
// gives the ids each prompt gives alone.
TEST(BatchGreedy, K3NanoFastSameIdsAsAlone) {
  auto m = k3::Model::load(nano().string());
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::Fast;
  const int64_t N = 8, n_gen = 16;
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t t = 0; t < 5 + 7 * i; ++t)
      prompts[size_t(i)].push_back(int32_t((uint32_t(t + 31 * i) * 2654435761u >> 9) % 8192u));
  auto pool = m->new_pool();
  std::vector<int32_t> slots, pick(static_cast<size_t>(N));
  std::vector<k3::SeqStep> batch;
  for (int64_t i = 0; i < N; ++i) {
    slots.push_back(pool->alloc());
    batch.push_back({slots.back(), prompts[size_t(i)].data(), int64_t(prompts[size_t(i)].size()), false});
  }
  std::vector<std::vector<int32_t>> got(static_cast<size_t>(N));
  m->step(*pool, batch, o, nullptr, pick.data());
  for (int64_t g = 0; g < n_gen; ++g) {
    for (int64_t i = 0; i < N; ++i) got[size_t(i)].push_back(pick[size_t(i)]);
    if (g + 1 == n_gen) break;
    std::vector<int32_t> feed = pick;
    for (int64_t i = 0; i < N; ++i) batch[size_t(i)] = {slots[size_t(i)], &feed[size_t(i)], 1, false};
    m->step(*pool, batch, o, nullptr, pick.data());
  }
  for (int64_t i = 0; i < N; ++i) {
    k3::Session s(*m);
    std::vector<float> l(size_t(m->dims().vocab));
    int32_t tok = -1;
    k3::ForwardOptions so = o;
    so.argmax_out = &tok;
    m->forward(s, prompts[size_t(i)].data(), int64_t(prompts[size_t(i)].size()), false, l.data(), so);
    std::vector<int32_t> alone;
    for (int64_t g = 0; g < n_gen; ++g) {
      alone.push_back(tok);
      if (g + 1 < n_gen) m->forward(s, &alone.back(), 1, false, l.data(), so);
    }
    EXPECT_EQ(got[size_t(i)], alone) << "prompt " << i;
  }
}

// In the default (fast) numerics every step of 8 sequences (prefill chunks of 5..54 tokens, then
// decode rows) gives each sequence the very bits it gets alone: chunks of >= 4 rows share the
// bf16 GEMM (each output one accumulation, independent of the other rows), the one-row sequences'
// dense products go through the multi-input GEMV and their routed experts through
// moe_decode_rows (each (expert, row) product and each row's sum as alone).
TEST(BatchDecode, K3NanoFastBitIdenticalToAlone) {
  auto m = k3::Model::load(nano().string());
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::Fast;
  const int64_t N = 8, n_gen = 6, V = m->dims().vocab;
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t t = 0; t < 5 + 7 * i; ++t)
      prompts[size_t(i)].push_back(int32_t((uint32_t(t + 17 * i) * 2654435761u >> 9) % 8192u));
  auto pool = m->new_pool();
  std::vector<int32_t> slots;
  std::vector<k3::SeqStep> batch;
  for (int64_t i = 0; i < N; ++i) {
    slots.push_back(pool->alloc());
    batch.push_back({slots.back(), prompts[size_t(i)].data(), int64_t(prompts[size_t(i)].size()), false});
  }
  // got[g][i]: sequence i's logits at step g (g = 0: the prefill's last row).
  std::vector<std::vector<float>> got(size_t(n_gen), std::vector<float>(size_t(N * V)));
  std::vector<int32_t> feed(static_cast<size_t>(N));
  for (int64_t g = 0; g < n_gen; ++g) {
    m->step(*pool, batch, o, got[size_t(g)].data());
    for (int64_t i = 0; i < N; ++i) {
      const float* l = got[size_t(g)].data() + i * V;
      feed[size_t(i)] = int32_t(std::max_element(l, l + V) - l);
      batch[size_t(i)] = {slots[size_t(i)], &feed[size_t(i)], 1, false};
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    k3::Session s(*m);
    std::vector<float> l(static_cast<size_t>(V));
    m->forward(s, prompts[size_t(i)].data(), int64_t(prompts[size_t(i)].size()), false, l.data(), o);
    for (int64_t g = 0; g < n_gen; ++g) {
      const float* b = got[size_t(g)].data() + i * V;
      EXPECT_EQ(std::memcmp(b, l.data(), size_t(V) * 4), 0) << "sequence " << i << " step " << g;
      int32_t next = int32_t(std::max_element(b, b + V) - b);
      if (g + 1 < n_gen) m->forward(s, &next, 1, false, l.data(), o);
    }
  }
}

// Fork mid-sequence (cache pages shared, then copied on write): parent and child continue with
// different tokens and each equals its whole sequence run alone; freeing either leaves the other intact.
TEST(StatePool, ForkSharesPagesCopyOnWrite) {
  auto m = k3::Model::load(ours("tiny").string());
  const size_t V = size_t(m->dims().vocab);
  std::vector<int32_t> a, b;
  for (int t = 0; t < 90; ++t) a.push_back(int32_t((t * 7 + 3) % int(V)));
  b.assign(a.begin(), a.begin() + 70);  // the fork point (mid-page: pages are 64 tokens)
  for (int t = 70; t < 90; ++t) b.push_back(int32_t((t * 13 + 1) % int(V)));
  auto pool = m->new_pool();
  const int32_t pa = pool->alloc();
  std::vector<float> la(a.size() * V, k3test::qnan()), lb(b.size() * V, k3test::qnan());
  const k3::SeqStep first{pa, a.data(), 70, true};
  m->step(*pool, std::span(&first, 1), {}, la.data());
  std::copy_n(la.begin(), 70 * V, lb.begin());
  const int32_t pb = pool->fork(pa);
  EXPECT_EQ(pool->position(pb), 70);
  EXPECT_EQ(pool->live_pages(), 2);  // shared, not copied
  for (int t = 70; t < 90; ++t) {
    const k3::SeqStep both[] = {{pa, &a[size_t(t)], 1, true}, {pb, &b[size_t(t)], 1, true}};
    std::vector<float> l(2 * V);
    m->step(*pool, both, {}, l.data());
    std::copy_n(l.begin(), V, la.begin() + t * int64_t(V));
    std::copy_n(l.begin() + int64_t(V), V, lb.begin() + t * int64_t(V));
  }
  // The page both wrote into was copied for the writer (parent); the first page stays shared.
  EXPECT_EQ(pool->live_pages(), 3);
  pool->free(pa);
  EXPECT_EQ(pool->live_pages(), 2);  // the child's two
  const auto alone = [&](const std::vector<int32_t>& ids) {
    k3::Session s(*m);
    std::vector<float> out(ids.size() * V);
    m->forward(s, ids.data(), 70, true, out.data());
    for (size_t t = 70; t < ids.size(); ++t) m->forward(s, &ids[t], 1, true, out.data() + t * V);
    return out;
  };
  EXPECT_LE(k3test::rel_l2(la, alone(a)), kBatchTol);
  EXPECT_LE(k3test::rel_l2(lb, alone(b)), kBatchTol);
  pool->free(pb);
  EXPECT_EQ(pool->live_slots(), 0);
  EXPECT_EQ(pool->live_pages(), 0);
}

// A freed slot comes back empty: reused, it computes what a fresh sequence computes.
TEST(StatePool, ReusedSlotStartsFresh) {
  auto m = k3::Model::load(ours("tiny").string());
  const size_t V = size_t(m->dims().vocab);
  auto pool = m->new_pool();
  std::vector<int32_t> ids{5, 9, 2, 6, 5, 3, 5, 8, 9, 7};
  std::vector<float> first(V), again(V);
  const int32_t s0 = pool->alloc();
  const k3::SeqStep a{s0, ids.data(), int64_t(ids.size()), false};
  m->step(*pool, std::span(&a, 1), {}, first.data());
  const k3::SeqStep other{s0, ids.data() + 3, 4, false};
  m->step(*pool, std::span(&other, 1), {}, again.data());  // state now holds more
  pool->free(s0);
  const int32_t s1 = pool->alloc();
  EXPECT_EQ(s1, s0);  // the same slot, reused
  EXPECT_EQ(pool->position(s1), 0);
  const k3::SeqStep b{s1, ids.data(), int64_t(ids.size()), false};
  m->step(*pool, std::span(&b, 1), {}, again.data());
  EXPECT_EQ(first, again);
}

// A snapshot restores the KDA state and shortens the cache: continuing differently equals a fresh run.
TEST(StatePool, SnapshotRestore) {
  auto m = k3::Model::load(ours("tiny").string());
  const size_t V = size_t(m->dims().vocab);
  auto pool = m->new_pool();
  std::vector<int32_t> p{1, 2, 3, 4, 5, 6, 7, 8}, x{9, 9, 9}, y{4, 3};
  const int32_t s = pool->alloc();
  std::vector<float> l(V), want(V);
  const k3::SeqStep a{s, p.data(), 8, false};
  m->step(*pool, std::span(&a, 1), {}, l.data());
  const auto snap = pool->snapshot(s);
  const k3::SeqStep bx{s, x.data(), 3, false};
  m->step(*pool, std::span(&bx, 1), {}, l.data());
  pool->restore(s, snap);
  EXPECT_EQ(pool->position(s), 8);
  const k3::SeqStep by{s, y.data(), 2, false};
  m->step(*pool, std::span(&by, 1), {}, l.data());
  std::vector<int32_t> py = p;
  py.insert(py.end(), y.begin(), y.end());
  k3::Session fresh(*m);  // the same pieces (a piece boundary moves the KDA chunking)
  m->forward(fresh, py.data(), 8, false, want.data());
  m->forward(fresh, py.data() + 8, 2, false, want.data());
  EXPECT_LE(k3test::rel_l2(l, want), kBatchTol);
}

// fill_random: a stand-in context of N tokens without a forward (k3 bench --depth-fill random):
// the position, seeded values (same seed same values, another seed others) of unit RMS in the MLA
// cache and within +-0.01 in the KDA state, and a decode step from it gives finite logits.
TEST(StatePool, FillRandomIsSeededAndDecodable) {
  auto m = k3::Model::load(ours("tiny").string());
  auto pool = m->new_pool();
  const int32_t a = pool->alloc(), b = pool->alloc(), c = pool->alloc();
  const int64_t N = 150;  // three pages of 64, the last one partial
  pool->fill_random(a, N, 7);
  pool->fill_random(b, N, 7);
  pool->fill_random(c, N, 8);
  EXPECT_EQ(pool->position(a), N);
  int64_t mla_layers = 0, kda_layers = 0;
  for (int64_t L = 0; L < m->dims().layers; ++L) {
    std::vector<float> ca, ka, cb, kb, cc, kc;
    if (pool->is_kda_layer(L)) {
      EXPECT_THROW(pool->read_mla(a, L, ca, ka), k3::Error);
      std::vector<float> Sa, Sb, Sc, conv[3];
      pool->read_kda(a, L, Sa, conv);
      pool->read_kda(b, L, Sb, conv);
      pool->read_kda(c, L, Sc, conv);
      EXPECT_EQ(Sa, Sb);
      EXPECT_NE(Sa, Sc);
      float mx = 0;
      for (float v : Sa) mx = std::max(mx, std::fabs(v));
      EXPECT_GT(mx, 0.005f);
      EXPECT_LE(mx, 0.01f);
      ++kda_layers;
      continue;
    }
    pool->read_mla(a, L, ca, ka);
    pool->read_mla(b, L, cb, kb);
    pool->read_mla(c, L, cc, kc);
    ASSERT_EQ(ca.size(), size_t(N * m->dims().mla.kv_lora));
    EXPECT_EQ(ca, cb);
    EXPECT_EQ(ka, kb);
    EXPECT_NE(ca, cc);
    double ms = 0;
    for (float v : ca) ms += double(v) * v;
    EXPECT_NEAR(ms / double(ca.size()), 1.0, 0.05);
    ++mla_layers;
  }
  EXPECT_GT(mla_layers, 0);
  EXPECT_GT(kda_layers, 0);
  std::vector<int32_t> id{5};
  std::vector<float> l(size_t(m->dims().vocab));
  const k3::SeqStep one{a, id.data(), 1, false};
  m->step(*pool, std::span(&one, 1), {}, l.data());
  EXPECT_EQ(pool->position(a), N + 1);
  EXPECT_EQ(k3test::count_nan(l), 0u);
  for (float v : l) ASSERT_TRUE(std::isfinite(v));
  EXPECT_THROW(pool->fill_random(a, -1, 7), k3::Error);
}

TEST(ModelStep, RefusesBadSteps) {
  auto m = k3::Model::load(ours("tiny").string());
  auto pool = m->new_pool();
  const int32_t s = pool->alloc();
  std::vector<int32_t> ids{1, 2};
  std::vector<float> l(2 * size_t(m->dims().vocab));
  const k3::SeqStep twice[] = {{s, ids.data(), 1, false}, {s, ids.data() + 1, 1, false}};
  EXPECT_THROW(m->step(*pool, twice, {}, l.data()), k3::Error);
  const k3::SeqStep dead{s + 1, ids.data(), 1, false};
  EXPECT_THROW(m->step(*pool, std::span(&dead, 1), {}, l.data()), k3::Error);
  const k3::SeqStep empty{s, ids.data(), 0, false};
  EXPECT_THROW(m->step(*pool, std::span(&empty, 1), {}, l.data()), k3::Error);
  const k3::SeqStep ok{s, ids.data(), 1, false};
  EXPECT_THROW(m->step(*pool, std::span(&ok, 1), {}, nullptr), k3::Error);
  EXPECT_THROW(pool->free(s + 5), k3::Error);
  EXPECT_EQ(pool->position(s), 0);  // nothing ran
}

}  // namespace

namespace {
// fp32 SIMD numerics: a batched step computes decode rows with GEMMs where alone they are GEMVs
// (another order of fp32 sums, ~1e-7). Reported, not gated: on the random tiny fixtures a 1e-7
// change can flip a router near-tie (the generator only keeps top-k gaps >= 1e-4), which moves a
// sequence's logits by tenths; K3-nano (trained) shows what the reordering itself costs.
TEST(BatchEquivalenceF32, Reported) {
  k3::ForwardOptions o;
  o.numerics = k3::ops::Numerics::F32;
  for (const fs::path& dir : {ours("tiny"), nano()}) {
    auto m = k3::Model::load(dir.string());
    for (int64_t N : {int64_t(8), dir == nano() ? int64_t(0) : int64_t(32)}) {
      if (N == 0) continue;  // K3-nano at 32 sequences takes minutes under the sanitizers
      const auto seqs = k3test::mixed_sequences(N, int32_t(m->dims().vocab), uint32_t(N));
      auto pool = m->new_pool();
      const auto batched = k3test::run_batched(*m, seqs, o, *pool);
      double worst = 0;
      for (size_t i = 0; i < seqs.size(); ++i)
        worst = std::max(worst, k3test::rel_l2(batched[i], k3test::run_alone(*m, seqs[i], o)));
      std::printf("%s N=%lld fp32: worst rel-L2 batched vs alone %.3g\n", dir.filename().c_str(), (long long)N, worst);
      EXPECT_EQ(pool->live_slots(), 0);
    }
  }
}
}  // namespace

// Kimi Linear (plain residual, experts in the hidden space, low-rank KDA gates, MLA with q_proj):
// the same batch == alone gate on its tiny fixture.
TEST(BatchEquivalenceKimiLinear, EightSequences) {
  auto m = k3::Model::load(ours("kl-tiny").string());
  const auto seqs = k3test::mixed_sequences(8, int32_t(m->dims().vocab), 11);
  auto pool = m->new_pool();
  const auto batched = k3test::run_batched(*m, seqs, {}, *pool);
  for (size_t i = 0; i < seqs.size(); ++i)
    EXPECT_LE(k3test::rel_l2(batched[i], k3test::run_alone(*m, seqs[i], {})), kBatchTol) << "sequence " << i;
  EXPECT_EQ(pool->live_slots(), 0);
}
