// Chat formats: renders messages (system, user, assistant with reasoning and tool calls, tool
// results, tool declarations, thinking effort) into segments/ids, and parses model output back
// incrementally (one state machine per format for streaming and one-shot). Two formats behind one
// interface (ChatFormat): K3's XTML (chat-format.md; render.cpp, parser.cpp) and the Kimi K2 chat
// template that Kimi Linear's checkpoint uses (docs/chat-k2.md; k2.cpp). Owns no tokenization rules
// beyond "markers are special ids, everything else is ordinary text"; no tensor code.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
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
  // The arguments exactly as given when they came as a JSON string (OpenAI requests) or as the model
  // wrote them; the K2 template renders a string verbatim. Empty = render `arguments`.
  std::optional<std::string> arguments_text;
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

// A streaming parser of one assistant reply: feed() text as it is detokenized (special markers kept
// as their text), finish() at the end; result() is everything parsed so far.
class StreamParser {
 public:
  virtual ~StreamParser() = default;
  virtual std::vector<Event> feed(std::string_view text) = 0;
  virtual std::vector<Event> finish() = 0;
  const ParseResult& result() const { return result_; }

 protected:
  // Appends an event and mirrors it into result_ (a tool-call event belongs to call call_).
  void push(std::vector<Event>& ev, EventKind k, std::string text);
  ParseResult result_;
  int call_ = -1;  // the call being parsed (index into result_.calls)
};

// The XTML parser.
class OutputParser : public StreamParser {
 public:
  // thinking_prompt: the generation prompt opened `think` (reasoning first); else `response`.
  explicit OutputParser(bool thinking_prompt = true);
  std::vector<Event> feed(std::string_view text) override;
  std::vector<Event> finish() override;

 private:
  enum class State { Between, Reasoning, Content, Tools, Call, Arg, JsonBody, Done };
  void emit_text(std::string_view t, std::vector<Event>& ev);
  void on_marker(bool open, bool close, const std::string& header, std::vector<Event>& ev);
  void begin_call(const std::string& name, std::vector<Event>& ev);
  void finish_arg(std::vector<Event>& ev);
  void end_call(std::vector<Event>& ev);

  State state_;
  std::string buf_;         // undecided input (a possible partial marker)
  std::string between_ws_;  // whitespace seen between sections, dropped if a marker follows
  bool saw_reasoning_text_ = false;
  int args_in_call_ = 0;
  bool call_open_ = false;
  bool json_body_ = false;
  std::string arg_key_, arg_type_, arg_value_;
  bool arg_streaming_ = false;
};

// Merges consecutive deltas of the same kind and call (streaming and one-shot compare equal this way).
std::vector<Event> coalesce(const std::vector<Event>& ev);
ParseResult parse_output(std::string_view text, bool thinking_prompt = true);

// ---- Kimi K2 chat template (docs/chat-k2.md) ----
std::vector<Segment> render_k2(const std::vector<Message>& msgs, const RenderOptions& opt);
// Python json.dumps(v, ensure_ascii=False) with its default separators (", ", ": "): what the HF
// chat-template `tojson` filter writes. Keys in the order the value holds them.
// The body of a JSON string for `s` (no quotes): ", \\, \\n, \\r, \\t escaped, other controls as \\u00XX
// (\\b and \\f as such when short_bf, as Python's json.dumps writes them); UTF-8 passes through.
std::string json_escape(std::string_view s, bool short_bf = false);
std::string python_json(const nlohmann::ordered_json& v);
std::string python_json(const nlohmann::json& v);  // keys sorted (std::map order = code point order)
// The function name of a K2 call id "functions.NAME:IDX" (the text before the last ':', after its
// last '.'); an id without ':' is taken whole.
std::string k2_call_name(const std::string& id);

// K2 output: optional <think>...</think> first, then content, then a tool-call section
// <|tool_calls_section_begin|> (<|tool_call_begin|>ID<|tool_call_argument_begin|>JSON<|tool_call_end|>)*
// <|tool_calls_section_end|>, then <|im_end|>. Arguments stream as raw JSON text.
class K2OutputParser : public StreamParser {
 public:
  // reasoning_first: the prompt already opened <think> (the reply starts inside reasoning).
  explicit K2OutputParser(bool reasoning_first = false);
  std::vector<Event> feed(std::string_view text) override;
  std::vector<Event> finish() override;
  // The ids the model gave its calls (functions.NAME:IDX), one per call.
  const std::vector<std::string>& call_ids() const { return ids_; }

 private:
  enum class State { Start, Reasoning, Content, Section, CallId, Args, Done };
  void text(std::string_view t, std::vector<Event>& ev);
  void marker(std::string_view m, std::vector<Event>& ev);
  void begin_call(std::vector<Event>& ev);
  void end_call(std::vector<Event>& ev);

  State state_;
  std::string buf_;       // undecided input (a possible partial marker)
  std::string start_ws_;  // leading whitespace before a possible <think>
  std::string id_;        // call id being read
  bool args_started_ = false;
  bool call_open_ = false;
  std::vector<std::string> ids_;
};

// ---- the two formats behind one interface ----
enum class Format { Xtml, K2 };
std::string format_name(Format f);                 // "xtml" | "k2"
Format parse_format_name(const std::string& name);  // throws k3::Error naming the choices
// The format of a checkpoint: the chat template in DIR/tokenizer_config.json (`chat_template`) or
// DIR/chat_template.jinja decides when it has one format's markers (<|im_user|>, <|im_assistant|>,
// <|im_end|> -> K2; <|open|>, <|end_of_msg|> -> XTML); otherwise model_type "kimi_linear" -> K2,
// anything else (K3) -> XTML. why (optional) receives a short reason for messages.
Format detect_format(const std::string& dir, const std::string& model_type, std::string* why = nullptr);

class ChatFormat {
 public:
  virtual ~ChatFormat() = default;
  virtual Format id() const = 0;
  virtual std::vector<Segment> render(const std::vector<Message>& msgs, const RenderOptions& opt) const = 0;
  // Does the generation prompt of these options open the reasoning section?
  virtual bool prompt_opens_reasoning(const RenderOptions& opt) const = 0;
  virtual std::unique_ptr<StreamParser> parser(bool prompt_opens_reasoning) const = 0;
  // The marker that ends an assistant turn (a stop token): <|end_of_msg|> or <|im_end|>.
  virtual std::string end_marker() const = 0;
  // The id a reply's call k (0-based) gets, as the format's prompts write it back.
  virtual std::string call_id(const std::string& name, size_t k, int64_t turn) const = 0;
};
const ChatFormat& chat_format(Format f);

}  // namespace k3::chat
