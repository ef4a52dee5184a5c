// Runtime layer on the tiny-chat checkpoint (tiny K3 + the 2,256-rank test tokenizer):
// Session mark/rollback and save/load are exact; prefill in pieces == one pass; StopMatcher holds
// back exactly the possible stop prefixes; ChatSession keeps the canonical transcript, so a
// multi-turn chat equals rendering the conversation and prefilling it at once; chat files round
// trip exactly and refuse bad input; memory plan and size parsing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/num_util.h"
#include "common/run_cmd.h"
#include "core/error.h"
#include "runtime/chat_session.h"
#include "runtime/generate.h"
#include "core/thread_pool.h"
#include "runtime/memory.h"

namespace fs = std::filesystem;
using k3test::rel_l2;

namespace {

constexpr double kPathTol = 1e-5;  // rel-L2: the same tokens through different prefill splits

fs::path fixture() { return fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny-chat"; }

struct Loaded {
  std::unique_ptr<k3::Model> model;
  k3::tok::Tokenizer tok;
};
const Loaded& tiny() {
  static Loaded* l = new Loaded{k3::Model::load(fixture().string()), k3::tok::Tokenizer::load_dir(fixture().string())};
  return *l;
}

std::vector<int32_t> random_ids(std::mt19937& rng, size_t n, int32_t vocab) {
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> last_logits(const k3::Model& m, const std::vector<int32_t>& ids) {
  k3::Session s(m);
  std::vector<float> l(size_t(m.dims().vocab), k3test::qnan());
  m.forward(s, ids.data(), int64_t(ids.size()), false, l.data());
  return l;
}

fs::path tmp_file(const std::string& name) {
  return fs::temp_directory_path() / ("k3rt_" + std::to_string(::getpid()) + "_" + name);
}

}  // namespace

TEST(Prefill, PiecesEqualOnePassAndReportProgress) {
  const auto& m = *tiny().model;
  std::mt19937 rng(11);
  const auto ids = random_ids(rng, 37, int32_t(m.dims().vocab));
  const auto ref = last_logits(m, ids);
  k3::Session s(m);
  std::vector<float> l(size_t(m.dims().vocab), k3test::qnan());
  std::vector<int64_t> seen;
  k3::GenStats st;
  ASSERT_TRUE(k3::prefill(
      m, s, ids, 8, {}, l.data(),
      [&](int64_t d, int64_t n) {
        EXPECT_EQ(n, 37);
        seen.push_back(d);
      },
      nullptr, &st));
  EXPECT_EQ(seen, (std::vector<int64_t>{8, 16, 24, 32, 37}));
  EXPECT_EQ(st.prompt_tokens, 37);
  EXPECT_EQ(k3test::count_nan(l), 0u);
  EXPECT_LT(rel_l2(l, ref), kPathTol);
}

TEST(Prefill, InterruptStopsBetweenPieces) {
  const auto& m = *tiny().model;
  std::mt19937 rng(12);
  const auto ids = random_ids(rng, 20, int32_t(m.dims().vocab));
  k3::Session s(m);
  std::vector<float> l(size_t(m.dims().vocab));
  std::atomic<bool> stop{false};
  const bool done = k3::prefill(
      m, s, ids, 5, {}, l.data(), [&](int64_t d, int64_t) { stop = d >= 10; }, &stop);
  EXPECT_FALSE(done);
  EXPECT_EQ(s.position(), 10);
}

TEST(Session, MarkRollbackIsExact) {
  const auto& m = *tiny().model;
  std::mt19937 rng(13);
  const auto a = random_ids(rng, 12, int32_t(m.dims().vocab)), b = random_ids(rng, 9, int32_t(m.dims().vocab)),
             c = random_ids(rng, 5, int32_t(m.dims().vocab));
  k3::Session s(m);
  std::vector<float> la(size_t(m.dims().vocab)), lb(la.size()), lc(la.size());
  m.forward(s, a.data(), int64_t(a.size()), false, la.data());
  const auto mk = s.mark();
  m.forward(s, b.data(), int64_t(b.size()), false, lb.data());  // a detour, then back
  s.rollback(mk);
  EXPECT_EQ(s.position(), int64_t(a.size()));
  m.forward(s, c.data(), int64_t(c.size()), false, lc.data());
  k3::Session fresh(m);
  std::vector<float> ref(la.size());
  m.forward(fresh, a.data(), int64_t(a.size()), false, ref.data());
  m.forward(fresh, c.data(), int64_t(c.size()), false, ref.data());
  EXPECT_EQ(lc, ref);  // same ops on the same state: bit-identical
  k3::Session shorter(m);
  EXPECT_THROW(shorter.rollback(mk), k3::Error);
}

TEST(Session, SaveLoadRoundTripIsBitExact) {
  const auto& m = *tiny().model;
  std::mt19937 rng(14);
  const auto a = random_ids(rng, 15, int32_t(m.dims().vocab)), b = random_ids(rng, 4, int32_t(m.dims().vocab));
  k3::Session s(m);
  std::vector<float> l(size_t(m.dims().vocab)), l2(l.size());
  m.forward(s, a.data(), int64_t(a.size()), false, l.data());
  std::stringstream buf;
  s.save(buf);
  k3::Session r(m);
  r.load(buf);
  EXPECT_EQ(r.position(), s.position());
  EXPECT_EQ(r.state_bytes(), s.state_bytes());
  m.forward(s, b.data(), int64_t(b.size()), false, l.data());
  m.forward(r, b.data(), int64_t(b.size()), false, l2.data());
  EXPECT_EQ(l, l2);
  // Truncated and foreign files are refused and leave the session untouched.
  const std::string img = [&] {
    std::stringstream o;
    s.save(o);
    return o.str();
  }();
  for (size_t cut : {size_t(3), size_t(20), img.size() / 2, img.size() - 1}) {
    std::stringstream t(img.substr(0, cut));
    k3::Session x(m);
    EXPECT_THROW(x.load(t), k3::Error) << "cut at " << cut;
    EXPECT_EQ(x.position(), 0);
  }
  std::string other = img;
  other[9] ^= 0x5a;  // fingerprint byte
  std::stringstream o2(other);
  k3::Session y(m);
  try {
    y.load(o2);
    FAIL() << "foreign session accepted";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("different model"), std::string::npos) << e.what();
  }
}

TEST(StopMatcher, HoldsBackOnlyPossiblePrefixes) {
  k3::StopMatcher sm({"STOP", "\n\n"});
  std::string out;
  out += sm.push("abc S");
  EXPECT_EQ(out, "abc ");  // "S" may start STOP
  out += sm.push("T");
  EXPECT_EQ(out, "abc ");
  out += sm.push("x");  // "STx" is not a prefix: released
  EXPECT_EQ(out, "abc STx");
  out += sm.push("\n");
  EXPECT_EQ(out, "abc STx");
  out += sm.push("y ST");
  EXPECT_EQ(out, "abc STx\ny ");
  out += sm.push("OP tail");
  EXPECT_TRUE(sm.matched());
  EXPECT_EQ(sm.matched_sequence(), "STOP");
  EXPECT_EQ(out, "abc STx\ny ");
  EXPECT_EQ(sm.push("more"), "");
  EXPECT_EQ(sm.flush(), "");
  // Split at every byte: the shown text is always the text before the first stop sequence.
  const std::string text = "one two\n\nthree STOP four";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    k3::StopMatcher s2({"STOP", "\n\n"});
    std::string shown = s2.push(text.substr(0, cut));
    shown += s2.push(text.substr(cut));
    shown += s2.flush();
    EXPECT_EQ(shown, "one two") << cut;
    EXPECT_EQ(s2.matched_sequence(), "\n\n");
  }
  k3::StopMatcher none({});
  EXPECT_EQ(none.push("abc"), "abc");
}

