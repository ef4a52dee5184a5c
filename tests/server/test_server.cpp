// Unit tests of the server library: the prefix cache's radix tree, SSE framing, the JSON-object
// constraint, the API-key compare, metrics text, request mapping and responses (tiny-chat), the
// scheduler (tiny-chat / K3-nano: batched == solo, cancellation within a step, cache hits), and
// /health while loading.
#include <gtest/gtest.h>
#include <httplib.h>

#include <set>
#include <thread>

#include "server/api.h"
#include "server/http_server.h"
#include "server/json_constraint.h"
#include "server/metrics.h"
#include "server/prefix_cache.h"
#include "server/scheduler.h"
#include "server/sse.h"

using namespace k3::server;

namespace {

std::string fixture(const char* name) { return std::string(K3_SOURCE_DIR) + "/tests/fixtures/" + name; }
std::string nano() { return std::string(K3_SOURCE_DIR) + "/models/k3-nano"; }

struct FakeSeqs {
  std::set<int32_t> freed;
  PrefixCache make(uint64_t budget, uint64_t per_snapshot = 10) {
    return PrefixCache(
        budget, [this](int32_t s) { freed.insert(s); }, [per_snapshot](int64_t, int64_t) { return per_snapshot; });
  }
};

std::vector<int32_t> ids(std::initializer_list<int32_t> l) { return l; }

}  // namespace

