// Continuous-batching scheduler over k3::Engine (see scheduler.h).
#include "server/scheduler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "runtime/generate.h"

namespace k3::server {

void check_scheduler_options(const SchedulerOptions& o) {
  if (o.parallel < 1 || o.parallel > 4096) fail("--parallel must be in 1..4096, not " + std::to_string(o.parallel));
  if (o.max_queue < 0) fail("--max-queue must be >= 0, not " + std::to_string(o.max_queue));
  if (o.prefill_chunk < 1) fail("--prefill-chunk must be >= 1, not " + std::to_string(o.prefill_chunk));
  if (o.batch_tokens < o.prefill_chunk)
    fail("--batch-tokens (" + std::to_string(o.batch_tokens) + ") must be at least --prefill-chunk (" +
         std::to_string(o.prefill_chunk) + ")");
  if (o.snapshot_every < o.prefill_chunk || o.snapshot_every % o.prefill_chunk != 0)
    fail("--snapshot-every (" + std::to_string(o.snapshot_every) + ") must be a multiple of --prefill-chunk (" +
         std::to_string(o.prefill_chunk) + ")");
}

TokenLogprob logprob_of(const float* row, int64_t vocab, int32_t token, int top) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, double(row[v]));
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
  const double lse = mx + std::log(sum);
  TokenLogprob lp;
  lp.id = token;
  lp.logprob = float(double(row[token]) - lse);
  if (top > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(vocab));
    for (int64_t v = 0; v < vocab; ++v) idx[size_t(v)] = int32_t(v);
    const size_t k = std::min<size_t>(size_t(top), idx.size());
    std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(k), idx.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    for (size_t i = 0; i < k; ++i) lp.top.emplace_back(idx[i], float(double(row[idx[i]]) - lse));
  }
  return lp;
}

struct Scheduler::Active {
  std::shared_ptr<Job> job;
  const GenRequest* req = nullptr;
  int32_t seq = -1;
  int64_t fed = 0;     // tokens the sequence holds
  int64_t cached = 0;  // of them restored from the prefix cache
  int64_t prefill_computed = 0;
  int64_t generated = 0, reasoning_tokens = 0;
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int32_t pending = -1;         // sampled, fed by the next step
  std::optional<TokenSampler> sampler;
  std::optional<Detokenizer> detok;
  std::unique_ptr<StopMatcher> stop;
  std::unique_ptr<chat::StreamParser> parser;  // chat requests: the engine's chat format
  JsonObjectPrefix json;
  bool saw_tool_call_end = false;
  Clock::time_point deadline, last_token;
  bool first_token = true;
  std::vector<TokenLogprob> prompt_lps;
};

Scheduler::Scheduler(Engine& e, const SchedulerOptions& o, Metrics& m)
    : e_(e), opt_(o), metrics_(m), vocab_(e.vocab_size()), stop_ids_(e.stop_ids()) {
  check_scheduler_options(o);
  const uint64_t state = e.sequence_state_bytes(), per_tok = e.cache_bytes_per_token();
  const int64_t page = e.cache_page_tokens();
  cache_ = std::make_unique<PrefixCache>(
      o.cache_bytes, [this](int32_t seq) { e_.free_sequence(seq); },
      [=](int64_t depth, int64_t shared) { return state + uint64_t(depth - shared + page) * per_tok; });
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Scheduler::submit(std::shared_ptr<Job> j) {
  {
    std::lock_guard<std::mutex> l(mu_);
    // Requests beyond the free slots wait; at most max_queue of them.
    const int64_t free_slots = std::max<int64_t>(0, opt_.parallel - running_.load());
    if (stop_ || queued_.load() >= opt_.max_queue + free_slots) return false;
    inbox_.push_back(std::move(j));
    ++queued_;
  }
  cv_.notify_all();
  return true;
}

PrefixCacheStats Scheduler::cache_stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return published_cache_;
}

void Scheduler::publish() {
  const PrefixCacheStats cs = cache_->stats();
  {
    std::lock_guard<std::mutex> l(mu_);
    published_cache_ = cs;
  }
  running_.store(int64_t(active_.size()));
  metrics_.set_gauges(queued_.load(), int64_t(active_.size()), cs.snapshots, cs.bytes);
}

const std::vector<std::string>& Scheduler::token_bytes() {
  if (token_bytes_.empty()) {
    token_bytes_.resize(size_t(vocab_));
    for (int64_t v = 0; v < vocab_; ++v) {
      try {
        const std::string plain = e_.detokenize({int32_t(v)}, /*skip_special=*/true);
        // Special tokens decode to nothing when skipped: never part of a JSON body.
        token_bytes_[size_t(v)] = plain;
      } catch (const std::exception&) {
        // an id the tokenizer lacks: never allowed
      }
    }
  }
  return token_bytes_;
}

