// Sampler, Rng, validation and generation_config.json defaults (see sampler.h for the order of the
// steps and why). Owns: the per-token math in double, the penalty window, the draw.
// Must not: sort the whole vocabulary, use std:: random distributions, or let the order of an
// unordered container, a heap or an nth_element result reach a sum or the draw (sums and the draw
// run in ascending id order or in the Better order, so results are the same on every platform).
#include "runtime/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace k3 {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// Slack on top_p / min_p: parameters are floats (0.8f != 0.8) and probabilities from float logits
// carry ~1e-7 relative error, so an exact compare would flip cutoffs that are exact in decimal.
constexpr double kCutoffSlack = 1e-6;
// top-p histogram (see top_p_last): 16 buckets per binade, 64 binades below 1.0, then one for the rest.
constexpr size_t kTopPBuckets = 64 * 16 + 1;
constexpr uint64_t kKeyOfOne = 0x3FF0;  // bits of 1.0 >> 48

// Shortest round-trip text of a float ("1.5", "0.8", "nan", "-inf") for messages.
std::string show(float v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Strict total order on token ids by value: larger v first, then lower id. Every selection and sort
// uses it, so each has exactly one answer whatever the standard library's algorithm.
struct Better {
  const std::vector<double>& v;
  bool operator()(int32_t a, int32_t b) const {
    const double va = v[static_cast<size_t>(a)], vb = v[static_cast<size_t>(b)];
    return va > vb || (va == vb && a < b);
  }
};

// One rule per parameter, shared by validate_sampling() and the generation_config.json reader so the
// two can never disagree. `range` is the phrase used in "<name> must be <range>, got <value>".
struct Rule {
  const char* flag;  // flag-style name, as the command line spells it
  const char* key;   // generation_config.json key (nullptr: not read from the file)
  const char* range;
  bool (*ok)(double);
};

bool finite(double v) { return std::isfinite(v); }
const Rule kTemperature{"temp", "temperature", "a finite number >= 0 (0 = greedy)",
                        [](double v) { return finite(v) && v >= 0; }};
const Rule kTopK{"top-k", "top_k", "an integer in [0, 2147483647] (0 = off)",
                 [](double v) { return v >= 0 && v <= 2147483647.0; }};
const Rule kTopP{"top-p", "top_p", "in (0, 1]", [](double v) { return v > 0 && v <= 1; }};
const Rule kMinP{"min-p", "min_p", "in [0, 1]", [](double v) { return v >= 0 && v <= 1; }};
const Rule kRepeat{"repeat-penalty", "repetition_penalty", "a finite number > 0 (1 = off)",
                   [](double v) { return finite(v) && v > 0; }};
const Rule kPresence{"presence-penalty", "presence_penalty", "a finite number (0 = off)", finite};
const Rule kFrequency{"frequency-penalty", "frequency_penalty", "a finite number (0 = off)", finite};
const Rule kLastN{"repeat-last-n", nullptr, "an integer >= -1 (-1 = all, 0 = off)", [](double v) { return v >= -1; }};

void check(const Rule& r, double v, const std::string& shown) {
  if (!r.ok(v)) fail(std::string(r.flag) + " must be " + r.range + ", got " + shown);
}

}  // namespace

// ---------------------------------------------------------------------------------------- Rng

