// Kimi pre-tokenizer: a hand-written matcher for the split pattern of spec §4 (leftmost-first,
// backtracking semantics of the reference regex engine), plus the long-input chunking rules of the
// Python tokenizer. Works on valid UTF-8 only; knows nothing about ranks or special tokens.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace k3::tok {

struct ByteRange {
  uint32_t begin, end;
};

// Splits valid UTF-8 `text` into regex pieces; appends byte ranges (relative to text) to `out`.
void split_pieces(std::string_view text, std::vector<ByteRange>& out);

// Long-input rule of tokenization_kimi.py: cut into chunks of at most 400,000 code points, then cut
// runs of more than 25,000 consecutive Python-isspace / non-space code points. Appends ranges.
void split_long_input(std::string_view text, std::vector<ByteRange>& out, uint32_t max_chunk = 400000,
                      uint32_t max_run = 25000);

// Well-formed UTF-8 decoding helpers. utf8_valid_len: length of the well-formed sequence at s[i]
// (1..4), or 0 when the byte at i does not start one.
int utf8_valid_len(std::string_view s, size_t i);
uint32_t utf8_decode_at(std::string_view s, size_t i, int len);

}  // namespace k3::tok
