// Tests for the token sampler (src/runtime/sampler.*): greedy, top-k / top-p / min-p cutoffs, the
// penalties and their window, the portable RNG (golden values), seed determinism, validation
// messages, generation_config.json defaults, and sample() against distribution() statistically.
// Must not: take expectations from the code under test. They are hand-computed, or come from the
// naive reference below (full sort, written straight from the order in sampler.h).
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/error_util.h"
#include "core/error.h"
#include "runtime/sampler.h"

namespace {

namespace fs = std::filesystem;
using k3::Sampler;
using k3::SamplingParams;
using Dist = std::vector<std::pair<int32_t, double>>;

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

// Uniform in [lo, hi) from std::mt19937_64's raw stream (the engine is specified by the standard,
// unlike std:: distributions), never exactly zero: "random non-zero inputs".
std::vector<float> random_logits(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 g(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    const double u = static_cast<double>(g() >> 11) * 0x1.0p-53;
    x = static_cast<float>(lo + (hi - lo) * u);
    if (x == 0.0f) x = 0.125f;
  }
  return v;
}

// The k3::Error message of f(), or a test failure when f() throws nothing or something else.
template <class F>
std::string error_of(F&& f) {
  return k3test::error_of_call(std::forward<F>(f));
}

std::set<int32_t> ids_of(const Dist& d) {
  std::set<int32_t> s;
  for (const auto& [id, p] : d) s.insert(id);
  return s;
}

// Naive reference of the whole pipeline, straight from the documented order, with a full sort.
Dist reference(const std::vector<float>& logits, const SamplingParams& p, const std::vector<int32_t>& history) {
  const size_t V = logits.size();
  std::vector<double> z(logits.begin(), logits.end());
  // 1. penalties over the window
  size_t first = 0;
  if (p.penalty_last_n == 0)
    first = history.size();
  else if (p.penalty_last_n > 0 && history.size() > size_t(p.penalty_last_n))
    first = history.size() - p.penalty_last_n;
  std::map<int32_t, int> counts;
  for (size_t i = first; i < history.size(); ++i) counts[history[i]]++;
  for (const auto& [t, c] : counts) {
    double x = z[t];
    x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    z[t] = x - p.presence_penalty - double(p.frequency_penalty) * c;
  }
  // 2. greedy
  if (p.temperature == 0.0f) {
    size_t best = 0;
    for (size_t i = 1; i < V; ++i)
      if (z[i] > z[best]) best = i;
    return {{int32_t(best), 1.0}};
  }
  // 3-4. temperature, full sort, top-k
  std::vector<int32_t> ids;
  for (size_t i = 0; i < V; ++i)
    if (z[i] != -INFINITY) {
      z[i] /= p.temperature;
      ids.push_back(int32_t(i));
    }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  if (p.top_k > 0 && size_t(p.top_k) < ids.size()) ids.resize(p.top_k);
  // 5. softmax
  double S = 0;
  for (int32_t i : ids) S += std::exp(z[i] - z[ids[0]]);
  Dist d;
  for (int32_t i : ids) d.emplace_back(i, std::exp(z[i] - z[ids[0]]) / S);
  // 6. top-p (slack 1e-6 as documented)
  if (p.top_p < 1.0f) {
    double cum = 0;
    size_t keep = d.size();
    for (size_t i = 0; i < d.size(); ++i) {
      cum += d[i].second;
      if (cum >= double(p.top_p) - 1e-6) {
        keep = i + 1;
        break;
      }
    }
    d.resize(keep);
  }
  // 7. min-p
  const double pmax = d[0].second;
  std::erase_if(d, [&](const auto& e) { return e.second < (double(p.min_p) - 1e-6) * pmax; });
  // 8. renormalize
  double T = 0;
  for (auto& e : d) T += e.second;
  for (auto& e : d) e.second /= T;
  return d;
}

void expect_same_dist(const Dist& got, const Dist& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << "rank " << i;
    EXPECT_NEAR(got[i].second, want[i].second, tol) << "token " << got[i].first;
  }
}

// Pearson chi-square of `draws` samples against `d`, and the bound it must stay under: the upper
// 0.1% point of chi-square with df = cells - 1 (Wilson-Hilferty approximation, z = 3.090). With a
// fixed seed the test is deterministic; the bound says how far off the sampler may be.
struct ChiSquare {
  double stat = 0, bound = 0;
  int df = 0;
};
ChiSquare chi_square(const Dist& d, const std::map<int32_t, int>& counts, int draws) {
  ChiSquare r;
  for (const auto& [id, p] : d) {
    const double expect = p * draws;
    const auto it = counts.find(id);
    const double got = it == counts.end() ? 0 : it->second;
    r.stat += (got - expect) * (got - expect) / expect;
  }
  r.df = int(d.size()) - 1;
  const double k = r.df, z = 3.090;
  r.bound = k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
  return r;
}

// ------------------------------------------------------------------------------------------ RNG

