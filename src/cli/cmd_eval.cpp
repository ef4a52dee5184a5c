// `k3 eval`: perplexity over a text file, llama.cpp-perplexity style, with the sliding-window
// protocol of docs/eval.md. Owns text intake, the window schedule, NLL accumulation (double,
// from fp32 logits) and the result line / JSON. Model math stays in Model::forward.
#include "cli/cmd_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "config/model_config.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace fs = std::filesystem;

namespace k3::cli {

std::vector<EvalWindow> eval_windows(int64_t n_tokens, int64_t ctx, int64_t stride) {
  std::vector<EvalWindow> w;
  if (n_tokens < 2 || ctx < 1 || ctx > n_tokens - 1 || stride < 1 || stride > ctx) return w;
  const int64_t last = n_tokens - 1;    // index of the last token: the last target
  int64_t start = 0, scored_up_to = 0;  // targets 1..scored_up_to are done
  for (;;) {
    EvalWindow x;
    x.start = start;
    x.first_target = scored_up_to + 1;
    x.last_target = start + ctx;  // the prediction made at the window's last position
    w.push_back(x);
    scored_up_to = x.last_target;
    if (scored_up_to >= last) break;
    start = std::min(start + stride, last - ctx);  // the last window ends at the last token
  }
  return w;
}

namespace {

std::string read_all(std::istream& in) { return std::string(std::istreambuf_iterator<char>(in), {}); }

// 98765 -> "98,765"
std::string group(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (v < 0 ? "-" : "") + out;
}

// -log softmax(row)[target]: max-subtracted, exp and sum in double.
double token_nll(const float* row, int64_t vocab, int32_t target) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, row[i]);
  const double m = double(mx);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(row[i]) - m);
  return m + std::log(sum) - double(row[target]);
}

struct Totals {
  double nll = 0;
  int64_t scored = 0, bytes = 0, fed = 0, windows = 0;
  double seconds = 0;  // of the scoring loop
};

// The command line of k3 eval (and which of the optional flags were given).
struct EvalFlags {
  RunEngineFlags ef;
  std::string file, json_path;
  int64_t stride = 0, max_tokens = 0;
  bool bos = false;
  bool ctx_given = false, stride_given = false, max_tokens_given = false;
};

void add_eval_flags(CLI::App& app, EvalFlags& f) {
  app.add_option("-f,--file", f.file, "text to evaluate (- = stdin)");
  app.add_option("--stride", f.stride, "tokens between window starts (default ctx/2; 1..ctx)");
  app.add_option("--max-tokens", f.max_tokens, "evaluate only the first N tokens (BOS included; default: all)");
  app.add_flag("--bos", f.bos, "prepend the config's bos_token_id at the very start (not scored)");
  app.add_option("--json", f.json_path, "also write the result as JSON to FILE");
  f.ef.add(&app);
  // --ctx comes from the engine flags; here it is the window size.
  app.get_option("--ctx")->description(
      "window size in tokens (default 512, capped by the text and max_position_embeddings)");
  app.get_option("-q")->description("no loading progress, header or evaluation progress on stderr");
}

// The flags that need nothing loaded.
void check_flags(const EvalFlags& f) {
  if (f.ctx_given && f.ef.ctx < 2) fail("--ctx must be at least 2 (got " + std::to_string(f.ef.ctx) + ")");
  if (f.stride_given && f.stride < 1) fail("--stride must be at least 1 (got " + std::to_string(f.stride) + ")");
  if (f.stride_given && f.ctx_given && f.stride > f.ef.ctx)
    fail("--stride " + std::to_string(f.stride) + " is larger than --ctx " + std::to_string(f.ef.ctx));
  if (f.max_tokens_given && f.max_tokens < 2)
    fail("--max-tokens must be at least 2 (one token is scored from the one before it; got " +
         std::to_string(f.max_tokens) + ")");
  if (f.file.empty()) fail("no text: pass --file F (-f - reads stdin)");
  if (!f.json_path.empty()) {
    const fs::path parent = fs::path(f.json_path).parent_path();
    if (!parent.empty() && !fs::is_directory(parent))
      fail("--json " + f.json_path + ": directory " + parent.string() + " does not exist");
    if (fs::is_directory(f.json_path)) fail("--json " + f.json_path + " is a directory");
  }
}

