// The public API (include/k3/engine.h): one-line k3::Errors for bad options, batched steps equal
// to Model::forward of each sequence alone (bitwise, exact numerics, tests/fixtures/tiny),
// fork/free/reset, the tokenizer and chat renderer on K3-nano, the sampler (greedy == argmax).
// Owns nothing the engine uses; test-only.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "k3/engine.h"
#include "model/model.h"

namespace fs = std::filesystem;

namespace {

std::string tiny() { return (fs::path(K3_SOURCE_DIR) / "tests/fixtures/tiny").string(); }
std::string nano() { return (fs::path(K3_SOURCE_DIR) / "models/k3-nano").string(); }

k3::EngineOptions tiny_exact() {
  k3::EngineOptions o;
  o.model_dir = tiny();
  o.numerics = "exact";
  o.need_tokenizer = false;  // the fixture has no tokenizer
  return o;
}

// The message of the k3::Error that loading `o` throws (checked to be one line, exit code 2).
std::string load_error(const k3::EngineOptions& o) {
  try {
    k3::Engine::load(o);
  } catch (const k3::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_FALSE(m.empty());
    EXPECT_EQ(e.exit_code(), 2);
    return m;
  }
  ADD_FAILURE() << "Engine::load threw no k3::Error";
  return "";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const k3::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no k3::Error";
  return "";
}

std::vector<int32_t> ids_of(int64_t n, int32_t vocab, uint32_t seed) {
  std::vector<int32_t> v;
  uint32_t x = seed * 2654435761u + 7u;
  for (int64_t i = 0; i < n; ++i) v.push_back(int32_t((x = x * 1664525u + 1013904223u) >> 8) % vocab);
  return v;
}

TEST(EngineLoad, BadOptionsAreOneLineErrors) {
  k3::EngineOptions o = tiny_exact();
  o.model_dir = "/nonexistent/model";
  EXPECT_NE(load_error(o).find("model directory /nonexistent/model does not exist"), std::string::npos);
  o = tiny_exact();
  o.model_dir = "";
  EXPECT_NE(load_error(o).find("model_dir is empty"), std::string::npos);
  o = tiny_exact();
  o.device = "tpu";
  EXPECT_EQ(load_error(o), "device must be cpu or cuda, not 'tpu'");
  o = tiny_exact();
  o.numerics = "fp16";
  EXPECT_EQ(load_error(o), "numerics must be fast, fp32 or exact, not 'fp16'");
  o = tiny_exact();
  o.threads = -1;
  EXPECT_NE(load_error(o).find("threads must be >= 0"), std::string::npos);
  o = tiny_exact();
  o.step_tokens = 0;
  EXPECT_NE(load_error(o).find("step_tokens must be in 1..1048576"), std::string::npos);
  o = tiny_exact();
  o.context = 1 << 30;
  EXPECT_NE(load_error(o).find("context 1073741824 exceeds the model's max_position_embeddings"), std::string::npos);
  o = tiny_exact();
  o.device = "cuda";
  EXPECT_NE(load_error(o).find("numerics=exact (fp64 sums) is CPU-only; with device=cuda"), std::string::npos);
  o = tiny_exact();
  o.direct_io = true;
  EXPECT_NE(load_error(o).find("direct_io needs ram_budget"), std::string::npos);
  o = tiny_exact();
  o.ram_budget = "lots";
  EXPECT_NE(load_error(o).find("ram_budget"), std::string::npos);
  o = tiny_exact();
  o.mem_limit = "1K";
  EXPECT_NE(load_error(o).find("is available (mem_limit); lower context, raise mem_limit or set ram_budget"),
            std::string::npos);
  o = tiny_exact();
  o.need_tokenizer = true;
  EXPECT_NE(load_error(o).find("has no tiktoken.model: set EngineOptions::tokenizer_dir"), std::string::npos);
}

// Three sequences in the same steps (prompts of different lengths, then a chunk and decode tokens,
// one sequence joining late) against each sequence run alone through Model::forward: equal bitwise.
TEST(EngineStep, BatchedEqualsEachSequenceAlone) {
  auto e = k3::Engine::load(tiny_exact());
  auto m = k3::Model::load(tiny());
  const int32_t V = int32_t(e->vocab_size());
  ASSERT_EQ(V, int32_t(m->dims().vocab));
  // Per sequence: the pieces it feeds, one per step (an empty piece: not in that step).
  const std::vector<std::vector<int64_t>> pieces = {{5, 1, 3, 1, 1}, {17, 1, 1, 1, 1}, {0, 0, 1, 4, 1}};
  std::vector<std::vector<int32_t>> ids(3);
  std::vector<std::vector<float>> got(3);
  std::vector<int32_t> seq(3, -1);
  for (size_t i = 0; i < 3; ++i) {
    int64_t n = 0;
    for (int64_t p : pieces[i]) n += p;
    ids[i] = ids_of(n, V, uint32_t(i + 1));
  }
  std::vector<int64_t> off(3, 0);
  for (size_t step = 0; step < 5; ++step) {
    std::vector<k3::StepInput> in;
    std::vector<size_t> who;
    for (size_t i = 0; i < 3; ++i) {
      const int64_t n = pieces[i][step];
      if (!n) continue;
      if (seq[i] < 0) seq[i] = e->new_sequence();
      in.push_back({seq[i], ids[i].data() + off[i], n, i != 1});  // sequence 1: last rows only
      who.push_back(i);
    }
    std::vector<float> logits;
    std::vector<int32_t> am;
    e->step(in, &logits, &am);
    size_t row = 0;
    for (size_t j = 0; j < in.size(); ++j) {
      const size_t i = who[j], rows = in[j].all_logits ? size_t(in[j].n) : 1;
      got[i].insert(got[i].end(), logits.begin() + row * V, logits.begin() + (row + rows) * V);
      const auto last = logits.begin() + (row + rows - 1) * V;
      EXPECT_EQ(am[j], int32_t(std::max_element(last, last + V) - last)) << "step " << step << " seq " << i;
      row += rows;
      off[i] += in[j].n;
      EXPECT_EQ(e->position(seq[i]), off[i]);
    }
    EXPECT_EQ(row * V, logits.size());
  }
  for (size_t i = 0; i < 3; ++i) {
    k3::Session s(*m);
    std::vector<float> alone;
    int64_t o = 0;
    for (int64_t n : pieces[i]) {
      if (!n) continue;
      const bool all = i != 1;
      std::vector<float> l(size_t(all ? n : 1) * V);
      m->forward(s, ids[i].data() + o, n, all, l.data());  // exact numerics: the library default
      alone.insert(alone.end(), l.begin(), l.end());
      o += n;
    }
    ASSERT_EQ(got[i].size(), alone.size()) << "sequence " << i;
    EXPECT_TRUE(got[i] == alone) << "sequence " << i << ": batched logits differ from the sequence alone";
    e->free_sequence(seq[i]);
  }
}

TEST(EngineStep, BadStepsAreErrors) {
  k3::EngineOptions o = tiny_exact();
  o.context = 8;
  auto e = k3::Engine::load(o);
  EXPECT_EQ(e->max_context(), 8);
  const int32_t s = e->new_sequence();
  const std::vector<int32_t> ids = ids_of(9, int32_t(e->vocab_size()), 3);
  std::vector<float> l;
  std::vector<int32_t> am;
  EXPECT_NE(error_of([&] {
              e->step({{s, ids.data(), 9, false}}, &l, nullptr);
            }).find("over the context limit of 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              e->step({{s, ids.data(), 2, true}}, nullptr, &am);
            }).find("logits is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              e->step({{s, ids.data(), 2, false}}, nullptr, nullptr);
            }).find("give logits, argmax"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              e->step({{s, ids.data(), 0, false}}, &l, nullptr);
            }).find("has no tokens"),
            std::string::npos);
  EXPECT_NE(error_of([&] { e->step({{s, nullptr, 2, false}}, &l, nullptr); }).find("no ids"), std::string::npos);
  const int32_t bad = 1 << 20;
  EXPECT_NE(error_of([&] {
              e->step({{s, &bad, 1, false}}, &l, nullptr);
            }).find("outside the vocabulary"),
            std::string::npos);
  EXPECT_FALSE(error_of([&] { e->step({{s + 5, ids.data(), 1, false}}, &l, nullptr); }).empty());
  EXPECT_EQ(e->position(s), 0);  // nothing was appended by the refused steps
}

