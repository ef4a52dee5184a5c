// Pieces shared by the model-running subcommands (run, chat, and later serve): engine and
// sampling flags, model-directory resolution, loading with a progress bar and a memory check,
// Ctrl-C handling, the summary line. Must not: contain model math or chat-format logic.
#pragma once
#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "model/model.h"
#include "runtime/expert_cache.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "tokenizer/tokenizer.h"

namespace k3::cli {

// -m/--model, --kda, --mla, --chunk, --ubatch, -t/--threads, --ctx, --mem-limit, --no-prefault,
// --ram-budget, --direct-io, --trunk-fp8.
struct RunEngineFlags {
  std::string model, tokenizer;
  std::string kda = "chunked", mla = "auto";
  int64_t chunk = 64, ubatch = 512, ctx = 0;
  int threads = 0;
  std::string mem_limit, ram_budget;
  bool no_prefault = false, quiet = false, direct_io = false;
  std::string numerics = "fast", cpu_isa;  // ops::Numerics; CPU kernel level (empty = best)
  std::string device = "cpu";              // cpu | cuda
  bool no_graphs = false;                  // cuda: run decode steps without CUDA-graph replay
  int tp = 1, ep = 1;                      // split over ranks in this process (CPU)
  bool trunk_fp8 = false;                  // hold the trunk in FP8 (quantised at load; CPU)
  bool cpu_experts = false;                // cuda: routed experts in host RAM, computed by the CPU
  std::string hot_experts;                 // with cpu_experts: the GPU's cache of hot experts (fraction or auto)
  bool cpu_experts_q8 = false;             // with cpu_experts: 8-bit activations for the CPU's experts
  std::string gpu_mem;                     // cuda: cap on the GPU memory (fit_gpu_mem picks the split)
  void add(CLI::App* app);
  ForwardOptions forward() const;
};

// --temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty,
// --frequency-penalty, --seed. Unset flags keep the checkpoint's generation_config.json values.
struct SamplingFlags {
  CLI::Option *temp = nullptr, *top_k = nullptr, *top_p = nullptr, *min_p = nullptr, *rep = nullptr, *rep_n = nullptr,
              *pres = nullptr, *freq = nullptr, *seed = nullptr;
  float v_temp = 0, v_top_p = 0, v_min_p = 0, v_rep = 0, v_pres = 0, v_freq = 0;
  int32_t v_top_k = 0, v_rep_n = 0;
  uint64_t v_seed = 0;
  void add(CLI::App* app);
  // defaults from DIR/generation_config.json, then flags; a random seed when --seed is absent.
  SamplingParams resolve(const std::string& model_dir, std::string* source) const;
};

// --tp N and --ep N (model/parallel.h), for every command that runs a model.
void add_parallel_options(CLI::App* app, int& tp, int& ep);
// --mla: "auto" (default), "absorbed" or "expanded" (already checked by the flag's validator).
inline constexpr const char* kMlaFlagHelp =
    "MLA attention form: auto (the CPU picks the expanded form in key tiles for long prefill pieces, absorbed "
    "otherwise), absorbed or expanded";
MlaAlgo parse_mla_algo(const std::string& name);
// --trunk-fp8 (Model::quantize_trunk_fp8), for every command that loads a model to run it.
void add_trunk_fp8_option(CLI::App* app, bool& on);
// The time now as ISO 8601 UTC ("2026-12-04T05:00:00Z"), for records.
std::string utc_now();
// --cpu-experts (GpuOptions::experts_on_cpu), for every command that can run on the GPU.
void add_cpu_experts_option(CLI::App* app, bool& on);
// --hot-experts F|auto (GpuOptions::hot_experts; parse_hot_experts), with --cpu-experts.
void add_hot_experts_option(CLI::App* app, std::string& value);
// Model::load, then with --trunk-fp8 the quantised trunk (its line on stderr unless quiet; a one-line
// error with --device cuda): the id tools' and k3 bench's loading, which has no memory check.
std::unique_ptr<Model> load_model_for_run(const std::string& dir, bool trunk_fp8, const std::string& device, bool quiet,
                                          const std::string& who);

// -m, else $K3_MODEL, else the bundled model (K3_DEFAULT_MODEL_DIR) when it exists.
std::string resolve_model_dir(const std::string& flag);

// The -m/--model option every subcommand that reads a model has (same text, same default:
// resolve_model_dir). `extra_names` adds aliases (",--vocab" for tokenize / detokenize).
CLI::Option* add_model_option(CLI::App* app, std::string& model, const std::string& extra_names = "");

// --seed N: 0..18446744073709551615 as decimal digits; a negative or non-integer value is refused
// by the parser in one line (CLI11 alone would wrap -1 to 2^64 - 1).
CLI::Option* add_seed_option(CLI::App* app, uint64_t& seed, const std::string& description);

// "WHO: error: MSG" on stderr, exactly one line (line breaks inside MSG become spaces).
void print_error(const std::string& who, const std::string& msg);

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<tok::Tokenizer> tok;
  std::string dir;
  std::unique_ptr<ExpertCache> experts;  // set under --ram-budget (declared after model: destroyed first)
  // flags.forward() with the expert cache (when there is one) as the expert source.
  ForwardOptions forward(const RunEngineFlags& flags) const;
};

