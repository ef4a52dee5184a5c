// response_format {"type": "json_object"}: a byte-level recognizer of JSON-object prefixes, used to
// mask candidate tokens whose bytes would leave the output no longer a prefix of one JSON object.
// Owns the grammar only. Must not: know about tokens, logits or the engine (the scheduler applies it).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace k3::server {

class JsonObjectPrefix {
 public:
  // Feeds bytes; false (and the state unchanged) when they cannot continue a JSON object.
  bool feed(std::string_view bytes);
  bool accepts(std::string_view bytes) const;  // feed on a copy
  bool complete() const { return state_ == S::Done; }

 private:
  enum class S : uint8_t {
    Start,        // before the top-level '{'
    Value,        // a value is expected
    ObjKeyOrEnd,  // after '{': a key or '}'
    ObjKey,       // after ',' in an object: a key
    Colon,        // after a key
    AfterValue,   // after a value: ',' or the closer of the innermost container
    ArrValueOrEnd,
    Str,
    StrEsc,
    StrU,  // inside \uXXXX (hex_left digits to go)
    NumMinus,
    NumZero,
    NumInt,
    NumDot,
    NumFrac,
    NumE,
    NumESign,
    NumExp,
    Lit,  // inside true / false / null
    Done
  };
  bool step(char c);
  bool end_value();  // a value just ended: the next state depends on the container
  bool number_char(char c);

  S state_ = S::Start;
  std::string stack_;  // '{' / '['
  bool key_ = false;   // the string being read is an object key
  uint8_t hex_left_ = 0;
  const char* lit_ = nullptr;  // the literal being matched and how far
  uint8_t lit_pos_ = 0;
  uint8_t ws_run_ = 0;  // consecutive whitespace outside strings (capped so output cannot spin on it)
};

}  // namespace k3::server
