// Shared helpers for tokenizer tests: reading the reference files written by tools/tokenizer/*.py
// (hex TSV, length-prefixed binary records, the tiktoken character classes), and a UTF-8 codec written
// independently of the tokenizer's (decode, then reject overlong forms, surrogates and values past
// U+10FFFF). Test-only; no tokenizer logic here.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
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

// Code points of well-formed UTF-8 `s` with their byte offsets (offsets.back() == s.size()); false on
// any ill-formed sequence.
inline bool decode_utf8(const std::string& s, std::vector<uint32_t>* cps = nullptr,
                        std::vector<size_t>* offsets = nullptr) {
  if (cps) cps->clear();
  if (offsets) offsets->clear();
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    int n;
    uint32_t cp;
    if ((b & 0x80) == 0) {
      n = 1, cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2, cp = b & 0x1Fu;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3, cp = b & 0x0Fu;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4, cp = b & 0x07u;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(n) > s.size()) return false;
    for (int k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3Fu);
    }
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    if (cps) cps->push_back(cp);
    if (offsets) offsets->push_back(i);
    i += static_cast<size_t>(n);
  }
  if (offsets) offsets->push_back(s.size());
  return true;
}

inline void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// tests/tokenizer/data/unicode_classes.txt (tools/tokenizer/unicode_reference.py): per class name, the
// members as tiktoken's regex engine reads them, one flag per code point (0..0x10FFFF). Empty when the
// file is missing or malformed.
inline std::map<std::string, std::vector<bool>> read_unicode_classes(const std::string& path) {
  std::map<std::string, std::vector<bool>> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t t1 = line.find('\t'), t2 = line.find('\t', t1 == std::string::npos ? t1 : t1 + 1);
    if (t1 == std::string::npos || t2 == std::string::npos) return {};
    std::vector<bool> member(0x110000, false);
    std::istringstream ranges(line.substr(t2 + 1));
    std::string r;
    while (ranges >> r) {
      const size_t dash = r.find('-');
      const unsigned long lo = std::stoul(r.substr(0, dash), nullptr, 16);
      const unsigned long hi = dash == std::string::npos ? lo : std::stoul(r.substr(dash + 1), nullptr, 16);
      if (lo > hi || hi >= 0x110000) return {};
      for (unsigned long c = lo; c <= hi; ++c) member[c] = true;
    }
    out[line.substr(0, t1)] = std::move(member);
  }
  return out;
}

}  // namespace k3test