// runtime/loader.h's load_checkpoint with the flags (checks memory: weights + state at ctx vs
// --mem-limit or MemAvailable, before mapping anything; loads, binds), then moves the model to the
// GPU or (unless --no-prefault) reads the weights in with a progress bar on stderr
// (a TTY gets one updating line; otherwise a few plain lines). The tokenizer comes from the
// model directory or --tokenizer. `who` prefixes messages ("k3 run").
// With --ram-budget the weights counted are the trunk plus the expert cache: routed experts are
// neither prefaulted nor read through the mapping but streamed into LoadedModel::experts.
LoadedModel load_for_generation(const RunEngineFlags& f, const std::string& who, int64_t ctx_tokens);

// " | experts: read 1.20 MiB/tok prefill, 12.30 MiB/tok decode, hit 41%, 123 reads, 7 evictions"
// (empty without an expert cache): bytes read from disk per token fed. `prefill` is the cache's
// stats() after the prefill; decode_tokens < 0 gives one figure over prefill_tokens instead.
std::string expert_summary(const LoadedModel& lm, const ExpertCacheStats& prefill, int64_t prefill_tokens,
                           int64_t decode_tokens);

// Ctrl-C: the first press raises the flag (generation stops cleanly); a second press exits 130.
void install_interrupt_handler();
std::atomic<bool>& interrupt_flag();

// --device cuda: moves `m` to the GPU (weights uploaded once; one-line error when there is no GPU,
// the build has no CUDA backend, or the model does not fit) and reports it on stderr unless quiet.
// On the CPU: steps of up to tokens_per_call rows when that is above the model's step rows.
// experts_resident false (--ram-budget): only the trunk is uploaded; routed experts come from the
// expert cache every step.
// experts_on_cpu (--cpu-experts): the routed experts stay in host RAM and the CPU computes them (a
// one-line error without --device cuda); prefill: where a long prompt's experts are computed
// (GpuOptions::prefill_experts, k3 bench --prefill-experts).
// Returns the GPU options used (on the CPU: defaults).
GpuOptions move_to_device(Model& m, const std::string& device, bool graphs, int64_t tokens_per_call, int64_t ctx_tokens,
                    bool quiet, const std::string& who, bool experts_resident = true, bool experts_on_cpu = false,
                    double hot_experts = 0,
                    GpuOptions::PrefillExperts prefill = GpuOptions::PrefillExperts::Auto, bool cpu_experts_q8 = false,
                    const std::string& gpu_mem = "");
void add_gpu_mem_option(CLI::App* app, std::string& value);
void add_cpu_experts_q8_option(CLI::App* app, bool& on);

// "this machine's GPU: NVIDIA H200, 139.8 GiB free (fits)" / "no usable CUDA GPU: ..." /
// "this k3 was built without the CUDA backend".
std::string gpu_fit_line(size_t need_bytes);
// This machine's GPU's multiprocessors (GpuOptions::sm_count for the memory plan), or 132 (H100 /
// H200 SXM) without a usable CUDA GPU.
int64_t gpu_sm_count();

// One-line stats: "prompt 12 tok | generated 50 tok | prefill 120.3 tok/s | decode 45.2 tok/s | peak RSS 1.2 GiB |
// stop: eos"
std::string summary_line(const GenStats& st, StopReason reason);

// Parses a subcommand's flags (app.get_name() is "k3 run" etc.). Returns the exit code when the
// program should end now: 0 after --help, 2 after a one-line "k3 run: error: ..."; else nothing.
std::optional<int> parse_flags(CLI::App& app, int argc, char** argv);

// Runs a subcommand body: k3::Error -> "WHO: error: ..." and its exit code (2), out of memory and
// other exceptions -> "WHO: error: internal error: ..." and exit 1. Every failure is one line on
// stderr (print_error).
int run_guarded(const char* who, const std::function<int()>& body);

// The tokenizer_config.json in tok_dir asks for a BOS token in front of raw prompts.
bool wants_bos(const std::string& tok_dir);
bool stderr_is_tty();
bool stdout_is_tty();

// A progress bar on stderr: one redrawn line on a TTY, or a plain line each time another 25% is
// passed otherwise. The percentage shown is always floor(100 * done / total) of the `done` and
// `total` of that same update (the unit text, e.g. "512/2730 tokens", shows the same count).
class Progress {
 public:
  Progress(std::string label, bool enabled);
  void update(uint64_t done, uint64_t total, const std::string& unit_text = "");
  void finish();

 private:
  std::string label_;
  bool enabled_, tty_, drawn_ = false;
  int last_quarter_ = -1;
  double last_draw_ = -1;
};

}  // namespace k3::cli