TEST(SamplerRng, GoldenOutputsSeed42) {
  // From the definitions (splitmix64 seeding four words, then xoshiro256**), evaluated by hand in
  // arbitrary-precision integers. Seeded state: bdd732262feb6e95 28efe333b266f103 47526757130f9f52
  // 581ce1ff0e4ae394. (Sanity of the splitmix64 constants: its first output from 0 is e220a8397b1dcdaf.)
  k3::Rng r(42);
  EXPECT_EQ(r.next_u64(), 0x15780b2e0c2ec716ULL);
  EXPECT_EQ(r.next_u64(), 0x6104d9866d113a7eULL);
  EXPECT_EQ(r.next_u64(), 0xae17533239e499a1ULL);
  EXPECT_EQ(r.next_u64(), 0xecb8ad4703b360a1ULL);
  EXPECT_EQ(r.next_u64(), 0xfde6dc7fe2ec5e64ULL);
  // next_double = top 53 bits * 2^-53, exactly.
  k3::Rng d(42);
  EXPECT_EQ(d.next_double(), double(0x15780b2e0c2ec716ULL >> 11) * 0x1.0p-53);
  EXPECT_EQ(d.next_double(), 0.3789802506626686);
  // reseed restarts the stream.
  d.reseed(42);
  EXPECT_EQ(d.next_u64(), 0x15780b2e0c2ec716ULL);
}

TEST(SamplerRng, UniformInUnitInterval) {
  k3::Rng r(7);
  double sum = 0, lo = 1, hi = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double u = r.next_double();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  // Mean of n uniforms has sd 1/sqrt(12 n) = 6.5e-4; 5 sd.
  EXPECT_NEAR(sum / n, 0.5, 5 * 6.5e-4);
  EXPECT_LT(lo, 1e-4);
  EXPECT_GT(hi, 1 - 1e-4);
}

// Golden draw rule: probabilities 0.5, 0.3, 0.15, 0.05 occupy [0,.5) [.5,.8) [.8,.95) [.95,1) in
// ascending id order; seed 42's uniforms 0.0839 0.3790 0.6800 0.9247 0.9918 give tokens 0 0 1 2 3.
TEST(SamplerRng, GoldenTokensSeed42) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.seed = 42;
  Sampler s(p, 4);
  std::vector<int32_t> got;
  for (int i = 0; i < 5; ++i) got.push_back(s.sample(logits.data()));
  EXPECT_EQ(got, (std::vector<int32_t>{0, 0, 1, 2, 3}));
}

// ---------------------------------------------------------------------------------------- greedy

TEST(SamplerGreedy, ArgmaxWithLowestIdOnTies) {
  auto logits = random_logits(1000, 1, -5, 5);
  const int32_t want = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  SamplingParams p;
  p.temperature = 0;
  p.top_k = 3;  // filters do not matter to greedy
  p.top_p = 0.5f;
  Sampler s(p, 1000);
  EXPECT_EQ(s.sample(logits.data()), want);
  const Dist d = s.distribution(logits.data());
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].first, want);
  EXPECT_EQ(d[0].second, 1.0);

  logits[700] = 9.5f;
  logits[123] = 9.5f;
  logits[900] = 9.5f;
  EXPECT_EQ(s.sample(logits.data()), 123);
  logits[0] = kNegInfF;  // -inf is fine, just never chosen
  EXPECT_EQ(s.sample(logits.data()), 123);
}

TEST(SamplerGreedy, PenaltiesChangeTheWinner) {
  auto logits = random_logits(50, 2, -1, 1);
  logits[5] = 3.0f;
  logits[9] = 2.5f;
  SamplingParams p;
  p.temperature = 0;
  {
    Sampler s(p, 50);
    s.accept(5);  // default penalties are off
    EXPECT_EQ(s.sample(logits.data()), 5);
  }
  p.repetition_penalty = 2.0f;  // 3.0 -> 1.5 < 2.5
  {
    Sampler s(p, 50);
    EXPECT_EQ(s.sample(logits.data()), 5);
    s.accept(5);
    EXPECT_EQ(s.sample(logits.data()), 9);
    EXPECT_EQ(s.distribution(logits.data())[0].first, 9);
    s.reset();
    EXPECT_EQ(s.sample(logits.data()), 5);
  }
  p.repetition_penalty = 1.0f;
  p.presence_penalty = 0.75f;  // 3.0 -> 2.25 < 2.5
  {
    Sampler s(p, 50);
    s.accept(5);
    EXPECT_EQ(s.sample(logits.data()), 9);
  }
  p.presence_penalty = 0;
  p.frequency_penalty = 0.2f;  // once: 2.8 (still wins); three times: 2.4 < 2.5
  {
    Sampler s(p, 50);
    s.accept(5);
    EXPECT_EQ(s.sample(logits.data()), 5);
    s.accept(5);
    s.accept(5);
    EXPECT_EQ(s.sample(logits.data()), 9);
  }
}

// ---------------------------------------------------------------------------------------- top-k

