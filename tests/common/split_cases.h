// What the tests of a split model (model/parallel.h, model/remote.h) share: the models by name, a
// bitwise comparison, deterministic prompts, options of one numerics, and the (model, tp, ep) cases
// with readable names. Test-only.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "model/model.h"

namespace k3test {

// tests/fixtures/NAME, or models/k3-nano.
inline std::string split_model_dir(const std::string& name) {
  const std::filesystem::path src(K3_SOURCE_DIR);
  return (name == "k3-nano" ? src / "models" / name : src / "tests" / "fixtures" / name).string();
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

inline std::vector<int32_t> prompt_ids(int32_t vocab, size_t n, uint32_t seed) {
  std::vector<int32_t> ids;
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) ids.push_back(int32_t((x = x * 1664525u + 1013904223u) >> 9) % vocab);
  return ids;
}

inline k3::ForwardOptions numerics_opts(k3::ops::Numerics n) {
  k3::ForwardOptions o;
  o.numerics = n;
  return o;
}

struct SplitCase {
  std::string model;
  int tp, ep;
};
inline std::string split_case_name(const ::testing::TestParamInfo<SplitCase>& i) {
  std::string m = i.param.model;
  for (char& c : m)
    if (c == '-') c = '_';
  return m + "_tp" + std::to_string(i.param.tp) + "_ep" + std::to_string(i.param.ep);
}
inline void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.model << " tp" << c.tp << " ep" << c.ep; }

}  // namespace k3test
