// Example of the public API (include/k3/ only): three prompts generated together, one sequence
// each, one Engine::step per token, sampled with the checkpoint's defaults.
// Usage: k3_example_generate [MODEL_DIR] [TOKENS]   (default: the bundled K3-nano, 32 tokens)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "k3/engine.h"

int main(int argc, char** argv) try {
  k3::EngineOptions opt;
  opt.model_dir = argc > 1 ? argv[1] : K3_EXAMPLE_MODEL_DIR;
  const int n_tokens = argc > 2 ? std::atoi(argv[2]) : 32;
  if (n_tokens < 1) throw k3::Error("TOKENS must be a positive number");
  const std::unique_ptr<k3::Engine> engine = k3::Engine::load(opt);
  const std::vector<std::string> prompts = {"The function returns", "To install the package,", "A database index"};
  const std::vector<int32_t> stops = engine->stop_ids();

  struct Seq {
    int32_t id;
    std::vector<int32_t> feed, out;  // what the next step feeds; the generated tokens
    k3::TokenSampler sampler;
    bool done = false;
  };
  std::vector<Seq> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    k3::SamplingOptions so = engine->sampling_defaults();
    so.seed = i + 1;
    seqs.push_back(
        {engine->new_sequence(), engine->tokenize(prompts[i]), {}, k3::TokenSampler(so, engine->vocab_size())});
    for (int32_t t : seqs.back().feed) seqs.back().sampler.accept(t);
  }
  std::vector<float> logits;
  for (int t = 0; t < n_tokens; ++t) {
    std::vector<k3::StepInput> batch;  // the first step feeds the prompts, later ones a token each
    std::vector<Seq*> running;
    for (Seq& s : seqs) {
      if (s.done) continue;
      batch.push_back({s.id, s.feed.data(), int64_t(s.feed.size()), false});
      running.push_back(&s);
    }
    if (batch.empty()) break;
    engine->step(batch, &logits, nullptr);  // one row of logits per sequence
    for (size_t j = 0; j < running.size(); ++j) {
      Seq& s = *running[j];
      const int32_t next = s.sampler.sample(logits.data() + j * size_t(engine->vocab_size()));
      s.sampler.accept(next);
      s.done = std::find(stops.begin(), stops.end(), next) != stops.end();
      if (!s.done) s.out.push_back(next);
      s.feed = {next};
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::printf("[%zu] %s%s\n\n", i, prompts[i].c_str(), engine->detokenize(seqs[i].out, true).c_str());
    engine->free_sequence(seqs[i].id);
  }
  return 0;
} catch (const k3::Error& e) {
  std::fprintf(stderr, "k3_example_generate: error: %s\n", e.what());
  return e.exit_code();
}