void Scheduler::fail_job(const std::shared_ptr<Job>& j, const std::string& reason, int status,
                         const std::string& error) {
  Finish f;
  f.reason = reason;
  f.status = status;
  f.error = error;
  f.prompt_tokens = int64_t(j->req.prompt.size());
  metrics_.request_seconds(std::chrono::duration<double>(Clock::now() - j->created).count());
  j->finish(std::move(f));
}

void Scheduler::admit(std::shared_ptr<Job> j) {
  auto a = std::make_unique<Active>();
  a->job = j;
  a->req = &j->req;
  const GenRequest& r = j->req;
  a->deadline = j->created + std::chrono::microseconds(int64_t(r.timeout_s * 1e6));
  try {
    PrefixHit hit;
    if (cache_->enabled() && r.use_cache && !r.prompt_logprobs)
      hit = cache_->lookup(r.prompt, int64_t(r.prompt.size()) - 1);
    if (hit.seq >= 0) {
      a->seq = e_.fork_sequence(hit.seq);
      a->fed = a->cached = hit.depth;
    } else {
      a->seq = e_.new_sequence();
    }
    a->sampler.emplace(r.sampling, vocab_);
    for (int32_t t : r.prompt) a->sampler->accept(t);
    a->detok.emplace(e_, /*skip_special=*/!r.chat);
    a->stop = std::make_unique<StopMatcher>(r.stop);
    if (r.chat) a->parser = chat::chat_format(chat::parse_format_name(e_.chat_format())).parser(r.thinking_prompt);
  } catch (const std::exception& ex) {
    if (a->seq >= 0) e_.free_sequence(a->seq);
    fail_job(j, "error", 500, std::string("could not start the request: ") + ex.what());
    return;
  }
  a->tokens = r.prompt;
  a->last_token = Clock::now();
  active_.push_back(std::move(a));
}

int64_t Scheduler::piece_end(const Active& a) const {
  const int64_t n = int64_t(a.req->prompt.size());
  int64_t end = std::min(n, (a.fed / opt_.prefill_chunk + 1) * opt_.prefill_chunk);
  if (a.req->cache_point > a.fed && a.req->cache_point < end) end = a.req->cache_point;
  const auto& cuts = a.req->cuts;
  const auto next = std::upper_bound(cuts.begin(), cuts.end(), a.fed);
  if (next != cuts.end() && *next < end) end = *next;
  return end;
}

bool Scheduler::needs_logits(const Active& a) const {
  return !a.sampler->greedy() || a.req->top_logprobs >= 0 || a.req->json_object || !a.req->logit_bias.empty();
}

void Scheduler::snapshot(Active& a) {
  if (!cache_->enabled()) return;
  try {
    const int32_t s = e_.fork_sequence(a.seq);
    const auto before = cache_->stats();
    cache_->insert(std::span<const int32_t>(a.tokens.data(), size_t(a.fed)), s);
    const auto after = cache_->stats();
    metrics_.cache_inserted(int64_t(after.inserted - before.inserted));
    metrics_.cache_evicted(int64_t(after.evicted - before.evicted));
  } catch (const std::exception&) {
    // A snapshot is an optimisation: failing to take one (memory) changes no output.
  }
}

void Scheduler::release_sequence(Active& a, bool to_cache) {
  if (a.seq < 0) return;
  const int32_t s = a.seq;
  a.seq = -1;
  try {
    if (to_cache && cache_->enabled() && a.fed > 0) {
      const auto before = cache_->stats();
      cache_->insert(std::span<const int32_t>(a.tokens.data(), size_t(a.fed)), s);  // the sequence moves in
      const auto after = cache_->stats();
      metrics_.cache_inserted(int64_t(after.inserted - before.inserted));
      metrics_.cache_evicted(int64_t(after.evicted - before.evicted));
    } else {
      e_.free_sequence(s);
    }
  } catch (const std::exception&) {
  }
}

