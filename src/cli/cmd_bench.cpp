// Implements `k3 bench` (llama-bench style): ppN / tgN throughput at several context depths, thread
// counts and batch sizes (sequences per Model::step), with a snapshot (a pool slot) of each depth
// context that every repetition copies. run() = plan (tests and settings) -> measure (probes, depth
// contexts, timed runs) -> report (md / json / jsonl).
// Owns: its flag parsing, timing, progress on stderr, md/json/jsonl on stdout. Must not: do model
// math (it only calls Model::step) or print anything but results to stdout; every bad input is
// one line "k3 bench: error: ..." on stderr and exit status 2.
#include "cli/cmd_bench.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cli/cli_common.h"
#include "config/arch_stats.h"
#include "core/comm.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "k3/version.h"
#include "model/backend_profile.h"
#include "model/model.h"
#include "runtime/loader.h"
#include "model/traffic.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/roofline.h"
#include "runtime/memory.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace k3::cli {

namespace {

using Json = nlohmann::ordered_json;
using k3::Error;

// The explanation after the option list of `k3 bench --help`.
const char* kHelpFooter =
    "LIST is comma-separated, e.g. -p 128,512 -d 0,1024. Tests: ppN for each N in -p and tgN for\n"
    "each N in -n, at every depth in -d, every thread count in -t and every batch in -b. A depth\n"
    "context is prefilled once from seeded random ids (a deeper one extends the previous one) and\n"
    "snapshotted (--depth-fill random: no prefill, the cache and state hold seeded random values;\n"
    "a decode step costs the same whatever they hold); each run starts from a copy (not timed) and\n"
    "one warm-up run precedes -r runs.\n"
    "ppN: one prefill of N new tokens (in --ubatch pieces, last-token logits). tgN: N single-token\n"
    "decode steps, each fed the argmax of the previous step. t/s = mean ± sample stddev over -r.\n"
    "\n"
    "Batch B (-b): B sequences, each a copy of the depth context, go through one Model::step per\n"
    "step. tgN: each step decodes one token of every sequence (each fed its own argmax; their first\n"
    "tokens differ). ppN: B different prompts of N tokens, each step feeding every sequence its next\n"
    "piece of at most --ubatch tokens. Once -b lists a B other than 1, rows gain n_batch, t/s becomes\n"
    "the aggregate (B x N tokens / time), and 't/s per seq' (N / time) and 'vs n_batch=1' (aggregate\n"
    "/ the B = 1 row of the same test; B = 1 runs first) are added.\n"
    "\n"
    "Roofline (per thread count, measured in the same run before the tests): streaming read\n"
    "bandwidth and the peak multiply-add rate of the widest product of the CPU level (vdpbf16ps on\n"
    "avx512, tdpbf16ps tiles on amx). tgN: t/s x bytes one decode step reads (weights touched: trunk + top-k experts +\n"
    "lm_head, KDA state read+write, MLA cache at the depth) / bandwidth. ppN: t/s x weight FLOPs\n"
    "per token (2 x active weight parameters, the lm_head counted once per --ubatch piece, since\n"
    "only the last token's logits are computed; attention not counted) / peak. On the CPU both\n"
    "probes run again (best of 3) before the first and after every repetition: a repetition is\n"
    "divided by the larger probe on its two sides, and the column is the mean of those ratios\n"
    "(a shared machine's bandwidth moves within seconds; json has both ratios). tgN with B > 1:\n"
    "bytes per step = the weights once, counting min(B x top_k, experts) routed experts per MoE\n"
    "layer (the most the union of the B selections can be, so an upper bound), + B embedding\n"
    "rows, KDA states and MLA caches; the ratio is the aggregate t/s x those bytes / B / bandwidth.\n"
    "With --device cuda the probes run on the GPU: device-to-device copy bandwidth (bytes read +\n"
    "written) and the cuBLAS bf16 GEMM rate (8192^3, random data); tgN runs with and without\n"
    "CUDA-graph replay of the decode step (--graphs); -t is ignored.";

struct Flags {
  std::string model;
  std::vector<int64_t> n_prompt{512}, n_gen{128}, n_depth{0}, threads, batch{1};
  int64_t reps = 5;
  std::string output = "md", json_out;
  std::string kda = "chunked", mla = "auto";
  int64_t chunk = 64, ubatch = 512;
  uint64_t seed = 1;
  bool progress = true, roofline = true;
  bool profile = false;  // --profile: one more run per test with per-op times
  std::string numerics = "fast", cpu_isa;
  int64_t roofline_mib = 1024;
  std::string device = "cpu", graphs = "both";
  std::string depth_fill = "prefill";  // --depth-fill: how a depth context is made (prefill or random)
  bool trunk_fp8 = false;              // --trunk-fp8: the trunk quantised to FP8 at load
  bool cpu_experts = false;            // --cpu-experts: routed experts on the host CPU (--device cuda)
  std::string hot_experts;             // --hot-experts: with --cpu-experts, a GPU cache of the hot experts
  std::string prefill_experts = "auto";  // --prefill-experts: with --cpu-experts, where long prompts' experts run
  bool cpu_experts_q8 = false;           // --cpu-experts-q8: 8-bit activations for the CPU's experts
  int tp = 1, ep = 1;                  // --tp/--ep: the model split over ranks (threads, or MPI processes)
  // Some -b value other than 1: rows and results then carry the batch columns and fields (with
  // -b 1 alone the output is what it was before batches existed).
  bool batched() const {
    return std::any_of(batch.begin(), batch.end(), [](int64_t b) { return b != 1; });
  }
  int64_t max_batch() const { return *std::max_element(batch.begin(), batch.end()); }
};

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return c >= '0' && c <= '9'; });
}

// One non-negative decimal integer with a flag-named message on any problem.
int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  if (s.empty()) throw Error(flag + ": empty value");
  if (s[0] == '-' && all_digits(s.substr(1))) throw Error(flag + ": '" + s + "' is negative");
  if (!all_digits(s)) throw Error(flag + ": '" + s + "' is not a non-negative integer");
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
  if (errno == ERANGE || v > uint64_t(std::numeric_limits<int64_t>::max()) || int64_t(v) > hi)
    throw Error(flag + ": " + s + " is too large (at most " + std::to_string(hi) + ")");
  if (int64_t(v) < lo) throw Error(flag + ": " + s + " is too small (at least " + std::to_string(lo) + ")");
  return int64_t(v);
}

std::vector<int64_t> parse_list(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  if (s.empty()) throw Error(flag + ": empty list");
  std::vector<int64_t> out;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty()) throw Error(flag + ": empty item in list '" + s + "'");
    out.push_back(parse_int(flag, item, lo, hi));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

constexpr int64_t kMaxTokens = int64_t(1) << 40;
constexpr int64_t kMaxBatch = 4096;  // sequences of one step (pool slots)

// The command line as given (strings: every value is checked below with a message naming its flag).
struct RawFlags {
  std::string n_prompt = "512", n_gen = "128", n_depth = "0", threads, batch = "1", reps = "5";
  std::string chunk = "64", ubatch = "512", seed = "1", roofline_mib = "1024";
};

