// XTML renderer for K3 (chat-format.md): turns messages + options into marker/text segments and ids.
// Markers (<|open|> <|close|> <|sep|> <|end_of_msg|>) are the only special ids; every other piece of
// text, including attribute values and user content, is encoded with special tokens disallowed.
#include <algorithm>

#include "chat/chat.h"
#include "core/error.h"

namespace k3::chat {

namespace {

constexpr const char* kOpen = "<|open|>";
constexpr const char* kClose = "<|close|>";
constexpr const char* kSep = "<|sep|>";
constexpr const char* kEnd = "<|end_of_msg|>";

using Attrs = std::vector<std::pair<std::string, std::string>>;

struct Out {
  std::vector<Segment> segs;
  void special(const char* m) { segs.push_back({true, m}); }
  void text(std::string t) {
    if (!t.empty()) segs.push_back({false, std::move(t)});
  }
  void open(const std::string& tag, const Attrs& attrs = {}) {
    std::string h = tag;
    for (const auto& [k, v] : attrs) h += " " + k + "=\"" + escape_attr(v) + "\"";
    special(kOpen);
    text(h);
    special(kSep);
  }
  void close(const std::string& tag) {
    special(kClose);
    text(tag);
    special(kSep);
  }
  void message(const Attrs& attrs, const std::string& body) {
    open("message", attrs);
    text(body);
    close("message");
    special(kEnd);
  }
};

std::string json_type(const nlohmann::ordered_json& v) {
  if (v.is_string()) return "string";
  if (v.is_number()) return "number";
  if (v.is_boolean()) return "boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "array";
  return "object";
}

void render_assistant(Out& o, const Message& m) {
  o.open("message", {{"role", "assistant"}});
  if (!m.reasoning.empty()) {
    o.open("think");
    o.text(m.reasoning);
    o.close("think");
  }
  if (!m.content.empty() || m.tool_calls.empty()) {
    o.open("response");
    o.text(m.content);
    o.close("response");
  }
  if (!m.tool_calls.empty()) {
    o.open("tools");
    for (size_t i = 0; i < m.tool_calls.size(); ++i) {
      const ToolCall& c = m.tool_calls[i];
      o.open("call", {{"tool", c.name}, {"index", std::to_string(i + 1)}});
      if (c.arguments.is_object()) {
        for (const auto& [k, v] : c.arguments.items()) {
          o.open("argument", {{"key", k}, {"type", json_type(v)}});
          o.text(v.is_string() ? v.get<std::string>() : v.dump());
          o.close("argument");
        }
      } else {
        o.open("json", {{"type", json_type(c.arguments)}});
        o.text(c.arguments.dump());
        o.close("json");
      }
      o.close("call");
    }
    o.close("tools");
  }
  o.close("message");
  o.special(kEnd);
}

}  // namespace

std::string escape_attr(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

std::string unescape_attr(const std::string& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    if (v.compare(i, 6, "&quot;") == 0) {
      out += '"';
      i += 6;
    } else if (v.compare(i, 5, "&amp;") == 0) {
      out += '&';
      i += 5;
    } else {
      out += v[i++];
    }
  }
  return out;
}

std::string sorted_compact_json(const nlohmann::json& j) { return j.dump(); }  // std::map keys: sorted

std::vector<Segment> render(const std::vector<Message>& msgs, const RenderOptions& opt) {
  Out o;
  const std::string& eff = opt.thinking_effort;
  if (!eff.empty() && eff != "none") {
    if (eff != "low" && eff != "medium" && eff != "high" && eff != "max")
      throw Error("chat: thinking effort '" + eff + "' is not one of low, medium, high, max, none");
    o.message({{"role", "system"}, {"type", "thinking-effort"}}, "thinking_effort=" + eff);
  }
  if (!opt.tools.is_array()) throw Error("chat: tools must be a JSON array");
  if (!opt.tools.empty()) {
    o.message({{"role", "system"}, {"type", "tool-declare"}},
              "# Tools\nHere are the available tools, described in JSONSchema.\n```json\n" +
                  sorted_compact_json(opt.tools) + "\n```");
  }
  if (opt.tool_choice_required) {
    o.message({{"role", "system"}, {"type", "tool-choice"}},
              "The system is invoked with `tool_choice=required`. You MUST call tools.");
  }
  const Message* last_assistant = nullptr;
  for (size_t i = 0; i < msgs.size();) {
    const Message& m = msgs[i];
    if (m.role == "system" || m.role == "user") {
      o.message({{"role", m.role}}, m.content);
      ++i;
    } else if (m.role == "assistant") {
      render_assistant(o, m);
      last_assistant = &m;
      ++i;
    } else if (m.role == "tool") {
      // a run of tool results: render in the order of the calls they answer
      std::vector<std::pair<size_t, const Message*>> run;
      for (; i < msgs.size() && msgs[i].role == "tool"; ++i) {
        const Message& t = msgs[i];
        size_t idx = run.size() + 1;
        if (!t.tool_call_id.empty()) {
          bool found = false;
          for (size_t k = 0; last_assistant && k < last_assistant->tool_calls.size(); ++k) {
            if (last_assistant->tool_calls[k].id == t.tool_call_id) {
              idx = k + 1;
              found = true;
            }
          }
          if (!found)
            throw Error("chat: tool message " + std::to_string(i) + " answers unknown tool_call_id '" + t.tool_call_id +
                        "'");
        }
        run.emplace_back(idx, &t);
      }
      std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& [idx, t] : run) {
        std::string name = t->name;
        if (name.empty() && last_assistant && idx - 1 < last_assistant->tool_calls.size())
          name = last_assistant->tool_calls[idx - 1].name;
        o.message({{"role", "tool"}, {"tool", name}, {"index", std::to_string(idx)}}, t->content);
      }
    } else {
      throw Error("chat: message " + std::to_string(i) + " has unknown role '" + m.role + "'");
    }
  }
  if (opt.add_generation_prompt) {
    o.open("message", {{"role", "assistant"}});
    o.open(opt.thinking && eff != "none" ? "think" : "response");
  }
  return o.segs;
}

