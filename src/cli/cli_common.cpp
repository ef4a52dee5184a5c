// Shared flags, loading with progress and a memory check, Ctrl-C, summary (see cli_common.h).
#include "cli/cli_common.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/remote.h"
#include "ops/cpu/isa.h"
#include "runtime/loader.h"
#include "runtime/memory.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace fs = std::filesystem;

namespace k3::cli {

CLI::Option* add_model_option(CLI::App* app, std::string& model, const std::string& extra_names) {
  return app
      ->add_option("-m,--model" + extra_names, model,
                   "checkpoint directory (default: $K3_MODEL, else the bundled K3-nano)")
      ->option_text("DIR");
}

CLI::Option* add_seed_option(CLI::App* app, uint64_t& seed, const std::string& description) {
  const CLI::Validator whole_number(
      [](std::string& v) -> std::string {
        const std::string range = "a seed is a whole number 0..18446744073709551615";
        if (!v.empty() && v[0] == '-') return "'" + v + "' is negative (" + range + ")";
        if (v.empty() || v.size() > 20 || v.find_first_not_of("0123456789") != std::string::npos)
          return "'" + v + "' is not a whole number (" + range + ")";
        if (v.size() == 20 && v > "18446744073709551615") return "'" + v + "' is too large (" + range + ")";
        return "";
      },
      "", "seed");
  return app->add_option("--seed", seed, description)->check(whole_number)->option_text("N");
}

void print_error(const std::string& who, const std::string& msg) {
  std::string m = msg;
  for (char& c : m)
    if (c == '\n' || c == '\r') c = ' ';
  std::fprintf(stderr, "%s: error: %s\n", who.c_str(), m.c_str());
}

void RunEngineFlags::add(CLI::App* app) {
  add_model_option(app, model);
  app->add_option("--tokenizer", tokenizer,
                  "directory with tiktoken.model + tokenizer_config.json (default: the model directory)");
  app->add_option("--kda", kda, "KDA prefill algorithm")->check(CLI::IsMember({"chunked", "recurrent"}));
  app->add_option("--mla", mla, kMlaFlagHelp)->check(CLI::IsMember({"auto", "absorbed", "expanded"}));
  app->add_option("--chunk", chunk, "KDA chunk size for prefill")->check(CLI::Range(1, 1024));
  app->add_option("--ubatch", ubatch, "prefill piece size in tokens (bounds activation memory)")
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--ctx", ctx, "context limit in tokens (default: the model's max_position_embeddings)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app->add_option("-t,--threads", threads, "CPU threads (default: all cores)")->check(CLI::Range(0, 1024));
  app->add_option("--mem-limit", mem_limit,
                  "refuse to load when the model needs more than SIZE (default: MemAvailable)");
  app->add_flag("--no-prefault", no_prefault,
                "do not read the weights in at load time (first tokens then fault pages in)");
  app->add_option("--ram-budget", ram_budget,
                  "keep weights within SIZE of RAM: the trunk stays resident, routed experts are read from disk into "
                  "an LRU cache of the rest (runs models larger than RAM; same output)")
      ->option_text("SIZE");
  app->add_flag("--direct-io", direct_io, "with --ram-budget: read experts with O_DIRECT (bypass the page cache)");
  app->add_flag("-q,--quiet", quiet, "no loading progress");
  app->add_option("--numerics", numerics,
                  "fast: SIMD fp32 + bf16-rounded activations in prefill GEMMs and MXFP4 GEMVs; fp32: SIMD fp32; "
                  "exact: scalar kernels with fp64 sums (reference grade, slow) (default fast)")
      ->check(CLI::IsMember({"fast", "fp32", "exact"}));
  app->add_option("--cpu-isa", cpu_isa, "CPU kernel level: amx, avx512, avx2 or scalar (default: the best this CPU has)")
      ->check(CLI::IsMember({"amx", "avx512", "avx2", "scalar"}));
  app->add_option("--device", device,
                  "cpu, or cuda: run on the NVIDIA GPU (weights uploaded once; --numerics fast = bf16 tensor-core "
                  "GEMMs, fp32 = parity mode) (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_flag("--no-graphs", no_graphs, "with --device cuda: launch decode steps kernel by kernel (no CUDA graphs)");
  add_parallel_options(app, tp, ep);
  add_trunk_fp8_option(app, trunk_fp8);
  add_cpu_experts_option(app, cpu_experts);
  add_hot_experts_option(app, hot_experts);
  add_cpu_experts_q8_option(app, cpu_experts_q8);
  add_gpu_mem_option(app, gpu_mem);
}

void add_trunk_fp8_option(CLI::App* app, bool& on) {
  app->add_flag("--trunk-fp8", on,
                "hold the trunk (attention, latent projections, shared experts, dense FFN) in FP8: E4M3 with "
                "128 x 128 block scales, quantised at load (about half the bf16 bytes; router, routed experts, "
                "embedding and lm_head unchanged; CPU and GPU: docs/fp8-trunk.md)");
}

std::unique_ptr<Model> load_model_for_run(const std::string& dir, bool trunk_fp8, const std::string& device, bool quiet,
                                          const std::string& who) {
  auto m = Model::load(dir);
  if (trunk_fp8) {
    const TrunkFp8Report r = m->quantize_trunk_fp8();
    if (!quiet) std::fprintf(stderr, "%s: %s\n", who.c_str(), trunk_fp8_summary(r).c_str());
  }
  return m;
}

void add_parallel_options(CLI::App* app, int& tp, int& ep) {
  app->add_option("--tp", tp,
                  "tensor parallel ranks: attention heads, dense FFN and shared experts split N ways (threads of this "
                  "process, or one rank per process under mpirun; output identical to one rank)")
      ->check(CLI::Range(1, 256));
  app->add_option("--ep", ep, "expert parallel ranks: routed experts split N ways (with --tp: the same ranks)")
      ->check(CLI::Range(1, 256));
  // Taken out of the arguments by main() before this parser runs (the processes start first); listed
  // here for --help.
  static int rank = 0, world = 0;
  static std::string master;
  app->add_option("--rank", rank, "with --world/--master: this process's rank, processes started by hand (GPU ranks)")
      ->group("Processes");
  app->add_option("--world", world, "with --rank/--master: how many processes (one rank each)")->group("Processes");
  app->add_option("--master", master, "with --rank/--world: HOST:PORT where rank 0 listens for the others")
      ->group("Processes");
}

int64_t gpu_sm_count() {
#ifdef K3_HAVE_CUDA
  if (cuda::device_count() > 0) return cuda::device_info().multiprocessors;
#endif
  return GpuOptions{}.sm_count;
}

std::string gpu_fit_line(size_t need) {
#ifdef K3_HAVE_CUDA
  if (cuda::device_count() == 0) return "no usable CUDA GPU here (" + cuda::unavailable_reason() + ")";
  const cuda::DeviceInfo d = cuda::device_info();
  return "this machine's GPU: " + d.name + ", " + human_bytes(d.free_bytes) + " free of " + human_bytes(d.total_bytes) +
         (need + (size_t(512) << 20) <= d.free_bytes ? " (fits)" : " (does NOT fit)");
#else
  (void)need;
  return "this k3 was built without the CUDA backend (K3_CUDA=OFF)";
#endif
}

GpuOptions move_to_device(Model& m, const std::string& device, bool graphs, int64_t tokens_per_call, int64_t ctx_tokens,
                    bool quiet, const std::string& who, bool experts_resident, bool experts_on_cpu,
                    double hot_experts, GpuOptions::PrefillExperts prefill, bool cpu_experts_q8,
                    const std::string& gpu_mem) {
  if (experts_on_cpu && device != "cuda")
    fail("--cpu-experts goes with --device cuda (on the CPU every routed expert is the CPU's already)");
  if (device != "cuda") {
    // --ubatch above the CPU's default step rows: steps of that many rows (its workspace grows), so
    // a piece really is one step (long prefill: fewer, larger MLA calls).
    if (tokens_per_call > m.max_step_rows()) m.set_max_step_rows(tokens_per_call);
    return GpuOptions{};
  }
  GpuOptions o = gpu_options_for(graphs, tokens_per_call, ctx_tokens, experts_resident, experts_on_cpu, hot_experts);
  o.sm_count = gpu_sm_count();  // (for the plan printed below)
  o.prefill_experts = prefill;
  o.cpu_experts_q8 = cpu_experts_q8;
  if (!gpu_mem.empty()) {
    o.gpu_mem = size_t(parse_size(gpu_mem, "--gpu-mem"));
    std::string how;
    o = fit_gpu_mem(m, o, &how);
    if (!quiet) std::fprintf(stderr, "%s: %s\n", who.c_str(), how.c_str());
    experts_on_cpu = o.experts_on_cpu;
    hot_experts = o.hot_experts;
  }
  const auto t0 = std::chrono::steady_clock::now();
  m.use_gpu(o);
  if (!quiet) {
    // (One rank of a model split over processes: that rank's weights, on this process's GPU.)
    const ModelWeights* rank = m.process_rank_weights();
    const GpuMemoryPlan p = rank ? gpu_memory_plan(m.config(), size_t(total_gpu_weight_bytes(*rank)), o, o.initial_context)
                                 : gpu_memory_plan(m, o, o.initial_context);
    std::fprintf(stderr,
                 "%s: on the GPU: %s of weights + %s workspace + %s state (%lld tokens reserved, grows), in %.2f s%s\n",
                 who.c_str(), human_bytes(p.weights).c_str(), human_bytes(p.workspace).c_str(),
                 human_bytes(p.state_fixed + p.state_per_token * size_t(p.context)).c_str(), (long long)p.context,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 experts_on_cpu ? (hot_experts != 0 ? ", routed experts in host RAM computed by the CPU, the hot ones "
                                                      "cached on the GPU once warm (no CUDA graphs)"
                                                    : ", routed experts in host RAM computed by the CPU (no CUDA graphs)")
                 : rank         ? ", this process's rank; no CUDA graphs (a split step's NCCL calls)"
                 : graphs       ? ", decode in CUDA graphs"
                                : "");
  }
  return o;
}

MlaAlgo parse_mla_algo(const std::string& name) {
  if (name == "auto") return MlaAlgo::Auto;
  if (name == "absorbed") return MlaAlgo::Absorbed;
  if (name == "expanded") return MlaAlgo::Expanded;
  throw Error("--mla: unknown form '" + name + "' (auto, absorbed or expanded)");
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void add_cpu_experts_option(CLI::App* app, bool& on) {
  app->add_flag("--cpu-experts", on,
                "with --device cuda: the routed experts stay in host RAM and the CPU cores compute them; the GPU holds "
                "the trunk and the state (for models whose experts do not fit the GPU)");
}

void add_gpu_mem_option(CLI::App* app, std::string& value) {
  app->add_option("--gpu-mem", value,
                  "with --device cuda: use at most SIZE of GPU memory; where the model does not fit, the routed experts "
                  "stay in host RAM (computed by the CPU) and as many as fit are cached on the GPU")
      ->option_text("SIZE");
}

void add_cpu_experts_q8_option(CLI::App* app, bool& on) {
  app->add_flag("--cpu-experts-q8", on,
                "with --cpu-experts and fast numerics: the CPU computes its experts with 8-bit activations, as a "
                "CPU-only run does (about twice as fast; tokens may differ from all on the GPU at near ties)");
}

void add_hot_experts_option(CLI::App* app, std::string& value) {
  app->add_option("--hot-experts", value,
                  "with --cpu-experts: keep the most often routed experts on the GPU too (a fraction of each layer's "
                  "experts, or auto: the GPU memory left over), chosen from the routing of the first 64 tokens; "
                  "decode steps then run those on the GPU while the CPU computes the rest")
      ->option_text("F|auto");
}

ForwardOptions RunEngineFlags::forward() const {
  ForwardOptions o;
  o.kda_algo = kda == "recurrent" ? KdaAlgo::Recurrent : KdaAlgo::Chunked;
  o.mla_algo = parse_mla_algo(mla);
  o.kda_chunk = chunk;
  o.numerics = ops::parse_numerics(numerics);
  return o;
}

void SamplingFlags::add(CLI::App* app) {
  temp =
      app->add_option("--temp,--temperature", v_temp, "temperature; 0 = greedy (default 1, or generation_config.json)");
  top_k = app->add_option("--top-k", v_top_k, "keep the k most likely tokens; 0 = off");
  top_p = app->add_option("--top-p", v_top_p, "nucleus: smallest set with cumulative probability >= p; 1 = off");
  min_p = app->add_option("--min-p", v_min_p, "drop tokens with p < min_p * p_max; 0 = off");
  rep = app->add_option("--repeat-penalty", v_rep, "CTRL repetition penalty; 1 = off");
  rep_n = app->add_option("--repeat-last-n", v_rep_n,
                          "tokens the penalties look back over; -1 = all, 0 = off (default 64)");
  pres = app->add_option("--presence-penalty", v_pres, "subtract this from tokens seen at least once; 0 = off");
  freq = app->add_option("--frequency-penalty", v_freq, "subtract this times the count of each seen token; 0 = off");
  seed = add_seed_option(app, v_seed, "RNG seed, 0..2^64-1 (default: random, printed in the summary)");
}

SamplingParams SamplingFlags::resolve(const std::string& model_dir, std::string* source) const {
  SamplingParams p = sampling_defaults_from_dir(model_dir, source);
  bool any = false;
  const auto set = [&](CLI::Option* o, auto& field, auto value) {
    if (o && o->count()) {
      field = value;
      any = true;
    }
  };
  set(temp, p.temperature, v_temp);
  set(top_k, p.top_k, v_top_k);
  set(top_p, p.top_p, v_top_p);
  set(min_p, p.min_p, v_min_p);
  set(rep, p.repetition_penalty, v_rep);
  set(rep_n, p.penalty_last_n, v_rep_n);
  set(pres, p.presence_penalty, v_pres);
  set(freq, p.frequency_penalty, v_freq);
  if (seed && seed->count()) {
    p.seed = v_seed;
  } else {
    std::random_device rd;
    p.seed = (uint64_t(rd()) << 32) ^ rd();
  }
  if (any && source) *source += " + command line";
  validate_sampling(p);
  return p;
}

std::string resolve_model_dir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("K3_MODEL"); env && *env) return env;
#ifdef K3_INSTALLED_MODEL_DIR
  // An installed k3 (cmake --install): PREFIX/bin/k3 and PREFIX/share/k3/models/k3-nano.
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path installed = exe.parent_path().parent_path() / K3_INSTALLED_MODEL_DIR;
    if (fs::exists(installed / "config.json", ec)) return installed.string();
  }
#endif
#ifdef K3_DEFAULT_MODEL_DIR
  if (fs::exists(fs::path(K3_DEFAULT_MODEL_DIR) / "config.json")) return K3_DEFAULT_MODEL_DIR;
#endif
  fail("no model given: pass -m DIR (a checkpoint directory) or set K3_MODEL");
}

std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string who = app.get_name();
    print_error(who, std::string(e.what()) + " (see " + who + " --help)");
    return 2;
  }
  return std::nullopt;
}