TEST(SamplerTopK, OnlyTopFiveOverManyDrawsAndFrequenciesMatch) {
  const int V = 2000, draws = 20000;
  const auto logits = random_logits(V, 3, -3, 3);
  std::vector<int32_t> order(V);
  for (int i = 0; i < V; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const std::set<int32_t> top5(order.begin(), order.begin() + 5);

  SamplingParams p;
  p.top_k = 5;
  p.seed = 11;
  Sampler s(p, V);
  const Dist d = s.distribution(logits.data());
  ASSERT_EQ(ids_of(d), top5);
  // Softmax over the five raw logits (temperature 1), computed here.
  double S = 0;
  for (int32_t i : top5) S += std::exp(double(logits[i]));
  for (const auto& [id, prob] : d) EXPECT_NEAR(prob, std::exp(double(logits[id])) / S, 1e-12);

  const auto before = logits;
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) {
    const int32_t t = s.sample(logits.data());
    ASSERT_TRUE(top5.count(t)) << "token " << t << " is outside the top 5 (draw " << i << ")";
    counts[t]++;
  }
  EXPECT_EQ(logits, before) << "sample() modified the logits";
  EXPECT_EQ(counts.size(), 5u) << "every top-5 token appears";
  const ChiSquare c = chi_square(d, counts, draws);
  EXPECT_LT(c.stat, c.bound) << "chi-square " << c.stat << " df " << c.df;
}