void Rng::reseed(uint64_t seed) {
  uint64_t x = seed;
  for (auto& s : s_) s = splitmix64(x);  // never all zero: splitmix64 outputs of distinct x differ
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

// ---------------------------------------------------------------------------------- validation

void validate_sampling(const SamplingParams& p) {
  check(kTemperature, p.temperature, show(p.temperature));
  check(kTopK, p.top_k, std::to_string(p.top_k));
  check(kTopP, p.top_p, show(p.top_p));
  check(kMinP, p.min_p, show(p.min_p));
  check(kRepeat, p.repetition_penalty, show(p.repetition_penalty));
  check(kPresence, p.presence_penalty, show(p.presence_penalty));
  check(kFrequency, p.frequency_penalty, show(p.frequency_penalty));
  check(kLastN, p.penalty_last_n, std::to_string(p.penalty_last_n));
}

// ------------------------------------------------------------------------ generation_config.json

SamplingParams sampling_defaults_from_dir(const std::string& dir, std::string* source) {
  using json = nlohmann::json;
  namespace fs = std::filesystem;
  SamplingParams p;
  const fs::path path = fs::path(dir) / "generation_config.json";
  const std::string where = path.string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (ec) fail(where + ": cannot access (" + ec.message() + ")");  // not "absent": don't guess
    if (source) *source = "built-in defaults";
    return p;
  }
  if (fs::is_directory(path, ec)) fail(where + ": is a directory, expected a JSON file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(where + ": cannot open for reading");
  std::stringstream text;
  text << in.rdbuf();
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::exception& e) {
    fail(where + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) fail(where + ": top level must be a JSON object, got " + std::string(j.type_name()));

  std::vector<std::string> used;
  const auto shown = [](const json& v) {
    std::string s = v.dump();
    return s.size() > 40 ? s.substr(0, 37) + "..." : s;
  };
  // Null means "unset" in Hugging Face configs, so a null value is treated like an absent key.
  const auto find = [&](const char* key) -> const json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  const auto read_float = [&](const Rule& r, float& out) {
    const json* v = find(r.key);
    if (!v) return;
    if (!v->is_number()) fail(where + ": key " + r.key + " must be a number, got " + shown(*v));
    const float f = static_cast<float>(v->get<double>());
    if (!r.ok(f)) fail(where + ": key " + r.key + " must be " + r.range + ", got " + shown(*v));
    out = f;
    used.push_back(r.key);
  };

  read_float(kTemperature, p.temperature);
  if (const json* v = find(kTopK.key)) {
    if (!v->is_number_integer()) fail(where + ": key top_k must be an integer, got " + shown(*v));
    // Unsigned JSON integers above INT64_MAX would wrap in get<int64_t>(); they are out of range anyway.
    const double k =
        v->is_number_unsigned() ? static_cast<double>(v->get<uint64_t>()) : static_cast<double>(v->get<int64_t>());
    if (!kTopK.ok(k)) fail(where + ": key top_k must be " + kTopK.range + ", got " + shown(*v));
    p.top_k = static_cast<int32_t>(k);
    used.push_back("top_k");
  }
  read_float(kTopP, p.top_p);
  read_float(kMinP, p.min_p);
  read_float(kRepeat, p.repetition_penalty);
  read_float(kPresence, p.presence_penalty);
  read_float(kFrequency, p.frequency_penalty);
  if (const json* v = find("do_sample")) {
    if (!v->is_boolean()) fail(where + ": key do_sample must be true or false, got " + shown(*v));
    // Only an explicit false means greedy: many released files set temperature/top_p without
    // do_sample, and vLLM / llama.cpp sample with them (transformers alone would decode greedily).
    if (!v->get<bool>()) p.temperature = 0.0f;
    used.push_back(v->get<bool>() ? "do_sample=true" : "do_sample=false");
  }

  if (source) {
    if (used.empty()) {
      *source = "built-in defaults (generation_config.json has no sampling keys)";
    } else {
      std::string s = "generation_config.json (";
      for (size_t i = 0; i < used.size(); ++i) s += (i ? ", " : "") + used[i];
      *source = s + ")";
    }
  }
  return p;
}

// ------------------------------------------------------------------------------------ Sampler

Sampler::Sampler(const SamplingParams& p, int64_t vocab) : p_(p), vocab_(vocab), rng_(p.seed) {
  validate_sampling(p);
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max())
    fail("sampler: vocab must be in [1, 2147483647], got " + std::to_string(vocab));
  // sample()'s buffers hold at most the vocabulary; a window of n tokens holds at most n distinct
  // ones, and n + 1 for a moment in accept() (the new token is counted before the oldest leaves).
  // Reserved here, so neither sample() (after its first call) nor accept() allocates.
  scratch_.kept.reserve(size_t(vocab));
  scratch_.order.reserve(size_t(vocab));
  if (p.penalty_last_n > 0) {
    window_.reserve(size_t(p.penalty_last_n));
    counts_.reserve(size_t(p.penalty_last_n) + 1);
  }
}

void Sampler::count(int32_t token, int32_t delta) {
  const auto it = std::lower_bound(counts_.begin(), counts_.end(), token,
                                   [](const std::pair<int32_t, int32_t>& e, int32_t t) { return e.first < t; });
  if (it != counts_.end() && it->first == token) {
    if ((it->second += delta) == 0) counts_.erase(it);
  } else if (delta > 0) {
    counts_.insert(it, {token, delta});
  }
}

