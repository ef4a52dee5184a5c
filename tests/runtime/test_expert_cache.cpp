// Memory tiers (--ram-budget) at the library level: a forward whose routed experts stream through
// an ExpertCache far smaller than the experts (down to exactly the minimum, buffered and O_DIRECT)
// gives logits bitwise identical (memcmp) to the resident forward, over prefill chunks and
// incremental decode, on tests/fixtures/tiny and models/k3-nano (both MXFP4 experts); the read
// counters match the distinct experts fetched, byte for byte; budgets too small, short reads and
// shards that changed size are one-line errors; prefault can leave the experts untouched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "common/error_util.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "runtime/expert_cache.h"

namespace fs = std::filesystem;
using k3test::error_of_call;

namespace {

fs::path tiny_dir() { return fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny"; }
fs::path nano_dir() { return fs::path(K3_SOURCE_DIR) / "models/k3-nano"; }

const k3::Model& tiny() {
  static k3::Model* m = k3::Model::load(tiny_dir().string()).release();
  return *m;
}

std::vector<int32_t> random_ids(uint32_t seed, size_t n, int64_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Prefill `ids` in `chunks` (all logits of every chunk), then feed `decode` more tokens one at a
// time (logits of each). Returns every logit row produced, in order.
std::vector<float> run_forward(const k3::Model& m, const std::vector<int32_t>& ids, const std::vector<int64_t>& chunks,
                               const std::vector<int32_t>& decode, k3::ExpertSource* src) {
  k3::Session s(m);
  k3::ForwardOptions opt;
  opt.experts = src;
  const int64_t V = m.dims().vocab;
  std::vector<float> all;
  size_t at = 0;
  for (int64_t c : chunks) {
    std::vector<float> l(static_cast<size_t>(c * V));
    m.forward(s, ids.data() + at, c, true, l.data(), opt);
    all.insert(all.end(), l.begin(), l.end());
    at += size_t(c);
  }
  EXPECT_EQ(at, ids.size());
  for (int32_t id : decode) {
    std::vector<float> l(static_cast<size_t>(V));
    m.forward(s, &id, 1, false, l.data(), opt);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

void expect_bitwise_equal(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

// Tensor bytes of one routed expert, from the checkpoint's names (independent of the cache).
uint64_t expert_bytes_by_name(const k3::Model& m, int64_t layer, int32_t e) {
  uint64_t n = 0;
  const std::string p =
      "language_model.model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(e) + ".";
  for (const char* w : {"w1", "w2", "w3"})
    for (const char* suffix : {".weight_packed", ".weight_scale", ".weight"})
      if (const k3::TensorView* t = m.checkpoint().find(p + w + suffix)) n += t->nbytes;
  return n;
}

int64_t moe_layers(const k3::Model& m) {
  int64_t n = 0;
  for (const auto& l : m.layers) n += l.dense_ffn ? 0 : 1;
  return n;
}

// Passes fetches through to a cache and records them, with the counters' change per fetch.
struct Recorder : k3::ExpertSource {
  explicit Recorder(k3::ExpertCache& c) : cache(c) {}
  struct Fetch {
    int64_t layer;
    std::vector<int32_t> ids;
    k3::ExpertCacheStats delta;
  };
  void fetch(int64_t layer, const int32_t* ids, int64_t n, const k3::GluWeights** out) override {
    const auto before = cache.stats();
    cache.fetch(layer, ids, n, out);
    log.push_back({layer, std::vector<int32_t>(ids, ids + n), cache.stats() - before});
  }
  int64_t max_batch() const override { return cache.max_batch(); }
  k3::ExpertCache& cache;
  std::vector<Fetch> log;
};

}  // namespace

TEST(ExpertCache, TinyHasMxfp4ExpertsAndTheFixtureShape) {
  const auto& m = tiny();
  const auto& e = m.layers[1].moe.experts[0];
  EXPECT_EQ(e.gate.fmt, k3::WFormat::MXFP4);
  EXPECT_EQ(e.down.fmt, k3::WFormat::MXFP4);
  k3::ExpertCache c(m, {uint64_t(1) << 30, false});
  EXPECT_EQ(c.expert_count(), moe_layers(m) * m.dims().moe.experts);
  uint64_t by_name = 0;
  for (int64_t L = 0; L < m.dims().layers; ++L)
    if (!m.layers[size_t(L)].dense_ffn)
      for (int32_t x = 0; x < m.dims().moe.experts; ++x) by_name += expert_bytes_by_name(m, L, x);
  EXPECT_EQ(c.expert_bytes(), by_name);
  const auto totals = k3::expert_tensor_totals(m.checkpoint());
  EXPECT_EQ(totals.expert_bytes, by_name);
  EXPECT_EQ(totals.trunk_bytes + totals.expert_bytes, m.checkpoint().total_tensor_bytes());
  EXPECT_EQ(totals.experts, c.expert_count());
  EXPECT_EQ(c.max_batch(), c.expert_count());  // 1 GiB holds them all
}

TEST(ExpertCache, StreamedLogitsAreBitwiseIdenticalToResident) {
  const auto& m = tiny();
  const auto ids = random_ids(5, 41, m.dims().vocab);
  const auto dec = random_ids(6, 9, m.dims().vocab);
  const std::vector<int64_t> chunks = {16, 1, 17, 7};
  const auto ref = run_forward(m, ids, chunks, dec, nullptr);
  const int64_t top_k = m.dims().moe.top_k;
  for (bool direct : {false, true}) {
    const uint64_t slot = k3::ExpertCache::slot_bytes_for(m, direct);
    // Exactly the minimum (top_k slots), one more, and a mid size; all far below the experts' bytes.
    for (int64_t slots : {top_k, top_k + 1, int64_t(11)}) {
      std::unique_ptr<k3::ExpertCache> c;
      try {
        c = std::make_unique<k3::ExpertCache>(m, k3::ExpertCacheOptions{uint64_t(slots) * slot, direct});
      } catch (const k3::Error& e) {
        if (direct && std::string(e.what()).find("direct I/O") != std::string::npos) GTEST_SKIP() << e.what();
        throw;
      }
      ASSERT_EQ(c->max_batch(), slots);
      ASSERT_LT(c->capacity_bytes() * 3, c->expert_bytes());
      const auto got = run_forward(m, ids, chunks, dec, c.get());
      expect_bitwise_equal(ref, got, "direct=" + std::to_string(direct) + " slots=" + std::to_string(slots));
      const auto st = c->stats();
      EXPECT_GT(st.misses, 0u);
      EXPECT_GT(st.evictions, 0u);  // the cache really was too small to hold the experts
      EXPECT_LE(c->allocated_bytes(), uint64_t(slots) * slot);
    }
  }
}

TEST(ExpertCache, EachDistinctExpertReadOncePerCallAndBytesMatch) {
  const auto& m = tiny();
  const int64_t E = m.dims().moe.experts;
  const auto ids = random_ids(7, 30, m.dims().vocab);
  const auto dec = random_ids(8, 4, m.dims().vocab);
  const auto ref = run_forward(m, ids, {30}, dec, nullptr);

  // A cache that holds everything: one fetch per MoE call with the call's whole union; every
  // (layer, expert) is read once over the run, and bytes_read is exactly those experts' bytes.
  {
    k3::ExpertCache c(m, {uint64_t(1) << 30, false});
    Recorder rec(c);
    expect_bitwise_equal(ref, run_forward(m, ids, {30}, dec, &rec), "large cache");
    EXPECT_EQ(int64_t(rec.log.size()), moe_layers(m) * (1 + int64_t(dec.size())));
    std::set<std::pair<int64_t, int32_t>> seen;
    uint64_t expect_bytes = 0, expect_misses = 0, expect_hits = 0;
    for (const auto& f : rec.log) {
      uint64_t fetch_bytes = 0, fetch_misses = 0;
      std::set<int32_t> distinct(f.ids.begin(), f.ids.end());
      EXPECT_EQ(distinct.size(), f.ids.size()) << "an expert asked for twice in one fetch";
      for (int32_t e : f.ids) {
        if (seen.insert({f.layer, e}).second) {
          fetch_bytes += expert_bytes_by_name(m, f.layer, e);
          ++fetch_misses;
        } else {
          ++expect_hits;
        }
      }
      EXPECT_EQ(f.delta.bytes_read, fetch_bytes) << "layer " << f.layer;
      EXPECT_EQ(f.delta.misses, fetch_misses);
      expect_bytes += fetch_bytes;
      expect_misses += fetch_misses;
    }
    const auto st = c.stats();
    EXPECT_EQ(st.bytes_read, expect_bytes);
    EXPECT_EQ(st.misses, expect_misses);
    EXPECT_EQ(st.hits, expect_hits);
    EXPECT_EQ(st.evictions, 0u);
    EXPECT_EQ(st.reads, st.misses);  // each tiny expert's six tensors are adjacent: one read
    EXPECT_EQ(st.fetches, uint64_t(rec.log.size()));
    // The 30-token prefill selects several experts per layer, all in its first fetch per layer.
    EXPECT_GT(rec.log[0].ids.size(), size_t(m.dims().moe.top_k));
  }

  // The minimum cache: a call's union comes in batches of at most top_k, each distinct expert of
  // the call exactly once (ascending), and every miss reads exactly that expert's bytes.
  {
    const int64_t k = m.dims().moe.top_k;
    k3::ExpertCache c(m, {uint64_t(k) * k3::ExpertCache::slot_bytes_for(m, false), false});
    Recorder rec(c);
    expect_bitwise_equal(ref, run_forward(m, ids, {30}, dec, &rec), "minimum cache");
    uint64_t expect_bytes = 0;
    std::vector<int32_t> call;  // ids of the current MoE call (consecutive fetches of one layer)
    int64_t call_layer = -1;
    for (const auto& f : rec.log) {
      EXPECT_LE(int64_t(f.ids.size()), k);
      if (f.layer != call_layer) call.clear();
      call_layer = f.layer;
      for (int32_t e : f.ids) {
        EXPECT_TRUE(call.empty() || e > call.back()) << "expert " << e << " of layer " << f.layer << " fetched twice";
        call.push_back(e);
      }
      ASSERT_EQ(f.delta.hits + f.delta.misses, f.ids.size());
      expect_bytes += f.delta.misses * expert_bytes_by_name(m, f.layer, f.ids[0]);  // all tiny experts are equal
      EXPECT_EQ(f.delta.bytes_read, f.delta.misses * expert_bytes_by_name(m, f.layer, f.ids[0]));
    }
    EXPECT_EQ(c.stats().bytes_read, expect_bytes);
    EXPECT_GT(c.stats().evictions, 0u);
    (void)E;
  }
}

TEST(ExpertCache, K3NanoStreamedEqualsResident) {
  if (!fs::exists(nano_dir() / "config.json")) GTEST_SKIP() << "models/k3-nano is absent";
  const auto m = k3::Model::load(nano_dir().string());
  ASSERT_EQ(m->layers[1].moe.experts[0].gate.fmt, k3::WFormat::MXFP4);
  const auto ids = random_ids(9, 24, m->dims().vocab);
  const auto dec = random_ids(10, 4, m->dims().vocab);
  const std::vector<int64_t> chunks = {13, 11};
  const auto ref = run_forward(*m, ids, chunks, dec, nullptr);
  const int64_t k = m->dims().moe.top_k;
  k3::ExpertCache c(*m, {uint64_t(k) * k3::ExpertCache::slot_bytes_for(*m, false), false});
  ASSERT_LT(c.capacity_bytes() * 10, c.expert_bytes());
  expect_bitwise_equal(ref, run_forward(*m, ids, chunks, dec, &c), "k3-nano at the minimum cache");
  EXPECT_GT(c.stats().evictions, 0u);
}

TEST(ExpertCache, BudgetsBelowTheMinimumAreOneLineErrors) {
  const auto& m = tiny();
  const int64_t k = m.dims().moe.top_k;
  const uint64_t slot = k3::ExpertCache::slot_bytes_for(m, false);
  const std::string e1 = error_of_call([&] { k3::ExpertCache c(m, {uint64_t(k) * slot - 1, false}); });
  EXPECT_NE(e1.find("cannot hold the " + std::to_string(k) + " experts"), std::string::npos) << e1;
  EXPECT_EQ(e1.find('\n'), std::string::npos);

  const auto totals = k3::expert_tensor_totals(m.checkpoint());
  const uint64_t least = totals.trunk_bytes + uint64_t(k) * slot;
  EXPECT_NE(k3::make_budget_expert_cache(m, least, false), nullptr);
  EXPECT_EQ(k3::make_budget_expert_cache(m, least, false)->max_batch(), k);
  const std::string e2 = error_of_call([&] { k3::make_budget_expert_cache(m, least - 1, false); });
  EXPECT_NE(e2.find("--ram-budget"), std::string::npos) << e2;
  EXPECT_NE(e2.find("too small"), std::string::npos) << e2;
  EXPECT_NE(e2.find(std::to_string(least) + " bytes"), std::string::npos) << e2;
  EXPECT_EQ(e2.find('\n'), std::string::npos);
  const std::string e3 = error_of_call([&] { k3::make_budget_expert_cache(m, totals.trunk_bytes / 2, false); });
  EXPECT_NE(e3.find("resident trunk"), std::string::npos) << e3;

  // Bad requests of the interface are errors too, never crashes.
  k3::ExpertCache c(m, {uint64_t(k) * slot, false});
  const k3::GluWeights* out[4] = {};
  const int32_t bad_id[1] = {int32_t(m.dims().moe.experts)};
  EXPECT_NE(error_of_call([&] { c.fetch(1, bad_id, 1, out); }).find("outside"), std::string::npos);
  const int32_t one[1] = {0};
  EXPECT_NE(error_of_call([&] { c.fetch(0, one, 1, out); }).find("no routed experts"),
            std::string::npos);  // dense layer 0
  const int32_t twice[2] = {2, 2};
  EXPECT_NE(error_of_call([&] { c.fetch(1, twice, 2, out); }).find("twice"), std::string::npos);
  const int32_t many[4] = {0, 1, 2, 3};
  EXPECT_NE(error_of_call([&] { c.fetch(1, many, 4, out); }).find("exceeds"), std::string::npos);
}

TEST(ExpertCache, ShortReadsAndChangedShardsAreOneLineErrors) {
  // A private copy of tiny whose expert shard is cut short after the cache was made (short read),
  // or before (changed size at construction). Only the cache reads it: the mapping is not touched.
  const fs::path dir = fs::temp_directory_path() / ("k3ec_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(tiny_dir(), dir);
  const auto m = k3::Model::load(dir.string());
  const auto loc =
      m->checkpoint().locate(static_cast<const uint8_t*>(m->layers.back().moe.experts.back().down.data), 1);
  ASSERT_TRUE(loc.has_value());
  const int64_t k = m->dims().moe.top_k;
  for (bool direct : {false, true}) {
    k3::ExpertCache c(*m, {uint64_t(k) * k3::ExpertCache::slot_bytes_for(*m, direct), direct});
    fs::resize_file(loc->path, loc->offset);  // the last expert's w2 is gone
    const k3::GluWeights* out[1] = {};
    const int32_t last[1] = {int32_t(m->dims().moe.experts - 1)};
    const std::string e = error_of_call([&] { c.fetch(m->dims().layers - 1, last, 1, out); });
    EXPECT_NE(e.find("short read"), std::string::npos) << e;
    EXPECT_NE(e.find("changed size"), std::string::npos) << e;
    EXPECT_NE(e.find(loc->path), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos);
    // Other experts (layer 1's are in the other shard or before the cut) still read fine.
    const auto l1 = m->checkpoint().locate(static_cast<const uint8_t*>(m->layers[1].moe.experts[0].gate.data), 1);
    ASSERT_TRUE(l1->path != loc->path || l1->offset < loc->offset);
    const int32_t first[1] = {0};
    c.fetch(1, first, 1, out);
    const k3::WeightMat& want = tiny().layers[1].moe.experts[0].gate;  // the untouched fixture
    EXPECT_EQ(std::memcmp(out[0]->gate.data, want.data, size_t(want.rows * want.cols / 2)), 0);
    const std::string e2 = error_of_call([&] { k3::ExpertCache c2(*m, {uint64_t(1) << 20, direct}); });
    EXPECT_NE(e2.find("changed size"), std::string::npos) << e2;
    fs::resize_file(loc->path, loc->file_size);  // restore the size for the next round (zeros: unread)
  }
  fs::remove_all(dir);
}

TEST(ExpertCache, PrefaultCanSkipTheExperts) {
  const auto& m = tiny();
  const auto totals = k3::expert_tensor_totals(m.checkpoint());
  uint64_t last_total = 0, calls = 0;
  m.checkpoint().prefault([&](uint64_t, uint64_t total) { last_total = total, ++calls; }, k3::is_routed_expert_tensor);
  EXPECT_GT(calls, 0u);
  // Headers and the trunk only (the fixture's tensors are packed back to back).
  EXPECT_EQ(last_total, m.checkpoint().mapped_bytes() - totals.expert_bytes);
  m.checkpoint().prefault([&](uint64_t, uint64_t total) { last_total = total; });
  EXPECT_EQ(last_total, m.checkpoint().mapped_bytes());
  // locate() by name and by address agree with the view.
  const std::string n = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale";
  const auto a = m.checkpoint().locate(n);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->nbytes, m.checkpoint().find(n)->nbytes);
  EXPECT_FALSE(m.checkpoint().locate("no.such.tensor").has_value());
  const auto b = m.checkpoint().locate(m.layers[1].moe.experts[3].down.scales, a->nbytes);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(a->offset, b->offset);
  EXPECT_EQ(a->path, b->path);
  EXPECT_TRUE(k3::is_routed_expert_tensor(n));
  EXPECT_FALSE(
      k3::is_routed_expert_tensor("language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"));
  EXPECT_FALSE(k3::is_routed_expert_tensor("language_model.model.layers.1.block_sparse_moe.gate.weight"));
}