TEST(Decode, StopsOnEndTokenMaxTokensAndCallback) {
  const auto& m = *tiny().model;
  std::mt19937 rng(15);
  const auto p = random_ids(rng, 6, int32_t(m.dims().vocab));
  const auto run = [&](k3::DecodeLimits lim, const std::function<bool(int32_t)>& cb) {
    k3::Session s(m);
    std::vector<float> l(size_t(m.dims().vocab));
    k3::prefill(m, s, p, 64, {}, l.data());
    k3::SamplingParams sp;
    sp.temperature = 0;
    k3::Sampler smp(sp, m.dims().vocab);
    auto r = k3::decode(m, s, smp, l.data(), lim, {}, cb);
    EXPECT_EQ(s.position(), int64_t(p.size()) + r.fed);
    return r;
  };
  k3::DecodeLimits lim;
  lim.max_tokens = 10;
  const auto free_run = run(lim, {});
  ASSERT_EQ(free_run.tokens.size(), 10u);
  EXPECT_EQ(free_run.fed, 9);
  EXPECT_EQ(free_run.reason, k3::StopReason::MaxTokens);
  lim.end_tokens = {free_run.tokens[4]};
  const auto eos = run(lim, {});
  const size_t first =
      size_t(std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[4]) - free_run.tokens.begin());
  EXPECT_EQ(eos.reason, k3::StopReason::EndToken);
  EXPECT_EQ(eos.tokens.size(), first + 1);
  lim.end_tokens.clear();
  int calls = 0;
  const auto cb = run(lim, [&](int32_t) { return ++calls < 3; });
  EXPECT_EQ(cb.reason, k3::StopReason::StopSequence);
  EXPECT_EQ(cb.tokens.size(), 3u);
  lim.max_position = int64_t(p.size()) + 2;
  const auto full = run(lim, {});
  EXPECT_EQ(full.reason, k3::StopReason::ContextFull);
}

