// Incremental XTML output parser (chat-format.md): one state machine serves streaming and one-shot
// parsing. Holds back a possible partial marker until it is decided, never lets structural text reach
// content/reasoning, tolerates missing think/response/argument closers, decodes argument values by type.
#include <array>

#include "chat/chat.h"

namespace k3::chat {

namespace {

constexpr std::string_view kOpen = "<|open|>", kClose = "<|close|>", kSep = "<|sep|>", kEnd = "<|end_of_msg|>";
constexpr size_t kMaxHeader = 4096;  // a longer "header" is not a marker

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }


std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && is_ws(s[a])) ++a;
  while (b > a && is_ws(s[b - 1])) --b;
  return s.substr(a, b - a);
}

// Argument value -> JSON text, by the declared type; values that do not fit become JSON strings.
std::string coerce_value(const std::string& type, const std::string& raw) {
  const std::string t = trim(raw);
  auto as_string = [&] { return "\"" + json_escape(raw) + "\""; };
  if (type == "boolean") {
    if (t == "true" || t == "True") return "true";
    if (t == "false" || t == "False") return "false";
    return as_string();
  }
  if (type == "null") return t.empty() || t == "null" ? "null" : as_string();
  auto j = nlohmann::ordered_json::parse(t, nullptr, false);
  if (j.is_discarded()) return as_string();
  if (type == "number" && !j.is_number()) return as_string();
  if (type == "object" && !j.is_object()) return as_string();
  if (type == "array" && !j.is_array()) return as_string();
  return j.dump();
}

struct Header {
  std::string tag;
  std::map<std::string, std::string> attrs;
};

Header parse_header(const std::string& h) {
  Header out;
  size_t i = 0;
  while (i < h.size() && h[i] != ' ') ++i;
  out.tag = h.substr(0, i);
  while (i < h.size()) {
    while (i < h.size() && h[i] == ' ') ++i;
    const size_t eq = h.find("=\"", i);
    if (eq == std::string::npos) break;
    const size_t end = h.find('"', eq + 2);
    if (end == std::string::npos) break;
    out.attrs[h.substr(i, eq - i)] = unescape_attr(h.substr(eq + 2, end - eq - 2));
    i = end + 1;
  }
  return out;
}

bool proper_prefix_of_marker(std::string_view rest) {
  for (std::string_view m : {kOpen, kClose, kSep, kEnd}) {
    if (rest.size() < m.size() && m.substr(0, rest.size()) == rest) return true;
  }
  return false;
}

}  // namespace

