// A multi-turn chat held in one Session, in the checkpoint's chat format (chat::ChatFormat: K3 XTML
// or Kimi K2). The session always holds exactly the ids of
// chat::render(messages) (the canonical rendering), so a turn only prefills the new text and a
// conversation continued here equals the same conversation rendered and prefilled at once.
// When the sampled tokens of a reply differ from its canonical rendering (a non-canonical BPE
// split, a reply cut off mid-section), the reply is rolled back to a Session::Mark and its
// canonical ids are prefilled instead. Owns turn bookkeeping and chat files (/save, /load);
// must not print (callbacks report events and progress).
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "chat/chat.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "tokenizer/tokenizer.h"

namespace k3 {

struct ChatOptions {
  chat::Format format = chat::Format::Xtml;  // the checkpoint's (chat::detect_format) or --chat-format
  std::string system;          // system prompt ("" = none)
  chat::RenderOptions render;  // tools, thinking effort, thinking on/off
  SamplingParams sampling;     // seed: turn n samples with a seed derived from (seed, n)
  int64_t max_tokens = 1024;   // per reply
  int64_t max_context = 0;     // 0 = the config's max_position_embeddings
  int64_t ubatch = 512;
  ForwardOptions forward;
};

struct TurnCallbacks {
  std::function<void(const chat::Event&)> on_event;  // parsed reply, streamed
  ProgressFn on_prefill;                             // prefill of the new text
};

struct TurnResult {
  chat::Message reply;
  StopReason reason = StopReason::MaxTokens;
  GenStats stats;
  int64_t prefilled = 0;  // tokens prefilled before generating (the new text only, normally)
  bool resynced = false;  // the reply's sampled ids were replaced by its canonical ids
};

class ChatSession {
 public:
  ChatSession(const Model& m, const tok::Tokenizer& tok, ChatOptions opt);

  // Appends a user (or tool-result) message and generates the assistant reply.
  TurnResult send(chat::Message msg, const TurnCallbacks& cb = {}, const std::atomic<bool>* interrupt = nullptr);
  void reset();  // forget the conversation (keeps options and the system prompt)

  // Chat file: options that shape the prompt, messages, ids, turn count and the exact Session
  // state. load() refuses a file from another model and leaves this chat untouched on error.
  void save(const std::string& path) const;
  void load(const std::string& path);

  const std::vector<chat::Message>& messages() const { return messages_; }
  const std::vector<tok::TokenId>& transcript() const { return transcript_; }
  const std::vector<float>& prompt_logits() const { return prompt_logits_; }  // after the last prefill
  const ChatOptions& options() const { return opt_; }
  int64_t turns() const { return turns_; }
  int64_t max_context() const;

 private:
  std::vector<tok::TokenId> render_ids(const std::vector<chat::Message>& msgs, bool generation_prompt) const;
  void start();  // system message + preamble, nothing prefilled yet

  const Model* model_;
  const tok::Tokenizer* tok_;
  ChatOptions opt_;
  Session session_;
  std::vector<chat::Message> messages_;
  std::vector<tok::TokenId> transcript_;  // == ids fed into session_
  std::vector<float> prompt_logits_;
  int64_t turns_ = 0;
};

}  // namespace k3
