// Kimi split-pattern matcher (see pre_tokenizer.h). Each branch of the pattern is matched with the
// same backtracking order a Perl-style engine uses, so piece boundaries equal the reference's.
// Must stay free of BPE/vocabulary logic; tests/tokenizer/test_pretokenizer_oracle.cpp checks it.
#include "tokenizer/pre_tokenizer.h"

#include "tokenizer/unicode_props.h"

namespace k3::tok {

int utf8_valid_len(std::string_view s, size_t i) {
  const size_t n = s.size();
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  auto cont = [&](size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) {
    if (k >= n) return false;
    const auto b = static_cast<unsigned char>(s[k]);
    return b >= lo && b <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(i + 1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2) && cont(i + 3) ? 4 : 0;
  }
  return 0;
}

uint32_t utf8_decode_at(std::string_view s, size_t i, int len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data() + i);
  switch (len) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    case 3:
      return ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    default:
      return ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
  }
}

namespace {

// Decoded view of the text: code points, their flags and byte offsets (offset[n] = size).
struct Cps {
  std::vector<uint32_t> cp;
  std::vector<uint8_t> fl;
  std::vector<uint32_t> off;
};

inline bool is_p(uint8_t f) { return !(f & (kLetter | kNumber | kCrLf)); }   // [^\r\n\p{L}\p{N}]
inline bool is_q(uint8_t f) { return !(f & (kLetter | kNumber | kSpace)); }  // [^\s\p{L}\p{N}]

struct Matcher {
  const Cps& c;
  size_t n;

  size_t run(size_t j, uint8_t mask) const {
    while (j < n && (c.fl[j] & mask)) ++j;
    return j;
  }
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)? at j: returns the end after the optional contraction.
  size_t contraction(size_t j) const {
    if (j + 1 >= n || c.cp[j] != '\'') return j;
    auto lc = [](uint32_t x) { return (x >= 'A' && x <= 'Z') ? x + 32 : (x == 0x17F ? uint32_t('s') : x); };
    const uint32_t a = lc(c.cp[j + 1]);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return j + 2;
    if (j + 2 < n) {
      const uint32_t b = lc(c.cp[j + 2]);
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return j + 3;
    }
    return j;
  }
  // U* W+ C? at j (branch 2 body); 0 = no match (j < returned end always when matched).
  size_t upper_star_lower_plus(size_t j) const {
    const size_t u_end = run(j, kUpper);
    for (size_t k = u_end + 1; k-- > j;) {  // greedy U* backs off one code point at a time
      if (k < n && (c.fl[k] & kLower)) return contraction(run(k, kLower));
    }
    return 0;
  }
  // U+ W* C? at j (branch 3 body)
  size_t upper_plus_lower_star(size_t j) const {
    if (j >= n || !(c.fl[j] & kUpper)) return 0;
    return contraction(run(run(j, kUpper), kLower));
  }

  size_t match(size_t i) const {
    const uint8_t f = c.fl[i];
    if (f & kHan) return run(i, kHan);  // 1
    const bool p = is_p(f);
    if (p && i + 1 < n) {  // 2 with the optional prefix
      if (size_t e = upper_star_lower_plus(i + 1)) return e;
    }
    if (size_t e = upper_star_lower_plus(i)) return e;  // 2 without it
    if (p && i + 1 < n) {                               // 3
      if (size_t e = upper_plus_lower_star(i + 1)) return e;
    }
    if (size_t e = upper_plus_lower_star(i)) return e;
    if (f & kNumber) {  // 4
      size_t e = i + 1;
      while (e < n && e < i + 3 && (c.fl[e] & kNumber)) ++e;
      return e;
    }
    // 5: ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    size_t q = i;
    if (c.cp[i] == ' ' && i + 1 < n && is_q(c.fl[i + 1])) q = i + 1;
    if (is_q(c.fl[q])) {
      size_t e = q;
      while (e < n && is_q(c.fl[e])) ++e;
      return run(e, kCrLf);
    }
    if (f & kSpace) {
      const size_t ws_end = run(i, kSpace);
      for (size_t k = ws_end; k > i; --k) {  // 6: \s*[\r\n]+ (last CR/LF of the run)
        if (c.fl[k - 1] & kCrLf) return k;
      }
      if (ws_end == n) return ws_end;          // 7: \s+(?!\S)
      if (ws_end - i >= 2) return ws_end - 1;  //    backs off one so a non-space follows a space
      return ws_end;                           // 8: \s+
    }
    return i + 1;  // unreachable for valid input; keeps progress guaranteed
  }
};

}  // namespace

void split_pieces(std::string_view text, std::vector<ByteRange>& out) {
  thread_local Cps c;
  c.cp.clear();
  c.fl.clear();
  c.off.clear();
  for (size_t i = 0; i < text.size();) {
    int len = utf8_valid_len(text, i);
    if (len == 0) len = 1;  // callers pass valid UTF-8; stay safe anyway
    const uint32_t cp = utf8_decode_at(text, i, len);
    c.cp.push_back(cp);
    c.fl.push_back(cp_props(cp));
    c.off.push_back(static_cast<uint32_t>(i));
    i += static_cast<size_t>(len);
  }
  c.off.push_back(static_cast<uint32_t>(text.size()));
  Matcher m{c, c.cp.size()};
  for (size_t i = 0; i < m.n;) {
    size_t e = m.match(i);
    if (e <= i) e = i + 1;
    out.push_back({c.off[i], c.off[e]});
    i = e;
  }
}

void split_long_input(std::string_view text, std::vector<ByteRange>& out, uint32_t max_chunk, uint32_t max_run) {
  size_t chunk_start = 0, slice_start = 0;
  uint32_t chunk_cps = 0, run_len = 0;
  bool run_space = false;
  for (size_t i = 0; i < text.size();) {
    int len = utf8_valid_len(text, i);
    if (len == 0) len = 1;
    const uint32_t cp = utf8_decode_at(text, i, len);
    if (chunk_cps == max_chunk) {  // new 400k chunk: the run state restarts
      if (slice_start < i) out.push_back({static_cast<uint32_t>(slice_start), static_cast<uint32_t>(i)});
      chunk_start = slice_start = i;
      chunk_cps = 0;
    }
    const bool sp = py_isspace(cp);
    if (i == chunk_start) {
      run_space = sp;
      run_len = 1;
    } else if (sp != run_space) {
      run_space = sp;
      run_len = 1;
    } else if (++run_len > max_run) {
      out.push_back({static_cast<uint32_t>(slice_start), static_cast<uint32_t>(i)});
      slice_start = i;
      run_len = 1;
    }
    ++chunk_cps;
    i += static_cast<size_t>(len);
  }
  if (slice_start < text.size() || text.empty())
    out.push_back({static_cast<uint32_t>(slice_start), static_cast<uint32_t>(text.size())});
}

}  // namespace k3::tok
