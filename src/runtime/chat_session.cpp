// Multi-turn chat over one Session (see chat_session.h for the canonical-transcript invariant).
#include "runtime/chat_session.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace k3 {

namespace {

constexpr char kChatMagic[8] = {'K', '3', 'C', 'H', 'A', 'T', '0', '1'};

bool starts_with(const std::vector<tok::TokenId>& a, const std::vector<tok::TokenId>& prefix) {
  return prefix.size() <= a.size() && std::equal(prefix.begin(), prefix.end(), a.begin());
}

std::vector<int32_t> as_model_ids(const tok::TokenId* p, size_t n) { return std::vector<int32_t>(p, p + n); }

uint64_t turn_seed(uint64_t seed, int64_t turn) {
  // splitmix64 finaliser: distinct, well-mixed seeds per turn, reproducible after /load.
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * uint64_t(turn + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

nlohmann::ordered_json message_json(const chat::Message& m) {
  nlohmann::ordered_json j;
  j["role"] = m.role;
  j["content"] = m.content;
  if (!m.reasoning.empty()) j["reasoning_content"] = m.reasoning;
  if (!m.tool_calls.empty()) {
    j["tool_calls"] = nlohmann::ordered_json::array();
    for (const auto& c : m.tool_calls)
      j["tool_calls"].push_back(
          {{"id", c.id},
           {"type", "function"},
           {"function", {{"name", c.name}, {"arguments", c.arguments_text ? *c.arguments_text : c.arguments.dump()}}}});
  }
  if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
  if (!m.name.empty()) j["name"] = m.name;
  return j;
}

}  // namespace

ChatSession::ChatSession(const Model& m, const tok::Tokenizer& tok, ChatOptions opt)
    : model_(&m), tok_(&tok), opt_(std::move(opt)), session_(m) {
  validate_sampling(opt_.sampling);
  if (opt_.max_tokens < 1) fail("chat: max tokens per reply must be at least 1");
  if (int64_t(tok.vocab_size()) > m.dims().vocab)
    fail("the tokenizer has " + std::to_string(tok.vocab_size()) + " ids but the model's vocabulary is " +
         std::to_string(m.dims().vocab));
  (void)chat::chat_format(opt_.format).render({}, opt_.render);  // validates the effort and tools now, not at the first turn
  start();
}

int64_t ChatSession::max_context() const {
  return opt_.max_context > 0 ? opt_.max_context : model_->config().max_position_embeddings;
}

void ChatSession::start() {
  session_.reset();
  messages_.clear();
  transcript_.clear();
  prompt_logits_.clear();
  turns_ = 0;
  if (!opt_.system.empty()) {
    chat::Message sys;
    sys.role = "system";
    sys.content = opt_.system;
    messages_.push_back(sys);
  }
}

void ChatSession::reset() { start(); }

std::vector<tok::TokenId> ChatSession::render_ids(const std::vector<chat::Message>& msgs,
                                                  bool generation_prompt) const {
  chat::RenderOptions ro = opt_.render;
  ro.add_generation_prompt = generation_prompt;
  return chat::segments_ids(*tok_, chat::chat_format(opt_.format).render(msgs, ro));
}

TurnResult ChatSession::send(chat::Message msg, const TurnCallbacks& cb, const std::atomic<bool>* interrupt) {
  if (msg.role != "user" && msg.role != "tool")
    fail("chat: only user and tool messages can be sent, not '" + msg.role + "'");
  TurnResult res;
  const Session::Mark before_mark = session_.mark();
  const std::vector<tok::TokenId> before = transcript_;
  const size_t n_messages_before = messages_.size();

  messages_.push_back(std::move(msg));
  std::vector<tok::TokenId> full;
  try {
    full = render_ids(messages_, true);
  } catch (...) {
    messages_.resize(n_messages_before);
    throw;
  }
  const int64_t ctx = max_context();
  if (int64_t(full.size()) + 1 > ctx) {
    messages_.resize(n_messages_before);
    fail("chat: the conversation needs " + std::to_string(full.size()) + " tokens, over the context limit of " +
         std::to_string(ctx) + " (use /reset, or a larger --ctx)");
  }
  size_t keep = before.size();
  if (!starts_with(full, before)) {  // the preamble changed: start the session over
    session_.reset();
    keep = 0;
  }
  const std::vector<int32_t> suffix = as_model_ids(full.data() + keep, full.size() - keep);
  const int64_t V = model_->dims().vocab;
  std::vector<float> logits(static_cast<size_t>(V));
  if (!prefill(*model_, session_, suffix, opt_.ubatch, opt_.forward, logits.data(), cb.on_prefill, interrupt,
               &res.stats)) {
    if (keep) {
      session_.rollback(before_mark);
    } else {  // the session was started over: rebuild what it held
      session_.reset();
      if (!before.empty())
        prefill(*model_, session_, as_model_ids(before.data(), before.size()), opt_.ubatch, opt_.forward,
                logits.data());
    }
    messages_.resize(n_messages_before);
    res.reason = StopReason::Interrupted;
    return res;
  }
  res.prefilled = int64_t(suffix.size());
  prompt_logits_ = logits;
  transcript_ = full;

  // Generate.
  SamplingParams sp = opt_.sampling;
  sp.seed = turn_seed(opt_.sampling.seed, turns_);
  Sampler sampler(sp, V);
  for (tok::TokenId id : transcript_) sampler.accept(int32_t(id));
  const chat::ChatFormat& fmt = chat::chat_format(opt_.format);
  const std::unique_ptr<chat::StreamParser> parser = fmt.parser(fmt.prompt_opens_reasoning(opt_.render));
  tok::StreamDecoder dec(*tok_);
  const auto emit = [&](const std::vector<chat::Event>& ev) {
    if (cb.on_event)
      for (const auto& e : ev) cb.on_event(e);
  };
  DecodeLimits lim;
  lim.max_tokens = opt_.max_tokens;
  lim.max_position = ctx;
  lim.interrupt = interrupt;
  lim.end_tokens.push_back(int32_t(tok_->require_special(fmt.end_marker())));
  const int64_t eos = model_->config().eos_token_id;
  if (eos >= 0 && eos < V && eos != lim.end_tokens[0]) lim.end_tokens.push_back(int32_t(eos));
  const DecodeResult r = decode(
      *model_, session_, sampler, logits.data(), lim, opt_.forward,
      [&](int32_t id) {
        if (tok_->is_valid_id(tok::TokenId(id))) emit(parser->feed(dec.push(tok::TokenId(id))));
        return true;
      },
      &res.stats);
  emit(parser->feed(dec.flush()));
  emit(parser->finish());
  res.reason = r.reason;

  // The reply as a message, then the session brought to its canonical ids.
  const chat::ParseResult& pr = parser->result();
  chat::Message reply;
  reply.role = "assistant";
  reply.reasoning = pr.reasoning;
  reply.content = pr.content;
  for (size_t k = 0; k < pr.calls.size(); ++k) {
    chat::ToolCall c;
    c.name = pr.calls[k].name.empty() ? "unnamed" : pr.calls[k].name;
    c.id = fmt.call_id(c.name, k, turns_);
    c.arguments =
        nlohmann::ordered_json::parse(pr.calls[k].arguments.empty() ? "{}" : pr.calls[k].arguments, nullptr, false);
    if (c.arguments.is_discarded()) c.arguments = pr.calls[k].arguments;  // kept verbatim as a JSON string
    // K2 renders a call's arguments as the text the model wrote (the template prints strings verbatim).
    if (opt_.format == chat::Format::K2) c.arguments_text = pr.calls[k].arguments.empty() ? "{}" : pr.calls[k].arguments;
    reply.tool_calls.push_back(std::move(c));
  }
  messages_.push_back(reply);
  const std::vector<tok::TokenId> canonical = render_ids(messages_, false);
  std::vector<tok::TokenId> fed = full;
  fed.insert(fed.end(), r.tokens.begin(), r.tokens.begin() + r.fed);
  std::vector<float> scratch(static_cast<size_t>(V));
  GenStats tail;
  if (starts_with(canonical, fed)) {
    if (canonical.size() > fed.size()) {
      const auto rest = as_model_ids(canonical.data() + fed.size(), canonical.size() - fed.size());
      prefill(*model_, session_, rest, opt_.ubatch, opt_.forward, scratch.data(), {}, nullptr, &tail);
    }
  } else {
    res.resynced = true;
    size_t from = keep;
    if (keep && starts_with(canonical, before)) {
      session_.rollback(before_mark);
    } else {
      session_.reset();
      from = 0;
    }
    const auto rest = as_model_ids(canonical.data() + from, canonical.size() - from);
    prefill(*model_, session_, rest, opt_.ubatch, opt_.forward, scratch.data(), {}, nullptr, &tail);
  }
  transcript_ = canonical;
  res.stats.prefill_seconds += tail.prefill_seconds;
  ++turns_;
  res.reply = std::move(reply);
  return res;
}

void ChatSession::save(const std::string& path) const {
  nlohmann::ordered_json j;
  j["format"] = "k3-chat";
  j["version"] = 1;
  j["model_fingerprint"] = std::to_string(model_->fingerprint());
  j["chat_format"] = chat::format_name(opt_.format);
  j["system"] = opt_.system;
  j["thinking_effort"] = opt_.render.thinking_effort;
  j["thinking"] = opt_.render.thinking;
  j["tool_choice_required"] = opt_.render.tool_choice_required;
  j["tools"] = nlohmann::ordered_json::parse(opt_.render.tools.dump());
  j["turns"] = turns_;
  j["messages"] = nlohmann::ordered_json::array();
  for (const auto& m : messages_) j["messages"].push_back(message_json(m));
  j["transcript"] = transcript_;
  // CBOR, not JSON text: replies of a model may hold bytes that are not valid UTF-8 (a reply cut
  // inside a character, or a model emitting raw bytes), and they must come back unchanged.
  const std::vector<uint8_t> cbor = nlohmann::ordered_json::to_cbor(j);
  const std::string text(cbor.begin(), cbor.end());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail("cannot write chat file " + path + ": " + std::strerror(errno));
    f.write(kChatMagic, 8);
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
    f.write(text.data(), std::streamsize(text.size()));
    session_.save(f);
    f.flush();
    if (!f) fail("cannot write chat file " + path + ": write failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot write chat file " + path + ": " + std::strerror(errno));
}

void ChatSession::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open chat file " + path + ": " + std::strerror(errno));
  char magic[8];
  if (!f.read(magic, 8) || std::memcmp(magic, kChatMagic, 8) != 0) fail(path + ": not a k3 chat file");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    const int ch = f.get();
    if (ch == EOF) fail(path + ": chat file is truncated");
    n |= uint64_t(uint8_t(ch)) << (8 * i);
  }
  if (n > (uint64_t(1) << 32)) fail(path + ": chat file header is implausibly large");
  std::string text(size_t(n), '\0');
  if (!f.read(text.data(), std::streamsize(n))) fail(path + ": chat file is truncated");
  nlohmann::json j;
  try {
    j = nlohmann::json::from_cbor(text);
  } catch (const nlohmann::json::exception&) {
    fail(path + ": chat file header is not valid");
  }
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "k3-chat")
    fail(path + ": chat file header is not valid");
  if (j.value("version", 0) != 1) fail(path + ": unsupported chat file version");
  if (j.value("model_fingerprint", "") != std::to_string(model_->fingerprint()))
    fail(path + ": chat file was saved with a different model");
  ChatOptions o = opt_;
  std::vector<chat::Message> msgs;
  std::vector<tok::TokenId> ids;
  int64_t turns = 0;
  try {
    if (j.contains("chat_format") &&
        chat::parse_format_name(j["chat_format"].get<std::string>()) != opt_.format)
      fail(path + ": chat file was saved in the " + j["chat_format"].get<std::string>() + " chat format, this chat uses " +
           chat::format_name(opt_.format));
    o.system = j.at("system").get<std::string>();
    o.render.thinking_effort = j.at("thinking_effort").get<std::string>();
    o.render.thinking = j.at("thinking").get<bool>();
    o.render.tool_choice_required = j.at("tool_choice_required").get<bool>();
    o.render.tools = j.at("tools");
    turns = j.at("turns").get<int64_t>();
    msgs = chat::messages_from_json(j.at("messages"));
    ids = j.at("transcript").get<std::vector<tok::TokenId>>();
  } catch (const nlohmann::json::exception& e) {
    fail(path + ": chat file header: " + e.what());
  }
  Session s(*model_);
  s.load(f);
  if (s.position() != int64_t(ids.size())) fail(path + ": chat file session length does not match its transcript");
  // Adopt only after everything checked out.
  opt_.system = o.system;
  opt_.render = o.render;
  messages_ = std::move(msgs);
  transcript_ = std::move(ids);
  turns_ = turns;
  session_ = std::move(s);
  prompt_logits_.clear();
}

}  // namespace k3