std::string json_escape(std::string_view s, bool short_bf) {
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
      case '\f':
        if (short_bf) {
          out += c == '\b' ? "\\b" : "\\f";
          break;
        }
        [[fallthrough]];
      default:
        if (c < 0x20) {
          static const char* hex = "0123456789abcdef";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  return out;
}

OutputParser::OutputParser(bool thinking_prompt) : state_(thinking_prompt ? State::Reasoning : State::Content) {}

void StreamParser::push(std::vector<Event>& ev, EventKind k, std::string text) {
  switch (k) {
    case EventKind::Reasoning:
      result_.reasoning += text;
      break;
    case EventKind::Content:
      result_.content += text;
      break;
    case EventKind::ToolCallStart:
      result_.calls.push_back({text, "", false});
      break;
    case EventKind::ToolArgs:
      result_.calls[static_cast<size_t>(call_)].arguments += text;
      break;
    case EventKind::ToolCallEnd:
      result_.calls[static_cast<size_t>(call_)].complete = true;
      break;
  }
  ev.push_back({k, std::move(text), k == EventKind::Reasoning || k == EventKind::Content ? -1 : call_});
}

void OutputParser::emit_text(std::string_view t, std::vector<Event>& ev) {
  if (t.empty()) return;
  switch (state_) {
    case State::Reasoning:
      for (char c : t) saw_reasoning_text_ |= !is_ws(c);
      push(ev, EventKind::Reasoning, std::string(t));
      break;
    case State::Content:
      push(ev, EventKind::Content, std::string(t));
      break;
    case State::Between: {
      size_t k = 0;
      while (k < t.size() && is_ws(t[k])) ++k;
      between_ws_.append(t.substr(0, k));
      if (k == t.size()) break;
      state_ = State::Content;  // text after a closed section without an opener: content
      std::string s = between_ws_ + std::string(t.substr(k));
      between_ws_.clear();
      push(ev, EventKind::Content, std::move(s));
      break;
    }
    case State::Arg:
      if (arg_streaming_)
        push(ev, EventKind::ToolArgs, json_escape(t));
      else
        arg_value_.append(t);
      break;
    case State::JsonBody:
      push(ev, EventKind::ToolArgs, std::string(t));
      break;
    case State::Tools:
    case State::Call:
    case State::Done:
      break;  // text between structural markers is not content
  }
}

void OutputParser::begin_call(const std::string& name, std::vector<Event>& ev) {
  ++call_;
  args_in_call_ = 0;
  json_body_ = false;
  call_open_ = true;
  push(ev, EventKind::ToolCallStart, name);
  state_ = State::Call;
}

void OutputParser::finish_arg(std::vector<Event>& ev) {
  if (arg_streaming_)
    push(ev, EventKind::ToolArgs, "\"");
  else
    push(ev, EventKind::ToolArgs, coerce_value(arg_type_, arg_value_));
  arg_streaming_ = false;
  arg_value_.clear();
  ++args_in_call_;
  state_ = State::Call;
}

void OutputParser::end_call(std::vector<Event>& ev) {
  if (!call_open_) return;
  if (state_ == State::Arg) finish_arg(ev);
  if (!json_body_) push(ev, EventKind::ToolArgs, args_in_call_ ? "}" : "{}");
  push(ev, EventKind::ToolCallEnd, "");
  call_open_ = false;
  state_ = State::Tools;
}

void OutputParser::on_marker(bool open, bool close, const std::string& header, std::vector<Event>& ev) {
  between_ws_.clear();
  if (state_ == State::Done) return;
  const Header h = parse_header(header);
  const std::string& tag = h.tag;
  const bool in_call = state_ == State::Call || state_ == State::Arg || state_ == State::JsonBody;
  if (!open && !close) {  // <|end_of_msg|>
    end_call(ev);
    state_ = State::Done;
    result_.finished_message = true;
    return;
  }
  if (close) {
    if (tag == "message") {
      end_call(ev);
      state_ = State::Done;
      result_.finished_message = true;
    } else if (tag == "think" && state_ == State::Reasoning) {
      state_ = State::Between;
    } else if (tag == "response" && state_ == State::Content) {
      state_ = State::Between;
    } else if (tag == "argument" && state_ == State::Arg) {
      finish_arg(ev);
    } else if (tag == "json" && state_ == State::JsonBody) {
      state_ = State::Call;
    } else if (tag == "call" && in_call) {
      end_call(ev);
    } else if (tag == "tools" && (in_call || state_ == State::Tools)) {
      end_call(ev);
      state_ = State::Between;
    }
    return;  // any other closer is structural noise: dropped
  }
  // openers
  if (tag == "think") {
    if (state_ == State::Between || (state_ == State::Content && result_.content.empty())) state_ = State::Reasoning;
  } else if (tag == "response") {
    if (state_ == State::Between || state_ == State::Reasoning) state_ = State::Content;
  } else if (tag == "tools") {
    if (in_call) end_call(ev);
    if (state_ != State::Done) state_ = State::Tools;
  } else if (tag == "call") {
    if (in_call) end_call(ev);
    auto it = h.attrs.find("tool");
    begin_call(it == h.attrs.end() ? "" : it->second, ev);
  } else if (tag == "argument" && (state_ == State::Call || state_ == State::Arg)) {
    if (state_ == State::Arg) finish_arg(ev);
    auto k = h.attrs.find("key");
    auto t = h.attrs.find("type");
    arg_type_ = t == h.attrs.end() ? "string" : t->second;
    const std::string key = k == h.attrs.end() ? "" : k->second;
    push(ev, EventKind::ToolArgs, std::string(args_in_call_ ? "," : "{") + "\"" + json_escape(key) + "\":");
    arg_streaming_ = arg_type_ == "string";
    if (arg_streaming_) push(ev, EventKind::ToolArgs, "\"");
    arg_value_.clear();
    state_ = State::Arg;
  } else if (tag == "json" && state_ == State::Call && args_in_call_ == 0 && !json_body_) {
    json_body_ = true;
    state_ = State::JsonBody;
  } else if (tag == "message") {
    end_call(ev);
    state_ = State::Done;
  }
}

std::vector<Event> OutputParser::feed(std::string_view text) {
  std::vector<Event> ev;
  buf_.append(text);
  size_t i = 0;
  while (i < buf_.size()) {
    const size_t lt = buf_.find('<', i);
    if (lt == std::string::npos) {
      emit_text(std::string_view(buf_).substr(i), ev);
      i = buf_.size();
      break;
    }
    emit_text(std::string_view(buf_).substr(i, lt - i), ev);
    const std::string_view rest = std::string_view(buf_).substr(lt);
    if (rest.substr(0, kEnd.size()) == kEnd) {
      on_marker(false, false, "", ev);
      i = lt + kEnd.size();
      continue;
    }
    const bool op = rest.substr(0, kOpen.size()) == kOpen, cl = rest.substr(0, kClose.size()) == kClose;
    if (op || cl) {
      const size_t hs = lt + (op ? kOpen.size() : kClose.size());
      const size_t nxt = buf_.find("<|", hs);
      if (nxt == std::string::npos || proper_prefix_of_marker(std::string_view(buf_).substr(nxt))) {
        if (nxt == std::string::npos && buf_.size() - hs > kMaxHeader) {
          i = hs;  // no separator within reach: not a marker; drop the opener
          continue;
        }
        i = lt;  // header still arriving
        break;
      }
      if (buf_.compare(nxt, kSep.size(), kSep) == 0 && nxt - hs <= kMaxHeader) {
        on_marker(op, cl, buf_.substr(hs, nxt - hs), ev);
        i = nxt + kSep.size();
      } else {
        i = hs;  // malformed (another marker before <|sep|>): drop the opener only
      }
      continue;
    }
    if (rest.substr(0, kSep.size()) == kSep) {  // stray separator
      i = lt + kSep.size();
      continue;
    }
    if (proper_prefix_of_marker(rest)) {  // could still become a marker
      i = lt;
      break;
    }
    emit_text("<", ev);
    i = lt + 1;
  }
  buf_.erase(0, i);
  return ev;
}

std::vector<Event> OutputParser::finish() {
  std::vector<Event> ev;
  std::string rest;
  rest.swap(buf_);
  const std::string_view r = rest;
  // An unfinished <|open|>/<|close|> header is structural: dropped. A bare marker prefix is text.
  if (!(r.substr(0, kOpen.size()) == kOpen || r.substr(0, kClose.size()) == kClose)) emit_text(r, ev);
  between_ws_.clear();
  end_call(ev);
  return ev;
}

std::vector<Event> coalesce(const std::vector<Event>& ev) {
  std::vector<Event> out;
  for (const auto& e : ev) {
    const bool delta = e.kind == EventKind::Reasoning || e.kind == EventKind::Content || e.kind == EventKind::ToolArgs;
    if (delta && e.text.empty()) continue;
    if (delta && !out.empty() && out.back().kind == e.kind && out.back().call == e.call) {
      out.back().text += e.text;
    } else {
      out.push_back(e);
    }
  }
  return out;
}

ParseResult parse_output(std::string_view text, bool thinking_prompt) {
  OutputParser p(thinking_prompt);
  p.feed(text);
  p.finish();
  return p.result();
}

}  // namespace k3::chat