// Fork mid-sequence: parent and child continue differently and each equals its whole sequence run
// alone; freeing one leaves the other; a freed sequence is refused.
TEST(EngineSequences, ForkFreeReset) {
  auto e = k3::Engine::load(tiny_exact());
  auto m = k3::Model::load(tiny());
  const int32_t V = int32_t(e->vocab_size());
  const std::vector<int32_t> prefix = ids_of(70, V, 11), ta = ids_of(6, V, 12), tb = ids_of(6, V, 13);
  const int32_t a = e->new_sequence();
  std::vector<float> l;
  e->step({{a, prefix.data(), int64_t(prefix.size()), false}}, &l, nullptr);
  const int32_t b = e->fork_sequence(a);
  EXPECT_EQ(e->position(b), 70);
  std::vector<float> la, lb;
  e->step({{a, ta.data(), 6, true}, {b, tb.data(), 6, true}}, &l, nullptr);
  la.assign(l.begin(), l.begin() + 6 * V);
  lb.assign(l.begin() + 6 * V, l.end());
  const auto alone = [&](const std::vector<int32_t>& tail) {
    k3::Session s(*m);
    std::vector<float> x(static_cast<size_t>(V)), y(6 * static_cast<size_t>(V));
    m->forward(s, prefix.data(), int64_t(prefix.size()), false, x.data());
    m->forward(s, tail.data(), 6, true, y.data());
    return y;
  };
  EXPECT_TRUE(la == alone(ta));
  EXPECT_TRUE(lb == alone(tb));
  e->free_sequence(a);
  EXPECT_FALSE(error_of([&] { e->position(a); }).empty());
  EXPECT_FALSE(error_of([&] { e->free_sequence(a); }).empty());
  EXPECT_FALSE(error_of([&] { e->fork_sequence(a); }).empty());
  EXPECT_EQ(e->position(b), 76);
  e->reset_sequence(b);
  EXPECT_EQ(e->position(b), 0);
  e->free_sequence(b);
}

