// OpenAI schema mapping (see api.h). Parameter names in messages are the request's own spelling.
#include "server/api.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "chat/chat.h"
#include "core/error.h"

namespace k3::server {

ApiError::ApiError(int st, std::string message, std::string param_, std::string code_, std::string type_)
    : std::runtime_error(std::move(message)),
      status(st),
      type(std::move(type_)),
      code(std::move(code_)),
      param(std::move(param_)) {}

namespace {

std::string default_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "unavailable_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& msg, const std::string& code = "") {
  throw ApiError(400, msg, param, code.empty() ? "invalid_value" : code);
}

bool has(const json& b, const char* k) { return b.contains(k) && !b[k].is_null(); }

double number(const json& b, const char* k, double lo, double hi, bool lo_open = false) {
  const json& v = b[k];
  if (!v.is_number()) bad(k, std::string(k) + " must be a number, not " + v.type_name(), "invalid_type");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s must be in %s%g, %g], got %g", k, lo_open ? "(" : "[", lo, hi, x);
    bad(k, buf);
  }
  return x;
}

int64_t integer(const json& b, const char* k, int64_t lo, int64_t hi) {
  const json& v = b[k];
  if (!v.is_number_integer() && !(v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))
    bad(k, std::string(k) + " must be an integer, not " + (v.is_number() ? "a fraction" : v.type_name()),
        "invalid_type");
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d < double(lo) || d > double(hi))
      bad(k, std::string(k) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return int64_t(d);
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
    bad(k, std::string(k) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    bad(k, std::string(k) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
               std::to_string(x));
  return x;
}

bool boolean(const json& b, const char* k) {
  if (!b[k].is_boolean()) bad(k, std::string(k) + " must be true or false, not " + b[k].type_name(), "invalid_type");
  return b[k].get<bool>();
}

void check_keys(const json& body, const std::set<std::string>& allowed, const char* endpoint) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_request");
  std::vector<std::string> unknown;
  for (const auto& [k, v] : body.items())
    if (!allowed.count(k)) unknown.push_back(k);
  if (unknown.empty()) return;
  std::string list;
  for (const auto& u : unknown) list += (list.empty() ? "" : ", ") + u;
  throw ApiError(
      400, std::string("unsupported parameter") + (unknown.size() > 1 ? "s" : "") + " for " + endpoint + ": " + list,
      unknown.front(), "unsupported_parameter");
}

void check_model(const json& body, const ApiConfig& cfg, std::string& model) {
  model = cfg.model_id;
  if (!has(body, "model")) return;
  if (!body["model"].is_string()) bad("model", "model must be a string", "invalid_type");
  const std::string m = body["model"].get<std::string>();
  if (m.empty()) return;
  if (m != cfg.model_id)
    throw ApiError(404, "the model '" + m + "' does not exist; this server serves '" + cfg.model_id + "'", "model",
                   "model_not_found");
}

// Sampling, limits, stop, logprobs, streaming: what both endpoints share.
void map_common(const json& b, const ApiConfig& cfg, ApiRequest& r) {
  GenRequest& g = r.gen;
  g.sampling = cfg.sampling_defaults;
  std::random_device rd;
  g.sampling.seed = (uint64_t(rd()) << 32) ^ rd();
  if (has(b, "temperature")) g.sampling.temperature = float(number(b, "temperature", 0, 100));
  if (has(b, "top_p")) g.sampling.top_p = float(number(b, "top_p", 0, 1, true));
  if (has(b, "top_k")) {
    const int64_t k = integer(b, "top_k", -1, 1 << 30);  // -1 (vLLM's "off") = 0
    g.sampling.top_k = k < 0 ? 0 : int32_t(k);
  }
  if (has(b, "min_p")) g.sampling.min_p = float(number(b, "min_p", 0, 1));
  if (has(b, "presence_penalty")) g.sampling.presence_penalty = float(number(b, "presence_penalty", -2, 2));
  if (has(b, "frequency_penalty")) g.sampling.frequency_penalty = float(number(b, "frequency_penalty", -2, 2));
  if (has(b, "repetition_penalty"))
    g.sampling.repetition_penalty = float(number(b, "repetition_penalty", 0, 100, true));
  if (has(b, "seed")) {
    const json& s = b["seed"];
    if (!s.is_number_integer()) bad("seed", "seed must be an integer", "invalid_type");
    g.sampling.seed = s.is_number_unsigned() ? s.get<uint64_t>() : uint64_t(s.get<int64_t>());
  }
  if (has(b, "n") && integer(b, "n", 1, 128) != 1) bad("n", "n must be 1 (one choice per request)");
  if (has(b, "stream")) r.stream = boolean(b, "stream");
  if (has(b, "stream_options")) {
    const json& so = b["stream_options"];
    if (!so.is_object()) bad("stream_options", "stream_options must be an object", "invalid_type");
    if (!r.stream) bad("stream_options", "stream_options is only allowed with stream: true");
    for (const auto& [k, v] : so.items()) {
      if (k != "include_usage" && k != "continuous_usage_stats")
        bad("stream_options." + k, "unsupported parameter: stream_options." + k, "unsupported_parameter");
    }
    if (has(so, "include_usage")) r.include_usage = boolean(so, "include_usage");
  }
  if (has(b, "stop")) {
    const json& s = b["stop"];
    if (s.is_string()) {
      g.stop.push_back(s.get<std::string>());
    } else if (s.is_array()) {
      if (s.size() > 16) bad("stop", "stop takes at most 16 sequences");
      for (const auto& x : s) {
        if (!x.is_string()) bad("stop", "stop must be a string or an array of strings", "invalid_type");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "stop must be a string or an array of strings", "invalid_type");
    }
    for (const auto& x : g.stop)
      if (x.empty()) bad("stop", "stop sequences must not be empty");
  }
  if (has(b, "ignore_eos")) g.ignore_eos = boolean(b, "ignore_eos");
  if (has(b, "logit_bias")) {
    const json& lb = b["logit_bias"];
    if (!lb.is_object()) bad("logit_bias", "logit_bias must be an object of token id -> bias", "invalid_type");
    for (const auto& [k, v] : lb.items()) {
      char* end = nullptr;
      const long id = std::strtol(k.c_str(), &end, 10);
      if (k.empty() || *end || id < 0) bad("logit_bias", "logit_bias key '" + k + "' is not a token id");
      if (!v.is_number() || !std::isfinite(v.get<double>()) || std::fabs(v.get<double>()) > 100)
        bad("logit_bias", "logit_bias values must be numbers in [-100, 100]");
      g.logit_bias.emplace_back(int32_t(id), v.get<float>());
    }
  }
  if (has(b, "cache_prompt")) g.use_cache = boolean(b, "cache_prompt");
  g.use_cache = g.use_cache && cfg.prefix_cache;
  if (has(b, "timeout"))
    g.timeout_s = number(b, "timeout", 0, cfg.timeout_s, true);
  else
    g.timeout_s = cfg.timeout_s;
  try {
    TokenSampler check(g.sampling, 1);  // the engine's own range checks
  } catch (const std::exception& ex) {
    bad("", std::string("sampling: ") + ex.what());
  }
}

void resolve_max_tokens(const json& b, const ApiConfig& cfg, GenRequest& g, const char* prompt_param) {
  const int64_t plen = int64_t(g.prompt.size());
  if (plen == 0) bad("prompt", "the prompt is empty");
  if (plen >= cfg.context)
    bad(prompt_param,
        "the prompt is " + std::to_string(plen) + " tokens; this server's context is " + std::to_string(cfg.context) +
            " tokens",
        "context_length_exceeded");
  int64_t max_tokens = -1;
  for (const char* k : {"max_completion_tokens", "max_tokens"})
    if (has(b, k)) max_tokens = integer(b, k, 1, int64_t(1) << 40);
  if (max_tokens < 0) {
    g.max_tokens = cfg.context - plen;
  } else {
    if (plen + max_tokens > cfg.context)
      bad(has(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
          "the prompt (" + std::to_string(plen) + " tokens) plus max_tokens (" + std::to_string(max_tokens) +
              ") exceeds this server's context of " + std::to_string(cfg.context) + " tokens",
          "context_length_exceeded");
    g.max_tokens = max_tokens;
  }
}

}  // namespace

json error_json(int status, const std::string& message, const std::string& param, const std::string& code,
                const std::string& type) {
  json e = {{"message", message}, {"type", type.empty() ? default_type(status) : type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

json error_json(const ApiError& e) { return error_json(e.status, e.what(), e.param, e.code, e.type); }

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json parse_body(const std::string& body) {
  try {
    return json::parse(body);
  } catch (const json::parse_error& ex) {
    std::string what = ex.what();
    if (const size_t p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    throw ApiError(400, "the request body is not valid JSON: " + what, "", "invalid_json");
  }
}

std::string random_id(const std::string& prefix, size_t n) {
  static const char al[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string s = prefix;
  for (size_t i = 0; i < n; ++i) s += al[rng() % (sizeof(al) - 1)];
  return s;
}

std::vector<int32_t> render_chat_ids(const json& body, const Engine& e, int64_t* cache_point, bool* thinking_prompt,
                                     std::vector<int64_t>* cuts) {
  std::vector<chat::Message> msgs;
  chat::RenderOptions ro;
  try {
    msgs = chat::messages_from_json(body["messages"]);
    ro = chat::options_from_json(body);
  } catch (const k3::Error& ex) {
    std::string m = ex.what();
    if (m.rfind("chat: ", 0) == 0) m = m.substr(6);
    bad("messages", m);
  }
  // tool_choice: "none" declares no tools; a named function declares only that one and requires a call.
  if (has(body, "tool_choice")) {
    const json& tc = body["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s == "none")
        ro.tools = json::array();
      else if (s != "auto" && s != "required")
        bad("tool_choice", "tool_choice must be none, auto, required or a function");
    } else if (tc.is_object() && tc.contains("function") && tc["function"].is_object() &&
               tc["function"].contains("name") && tc["function"]["name"].is_string()) {
      const std::string name = tc["function"]["name"].get<std::string>();
      json only = json::array();
      for (const auto& t : ro.tools)
        if (t.is_object() && t.contains("function") && t["function"].is_object() &&
            t["function"].value("name", "") == name)
          only.push_back(t);
      if (only.empty()) bad("tool_choice", "tool_choice names the function '" + name + "', which is not in tools");
      ro.tools = only;
      ro.tool_choice_required = true;
    } else {
      bad("tool_choice",
          "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  for (size_t i = 0; i < ro.tools.size(); ++i) {
    const json& t = ro.tools[i];
    if (!t.is_object() || !t.contains("function") || !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string())
      bad("tools", "tools[" + std::to_string(i) + "] must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  if (has(body, "response_format")) {
    const json& rf = body["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      bad("response_format", "response_format must be {\"type\": \"text\"} or {\"type\": \"json_object\"}");
    const std::string t = rf["type"].get<std::string>();
    if (t == "json_object")
      ro.thinking = false;  // the JSON body is the answer: no reasoning section
    else if (t != "text")
      throw ApiError(400, "response_format type '" + t + "' is not supported (text, json_object)", "response_format",
                     "unsupported_parameter");
  }
  const chat::ChatFormat& fmt = chat::chat_format(chat::parse_format_name(e.chat_format()));
  std::vector<chat::Segment> segs;
  size_t prefix_segs = 0;
  try {
    segs = fmt.render(msgs, ro);
    chat::RenderOptions nogen = ro;
    nogen.add_generation_prompt = false;
    prefix_segs = fmt.render(msgs, nogen).size();
  } catch (const k3::Error& ex) {
    std::string m = ex.what();
    if (m.rfind("chat: ", 0) == 0) m = m.substr(6);
    bad("messages", m);
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (i == prefix_segs && cache_point) *cache_point = int64_t(ids.size());
    if (segs[i].special) {
      const int32_t id = e.special_id(segs[i].text);
      if (id < 0) throw ApiError(500, "the model's tokenizer has no special token " + segs[i].text, "", "server_error");
      ids.push_back(id);
    } else {
      const auto t = e.tokenize(segs[i].text);
      ids.insert(ids.end(), t.begin(), t.end());
    }
  }
  if (thinking_prompt) *thinking_prompt = ro.add_generation_prompt && fmt.prompt_opens_reasoning(ro);
  if (cuts) {
    const int32_t end_of_msg = e.end_of_turn_id();
    cuts->clear();
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      if (ids[i] == end_of_msg) cuts->push_back(int64_t(i) + 1);
  }
  return ids;
}

// Request keys both endpoints take (sampling, limits, streaming, logprobs, extras), plus `own`.
std::set<std::string> with_common_keys(std::set<std::string> own) {
  for (const char* k : {"model",
                        "stream",
                        "stream_options",
                        "max_tokens",
                        "temperature",
                        "top_p",
                        "top_k",
                        "min_p",
                        "presence_penalty",
                        "frequency_penalty",
                        "repetition_penalty",
                        "seed",
                        "stop",
                        "n",
                        "logprobs",
                        "user",
                        "logit_bias",
                        "ignore_eos",
                        "cache_prompt",
                        "timeout"})
    own.insert(k);
  return own;
}

ApiRequest map_chat_request(const json& b, const Engine& e, const ApiConfig& cfg) {
  static const std::set<std::string> allowed = with_common_keys(
      {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
       "response_format", "reasoning_effort", "chat_template_kwargs", "thinking"});
  check_keys(b, allowed, "/v1/chat/completions");
  ApiRequest r;
  check_model(b, cfg, r.model);
  if (!b.contains("messages")) bad("messages", "messages is required", "missing_required_parameter");
  if (!b["messages"].is_array() || b["messages"].empty()) bad("messages", "messages must be a non-empty array");
  map_common(b, cfg, r);
  GenRequest& g = r.gen;
  g.chat = true;
  if (has(b, "logprobs")) r.logprobs = boolean(b, "logprobs");
  if (has(b, "top_logprobs")) {
    const int64_t k = integer(b, "top_logprobs", 0, 20);
    if (!r.logprobs) bad("top_logprobs", "top_logprobs needs logprobs: true");
    g.top_logprobs = int(k);
  } else if (r.logprobs) {
    g.top_logprobs = 0;
  }
  if (has(b, "parallel_tool_calls")) g.parallel_tool_calls = boolean(b, "parallel_tool_calls");
  if (has(b, "tools") && !b["tools"].is_array()) bad("tools", "tools must be an array", "invalid_type");
  if (has(b, "reasoning_effort") && !b["reasoning_effort"].is_string())
    bad("reasoning_effort", "reasoning_effort must be a string", "invalid_type");
  if (has(b, "chat_template_kwargs") && !b["chat_template_kwargs"].is_object())
    bad("chat_template_kwargs", "chat_template_kwargs must be an object", "invalid_type");
  if (has(b, "response_format") && b["response_format"].is_object() &&
      b["response_format"].value("type", "") == "json_object")
    g.json_object = true;
  g.prompt = render_chat_ids(b, e, &g.cache_point, &g.thinking_prompt, &g.cuts);
  resolve_max_tokens(b, cfg, g, "messages");
  return r;
}

ApiRequest map_completion_request(const json& b, const Engine& e, const ApiConfig& cfg) {
  static const std::set<std::string> allowed = with_common_keys({"prompt", "echo", "best_of"});
  check_keys(b, allowed, "/v1/completions");
  ApiRequest r;
  check_model(b, cfg, r.model);
  if (has(b, "best_of") && integer(b, "best_of", 1, 128) != 1) bad("best_of", "best_of must be 1");
  map_common(b, cfg, r);
  GenRequest& g = r.gen;
  if (!b.contains("prompt")) bad("prompt", "prompt is required", "missing_required_parameter");
  json p = b["prompt"];
  // One prompt: a string, an array of token ids, or an array holding one of those.
  if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = p[0];
  if (cfg.add_bos && e.bos_id() >= 0) g.prompt.push_back(e.bos_id());
  if (p.is_string()) {
    r.echo_text = p.get<std::string>();
    const auto t = e.tokenize(r.echo_text);
    g.prompt.insert(g.prompt.end(), t.begin(), t.end());
  } else if (p.is_array() && !p.empty() &&
             std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
    for (const auto& x : p) {
      const int64_t id = x.get<int64_t>();
      if (id < 0 || id >= e.vocab_size())
        bad("prompt", "token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                          std::to_string(e.vocab_size() - 1) + ")");
      g.prompt.push_back(int32_t(id));
    }
    try {
      r.echo_text = e.detokenize(
          std::vector<int32_t>(g.prompt.begin() + (cfg.add_bos && e.bos_id() >= 0 ? 1 : 0), g.prompt.end()));
    } catch (const std::exception& ex) {
      bad("prompt", ex.what());
    }
  } else if (p.is_array() && p.size() > 1) {
    bad("prompt", "batched prompts are not supported: send one prompt per request");
  } else {
    bad("prompt", "prompt must be a string or an array of token ids", "invalid_type");
  }
  g.cache_point = int64_t(g.prompt.size()) - 1;  // a repeated prompt recomputes one token
  if (has(b, "echo")) r.echo = boolean(b, "echo");
  if (has(b, "logprobs")) {
    g.top_logprobs = int(integer(b, "logprobs", 0, 20));
    r.logprobs = true;
    g.prompt_logprobs = r.echo;
  }
  resolve_max_tokens(b, cfg, g, "prompt");
  return r;
}

json usage_json(const Finish& f) {
  return json{{"prompt_tokens", f.prompt_tokens},
              {"completion_tokens", f.completion_tokens},
              {"total_tokens", f.prompt_tokens + f.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", f.cached_tokens}}},
              {"completion_tokens_details", {{"reasoning_tokens", f.reasoning_tokens}}}};
}

json models_json(const ApiConfig& cfg, int64_t created) {
  return json{{"object", "list"},
              {"data", json::array({json{{"id", cfg.model_id},
                                         {"object", "model"},
                                         {"created", created},
                                         {"owned_by", "k3cpp"},
                                         {"max_model_len", cfg.context}}})}};
}

json logprob_entry_json(const Engine& e, const TokenLogprob& lp) {
  const auto tok_json = [&](int32_t id, float logprob) {
    std::string text;
    try {
      text = e.detokenize({id});
    } catch (const std::exception&) {
    }
    json bytes = json::array();
    for (unsigned char c : text) bytes.push_back(int(c));
    return json{{"token", text}, {"logprob", logprob}, {"bytes", bytes}};
  };
  json j = tok_json(lp.id, lp.logprob);
  json top = json::array();
  for (const auto& [id, l] : lp.top) top.push_back(tok_json(id, l));
  j["top_logprobs"] = top;
  return j;
}

// ---- chat responses

ChatResponder::ChatResponder(const Engine& e, std::string id, std::string model, int64_t created, bool logprobs)
    : e_(e), id_(std::move(id)), model_(std::move(model)), created_(created), logprobs_(logprobs) {}

json ChatResponder::chunk_base() const {
  return json{{"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", model_}};
}

json ChatResponder::first_chunk() const {
  json c = chunk_base();
  c["choices"] = json::array({json{{"index", 0},
                                   {"delta", {{"role", "assistant"}, {"content", ""}}},
                                   {"logprobs", nullptr},
                                   {"finish_reason", nullptr}}});
  return c;
}

std::optional<json> ChatResponder::chunk(const Delta& d) {
  json delta = json::object();
  std::string reasoning, content;
  json tool_calls = json::array();
  for (const chat::Event& ev : d.events) {
    switch (ev.kind) {
      case chat::EventKind::Reasoning:
        reasoning += ev.text;
        break;
      case chat::EventKind::Content:
        content += ev.text;
        break;
      case chat::EventKind::ToolCallStart: {
        Call c;
        // K2: the model's own id form (functions.NAME:IDX), which the template writes back in the
        // assistant turn and in "## Return of ID"; XTML prompts use the index, so any id will do.
        c.id = e_.chat_format() == "k2" ? "functions." + ev.text + ":" + std::to_string(ev.call) : random_id("call_");
        c.name = ev.text;
        calls_.push_back(c);
        tool_calls.push_back(json{{"index", ev.call},
                                  {"id", c.id},
                                  {"type", "function"},
                                  {"function", {{"name", c.name}, {"arguments", ""}}}});
        break;
      }
      case chat::EventKind::ToolArgs: {
        if (ev.call < 0 || size_t(ev.call) >= calls_.size() || ev.text.empty()) break;
        calls_[size_t(ev.call)].arguments += ev.text;
        // Merge with this chunk's entry for the same call when there is one.
        bool merged = false;
        for (auto& t : tool_calls)
          if (t["index"] == ev.call) {
            t["function"]["arguments"] = t["function"]["arguments"].get<std::string>() + ev.text;
            merged = true;
          }
        if (!merged) tool_calls.push_back(json{{"index", ev.call}, {"function", {{"arguments", ev.text}}}});
        break;
      }
      case chat::EventKind::ToolCallEnd:
        break;
    }
  }
  reasoning_ += reasoning;
  content_ += content;
  if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
  if (!content.empty()) delta["content"] = content;
  if (!tool_calls.empty()) delta["tool_calls"] = tool_calls;
  json lp = nullptr;
  if (logprobs_ && d.lp) {
    json entry = logprob_entry_json(e_, *d.lp);
    lp_content_.push_back(entry);
    lp = json{{"content", json::array({entry})}};
  }
  if (delta.empty() && lp.is_null()) return std::nullopt;
  json c = chunk_base();
  c["choices"] = json::array({json{{"index", 0}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", nullptr}}});
  return c;
}

json ChatResponder::final_chunk(const Finish& f) const {
  json c = chunk_base();
  c["choices"] =
      json::array({json{{"index", 0}, {"delta", json::object()}, {"logprobs", nullptr}, {"finish_reason", f.reason}}});
  return c;
}

json ChatResponder::usage_chunk(const Finish& f) const {
  json c = chunk_base();
  c["choices"] = json::array();
  c["usage"] = usage_json(f);
  return c;
}

json ChatResponder::response(const Finish& f) const {
  json msg = {{"role", "assistant"}};
  msg["content"] = content_.empty() && !calls_.empty() ? json(nullptr) : json(content_);
  if (!reasoning_.empty()) msg["reasoning_content"] = reasoning_;
  if (!calls_.empty()) {
    json tc = json::array();
    for (const Call& c : calls_)
      tc.push_back(
          json{{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    msg["tool_calls"] = tc;
  }
  json choice = {{"index", 0}, {"message", msg}, {"finish_reason", f.reason}};
  choice["logprobs"] = logprobs_ ? json{{"content", lp_content_}} : json(nullptr);
  return json{{"id", id_},       {"object", "chat.completion"},      {"created", created_},
              {"model", model_}, {"choices", json::array({choice})}, {"usage", usage_json(f)}};
}

// ---- completion responses

CompletionResponder::CompletionResponder(const Engine& e, std::string id, std::string model, int64_t created,
                                         bool logprobs, int top_logprobs, std::string echo_text,
                                         std::vector<int32_t> echo_ids)
    : e_(e),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      logprobs_(logprobs),
      top_(top_logprobs),
      echo_text_(std::move(echo_text)),
      echo_ids_(std::move(echo_ids)) {}

json CompletionResponder::lp_json(const std::vector<const TokenLogprob*>& lps, const std::vector<int32_t>& ids,
                                  size_t offset0, bool first_null) const {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
  size_t off = offset0;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string t;
    try {
      t = e_.detokenize({ids[i]});
    } catch (const std::exception&) {
    }
    tokens.push_back(t);
    offsets.push_back(off);
    off += t.size();
    const TokenLogprob* lp = i < lps.size() ? lps[i] : nullptr;
    if (!lp || (first_null && i == 0)) {
      token_lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    token_lps.push_back(lp->logprob);
    json top = json::object();
    for (const auto& [id, l] : lp->top) {
      std::string s;
      try {
        s = e_.detokenize({id});
      } catch (const std::exception&) {
      }
      top[s] = l;
    }
    tops.push_back(top);
  }
  return json{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

std::optional<json> CompletionResponder::chunk(const Delta& d) {
  std::string text = d.text;
  if (!echo_sent_ && !echo_text_.empty()) {
    text = echo_text_ + text;
    echo_sent_ = true;
  }
  text_ += d.text;
  if (d.lp) lps_.push_back(*d.lp);
  ids_.push_back(d.token);
  if (text.empty() && !(logprobs_ && d.lp)) return std::nullopt;
  json lp = nullptr;
  if (logprobs_ && d.lp) lp = lp_json({&*d.lp}, {d.token}, 0, false);
  return json{
      {"id", id_},
      {"object", "text_completion"},
      {"created", created_},
      {"model", model_},
      {"choices", json::array({json{{"index", 0}, {"text", text}, {"logprobs", lp}, {"finish_reason", nullptr}}})}};
}

json CompletionResponder::final_chunk(const Finish& f) const {
  return json{
      {"id", id_},
      {"object", "text_completion"},
      {"created", created_},
      {"model", model_},
      {"choices", json::array({json{{"index", 0}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", f.reason}}})}};
}

json CompletionResponder::usage_chunk(const Finish& f) const {
  return json{{"id", id_},       {"object", "text_completion"}, {"created", created_},
              {"model", model_}, {"choices", json::array()},    {"usage", usage_json(f)}};
}

json CompletionResponder::response(const Finish& f) {
  json lp = nullptr;
  if (logprobs_) {
    std::vector<const TokenLogprob*> all;
    std::vector<int32_t> ids;
    if (!echo_text_.empty() && !echo_ids_.empty()) {
      all.push_back(nullptr);  // the first prompt token has no logprob
      for (const auto& p : f.prompt_lps) all.push_back(&p);
      ids = echo_ids_;
      all.resize(ids.size(), nullptr);
    }
    for (size_t i = 0; i < ids_.size(); ++i) {
      all.push_back(i < lps_.size() ? &lps_[i] : nullptr);
      ids.push_back(ids_[i]);
    }
    lp = lp_json(all, ids, 0, false);
  }
  const std::string text = (echo_text_.empty() ? "" : echo_text_) + text_;
  return json{
      {"id", id_},
      {"object", "text_completion"},
      {"created", created_},
      {"model", model_},
      {"choices", json::array({json{{"index", 0}, {"text", text}, {"logprobs", lp}, {"finish_reason", f.reason}}})},
      {"usage", usage_json(f)}};
}

}  // namespace k3::server
