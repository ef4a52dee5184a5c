// Builds the code-point flag table from ICU's character database (general category, script,
// White_Space), deduplicating identical 256-code-point blocks. Runs once per process.
// Must not be used for anything but classification; no tokenizer logic here.
#include "tokenizer/unicode_props.h"

#include <unicode/uchar.h>
#include <unicode/uscript.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace k3::tok {
namespace detail {

static uint8_t compute(UChar32 c) {
  uint8_t f = 0;
  const int8_t gc = u_charType(c);
  UErrorCode err = U_ZERO_ERROR;
  const bool han = uscript_getScript(c, &err) == USCRIPT_HAN;
  if (han) f |= kHan;
  const bool lu = gc == U_UPPERCASE_LETTER, ll = gc == U_LOWERCASE_LETTER, lt = gc == U_TITLECASE_LETTER,
             lm = gc == U_MODIFIER_LETTER, lo = gc == U_OTHER_LETTER;
  const bool m = gc == U_NON_SPACING_MARK || gc == U_ENCLOSING_MARK || gc == U_COMBINING_SPACING_MARK;
  if (lu || ll || lt || lm || lo) f |= kLetter;
  if (gc == U_DECIMAL_DIGIT_NUMBER || gc == U_LETTER_NUMBER || gc == U_OTHER_NUMBER) f |= kNumber;
  if (!han && (lu || lt || lm || lo || m)) f |= kUpper;
  if (!han && (ll || lm || lo || m)) f |= kLower;
  if (u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) f |= kSpace;
  if (c == '\r' || c == '\n') f |= kCrLf;
  return f;
}

const PropTable& prop_table() {
  static PropTable* table = [] {
    auto* t = new PropTable;
    std::vector<std::string> blocks;
    std::map<std::string, uint16_t> index;
    std::string cur(256, '\0');
    for (uint32_t b = 0; b < (0x110000 >> 8); ++b) {
      for (uint32_t i = 0; i < 256; ++i) cur[i] = static_cast<char>(compute(static_cast<UChar32>((b << 8) | i)));
      auto it = index.find(cur);
      if (it == index.end()) {
        it = index.emplace(cur, static_cast<uint16_t>(blocks.size())).first;
        blocks.push_back(cur);
      }
      t->block[b] = it->second;
    }
    t->data = new uint8_t[blocks.size() * 256];
    for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(t->data + i * 256, blocks[i].data(), 256);
    return t;
  }();
  return *table;
}

}  // namespace detail

bool py_isspace(uint32_t cp) {
  // General category Zs, or bidi class WS, B or S (CPython's definition).
  if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20);
  if (u_charType(static_cast<UChar32>(cp)) == U_SPACE_SEPARATOR) return true;
  const auto bidi = u_charDirection(static_cast<UChar32>(cp));
  return bidi == U_WHITE_SPACE_NEUTRAL || bidi == U_BLOCK_SEPARATOR || bidi == U_SEGMENT_SEPARATOR;
}

}  // namespace k3::tok
