// The `k3` command: one binary, subcommands over libk3 (logits, generate, info, tokenize, ...).
// Owns: flag parsing, file output, exit codes (0 ok, 2 bad input/usage, 1 internal error).
// Must not: contain model math; every failure is one line on stderr.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "cli/cmd_bench.h"
#include "cli/cmd_eval.h"
#include "cli/cmd_run.h"
#include "cli/cmd_tokenize.h"
#include "cli/ids.h"
#include "config/arch_stats.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "k3/version.h"
#include "model/model.h"
#include "ops/cpu/isa.h"
#include "runtime/memory.h"

namespace {

struct EngineFlags {
  std::string model;
  std::string kda = "chunked", mla = "absorbed";
  int64_t chunk = 64;
  int threads = 0;
  std::string device = "cpu", numerics;  // numerics: default exact on the CPU, fp32 on the GPU
  bool no_graphs = false;

  void add(CLI::App* app) {
    app->add_option("-m,--model", model, "checkpoint directory (config.json + safetensors)")->required();
    app->add_option("--kda", kda, "KDA prefill algorithm")->check(CLI::IsMember({"chunked", "recurrent"}));
    app->add_option("--mla", mla, "MLA attention form")->check(CLI::IsMember({"absorbed", "expanded"}));
    app->add_option("--chunk", chunk, "KDA chunk size for prefill")->check(CLI::Range(1, 1024));
    app->add_option("-t,--threads", threads, "CPU threads (default: all cores)")->check(CLI::Range(0, 1024));
    app->add_option("--device", device, "cpu or cuda (default cpu)")->check(CLI::IsMember({"cpu", "cuda"}));
    app->add_option("--numerics", numerics,
                    "exact (CPU default: fp64 sums), fp32 (GPU default: parity mode) or fast (bf16 activations)")
        ->check(CLI::IsMember({"fast", "fp32", "exact"}));
    app->add_flag("--no-graphs", no_graphs, "with --device cuda: no CUDA-graph replay of decode steps");
  }
  std::unique_ptr<k3::Model> load() const {
    if (device == "cuda" && numerics == "exact")
      k3::fail("--numerics exact (fp64 sums) is CPU-only; with --device cuda use fp32 (parity mode) or fast (bf16)");
    auto m = k3::Model::load(model);
    k3::cli::move_to_device(*m, device, !no_graphs, 512, 4096, true, "k3");
    return m;
  }
  k3::ForwardOptions options() const {
    k3::ForwardOptions o;
    o.numerics = k3::ops::parse_numerics(!numerics.empty() ? numerics : device == "cuda" ? "fp32" : "exact");
    o.kda_algo = kda == "recurrent" ? k3::KdaAlgo::Recurrent : k3::KdaAlgo::Chunked;
    o.mla_algo = mla == "expanded" ? k3::MlaAlgo::Expanded : k3::MlaAlgo::Absorbed;
    o.kda_chunk = chunk;
    return o;
  }
  void apply_threads() const {
    if (threads > 0) omp_set_num_threads(threads);
  }
};

// The prompts of a run: --ids (one prompt) or --ids-file (one prompt per line, comma-separated ids).
std::vector<std::vector<int32_t>> read_prompts(const std::string& ids_arg, const std::string& ids_file) {
  if (ids_arg.empty() == ids_file.empty()) k3::fail("give one of --ids or --ids-file");
  if (!ids_arg.empty()) return {k3::cli::parse_ids(ids_arg)};
  std::ifstream f(ids_file);
  if (!f) k3::fail("cannot read " + ids_file + ": " + std::strerror(errno));
  std::vector<std::vector<int32_t>> prompts;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos)
      k3::fail(ids_file + ":" + std::to_string(n) + ": empty line (one prompt per line)");
    try {
      prompts.push_back(k3::cli::parse_ids(line));
    } catch (const k3::Error& e) {
      k3::fail(ids_file + ":" + std::to_string(n) + ": " + e.what());
    }
  }
  if (prompts.empty()) k3::fail(ids_file + ": no prompts");
  return prompts;
}

