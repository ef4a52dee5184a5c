// The Kimi K2 chat template (docs/chat-k2.md): renderer, Python-style JSON for the template's
// `tojson`, and the incremental output parser (think section, content, tool-call section).
// Markers are special ids; every other piece of text (user content, names, ids, arguments) is
// ordinary text, so content that spells a marker never becomes one.
#include <algorithm>
#include <array>

#include "chat/chat.h"
#include "core/error.h"

namespace k3::chat {

namespace {

constexpr const char* kSystem = "<|im_system|>";
constexpr const char* kUser = "<|im_user|>";
constexpr const char* kAssistant = "<|im_assistant|>";
constexpr const char* kMiddle = "<|im_middle|>";
constexpr const char* kEnd = "<|im_end|>";
constexpr const char* kSectionBegin = "<|tool_calls_section_begin|>";
constexpr const char* kSectionEnd = "<|tool_calls_section_end|>";
constexpr const char* kCallBegin = "<|tool_call_begin|>";
constexpr const char* kArgBegin = "<|tool_call_argument_begin|>";
constexpr const char* kCallEnd = "<|tool_call_end|>";
constexpr const char* kDefaultSystem = "You are Kimi, an AI assistant created by Moonshot AI.";
// The text between the tool_declare header and the JSON, as the template's whitespace leaves it.
constexpr const char* kToolsPreamble = "\n  # Tools\n  ";
// The text between "## Return of ID" and the tool result (the template's line break + indent).
constexpr const char* kReturnSep = "\n    ";

void py_string(const std::string& s, std::string& out) { out += '"' + json_escape(s, true) + '"'; }

template <class J>
void py_json(const J& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      py_string(it.key(), out);
      out += ": ";
      py_json(it.value(), out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ", ";
      py_json(v[i], out);
    }
    out += ']';
  } else if (v.is_string()) {
    py_string(v.template get<std::string>(), out);
  } else {
    out += v.dump();  // numbers, booleans, null: the same text in both
  }
}

struct Out {
  std::vector<Segment> segs;
  void special(const char* m) { segs.push_back({true, m}); }
  void text(const std::string& t) {
    if (!t.empty()) segs.push_back({false, t});
  }
  void header(const char* marker, const std::string& name) {
    special(marker);
    text(name);
    special(kMiddle);
  }
};

}  // namespace

std::string python_json(const nlohmann::ordered_json& v) {
  std::string s;
  py_json(v, s);
  return s;
}

std::string python_json(const nlohmann::json& v) {
  std::string s;
  py_json(v, s);
  return s;
}

std::string k2_call_name(const std::string& id) {
  const size_t colon = id.rfind(':');
  std::string head = colon == std::string::npos ? id : id.substr(0, colon);
  const size_t dot = head.rfind('.');
  return dot == std::string::npos ? head : head.substr(dot + 1);
}

std::vector<Segment> render_k2(const std::vector<Message>& msgs, const RenderOptions& opt) {
  Out o;
  if (!opt.tools.is_array()) throw Error("chat: tools must be a JSON array");
  if (!opt.tools.empty()) {
    // Kimi's tokenizer sorts the keys of the tools at every depth before rendering (deep_sort_dict):
    // nlohmann::json holds them sorted already.
    o.header(kSystem, "tool_declare");
    o.text(std::string(kToolsPreamble) + python_json(opt.tools));
    o.special(kEnd);
  }
  for (size_t i = 0; i < msgs.size(); ++i) {
    const Message& m = msgs[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool")
      throw Error("chat: message " + std::to_string(i) + " has unknown role '" + m.role + "'");
    if (i == 0 && m.role != "system") {
      o.header(kSystem, "system");
      o.text(kDefaultSystem);
      o.special(kEnd);
    }
    const std::string& role_name = m.name.empty() ? m.role : m.name;
    o.header(m.role == "user" ? kUser : m.role == "assistant" ? kAssistant : kSystem, role_name);
    if (m.role == "assistant" && !m.tool_calls.empty()) {
      o.text(m.content);
      o.special(kSectionBegin);
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        const ToolCall& c = m.tool_calls[k];
        o.special(kCallBegin);
        o.text(c.id.empty() ? "functions." + c.name + ":" + std::to_string(k) : c.id);
        o.special(kArgBegin);
        o.text(c.arguments_text ? *c.arguments_text
                                : c.arguments.is_string() ? c.arguments.get<std::string>() : python_json(c.arguments));
        o.special(kCallEnd);
      }
      o.special(kSectionEnd);
    } else if (m.role == "tool") {
      o.text("## Return of " + m.tool_call_id + kReturnSep + m.content);
    } else {
      o.text(m.content);  // the template has no reasoning section: an assistant's reasoning is dropped
    }
    o.special(kEnd);
  }
  if (opt.add_generation_prompt) o.header(kAssistant, "assistant");
  return o.segs;
}

// ---- parser

namespace {

constexpr std::array<std::string_view, 9> kMarkers = {
    "<|im_end|>",          "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    // the singular spelling some K2 outputs use (vLLM's kimi_k2 parser accepts both)
    "<|tool_call_section_begin|>", "<|tool_call_section_end|>", "<|im_middle|>"};
constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr size_t kMaxId = 1024;  // a longer call id is not an id: the call is named by what came

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && is_ws(s[a])) ++a;
  while (b > a && is_ws(s[b - 1])) --b;
  return s.substr(a, b - a);
}

}  // namespace