void Scheduler::complete(Active& a, std::string reason, int status, std::string error) {
  Finish f;
  const bool ok = reason == "stop" || reason == "length";
  if (ok) {
    // What the detokenizer and the stop matcher still hold, then the parser's end.
    Delta d;
    if (!a.stop->matched()) {
      d.text = a.stop->push(a.detok->flush());
      if (!a.stop->matched()) d.text += a.stop->flush();
    }
    if (a.parser) {
      d.events = a.parser->feed(d.text);
      auto more = a.parser->finish();
      d.events.insert(d.events.end(), more.begin(), more.end());
    }
    if (!d.text.empty() || !d.events.empty()) a.job->push(std::move(d));
    if (reason == "stop" && a.parser && !a.parser->result().calls.empty()) reason = "tool_calls";
  }
  f.reason = reason;
  f.status = status;
  f.error = std::move(error);
  f.prompt_tokens = int64_t(a.req->prompt.size());
  f.completion_tokens = a.generated;
  f.cached_tokens = a.cached;
  f.prefill_computed = a.prefill_computed;
  f.reasoning_tokens = a.reasoning_tokens;
  f.prompt_lps = std::move(a.prompt_lps);
  metrics_.tokens(f.prompt_tokens, f.completion_tokens, f.cached_tokens, f.prefill_computed);
  metrics_.request_seconds(std::chrono::duration<double>(Clock::now() - a.job->created).count());
  release_sequence(a, ok && opt_.turn_snapshots);
  a.job->finish(std::move(f));
}

void Scheduler::emit_token(Active& a, int32_t tok, std::optional<TokenLogprob> lp) {
  const GenRequest& r = *a.req;
  const auto now = Clock::now();
  if (a.first_token) {
    metrics_.ttft(std::chrono::duration<double>(now - a.job->created).count());
    a.first_token = false;
  } else {
    metrics_.inter_token(std::chrono::duration<double>(now - a.last_token).count());
  }
  a.last_token = now;
  ++a.generated;
  a.tokens.push_back(tok);
  Delta d;
  d.token = tok;
  d.lp = std::move(lp);
  std::string reason;
  const bool is_stop_id = std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
  if (is_stop_id && !r.ignore_eos) {
    reason = "stop";
  } else {
    d.text = a.stop->push(a.detok->push(tok));
    if (a.stop->matched()) reason = "stop";
    if (a.parser) {
      d.events = a.parser->feed(d.text);
      bool reasoning = false;
      for (const chat::Event& ev : d.events) {
        reasoning |= ev.kind == chat::EventKind::Reasoning;
        a.saw_tool_call_end |= ev.kind == chat::EventKind::ToolCallEnd;
      }
      a.reasoning_tokens += reasoning;
      // ignore_eos (a benchmarking extra) also goes past the end of the chat message: the tokens
      // after it are generated and counted, and the parser shows none of them
      if (a.parser->result().finished_message && !r.ignore_eos) reason = "stop";
      if (!r.parallel_tool_calls && a.saw_tool_call_end) reason = "stop";
    }
    if (r.json_object) {
      a.json.feed(token_bytes()[size_t(tok)]);
      if (a.json.complete()) reason = "stop";
    }
  }
  if (reason.empty() && a.generated >= r.max_tokens) reason = "length";
  if (reason.empty() && a.fed + 1 > e_.max_context()) reason = "length";
  a.job->push(std::move(d));
  if (!reason.empty()) {
    complete(a, reason);
    return;
  }
  a.pending = tok;
}

void Scheduler::sample_and_emit(Active& a, const float* row, int32_t argmax) {
  const GenRequest& r = *a.req;
  int32_t tok = argmax;
  std::optional<TokenLogprob> lp;
  if (row) {
    const float* src = row;
    if (r.json_object || !r.logit_bias.empty()) {
      scratch_.assign(row, row + vocab_);
      for (const auto& [id, b] : r.logit_bias)
        if (id >= 0 && id < vocab_) scratch_[size_t(id)] += b;
      if (r.json_object) {
        const auto& bytes = token_bytes();
        for (int64_t v = 0; v < vocab_; ++v)
          if (!a.json.accepts(bytes[size_t(v)])) scratch_[size_t(v)] = -INFINITY;
      }
      src = scratch_.data();
    }
    tok = a.sampler->greedy() && src == row ? argmax : a.sampler->sample(src);
    if (r.top_logprobs >= 0) lp = logprob_of(row, vocab_, tok, r.top_logprobs);
  }
  a.sampler->accept(tok);
  emit_token(a, tok, std::move(lp));
}