// The text of --file (- = stdin); `src` names it in messages.
std::string read_text(const std::string& file, const std::string& src) {
  std::string text;
  if (file == "-") {
    text = read_all(std::cin);
  } else {
    if (fs::is_directory(file)) fail("cannot read text file " + file + ": it is a directory");
    std::ifstream in(file, std::ios::binary);
    if (!in) fail("cannot read text file " + file);
    text = read_all(in);
  }
  if (text.empty()) fail("the text in " + src + " is empty");
  return text;
}

// The window size asked for, checked against the model's config; settles the default stride.
int64_t window_request(EvalFlags& f, const ModelConfig& cfg) {
  if (f.ctx_given && f.ef.ctx > cfg.max_position_embeddings)
    fail("--ctx " + std::to_string(f.ef.ctx) + " exceeds the model's max_position_embeddings (" +
         std::to_string(cfg.max_position_embeddings) + ")");
  const int64_t ctx_req = f.ctx_given ? f.ef.ctx : std::min<int64_t>(512, cfg.max_position_embeddings);
  if (ctx_req < 2)
    fail("the model's max_position_embeddings (" + std::to_string(cfg.max_position_embeddings) + ") is below 2");
  if (!f.stride_given) f.stride = std::max<int64_t>(1, ctx_req / 2);
  if (f.stride > ctx_req)
    fail("--stride " + std::to_string(f.stride) + " is larger than the window (" + std::to_string(ctx_req) + ")");
  if (f.bos && (cfg.bos_token_id < 0 || cfg.bos_token_id >= cfg.vocab_size))
    fail("--bos: the model config has no usable bos_token_id");
  return ctx_req;
}

// The ids to score: BOS (with --bos), the text as plain text, cut at --max-tokens.
std::vector<int32_t> tokenize_text(const tok::Tokenizer& tk, const std::string& text, const std::string& src,
                                   const EvalFlags& f, int64_t bos_id) {
  std::vector<int32_t> ids;
  if (f.bos) ids.push_back(int32_t(bos_id));
  for (tok::TokenId t : tk.encode(text)) ids.push_back(int32_t(t));
  if (f.max_tokens > 0 && int64_t(ids.size()) > f.max_tokens) ids.resize(size_t(f.max_tokens));
  if (ids.size() < 2)
    fail("the text in " + src + " is " + std::to_string(ids.size()) +
         " token(s); at least 2 are needed to score one (--bos adds one)");
  return ids;
}