TEST(EngineText, TokenizerAndChatOnK3Nano) {
  k3::EngineOptions o;
  o.model_dir = nano();
  o.prefault = false;
  auto e = k3::Engine::load(o);
  for (const std::string s : {"The function returns a new object.", "  spaces\tand\nnewlines  ",
                              "héllo wörld — ∑ 日本語 🙂", "<|end_of_msg|> is text here", ""}) {
    const std::vector<int32_t> ids = e->tokenize(s);
    EXPECT_EQ(e->detokenize(ids), s);
    k3::Detokenizer d(*e);
    std::string streamed;
    for (int32_t id : ids) streamed += d.push(id);
    EXPECT_EQ(streamed + d.flush(), s);
  }
  EXPECT_EQ(e->end_of_turn_id(), 8194);
  const auto special = e->tokenize("<|end_of_msg|>");
  EXPECT_EQ(std::count(special.begin(), special.end(), e->end_of_turn_id()), 0);  // user text never makes markers
  const auto stops = e->stop_ids();
  EXPECT_NE(std::find(stops.begin(), stops.end(), 8194), stops.end());
  EXPECT_EQ(e->bos_id(), 8192);
  EXPECT_EQ(e->detokenize({e->bos_id()}, true), "");
  EXPECT_FALSE(error_of([&] { e->detokenize({-1}); }).empty());

  const std::vector<int32_t> chat = e->render_chat({{"system", "Be brief."}, {"user", "Hi there"}});
  const std::string text = e->detokenize(chat);
  EXPECT_NE(text.find("Hi there"), std::string::npos) << text;
  EXPECT_EQ(text.rfind("<|open|>think<|sep|>"), text.size() - std::string("<|open|>think<|sep|>").size()) << text;
  EXPECT_FALSE(error_of([&] { e->render_chat({{"robot", "x"}}); }).empty());

  k3::ChatParser p(true);
  std::string reasoning, content;
  for (const auto& ev : p.feed("Let me think.<|close|>think<|sep|><|open|>response<|sep|>Hi"))
    (ev.kind == k3::ChatEventKind::Reasoning ? reasoning : content) += ev.text;
  for (const auto& ev : p.feed(" there<|close|>response<|sep|><|close|>message<|sep|>")) content += ev.text;
  for (const auto& ev : p.finish()) content += ev.text;
  EXPECT_EQ(reasoning, "Let me think.");
  EXPECT_EQ(content, "Hi there");
  EXPECT_EQ(p.content(), "Hi there");
  EXPECT_TRUE(p.finished_message());

  const k3::SamplingOptions d = e->sampling_defaults();  // generation_config.json
  EXPECT_FLOAT_EQ(d.temperature, 0.7f);
  EXPECT_FLOAT_EQ(d.top_p, 0.9f);
  EXPECT_FLOAT_EQ(d.repetition_penalty, 1.1f);
}

