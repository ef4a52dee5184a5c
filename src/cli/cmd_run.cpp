// `k3 run`: raw text completion streamed to stdout, with sampling, stop sequences and a one-line
// summary on stderr. Owns prompt intake (argument, -p, -f, stdin) and output streaming only.
#include "cli/cmd_run.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli_common.h"
#include "cli/utf8.h"
#include "core/error.h"
#include "runtime/generate.h"
#include "runtime/loader.h"
#include "runtime/sampler.h"

namespace fs = std::filesystem;

namespace k3::cli {

namespace {

std::string read_all(std::istream& in) { return std::string(std::istreambuf_iterator<char>(in), {}); }

void write_out(const std::string& s) {
  if (s.empty()) return;
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

int cmd_run(int argc, char** argv) {
  CLI::App app{
      "k3 run: raw text completion, streamed to stdout; a summary line goes to stderr.\n"
      "The prompt is the argument, -p TEXT, -f FILE (- = stdin), or stdin when it is not a terminal."};
  app.name("k3 run");
  RunEngineFlags ef;
  SamplingFlags sf;
  std::string prompt_arg, prompt_flag, prompt_file;
  int64_t max_tokens = 256;
  std::vector<std::string> stops;
  bool ignore_eos = false, echo = false, special = false, verbose = false;
  std::optional<bool> bos;
  app.add_option("prompt", prompt_arg, "prompt text");
  app.add_option("-p,--prompt", prompt_flag, "prompt text");
  app.add_option("-f,--file", prompt_file, "read the prompt from FILE (- = stdin)");
  app.add_option("-n,--max-tokens", max_tokens, "tokens to generate at most (default 256)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  // One value per occurrence: `--stop . "prompt"` keeps "prompt" as the prompt.
  app.add_option("--stop", stops, "stop when this text is generated (one TEXT per --stop, repeatable; not printed)")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-sequence tokens");
  app.add_flag("--echo", echo, "print the prompt before the completion");
  app.add_flag("--special", special, "print special tokens (e.g. <|open|>) instead of hiding them");
  app.add_flag("--bos,!--no-bos", bos, "prepend the BOS token (default: tokenizer_config.json add_bos_token)");
  app.add_flag("-v,--verbose", verbose,
               "print the sampling settings and prompt size (and, under --ram-budget, exact expert-read counts)");
  ef.add(&app);
  sf.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;

  install_interrupt_handler();  // before loading: a Ctrl-C at any point ends with the summary
  return run_guarded("k3 run", [&]() -> int {
    // Prompt intake.
    const int given = int(!prompt_arg.empty()) + int(app.count("--prompt") > 0) + int(!prompt_file.empty());
    if (given > 1) fail("give the prompt one way: as the argument, -p or -f");
    std::string prompt;
    if (!prompt_arg.empty())
      prompt = prompt_arg;
    else if (app.count("--prompt"))
      prompt = prompt_flag;
    else if (prompt_file == "-")
      prompt = read_all(std::cin);
    else if (!prompt_file.empty()) {
      std::ifstream f(prompt_file, std::ios::binary);
      if (!f) fail("cannot read prompt file " + prompt_file);
      prompt = read_all(f);
    } else if (!::isatty(0)) {
      prompt = read_all(std::cin);
    } else {
      fail("no prompt: give it as an argument, with -p TEXT or -f FILE, or pipe it on stdin");
    }
    require_utf8(prompt, !prompt_file.empty() && prompt_file != "-" ? "the prompt in " + prompt_file : "the prompt");

    const std::string dir = resolve_model_dir(ef.model);
    const ModelConfig cfg = load_model_config(dir);
    const int64_t ctx_limit = ef.ctx ? ef.ctx : cfg.max_position_embeddings;
    std::string sampling_source;
    const SamplingParams sp = sf.resolve(dir, &sampling_source);
    // Prompt tokens <= prompt bytes + BOS, so this bounds the context the run can reach.
    const int64_t ctx_need = std::min<int64_t>(ctx_limit, int64_t(prompt.size()) + 1 + max_tokens);
    RunEngineFlags f2 = ef;
    f2.model = dir;
    LoadedModel lm = load_for_generation(f2, "k3 run", ctx_need);
    const Model& m = *lm.model;

    std::vector<int32_t> ids;
    const std::string tok_dir = ef.tokenizer.empty() ? dir : ef.tokenizer;
    if (bos.value_or(wants_bos(tok_dir))) {
      if (cfg.bos_token_id < 0) fail("--bos: the model config has no bos_token_id");
      ids.push_back(int32_t(cfg.bos_token_id));
    }
    for (tok::TokenId t : lm.tok->encode(prompt)) ids.push_back(int32_t(t));
    if (ids.empty()) fail("the prompt is empty (pass --bos to generate from the BOS token alone)");
    if (int64_t(ids.size()) >= ctx_limit)
      fail("the prompt is " + std::to_string(ids.size()) + " tokens, at or over the context limit of " +
           std::to_string(ctx_limit));
    if (verbose)
      std::fprintf(stderr,
                   "k3 run: %zu prompt tokens; sampling from %s: temp %g top-k %d top-p %g min-p %g repeat %g/%d "
                   "presence %g frequency %g seed %llu\n",
                   ids.size(), sampling_source.c_str(), double(sp.temperature), sp.top_k, double(sp.top_p),
                   double(sp.min_p), double(sp.repetition_penalty), sp.penalty_last_n, double(sp.presence_penalty),
                   double(sp.frequency_penalty), (unsigned long long)sp.seed);

    GenStats st;
    std::vector<float> logits(size_t(m.dims().vocab));
    if (echo) write_out(prompt);
    Session session(m);
    Progress bar("k3 run: prefill", !ef.quiet && int64_t(ids.size()) > ef.ubatch);
    const bool complete = prefill(
        m, session, ids, ef.ubatch, lm.forward(ef), logits.data(),
        [&](int64_t d, int64_t n) {
          bar.update(uint64_t(d), uint64_t(n), std::to_string(d) + "/" + std::to_string(n) + " tokens");
        },
        &interrupt_flag(), &st);
    bar.finish();
    const ExpertCacheStats after_prefill = lm.experts ? lm.experts->stats() : ExpertCacheStats{};
    int64_t decode_fed = 0;
    StopReason reason = StopReason::Interrupted;
    if (complete) {
      Sampler sampler(sp, m.dims().vocab);
      for (int32_t id : ids) sampler.accept(id);
      tok::StreamDecoder dec(*lm.tok, /*skip_special=*/!special);
      StopMatcher stop(stops);
      DecodeLimits lim;
      lim.max_tokens = max_tokens;
      lim.max_position = ctx_limit;
      lim.interrupt = &interrupt_flag();
      if (!ignore_eos) lim.end_tokens = eos_ids_from_dir(m, dir);
      const DecodeResult r = decode(
          m, session, sampler, logits.data(), lim, lm.forward(ef),
          [&](int32_t id) {
            if (!lm.tok->is_valid_id(tok::TokenId(id))) return true;  // an id the tokenizer lacks prints nothing
            write_out(stop.push(dec.push(tok::TokenId(id))));
            return !stop.matched();
          },
          &st);
      if (!stop.matched()) write_out(stop.push(dec.flush()));
      write_out(stop.flush());
      reason = r.reason;
      decode_fed = r.fed;
    }
    if (stdout_is_tty()) write_out("\n");
    if (verbose && lm.experts) {
      const ExpertCacheStats all = lm.experts->stats(), dec = all - after_prefill;
      std::fprintf(
          stderr,
          "k3 run: expert cache %llu bytes (%lld slots of %llu) for %llu bytes of experts; prefill %lld tok: "
          "%llu bytes read; decode %lld tok: %llu bytes read; %llu reads, %llu hits, %llu misses, %llu evictions\n",
          (unsigned long long)lm.experts->capacity_bytes(), (long long)lm.experts->max_batch(),
          (unsigned long long)lm.experts->slot_bytes(), (unsigned long long)lm.experts->expert_bytes(),
          (long long)st.prompt_tokens, (unsigned long long)after_prefill.bytes_read, (long long)decode_fed,
          (unsigned long long)dec.bytes_read, (unsigned long long)all.reads, (unsigned long long)all.hits,
          (unsigned long long)all.misses, (unsigned long long)all.evictions);
    }
    std::fprintf(stderr, "k3 run: %s | seed %llu%s\n", summary_line(st, reason).c_str(), (unsigned long long)sp.seed,
                 expert_summary(lm, after_prefill, st.prompt_tokens, decode_fed).c_str());
    return reason == StopReason::Interrupted ? 130 : 0;
  });
}

}  // namespace k3::cli
