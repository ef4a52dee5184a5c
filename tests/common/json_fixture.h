// Loader for the third-party JSON op fixtures (shared/fixtures/third-party/...): each array is
// {"shape": [...], "data": [...]} flattened row-major. Also locates the shared folder (K3_SHARED_DIR)
// so tests can GTEST_SKIP() with a message when it is absent.
// Owns: parsing + shape checks only; never copies fixtures into the repository.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace k3test {

inline std::filesystem::path shared_dir() {
#ifdef K3_SHARED_DIR
  return std::filesystem::path(K3_SHARED_DIR);
#else
  return {};
#endif
}

inline std::filesystem::path third_party_ops_dir() {
  return shared_dir() / "fixtures" / "third-party" / "kimi-k3-in-c-ops";
}

// Parses a JSON file; throws on a missing or malformed file.
inline nlohmann::json load_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  return nlohmann::json::parse(f);
}

struct FArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

// j[key] must be {"shape", "data"} with prod(shape) == data.size().
inline FArray get_array(const nlohmann::json& j, const std::string& key) {
  if (!j.contains(key)) throw std::runtime_error("fixture has no key '" + key + "'");
  const auto& a = j.at(key);
  FArray r;
  r.shape = a.at("shape").get<std::vector<int64_t>>();
  r.data = a.at("data").get<std::vector<float>>();
  if (r.numel() != int64_t(r.data.size()))
    throw std::runtime_error("fixture array '" + key + "': shape/data size mismatch");
  return r;
}

inline std::vector<float> get_data(const nlohmann::json& j, const std::string& key,
                                   const std::vector<int64_t>& expect_shape) {
  FArray a = get_array(j, key);
  if (a.shape != expect_shape) {
    std::string s = "fixture array '" + key + "' has shape [";
    for (auto x : a.shape) s += std::to_string(x) + ",";
    throw std::runtime_error(s + "] not the expected one");
  }
  return std::move(a.data);
}

// A loaded fixture file that keeps every array it hands out alive (std::map nodes are stable),
// so WeightMat views can point straight into it.
class Fixture {
 public:
  explicit Fixture(const std::filesystem::path& p) : j_(load_json(p)) {}
  const nlohmann::json& json() const { return j_; }
  // The array `key`, checked against `shape` (pass {} to skip the check).
  const std::vector<float>& arr(const std::string& key, const std::vector<int64_t>& shape = {}) {
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      FArray a = get_array(j_, key);
      shapes_[key] = a.shape;
      it = cache_.emplace(key, std::move(a.data)).first;
    }
    if (!shape.empty() && shapes_.at(key) != shape) throw std::runtime_error("fixture array '" + key + "': bad shape");
    return it->second;
  }
  const std::vector<int64_t>& shape(const std::string& key) {
    arr(key);
    return shapes_.at(key);
  }
  template <class T>
  T val(const std::string& key) const {
    return j_.at(key).get<T>();
  }

 private:
  nlohmann::json j_;
  std::map<std::string, std::vector<float>> cache_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

}  // namespace k3test

// Skips the current test (with a message) when the third-party op fixtures are not present.
#define K3_REQUIRE_THIRD_PARTY_OPS()                                                                 \
  do {                                                                                               \
    if (!std::filesystem::is_directory(k3test::third_party_ops_dir()))                               \
      GTEST_SKIP() << "third-party fixtures not found at " << k3test::third_party_ops_dir().string() \
                   << " (K3_SHARED_DIR); skipping";                                                  \
  } while (0)
