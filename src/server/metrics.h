// Server metrics and their Prometheus text exposition (format 0.0.4, written by hand): request
// counts by endpoint and status, token counters, queue depth, running sequences, batch sizes,
// prefix-cache hits, time-to-first-token and inter-token latency histograms. Thread-safe.
// Must not: know HTTP or engine types (callers report plain numbers).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace k3::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // "name_bucket{le=...} n" ... "name_sum" "name_count"
  std::string expose(const std::string& name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, plus +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  void request_done(const std::string& endpoint, int status);
  void tokens(int64_t prompt, int64_t generated, int64_t cached, int64_t prefill_computed);
  void step(int64_t sequences, int64_t tokens, double seconds);
  void ttft(double seconds);
  void inter_token(double seconds);
  void request_seconds(double seconds);
  void set_gauges(int64_t queued, int64_t running, int64_t cache_snapshots, uint64_t cache_bytes);
  void cache_inserted(int64_t n);
  void cache_evicted(int64_t n);

  std::string expose() const;  // the whole text page

  // For tests and logs.
  int64_t prefill_computed() const;
  int64_t cached_tokens() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  int64_t prompt_ = 0, generated_ = 0, cached_ = 0, prefill_ = 0, steps_ = 0, step_tokens_ = 0;
  int64_t queued_ = 0, running_ = 0, snapshots_ = 0, cache_inserted_ = 0, cache_evicted_ = 0;
  uint64_t cache_bytes_ = 0;
  double step_seconds_ = 0;
  Histogram batch_seqs_, batch_tokens_, ttft_, itl_, req_seconds_;
};

}  // namespace k3::server