TEST(EngineText, NoTokenizerRefusesTextCalls) {
  auto e = k3::Engine::load(tiny_exact());
  EXPECT_NE(error_of([&] { e->tokenize("x"); }).find("without a tokenizer"), std::string::npos);
  EXPECT_EQ(e->end_of_turn_id(), -1);
}

TEST(TokenSampler, GreedyIsTheStepsArgmax) {
  auto e = k3::Engine::load(tiny_exact());
  const int32_t V = int32_t(e->vocab_size());
  std::vector<int32_t> seqs;
  std::vector<std::vector<int32_t>> ids;
  std::vector<k3::StepInput> in;
  for (int i = 0; i < 4; ++i) {
    seqs.push_back(e->new_sequence());
    ids.push_back(ids_of(3 + 4 * i, V, uint32_t(20 + i)));
  }
  for (int i = 0; i < 4; ++i)
    in.push_back({seqs[size_t(i)], ids[size_t(i)].data(), int64_t(ids[size_t(i)].size()), false});
  k3::SamplingOptions g;
  g.temperature = 0;
  g.penalty_last_n = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<float> l;
    std::vector<int32_t> am;
    e->step(in, &l, &am);
    for (int i = 0; i < 4; ++i) {
      k3::TokenSampler s(g, V);
      EXPECT_TRUE(s.greedy());
      ids[size_t(i)] = {s.sample(l.data() + size_t(i) * size_t(V))};
      EXPECT_EQ(ids[size_t(i)][0], am[size_t(i)]) << "round " << round << " sequence " << i;
      in[size_t(i)] = {seqs[size_t(i)], ids[size_t(i)].data(), 1, false};
    }
  }
  k3::SamplingOptions bad;
  bad.top_p = 1.5f;
  EXPECT_NE(error_of([&] { (void)k3::TokenSampler(bad, V); }).find("top-p"), std::string::npos);
  k3::TokenSampler s(k3::SamplingOptions{}, V);
  EXPECT_FALSE(s.greedy());
  EXPECT_FALSE(error_of([&] { s.accept(V); }).empty());
}

}  // namespace