TEST(SamplerTopK, BoundaryTiesGoToLowerIdAndInfIsNeverKept) {
  // Values 1 3 2 2 2 0.5: k = 3 keeps 1 (3.0) and the two lowest ids among the tied 2.0s: 2 and 3.
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 2.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.top_k = 3;
  Sampler s(p, 6);
  EXPECT_EQ(ids_of(s.distribution(logits.data())), (std::set<int32_t>{1, 2, 3}));
  // Equal probabilities list lower ids first.
  const Dist d = s.distribution(logits.data());
  EXPECT_EQ(d[1].first, 2);
  EXPECT_EQ(d[2].first, 3);

  // Same rule on the bounded-heap path (small k against a larger vocabulary): 64 tokens, ids 10..63
  // all tied at 1.0, ids 0..9 lower; k = 4 keeps 10, 11, 12, 13.
  std::vector<float> flat(64, 1.0f);
  for (int i = 0; i < 10; ++i) flat[i] = 0.5f;
  p.top_k = 4;
  Sampler s_heap(p, 64);
  EXPECT_EQ(ids_of(s_heap.distribution(flat.data())), (std::set<int32_t>{10, 11, 12, 13}));
  flat[40] = 1.5f;  // a new best displaces the highest tied id
  EXPECT_EQ(ids_of(s_heap.distribution(flat.data())), (std::set<int32_t>{10, 11, 12, 40}));

  // k larger than the possible tokens keeps every possible token and no -inf one.
  const std::vector<float> sparse = {kNegInfF, 0.5f, kNegInfF, -0.5f};
  p.top_k = 3;
  Sampler s2(p, 4);
  EXPECT_EQ(ids_of(s2.distribution(sparse.data())), (std::set<int32_t>{1, 3}));
  for (int i = 0; i < 200; ++i) {
    const int32_t t = s2.sample(sparse.data());
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

// --------------------------------------------------------------------------------- top-p, min-p

// Probabilities 0.5 0.3 0.15 0.05 given as float log-probs (temperature 1, so softmax returns them
// up to float rounding). Expected values are recomputed here from the same float logits.
class SamplerCutoffs : public ::testing::Test {
 protected:
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};

  Dist dist(float top_p, float min_p, float temperature = 1.0f) const {
    SamplingParams p;
    p.top_p = top_p;
    p.min_p = min_p;
    p.temperature = temperature;
    return Sampler(p, 4).distribution(logits.data());
  }
  // Exact renormalized probabilities of `keep` (ids), in descending order.
  Dist expected(const std::vector<int32_t>& keep, float temperature = 1.0f) const {
    double S = 0;
    for (int32_t i : keep) S += std::exp(double(logits[i]) / temperature);
    Dist d;
    for (int32_t i : keep) d.emplace_back(i, std::exp(double(logits[i]) / temperature) / S);
    return d;
  }
};

TEST_F(SamplerCutoffs, TopP) {
  expect_same_dist(dist(0.8f, 0), expected({0, 1}), 1e-12);  // 0.5 + 0.3 reaches 0.8
  expect_same_dist(dist(0.81f, 0), expected({0, 1, 2}), 1e-12);
  expect_same_dist(dist(0.5f, 0), expected({0}), 1e-12);  // the first alone reaches 0.5
  expect_same_dist(dist(0.3f, 0), expected({0}), 1e-12);
  expect_same_dist(dist(0.95f, 0), expected({0, 1, 2}), 1e-12);
  expect_same_dist(dist(0.96f, 0), expected({0, 1, 2, 3}), 1e-12);
  expect_same_dist(dist(1.0f, 0), expected({0, 1, 2, 3}), 1e-12);
  const Dist one = dist(0.8f, 0);
  EXPECT_NEAR(one[0].second, 0.625, 1e-6);  // 0.5 / 0.8, up to the float log-probs
  EXPECT_NEAR(one[1].second, 0.375, 1e-6);
}

TEST_F(SamplerCutoffs, MinP) {
  expect_same_dist(dist(1, 0.2f), expected({0, 1, 2}), 1e-12);  // drops p < 0.1: only 0.05
  expect_same_dist(dist(1, 0.3f), expected({0, 1, 2}), 1e-12);  // 0.15 == 0.3 * 0.5 is kept
  expect_same_dist(dist(1, 0.31f), expected({0, 1}), 1e-12);
  expect_same_dist(dist(1, 0.6f), expected({0, 1}), 1e-12);  // 0.3 == 0.6 * 0.5 is kept
  expect_same_dist(dist(1, 0.61f), expected({0}), 1e-12);
  expect_same_dist(dist(1, 1.0f), expected({0}), 1e-12);
  expect_same_dist(dist(1, 0.09f), expected({0, 1, 2, 3}), 1e-12);
  expect_same_dist(dist(0.96f, 0.2f), expected({0, 1, 2}), 1e-12);  // both: min-p after top-p
  expect_same_dist(dist(0.8f, 0.1f), expected({0, 1}), 1e-12);
}

// Temperature comes before the filters: at T = 2 the probabilities are prop. to sqrt(p):
// 0.3791 0.2936 0.2076 0.1199. top-p 0.7 needs three tokens (it would need two before temperature)
// and min-p 0.2 keeps all four (0.1199 >= 0.0758; before temperature 0.05 < 0.1 would go).
TEST_F(SamplerCutoffs, TemperatureBeforeFilters) {
  expect_same_dist(dist(0.7f, 0, 2.0f), expected({0, 1, 2}, 2.0f), 1e-12);
  expect_same_dist(dist(1, 0.2f, 2.0f), expected({0, 1, 2, 3}, 2.0f), 1e-12);
  const Dist all = dist(1, 0, 2.0f);
  EXPECT_NEAR(all[0].second, std::sqrt(0.5) / (std::sqrt(0.5) + std::sqrt(0.3) + std::sqrt(0.15) + std::sqrt(0.05)),
              1e-6);
}

TEST_F(SamplerCutoffs, SampleStaysInsideTheCut) {
  SamplingParams p;
  p.top_p = 0.8f;
  p.seed = 5;
  Sampler s(p, 4);
  int seen[4] = {0, 0, 0, 0};
  for (int i = 0; i < 2000; ++i) seen[s.sample(logits.data())]++;
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_EQ(seen[2], 0);
  EXPECT_EQ(seen[3], 0);
}

// ------------------------------------------------------------------------------------ penalties

// Logits and penalties are binary fractions, so every expected value below is exact.
class SamplerPenalties : public ::testing::Test {
 protected:
  const std::vector<float> logits = {3.0f, -1.5f, 2.0f, -4.0f, 0.5f, 1.0f, -0.25f, 6.0f};
  const std::vector<int32_t> history = {0, 0, 1, 3, 3, 3};  // counts: 0 x2, 1 x1, 3 x3

  std::vector<double> run(float rp, float presence, float frequency, int32_t last_n) const {
    SamplingParams p;
    p.repetition_penalty = rp;
    p.presence_penalty = presence;
    p.frequency_penalty = frequency;
    p.penalty_last_n = last_n;
    Sampler s(p, 8);
    for (int32_t t : history) s.accept(t);
    return s.penalized_logits(logits.data());
  }
  std::vector<double> raw() const { return std::vector<double>(logits.begin(), logits.end()); }
};

TEST_F(SamplerPenalties, Repetition) {
  // CTRL: positive / rp, negative * rp, once per distinct token however often it occurred.
  auto want = raw();
  want[0] = 1.5;   // 3 / 2 (seen twice, applied once)
  want[1] = -3.0;  // -1.5 * 2
  want[3] = -8.0;  // -4 * 2
  EXPECT_EQ(run(2.0f, 0, 0, -1), want);
  // rp < 1 boosts: 3 / 0.5 = 6, -1.5 * 0.5 = -0.75.
  auto boost = raw();
  boost[0] = 6.0;
  boost[1] = -0.75;
  boost[3] = -2.0;
  EXPECT_EQ(run(0.5f, 0, 0, -1), boost);
}

TEST_F(SamplerPenalties, PresenceAndFrequency) {
  auto want = raw();
  want[0] = 3.0 - 0.5;  // presence once
  want[1] = -1.5 - 0.5;
  want[3] = -4.0 - 0.5;
  EXPECT_EQ(run(1, 0.5f, 0, -1), want);
  want = raw();
  want[0] = 3.0 - 0.25 * 2;
  want[1] = -1.5 - 0.25 * 1;
  want[3] = -4.0 - 0.25 * 3;
  EXPECT_EQ(run(1, 0, 0.25f, -1), want);
  // All three: repetition first, then presence + frequency * count.
  want = raw();
  want[0] = 1.5 - 0.5 - 0.5;    // 0.5
  want[1] = -3.0 - 0.5 - 0.25;  // -3.75
  want[3] = -8.0 - 0.5 - 0.75;  // -9.25
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, -1), want);
}

