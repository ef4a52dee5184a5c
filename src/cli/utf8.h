// UTF-8 checks of the text the commands take as prompts (argument, -p, -f FILE, stdin, chat lines,
// system prompts): the model's tokenizer and streamed output assume well-formed UTF-8, so invalid
// text is refused in one line naming the byte offset instead of producing stray bytes.
// Owns: the validation (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF).
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace k3::cli {

// The byte offset where the first malformed sequence starts, or nothing when `text` is valid UTF-8.
std::optional<size_t> first_invalid_utf8(std::string_view text);

// k3::Error "WHAT is not valid UTF-8: malformed sequence at byte offset N (0xHH)" when it is not.
void require_utf8(std::string_view text, const std::string& what);

}  // namespace k3::cli