// Runs every window in a fresh session and sums the NLL of the tokens it scores; stops early on
// Ctrl-C (`interrupted`). C: tokens fed per window.
Totals score_windows(const LoadedModel& lm, const RunEngineFlags& ef, const std::vector<int32_t>& ids,
                     const std::vector<EvalWindow>& windows, int64_t C, bool& interrupted) {
  const Model& m = *lm.model;
  const int64_t V = m.dims().vocab, N = int64_t(ids.size()), W = int64_t(windows.size());
  // Per-token byte length of the scored text (decoded bytes of each scored token).
  std::vector<int64_t> tok_bytes(size_t(N), 0);
  for (int64_t t = 1; t < N; ++t)
    if (lm.tok->is_valid_id(tok::TokenId(ids[size_t(t)])))
      tok_bytes[size_t(t)] = int64_t(lm.tok->token_bytes(tok::TokenId(ids[size_t(t)])).size());

  const ForwardOptions opt = lm.forward(ef);
  const int64_t piece_max = std::min<int64_t>(std::max<int64_t>(1, ef.ubatch), C);
  std::vector<float> logits(static_cast<size_t>(piece_max * V));
  std::vector<double> row_nll(static_cast<size_t>(piece_max));
  Totals tot;
  Progress bar("k3 eval", !ef.quiet);
  const auto t0 = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  interrupted = false;
  for (const EvalWindow& w : windows) {
    if (interrupt_flag().load()) {
      interrupted = true;
      break;
    }
    // A fresh session: no KDA state or MLA cache carries across windows.
    Session session(m);
    const int64_t row_lo = w.first_target - 1 - w.start;  // first window position whose logits are scored
    for (int64_t p = 0; p < C; p += piece_max) {
      const int64_t n = std::min(piece_max, C - p);
      const bool need = p + n > row_lo;
      m.forward(session, ids.data() + w.start + p, n, need, logits.data(), opt);
      if (!need) continue;
      const int64_t r0 = std::max(p, row_lo);
      par::parallel_for_each(p + n - r0, [&](int64_t i) {
        const int64_t r = r0 + i;
        row_nll[size_t(r - p)] = token_nll(logits.data() + (r - p) * V, V, ids[size_t(w.start + r + 1)]);
      });
      for (int64_t r = r0; r < p + n; ++r) {  // in order: the sum does not depend on the thread count
        tot.nll += row_nll[size_t(r - p)];
        tot.bytes += tok_bytes[size_t(w.start + r + 1)];
        ++tot.scored;
      }
    }
    tot.fed += C;
    ++tot.windows;
    const double secs = elapsed();
    char buf[256];
    std::snprintf(buf, sizeof buf, "%lld/%lld windows | %s tokens scored | ppl %.4f | %.1f tok/s",
                  (long long)tot.windows, (long long)W, group(tot.scored).c_str(),
                  std::exp(tot.nll / double(tot.scored)), secs > 0 ? double(tot.fed) / secs : 0.0);
    bar.update(uint64_t(tot.windows), uint64_t(W), buf);
  }
  bar.finish();
  tot.seconds = elapsed();
  return tot;
}

// What the summary reports besides the totals.
struct EvalResult {
  std::string model, file;
  int64_t tokens = 0, ctx = 0, stride = 0, windows_total = 0;
  bool bos = false, interrupted = false;
};

// The result line on stdout, and the JSON file with --json.
void report(const Totals& tot, const EvalResult& r, const std::string& json_path) {
  const double mean = tot.nll / double(tot.scored), ppl = std::exp(mean);
  const double bpb = tot.bytes > 0 ? tot.nll / std::log(2.0) / double(tot.bytes) : 0.0;
  const double tps = tot.seconds > 0 ? double(tot.fed) / tot.seconds : 0.0;
  char line[512];
  std::snprintf(line, sizeof line,
                "perplexity %.4f over %s tokens (ctx %lld, stride %lld) | nll/token %.4f | bits/byte %.3f | %.1f tok/s",
                ppl, group(tot.scored).c_str(), (long long)r.ctx, (long long)r.stride, mean, bpb, tps);
  std::string out = line;
  if (r.interrupted)
    out += " | interrupted after " + std::to_string(tot.windows) + "/" + std::to_string(r.windows_total) + " windows";
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
  if (json_path.empty()) return;
  nlohmann::json j;
  j["model"] = r.model;
  j["file"] = r.file;
  j["tokens"] = r.tokens;
  j["tokens_scored"] = tot.scored;
  j["bytes_scored"] = tot.bytes;
  j["ctx"] = r.ctx;
  j["stride"] = r.stride;
  j["bos"] = r.bos;
  j["nll_sum"] = tot.nll;
  j["nll_mean"] = mean;
  j["perplexity"] = ppl;
  j["bits_per_byte"] = bpb;
  j["seconds"] = tot.seconds;
  j["tokens_per_second"] = tps;
  j["windows"] = tot.windows;
  j["windows_total"] = r.windows_total;
  j["interrupted"] = r.interrupted;
  std::ofstream jf(json_path, std::ios::binary);
  if (!jf) fail("cannot write --json " + json_path);
  jf << j.dump(2) << "\n";
  if (!jf) fail("write failed for --json " + json_path);
}

