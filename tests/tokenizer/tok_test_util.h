// Shared helpers for tokenizer tests: reading the reference files written by tools/tokenizer/*.py
// (hex TSV and length-prefixed binary records). Test-only; no tokenizer logic here.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace k3test {

struct RefCase {
  std::string input;
  std::vector<uint32_t> ids;
};

inline std::vector<RefCase> read_reference_tsv(const std::string& path) {
  std::vector<RefCase> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t tab = line.find('\t');
    RefCase c;
    const std::string hex = line.substr(0, tab);
    for (size_t i = 0; i + 1 < hex.size(); i += 2)
      c.input.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    std::istringstream ids(tab == std::string::npos ? "" : line.substr(tab + 1));
    uint32_t v;
    while (ids >> v) c.ids.push_back(v);
    out.push_back(std::move(c));
  }
  return out;
}

inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// <u32 length><bytes> records
inline std::vector<std::string> read_records(const std::string& path) {
  const std::string d = read_all(path);
  std::vector<std::string> out;
  for (size_t p = 0; p + 4 <= d.size();) {
    uint32_t n;
    std::memcpy(&n, d.data() + p, 4);
    p += 4;
    out.push_back(d.substr(p, n));
    p += n;
  }
  return out;
}

// <u32 count><u32 ids...> records
inline std::vector<std::vector<uint32_t>> read_id_records(const std::string& path) {
  const std::string d = read_all(path);
  std::vector<std::vector<uint32_t>> out;
  for (size_t p = 0; p + 4 <= d.size();) {
    uint32_t n;
    std::memcpy(&n, d.data() + p, 4);
    p += 4;
    std::vector<uint32_t> ids(n);
    if (p + 4ull * n > d.size()) break;  // truncated record file
    if (n) std::memcpy(ids.data(), d.data() + p, 4ull * n);
    p += 4ull * n;
    out.push_back(std::move(ids));
  }
  return out;
}

}  // namespace k3test
