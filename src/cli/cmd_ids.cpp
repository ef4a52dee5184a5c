// `k3 logits` and `k3 generate`: the token-id level tools (tests, references). Ids in (--ids or one
// prompt per line of --ids-file), float32 logits or greedy ids out. Both refuse, before loading the
// weights, a prompt (plus the tokens to generate) longer than the model's max_position_embeddings,
// as run / eval / bench do. Owns flag parsing and file output only.
#include "cli/cmd_ids.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "cli/ids.h"
#include "config/model_config.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"

namespace k3::cli {

namespace {

// The engine flags of the id-level tools: the model, the algorithms, the device and the numerics
// (exact on the CPU and fp32 on the GPU by default: these are reference tools).
struct IdEngineFlags {
  std::string model;
  std::string kda = "chunked", mla = "auto";
  int64_t chunk = 64;
  int threads = 0;
  std::string device = "cpu", numerics;
  bool no_graphs = false;
  int tp = 1, ep = 1;
  bool cpu_experts = false;
  bool trunk_fp8 = false;

  void add(CLI::App* app) {
    add_model_option(app, model);
    app->add_option("--kda", kda, "KDA prefill algorithm")->check(CLI::IsMember({"chunked", "recurrent"}));
    app->add_option("--mla", mla, kMlaFlagHelp)->check(CLI::IsMember({"auto", "absorbed", "expanded"}));
    app->add_option("--chunk", chunk, "KDA chunk size for prefill")->check(CLI::Range(1, 1024));
    app->add_option("-t,--threads", threads, "CPU threads (default: all cores)")->check(CLI::Range(0, 1024));
    app->add_option("--device", device, "cpu or cuda (default cpu)")->check(CLI::IsMember({"cpu", "cuda"}));
    app->add_option("--numerics", numerics,
                    "exact (CPU default: fp64 sums), fp32 (GPU default: parity mode) or fast (bf16 activations)")
        ->check(CLI::IsMember({"fast", "fp32", "exact"}));
    app->add_flag("--no-graphs", no_graphs, "with --device cuda: no CUDA-graph replay of decode steps");
    add_parallel_options(app, tp, ep);
    add_trunk_fp8_option(app, trunk_fp8);
    add_cpu_experts_option(app, cpu_experts);
  }
  std::unique_ptr<Model> load(const std::string& dir, const std::string& who) const {
    if (device == "cuda" && numerics == "exact")
      fail("--numerics exact (fp64 sums) is CPU-only; with --device cuda use fp32 (parity mode) or fast (bf16)");
    const ParallelPlan plan{tp, ep};
    check_split_device(plan, device == "cuda");  // GPUs: one process per GPU, tensor parallel only
    auto m = load_model_for_run(dir, trunk_fp8, device, false, who);  // before the split
    m->split(plan);  // also with one rank: under an MPI launch it checks the plan against the processes
    if (plan.split()) std::fprintf(stderr, "%s: split %s\n", who.c_str(), split_description(m->dims(), plan).c_str());
    move_to_device(*m, device, !no_graphs, 512, 4096, true, who, true, cpu_experts);
    return m;
  }
  ForwardOptions options() const {
    ForwardOptions o;
    o.numerics = ops::parse_numerics(!numerics.empty() ? numerics : device == "cuda" ? "fp32" : "exact");
    o.kda_algo = kda == "recurrent" ? KdaAlgo::Recurrent : KdaAlgo::Chunked;
    o.mla_algo = parse_mla_algo(mla);
    o.kda_chunk = chunk;
    return o;
  }
  void apply_threads() const {
    if (threads > 0) par::set_max_threads(threads);
  }
};

// One prompt and where it came from ("--ids" or "FILE:LINE"), for messages.
struct Prompt {
  std::vector<int32_t> ids;
  std::string where;
};

// The prompts of a run: --ids (one prompt) or --ids-file (one prompt per line, comma-separated ids).
std::vector<Prompt> read_prompts(const std::string& ids_arg, const std::string& ids_file) {
  if (ids_arg.empty() == ids_file.empty()) fail("give one of --ids or --ids-file");
  if (!ids_arg.empty()) return {{parse_ids(ids_arg), "--ids"}};
  std::ifstream f(ids_file);
  if (!f) fail("cannot read " + ids_file + ": " + std::strerror(errno));
  std::vector<Prompt> prompts;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    const std::string where = ids_file + ":" + std::to_string(n);
    if (line.find_first_not_of(" \t\r") == std::string::npos) fail(where + ": empty line (one prompt per line)");
    try {
      prompts.push_back({parse_ids(line), where});
    } catch (const Error& e) {
      fail(where + ": " + e.what());
    }
  }
  if (prompts.empty()) fail(ids_file + ": no prompts");
  return prompts;
}

// Positions a prompt of P tokens followed by `generated` tokens takes: refused past the model's
// max_position_embeddings, with the same arithmetic as `k3 bench` (prompt + generated).
void check_positions(const std::vector<Prompt>& prompts, int64_t generated, const ModelConfig& cfg) {
  const int64_t max_pos = cfg.max_position_embeddings;
  for (const Prompt& p : prompts) {
    const int64_t P = int64_t(p.ids.size()), total = P + generated;
    if (total <= max_pos) continue;
    const std::string of = " exceeds the model's max_position_embeddings (" + std::to_string(max_pos) + ")";
    if (generated == 0) fail(p.where + ": the prompt is " + std::to_string(P) + " tokens, which" + of);
    fail(p.where + ": prompt " + std::to_string(P) + " + generated " + std::to_string(generated) + " = " +
         std::to_string(total) + " tokens" + of);
  }
}

// Every prompt in one step of its own slot (a batch); all logits of each.
int run_logits(const IdEngineFlags& ef, const std::string& ids_arg, const std::string& ids_file,
               const std::string& out_path) {
  ef.apply_threads();
  const auto prompts = read_prompts(ids_arg, ids_file);
  const std::string dir = resolve_model_dir(ef.model);
  check_positions(prompts, 0, load_model_config(dir));
  auto model = ef.load(dir, "k3 logits");
  auto pool = model->new_pool();
  const int64_t V = model->dims().vocab;
  std::vector<SeqStep> batch;
  int64_t rows = 0;
  for (const auto& p : prompts) {
    batch.push_back({pool->alloc(), p.ids.data(), int64_t(p.ids.size()), true});
    rows += int64_t(p.ids.size());
  }
  std::vector<float> logits(static_cast<size_t>(rows * V));
  model->step(*pool, batch, ef.options(), logits.data());
  int64_t r = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // --ids writes OUT itself; --ids-file writes OUT.0, OUT.1, ... (one per line of the file).
    const std::string path = ids_file.empty() ? out_path : out_path + "." + std::to_string(i);
    const int64_t T = int64_t(prompts[i].ids.size());
    std::ofstream f(path, std::ios::binary);
    if (!f) fail("cannot write " + path + ": " + std::strerror(errno));
    f.write(reinterpret_cast<const char*>(logits.data() + r * V), std::streamsize(T * V * 4));
    if (!f) fail("write failed for " + path);
    std::fprintf(stderr, "k3 logits: wrote %lld x %lld float32 to %s\n", (long long)T, (long long)V, path.c_str());
    r += T;
  }
  return 0;
}