TEST_F(SamplerPenalties, Window) {
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 0), raw());  // 0: penalties off
  auto want = raw();                            // 2: window {3, 3}
  want[3] = -8.0 - 0.5 - 0.5;
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 2), want);
  want = raw();  // 4: window {1, 3, 3, 3}
  want[1] = -3.0 - 0.5 - 0.25;
  want[3] = -8.0 - 0.5 - 0.75;
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 4), want);
  want[0] = 1.5 - 0.5 - 0.25;  // 5: window {0, 1, 3, 3, 3}
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 5), want);
  want[0] = 1.5 - 0.5 - 0.5;  // 6 and more: everything, like -1
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 6), want);
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, 64), want);
  EXPECT_EQ(run(2.0f, 0.5f, 0.25f, -1), want);
}

TEST_F(SamplerPenalties, SlidingWindowResetAndDistribution) {
  SamplingParams p;
  p.frequency_penalty = 1.0f;
  p.penalty_last_n = 3;
  Sampler s(p, 8);
  const auto count_pen = [&](int32_t tok) { return double(logits[tok]) - s.penalized_logits(logits.data())[tok]; };
  for (int32_t t : {7, 7, 2}) s.accept(t);
  EXPECT_EQ(count_pen(7), 2.0);
  EXPECT_EQ(count_pen(2), 1.0);
  s.accept(4);  // window {7, 2, 4}
  EXPECT_EQ(count_pen(7), 1.0);
  s.accept(4);  // {2, 4, 4}
  s.accept(5);  // {4, 4, 5}
  EXPECT_EQ(count_pen(7), 0.0);
  EXPECT_EQ(count_pen(2), 0.0);
  EXPECT_EQ(count_pen(4), 2.0);
  EXPECT_EQ(count_pen(5), 1.0);
  // distribution() is the softmax of the penalized logits.
  const auto z = s.penalized_logits(logits.data());
  double S = 0;
  for (double x : z) S += std::exp(x);
  for (const auto& [id, prob] : s.distribution(logits.data())) EXPECT_NEAR(prob, std::exp(z[id]) / S, 1e-12);
  s.reset();
  EXPECT_EQ(s.penalized_logits(logits.data()), raw());
  // -inf stays -inf under every penalty.
  auto with_inf = logits;
  with_inf[6] = kNegInfF;
  s.accept(6);
  EXPECT_EQ(s.penalized_logits(with_inf.data())[6], -INFINITY);
}

// ------------------------------------------------------------------------------- determinism

std::vector<int32_t> generate(Sampler& s, int n, int V) {
  // A different random logit row per step; each emitted token is fed back, as the generation loop does.
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const auto logits = random_logits(V, 1000 + i, -4, 4);
    const int32_t t = s.sample(logits.data());
    s.accept(t);
    out.push_back(t);
  }
  return out;
}

TEST(SamplerDeterminism, SameSeedSameSequenceResetRestarts) {
  const int V = 512, N = 1000;
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 40;
  p.top_p = 0.95f;
  p.repetition_penalty = 1.1f;
  p.seed = 1234;
  Sampler a(p, V), b(p, V);
  for (int32_t t : {1, 2, 3}) {  // a "prompt"
    a.accept(t);
    b.accept(t);
  }
  const auto sa = generate(a, N, V), sb = generate(b, N, V);
  EXPECT_EQ(sa, sb);
  EXPECT_GT(std::set<int32_t>(sa.begin(), sa.end()).size(), 50u) << "the sequence is not degenerate";

  p.seed = 1235;
  Sampler c(p, V);
  for (int32_t t : {1, 2, 3}) c.accept(t);
  const auto sc = generate(c, N, V);
  int differ = 0;
  for (int i = 0; i < N; ++i) differ += sa[i] != sc[i];
  EXPECT_GT(differ, N / 2) << "different seeds should give mostly different tokens";

  a.reset();
  for (int32_t t : {1, 2, 3}) a.accept(t);
  EXPECT_EQ(generate(a, N, V), sa);
}

// ----------------------------------------------------------------------------------- validation