int run_guarded(const char* who, const std::function<int()>& body) {
  try {
    return body();
  } catch (const FollowerDone&) {
    return 0;  // a rank > 0 of an MPI launch: rank 0 did the job and closed the group (model/remote.h)
  } catch (const Error& e) {
    print_error(who, e.what());
    return e.exit_code();
  } catch (const std::bad_alloc&) {
    print_error(who, "out of memory");
    return 1;
  } catch (const std::exception& e) {
    print_error(who, std::string("internal error: ") + e.what());
    return 1;
  }
}

bool wants_bos(const std::string& tok_dir) {
  std::ifstream f(std::filesystem::path(tok_dir) / "tokenizer_config.json");
  if (!f) return false;
  const auto j = nlohmann::json::parse(f, nullptr, false);
  return j.is_object() && j.contains("add_bos_token") && j["add_bos_token"].is_boolean() &&
         j["add_bos_token"].get<bool>();
}

bool stderr_is_tty() { return ::isatty(2) == 1; }
bool stdout_is_tty() { return ::isatty(1) == 1; }

namespace {
// floor(100 * done / total) in integers (no rounding of a double can show 100% before the end).
int percent(uint64_t done, uint64_t total) {
  if (done >= total) return 100;
  if (done <= UINT64_MAX / 100) return int(done * 100 / total);
  return int(done / (total / 100));  // total > done > 1.8e17: total / 100 loses nothing that shows
}
}  // namespace