// Greedy decoding of every prompt together: one step prefills them all, then each step decodes one
// token of every prompt (the argmax is picked where the logits are: on the GPU, on the device).
int run_generate(const IdEngineFlags& ef, const std::string& ids_arg, const std::string& ids_file, int64_t n,
                 bool print_ids) {
  ef.apply_threads();
  const auto prompts = read_prompts(ids_arg, ids_file);
  const std::string dir = resolve_model_dir(ef.model);
  check_positions(prompts, n, load_model_config(dir));
  auto model = ef.load(dir, "k3 generate");
  auto pool = model->new_pool();
  const ForwardOptions opt = ef.options();
  const size_t N = prompts.size();
  std::vector<SeqStep> batch;
  for (const auto& p : prompts) batch.push_back({pool->alloc(), p.ids.data(), int64_t(p.ids.size()), false});
  std::vector<int32_t> picked(N), feed(N);
  std::vector<std::vector<int32_t>> out(N);
  model->step(*pool, batch, opt, nullptr, picked.data());
  for (int64_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < N; ++j) out[j].push_back(picked[j]);
    if (i + 1 == n) break;
    feed = picked;
    for (size_t j = 0; j < N; ++j) batch[j] = {batch[j].slot, &feed[j], 1, false};
    model->step(*pool, batch, opt, nullptr, picked.data());
  }
  if (print_ids)
    for (const auto& ids : out) {
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
      std::printf("%s\n", line.c_str());
    }
  return 0;
}

}  // namespace

int cmd_logits(int argc, char** argv) {
  CLI::App app{
      "k3 logits: one prefill over --ids (or every line of --ids-file, as one batch); writes float32 "
      "little-endian logits [T, vocab]"};
  app.name("k3 logits");
  IdEngineFlags ef;
  std::string ids, ids_file, out_path;
  auto* ids_opt = app.add_option("--ids", ids, "token ids: 1,2,3 or @file (commas/whitespace)");
  app.add_option("--ids-file", ids_file, "one prompt per line (comma-separated ids), run together as a batch")
      ->excludes(ids_opt);
  app.add_option("-o,--out", out_path, "output file (with --ids-file: PREFIX; writes PREFIX.0, PREFIX.1, ...)")
      ->required();
  ef.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  return run_guarded("k3 logits", [&] { return run_logits(ef, ids, ids_file, out_path); });
}

int cmd_generate(int argc, char** argv) {
  CLI::App app{
      "k3 generate: prefill --ids (or every line of --ids-file, as one batch), then -n greedy decode steps "
      "(argmax; sampling is `k3 run`'s)"};
  app.name("k3 generate");
  IdEngineFlags ef;
  std::string ids, ids_file;
  int64_t n = 16;
  bool greedy = true, print_ids = false;
  auto* ids_opt = app.add_option("--ids", ids, "prompt token ids: 1,2,3 or @file");
  app.add_option("--ids-file", ids_file,
                 "one prompt per line (comma-separated ids), decoded together as a batch; "
                 "one line of generated ids per prompt, in input order")
      ->excludes(ids_opt);
  app.add_option("-n,--n-tokens", n, "tokens to generate (default 16)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  app.add_flag("--greedy", greedy, "argmax decoding: the only mode, and the default (accepted for old scripts)");
  app.add_flag("--print-ids", print_ids, "print the generated ids on one line");
  ef.add(&app);
  if (const auto code = parse_flags(app, argc, argv)) return *code;
  return run_guarded("k3 generate", [&] { return run_generate(ef, ids, ids_file, n, print_ids); });
}

}  // namespace k3::cli
