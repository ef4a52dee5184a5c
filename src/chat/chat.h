// K3 XTML chat format: renders messages (system, user, assistant with reasoning and tool calls, tool
// results, tool declarations, thinking effort) into segments/ids, and parses model output back
// incrementally (one state machine for streaming and one-shot). Owns no tokenization rules beyond
// "markers are special ids, everything else is ordinary text"; no tensor code.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace k3::chat {

struct ToolCall {
  std::string id;  // OpenAI call id (kept internal; the prompt uses index)
  std::string name;
  nlohmann::ordered_json arguments;  // usually an object; other JSON values use a json body
};

struct Message {
  std::string role;  // system | user | assistant | tool
  std::string content;
  std::string reasoning;             // assistant
  std::vector<ToolCall> tool_calls;  // assistant
  std::string tool_call_id;          // tool
  std::string name;                  // tool: function name (optional when tool_call_id resolves)
};

struct RenderOptions {
  nlohmann::json tools = nlohmann::json::array();  // OpenAI tool declarations
  std::string thinking_effort;  // "" (no effort message), low, medium, high, max, or none (= non-thinking)
  bool thinking = true;         // generation prompt opens think (true) or response (false)
  bool add_generation_prompt = true;
  bool tool_choice_required = false;
};

// Text segments are encoded with special tokens disallowed; special segments are one marker id.
struct Segment {
  bool special = false;
  std::string text;
};

std::vector<Segment> render(const std::vector<Message>& msgs, const RenderOptions& opt);
// Plain concatenation (markers appear as their names).
std::string segments_text(const std::vector<Segment>& segs);
// Review form for goldens: like segments_text, but "<|" inside ordinary text is written "<\|".
std::string segments_review_text(const std::vector<Segment>& segs);
std::vector<tok::TokenId> segments_ids(const tok::Tokenizer& tok, const std::vector<Segment>& segs);

// OpenAI-style request JSON -> messages/options. Throws k3::Error naming the bad field.
std::vector<Message> messages_from_json(const nlohmann::json& messages);
RenderOptions options_from_json(const nlohmann::json& request);

std::string escape_attr(const std::string& v);  // & -> &amp;, " -> &quot;
std::string unescape_attr(const std::string& v);
// Compact JSON with keys sorted at every depth (tool declarations).
std::string sorted_compact_json(const nlohmann::json& j);

// ---- parsing model output ----
enum class EventKind { Reasoning, Content, ToolCallStart, ToolArgs, ToolCallEnd };

struct Event {
  EventKind kind;
  std::string text;  // deltas; tool name for ToolCallStart
  int call = -1;     // 0-based call number within the message (tool events)
};

struct ParsedCall {
  std::string name;
  std::string arguments;  // JSON text
  bool complete = false;
};

struct ParseResult {
  std::string reasoning, content;
  std::vector<ParsedCall> calls;
  bool finished_message = false;  // saw <|close|>message<|sep|> or <|end_of_msg|>
};

class OutputParser {
 public:
  // thinking_prompt: the generation prompt opened `think` (reasoning first); else `response`.
  explicit OutputParser(bool thinking_prompt = true);
  std::vector<Event> feed(std::string_view text);
  std::vector<Event> finish();
  const ParseResult& result() const { return result_; }

 private:
  enum class State { Between, Reasoning, Content, Tools, Call, Arg, JsonBody, Done };
  void emit_text(std::string_view t, std::vector<Event>& ev);
  void on_marker(bool open, bool close, const std::string& header, std::vector<Event>& ev);
  void begin_call(const std::string& name, std::vector<Event>& ev);
  void finish_arg(std::vector<Event>& ev);
  void end_call(std::vector<Event>& ev);
  void push(std::vector<Event>& ev, EventKind k, std::string text);

  State state_;
  std::string buf_;         // undecided input (a possible partial marker)
  std::string between_ws_;  // whitespace seen between sections, dropped if a marker follows
  bool saw_reasoning_text_ = false;
  int call_ = -1;
  int args_in_call_ = 0;
  bool call_open_ = false;
  bool json_body_ = false;
  std::string arg_key_, arg_type_, arg_value_;
  bool arg_streaming_ = false;
  ParseResult result_;
};

// Merges consecutive deltas of the same kind and call (streaming and one-shot compare equal this way).
std::vector<Event> coalesce(const std::vector<Event>& ev);
ParseResult parse_output(std::string_view text, bool thinking_prompt = true);

}  // namespace k3::chat
