// One generation request as the scheduler runs it (Job) and what flows back to the HTTP thread that
// waits on it (Delta, Finish). Owns the hand-over between the two threads (mutex + condition).
// Must not: hold engine state (sequences, samplers live in the scheduler) or any HTTP/JSON types.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chat/chat.h"
#include "k3/engine.h"

namespace k3::server {

using Clock = std::chrono::steady_clock;

// A validated request: the prompt as ids and every generation setting resolved.
struct GenRequest {
  std::vector<int32_t> prompt;
  SamplingOptions sampling;
  int64_t max_tokens = 16;  // resolved (prompt + max_tokens <= context)
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int top_logprobs = -1;         // -1: no logprobs; 0..20: logprob of each token + this many alternatives
  bool prompt_logprobs = false;  // completions echo + logprobs: logprobs of the prompt tokens too
  bool chat = false;             // parse the output as XTML (reasoning / content / tool calls)
  bool thinking_prompt = true;   // the generation prompt opened `think`
  bool json_object = false;      // response_format json_object: constrained to one JSON object
  bool parallel_tool_calls = true;
  std::vector<std::pair<int32_t, float>> logit_bias;
  bool use_cache = true;     // may restore a prefix-cache snapshot
  int64_t cache_point = -1;  // extra snapshot position inside the prompt (chat: before the generation prompt)
  // Prompt positions where prefill pieces end, ascending (chat: after every message). They depend only
  // on the prompt's tokens, so a snapshot taken at one by an earlier request of the same conversation
  // is a piece boundary of this request too: restoring it computes exactly what a cold run computes.
  std::vector<int64_t> cuts;
  double timeout_s = 600;
};

struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// What one generated token produced (text after stop-sequence hold-back; parsed chat events).
struct Delta {
  int32_t token = -1;
  std::string text;                 // raw text released (completions content; chat: parser input)
  std::vector<chat::Event> events;  // chat only
  std::optional<TokenLogprob> lp;
};

struct Finish {
  std::string reason;  // stop | length | tool_calls | cancelled | timeout | error
  int status = 200;    // error: the HTTP status
  std::string error;   // error: the message
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0, prefill_computed = 0, reasoning_tokens = 0;
  std::vector<TokenLogprob> prompt_lps;  // prompt_logprobs: entries for prompt tokens 1..n-1
};

struct Job {
  uint64_t id = 0;
  GenRequest req;
  Clock::time_point created = Clock::now();
  std::atomic<bool> cancel{false};  // set by the HTTP side (disconnect); the scheduler frees within a step

  // scheduler -> HTTP thread
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Delta> deltas;
  bool finished = false;
  Finish fin;

  void push(Delta d) {
    {
      std::lock_guard<std::mutex> l(mu);
      deltas.push_back(std::move(d));
    }
    cv.notify_all();
  }
  void finish(Finish f) {
    {
      std::lock_guard<std::mutex> l(mu);
      fin = std::move(f);
      finished = true;
    }
    cv.notify_all();
  }
};

}  // namespace k3::server