TEST(SamplerValidation, EachBadValueNamesItsFlag) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto err = [](auto edit) {
    SamplingParams p;
    edit(p);
    return error_of([&] { k3::validate_sampling(p); });
  };
  EXPECT_EQ(err([](SamplingParams& p) { p.top_p = 1.5f; }), "top-p must be in (0, 1], got 1.5");
  EXPECT_EQ(err([](SamplingParams& p) { p.top_p = 0; }), "top-p must be in (0, 1], got 0");
  EXPECT_EQ(err([&](SamplingParams& p) { p.top_p = nan; }), "top-p must be in (0, 1], got nan");
  EXPECT_EQ(err([](SamplingParams& p) { p.temperature = -0.5f; }),
            "temp must be a finite number >= 0 (0 = greedy), got -0.5");
  EXPECT_NE(err([&](SamplingParams& p) { p.temperature = inf; }).find("temp must be"), std::string::npos);
  EXPECT_NE(err([&](SamplingParams& p) { p.temperature = nan; }).find("temp must be"), std::string::npos);
  EXPECT_EQ(err([](SamplingParams& p) { p.top_k = -1; }),
            "top-k must be an integer in [0, 2147483647] (0 = off), got -1");
  EXPECT_EQ(err([](SamplingParams& p) { p.min_p = 1.25f; }), "min-p must be in [0, 1], got 1.25");
  EXPECT_EQ(err([](SamplingParams& p) { p.min_p = -0.1f; }), "min-p must be in [0, 1], got -0.1");
  EXPECT_EQ(err([](SamplingParams& p) { p.repetition_penalty = 0; }),
            "repeat-penalty must be a finite number > 0 (1 = off), got 0");
  EXPECT_NE(err([](SamplingParams& p) { p.repetition_penalty = -1; }).find("repeat-penalty"), std::string::npos);
  EXPECT_NE(err([&](SamplingParams& p) { p.repetition_penalty = inf; }).find("repeat-penalty"), std::string::npos);
  EXPECT_EQ(err([&](SamplingParams& p) { p.presence_penalty = nan; }),
            "presence-penalty must be a finite number (0 = off), got nan");
  EXPECT_EQ(err([&](SamplingParams& p) { p.frequency_penalty = -inf; }),
            "frequency-penalty must be a finite number (0 = off), got -inf");
  EXPECT_EQ(err([](SamplingParams& p) { p.penalty_last_n = -2; }),
            "repeat-last-n must be an integer >= -1 (-1 = all, 0 = off), got -2");

  // Boundaries are accepted; the constructor validates too.
  SamplingParams ok;
  ok.temperature = 0;
  ok.top_p = 1;
  ok.min_p = 1;
  ok.penalty_last_n = -1;
  ok.presence_penalty = -2;
  EXPECT_NO_THROW(k3::validate_sampling(ok));
  SamplingParams bad;
  bad.top_p = 2;
  EXPECT_NE(error_of([&] { Sampler s(bad, 10); }).find("top-p"), std::string::npos);
  EXPECT_EQ(error_of([] { Sampler s(SamplingParams{}, 0); }), "sampler: vocab must be in [1, 2147483647], got 0");
  Sampler s(SamplingParams{}, 10);
  EXPECT_EQ(error_of([&] { s.accept(10); }), "sampler: accepted token 10 is outside the vocabulary [0, 10)");
  EXPECT_NE(error_of([&] { s.accept(-1); }).find("outside the vocabulary"), std::string::npos);
}