void Sampler::accept(int32_t token) {
  if (token < 0 || token >= vocab_)
    fail("sampler: accepted token " + std::to_string(token) + " is outside the vocabulary [0, " +
         std::to_string(vocab_) + ")");
  const int32_t n = p_.penalty_last_n;
  if (n == 0) return;  // penalties off: keep no history at all
  count(token, 1);
  if (n < 0) return;  // -1: the whole history counts; the counts alone are enough
  if (window_.size() < static_cast<size_t>(n)) {
    window_.push_back(token);
    return;
  }
  // Full ring: the oldest token leaves the window as the new one enters.
  const int32_t old = window_[head_];
  count(old, -1);
  window_[head_] = token;
  head_ = (head_ + 1) % window_.size();
}

void Sampler::reset() {
  window_.clear();
  head_ = 0;
  counts_.clear();
  rng_.reseed(p_.seed);
}

void Sampler::penalize(const float* logits, std::vector<double>& v) const {
  v.resize(static_cast<size_t>(vocab_));
  for (int64_t i = 0; i < vocab_; ++i) {
    const float x = logits[i];
    if (std::isnan(x)) fail("sampler: logits contain NaN at token " + std::to_string(i));
    if (x == std::numeric_limits<float>::infinity()) fail("sampler: logits contain +inf at token " + std::to_string(i));
    v[static_cast<size_t>(i)] = x;
  }
  const double rp = p_.repetition_penalty, presence = p_.presence_penalty, frequency = p_.frequency_penalty;
  if (rp == 1.0 && presence == 0.0 && frequency == 0.0) return;
  // Each distinct token is changed once from its own raw logit, so the order is irrelevant.
  for (const auto& [tok, count] : counts_) {
    double x = v[static_cast<size_t>(tok)];
    if (rp != 1.0) x = x > 0 ? x / rp : x * rp;
    x -= presence + frequency * count;
    v[static_cast<size_t>(tok)] = x;
  }
}

std::vector<double> Sampler::penalized_logits(const float* logits) const {
  std::vector<double> v;
  penalize(logits, v);
  return v;
}

int32_t Sampler::argmax(const std::vector<double>& v) const {
  int32_t best = -1;
  double best_v = kNegInf;
  for (int32_t i = 0; i < static_cast<int32_t>(vocab_); ++i) {
    if (v[static_cast<size_t>(i)] > best_v) {  // strict: a tie keeps the lower id
      best_v = v[static_cast<size_t>(i)];
      best = i;
    }
  }
  if (best < 0) fail("sampler: every logit is -inf; no token can be chosen");
  return best;
}

// Step 6: returns the last token top-p keeps (the kept set is every candidate at least as good as
// it under Better), or -1 when top-p keeps them all. Cost O(V) plus a sort of one or two histogram
// buckets, never of the whole list:
//  * bucket = the top 16 bits of the weight's IEEE bits (exponent + 4 mantissa bits): monotone in
//    the weight, 16 buckets per binade below the best token's 1.0; weights <= 2^-64 share the last;
//  * walking whole buckets from the best, their masses (each summed in id order) are added while the
//    cumulative probability stays below top_p; the bucket that would reach it is sorted and walked
//    token by token. The sums are fixed by the ids and weights alone, so the cut is portable.
int32_t Sampler::top_p_last(Scratch& s, double total) const {
  const std::vector<double>& v = s.v;
  const std::vector<int32_t>& kept = s.kept;
  std::vector<int32_t>& order = s.order;
  const double need = static_cast<double>(p_.top_p) - kCutoffSlack;
  const auto bucket = [&v](int32_t id) {
    const uint64_t key = std::bit_cast<uint64_t>(v[static_cast<size_t>(id)]) >> 48;
    return static_cast<size_t>(std::min<uint64_t>(kKeyOfOne - key, kTopPBuckets - 1));
  };
  std::array<double, kTopPBuckets> mass{};
  for (int32_t id : kept) mass[bucket(id)] += v[static_cast<size_t>(id)];
  double acc = 0;
  size_t b = 0;
  while (b < kTopPBuckets && (acc + mass[b]) / total < need) acc += mass[b++];
  if (b == kTopPBuckets) return -1;  // top_p within rounding of 1: everything stays

  // Token by token from bucket b on. Normally the cut is inside bucket b; rounding (the bucket's
  // mass vs. the same weights added one by one) can push it into later buckets, so the rest follows.
  const auto walk = [&](size_t lo, size_t hi) -> int32_t {  // buckets [lo, hi]
    order.clear();
    for (int32_t id : kept) {
      const size_t bk = bucket(id);
      if (bk >= lo && bk <= hi) order.push_back(id);
    }
    std::sort(order.begin(), order.end(), Better{v});
    for (int32_t id : order) {
      acc += v[static_cast<size_t>(id)];
      if (acc / total >= need) return id;
    }
    return -1;
  };
  if (const int32_t last = walk(b, b); last >= 0) return last;
  if (b + 1 < kTopPBuckets) return walk(b + 1, kTopPBuckets - 1);
  return -1;
}