// Parses the flags into `f`. Returns the exit code when the program ends now (0 after --help, 2
// after a one-line usage error), else nothing.
std::optional<int> parse_flags(int argc, char** argv, Flags& f) {
  CLI::App app{"k3 bench: prefill (ppN) and decode (tgN) throughput, llama-bench style"};
  app.name("k3 bench");
  app.footer(kHelpFooter);
  RawFlags raw;
  k3::cli::add_model_option(&app, f.model);
  app.add_option("-p,--n-prompt", raw.n_prompt, "prompt lengths: one ppN test per value, 0 = none (default 512)")
      ->option_text("LIST");
  app.add_option("-n,--n-gen", raw.n_gen, "decode lengths: one tgN test per value, 0 = none (default 128)")
      ->option_text("LIST");
  app.add_option("-d,--n-depth", raw.n_depth, "context depths: tokens already in the cache (default 0)")
      ->option_text("LIST");
  app.add_option("-t,--threads", raw.threads, "CPU thread counts (default: all cores)")->option_text("LIST");
  app.add_option("-b,--batch", raw.batch, "sequences per step: N sequences run together (default 1)")
      ->option_text("LIST");
  app.add_option("-r,--repetitions", raw.reps, "timed repetitions per test, after one warm-up run (default 5)")
      ->option_text("N");
  app.add_option("-o,--output", f.output, "md, json or jsonl (default md)")->option_text("FORMAT");
  app.add_option("--json-out", f.json_out, "also write the json document to FILE (any -o)")->option_text("FILE");
  app.add_option("--kda", f.kda, "KDA prefill algorithm: chunked or recurrent (default chunked)")->option_text("ALGO");
  app.add_option("--mla", f.mla, std::string(k3::cli::kMlaFlagHelp) + " (default auto)")->option_text("FORM");
  app.add_option("--chunk", raw.chunk, "KDA chunk size for prefill, 1..1024 (default 64)")->option_text("N");
  app.add_option("--ubatch", raw.ubatch, "prefill tokens per sequence and step (default 512)")->option_text("N");
  app.add_option("--seed", raw.seed, "seed of the random token ids, 0..2^63-1 (default 1)")->option_text("N");
  app.add_option("--depth-fill", f.depth_fill,
                 "how a depth context is made: prefill (a forward over seeded random ids) or random (no forward: "
                 "the cache and state filled with seeded random values; decode at depths a prefill would take "
                 "hours to reach) (default prefill)")
      ->option_text("MODE");
  app.add_option("--numerics", f.numerics, "fast, fp32 or exact (see docs/performance.md) (default fast)")
      ->option_text("MODE");
  app.add_option("--cpu-isa", f.cpu_isa, "amx, avx512, avx2 or scalar kernels (default: the best this CPU has)")
      ->option_text("LEVEL");
  app.add_option("--device", f.device, "cpu or cuda (NVIDIA GPU; fast = bf16, fp32 = parity) (default cpu)")
      ->option_text("DEV");
  app.add_option("--graphs", f.graphs, "cuda tgN: both, on or off (CUDA-graph decode steps) (default both)")
      ->option_text("MODE");
  bool no_roofline = false;
  app.add_flag("--no-roofline", no_roofline, "skip the bandwidth / peak-FLOP probes and the ratio column")
      ->disable_flag_override();
  app.add_flag("--profile", f.profile,
               "after each test, one more (untimed) run with the time of every backend op: a table per test "
               "(op, calls, ms, share); on CUDA timed with device events, graphs off in that run")
      ->disable_flag_override();
  app.add_option("--roofline-mib", raw.roofline_mib,
                 "buffer the bandwidth probe reads, >> last-level cache (default 1024)")
      ->option_text("N");
  app.add_flag("--progress,!--no-progress", f.progress, "progress on stderr (default), or none")
      ->disable_flag_override();
  k3::cli::add_trunk_fp8_option(&app, f.trunk_fp8);
  k3::cli::add_cpu_experts_option(&app, f.cpu_experts);
  k3::cli::add_hot_experts_option(&app, f.hot_experts);
  k3::cli::add_cpu_experts_q8_option(&app, f.cpu_experts_q8);
  app.add_option("--prefill-experts", f.prefill_experts,
                 "with --cpu-experts: a long prompt's routed experts computed by the CPU (cpu), copied to the GPU "
                 "group by group and computed there (gpu), or auto (default: each way timed once, then the faster "
                 "per layer)")
      ->option_text("auto|cpu|gpu");
  k3::cli::add_parallel_options(&app, f.tp, f.ep);
  if (const auto code = k3::cli::parse_flags(app, argc, argv)) return code;
  f.roofline = !no_roofline;

  f.n_prompt = parse_list("-p/--n-prompt", raw.n_prompt, 0, kMaxTokens);
  f.n_gen = parse_list("-n/--n-gen", raw.n_gen, 0, kMaxTokens);
  f.n_depth = parse_list("-d/--n-depth", raw.n_depth, 0, kMaxTokens);
  if (app.count("--threads")) f.threads = parse_list("-t/--threads", raw.threads, 1, 4096);
  f.batch = parse_list("-b/--batch", raw.batch, 1, kMaxBatch);
  f.reps = parse_int("-r/--repetitions", raw.reps, 1, 1000000);
  if (f.output != "md" && f.output != "json" && f.output != "jsonl")
    throw Error("-o/--output: unknown format '" + f.output + "' (md, json or jsonl)");
  if (app.count("--json-out") && f.json_out.empty()) throw Error("--json-out: empty file name");
  if (f.kda != "chunked" && f.kda != "recurrent")
    throw Error("--kda: unknown algorithm '" + f.kda + "' (chunked or recurrent)");
  if (f.mla != "auto" && f.mla != "absorbed" && f.mla != "expanded")
    throw Error("--mla: unknown form '" + f.mla + "' (auto, absorbed or expanded)");
  if (f.depth_fill != "prefill" && f.depth_fill != "random")
    throw Error("--depth-fill: unknown mode '" + f.depth_fill + "' (prefill or random)");
  f.chunk = parse_int("--chunk", raw.chunk, 1, 1024);
  f.ubatch = parse_int("--ubatch", raw.ubatch, 1, kMaxTokens);
  f.seed = uint64_t(parse_int("--seed", raw.seed, 0, std::numeric_limits<int64_t>::max()));
  f.roofline_mib = parse_int("--roofline-mib", raw.roofline_mib, 16, 1 << 20);
  k3::ops::parse_numerics(f.numerics);
  if (!f.cpu_isa.empty()) k3::ops::parse_cpu_isa(f.cpu_isa);
  if (f.device != "cpu" && f.device != "cuda") throw Error("--device: unknown device '" + f.device + "' (cpu or cuda)");
  k3::parse_hot_experts(f.hot_experts, f.cpu_experts);  // (a bad value or a missing --cpu-experts: one line, before loading)
  k3::parse_prefill_experts(f.prefill_experts);
  k3::check_cpu_experts_q8(f.cpu_experts_q8, f.cpu_experts);
  if (f.prefill_experts != "auto" && !f.cpu_experts)
    throw Error("--prefill-experts goes with --cpu-experts (without it every routed expert is on the GPU)");
  if (f.graphs != "both" && f.graphs != "on" && f.graphs != "off")
    throw Error("--graphs: unknown mode '" + f.graphs + "' (both, on or off)");
  f.model = k3::cli::resolve_model_dir(f.model);
  if (f.device == "cuda" && f.numerics == "exact")
    throw Error("--numerics exact (fp64 sums) is CPU-only; with --device cuda use fp32 (parity mode) or fast (bf16)");
  if (f.device == "cuda" && f.mla == "expanded") throw Error("--mla expanded is CPU-only; the GPU runs MLA absorbed");
  const k3::ParallelPlan split{f.tp, f.ep};
  k3::check_split_device(split, f.device == "cuda");  // GPUs: one process per GPU, tensor parallel only
  if (split.split() && f.profile)
    throw Error("--profile times one backend's ops; with --tp/--ep each rank has its own (not supported together)");
  if (std::all_of(f.n_prompt.begin(), f.n_prompt.end(), [](int64_t v) { return v == 0; }) &&
      std::all_of(f.n_gen.begin(), f.n_gen.end(), [](int64_t v) { return v == 0; }))
    throw Error("nothing to run: every -p and -n value is 0");
  return std::nullopt;
}