K2OutputParser::K2OutputParser(bool reasoning_first) : state_(reasoning_first ? State::Reasoning : State::Start) {}

void K2OutputParser::text(std::string_view t, std::vector<Event>& ev) {
  if (t.empty()) return;
  switch (state_) {
    case State::Start: {
      size_t k = 0;
      while (k < t.size() && is_ws(t[k])) ++k;
      start_ws_.append(t.substr(0, k));
      if (k == t.size()) break;
      state_ = State::Content;
      std::string s = start_ws_ + std::string(t.substr(k));
      start_ws_.clear();
      push(ev, EventKind::Content, std::move(s));
      break;
    }
    case State::Reasoning:
      push(ev, EventKind::Reasoning, std::string(t));
      break;
    case State::Content:
      push(ev, EventKind::Content, std::string(t));
      break;
    case State::CallId:
      if (id_.size() < kMaxId) id_.append(t.substr(0, kMaxId - id_.size()));
      break;
    case State::Args: {
      if (!args_started_) {  // whitespace between the argument marker and the JSON is not part of it
        size_t k = 0;
        while (k < t.size() && is_ws(t[k])) ++k;
        t = t.substr(k);
        if (t.empty()) break;
        args_started_ = true;
      }
      push(ev, EventKind::ToolArgs, std::string(t));
      break;
    }
    case State::Section:
    case State::Done:
      break;  // text between calls, or after the end of the message, is not content
  }
}

void K2OutputParser::begin_call(std::vector<Event>& ev) {
  const std::string id = trim(id_);
  id_.clear();
  ++call_;
  call_open_ = true;
  args_started_ = false;
  ids_.push_back(id);
  push(ev, EventKind::ToolCallStart, k2_call_name(id));
  state_ = State::Args;
}

void K2OutputParser::end_call(std::vector<Event>& ev) {
  if (state_ == State::CallId) begin_call(ev);  // an id without arguments: a call with none
  if (!call_open_) return;
  push(ev, EventKind::ToolCallEnd, "");
  call_open_ = false;
  state_ = State::Section;
}

void K2OutputParser::marker(std::string_view m, std::vector<Event>& ev) {
  if (state_ == State::Done) return;
  if (state_ == State::Start) start_ws_.clear();
  if (m == kThinkOpen) {
    state_ = State::Reasoning;
  } else if (m == kThinkClose) {
    state_ = State::Content;
  } else if (m == "<|im_end|>") {
    end_call(ev);
    state_ = State::Done;
    result_.finished_message = true;
  } else if (m == "<|tool_calls_section_begin|>" || m == "<|tool_call_section_begin|>") {
    end_call(ev);
    state_ = State::Section;
  } else if (m == "<|tool_calls_section_end|>" || m == "<|tool_call_section_end|>") {
    end_call(ev);
    state_ = State::Content;  // text after the section (before <|im_end|>) is content
  } else if (m == "<|tool_call_begin|>") {
    end_call(ev);
    id_.clear();
    state_ = State::CallId;
  } else if (m == "<|tool_call_argument_begin|>") {
    if (state_ == State::CallId) begin_call(ev);
  } else if (m == "<|tool_call_end|>") {
    end_call(ev);
  }
  // <|im_middle|> or a marker out of place: structural, dropped
}

std::vector<Event> K2OutputParser::feed(std::string_view input) {
  std::vector<Event> ev;
  buf_.append(input);
  size_t i = 0;
  while (i < buf_.size()) {
    const size_t lt = buf_.find('<', i);
    if (lt == std::string::npos) {
      text(std::string_view(buf_).substr(i), ev);
      i = buf_.size();
      break;
    }
    text(std::string_view(buf_).substr(i, lt - i), ev);
    const std::string_view rest = std::string_view(buf_).substr(lt);
    // <think> only opens reasoning at the start of the reply, </think> only closes it.
    std::vector<std::string_view> live(kMarkers.begin(), kMarkers.end());
    if (state_ == State::Start) live.push_back(kThinkOpen);
    if (state_ == State::Reasoning) live.push_back(kThinkClose);
    bool matched = false, partial = false;
    for (std::string_view m : live) {
      if (rest.substr(0, m.size()) == m) {
        marker(m, ev);
        i = lt + m.size();
        matched = true;
        break;
      }
      if (rest.size() < m.size() && m.substr(0, rest.size()) == rest) partial = true;
    }
    if (matched) continue;
    if (partial) {  // could still become a marker
      i = lt;
      break;
    }
    text("<", ev);
    i = lt + 1;
  }
  buf_.erase(0, i);
  return ev;
}

std::vector<Event> K2OutputParser::finish() {
  std::vector<Event> ev;
  std::string rest;
  rest.swap(buf_);
  // A marker prefix left at the end is text in content or reasoning, structure inside a call.
  const bool in_call = state_ == State::CallId || state_ == State::Args || state_ == State::Section;
  if (!(in_call && rest.rfind("<|", 0) == 0)) text(rest, ev);
  if (state_ == State::Start && !start_ws_.empty()) {
    push(ev, EventKind::Content, start_ws_);
    start_ws_.clear();
  }
  if (state_ == State::CallId || call_open_) end_call(ev);
  return ev;
}

}  // namespace k3::chat
