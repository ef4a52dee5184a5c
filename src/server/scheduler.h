// The scheduler: the one thread that drives the Engine (the API's threading contract). Continuous
// batching: every step carries the decode token of each running request plus prefill pieces of
// admitted ones under a per-step token budget; FIFO admission up to --parallel sequences with a queue
// limit; cancellation and timeouts take effect at the next step; the prefix cache (prefix_cache.h)
// is consulted at admission and fed with snapshots. Owns sequences, samplers, detokenizers, output
// parsers and stop matching. Must not: know HTTP or JSON (jobs carry plain settings and results).
//
// Determinism: a request's tokens are fed in pieces whose ends depend only on its prompt's tokens
// (multiples of prefill_chunk, the ends of chat messages, its cache point), one token per decode
// step, so its results equal the same request run alone (the Engine's step guarantee), and a prompt
// snapshot restored by a later request sits on one of that request's own piece ends.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "k3/engine.h"
#include "server/job.h"
#include "server/json_constraint.h"
#include "server/metrics.h"
#include "server/prefix_cache.h"

namespace k3 {
class StopMatcher;
}

namespace k3::server {

struct SchedulerOptions {
  int parallel = 8;               // sequences decoded at once
  int max_queue = 64;             // requests waiting for a slot; more are refused (429)
  int64_t batch_tokens = 512;     // tokens per engine step (decode tokens + prefill pieces)
  int64_t prefill_chunk = 256;    // prefill pieces end at multiples of this (absolute positions)
  int64_t snapshot_every = 1024;  // prefix-cache snapshots at these positions (a multiple of prefill_chunk)
  uint64_t cache_bytes = 0;       // prefix-cache budget; 0 = off
  bool turn_snapshots = true;     // also cache the state at the end of every reply (decode-fed: see docs/server.md)
};

// Checks option ranges and relations; k3::Error naming the flag.
void check_scheduler_options(const SchedulerOptions& o);

class Scheduler {
 public:
  Scheduler(Engine& e, const SchedulerOptions& o, Metrics& m);
  ~Scheduler();  // stops the thread; unfinished jobs end with an error
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a job (FIFO). False when the queue is full (the job is left untouched).
  bool submit(std::shared_ptr<Job> j);
  void stop();

  int64_t queued() const { return queued_.load(); }
  int64_t running() const { return running_.load(); }
  PrefixCacheStats cache_stats() const;
  const SchedulerOptions& options() const { return opt_; }

 private:
  struct Active;
  void loop();
  void admit(std::shared_ptr<Job> j);
  int64_t piece_end(const Active& a) const;
  void snapshot(Active& a);
  bool needs_logits(const Active& a) const;
  void sample_and_emit(Active& a, const float* row, int32_t argmax);
  void emit_token(Active& a, int32_t tok, std::optional<TokenLogprob> lp);
  void complete(Active& a, std::string reason, int status = 200, std::string error = "");
  void release_sequence(Active& a, bool to_cache);
  void fail_job(const std::shared_ptr<Job>& j, const std::string& reason, int status, const std::string& error);
  const std::vector<std::string>& token_bytes();
  void publish();

  Engine& e_;
  SchedulerOptions opt_;
  Metrics& metrics_;
  int64_t vocab_;
  std::vector<int32_t> stop_ids_;
  std::unique_ptr<PrefixCache> cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> inbox_;
  bool stop_ = false;
  std::atomic<int64_t> queued_{0}, running_{0};
  PrefixCacheStats published_cache_;

  // scheduler thread only
  std::deque<std::shared_ptr<Job>> waiting_;
  std::vector<std::unique_ptr<Active>> active_;
  std::vector<std::string> token_bytes_;  // JSON constraint: bytes of every id ("" = never allowed)
  std::vector<float> logits_, scratch_;
  std::vector<int32_t> argmax_;
  std::thread thread_;
};

// log-softmax entry of `token` in row[vocab] with the `top` most likely alternatives.
TokenLogprob logprob_of(const float* row, int64_t vocab, int32_t token, int top);

}  // namespace k3::server