// ---------------------------------------------------------------- environment

std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string v = line.substr(colon + 1);
    const size_t b = v.find_first_not_of(" \t");
    return b == std::string::npos ? "unknown CPU" : v.substr(b);
  }
  return "unknown CPU";
}

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("GCC ") + __VERSION__;
#else
  return "unknown";
#endif
}

using k3::human_bytes;

std::string human_count(int64_t n) {
  char buf[64];
  if (n >= 1000000000)
    std::snprintf(buf, sizeof buf, "%.2f B", double(n) / 1e9);
  else if (n >= 1000000)
    std::snprintf(buf, sizeof buf, "%.2f M", double(n) / 1e6);
  else if (n >= 1000)
    std::snprintf(buf, sizeof buf, "%.2f K", double(n) / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%lld", (long long)n);
  return buf;
}

// ---------------------------------------------------------------- progress

class Progress {
 public:
  explicit Progress(bool on) : on_(on), tty_(on && ::isatty(STDERR_FILENO)) {}
  void say(const std::string& msg) {
    if (!on_) return;
    if (tty_) {
      std::fprintf(stderr, "\r\033[Kk3 bench: %s", msg.c_str());
      open_ = true;
    } else {
      std::fprintf(stderr, "k3 bench: %s\n", msg.c_str());
    }
    std::fflush(stderr);
  }
  void done() {
    if (open_) std::fprintf(stderr, "\r\033[K"), std::fflush(stderr);
    open_ = false;
  }
  ~Progress() { done(); }

 private:
  bool on_, tty_, open_ = false;
};

// ---------------------------------------------------------------- tests

// Deterministic ids (splitmix64), independent of the standard library's distributions.
struct IdGen {
  uint64_t s;
  int32_t next(int64_t vocab) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return int32_t(z % uint64_t(vocab));
  }
};

std::vector<int32_t> random_ids(uint64_t seed, uint64_t stream, int64_t n, int64_t vocab) {
  IdGen g{seed * 0x100000001B3ull ^ (stream * 0xD6E8FEB86659FD93ull)};
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = g.next(vocab);
  return ids;
}

struct Test {
  bool pp = true;
  int64_t n = 0, depth = 0, threads = 1;
  size_t depth_index = 0;  // position in -d (a depth may be listed twice)
  int graphs = -1;         // GPU tgN: 1 = CUDA-graph decode steps, 0 = launched kernel by kernel; -1 = n/a
  int64_t batch = 1;       // sequences run together
  std::string name() const {
    std::string s = (pp ? "pp" : "tg") + std::to_string(n);
    if (depth > 0) s += " @ d" + std::to_string(depth);
    if (graphs >= 0) s += graphs ? " graphs" : " no-graphs";
    return s;
  }
  int64_t tokens() const { return batch * n; }  // tokens of one run, all sequences
};

struct Result {
  Test test;
  std::vector<int64_t> samples_ns;
  double avg_ts = 0, stddev_ts = 0;  // aggregate: test.tokens() per run
  // Roofline ratio (0 when not measured): tg -> bytes/token x t/s / read bandwidth; pp -> weight
  // FLOPs/token x t/s / peak. On the CPU the roof is probed again around every repetition
  // (`around`: before the first, between two, after the last); repetition i divides by the larger
  // of the probes on its two sides, and `roofline_ratio` is the mean of those ratios, `roof` the
  // mean of those roofs. `ratio_start` divides the mean t/s by the probe taken before all tests.
  // For tg with a batch, bytes/token is bytes_per_step / batch (traffic: the step's parts).
  double roofline_ratio = 0, work_per_token = 0, roof = 0, start_roof = 0, ratio_start = 0;
  double lm_head_flops = 0;  // per logit row; a run computes logit_rows of them
  int64_t logit_rows = 0;
  k3::DecodeTraffic traffic;
  std::vector<double> around, rep_ratios;
  double vs_batch1 = 0;  // avg_ts / avg_ts of the batch-1 result of the same test (0: none)
  // CPU: threads the timed repetitions' parallel loops had on average (the pool shrinks its team
  // while other processes keep the cores busy; core/thread_pool.h), and whether that was allowed.
  double threads_used = 0;
  bool adaptive_threads = false;
  k3::OpProfile profile;  // --profile: the extra run's op times (profile.steps == 0: not profiled)
};

// Fills the roofline fields of `r` from its samples (summarize() first) and `work` per token.
void roofline_ratios(Result& r, double work, double start_roof) {
  r.work_per_token = work;
  r.start_roof = start_roof;
  r.ratio_start = r.avg_ts * work / (start_roof * 1e9);
  if (r.around.size() != r.samples_ns.size() + 1) {  // no probes around the repetitions (GPU)
    r.roof = start_roof;
    r.roofline_ratio = r.ratio_start;
    return;
  }
  double sum_ratio = 0, sum_roof = 0;
  for (size_t i = 0; i < r.samples_ns.size(); ++i) {
    const double roof = std::max(r.around[i], r.around[i + 1]);
    const double ts = double(r.test.tokens()) * 1e9 / double(std::max<int64_t>(r.samples_ns[i], 1));
    r.rep_ratios.push_back(ts * work / (roof * 1e9));
    sum_ratio += r.rep_ratios.back();
    sum_roof += roof;
  }
  r.roofline_ratio = sum_ratio / double(r.samples_ns.size());
  r.roof = sum_roof / double(r.samples_ns.size());
}

void summarize(Result& r) {
  std::vector<double> ts;
  for (int64_t ns : r.samples_ns) ts.push_back(double(r.test.tokens()) * 1e9 / double(std::max<int64_t>(ns, 1)));
  double sum = 0;
  for (double v : ts) sum += v;
  r.avg_ts = sum / double(ts.size());
  double ss = 0;
  for (double v : ts) ss += (v - r.avg_ts) * (v - r.avg_ts);
  r.stddev_ts = ts.size() > 1 ? std::sqrt(ss / double(ts.size() - 1)) : 0.0;
}

// The timed work: a pool with the depth context in `base` and the slots of the timed runs.
struct Bench {
  const k3::Model& model;
  const Flags& f;
  k3::ForwardOptions opt;
  std::unique_ptr<k3::StatePool> pool;
  int32_t base = -1;          // the depth context every run copies
  std::vector<int32_t> work;  // the runs' sequences (as many as the largest -b)
  std::vector<float> logits;  // [largest -b, vocab]: last-token logits of prefill steps
  std::vector<k3::SeqStep> seqs;
  std::vector<int32_t> feed, picked;

  Bench(const k3::Model& m, const Flags& fl, const k3::StatePoolOptions& po)
      : model(m), f(fl), pool(m.new_pool(po)), logits(static_cast<size_t>(fl.max_batch() * m.dims().vocab)) {
    opt.kda_algo = f.kda == "recurrent" ? k3::KdaAlgo::Recurrent : k3::KdaAlgo::Chunked;
    opt.mla_algo = k3::cli::parse_mla_algo(f.mla);
    opt.kda_chunk = f.chunk;
    opt.numerics = k3::ops::parse_numerics(f.numerics);
    base = pool->alloc();
    for (int64_t i = 0; i < f.max_batch(); ++i) work.push_back(pool->alloc());
  }