// Every prompt in one step of its own slot (a batch); all logits of each.
int cmd_logits(const EngineFlags& ef, const std::string& ids_arg, const std::string& ids_file,
               const std::string& out_path) {
  ef.apply_threads();
  const auto prompts = read_prompts(ids_arg, ids_file);
  auto model = ef.load();
  auto pool = model->new_pool();
  const int64_t V = model->dims().vocab;
  std::vector<k3::SeqStep> batch;
  int64_t rows = 0;
  for (const auto& p : prompts) {
    batch.push_back({pool->alloc(), p.data(), int64_t(p.size()), true});
    rows += int64_t(p.size());
  }
  std::vector<float> logits(static_cast<size_t>(rows * V));
  model->step(*pool, batch, ef.options(), logits.data());
  int64_t r = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // --ids writes OUT itself; --ids-file writes OUT.0, OUT.1, ... (one per line of the file).
    const std::string path = ids_file.empty() ? out_path : out_path + "." + std::to_string(i);
    const int64_t T = int64_t(prompts[i].size());
    std::ofstream f(path, std::ios::binary);
    if (!f) k3::fail("cannot write " + path + ": " + std::strerror(errno));
    f.write(reinterpret_cast<const char*>(logits.data() + r * V), std::streamsize(T * V * 4));
    if (!f) k3::fail("write failed for " + path);
    std::fprintf(stderr, "k3 logits: wrote %lld x %lld float32 to %s\n", (long long)T, (long long)V, path.c_str());
    r += T;
  }
  return 0;
}