// ---- chat

k3::ChatOptions chat_opts(uint64_t seed) {
  k3::ChatOptions o;
  o.system = "You are terse.";
  o.sampling.temperature = 0.9f;
  o.sampling.top_k = 50;
  o.sampling.seed = seed;
  o.max_tokens = 24;
  o.ubatch = 16;
  return o;
}

k3::chat::Message user(const std::string& t) {
  k3::chat::Message m;
  m.role = "user";
  m.content = t;
  return m;
}

std::vector<int32_t> as_i32(const std::vector<k3::tok::TokenId>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

TEST(ChatSession, MultiTurnEqualsRenderingTheWholeConversation) {
  const auto& t = tiny();
  // Long replies of a random model are rarely canonical BPE (their ids get replaced: "resynced");
  // one-token replies usually are (kept as sampled). Both paths must give the same equality.
  int kept = 0, replaced = 0;
  for (auto [seed, max_tokens] : {std::pair{1, 24}, {2, 24}, {3, 1}, {4, 1}, {5, 1}}) {
    auto opts = chat_opts(uint64_t(seed));
    opts.max_tokens = max_tokens;
    k3::ChatSession chat(*t.model, t.tok, opts);
    std::vector<k3::chat::Event> events;
    k3::TurnCallbacks cb;
    cb.on_event = [&](const k3::chat::Event& e) { events.push_back(e); };
    const auto r1 = chat.send(user("Name a prime number."), cb);
    EXPECT_GT(r1.stats.generated_tokens, 0);
    EXPECT_FALSE(events.empty());
    const size_t after1 = chat.transcript().size();
    const auto r2 = chat.send(user("Another one, please."), cb);
    (r1.resynced ? replaced : kept)++;
    // Turn 2 prefilled only its new text.
    ASSERT_EQ(chat.messages().size(), 5u);  // system, user, assistant, user, assistant
    std::vector<k3::chat::Message> upto2(chat.messages().begin(), chat.messages().end() - 1);
    const auto full = k3::chat::segments_ids(t.tok, k3::chat::render(upto2, chat.options().render));
    EXPECT_EQ(r2.prefilled, int64_t(full.size() - after1)) << "seed " << seed;
    // Same logits as rendering the whole conversation and prefilling it at once.
    const auto ref = last_logits(*t.model, as_i32(full));
    ASSERT_EQ(chat.prompt_logits().size(), ref.size());
    EXPECT_LT(rel_l2(chat.prompt_logits(), ref), kPathTol) << "seed " << seed;
    // And the session holds exactly the canonical rendering of everything.
    auto ro = chat.options().render;
    ro.add_generation_prompt = false;
    EXPECT_EQ(chat.transcript(), k3::chat::segments_ids(t.tok, k3::chat::render(chat.messages(), ro)));
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(replaced, 0);
}

TEST(ChatSession, SameSeedSameConversation) {
  const auto& t = tiny();
  const auto run = [&](uint64_t seed) {
    k3::ChatSession c(*t.model, t.tok, chat_opts(seed));
    c.send(user("hi"));
    c.send(user("and then?"));
    return c.transcript();
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(ChatSession, SaveLoadContinuesExactly) {
  const auto& t = tiny();
  const fs::path f = tmp_file("chat.k3chat");
  k3::ChatSession a(*t.model, t.tok, chat_opts(21));
  a.send(user("first"));
  a.save(f.string());
  const auto a2 = a.send(user("second"));

  auto other = chat_opts(21);
  other.system = "something else";  // the file's system prompt wins: it is part of the transcript
  k3::ChatSession b(*t.model, t.tok, other);
  b.load(f.string());
  EXPECT_EQ(b.options().system, "You are terse.");
  EXPECT_EQ(b.turns(), 1);
  const auto b2 = b.send(user("second"));
  EXPECT_EQ(a.transcript(), b.transcript());
  EXPECT_EQ(a.prompt_logits(), b.prompt_logits());
  EXPECT_EQ(a2.reply.reasoning, b2.reply.reasoning);
  EXPECT_EQ(a2.reply.content, b2.reply.content);

  // Bad files: one k3::Error each, chat untouched.
  const std::string img = k3test::slurp(f);
  const auto expect_refused = [&](const std::string& bytes, const std::string& needle) {
    const fs::path g = tmp_file("bad.k3chat");
    std::ofstream(g, std::ios::binary) << bytes;
    k3::ChatSession c(*t.model, t.tok, chat_opts(1));
    try {
      c.load(g.string());
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(c.transcript().size(), 0u);
    fs::remove(g);
  };
  expect_refused("hello", "not a k3 chat file");
  expect_refused(img.substr(0, 12), "truncated");
  expect_refused(img.substr(0, img.size() - 7), "truncated");
  std::string junk = img;
  junk[20] = char(0xff);
  junk[21] = char(0xff);
  expect_refused(junk, "chat file");
  fs::remove(f);
}

TEST(ChatSession, InterruptedPrefillLeavesConversationUnchanged) {
  const auto& t = tiny();
  k3::ChatSession c(*t.model, t.tok, chat_opts(4));
  c.send(user("one"));
  const auto before = c.transcript();
  const auto n = c.messages().size();
  std::atomic<bool> stop{true};
  const auto r = c.send(user("two"), {}, &stop);
  EXPECT_EQ(r.reason, k3::StopReason::Interrupted);
  EXPECT_EQ(c.transcript(), before);
  EXPECT_EQ(c.messages().size(), n);
  // ... and the next turn still matches a one-shot rendering.
  c.send(user("three"));
  std::vector<k3::chat::Message> upto(c.messages().begin(), c.messages().end() - 1);
  const auto full = k3::chat::segments_ids(t.tok, k3::chat::render(upto, c.options().render));
  EXPECT_LT(rel_l2(c.prompt_logits(), last_logits(*t.model, as_i32(full))), kPathTol);
}

TEST(ChatSession, ContextLimitIsAnError) {
  const auto& t = tiny();
  auto o = chat_opts(5);
  o.max_context = 40;
  k3::ChatSession c(*t.model, t.tok, o);
  try {
    c.send(user(std::string(400, 'x')));
    FAIL() << "over-long message accepted";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("context limit of 40"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.messages().size(), 1u);  // only the system prompt
}

TEST(Memory, PlanAndSizes) {
  const auto cfg = tiny().model->config();
  const auto p0 = k3::plan_memory(cfg, 1000, 0, 1), p1 = k3::plan_memory(cfg, 1000, 100, 1);
  EXPECT_EQ(p0.weights, 1000u);
  EXPECT_GT(p0.kda_state, 0u);
  // 4 MLA layers x (kv_lora 32 + rope 8) x 4 bytes per token.
  EXPECT_EQ(p1.mla_cache - p0.mla_cache, 100u * 4 * 40 * 4);
  // KDA state as held by a Session: 9 KDA layers.
  k3::Session s(*tiny().model);
  EXPECT_EQ(p0.kda_state, s.state_bytes());
  // The MLA attention workspace is bounded (online softmax over key tiles): from 1K to 1M tokens only
  // the per-thread score rows of the exact kernels grow; a longer ubatch needs more.
  const auto a = k3::plan_memory(cfg, 0, 1024, 512), b = k3::plan_memory(cfg, 0, 1 << 20, 512);
  EXPECT_EQ(b.scratch - a.scratch, 4ull * uint64_t(k3::par::hardware_threads()) * ((1u << 20) - 1024));
  EXPECT_GT(k3::plan_memory(cfg, 0, 1024, 2048).scratch, a.scratch);
  EXPECT_EQ(k3::parse_size("512", "x"), 512u);
  EXPECT_EQ(k3::parse_size("2K", "x"), 2048u);
  EXPECT_EQ(k3::parse_size("1.5GiB", "x"), uint64_t(1.5 * 1024 * 1024 * 1024));
  EXPECT_EQ(k3::parse_size("24g", "x"), uint64_t(24) << 30);
  for (const char* bad : {"", "G", "-1", "1X", "1.2.3M", "0"})
    EXPECT_THROW(k3::parse_size(bad, "--mem-limit"), k3::Error) << bad;
}

// Kimi Linear (kl-tiny) with the K2 test tokenizer: the chat format comes from the checkpoint, the
// first prompt is the ids the K2 template itself gives (tests/fixtures/chat-k2/user_only.ids, from
// tools/chat/check_k2_goldens.py), replies stop at <|im_end|>, and the session holds the canonical
// K2 rendering of the conversation after every turn.
TEST(ChatSession, KimiLinearChatsInTheK2Format) {
  const std::string kl = (fs::path(K3_SOURCE_DIR) / "tests/fixtures/kl-tiny").string();
  const std::string tokdir = (fs::path(K3_SOURCE_DIR) / "tests/fixtures/tokenizer-k2-tiny").string();
  const auto model = k3::Model::load(kl);
  const auto tok = k3::tok::Tokenizer::load_dir(tokdir);
  const k3::chat::Format fmt = k3::chat::detect_format(tokdir, model->config().model_type);
  ASSERT_EQ(fmt, k3::chat::Format::K2);
  std::vector<int32_t> want;
  {
    std::ifstream f(fs::path(K3_SOURCE_DIR) / "tests/fixtures/chat-k2/user_only.ids");
    for (int32_t x; f >> x;) want.push_back(x);
  }
  ASSERT_FALSE(want.empty());
  for (uint64_t seed : {1u, 2u, 3u}) {
    auto opts = chat_opts(seed);
    opts.system.clear();  // the template's default system turn then comes first
    opts.format = fmt;
    opts.max_tokens = 6;
    k3::ChatSession chat(*model, tok, opts);
    const auto r = chat.send(user("Hi!"));
    EXPECT_EQ(r.prefilled, int64_t(want.size()));
    ASSERT_GE(chat.transcript().size(), want.size());
    EXPECT_EQ(as_i32(std::vector<k3::tok::TokenId>(chat.transcript().begin(), chat.transcript().begin() + want.size())),
              want);
    auto ro = chat.options().render;
    ro.add_generation_prompt = false;
    const auto canonical = k3::chat::segments_ids(tok, k3::chat::render_k2(chat.messages(), ro));
    EXPECT_EQ(chat.transcript(), canonical) << "seed " << seed;
    EXPECT_EQ(chat.transcript().back(), tok.require_special("<|im_end|>"));
    const auto r2 = chat.send(user("More."));
    EXPECT_GT(r2.prefilled, 0);
    EXPECT_EQ(chat.transcript(), k3::chat::segments_ids(tok, k3::chat::render_k2(chat.messages(), ro)));
  }
}
