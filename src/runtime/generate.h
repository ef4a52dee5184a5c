// Text generation over a Model + Session: chunked prefill with progress, the sample -> feed decode
// loop with stop tokens / limits / interruption, and stop-sequence matching on streamed text.
// Owns timing of prefill and decode. Must not: print anything (front ends do) or know the chat
// format (see chat_session.h).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/model.h"
#include "runtime/sampler.h"

namespace k3 {

enum class StopReason { MaxTokens, EndToken, StopSequence, Interrupted, ContextFull };
const char* stop_reason_name(StopReason r);  // "max-tokens", "eos", "stop-sequence", ...

struct GenStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  double prefill_tps() const { return prefill_seconds > 0 ? double(prompt_tokens) / prefill_seconds : 0; }
  double decode_tps() const { return decode_seconds > 0 ? double(generated_tokens) / decode_seconds : 0; }
};

using ProgressFn = std::function<void(int64_t done, int64_t total)>;

// Feeds ids in pieces of at most `ubatch` tokens (bounded activation memory; progress after each
// piece) and writes the last token's logits [vocab]. Returns false if `interrupt` was raised
// between pieces (the session then holds a prefix of ids). Adds to stats->prefill_*.
bool prefill(const Model& m, Session& s, std::span<const int32_t> ids, int64_t ubatch, const ForwardOptions& opt,
             float* last_logits, const ProgressFn& progress = {}, const std::atomic<bool>* interrupt = nullptr,
             GenStats* stats = nullptr);

struct DecodeLimits {
  int64_t max_tokens = 256;
  int64_t max_position = INT64_MAX;  // the session may not grow beyond this many tokens
  std::vector<int32_t> end_tokens;   // sampled -> stop (EndToken); the token is returned, not fed
  const std::atomic<bool>* interrupt = nullptr;
};

struct DecodeResult {
  std::vector<int32_t> tokens;  // every sampled token, in order
  int64_t fed = 0;              // tokens[0, fed) went through the model; the rest did not
  StopReason reason = StopReason::MaxTokens;
};

// The decode loop. `logits` holds the next-token logits on entry and is overwritten as tokens are
// fed (except on the GPU with a plain-greedy sampler: each next token is then picked on the device
// and `logits` keeps its entry value). on_token(id) is called for every sampled token that is not an end token;
// returning false stops with StopSequence. The last sampled token is never fed (nothing would read its logits).
DecodeResult decode(const Model& m, Session& s, Sampler& sampler, float* logits, const DecodeLimits& lim,
                    const ForwardOptions& opt, const std::function<bool(int32_t)>& on_token, GenStats* stats = nullptr);

// Streams text through stop sequences: push() returns what can be shown now, holding back any
// tail that could still grow into a stop sequence. Once a stop sequence is complete, matched() is
// true and the text before it (never the sequence itself) has been returned.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string push(std::string_view text);
  std::string flush();  // the held-back tail at the end of generation
  bool matched() const { return matched_; }
  const std::string& matched_sequence() const { return which_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
  std::string which_;
};

}  // namespace k3