// Everything after the flags: text, config checks, tokens, model, windows, scoring, summary.
int run_eval(EvalFlags& f) {
  check_flags(f);
  const std::string src = f.file == "-" ? "stdin" : f.file;
  const std::string text = read_text(f.file, src);

  // Model config: window size against the model.
  const std::string dir = resolve_model_dir(f.ef.model);
  if (!fs::is_directory(dir)) fail("model directory " + dir + " does not exist");
  const ModelConfig cfg = load_model_config(dir);
  const int64_t ctx_req = window_request(f, cfg);

  // Tokenize before loading the weights, so that a bad text fails fast (load_for_generation
  // reports a missing tokenizer itself).
  const std::string tok_dir = f.ef.tokenizer.empty() ? dir : f.ef.tokenizer;
  std::vector<int32_t> ids;
  if (fs::exists(fs::path(tok_dir) / "tiktoken.model"))
    ids = tokenize_text(tok::Tokenizer::load_dir(tok_dir), text, src, f, cfg.bos_token_id);

  const int64_t n_req = ids.empty() ? ctx_req : std::min<int64_t>(ctx_req, int64_t(ids.size()) - 1);
  RunEngineFlags f2 = f.ef;
  f2.model = dir;
  f2.ctx = 0;  // checked above
  LoadedModel lm = load_for_generation(f2, "k3 eval", n_req);
  if (ids.empty()) ids = tokenize_text(*lm.tok, text, src, f, cfg.bos_token_id);
  const int64_t V = lm.model->dims().vocab;
  for (int32_t id : ids)
    if (id < 0 || id >= V) fail("token id " + std::to_string(id) + " is outside the model's vocabulary");

  const int64_t N = int64_t(ids.size());
  const int64_t C = std::min<int64_t>(ctx_req, N - 1);  // tokens fed per window
  const int64_t S = std::min<int64_t>(f.stride, C);
  const std::vector<EvalWindow> windows = eval_windows(N, C, S);
  const int64_t W = int64_t(windows.size());
  if (!f.ef.quiet)
    std::fprintf(stderr,
                 "k3 eval: %s tokens from %s (%s bytes%s); %lld window(s) of %lld tokens at stride %lld, each in a "
                 "fresh session, the last aligned to the end; each window scores only tokens not scored before "
                 "(context >= %lld tokens after the first window); %s tokens scored\n",
                 group(N).c_str(), src.c_str(), group(int64_t(text.size())).c_str(), f.bos ? ", BOS prepended" : "",
                 (long long)W, (long long)C, (long long)S, (long long)(C - S + 1), group(N - 1).c_str());

  bool interrupted = false;
  const Totals tot = score_windows(lm, f.ef, ids, windows, C, interrupted);
  if (tot.scored == 0) {
    std::fprintf(stderr, "k3 eval: interrupted before the first window finished\n");
    return 130;
  }
  report(tot, {lm.dir, f.file, N, C, S, W, f.bos, interrupted}, f.json_path);
  return interrupted ? 130 : 0;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  CLI::App app{
      "k3 eval: perplexity of a model over a text file (docs/eval.md).\n"
      "The text is tokenized as plain text and cut into windows of --ctx tokens starting every --stride tokens\n"
      "(the last one aligned to the end); each window runs in a fresh session and scores only tokens no earlier\n"
      "window scored, so every token but the first is scored exactly once. The result line goes to stdout."};
  app.name("k3 eval");
  EvalFlags f;
  add_eval_flags(app, f);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  f.ctx_given = app.count("--ctx") > 0;
  f.stride_given = app.count("--stride") > 0;
  f.max_tokens_given = app.count("--max-tokens") > 0;

  install_interrupt_handler();
  return run_guarded("k3 eval", [&]() -> int { return run_eval(f); });
}

}  // namespace k3::cli