  // Appends `ids` to the depth context in --ubatch pieces (last-token logits); `tick(done)` after each.
  template <class Tick>
  void prefill_base(const int32_t* ids, int64_t n, Tick tick) {
    for (int64_t off = 0; off < n; off += f.ubatch) {
      const k3::SeqStep one{base, ids + off, std::min(f.ubatch, n - off), false};
      model.step(*pool, std::span<const k3::SeqStep>(&one, 1), opt, logits.data());
      tick(off + one.n);
    }
  }
  void reset_base() { pool->reset(base); }

  // One timed run of `t`: its t.batch sequences start as copies of the depth context (not timed).
  // pp: prompts holds batch x n ids (sequence i's at i x n); each step feeds every sequence its next
  // piece of at most --ubatch ids, last-token logits. tg: first holds the first id of each; each
  // step decodes one token of every sequence, fed its argmax of the step before (argmax output
  // only: the GPU copies back one id per sequence).
  int64_t run_once(const Test& t, const std::vector<int32_t>& prompts, const std::vector<int32_t>& first) {
    const size_t B = size_t(t.batch);
    for (size_t i = 0; i < B; ++i) pool->copy_into(work[i], base);
    if (t.graphs >= 0) model.set_gpu_graphs(t.graphs == 1);
    seqs.resize(B);
    const std::span<const k3::SeqStep> step(seqs.data(), B);
    const auto t0 = std::chrono::steady_clock::now();
    if (t.pp) {
      for (int64_t off = 0; off < t.n; off += f.ubatch) {
        const int64_t len = std::min(f.ubatch, t.n - off);
        for (size_t i = 0; i < B; ++i) seqs[i] = {work[i], prompts.data() + int64_t(i) * t.n + off, len, false};
        model.step(*pool, step, opt, logits.data());
      }
    } else {
      feed.assign(first.begin(), first.begin() + int64_t(B));
      picked.resize(B);
      for (int64_t s = 0; s < t.n; ++s) {
        for (size_t i = 0; i < B; ++i) seqs[i] = {work[i], &feed[i], 1, false};
        model.step(*pool, step, opt, nullptr, picked.data());
        feed.swap(picked);
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  }
};

// ---------------------------------------------------------------- plan

struct ModelInfo {
  std::string name;
  uint64_t bytes = 0;
  int64_t n_params = 0, n_active = 0;
  k3::TrunkFp8Bytes fp8;  // --trunk-fp8: the trunk matrices, their stored bytes and their FP8 bytes
};

// Everything decided before the first probe: the tests in run order and what the header says.
struct Plan {
  bool cuda = false;
  ModelInfo mi;
  std::vector<int64_t> threads;
  int64_t build_threads = 1;  // threads of the (untimed) depth prefills
  std::vector<Test> tests;
  std::string kernel_level, cpu, gpu, algo, command;
  k3::StatePoolOptions pool;  // sized for the depth context and the largest batch
};

void check_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw Error("model directory '" + dir + "' does not exist");
  if (!fs::is_directory(dir, ec)) throw Error("model path '" + dir + "' is not a directory");
}

// Tokens a sequence holds at most: the deepest depth + the longest prompt or generation.
int64_t max_context(const Flags& f) {
  int64_t max_ctx = 16;
  for (int64_t d : f.n_depth)
    max_ctx = std::max(max_ctx, d + std::max(*std::max_element(f.n_prompt.begin(), f.n_prompt.end()),
                                             *std::max_element(f.n_gen.begin(), f.n_gen.end())));
  return max_ctx;
}

std::unique_ptr<k3::Model> load_model(const Flags& f) {
  if (!f.cpu_isa.empty()) k3::ops::set_cpu_isa(k3::ops::parse_cpu_isa(f.cpu_isa));
  auto model = k3::cli::load_model_for_run(f.model, f.trunk_fp8, f.device, !f.progress, "k3 bench");
  const k3::ParallelPlan split{f.tp, f.ep};
  model->split(split);  // also with one rank: under an MPI launch it checks the plan against the processes
  if (split.split() && f.progress)
    std::fprintf(stderr, "k3 bench: split %s\n", k3::split_description(model->dims(), split).c_str());
  // (On the CPU: --ubatch above 512 makes the steps that long.)
  k3::cli::move_to_device(*model, f.device, f.graphs != "off", f.ubatch, max_context(f), !f.progress, "k3 bench", true,
                          f.cpu_experts, k3::parse_hot_experts(f.hot_experts, f.cpu_experts),
                          k3::parse_prefill_experts(f.prefill_experts), f.cpu_experts_q8);
  return model;
}

void check_positions(const Flags& f, int64_t max_pos) {
  if (max_pos <= 0) return;
  for (int64_t d : f.n_depth) {
    for (int64_t p : f.n_prompt)
      if (p > 0 && d + p > max_pos)
        throw Error("depth " + std::to_string(d) + " + prompt " + std::to_string(p) + " = " + std::to_string(d + p) +
                    " tokens exceeds the model's max_position_embeddings (" + std::to_string(max_pos) + ")");
    for (int64_t n : f.n_gen)
      if (n > 0 && d + n > max_pos)
        throw Error("depth " + std::to_string(d) + " + generated " + std::to_string(n) + " = " + std::to_string(d + n) +
                    " tokens exceeds the model's max_position_embeddings (" + std::to_string(max_pos) + ")");
  }
}

ModelInfo model_info(const Flags& f, const k3::Model& model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ModelInfo mi;
  std::string dir = fs::path(f.model).lexically_normal().string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  mi.name = fs::path(dir).filename().string();
  if (mi.name.empty() || mi.name == ".")
    mi.name = fs::absolute(f.model, ec).lexically_normal().parent_path().filename().string();
  if (mi.name.empty()) mi.name = "model";
  mi.bytes = model.checkpoint().total_tensor_bytes();
  if (model.trunk_fp8()) {  // the weights as held: the trunk in FP8 instead of the tensors it replaced
    const k3::TrunkFp8Bytes now = k3::trunk_fp8_bytes(model.weights());  // its "before" is the FP8 bytes
    mi.fp8.matrices = now.matrices;
    mi.fp8.after = now.before;
    for (const std::string& n : model.checkpoint().names())
      if (model.replaced_by_trunk_fp8(n)) mi.fp8.before += model.checkpoint().find(n)->nbytes;
    mi.bytes = mi.bytes - mi.fp8.before + mi.fp8.after;
  }
  const k3::ArchParams ap = k3::compute_arch_params(model.config());
  mi.n_params = ap.total;
  mi.n_active = ap.active_per_token;
  return mi;
}

// -b in run order: batch 1 first (the others are compared with it), then the rest as given.
std::vector<int64_t> batch_order(const std::vector<int64_t>& batch) {
  std::vector<int64_t> order;
  std::copy_if(batch.begin(), batch.end(), std::back_inserter(order), [](int64_t b) { return b == 1; });
  std::copy_if(batch.begin(), batch.end(), std::back_inserter(order), [](int64_t b) { return b != 1; });
  return order;
}

Plan make_plan(const Flags& f, const k3::Model& model, int argc, char** argv) {
  Plan p;
  p.cuda = f.device == "cuda";
  // Exact numerics run the scalar kernels whatever the CPU level (ops/cpu/isa.h).
  p.kernel_level = f.numerics == "exact" ? "scalar" : k3::ops::cpu_isa_name(k3::ops::cpu_isa());
  check_positions(f, model.config().max_position_embeddings);
  p.mi = model_info(f, model);
  p.threads = f.threads;
  // -t is for CPU work: one host thread drives the GPU, except where the CPU cores compute the routed
  // experts (--cpu-experts: every core unless -t says otherwise).
  if (p.cuda && !f.cpu_experts)
    p.threads = {1};
  else if (p.threads.empty())
    p.threads = {par::max_threads()};
  p.build_threads = *std::max_element(p.threads.begin(), p.threads.end());

  // Every test, in run order: per depth, per thread count, pp tests then tg tests, each per batch.
  const std::vector<int64_t> batches = batch_order(f.batch);
  for (size_t di = 0; di < f.n_depth.size(); ++di)
    for (int64_t t : p.threads) {
      for (int64_t n : f.n_prompt)
        for (int64_t b : batches)
          if (n > 0) p.tests.push_back({true, n, f.n_depth[di], t, di, -1, b});
      for (int64_t n : f.n_gen)
        for (int64_t b : batches) {
          if (n <= 0) continue;
          if (!p.cuda) p.tests.push_back({false, n, f.n_depth[di], t, di, -1, b});
          if (p.cuda && f.graphs != "off") p.tests.push_back({false, n, f.n_depth[di], t, di, 1, b});
          if (p.cuda && f.graphs != "on") p.tests.push_back({false, n, f.n_depth[di], t, di, 0, b});
        }
    }

  p.cpu = cpu_name();
#ifdef K3_HAVE_CUDA
  if (p.cuda) p.gpu = k3::cuda::device_info().name;
#endif
  p.algo = "KDA " + f.kda;
  if (f.kda == "chunked") p.algo += " (chunk " + std::to_string(f.chunk) + ")";
  p.algo += ", MLA " + f.mla + ", ubatch " + std::to_string(f.ubatch);
  for (int i = 0; i < argc; ++i) p.command += std::string(i ? " " : "k3 ") + argv[i];

  // Slots: the depth context + the largest batch. Pages: the deepest context, plus the pages a run
  // adds to each sequence (runs share the context's pages copy-on-write); the pool grows if short.
  const int64_t pt = p.pool.page_tokens, max_depth = *std::max_element(f.n_depth.begin(), f.n_depth.end());
  const int64_t longest = std::max(*std::max_element(f.n_prompt.begin(), f.n_prompt.end()),
                                   *std::max_element(f.n_gen.begin(), f.n_gen.end()));
  const int64_t run_pages = std::min<int64_t>(longest, 1 << 20) / pt + 2;
  p.pool.initial_slots = 1 + f.max_batch();
  p.pool.initial_pages =
      std::clamp<int64_t>(std::min<int64_t>(max_depth, 1 << 24) / pt + 1 + f.max_batch() * run_pages, 8, 1 << 16);
  return p;
}

// ---------------------------------------------------------------- report

// Batched decode's roofline counts min(B x top_k, E) experts per MoE layer, the most a step can read;
// the profiled run (--profile) sees the union its steps' rows chose: that union per layer, and the
// roofline ratio with the step's bytes for it in place of the bound.
double profiled_union(const Result& r) { return r.profile.distinct_experts / double(r.profile.router_calls); }
double profiled_union_ratio(const Result& r) {
  const k3::DecodeTraffic& t = r.traffic;
  const double experts = t.experts_per_layer > 0 ? double(t.experts) * profiled_union(r) / t.experts_per_layer : 0.0;
  return r.roofline_ratio * (double(t.total()) - double(t.experts) + experts) / double(t.total());
}

// The op table of a profiled run: ops by time, each with calls, ms and share of the run's op time.
Json profile_json(const k3::OpProfile& p) {
  std::vector<std::pair<std::string, k3::OpProfile::Entry>> ops(p.ops.begin(), p.ops.end());
  std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  const double total = p.total_seconds();
  Json rows = Json::array();
  for (const auto& [name, e] : ops)
    rows.push_back(
        {{"op", name}, {"calls", e.calls}, {"ms", 1e3 * e.seconds}, {"share", total > 0 ? e.seconds / total : 0}});
  return {{"steps", p.steps}, {"op_ms_total", 1e3 * total}, {"ops", rows}};
}

Json result_json(const ModelInfo& mi, const Flags& f, const Result& r) {
  const bool batched = f.batched();
  Json j;
  if (r.profile.steps > 0) j["profile"] = profile_json(r.profile);
  j["model"] = mi.name;
  j["model_bytes"] = mi.bytes;
  j["n_params"] = mi.n_params;
  j["n_active_params"] = mi.n_active;
  j["threads"] = r.test.threads;
  if (f.device != "cuda") {
    j["threads_used"] = r.threads_used;
    j["adaptive_threads"] = r.adaptive_threads;
  }
  if (batched) j["n_batch"] = r.test.batch;
  j["n_prompt"] = r.test.pp ? r.test.n : 0;
  j["n_gen"] = r.test.pp ? 0 : r.test.n;
  j["n_depth"] = r.test.depth;
  if (r.test.depth > 0) j["depth_fill"] = f.depth_fill;
  j["test"] = r.test.name();
  j["samples_ns"] = r.samples_ns;
  j["avg_ts"] = r.avg_ts;
  j["stddev_ts"] = r.stddev_ts;
  if (batched) {
    j["per_seq_ts"] = r.avg_ts / double(r.test.batch);
    j["per_seq_stddev_ts"] = r.stddev_ts / double(r.test.batch);
    if (r.vs_batch1 > 0) j["aggregate_vs_batch1"] = r.vs_batch1;
  }
  j["kda"] = f.kda;
  j["mla"] = f.mla;
  j["kda_chunk"] = f.chunk;
  j["n_ubatch"] = f.ubatch;
  j["numerics"] = f.numerics;
  j["trunk_fp8"] = f.trunk_fp8;
  j["device"] = f.device;
  if (r.test.graphs >= 0) j["cuda_graphs"] = r.test.graphs == 1;
  if (r.roof > 0) {
    const char* unit = r.test.pp ? "peak_gflops" : "read_gbs";
    j["roofline"] = {{"kind", r.test.pp ? "peak_flops" : "read_bandwidth"},
                     {r.test.pp ? "weight_flops_per_token" : "bytes_per_token", r.work_per_token},
                     {unit, r.roof},
                     {"ratio", r.roofline_ratio},
                     {std::string("start_") + unit, r.start_roof},
                     {"lm_head_flops_per_logit_row", r.lm_head_flops},
                     {"logit_rows_per_run", r.logit_rows},
                     {"ratio_vs_start_probe", r.ratio_start}};
    if (!r.rep_ratios.empty()) {
      j["roofline"]["probes_around_reps"] = r.around;
      j["roofline"]["rep_ratios"] = r.rep_ratios;
    }
    if (batched && !r.test.pp) {
      const k3::DecodeTraffic& t = r.traffic;
      j["roofline"]["bytes_per_step"] = t.total();
      j["roofline"]["bytes_per_step_parts"] = {
          {"trunk", t.trunk}, {"experts", t.experts}, {"kda_state", t.kda_state}, {"mla_cache", t.mla_cache}};
      j["roofline"]["experts_per_moe_layer"] = t.experts_per_layer;
      if (r.profile.router_calls > 0) {  // the union the profiled run's steps actually read
        j["roofline"]["experts_per_moe_layer_profiled"] = profiled_union(r);
        j["roofline"]["ratio_profiled_union"] = profiled_union_ratio(r);
      }
    }
  }
  return j;
}

// A markdown table: the first column left-aligned, the others right-aligned.
struct MdTable {
  std::vector<std::string> names;
  std::vector<size_t> w;
  void add(const std::string& name, size_t width) { names.push_back(name), w.push_back(width); }
  static std::string pad(const std::string& s, size_t n, bool right) {
    // Width in characters, not bytes ("±" is two bytes of UTF-8).
    const size_t len = size_t(
        std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
    if (len >= n) return s;
    return right ? std::string(n - len, ' ') + s : s + std::string(n - len, ' ');
  }
  std::string row(const std::vector<std::string>& cells) const {
    std::string line = "|";
    for (size_t i = 0; i < cells.size(); ++i) line += " " + pad(cells[i], w[i], i != 0) + " |";
    return line + "\n";
  }
  std::string header() const {
    std::string line = row(names) + "|";
    for (size_t i = 0; i < w.size(); ++i)
      line += " " + (i == 0 ? std::string(w[i], '-') : std::string(w[i] - 1, '-') + ":") + " |";
    return line + "\n";
  }
};

void out(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

using Roofs = std::map<int64_t, k3::ops::Roofline>;  // per thread count

// The output side: the json document (printed with -o json and written to --json-out at the end),
// md rows or jsonl lines as results come, and the batch-1 results the others are compared with.
class Report {
 public:
  Report(const Flags& f, const Plan& p) : f_(f), p_(p) {
    doc_["build"] = {{"engine", "k3cpp"},
                     {"version", k3::version()},
                     {"compiler", compiler()},
                     {"cpu", p.cpu},
                     {"cpu_cores", par::hardware_threads()},
                     {"date", k3::cli::utc_now()},
                     {"command", p.command}};
    if (p.cuda) doc_["build"]["gpu"] = p.gpu;
    doc_["settings"] = {{"kda", f.kda},         {"mla", f.mla},           {"kda_chunk", f.chunk},
                        {"n_ubatch", f.ubatch}, {"numerics", f.numerics}, {"cpu_isa", p.kernel_level},
                        {"device", f.device},   {"repetitions", f.reps},  {"seed", f.seed},
                        {"warmup_runs", 1}};
    if (f.batched()) doc_["settings"]["n_batch"] = f.batch;
    doc_["settings"]["trunk_fp8"] = f.trunk_fp8;
    if (f.cpu_experts)
      doc_["settings"]["cpu_experts"] = {{"hot_experts", f.hot_experts},
                                         {"prefill_experts", f.prefill_experts},
                                         {"q8", f.cpu_experts_q8}};
    doc_["settings"]["tp"] = f.tp;
    doc_["settings"]["ep"] = f.ep;
    doc_["settings"]["processes"] = k3::process_group() ? k3::process_group()->size() : 1;
    if (f.trunk_fp8)
      doc_["settings"]["trunk_fp8_bytes"] = {
          {"matrices", p.mi.fp8.matrices}, {"before", p.mi.fp8.before}, {"after", p.mi.fp8.after}};
    doc_["results"] = Json::array();
    size_t test_w = 4;
    for (const Test& t : p.tests) test_w = std::max(test_w, t.name().size());
    table_.add("model", std::max<size_t>(p.mi.name.size(), 5));
    table_.add("size", 10);
    table_.add("params", 10);
    table_.add("threads", 7);
    if (f.batched()) table_.add("n_batch", 7);
    table_.add("test", test_w);
    table_.add("t/s", 20);
    if (f.batched()) table_.add("t/s per seq", 20), table_.add("vs n_batch=1", 12);
    if (f.roofline) table_.add("roofline", 12);
  }

  // Opened by run() before the model loads, so a bad --json-out fails fast.
  static std::unique_ptr<std::ofstream> open_json_out(const Flags& f) {
    if (f.json_out.empty()) return nullptr;
    auto file = std::make_unique<std::ofstream>(f.json_out, std::ios::binary | std::ios::trunc);
    if (!*file) throw Error("--json-out: cannot write " + f.json_out + ": " + std::strerror(errno));
    return file;
  }

  // The probes in the document, and the md header (engine, machine, settings, roofs, columns).
  void begin(const Roofs& roofs, Progress& prog) {
    if (f_.roofline) {
      Json rj = Json::array();
      std::vector<int64_t> seen;  // -t may list a count twice: one probe each
      for (int64_t t : p_.threads) {
        const auto it = roofs.find(t);
        if (it == roofs.end() || std::find(seen.begin(), seen.end(), t) != seen.end()) continue;
        seen.push_back(t);
        const k3::ops::Roofline& r = it->second;
        rj.push_back({{"threads", t},
                      {"read_gbs", r.read_gbs},
                      {"peak_gflops", r.peak_gflops},
                      {"peak_kind", r.peak_kind},
                      {"probe_bytes", r.probe_bytes}});
      }
      doc_["roofline"] = rj;
    }
    if (f_.output != "md") return;
    prog.done();
    std::string head = "k3 " + std::string(k3::version()) + " bench | " + (p_.cuda ? "GPU: " + p_.gpu + " | " : "") +
                       "CPU: " + p_.cpu + " (" + std::to_string(par::hardware_threads()) + " cores, " +
                       p_.kernel_level + " kernels) | " + p_.algo + " | numerics " + f_.numerics +
                       (f_.trunk_fp8 ? " | trunk FP8" : "") + " | " + std::to_string(f_.reps) + " reps + 1 warm-up\n";
    for (const auto& [t, r] : roofs) {
      char line[256];
      if (p_.cuda)
        std::snprintf(line, sizeof line, "roofline GPU: copy %.1f GB/s (read + write), peak %.1f GFLOP/s (%s)\n",
                      r.read_gbs, r.peak_gflops, r.peak_kind.c_str());
      else
        std::snprintf(line, sizeof line, "roofline t=%lld: read %.1f GB/s, peak %.1f GFLOP/s (%s)\n", (long long)t,
                      r.read_gbs, r.peak_gflops, r.peak_kind.c_str());
      head += line;
    }
    out(head + "\n" + table_.header());
  }

  // One finished test: compared with its batch-1 result, then printed (md / jsonl) and kept.
  void add(Result r, Progress& prog) {
    const auto key = std::make_tuple(r.test.depth_index, r.test.threads, r.test.pp, r.test.n, r.test.graphs);
    if (r.test.batch == 1) batch1_[key] = r.avg_ts;
    if (auto it = batch1_.find(key); it != batch1_.end() && it->second > 0) r.vs_batch1 = r.avg_ts / it->second;
    Json rj = result_json(p_.mi, f_, r);
    if (f_.output == "md") {
      prog.done();
      out(table_.row(md_cells(r)));
      if (r.profile.steps > 0) profiles_ += profile_md(r);
    } else if (f_.output == "jsonl") {
      prog.done();
      out(rj.dump() + "\n");
    }
    doc_["results"].push_back(std::move(rj));
  }

  // A depth context built by prefill (not a timed test, but its wall time is a long-prefill
  // measurement: -p 0 -n N -d D times a D-token prefill, then decode from it).
  // The GPU's cache of hot experts (--hot-experts) as it stood at the end of the run.
  void hot_experts(const k3::HotExpertStats& st) {
    if (st.layers == 0) return;
    doc_["expert_cache"] = {{"layers", st.layers},   {"experts", st.experts}, {"cached", st.cached},
                            {"slots", st.slots},     {"hits", st.hits},       {"hit_rate", st.hit_rate()},
                            {"bytes", st.bytes},     {"option", f_.hot_experts}};
    char line[256];
    std::snprintf(line, sizeof line,
                  "hot experts on the GPU: %lld of %lld routed experts over %lld layers (%.2f GiB); %.1f%% of %lld "
                  "decode slots hit the cache since it filled\n",
                  (long long)st.cached, (long long)st.experts, (long long)st.layers, double(st.bytes) / double(1 << 30),
                  100.0 * st.hit_rate(), (long long)st.slots);
    notes_ += line;
  }
  void depth_prefill(int64_t depth, int64_t from, double seconds) {
    const int64_t n = depth - from;
    const double tps = seconds > 0 ? double(n) / seconds : 0;
    doc_["depth_prefills"].push_back(
        {{"n_depth", depth}, {"from", from}, {"tokens", n}, {"seconds", seconds}, {"ts", tps}, {"n_ubatch", f_.ubatch}});
    char line[256];
    std::snprintf(line, sizeof line, "depth %lld: prefill of %lld tokens (--ubatch %lld, not a timed test) took %.2f s = %.2f t/s\n",
                  (long long)depth, (long long)n, (long long)f_.ubatch, seconds, tps);
    notes_ += line;
  }

  // The json document: on stdout with -o json, and into the --json-out file.
  void finish(Progress& prog, std::ofstream* json_file) {
    prog.done();
    // Memory of this process at its peak (host); on the GPU, the device's memory in use at the end
    // (cudaMemGetInfo: the CUDA context and libraries included) and the most the engine's own
    // allocations (weights, state pools, workspaces) ever held at once.
    doc_["peak_rss_bytes"] = k3::peak_rss_bytes();
#ifdef K3_HAVE_CUDA
    if (p_.cuda) {
      const k3::cuda::DeviceInfo dev = k3::cuda::device_info();
      doc_["gpu_used_bytes_at_end"] = dev.total_bytes - dev.free_bytes;
      doc_["gpu_engine_peak_bytes"] = k3::cuda::dev_bytes_peak();
      for (const auto& [what, bytes] : k3::cuda::dev_peak_breakdown()) doc_["gpu_engine_peak_by_buffer"][what] = bytes;
    }
#endif
    if (f_.output == "md" && !notes_.empty()) out("\n" + notes_);
    if (!profiles_.empty()) out(profiles_);
    const std::string text = doc_.dump(2) + "\n";
    if (f_.output == "json") out(text);
    if (json_file) {
      *json_file << text;
      json_file->flush();
      if (!*json_file) throw Error("--json-out: write failed for " + f_.json_out);
    }
  }

 private:
  std::vector<std::string> md_cells(const Result& r) const {
    const Test& t = r.test;
    auto pm = [](double v, double sd) {
      char s[64];
      std::snprintf(s, sizeof s, "%.2f ± %.2f", v, sd);
      return std::string(s);
    };
    std::string threads = std::to_string(t.threads);
    if (!p_.cuda && r.threads_used > 0 && r.threads_used < double(t.threads) - 0.05) {
      char used[32];  // the pool shrank its team: the machine was busy
      std::snprintf(used, sizeof used, " (%.2f used)", r.threads_used);
      threads += used;
    }
    std::vector<std::string> cells{p_.mi.name, human_bytes(p_.mi.bytes), human_count(p_.mi.n_params), threads};
    if (f_.batched()) cells.push_back(std::to_string(t.batch));
    cells.push_back(t.name());
    cells.push_back(pm(r.avg_ts, r.stddev_ts));
    if (f_.batched()) {
      cells.push_back(pm(r.avg_ts / double(t.batch), r.stddev_ts / double(t.batch)));
      char vs[32];
      std::snprintf(vs, sizeof vs, "%.2fx", r.vs_batch1);
      cells.push_back(r.vs_batch1 > 0 ? vs : "-");
    }
    if (f_.roofline) {
      char rl[64];
      std::snprintf(rl, sizeof rl, "%.1f%% %s", 100 * r.roofline_ratio, t.pp ? "peak" : p_.cuda ? "HBM" : "BW");
      cells.push_back(rl);
    }
    return cells;
  }

  // "profile of tg16 (t=2): 16 steps, 12.3 ms of ops" and a table of the ops by time.
  std::string profile_md(const Result& r) const {
    const Json j = profile_json(r.profile);
    char head[160];
    std::snprintf(head, sizeof head, "\nprofile of %s (t=%lld): %lld steps, %.3f ms in backend ops%s\n\n",
                  r.test.name().c_str(), (long long)r.test.threads, (long long)r.profile.steps,
                  j["op_ms_total"].get<double>(), p_.cuda ? " (device events, no graphs)" : "");
    std::string s = std::string(head) + "| op | calls | ms | share |\n|----|------:|---:|------:|\n";
    for (const Json& o : j["ops"]) {
      char line[200];
      std::snprintf(line, sizeof line, "| %s | %lld | %.3f | %.1f%% |\n", o["op"].get<std::string>().c_str(),
                    (long long)o["calls"].get<int64_t>(), o["ms"].get<double>(), 100 * o["share"].get<double>());
      s += line;
    }
    if (r.profile.router_calls > 0 && r.roof > 0 && !r.test.pp && r.test.batch > 1) {
      const double u = profiled_union(r);
      char line[320];
      std::snprintf(line, sizeof line,
                    "\nrouted experts read per MoE layer in this run: %.1f (the roofline column counts %.1f, the most "
                    "%lld sequences can select); with %.1f the %s roofline is %.1f%%\n",
                    u, r.traffic.experts_per_layer, (long long)r.test.batch, u, r.test.name().c_str(),
                    100 * profiled_union_ratio(r));
      s += line;
    }
    return s;
  }

  const Flags& f_;
  const Plan& p_;
  std::string profiles_;  // md profile tables, printed after the results table
  std::string notes_;     // md lines about the depth prefills, printed after the results table
  Json doc_;
  MdTable table_;
  std::map<std::tuple<size_t, int64_t, bool, int64_t, int>, double> batch1_;  // aggregate t/s of batch 1
};

// ---------------------------------------------------------------- measure

// GPU probes in the CPU roofline's shape: read_gbs = device copy bandwidth, peak = cuBLAS bf16.
k3::ops::Roofline gpu_roofline(uint64_t bytes) {
#ifdef K3_HAVE_CUDA
  k3::ops::Roofline r;
  r.read_gbs = k3::cuda::measure_copy_gbs(size_t(std::max<uint64_t>(bytes, uint64_t(1) << 30)));
  r.peak_gflops = 1e3 * k3::cuda::measure_bf16_gemm_tflops(8192);
  r.peak_kind = "cuBLAS bf16 GEMM 8192^3";
  r.probe_bytes = bytes;
  return r;
#else
  (void)bytes;
  throw Error("--device cuda: this k3 was built without the CUDA backend");
#endif
}

// Roofline probes, per thread count, before any test (the machine is otherwise idle then). On the
// CPU the read probe keeps its buffer (read_probes), so both probes run again around every repetition.
Roofs probe_roofs(const Flags& f, const Plan& p, Progress& prog,
                  std::map<int64_t, std::unique_ptr<k3::ops::ReadProbe>>& read_probes) {
  Roofs roofs;
  if (!f.roofline) return roofs;
  for (int64_t t : p.threads) {
    if (roofs.count(t)) continue;
    prog.say("roofline probes (t=" + std::to_string(t) + ")");
    if (p.cuda) {
      roofs[t] = gpu_roofline(uint64_t(f.roofline_mib) << 20);
    } else {
      auto& probe = read_probes[t] = std::make_unique<k3::ops::ReadProbe>(int(t), uint64_t(f.roofline_mib) << 20);
      roofs[t] = k3::ops::measure_roofline(*probe, 5);
    }
  }
  return roofs;
}

// One test at depth d (the context is in bench.base): a warm-up, -r timed repetitions with the
// probes around them, the statistics and the roofline ratio.
Result measure_test(const Flags& f, const Test& t, const k3::Model& model, Bench& bench, const Roofs& roofs,
                    const std::map<int64_t, std::unique_ptr<k3::ops::ReadProbe>>& read_probes, Progress& prog) {
  const int64_t d = t.depth, V = model.dims().vocab;
  par::set_max_threads(int(t.threads));
  // Sequence i of a batch: prompt ids [i n, (i+1) n) of the depth's prompt stream, first decode id i
  // of its first-id stream (sequence 0 gets what a batch of 1 gets).
  const std::vector<int32_t> prompts =
      t.pp ? random_ids(f.seed, uint64_t(d) * 2 + 1, t.tokens(), V) : std::vector<int32_t>{};
  const std::vector<int32_t> first = random_ids(f.seed, uint64_t(d) * 2 + 2, t.batch, V);
  const std::string label =
      t.name() + (f.batched() ? " b=" + std::to_string(t.batch) : "") + " (t=" + std::to_string(t.threads) + ")";
  prog.say(label + ": warm-up");
  bench.run_once(t, prompts, first);
  Result r;
  r.test = t;
  // The roof of this test's kind, probed again (best of 3) before the first repetition and after each one.
  const auto probe_it = read_probes.find(t.threads);
  auto probe_again = [&] {
    if (probe_it == read_probes.end()) return;
    prog.say(label + ": roofline probe");
    r.around.push_back(t.pp ? k3::ops::measure_peak_gflops(int(t.threads), 3) : probe_it->second->measure(3));
  };
  probe_again();
  par::Stats used;
  for (int64_t rep = 0; rep < f.reps; ++rep) {
    prog.say(label + ": rep " + std::to_string(rep + 1) + "/" + std::to_string(f.reps));
    par::reset_stats();
    r.samples_ns.push_back(bench.run_once(t, prompts, first));
    const par::Stats s = par::stats();
    used.loops += s.loops;
    used.team_sum += s.team_sum;
    probe_again();
  }
  r.threads_used = used.loops ? used.mean_team() : double(t.threads);
  r.adaptive_threads = par::adaptive();
  summarize(r);
  if (f.profile) {
    prog.say(label + ": profile run");
    k3::set_profile_sink(model.backend(), &r.profile);
    try {
      bench.run_once(t, prompts, first);
    } catch (...) {
      k3::set_profile_sink(model.backend(), nullptr);
      throw;
    }
    k3::set_profile_sink(model.backend(), nullptr);
  }
  if (auto it = roofs.find(t.threads); it != roofs.end()) {
    // A tg step of the batch reads the traffic of all its sequences; a pp token costs the same
    // weight FLOPs whatever the batch.
    r.traffic = k3::decode_traffic(model, d, t.pp ? 1 : t.batch);
    // A ppN run computes the logits of the last token of each --ubatch piece of each sequence only.
    const int64_t pieces = (t.n + f.ubatch - 1) / f.ubatch;
    roofline_ratios(r,
                    t.pp ? r.traffic.prefill_flops_per_token(t.n, pieces) : double(r.traffic.total()) / double(t.batch),
                    t.pp ? it->second.peak_gflops : it->second.read_gbs);
    r.lm_head_flops = r.traffic.lm_head_flops;
    r.logit_rows = t.batch * (t.pp ? pieces : t.n);
  }
  return r;
}

// Every test in plan order: the depth contexts built (untimed) as the depths come, each test measured
// and handed to the report.
void measure(const Flags& f, const Plan& p, const k3::Model& model, const Roofs& roofs,
             const std::map<int64_t, std::unique_ptr<k3::ops::ReadProbe>>& read_probes, Report& report,
             Progress& prog) {
  prog.say("loaded " + f.model + " (" + human_bytes(p.mi.bytes) + ", " + human_count(p.mi.n_params) + " params); " +
           std::to_string(p.tests.size()) + " tests");
  // Read every weight page in once, so no timed run pays for page faults of experts that the
  // warm-up happened not to route to.
  // (Not the tensors the FP8 trunk replaced: their pages were released and are never read again.)
  const auto read_progress = [&](uint64_t done, uint64_t total) {
    prog.say("reading weights " + std::to_string(done * 100 / std::max<uint64_t>(total, 1)) + "%");
  };
  if (!p.cuda && !k3::prefault_process_rank(model, read_progress))  // (one rank of a split: its part)
    model.checkpoint().prefault(read_progress, [&](std::string_view n) { return model.replaced_by_trunk_fp8(n); });
  Bench bench(model, f, p.pool);
  // Depth contexts are prefixes of one id stream: a deeper context extends the previous one
  // (so -d 0,1024,2048 prefills 2048 tokens, not 3072); a shallower one starts over.
  const std::vector<int32_t> ctx_ids =
      random_ids(f.seed, 0, *std::max_element(f.n_depth.begin(), f.n_depth.end()), model.dims().vocab);
  int64_t base_len = 0;
  size_t next = 0;
  for (size_t di = 0; di < f.n_depth.size(); ++di) {
    const int64_t d = f.n_depth[di];
    par::set_max_threads(int(p.build_threads));
    if (f.depth_fill == "random") {  // no forward: the cache and state of d tokens, seeded values
      prog.say("depth " + std::to_string(d) + ": filling the cache with random values");
      bench.pool->fill_random(bench.base, d, f.seed);
      base_len = d;
    }
    if (d < base_len) bench.reset_base(), base_len = 0;
    if (d > base_len) {
      const std::string dn = std::to_string(d);
      const int64_t from = base_len;
      prog.say("depth " + dn + ": prefill " + std::to_string(from) + "/" + dn);
      const auto t0 = std::chrono::steady_clock::now();
      bench.prefill_base(ctx_ids.data() + from, d - from, [&](int64_t done) {
        prog.say("depth " + dn + ": prefill " + std::to_string(from + done) + "/" + dn);
      });
      report.depth_prefill(d, from, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      base_len = d;
    }
    for (; next < p.tests.size() && p.tests[next].depth_index == di; ++next)
      report.add(measure_test(f, p.tests[next], model, bench, roofs, read_probes, prog), prog);
  }
}

int run(const Flags& f, int argc, char** argv) {
  check_model_dir(f.model);
  const std::unique_ptr<std::ofstream> json_file = Report::open_json_out(f);
  const std::unique_ptr<k3::Model> model = load_model(f);
  if (f.profile) {  // the timing wrapper around the backend, idle until a profile run
    k3::OpProfile none;
    model->set_op_profile(&none);
    k3::set_profile_sink(model->backend(), nullptr);
  }
  const Plan plan = make_plan(f, *model, argc, argv);
  Report report(f, plan);
  Progress prog(f.progress);
  std::map<int64_t, std::unique_ptr<k3::ops::ReadProbe>> read_probes;
  const Roofs roofs = probe_roofs(f, plan, prog, read_probes);
  report.begin(roofs, prog);
  measure(f, plan, *model, roofs, read_probes, report, prog);
  report.hot_experts(model->backend().hot_expert_stats());
  report.finish(prog, json_file.get());
  return 0;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  Flags f;
  return k3::cli::run_guarded("k3 bench", [&]() -> int {
    try {
      if (const auto code = parse_flags(argc, argv, f)) return *code;
    } catch (const Error& e) {
      k3::cli::print_error("k3 bench", std::string(e.what()) + " (see k3 bench --help)");
      return e.exit_code();
    }
    return run(f, argc, argv);
  });
}

}  // namespace k3::cli