TEST(SamplerValidation, BadLogits) {
  auto logits = random_logits(100, 4, -2, 2);
  Sampler s(SamplingParams{}, 100);
  SamplingParams greedy;
  greedy.temperature = 0;
  Sampler g(greedy, 100);
  logits[17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(error_of([&] { s.sample(logits.data()); }), "sampler: logits contain NaN at token 17");
  EXPECT_EQ(error_of([&] { s.distribution(logits.data()); }), "sampler: logits contain NaN at token 17");
  EXPECT_EQ(error_of([&] { g.sample(logits.data()); }), "sampler: logits contain NaN at token 17");
  logits[17] = 1.0f;
  logits[42] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(error_of([&] { s.sample(logits.data()); }), "sampler: logits contain +inf at token 42");
  std::vector<float> none(100, kNegInfF);
  EXPECT_NE(error_of([&] { s.sample(none.data()); }).find("every logit is -inf"), std::string::npos);
  EXPECT_NE(error_of([&] { g.sample(none.data()); }).find("every logit is -inf"), std::string::npos);
  none[63] = -1e30f;  // one possible token: always drawn
  EXPECT_EQ(s.sample(none.data()), 63);
  EXPECT_EQ(g.sample(none.data()), 63);
}

// ------------------------------------------------------------------------- generation_config.json

class SamplerGenConfig : public ::testing::Test {
 protected:
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("k3_sampler_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  void write(const std::string& text) const { std::ofstream(dir / "generation_config.json") << text; }
  std::string file() const { return (dir / "generation_config.json").string(); }
};

TEST_F(SamplerGenConfig, AbsentFileGivesDefaults) {
  std::string src;
  const SamplingParams p = k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(src, "built-in defaults");
  const SamplingParams d;
  EXPECT_EQ(p.temperature, d.temperature);
  EXPECT_EQ(p.top_k, d.top_k);
  EXPECT_EQ(p.top_p, d.top_p);
  EXPECT_EQ(p.min_p, d.min_p);
  EXPECT_EQ(p.repetition_penalty, d.repetition_penalty);
  EXPECT_EQ(p.penalty_last_n, d.penalty_last_n);
  EXPECT_NO_THROW(k3::sampling_defaults_from_dir(dir.string()));  // source is optional
}

TEST_F(SamplerGenConfig, ValidFile) {
  write(R"({"_from_model_config": true, "bos_token_id": 1, "eos_token_id": [2, 3], "max_new_tokens": 512,
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.05,
            "presence_penalty": 0.25, "frequency_penalty": -0.5, "transformers_version": "4.56.0"})");
  std::string src;
  const SamplingParams p = k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(p.temperature, 0.6f);
  EXPECT_EQ(p.top_p, 0.95f);
  EXPECT_EQ(p.top_k, 20);
  EXPECT_EQ(p.min_p, 0.01f);
  EXPECT_EQ(p.repetition_penalty, 1.05f);
  EXPECT_EQ(p.presence_penalty, 0.25f);
  EXPECT_EQ(p.frequency_penalty, -0.5f);
  EXPECT_EQ(p.penalty_last_n, 64);  // not a generation_config key
  EXPECT_EQ(src,
            "generation_config.json (temperature, top_k, top_p, min_p, repetition_penalty, "
            "presence_penalty, frequency_penalty)");

  write(R"({"temperature": 0.7, "top_p": 0.8, "top_k": null})");  // null = unset
  const SamplingParams q = k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(src, "generation_config.json (temperature, top_p)");
  EXPECT_EQ(q.top_k, 0);

  write(R"({"eos_token_id": 2})");
  k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(src, "built-in defaults (generation_config.json has no sampling keys)");
}

TEST_F(SamplerGenConfig, DoSample) {
  write(R"({"do_sample": false, "temperature": 0.7, "top_p": 0.9})");
  std::string src;
  SamplingParams p = k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(p.temperature, 0.0f);
  EXPECT_EQ(p.top_p, 0.9f);
  EXPECT_EQ(src, "generation_config.json (temperature, top_p, do_sample=false)");
  write(R"({"do_sample": true, "temperature": 0.7})");
  p = k3::sampling_defaults_from_dir(dir.string(), &src);
  EXPECT_EQ(p.temperature, 0.7f);
  EXPECT_EQ(src, "generation_config.json (temperature, do_sample=true)");
}

TEST_F(SamplerGenConfig, WrongTypesAndRangesNameFileAndKey) {
  const auto err = [&](const std::string& text) {
    write(text);
    return error_of([&] { k3::sampling_defaults_from_dir(dir.string()); });
  };
  EXPECT_EQ(err(R"({"temperature": "hot"})"), file() + ": key temperature must be a number, got \"hot\"");
  EXPECT_EQ(err(R"({"top_k": 2.5})"), file() + ": key top_k must be an integer, got 2.5");
  EXPECT_EQ(err(R"({"top_k": -3})"), file() + ": key top_k must be an integer in [0, 2147483647] (0 = off), got -3");
  EXPECT_EQ(err(R"({"top_p": 1.5})"), file() + ": key top_p must be in (0, 1], got 1.5");
  EXPECT_EQ(err(R"({"min_p": true})"), file() + ": key min_p must be a number, got true");
  EXPECT_EQ(err(R"({"repetition_penalty": 0})"),
            file() + ": key repetition_penalty must be a finite number > 0 (1 = off), got 0");
  EXPECT_EQ(err(R"({"temperature": -1})"),
            file() + ": key temperature must be a finite number >= 0 (0 = greedy), got -1");
  EXPECT_EQ(err(R"({"do_sample": "yes"})"), file() + ": key do_sample must be true or false, got \"yes\"");
  EXPECT_EQ(err(R"({"presence_penalty": [1]})"), file() + ": key presence_penalty must be a number, got [1]");
  const std::string bad_json = err(R"({"temperature": 0.7,)");
  EXPECT_EQ(bad_json.rfind(file() + ": not valid JSON", 0), 0u) << bad_json;
  EXPECT_EQ(bad_json.find('\n'), std::string::npos) << "one-line message";
  EXPECT_EQ(err("[1, 2]"), file() + ": top level must be a JSON object, got array");
}

// ---------------------------------------------------------------- sample() against distribution()

// Logits shaped so every filter bites at temperature 0.7 / top-k 50 / top-p 0.9 / min-p 0.05: ten
// strong tokens (4.0 down to 3.55, about 81% of the top-50 mass), then a flat band 2.17 lower
// (p / p_max ~ exp(-2.17 / 0.7) = 0.045 < 0.05): top-k keeps 40 of its 60 tokens, top-p needs ~19 of
// them to reach 0.9, and min-p then drops them all. The rest is a random background far below.
std::vector<float> shaped_logits(size_t V, uint64_t seed) {
  auto v = random_logits(V, seed, -6, 0);
  std::mt19937_64 g(seed + 1);
  for (int i = 0; i < 10; ++i) v[5 + 37 * i] = float(4.0 - 0.05 * i + 0.001 * double(g() % 7));
  for (int j = 0; j < 60; ++j) v[5 + 37 * (10 + j)] = float(1.83 - 0.002 * j);
  return v;
}

TEST(SamplerStatistics, CombinedConfigMatchesDistribution) {
  const int V = 4096, draws = 20000;
  const auto logits = shaped_logits(V, 21);
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 50;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  p.seed = 99;
  Sampler s(p, V);
  const Dist d = s.distribution(logits.data());
  expect_same_dist(d, reference(logits, p, {}), 1e-12);

  // Every filter removes something here (so the test exercises each one).
  SamplingParams no_min = p, no_topp = p;
  no_min.min_p = 0;
  no_topp.min_p = 0;
  no_topp.top_p = 1;
  const size_t n_all = Sampler(no_topp, V).distribution(logits.data()).size();
  const size_t n_topp = Sampler(no_min, V).distribution(logits.data()).size();
  EXPECT_EQ(n_all, 50u);
  EXPECT_LT(n_topp, n_all);
  EXPECT_LT(d.size(), n_topp);
  double sum = 0;
  for (const auto& e : d) sum += e.second;
  EXPECT_NEAR(sum, 1.0, 1e-12);

  const std::set<int32_t> allowed = ids_of(d);
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) {
    const int32_t t = s.sample(logits.data());
    ASSERT_TRUE(allowed.count(t)) << "token " << t << " is not in distribution()";
    counts[t]++;
  }
  const ChiSquare c = chi_square(d, counts, draws);
  EXPECT_LT(c.stat, c.bound) << "chi-square " << c.stat << " df " << c.df << " over " << d.size() << " tokens";
  // And each token separately within 5 binomial standard deviations.
  for (const auto& [id, prob] : d) {
    const double sd = std::sqrt(draws * prob * (1 - prob));
    EXPECT_NEAR(counts[id], draws * prob, 5 * sd) << "token " << id;
  }
}