Progress::Progress(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled), tty_(stderr_is_tty()) {}

void Progress::update(uint64_t done, uint64_t total, const std::string& unit_text) {
  if (!enabled_ || total == 0) return;
  const double frac = std::min(1.0, double(done) / double(total));
  if (tty_) {
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    if (done < total && last_draw_ >= 0 && now - last_draw_ < 0.1) return;  // at most ~10 redraws a second
    last_draw_ = now;
    constexpr int kWidth = 30;
    const int fill = int(frac * kWidth + 0.5);
    std::fprintf(stderr, "\r%s [%s%s] %3d%% %s\x1b[K", label_.c_str(), std::string(size_t(fill), '#').c_str(),
                 std::string(size_t(kWidth - fill), '.').c_str(), percent(done, total), unit_text.c_str());
    drawn_ = true;
  } else {
    // A line each time another quarter is passed; the percentage is the one of this very count.
    const int q = int(frac * 4);
    if (q > last_quarter_) {
      last_quarter_ = q;
      std::fprintf(stderr, "%s: %d%% %s\n", label_.c_str(), percent(done, total), unit_text.c_str());
    }
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (enabled_ && tty_ && drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
}

LoadedModel load_for_generation(const RunEngineFlags& f, const std::string& who, int64_t ctx_tokens) {
  if (f.threads > 0) par::set_max_threads(f.threads);
  if (!f.cpu_isa.empty()) ops::set_cpu_isa(ops::parse_cpu_isa(f.cpu_isa));  // one-line error if the CPU lacks it
  LoadRequest req;
  req.dir = resolve_model_dir(f.model);
  req.tokenizer_dir = f.tokenizer;
  req.ctx_limit = f.ctx;
  req.ctx_tokens = ctx_tokens;
  req.ubatch = f.ubatch;
  req.mem_limit = f.mem_limit;
  req.ram_budget = f.ram_budget;
  req.direct_io = f.direct_io;
  req.cuda = f.device == "cuda";
  req.numerics = ops::parse_numerics(f.numerics);
  req.parallel = {f.tp, f.ep};
  req.trunk_fp8 = f.trunk_fp8;
  if (f.cpu_experts && !req.cuda)
    fail("--cpu-experts goes with --device cuda (on the CPU every routed expert is the CPU's already)");
  const double hot = parse_hot_experts(f.hot_experts, f.cpu_experts);
  check_cpu_experts_q8(f.cpu_experts_q8, f.cpu_experts);
  check_gpu_mem(f.gpu_mem, req.cuda);
  if (hot != 0 && !f.ram_budget.empty())
    fail("--hot-experts caches routed experts held in host RAM; with --ram-budget they are read from disk (not both)");
  LoadedCheckpoint lc = load_checkpoint(req);
  if (lc.trunk_fp8 && !f.quiet) std::fprintf(stderr, "%s: %s\n", who.c_str(), trunk_fp8_summary(lc.fp8).c_str());
  if (req.parallel.split() && !f.quiet)
    std::fprintf(stderr, "%s: split %s\n", who.c_str(), split_description(lc.model->dims(), req.parallel).c_str());

  const auto t0 = std::chrono::steady_clock::now();
  bool experts_on_host = f.cpu_experts;
  if (req.cuda) {
    // The upload reads every weight once; no prefault of the host mapping is needed.
    // Under --ram-budget the routed experts stay on the host: each step uploads the ones it selects.
    // With --cpu-experts the CPU reads the routed experts from the mapping: read them in now.
    // (--gpu-mem may keep them there too: the placement chosen is returned.)
    experts_on_host = move_to_device(*lc.model, f.device, !f.no_graphs, f.ubatch, ctx_tokens, f.quiet, who,
                                     lc.ram_budget == 0, f.cpu_experts, hot, GpuOptions::PrefillExperts::Auto,
                                     f.cpu_experts_q8, f.gpu_mem)
                          .experts_on_cpu;
  }
  if ((!req.cuda || (experts_on_host && !lc.ram_budget)) && !f.no_prefault) {
    Progress bar(who + ": loading", !f.quiet);
    prefault_weights(lc, [&](uint64_t done, uint64_t total) {
      bar.update(done, total, human_bytes(done) + " / " + human_bytes(total));
    });
    bar.finish();
  }
  const double secs = lc.bind_seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!f.quiet) {
    std::string streamed;
    if (lc.experts)
      streamed = " (trunk " + human_bytes(lc.trunk_bytes) + " resident; routed experts " +
                 human_bytes(lc.experts->expert_bytes()) + " streamed through a " +
                 human_bytes(lc.experts->capacity_bytes()) + " cache, --ram-budget " + human_bytes(lc.ram_budget) +
                 (f.direct_io ? ", O_DIRECT)" : ")");
    std::fprintf(stderr, "%s: loaded %s: %s of weights%s, %zu tensors, in %.2f s\n", who.c_str(), lc.dir.c_str(),
                 human_bytes(lc.weight_bytes).c_str(), streamed.c_str(), lc.model->checkpoint().tensor_count(), secs);
  }
  LoadedModel lm;
  lm.model = std::move(lc.model);
  lm.tok = std::move(lc.tok);
  lm.dir = lc.dir;
  lm.experts = std::move(lc.experts);
  return lm;
}

ForwardOptions LoadedModel::forward(const RunEngineFlags& flags) const {
  ForwardOptions o = flags.forward();
  o.experts = experts.get();
  return o;
}

std::string expert_summary(const LoadedModel& lm, const ExpertCacheStats& prefill, int64_t prefill_tokens,
                           int64_t decode_tokens) {
  if (!lm.experts) return "";
  const ExpertCacheStats all = lm.experts->stats();
  const auto per = [](uint64_t bytes, int64_t tokens) {
    return human_bytes(tokens > 0 ? uint64_t(double(bytes) / double(tokens)) : 0) + "/tok";
  };
  std::string s = " | experts: read ";
  if (decode_tokens < 0)
    s += per(all.bytes_read, prefill_tokens);
  else
    s += per(prefill.bytes_read, prefill_tokens) + " prefill, " + per((all - prefill).bytes_read, decode_tokens) +
         " decode";
  char buf[160];
  std::snprintf(buf, sizeof buf, ", hit %.0f%%, %llu reads, %llu evictions", 100.0 * all.hit_rate(),
                (unsigned long long)all.reads, (unsigned long long)all.evictions);
  return s + buf;
}

namespace {
std::atomic<bool> g_interrupt{false};
std::atomic<int64_t> g_first_ns{0};
int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
extern "C" void on_sigint(int) {
  const int64_t now = monotonic_ns();
  if (!g_interrupt.exchange(true)) {
    g_first_ns.store(now);
    return;
  }
  // A second Ctrl-C leaves at once. One that follows within 300 ms is the same press delivered
  // twice (to the process and to its group, as `timeout` and some shells do) and is ignored.
  if (now - g_first_ns.load() > 300000000) ::_exit(130);
}
}  // namespace

std::atomic<bool>& interrupt_flag() { return g_interrupt; }

void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocking read at the chat prompt returns EINTR
  sigaction(SIGINT, &sa, nullptr);
}

std::string summary_line(const GenStats& st, StopReason reason) {
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "prompt %lld tok | generated %lld tok | prefill %.1f tok/s | decode %.1f tok/s | peak RSS %s | stop: %s",
      (long long)st.prompt_tokens, (long long)st.generated_tokens, st.prefill_tps(), st.decode_tps(),
      human_bytes(peak_rss_bytes()).c_str(), stop_reason_name(reason));
  return buf;
}

}  // namespace k3::cli
