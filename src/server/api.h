// The OpenAI-compatible request/response mapping: JSON bodies of /v1/chat/completions and
// /v1/completions -> GenRequest (every parameter checked; unsupported ones refused by name), and
// scheduler output (Delta, Finish) -> OpenAI response objects and stream chunks. Owns the schema
// mapping and the error objects. Must not: do I/O or touch sequences (the engine is used only for
// its const tokenizer/chat calls).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "k3/engine.h"
#include "server/job.h"

namespace k3::server {

using json = nlohmann::json;

// An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError : std::runtime_error {
  int status;
  std::string type, code, param;
  ApiError(int st, std::string message, std::string param_ = "", std::string code_ = "", std::string type_ = "");
};
json error_json(int status, const std::string& message, const std::string& param = "", const std::string& code = "",
                const std::string& type = "");
json error_json(const ApiError& e);
// Compact JSON; invalid UTF-8 inside strings becomes U+FFFD instead of throwing.
std::string dump(const json& j);
// Parses a request body: malformed JSON (or invalid UTF-8 in it) -> ApiError 400.
json parse_body(const std::string& body);

// What the server fixes for every request.
struct ApiConfig {
  std::string model_id;  // the one model's name (/v1/models); requests naming another get 404
  int64_t context = 0;   // Engine::max_context()
  SamplingOptions sampling_defaults;
  bool add_bos = false;  // completions: prepend BOS (tokenizer_config.json add_bos_token)
  double timeout_s = 600;
  bool prefix_cache = true;
};

// A mapped request: the generation settings plus what the response needs.
struct ApiRequest {
  GenRequest gen;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;  // chat: logprobs.content; completions: logprobs object
  bool echo = false;      // completions: the prompt text before the completion
  std::string echo_text;
  std::string model;
};

ApiRequest map_chat_request(const json& body, const Engine& e, const ApiConfig& cfg);
ApiRequest map_completion_request(const json& body, const Engine& e, const ApiConfig& cfg);

// Renders chat messages (+ tools etc. of `body`) to ids exactly as map_chat_request does.
std::vector<int32_t> render_chat_ids(const json& body, const Engine& e, int64_t* cache_point = nullptr,
                                     bool* thinking_prompt = nullptr, std::vector<int64_t>* cuts = nullptr);

json usage_json(const Finish& f);
json models_json(const ApiConfig& cfg, int64_t created);

// Turns the deltas of one chat request into stream chunks, and accumulates the final message: the
// streamed and the one-shot responses are built from the same events.
class ChatResponder {
 public:
  ChatResponder(const Engine& e, std::string id, std::string model, int64_t created, bool logprobs);
  json first_chunk() const;                   // delta {role: assistant, content: ""}
  std::optional<json> chunk(const Delta& d);  // nullopt when the delta shows nothing
  json final_chunk(const Finish& f) const;    // empty delta + finish_reason
  json usage_chunk(const Finish& f) const;    // choices [] + usage
  json response(const Finish& f) const;       // the non-streamed chat.completion

 private:
  json chunk_base() const;
  const Engine& e_;
  std::string id_, model_;
  int64_t created_;
  bool logprobs_;
  std::string reasoning_, content_;
  struct Call {
    std::string id, name, arguments;
  };
  std::vector<Call> calls_;
  json lp_content_ = json::array();
};

class CompletionResponder {
 public:
  CompletionResponder(const Engine& e, std::string id, std::string model, int64_t created, bool logprobs,
                      int top_logprobs, std::string echo_text, std::vector<int32_t> echo_ids);
  std::optional<json> chunk(const Delta& d);
  json final_chunk(const Finish& f) const;
  json usage_chunk(const Finish& f) const;
  json response(const Finish& f);

 private:
  json lp_json(const std::vector<const TokenLogprob*>& lps, const std::vector<int32_t>& ids, size_t text_offset0,
               bool first_null) const;
  const Engine& e_;
  std::string id_, model_;
  int64_t created_;
  bool logprobs_;
  int top_;
  std::string text_;
  std::string echo_text_;
  std::vector<int32_t> echo_ids_;
  std::vector<TokenLogprob> lps_;
  std::vector<int32_t> ids_;
  bool echo_sent_ = false;
};

std::string random_id(const std::string& prefix, size_t n = 24);  // prefix + n alphanumerics
json logprob_entry_json(const Engine& e, const TokenLogprob& lp);

}  // namespace k3::server