TEST(SamplerStatistics, NoFilterFastPathMatchesDistribution) {
  const int V = 64, draws = 20000;
  const auto logits = random_logits(V, 8, -2, 2);
  SamplingParams p;
  p.temperature = 1.3f;
  p.seed = 3;
  Sampler s(p, V);
  const Dist d = s.distribution(logits.data());
  expect_same_dist(d, reference(logits, p, {}), 1e-12);
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) counts[s.sample(logits.data())]++;
  const ChiSquare c = chi_square(d, counts, draws);
  EXPECT_LT(c.stat, c.bound) << "chi-square " << c.stat << " df " << c.df;
}

// Many random small cases against the naive reference: vocabularies of 1..400 with -inf entries and
// heavy ties (logits on a coarse grid), random parameters and histories. Covers the heap and
// nth_element top-k paths, the top-p histogram (cuts inside and across buckets) and min-p.
TEST(SamplerStatistics, RandomConfigsMatchReference) {
  std::mt19937_64 g(2024);
  const auto uni = [&] { return double(g() >> 11) * 0x1.0p-53; };
  for (int trial = 0; trial < 400; ++trial) {
    const int V = 1 + int(g() % 400);
    std::vector<float> logits(V);
    const bool grid = trial % 2 == 0;
    for (auto& x : logits) {
      x = grid ? float(0.5 * double(int(g() % 9) - 4)) : float(-6 + 10 * uni());
      if (x == 0.0f) x = 0.25f;
      if (g() % 10 == 0) x = kNegInfF;
    }
    logits[g() % V] = 2.75f;  // at least one possible token
    SamplingParams p;
    p.temperature = float(0.2 + 2 * uni());
    p.top_k = g() % 3 == 0 ? 0 : int32_t(1 + g() % 60);
    p.top_p = g() % 3 == 0 ? 1.0f : float(0.05 + 0.95 * uni());
    p.min_p = g() % 3 == 0 ? 0.0f : float(0.3 * uni());
    p.repetition_penalty = float(0.8 + 0.6 * uni());
    p.presence_penalty = float(uni() - 0.5);
    p.frequency_penalty = float(0.3 * uni());
    p.penalty_last_n = int32_t(g() % 20) - 1;
    std::vector<int32_t> hist(g() % 40);
    for (auto& t : hist) t = int32_t(g() % V);
    Sampler s(p, V);
    for (int32_t t : hist) s.accept(t);
    SCOPED_TRACE("trial " + std::to_string(trial) + " V " + std::to_string(V));
    const Dist d = s.distribution(logits.data());
    expect_same_dist(d, reference(logits, p, hist), 1e-12);
    const auto allowed = ids_of(d);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(allowed.count(s.sample(logits.data())));
  }
}

// The fast paths (bounded heap, nth_element, the top-p histogram) against the naive full-sort reference on a
// full-size vocabulary, with penalties; also a loose per-call time bound that only catches blowups.
TEST(SamplerStatistics, FullVocabMatchesReference) {
  const int V = 163840;
  const auto logits = random_logits(V, 31, -8, 8);
  std::vector<int32_t> hist;
  for (int i = 0; i < 100; ++i) hist.push_back(int32_t((i * 7919) % V));
  const auto check = [&](SamplingParams p) {
    Sampler s(p, V);
    for (int32_t t : hist) s.accept(t);
    const Dist d = s.distribution(logits.data());
    expect_same_dist(d, reference(logits, p, hist), 1e-12);
    const auto allowed = ids_of(d);
    const auto t0 = std::chrono::steady_clock::now();
    const int n = 20;
    for (int i = 0; i < n; ++i) EXPECT_TRUE(allowed.count(s.sample(logits.data())));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
    EXPECT_LT(ms, 100.0) << "sample() took " << ms << " ms per call";
    return d.size();
  };
  SamplingParams p;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.1f;
  p.penalty_last_n = 50;
  p.top_k = 40;
  EXPECT_EQ(check(p), 40u);
  p.top_k = 50000;  // large k: the nth_element path
  EXPECT_EQ(check(p), 50000u);
  p.top_k = 0;
  p.top_p = 0.9f;  // a flat distribution: tens of thousands kept, the cut deep in the histogram
  p.temperature = 3.0f;
  EXPECT_GT(check(p), 1000u);
  p.top_p = 1;
  p.min_p = 0.3f;
  check(p);
  p.min_p = 0;
  EXPECT_EQ(check(p), size_t(V));
}

}  // namespace
