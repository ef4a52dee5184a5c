// Test helpers for the io module: a tiny safetensors image writer and a self-removing temp dir.
// Owns: building valid (or deliberately broken) safetensors bytes for tests only.
// Must not: use the reader under test to build its inputs.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace k3test {

struct StEntry {
  std::string name;   // written verbatim inside JSON quotes (caller escapes if needed)
  std::string dtype;  // safetensors spelling
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline void put_le64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

// Raw image: 8-byte little-endian length, header text, data bytes.
inline std::vector<uint8_t> st_raw(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  put_le64(out, header.size());
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// Valid image: tensors laid out back to back in the given order; header padded with spaces to a
// multiple of 8 like the reference writer does.
inline std::vector<uint8_t> st_image(const std::vector<StEntry>& entries,
                                     const std::vector<std::pair<std::string, std::string>>& metadata = {}) {
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i)
      h += (i ? "," : "") + std::string("\"") + metadata[i].first + "\":\"" + metadata[i].second + "\"";
    h += "}";
    first = false;
  }
  std::vector<uint8_t> data;
  for (const StEntry& e : entries) {
    if (!first) h += ",";
    first = false;
    h += "\"" + e.name + "\":{\"dtype\":\"" + e.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) h += (i ? "," : "") + std::to_string(e.shape[i]);
    const size_t begin = data.size();
    data.insert(data.end(), e.bytes.begin(), e.bytes.end());
    h += "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  h += "}";
  while (h.size() % 8) h += ' ';
  return st_raw(h, data);
}

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/k3io-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    std::ofstream f(file(name), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return file(name);
  }
  std::string write_text(const std::string& name, const std::string& text) const {
    return write(name, std::vector<uint8_t>(text.begin(), text.end()));
  }

 private:
  std::string path_;
};

// Asserts that fn throws k3::Error (exit code 2) whose single-line message contains `fragment`.
inline void expect_k3_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.exit_code(), 2) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << "message: " << msg << "\nexpected fragment: " << fragment;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected k3::Error containing '" << fragment << "', got std::exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected k3::Error containing '" << fragment << "', nothing was thrown";
}

}  // namespace k3test
