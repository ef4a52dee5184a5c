// Code-point property flags the Kimi pre-tokenizer needs (letters, marks, numbers, Han script,
// White_Space), precomputed once from ICU into a two-level table so lookups are two loads.
// Owns only character classification; knows nothing about the split pattern or BPE.
#pragma once
#include <cstdint>

namespace k3::tok {

enum : uint8_t {
  kHan = 1,     // Script=Han (not Script_Extensions: matches the reference regex engine)
  kLetter = 2,  // \p{L}
  kNumber = 4,  // \p{N}
  kUpper = 8,   // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] minus Han
  kLower = 16,  // [\p{Ll}\p{Lm}\p{Lo}\p{M}] minus Han
  kSpace = 32,  // \s = Unicode White_Space
  kCrLf = 64,   // \r or \n
};

namespace detail {
struct PropTable {
  uint16_t block[0x110000 >> 8];  // code point >> 8 -> block index
  uint8_t* data;                  // blocks of 256 flags
};
const PropTable& prop_table();
}  // namespace detail

inline uint8_t cp_props(uint32_t cp) {
  static const detail::PropTable& t = detail::prop_table();
  if (cp >= 0x110000) return 0;
  return t.data[(static_cast<uint32_t>(t.block[cp >> 8]) << 8) | (cp & 0xFF)];
}

// Python str.isspace() (used by the long-run splitting rule of the Python tokenizer).
bool py_isspace(uint32_t cp);

}  // namespace k3::tok