std::string segments_text(const std::vector<Segment>& segs) {
  std::string s;
  for (const auto& g : segs) s += g.text;
  return s;
}

std::string segments_review_text(const std::vector<Segment>& segs) {
  std::string s;
  for (const auto& g : segs) {
    if (g.special) {
      s += g.text;
      continue;
    }
    for (size_t i = 0; i < g.text.size(); ++i) {
      s += g.text[i];
      if (g.text[i] == '<' && i + 1 < g.text.size() && g.text[i + 1] == '|') s += '\\';
    }
  }
  return s;
}

std::vector<tok::TokenId> segments_ids(const tok::Tokenizer& tok, const std::vector<Segment>& segs) {
  std::vector<tok::TokenId> ids;
  for (const auto& g : segs) {
    if (g.special)
      ids.push_back(tok.require_special(g.text));
    else
      tok.encode_append(g.text, ids);
  }
  return ids;
}

namespace {

std::string content_text(const nlohmann::json& c, const std::string& where) {
  if (c.is_null()) return "";
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {
    std::string s;
    for (const auto& part : c) {
      if (!part.is_object() || !part.contains("text") || !part["text"].is_string())
        throw Error("chat: " + where + ".content has a part without a string 'text' (only text parts are supported)");
      s += part["text"].get<std::string>();
    }
    return s;
  }
  throw Error("chat: " + where + ".content must be a string, an array of text parts or null");
}

std::string str_field(const nlohmann::json& o, const char* key, const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return "";
  if (!o[key].is_string()) throw Error("chat: " + where + "." + key + " must be a string");
  return o[key].get<std::string>();
}

}  // namespace

std::vector<Message> messages_from_json(const nlohmann::json& messages) {
  if (!messages.is_array()) throw Error("chat: messages must be a JSON array");
  std::vector<Message> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& j = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!j.is_object()) throw Error("chat: " + where + " must be an object");
    Message m;
    m.role = str_field(j, "role", where);
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool")
      throw Error("chat: " + where + ".role '" + m.role + "' is not system, user, assistant or tool");
    if (j.contains("content")) m.content = content_text(j["content"], where);
    m.reasoning = str_field(j, "reasoning_content", where);
    if (m.reasoning.empty()) m.reasoning = str_field(j, "reasoning", where);
    m.tool_call_id = str_field(j, "tool_call_id", where);
    m.name = str_field(j, "name", where);
    if (j.contains("tool_calls") && !j["tool_calls"].is_null()) {
      if (!j["tool_calls"].is_array()) throw Error("chat: " + where + ".tool_calls must be an array");
      for (size_t k = 0; k < j["tool_calls"].size(); ++k) {
        const auto& tc = j["tool_calls"][k];
        const std::string w = where + ".tool_calls[" + std::to_string(k) + "]";
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object())
          throw Error("chat: " + w + " has no function object");
        ToolCall c;
        c.id = str_field(tc, "id", w);
        c.name = str_field(tc["function"], "name", w + ".function");
        if (c.name.empty()) throw Error("chat: " + w + ".function.name is missing");
        const auto& a = tc["function"].contains("arguments") ? tc["function"]["arguments"] : nlohmann::json::object();
        if (a.is_string()) {
          const std::string s = a.get<std::string>();
          c.arguments = s.empty() ? nlohmann::ordered_json::object() : nlohmann::ordered_json::parse(s, nullptr, false);
          if (c.arguments.is_discarded()) throw Error("chat: " + w + ".function.arguments is not valid JSON");
          c.arguments_text = s;
        } else {
          c.arguments = nlohmann::ordered_json::parse(a.dump());
        }
        m.tool_calls.push_back(std::move(c));
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

RenderOptions options_from_json(const nlohmann::json& req) {
  RenderOptions o;
  if (!req.is_object()) throw Error("chat: request must be a JSON object");
  if (req.contains("tools") && !req["tools"].is_null()) {
    if (!req["tools"].is_array()) throw Error("chat: tools must be an array");
    o.tools = req["tools"];
  }
  if (req.contains("reasoning_effort") && !req["reasoning_effort"].is_null()) {
    if (!req["reasoning_effort"].is_string()) throw Error("chat: reasoning_effort must be a string");
    o.thinking_effort = req["reasoning_effort"].get<std::string>();
    if (o.thinking_effort == "none") o.thinking = false;
  }
  auto flag = [&](const nlohmann::json& obj, const char* key) {
    if (obj.is_object() && obj.contains(key) && obj[key].is_boolean() && !obj[key].get<bool>()) o.thinking = false;
  };
  flag(req, "thinking");
  if (req.contains("chat_template_kwargs")) {
    flag(req["chat_template_kwargs"], "enable_thinking");
    flag(req["chat_template_kwargs"], "thinking");
  }
  if (req.contains("tool_choice") && req["tool_choice"].is_string() && req["tool_choice"] == "required")
    o.tool_choice_required = true;
  return o;
}

}  // namespace k3::chat
