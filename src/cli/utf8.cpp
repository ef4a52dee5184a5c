// See utf8.h.
#include "cli/utf8.h"

#include <cstdint>
#include <cstdio>

#include "core/error.h"

namespace k3::cli {

std::optional<size_t> first_invalid_utf8(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  size_t i = 0;
  while (i < text.size()) {
    const uint8_t b = byte(i);
    if (b < 0x80) {
      ++i;
      continue;
    }
    // Lead byte: the sequence length and the range of its second byte (the narrower ranges after
    // E0, ED, F0 and F4 exclude overlong forms, surrogates and code points past U+10FFFF).
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return i;  // a continuation byte without a lead, C0/C1 (overlong) or F5..FF
    }
    if (i + len > text.size()) return i;  // cut off at the end
    if (byte(i + 1) < lo || byte(i + 1) > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return i;
    i += len;
  }
  return std::nullopt;
}

void require_utf8(std::string_view text, const std::string& what) {
  const std::optional<size_t> at = first_invalid_utf8(text);
  if (!at) return;
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", unsigned(static_cast<uint8_t>(text[*at])));
  fail(what + " is not valid UTF-8: malformed sequence at byte offset " + std::to_string(*at) + " (" + hex + ")");
}

}  // namespace k3::cli
