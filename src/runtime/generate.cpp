// Prefill/decode loops and stop-sequence matching (see generate.h).
#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace k3 {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::MaxTokens:
      return "max-tokens";
    case StopReason::EndToken:
      return "eos";
    case StopReason::StopSequence:
      return "stop-sequence";
    case StopReason::Interrupted:
      return "interrupted";
    case StopReason::ContextFull:
      return "context-full";
  }
  return "?";
}

bool prefill(const Model& m, Session& s, std::span<const int32_t> ids, int64_t ubatch, const ForwardOptions& opt,
             float* last_logits, const ProgressFn& progress, const std::atomic<bool>* interrupt, GenStats* stats) {
  if (ids.empty()) fail("prefill needs at least one token");
  if (ubatch < 1) fail("ubatch must be at least 1");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = int64_t(ids.size());
  int64_t done = 0;
  bool complete = true;
  while (done < n) {
    if (interrupt && interrupt->load()) {
      complete = false;
      break;
    }
    const int64_t piece = std::min(ubatch, n - done);
    m.forward(s, ids.data() + done, piece, false, last_logits, opt);
    done += piece;
    if (progress) progress(done, n);
  }
  if (stats) {
    stats->prompt_tokens += done;
    stats->prefill_seconds += seconds_since(t0);
  }
  return complete;
}

DecodeResult decode(const Model& m, Session& s, Sampler& sampler, float* logits, const DecodeLimits& lim,
                    const ForwardOptions& opt, const std::function<bool(int32_t)>& on_token, GenStats* stats) {
  DecodeResult r;
  const auto t0 = std::chrono::steady_clock::now();
  // On the GPU, greedy decoding without penalties picks each next token on the device (the same
  // argmax, ties to the lowest id) and copies back 4 bytes instead of the logits.
  const bool device_greedy = m.on_gpu() && sampler.plain_greedy();
  int32_t picked = -1;
  ForwardOptions step_opt = opt;
  if (device_greedy) step_opt.argmax_out = &picked;
  for (int64_t i = 0;; ++i) {
    if (i >= lim.max_tokens) {
      r.reason = StopReason::MaxTokens;
      break;
    }
    if (lim.interrupt && lim.interrupt->load()) {
      r.reason = StopReason::Interrupted;
      break;
    }
    const int32_t tok = device_greedy && picked >= 0 ? picked : sampler.sample(logits);
    sampler.accept(tok);
    r.tokens.push_back(tok);
    if (std::find(lim.end_tokens.begin(), lim.end_tokens.end(), tok) != lim.end_tokens.end()) {
      r.reason = StopReason::EndToken;
      break;
    }
    if (on_token && !on_token(tok)) {
      r.reason = StopReason::StopSequence;
      break;
    }
    if (i + 1 >= lim.max_tokens) {  // nothing would read the logits of this token
      r.reason = StopReason::MaxTokens;
      break;
    }
    if (s.position() + 1 > lim.max_position) {
      r.reason = StopReason::ContextFull;
      break;
    }
    m.forward(s, &tok, 1, false, device_greedy ? nullptr : logits, step_opt);
    ++r.fed;
  }
  if (stats) {
    stats->generated_tokens += int64_t(r.tokens.size());
    stats->decode_seconds += seconds_since(t0);
  }
  return r;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove_if(stops_.begin(), stops_.end(), [](const std::string& x) { return x.empty(); }),
               stops_.end());
}

std::string StopMatcher::push(std::string_view text) {
  if (matched_) return {};
  held_.append(text);
  // Earliest complete stop sequence wins (ties: the longer one, which starts at the same place).
  size_t best = std::string::npos;
  for (const auto& st : stops_) {
    const size_t at = held_.find(st);
    if (at != std::string::npos &&
        (best == std::string::npos || at < best || (at == best && st.size() > which_.size()))) {
      best = at;
      which_ = st;
    }
  }
  if (best != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop sequence.
  size_t keep = 0;
  for (const auto& st : stops_)
    for (size_t k = std::min(st.size() - 1, held_.size()); k > keep; --k)
      if (held_.compare(held_.size() - k, k, st, 0, k) == 0) {
        keep = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!matched_) out.swap(held_);
  held_.clear();
  return out;
}

}  // namespace k3