TEST(PrefixCache, DeepestSnapshotAtOrBelowTheLimit) {
  FakeSeqs f;
  PrefixCache c = f.make(1000);
  EXPECT_TRUE(c.insert(ids({1, 2, 3}), 10));
  EXPECT_TRUE(c.insert(ids({1, 2, 3, 4, 5, 6}), 11));
  EXPECT_TRUE(c.insert(ids({1, 2, 9}), 12));  // splits the edge after {1, 2}
  const auto q = ids({1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(c.lookup(q, 7).seq, 11);
  EXPECT_EQ(c.lookup(q, 7).depth, 6);
  EXPECT_EQ(c.lookup(q, 5).seq, 10);  // 6 is past the limit: the snapshot at 3
  EXPECT_EQ(c.lookup(q, 2).seq, -1);
  EXPECT_EQ(c.lookup(ids({1, 2, 9, 9}), 4).seq, 12);
  EXPECT_EQ(c.lookup(ids({1, 2, 4}), 3).seq, -1);        // diverges inside an edge
  EXPECT_EQ(c.lookup(ids({1, 2, 3, 4, 9}), 5).seq, 10);  // diverges below the deeper snapshot
  EXPECT_EQ(c.stats().snapshots, 3);
  EXPECT_TRUE(f.freed.empty());
}

TEST(PrefixCache, SameTokensKeepTheOlderSnapshot) {
  FakeSeqs f;
  PrefixCache c = f.make(1000);
  EXPECT_TRUE(c.insert(ids({5, 6}), 1));
  EXPECT_FALSE(c.insert(ids({5, 6}), 2));
  EXPECT_EQ(f.freed, std::set<int32_t>{2});
  EXPECT_EQ(c.lookup(ids({5, 6, 7}), 3).seq, 1);
}

TEST(PrefixCache, LruEvictionUnderTheBudgetAndPruning) {
  FakeSeqs f;
  PrefixCache c = f.make(30);  // three snapshots of 10 bytes
  c.insert(ids({1, 1}), 1);
  c.insert(ids({1, 2}), 2);
  c.insert(ids({1, 3}), 3);
  EXPECT_EQ(c.lookup(ids({1, 1, 0}), 3).seq, 1);  // 1 becomes most recently used
  c.insert(ids({2, 2}), 4);                       // evicts 2, the least recently used
  EXPECT_EQ(f.freed, std::set<int32_t>{2});
  EXPECT_EQ(c.lookup(ids({1, 2, 0}), 3).seq, -1);
  EXPECT_EQ(c.lookup(ids({1, 1, 0}), 3).seq, 1);
  EXPECT_EQ(c.stats().bytes, 30u);
  c.clear();
  EXPECT_EQ(f.freed, (std::set<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(c.stats().snapshots, 0);
  EXPECT_EQ(c.stats().nodes, 0);  // every node pruned
}

TEST(PrefixCache, OffOrOverBudgetReleasesAtOnce) {
  FakeSeqs f;
  PrefixCache off = f.make(0);
  EXPECT_FALSE(off.insert(ids({1}), 7));
  PrefixCache tiny = f.make(5);  // one snapshot (10) is over the budget
  EXPECT_FALSE(tiny.insert(ids({1}), 8));
  EXPECT_EQ(f.freed, (std::set<int32_t>{7, 8}));
}

TEST(Sse, Framing) {
  EXPECT_EQ(sse_data("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_data("a\nb\r\nc"), "data: a\ndata: b\ndata: c\n\n");
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  EXPECT_EQ(sse_comment("keep\nalive"), ": keep alive\n\n");
}

TEST(JsonObjectPrefix, AcceptsObjectsByteByByte) {
  for (const std::string doc :
       {R"({})", R"( {"a": [1, -2.5e3, true, null, "x\"\u00e9"], "b": {"c": {}}})", R"({"k":0.5,"l":[[],[{}]]})"}) {
    JsonObjectPrefix p;
    for (char ch : doc) ASSERT_TRUE(p.feed(std::string(1, ch))) << doc << " at " << ch;
    EXPECT_TRUE(p.complete()) << doc;
    EXPECT_FALSE(p.accepts("x"));
  }
}

TEST(JsonObjectPrefix, RejectsWhatCannotContinueAnObject) {
  JsonObjectPrefix p;
  EXPECT_FALSE(p.accepts("["));
  EXPECT_FALSE(p.accepts("\"a\""));
  EXPECT_FALSE(p.accepts(""));
  ASSERT_TRUE(p.feed("{\"a\""));
  EXPECT_FALSE(p.accepts(","));
  EXPECT_FALSE(p.accepts("}"));
  ASSERT_TRUE(p.feed(":"));
  EXPECT_FALSE(p.accepts("01"));
  EXPECT_FALSE(p.accepts("tru3"));
  EXPECT_FALSE(p.accepts("\"\x01"));
  EXPECT_TRUE(p.accepts("tr"));
  ASSERT_TRUE(p.feed("12"));
  EXPECT_FALSE(p.complete());
  ASSERT_TRUE(p.feed("}"));
  EXPECT_TRUE(p.complete());
  JsonObjectPrefix w;
  ASSERT_TRUE(w.feed("{"));
  EXPECT_FALSE(w.accepts(std::string(20, ' ')));  // whitespace runs are capped
}

TEST(Auth, ConstantTimeCompareIsExact) {
  EXPECT_TRUE(keys_equal("s3cret", "s3cret"));
  EXPECT_FALSE(keys_equal("s3cre", "s3cret"));
  EXPECT_FALSE(keys_equal("s3cretX", "s3cret"));
  EXPECT_FALSE(keys_equal("s3creT", "s3cret"));
  EXPECT_FALSE(keys_equal("", "s3cret"));
}

TEST(Metrics, PrometheusText) {
  Metrics m;
  m.request_done("/v1/completions", 200);
  m.tokens(10, 5, 4, 6);
  m.step(3, 12, 0.01);
  m.ttft(0.2);
  const std::string t = m.expose();
  EXPECT_NE(t.find("k3_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("k3_prefix_cache_hit_tokens_total 4\n"), std::string::npos);
  EXPECT_NE(t.find("k3_batch_sequences_bucket{le=\"4\"} 1\n"), std::string::npos);
  EXPECT_NE(t.find("k3_time_to_first_token_seconds_count 1\n"), std::string::npos);
  EXPECT_NE(t.find("# TYPE k3_inter_token_latency_seconds histogram"), std::string::npos);
}

class WithTinyChat : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    k3::EngineOptions o;
    o.model_dir = fixture("tiny-chat");
    o.numerics = "exact";
    o.prefault = false;
    engine_ = k3::Engine::load(o).release();
    cfg_.model_id = "tiny";
    cfg_.context = engine_->max_context();
    cfg_.sampling_defaults = engine_->sampling_defaults();
  }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }
  static ApiError error_of(const json& body, bool chat = true) {
    try {
      chat ? map_chat_request(body, *engine_, cfg_) : map_completion_request(body, *engine_, cfg_);
    } catch (const ApiError& e) {
      return e;
    }
    return ApiError(0, "no error");
  }
  static inline k3::Engine* engine_ = nullptr;
  static inline ApiConfig cfg_;
};

TEST_F(WithTinyChat, MappingRefusesBadRequestsByName) {
  const json msgs = json::array({{{"role", "user"}, {"content", "hi"}}});
  ApiError e = error_of({{"messages", msgs}, {"frequency_penalty", 1}, {"functions", 1}, {"audio", 2}});
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(std::string(e.what()), "unsupported parameters for /v1/chat/completions: audio, functions");
  e = error_of({{"messages", msgs}, {"top_p", 0}});
  EXPECT_EQ(e.param, "top_p");
  e = error_of({{"messages", msgs}, {"stream_options", {{"include_usage", true}}}});
  EXPECT_EQ(e.param, "stream_options");
  e = error_of({{"messages", msgs}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}});
  EXPECT_EQ(e.param, "tool_choice");
  e = error_of({{"messages", json::array({{{"role", "robot"}, {"content", "x"}}})}});
  EXPECT_EQ(e.param, "messages");
  e = error_of({{"model", "other"}, {"messages", msgs}});
  EXPECT_EQ(e.status, 404);
  e = error_of({{"prompt", json::array({1, 2})}, {"max_tokens", cfg_.context}}, false);
  EXPECT_EQ(e.code, "context_length_exceeded");
  e = error_of({{"prompt", json::array({"a", "b"})}}, false);
  EXPECT_NE(std::string(e.what()).find("batched prompts"), std::string::npos);
}

TEST_F(WithTinyChat, MappingResolvesSettings) {
  const json msgs = json::array({{{"role", "user"}, {"content", "hi"}}});
  ApiRequest r = map_chat_request({{"messages", msgs},
                                   {"temperature", 0},
                                   {"max_completion_tokens", 7},
                                   {"stop", "x"},
                                   {"seed", 9},
                                   {"top_logprobs", 2},
                                   {"logprobs", true}},
                                  *engine_, cfg_);
  EXPECT_EQ(r.gen.max_tokens, 7);
  EXPECT_EQ(r.gen.sampling.temperature, 0.0f);
  EXPECT_EQ(r.gen.sampling.seed, 9u);
  EXPECT_EQ(r.gen.top_logprobs, 2);
  EXPECT_EQ(r.gen.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(r.gen.thinking_prompt);
  // the cache point is the end of the last message, before the generation prompt
  ApiRequest nogen =
      map_chat_request({{"messages", msgs}, {"chat_template_kwargs", {{"enable_thinking", false}}}}, *engine_, cfg_);
  EXPECT_FALSE(nogen.gen.thinking_prompt);
  EXPECT_GT(r.gen.cache_point, 0);
  EXPECT_LT(r.gen.cache_point, int64_t(r.gen.prompt.size()));
  EXPECT_EQ(r.gen.max_tokens, 7);
  ApiRequest d = map_chat_request({{"messages", msgs}}, *engine_, cfg_);
  EXPECT_EQ(d.gen.max_tokens, cfg_.context - int64_t(d.gen.prompt.size()));
}

// A tool-call transcript parsed as the scheduler does (one byte at a time): the streamed chunks carry
// the call's id and name first, then argument pieces, and add up to the one-shot message.
TEST_F(WithTinyChat, ToolCallsStreamIncrementallyAndMatchTheMessage) {
  const std::string out =
      "I should look it up.<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" "
      "index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris, \"FR\"<|close|>argument<|sep|>"
      "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>"
      "<|close|>tools<|sep|><|close|>message<|sep|>";
  k3::chat::OutputParser p(true);
  ChatResponder cr(*engine_, "chatcmpl-x", "tiny", 0, false);
  std::string streamed_args, name, id, reasoning;
  int arg_chunks = 0;
  for (char ch : out) {
    Delta d;
    d.events = p.feed(std::string(1, ch));
    if (auto c = cr.chunk(d)) {
      const json& delta = (*c)["choices"][0]["delta"];
      EXPECT_FALSE(delta.contains("content")) << "markers leaked into content: " << dump(delta);
      if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
      if (delta.contains("tool_calls")) {
        const json& tc = delta["tool_calls"][0];
        EXPECT_EQ(tc["index"], 0);
        if (tc.contains("id")) {
          id = tc["id"];
          name = tc["function"]["name"];
        }
        streamed_args += tc["function"]["arguments"].get<std::string>();
        ++arg_chunks;
      }
    }
  }
  Delta last;
  last.events = p.finish();
  cr.chunk(last);
  EXPECT_EQ(reasoning, "I should look it up.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(id.rfind("call_", 0), 0u);
  EXPECT_GT(arg_chunks, 5) << "arguments arrived in one piece";
  EXPECT_EQ(json::parse(streamed_args), json::parse(R"({"city": "Paris, \"FR\"", "days": 3})"));
  Finish f;
  f.reason = "tool_calls";
  const json msg = cr.response(f)["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_EQ(msg["tool_calls"][0]["id"], id);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"].get<std::string>(), streamed_args);
  EXPECT_EQ(cr.response(f)["choices"][0]["finish_reason"], "tool_calls");
}

namespace {

std::shared_ptr<Job> job_of(const std::vector<int32_t>& prompt, int64_t max_tokens, int64_t cache_point = -1) {
  auto j = std::make_shared<Job>();
  j->req.prompt = prompt;
  j->req.sampling.temperature = 0;
  j->req.max_tokens = max_tokens;
  j->req.ignore_eos = true;
  j->req.cache_point = cache_point;
  return j;
}

std::vector<int32_t> wait_tokens(Job& j, Finish* fin) {
  std::unique_lock<std::mutex> l(j.mu);
  j.cv.wait(l, [&] { return j.finished; });
  *fin = j.fin;
  std::vector<int32_t> out;
  for (const Delta& d : j.deltas) out.push_back(d.token);
  return out;
}

std::vector<int32_t> prompt_of(const k3::Engine& e, int i) {
  return e.tokenize("Prompt number " + std::to_string(i) +
                    " says something different from the others: " + std::string(size_t(i % 5), 'x'));
}

}  // namespace

// Many greedy requests at once (prefill pieces and decode tokens of different requests in the same
// steps) each equal their solo run, token for token.
TEST(Scheduler, BatchedRequestsEqualSoloRuns) {
  k3::EngineOptions o;
  o.model_dir = nano();
  o.prefault = false;
  auto e = k3::Engine::load(o);
  Metrics m;
  SchedulerOptions so;
  so.parallel = 6;
  so.prefill_chunk = 8;  // several pieces per prompt
  so.batch_tokens = 16;
  so.snapshot_every = 8;
  std::vector<std::vector<int32_t>> solo;
  {
    Scheduler s(*e, so, m);
    for (int i = 0; i < 6; ++i) {
      auto j = job_of(prompt_of(*e, i), 6);
      ASSERT_TRUE(s.submit(j));
      Finish f;
      solo.push_back(wait_tokens(*j, &f));
      EXPECT_EQ(f.reason, "length");
    }
  }
  Scheduler s(*e, so, m);
  std::vector<std::shared_ptr<Job>> jobs;
  for (int i = 0; i < 6; ++i) {
    jobs.push_back(job_of(prompt_of(*e, i), 6));
    ASSERT_TRUE(s.submit(jobs.back()));
  }
  for (int i = 0; i < 6; ++i) {
    Finish f;
    EXPECT_EQ(wait_tokens(*jobs[size_t(i)], &f), solo[size_t(i)]) << "request " << i;
    EXPECT_EQ(f.completion_tokens, 6);
  }
}

// A prompt-boundary snapshot restores bit-identically: the same request with the cache on (hit at its
// cache point) and off gives the same tokens, and reports the cached tokens.
TEST(Scheduler, CacheHitAtACachePointEqualsNoCache) {
  k3::EngineOptions o;
  o.model_dir = fixture("tiny-chat");
  o.numerics = "exact";
  o.prefault = false;
  auto e = k3::Engine::load(o);
  Metrics m;
  SchedulerOptions so;
  so.prefill_chunk = 8;
  so.snapshot_every = 8;
  const std::vector<int32_t> prompt = prompt_of(*e, 3);
  const int64_t cp = int64_t(prompt.size()) - 3;
  std::vector<int32_t> off;
  {
    Scheduler s(*e, so, m);
    auto j = job_of(prompt, 5, cp);
    s.submit(j);
    Finish f;
    off = wait_tokens(*j, &f);
    EXPECT_EQ(f.cached_tokens, 0);
  }
  so.cache_bytes = 64u << 20;
  Scheduler s(*e, so, m);
  for (int round = 0; round < 2; ++round) {
    auto j = job_of(prompt, 5, cp);
    s.submit(j);
    Finish f;
    EXPECT_EQ(wait_tokens(*j, &f), off) << "round " << round;
    EXPECT_EQ(f.cached_tokens, round == 0 ? 0 : cp);
    EXPECT_EQ(f.prefill_computed, round == 0 ? int64_t(prompt.size()) : int64_t(prompt.size()) - cp);
  }
  EXPECT_GT(s.cache_stats().snapshots, 0);
}

TEST(Scheduler, CancelFreesTheSequenceWithinAStep) {
  k3::EngineOptions o;
  o.model_dir = fixture("tiny-chat");
  o.prefault = false;
  auto e = k3::Engine::load(o);
  Metrics m;
  Scheduler s(*e, SchedulerOptions{}, m);
  auto j = job_of(prompt_of(*e, 1), 100000 > e->max_context() ? e->max_context() - 40 : 1000);
  ASSERT_TRUE(s.submit(j));
  {
    std::unique_lock<std::mutex> l(j->mu);
    j->cv.wait(l, [&] { return j->deltas.size() >= 2; });
  }
  j->cancel.store(true);
  Finish f;
  wait_tokens(*j, &f);
  EXPECT_EQ(f.reason, "cancelled");
  EXPECT_LT(f.completion_tokens, e->max_context() - 100);
  for (int i = 0; i < 100 && s.running() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(s.running(), 0);
}

TEST(Scheduler, QueueLimitAndTimeout) {
  k3::EngineOptions o;
  o.model_dir = fixture("tiny-chat");
  o.prefault = false;
  auto e = k3::Engine::load(o);
  Metrics m;
  SchedulerOptions so;
  so.parallel = 1;
  so.max_queue = 1;
  Scheduler s(*e, so, m);
  auto a = job_of(prompt_of(*e, 1), 200), b = job_of(prompt_of(*e, 2), 2), c = job_of(prompt_of(*e, 3), 2);
  b->req.timeout_s = 1e-6;  // expires while it waits
  EXPECT_TRUE(s.submit(a));
  EXPECT_TRUE(s.submit(b));
  EXPECT_FALSE(s.submit(c));  // one slot busy (or about to be), one waiting: full
  Finish fb;
  wait_tokens(*b, &fb);
  EXPECT_EQ(fb.reason, "timeout");
  EXPECT_EQ(fb.status, 504);
  a->cancel.store(true);
  Finish fa;
  wait_tokens(*a, &fa);
}

TEST(HttpServer, HealthIs503WithProgressWhileLoading) {
  Metrics m;
  HttpOptions ho;
  ho.port = 0;
  HttpServer h(ho, m);
  const int port = h.bind();
  std::thread t([&] { h.serve(); });
  h.set_load_progress(25, 100);
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["status"], "loading");
  EXPECT_DOUBLE_EQ(j["progress"].get<double>(), 0.25);
  auto r2 = c.Post("/v1/completions", "{}", "application/json");
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->status, 503);
  EXPECT_EQ(json::parse(r2->body)["error"]["code"], "loading");
  h.stop();
  t.join();
}