void Sampler::filter(Scratch& s) const {
  std::vector<double>& v = s.v;
  std::vector<int32_t>& kept = s.kept;
  const Better better{v};
  // 3. temperature over the possible tokens, fused with 4. top-k. A small k keeps a bounded heap
  // (front = worst kept): one pass, and nearly every token is rejected by a single compare. A large
  // k uses nth_element, O(V). Either way the kept ids are then sorted by id, O(k log k), because the
  // order a heap or nth_element leaves behind is not portable and sums/draws run in kept order.
  const double t = p_.temperature;
  const size_t k = p_.top_k > 0 ? static_cast<size_t>(p_.top_k) : 0;
  const bool use_heap = k > 0 && k <= static_cast<size_t>(vocab_) / 8;
  kept.clear();
  for (int32_t i = 0; i < static_cast<int32_t>(vocab_); ++i) {
    double& x = v[static_cast<size_t>(i)];
    if (x == kNegInf) continue;
    x /= t;
    if (!use_heap) {
      kept.push_back(i);
    } else if (kept.size() < k) {
      kept.push_back(i);
      std::push_heap(kept.begin(), kept.end(), better);
    } else if (better(i, kept.front())) {
      std::pop_heap(kept.begin(), kept.end(), better);
      kept.back() = i;
      std::push_heap(kept.begin(), kept.end(), better);
    }
  }
  if (kept.empty()) fail("sampler: every logit is -inf; no token can be drawn");
  if (use_heap) {
    std::sort(kept.begin(), kept.end());
  } else if (k > 0 && k < kept.size()) {
    std::nth_element(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(k - 1), kept.end(), better);
    kept.resize(k);
    std::sort(kept.begin(), kept.end());
  }

  // 5. softmax weights exp(z - max); the max token gets exactly 1. Tokens whose weight underflows
  // to 0 are impossible and dropped, so every listed token has p > 0.
  double m = kNegInf;
  for (int32_t id : kept) m = std::max(m, v[static_cast<size_t>(id)]);
  double total = 0;
  size_t n = 0;
  for (int32_t id : kept) {
    double& x = v[static_cast<size_t>(id)];
    x = std::exp(x - m);
    if (x > 0) {
      kept[n++] = id;
      total += x;
    }
  }
  kept.resize(n);

  // 6. top-p over probabilities v/total, cumulated in (probability desc, id asc) order.
  if (p_.top_p < 1.0f) {
    if (const int32_t last = top_p_last(s, total); last >= 0)
      std::erase_if(kept, [&](int32_t id) { return better(last, id); });  // keeps id order, O(n)
  }

  // 7. min-p: p < min_p * p_max  <=>  w < min_p * w_max (same total); w_max is the max token's 1.0.
  if (p_.min_p > 0.0f) {
    double w_max = 0;
    for (int32_t id : kept) w_max = std::max(w_max, v[static_cast<size_t>(id)]);
    const double threshold = (static_cast<double>(p_.min_p) - kCutoffSlack) * w_max;
    std::erase_if(kept, [&](int32_t id) { return v[static_cast<size_t>(id)] < threshold; });
  }

  // 8. renormalize: the new total, summed in ascending id order like the draw.
  total = 0;
  for (int32_t id : kept) total += v[static_cast<size_t>(id)];
  s.total = total;
}

int32_t Sampler::sample(const float* logits) {
  Scratch& s = scratch_;
  penalize(logits, s.v);
  if (p_.temperature == 0.0f) return argmax(s.v);
  filter(s);
  // 9. one uniform per call; the first id whose cumulative weight exceeds u * total.
  const double target = rng_.next_double() * s.total;
  double cum = 0;
  for (int32_t id : s.kept) {
    cum += s.v[static_cast<size_t>(id)];
    if (target < cum) return id;
  }
  return s.kept.back();  // u * total rounded up to total: the last token owns that edge
}

std::vector<std::pair<int32_t, double>> Sampler::distribution(const float* logits) const {
  Scratch s;
  penalize(logits, s.v);
  if (p_.temperature == 0.0f) return {{argmax(s.v), 1.0}};
  filter(s);
  std::vector<std::pair<int32_t, double>> out;
  out.reserve(s.kept.size());
  for (int32_t id : s.kept) out.emplace_back(id, s.v[static_cast<size_t>(id)] / s.total);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  return out;
}

}  // namespace k3