// Greedy decoding of every prompt together: one step prefills them all, then each step decodes one
// token of every prompt (the argmax is picked where the logits are: on the GPU, on the device).
int cmd_generate(const EngineFlags& ef, const std::string& ids_arg, const std::string& ids_file, int64_t n,
                 bool print_ids) {
  ef.apply_threads();
  const auto prompts = read_prompts(ids_arg, ids_file);
  auto model = ef.load();
  auto pool = model->new_pool();
  const k3::ForwardOptions opt = ef.options();
  const size_t N = prompts.size();
  std::vector<k3::SeqStep> batch;
  for (const auto& p : prompts) batch.push_back({pool->alloc(), p.data(), int64_t(p.size()), false});
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

using k3::human_bytes;

int cmd_info(const std::string& dir, int64_t ctx) {
  const k3::ModelConfig cfg = k3::load_model_config(dir);
  std::string report = k3::format_arch_report(cfg, ctx);
  std::printf("%s", report.c_str());
  const std::vector<std::string> unsupported = k3::unsupported_features(cfg);
  if (!unsupported.empty()) {
    std::printf("engine support: this engine cannot run this family member (the counts above assume K3's tensors)\n");
    for (const std::string& u : unsupported) std::printf("  %s\n", u.c_str());
  }
  // Weights on disk, from safetensors headers only (works on a config + index without shards).
  auto ck = k3::io::Checkpoint::open_headers(dir);
  if (ck->tensor_count() == 0 && ck->missing_shards().empty()) {
    std::printf("checkpoint: no safetensors files (config only)\n");
    return 0;
  }
  std::printf("checkpoint: %zu tensors in %zu shard(s)%s\n", ck->tensor_count(), ck->shard_paths().size(),
              ck->has_index() ? " (indexed)" : "");
  if (!ck->missing_shards().empty())
    std::printf("  %zu shard(s) absent: tensor byte counts below cover the present shards only\n",
                ck->missing_shards().size());
  for (const auto& [dt, bytes] : ck->bytes_by_dtype())
    std::printf("  %-8s %20llu B  (%s)\n", k3::dtype_name(dt), (unsigned long long)bytes, human_bytes(bytes).c_str());
  std::printf("  %-8s %20llu B  (%s)\n", "total", (unsigned long long)ck->total_tensor_bytes(),
              human_bytes(ck->total_tensor_bytes()).c_str());
  if (ck->missing_shards().empty()) {
    // What `k3 run` / `k3 chat` will check against MemAvailable (fp32 state, as this engine holds it).
    const int64_t at = ctx > 0 ? ctx : std::min<int64_t>(cfg.max_position_embeddings, 32768);
    const k3::MemoryPlan p = k3::plan_memory(cfg, ck->total_tensor_bytes(), at, 512);
    std::printf("memory to run at %lld tokens (k3, fp32 state, ubatch 512)%s\n", (long long)at,
                ctx > 0 ? "" : " [--ctx N to change]");
    std::printf("  weights %s + KDA state %s + MLA cache %s + buffers ~%s = %s\n", k3::human_bytes(p.weights).c_str(),
                k3::human_bytes(p.kda_state).c_str(), k3::human_bytes(p.mla_cache).c_str(),
                k3::human_bytes(p.scratch).c_str(), k3::human_bytes(p.total()).c_str());
    if (auto avail = k3::mem_available_bytes())
      std::printf("  this machine: %s available (%s)\n", k3::human_bytes(*avail).c_str(),
                  p.total() <= *avail ? "fits" : "does NOT fit: lower --ctx");
  }
  if (ck->missing_shards().empty()) {
    // What `--device cuda` needs in GPU memory (weights as stored, MXFP4 experts stay 4-bit).
    const int64_t at = ctx > 0 ? ctx : 4096;
    const k3::GpuMemoryPlan g = k3::gpu_memory_plan(cfg, ck->total_tensor_bytes(), k3::GpuOptions{}, at);
    std::printf("GPU memory to run at %lld tokens (--device cuda)\n", (long long)at);
    std::printf("  weights %s + state %s + MLA cache %s + workspace %s = %s\n", human_bytes(g.weights).c_str(),
                human_bytes(g.state_fixed).c_str(), human_bytes(g.state_per_token * size_t(at)).c_str(),
                human_bytes(g.workspace).c_str(), human_bytes(g.total()).c_str());
    std::printf("  %s\n", k3::cli::gpu_fit_line(g.total()).c_str());
  }
  std::printf("CPU kernels: %s (best on this CPU: %s; K3_CPU_ISA=scalar|avx2|avx512 to choose)\n",
              k3::ops::cpu_isa_name(k3::ops::cpu_isa()), k3::ops::cpu_isa_name(k3::ops::cpu_isa_detected()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"k3: inference engine for Kimi K3-architecture models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("k3 ") + k3::version());

  EngineFlags ef_logits, ef_gen;
  std::string ids_logits, ids_gen, file_logits, file_gen, out_path, info_dir;
  int64_t n_gen = 16, ctx = 0;
  bool greedy = false, print_ids = false;

  auto* logits = app.add_subcommand(
      "logits", "one prefill over --ids (or every line of --ids-file, as one batch); float32 LE logits [T, vocab]");
  ef_logits.add(logits);
  auto* lo_ids = logits->add_option("--ids", ids_logits, "token ids: 1,2,3 or @file (commas/whitespace)");
  logits->add_option("--ids-file", file_logits, "one prompt per line (comma-separated ids), run together as a batch")
      ->excludes(lo_ids);
  logits->add_option("-o,--out", out_path, "output file (with --ids-file: PREFIX; writes PREFIX.0, PREFIX.1, ...)")
      ->required();

  auto* gen =
      app.add_subcommand("generate", "prefill --ids (or every line of --ids-file), then -n decode steps (greedy)");
  ef_gen.add(gen);
  auto* gen_ids = gen->add_option("--ids", ids_gen, "prompt token ids: 1,2,3 or @file");
  gen->add_option("--ids-file", file_gen,
                  "one prompt per line (comma-separated ids), decoded together as a batch; "
                  "one line of generated ids per prompt, in input order")
      ->excludes(gen_ids);
  gen->add_option("-n,--n-tokens", n_gen, "tokens to generate")->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  gen->add_flag("--greedy", greedy, "argmax decoding (the only mode of this subcommand)");
  gen->add_flag("--print-ids", print_ids, "print the generated ids on one line");

  auto* info = app.add_subcommand("info", "architecture, parameter counts, state/cache sizes, weight bytes by dtype");
  info->add_option("-m,--model", info_dir, "checkpoint directory (config.json alone is enough)")->required();
  info->add_option("--ctx", ctx, "also size the MLA cache for this many tokens")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));

  // These parse their own flags; listed here so that `k3 --help` shows every subcommand.
  app.add_subcommand("run", "raw text completion streamed to stdout (k3 run --help)");
  app.add_subcommand("chat", "interactive multi-turn chat in the K3 format (k3 chat --help)");
  app.add_subcommand("bench", "prefill/decode throughput at several context depths (k3 bench --help)");
  app.add_subcommand("tokenize", "text -> token ids (k3 tokenize --help)");
  app.add_subcommand("detokenize", "token ids -> text (k3 detokenize --help)");
  app.add_subcommand("eval", "perplexity of a model over a text file (k3 eval --help)");
  // tokenize / detokenize parse their own flags (they never load a model).
  if (argc > 1 && std::string(argv[1]) == "tokenize") return cmd_tokenize(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "detokenize") return cmd_detokenize(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "bench") return cmd_bench(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "run") return k3::cli::cmd_run(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "chat") return k3::cli::cmd_chat(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "eval") return k3::cli::cmd_eval(argc - 1, argv + 1);
  const auto is_subcommand = [&](const std::string& name) {
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == name) return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !is_subcommand(argv[1])) {
    std::fprintf(stderr, "k3: error: unknown subcommand '%s' (see k3 --help)\n", argv[1]);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "k3: error: %s (see k3 --help)\n", e.what());
    return 2;
  }

  try {
    if (*logits) return cmd_logits(ef_logits, ids_logits, file_logits, out_path);
    if (*gen) {
      if (!greedy)
        k3::fail("generate: only --greedy decoding is available in this subcommand (sampling lives in `k3 run`)");
      return cmd_generate(ef_gen, ids_gen, file_gen, n_gen, print_ids);
    }
    if (*info) return cmd_info(info_dir, ctx);
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "k3: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