void Scheduler::loop() {
  std::vector<StepInput> in;
  std::vector<Active*> who;
  std::vector<bool> decode;
  for (;;) {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!stop_ && inbox_.empty() && active_.empty())
        cv_.wait_for(l, std::chrono::milliseconds(200), [&] { return stop_ || !inbox_.empty(); });
      if (stop_) break;
      while (!inbox_.empty()) {
        waiting_.push_back(std::move(inbox_.front()));
        inbox_.pop_front();
      }
    }
    const auto now = Clock::now();
    // Cancellations and timeouts, before anything else is spent on them.
    for (auto& a : active_) {
      if (a->job->cancel.load()) {
        complete(*a, "cancelled", 499, "the client went away");
      } else if (now > a->deadline) {
        complete(*a, "timeout", 504, "the request took longer than its timeout");
      }
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& a) { return a->seq < 0; }),
                  active_.end());
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      const auto& j = *it;
      if (j->cancel.load()) {
        fail_job(j, "cancelled", 499, "the client went away");
      } else if (now > j->created + std::chrono::microseconds(int64_t(j->req.timeout_s * 1e6))) {
        fail_job(j, "timeout", 504, "the request waited longer than its timeout");
      } else {
        ++it;
        continue;
      }
      it = waiting_.erase(it);
      --queued_;
    }
    while (int(active_.size()) < opt_.parallel && !waiting_.empty()) {
      std::shared_ptr<Job> j = std::move(waiting_.front());
      waiting_.pop_front();
      --queued_;
      admit(std::move(j));
    }
    publish();
    if (active_.empty()) continue;

    // The step: decode tokens first, then prefill pieces in admission order under the budget.
    in.clear();
    who.clear();
    decode.clear();
    int64_t budget = opt_.batch_tokens, tokens = 0;
    bool want_logits = false;
    for (auto& a : active_) {
      if (a->pending < 0) continue;
      in.push_back({a->seq, &a->pending, 1, false});
      who.push_back(a.get());
      decode.push_back(true);
      want_logits |= needs_logits(*a);
      --budget;
      ++tokens;
    }
    for (auto& a : active_) {
      if (a->pending >= 0 || a->fed >= int64_t(a->req->prompt.size())) continue;
      const int64_t end = piece_end(*a), n = end - a->fed;
      if (n > budget && !in.empty()) break;  // FIFO: later requests wait rather than overtake
      in.push_back({a->seq, a->req->prompt.data() + a->fed, n, a->req->prompt_logprobs});
      who.push_back(a.get());
      decode.push_back(false);
      want_logits |= a->req->prompt_logprobs || (end == int64_t(a->req->prompt.size()) && needs_logits(*a));
      budget -= n;
      tokens += n;
    }
    if (in.empty()) continue;

    const auto t0 = Clock::now();
    try {
      e_.step(in, want_logits ? &logits_ : nullptr, &argmax_);
    } catch (const std::exception& ex) {
      for (Active* a : who) complete(*a, "error", 500, std::string("engine step failed: ") + ex.what());
      active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& a) { return a->seq < 0; }),
                    active_.end());
      continue;
    }
    metrics_.step(int64_t(in.size()), tokens, std::chrono::duration<double>(Clock::now() - t0).count());

    size_t row = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      Active& a = *who[i];
      const size_t rows = in[i].all_logits ? size_t(in[i].n) : 1;
      const float* last = want_logits ? logits_.data() + (row + rows - 1) * size_t(vocab_) : nullptr;
      try {
        if (decode[i]) {
          a.fed += 1;
          a.pending = -1;
          sample_and_emit(a, needs_logits(a) ? last : nullptr, argmax_[i]);
        } else {
          const int64_t start = a.fed, n = in[i].n, plen = int64_t(a.req->prompt.size());
          if (a.req->prompt_logprobs) {
            // row k predicts the token at start + k + 1
            for (int64_t k = 0; k < n && start + k + 1 < plen; ++k)
              a.prompt_lps.push_back(logprob_of(logits_.data() + (row + size_t(k)) * size_t(vocab_), vocab_,
                                                a.req->prompt[size_t(start + k + 1)],
                                                std::max(0, a.req->top_logprobs)));
          }
          a.fed += n;
          a.prefill_computed += n;
          if (a.fed < plen) {
            if (a.fed % opt_.snapshot_every == 0 || a.fed == a.req->cache_point) snapshot(a);
          } else {
            sample_and_emit(a, needs_logits(a) ? last : nullptr, argmax_[i]);
          }
        }
      } catch (const std::exception& ex) {
        if (a.seq >= 0) complete(a, "error", 500, std::string("generation failed: ") + ex.what());
      }
      row += rows;
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& a) { return a->seq < 0; }),
                  active_.end());
    publish();
  }
  // Shutdown: every unfinished job ends with an error.
  for (auto& a : active_)
    if (a->seq >= 0) complete(*a, "error", 503, "the server is shutting down");
  active_.clear();
  for (auto& j : waiting_) fail_job(j, "error", 503, "the server is shutting down");
  waiting_.clear();
  std::lock_guard<std::mutex> l(mu_);
  for (auto& j : inbox_) fail_job(j, "error", 503, "the server is shutting down");
  inbox_.clear();
  cache_->clear();
}

}  // namespace k3::server
