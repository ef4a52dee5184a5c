// JSON-object prefix recognizer (RFC 8259 grammar, top level an object; see json_constraint.h).
#include "server/json_constraint.h"

namespace k3::server {

namespace {
constexpr uint8_t kMaxWsRun = 8;
bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
}  // namespace

bool JsonObjectPrefix::accepts(std::string_view bytes) const {
  JsonObjectPrefix copy = *this;
  return copy.feed(bytes);
}

bool JsonObjectPrefix::feed(std::string_view bytes) {
  if (bytes.empty()) return false;  // a token that adds nothing cannot make progress
  JsonObjectPrefix saved = *this;
  for (char c : bytes) {
    if (!step(c)) {
      *this = saved;
      return false;
    }
  }
  return true;
}

bool JsonObjectPrefix::end_value() {
  if (stack_.empty()) {
    state_ = S::Done;
    return true;
  }
  state_ = S::AfterValue;
  return true;
}

bool JsonObjectPrefix::number_char(char c) {
  switch (state_) {
    case S::NumMinus:
      if (c == '0') return state_ = S::NumZero, true;
      if (is_digit(c)) return state_ = S::NumInt, true;
      return false;
    case S::NumZero:
      if (c == '.') return state_ = S::NumDot, true;
      if (c == 'e' || c == 'E') return state_ = S::NumE, true;
      break;
    case S::NumInt:
      if (is_digit(c)) return true;
      if (c == '.') return state_ = S::NumDot, true;
      if (c == 'e' || c == 'E') return state_ = S::NumE, true;
      break;
    case S::NumDot:
      return is_digit(c) ? (state_ = S::NumFrac, true) : false;
    case S::NumFrac:
      if (is_digit(c)) return true;
      if (c == 'e' || c == 'E') return state_ = S::NumE, true;
      break;
    case S::NumE:
      if (c == '+' || c == '-') return state_ = S::NumESign, true;
      return is_digit(c) ? (state_ = S::NumExp, true) : false;
    case S::NumESign:
      return is_digit(c) ? (state_ = S::NumExp, true) : false;
    case S::NumExp:
      if (is_digit(c)) return true;
      break;
    default:
      return false;
  }
  // A complete number ends here; c belongs to what follows it.
  if (!end_value()) return false;
  return step(c);
}

bool JsonObjectPrefix::step(char c) {
  const auto open_value = [&](char ch) -> bool {
    ws_run_ = 0;
    switch (ch) {
      case '{':
        stack_.push_back('{');
        state_ = S::ObjKeyOrEnd;
        return true;
      case '[':
        stack_.push_back('[');
        state_ = S::ArrValueOrEnd;
        return true;
      case '"':
        key_ = false;
        state_ = S::Str;
        return true;
      case '-':
        state_ = S::NumMinus;
        return true;
      case '0':
        state_ = S::NumZero;
        return true;
      case 't':
        lit_ = "true";
        break;
      case 'f':
        lit_ = "false";
        break;
      case 'n':
        lit_ = "null";
        break;
      default:
        if (is_digit(ch)) {
          state_ = S::NumInt;
          return true;
        }
        return false;
    }
    lit_pos_ = 1;
    state_ = S::Lit;
    return true;
  };
  const auto ws = [&]() -> bool {
    if (ws_run_ >= kMaxWsRun) return false;
    ++ws_run_;
    return true;
  };
  switch (state_) {
    case S::Done:
      return false;
    case S::Start:
      if (is_ws(c)) return ws();
      if (c != '{') return false;
      return open_value(c);
    case S::Value:
      if (is_ws(c)) return ws();
      return open_value(c);
    case S::ArrValueOrEnd:
      if (is_ws(c)) return ws();
      if (c == ']') {
        ws_run_ = 0;
        stack_.pop_back();
        return end_value();
      }
      return open_value(c);
    case S::ObjKeyOrEnd:
    case S::ObjKey:
      if (is_ws(c)) return ws();
      ws_run_ = 0;
      if (c == '}' && state_ == S::ObjKeyOrEnd) {
        stack_.pop_back();
        return end_value();
      }
      if (c != '"') return false;
      key_ = true;
      state_ = S::Str;
      return true;
    case S::Colon:
      if (is_ws(c)) return ws();
      if (c != ':') return false;
      ws_run_ = 0;
      state_ = S::Value;
      return true;
    case S::AfterValue:
      if (is_ws(c)) return ws();
      ws_run_ = 0;
      if (c == ',') {
        state_ = stack_.back() == '{' ? S::ObjKey : S::Value;
        return true;
      }
      if ((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '[')) {
        stack_.pop_back();
        return end_value();
      }
      return false;
    case S::Str:
      if (c == '"') {
        if (key_) {
          key_ = false;
          state_ = S::Colon;
          return true;
        }
        return end_value();
      }
      if (c == '\\') return state_ = S::StrEsc, true;
      return static_cast<unsigned char>(c) >= 0x20;
    case S::StrEsc:
      if (c == 'u') {
        hex_left_ = 4;
        state_ = S::StrU;
        return true;
      }
      if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't')
        return state_ = S::Str, true;
      return false;
    case S::StrU:
      if (!is_hex(c)) return false;
      if (--hex_left_ == 0) state_ = S::Str;
      return true;
    case S::Lit:
      if (lit_[lit_pos_] != c) return false;
      if (lit_[++lit_pos_] == '\0') return end_value();
      return true;
    default:
      return number_char(c);
  }
}

}  // namespace k3::server
