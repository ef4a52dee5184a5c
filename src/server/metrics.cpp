// Prometheus text exposition of the server's counters, gauges and histograms (see metrics.h).
#include "server/metrics.h"

#include <cstdio>

namespace k3::server {

namespace {
std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}
void head(std::string& s, const char* name, const char* type, const char* help) {
  s += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}
}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

std::string Histogram::expose(const std::string& name) const {
  std::string s;
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    s += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  s += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
  s += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
  return s;
}

Metrics::Metrics()
    : batch_seqs_({1, 2, 4, 8, 16, 32, 64, 128, 256}),
      batch_tokens_({1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096}),
      ttft_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      req_seconds_({0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}) {}

void Metrics::request_done(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> l(mu_);
  ++requests_[{endpoint, status}];
}
void Metrics::tokens(int64_t prompt, int64_t generated, int64_t cached, int64_t prefill_computed) {
  std::lock_guard<std::mutex> l(mu_);
  prompt_ += prompt;
  generated_ += generated;
  cached_ += cached;
  prefill_ += prefill_computed;
}
void Metrics::step(int64_t sequences, int64_t tokens, double seconds) {
  std::lock_guard<std::mutex> l(mu_);
  ++steps_;
  step_tokens_ += tokens;
  step_seconds_ += seconds;
  batch_seqs_.observe(double(sequences));
  batch_tokens_.observe(double(tokens));
}
void Metrics::ttft(double s) {
  std::lock_guard<std::mutex> l(mu_);
  ttft_.observe(s);
}
void Metrics::inter_token(double s) {
  std::lock_guard<std::mutex> l(mu_);
  itl_.observe(s);
}
void Metrics::request_seconds(double s) {
  std::lock_guard<std::mutex> l(mu_);
  req_seconds_.observe(s);
}
void Metrics::set_gauges(int64_t queued, int64_t running, int64_t snapshots, uint64_t cache_bytes) {
  std::lock_guard<std::mutex> l(mu_);
  queued_ = queued;
  running_ = running;
  snapshots_ = snapshots;
  cache_bytes_ = cache_bytes;
}
void Metrics::cache_inserted(int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  cache_inserted_ += n;
}
void Metrics::cache_evicted(int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  cache_evicted_ += n;
}
int64_t Metrics::prefill_computed() const {
  std::lock_guard<std::mutex> l(mu_);
  return prefill_;
}
int64_t Metrics::cached_tokens() const {
  std::lock_guard<std::mutex> l(mu_);
  return cached_;
}

std::string Metrics::expose() const {
  std::lock_guard<std::mutex> l(mu_);
  std::string s;
  head(s, "k3_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [k, v] : requests_)
    s += "k3_requests_total{endpoint=\"" + k.first + "\",status=\"" + std::to_string(k.second) + "\"} " +
         std::to_string(v) + "\n";
  const auto counter = [&](const char* name, const char* help, double v) {
    head(s, name, "counter", help);
    s += std::string(name) + " " + num(v) + "\n";
  };
  const auto gauge = [&](const char* name, const char* help, double v) {
    head(s, name, "gauge", help);
    s += std::string(name) + " " + num(v) + "\n";
  };
  counter("k3_prompt_tokens_total", "Prompt tokens of finished generation requests.", double(prompt_));
  counter("k3_generation_tokens_total", "Tokens generated.", double(generated_));
  counter("k3_prefix_cache_hit_tokens_total", "Prompt tokens restored from the prefix cache instead of computed.",
          double(cached_));
  counter("k3_prefill_tokens_computed_total", "Prompt tokens run through the model.", double(prefill_));
  counter("k3_engine_steps_total", "Engine steps run by the scheduler.", double(steps_));
  counter("k3_engine_step_tokens_total", "Tokens fed to the engine (prefill + decode).", double(step_tokens_));
  counter("k3_engine_step_seconds_total", "Time spent inside engine steps.", step_seconds_);
  counter("k3_prefix_cache_snapshots_inserted_total", "Snapshots given to the prefix cache.", double(cache_inserted_));
  counter("k3_prefix_cache_snapshots_evicted_total", "Snapshots evicted (LRU, memory budget).", double(cache_evicted_));
  gauge("k3_queue_depth", "Requests waiting for a sequence slot.", double(queued_));
  gauge("k3_running_sequences", "Requests being prefilled or decoded.", double(running_));
  gauge("k3_prefix_cache_snapshots", "Snapshots held by the prefix cache.", double(snapshots_));
  gauge("k3_prefix_cache_bytes", "Bytes charged to the prefix cache's snapshots.", double(cache_bytes_));
  head(s, "k3_batch_sequences", "histogram", "Sequences per engine step.");
  s += batch_seqs_.expose("k3_batch_sequences");
  head(s, "k3_batch_tokens", "histogram", "Tokens per engine step.");
  s += batch_tokens_.expose("k3_batch_tokens");
  head(s, "k3_time_to_first_token_seconds", "histogram", "From request arrival to its first generated token.");
  s += ttft_.expose("k3_time_to_first_token_seconds");
  head(s, "k3_inter_token_latency_seconds", "histogram", "Between consecutive generated tokens of a request.");
  s += itl_.expose("k3_inter_token_latency_seconds");
  head(s, "k3_request_duration_seconds", "histogram", "From arrival to the end of a generation request.");
  s += req_seconds_.expose("k3_request_duration_seconds");
  return s;
}

}  // namespace k3::server
