// Implements `k3 bench` (llama-bench style): ppN / tgN throughput at several context depths, several
// thread counts, with a snapshot (Session copy) of each depth context reused by every repetition.
// Owns: its flag parsing, timing, progress on stderr, md/json/jsonl on stdout. Must not: do model
// math (it only calls Model::forward) or print anything but results to stdout; every bad input is
// one line "k3 bench: error: ..." on stderr and exit status 2.
#include "cli/cmd_bench.h"

#include <omp.h>
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
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "config/arch_stats.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "k3/version.h"
#include "model/model.h"
#include "model/traffic.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/roofline.h"
#include "runtime/memory.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace {

using Json = nlohmann::ordered_json;
using k3::Error;

const char* kHelp =
    "k3 bench: prefill (ppN) and decode (tgN) throughput, llama-bench style\n"
    "\n"
    "usage: k3 bench -m DIR [options]\n"
    "\n"
    "  -m, --model DIR        checkpoint directory (config.json + safetensors)    (required)\n"
    "  -p, --n-prompt LIST    prompt lengths: one ppN test per value (0 = none)    (default 512)\n"
    "  -n, --n-gen LIST       decode lengths: one tgN test per value (0 = none)    (default 128)\n"
    "  -d, --n-depth LIST     context depths: tokens already in the cache          (default 0)\n"
    "  -t, --threads LIST     CPU thread counts                                   (default: all cores)\n"
    "  -r, --repetitions N    timed repetitions per test, after one warm-up run   (default 5)\n"
    "  -o, --output FORMAT    md | json | jsonl                                    (default md)\n"
    "      --json-out FILE    also write the json document to FILE (any -o)\n"
    "      --kda ALGO         KDA prefill algorithm: chunked | recurrent           (default chunked)\n"
    "      --mla FORM         MLA attention form: absorbed | expanded              (default absorbed)\n"
    "      --chunk N          KDA chunk size for prefill, 1..1024                  (default 64)\n"
    "      --ubatch N         tokens per forward call when prefilling              (default 512)\n"
    "      --seed N           seed of the random token ids                         (default 1)\n"
    "      --numerics MODE    fast | fp32 | exact (see docs/performance.md)        (default fast)\n"
    "      --cpu-isa LEVEL    avx512 | avx2 | scalar kernels                       (default: best)\n"
    "      --device DEV       cpu | cuda (NVIDIA GPU; fast = bf16, fp32 = parity)  (default cpu)\n"
    "      --graphs MODE      cuda tgN: both | on | off (CUDA-graph decode steps)  (default both)\n"
    "      --no-roofline      skip the bandwidth / peak-FLOP probes and the ratio column\n"
    "      --roofline-mib N   buffer the bandwidth probe reads, >> last-level cache (default 1024)\n"
    "      --progress         progress on stderr (default)\n"
    "      --no-progress      no progress on stderr\n"
    "  -h, --help             this text\n"
    "\n"
    "LIST is comma-separated, e.g. -p 128,512 -d 0,1024. Tests: ppN for each N in -p and tgN for\n"
    "each N in -n, each at every depth in -d and every thread count in -t. A depth context is\n"
    "prefilled once from seeded random ids (a deeper one extends the previous one) and\n"
    "snapshotted; each run starts from a copy (not timed) and one warm-up run precedes -r runs.\n"
    "ppN: one prefill of N new tokens (in --ubatch pieces, last-token logits). tgN: N single-token\n"
    "decode steps, each fed the argmax of the previous step. t/s = mean ± sample stddev over -r.\n"
    "\n"
    "Roofline (per thread count, measured in the same run before the tests): streaming read\n"
    "bandwidth and the peak multiply-add rate of the widest product of the CPU level (vdpbf16ps on\n"
    "avx512). tgN: t/s x bytes one decode step reads (weights touched: trunk + top-k experts +\n"
    "lm_head, KDA state read+write, MLA cache at the depth) / bandwidth. ppN: t/s x weight FLOPs\n"
    "per token (2 x active weight parameters, the lm_head counted once per --ubatch piece, since\n"
    "only the last token's logits are computed; attention not counted) / peak. On the CPU both\n"
    "probes run again (best of 3) before the first and after every repetition: a repetition is\n"
    "divided by the larger probe on its two sides, and the column is the mean of those ratios\n"
    "(a shared machine's bandwidth moves within seconds; json has both ratios).\n"
    "With --device cuda the probes run on the GPU: device-to-device copy bandwidth (bytes read +\n"
    "written) and the cuBLAS bf16 GEMM rate (8192^3, random data); tgN runs with and without\n"
    "CUDA-graph replay of the decode step (--graphs); -t is ignored.\n";

struct Flags {
  std::string model;
  std::vector<int64_t> n_prompt{512}, n_gen{128}, n_depth{0}, threads;
  int64_t reps = 5;
  std::string output = "md", json_out;
  std::string kda = "chunked", mla = "absorbed";
  int64_t chunk = 64, ubatch = 512;
  uint64_t seed = 1;
  bool progress = true, help = false, roofline = true;
  std::string numerics = "fast", cpu_isa;
  int64_t roofline_mib = 1024;
  std::string device = "cpu", graphs = "both";
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

Flags parse_flags(int argc, char** argv) {
  Flags f;
  bool have_model = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], inline_value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0) {  // --flag=value
      const size_t eq = a.find('=');
      if (eq != std::string::npos) inline_value = a.substr(eq + 1), a = a.substr(0, eq), has_inline = true;
    }
    auto value = [&]() -> std::string {
      if (has_inline) return inline_value;
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    auto no_value = [&]() {
      if (has_inline) throw Error(a + " takes no value");
    };
    if (a == "-h" || a == "--help") no_value(), f.help = true;
    else if (a == "-m" || a == "--model") f.model = value(), have_model = true;
    else if (a == "-p" || a == "--n-prompt") f.n_prompt = parse_list(a, value(), 0, kMaxTokens);
    else if (a == "-n" || a == "--n-gen") f.n_gen = parse_list(a, value(), 0, kMaxTokens);
    else if (a == "-d" || a == "--n-depth") f.n_depth = parse_list(a, value(), 0, kMaxTokens);
    else if (a == "-t" || a == "--threads") f.threads = parse_list(a, value(), 1, 4096);
    else if (a == "-r" || a == "--repetitions") f.reps = parse_int(a, value(), 1, 1000000);
    else if (a == "-o" || a == "--output") {
      f.output = value();
      if (f.output != "md" && f.output != "json" && f.output != "jsonl")
        throw Error(a + ": unknown format '" + f.output + "' (md, json or jsonl)");
    } else if (a == "--json-out") {
      f.json_out = value();
      if (f.json_out.empty()) throw Error("--json-out: empty file name");
    } else if (a == "--kda") {
      f.kda = value();
      if (f.kda != "chunked" && f.kda != "recurrent") throw Error("--kda: unknown algorithm '" + f.kda + "' (chunked or recurrent)");
    } else if (a == "--mla") {
      f.mla = value();
      if (f.mla != "absorbed" && f.mla != "expanded") throw Error("--mla: unknown form '" + f.mla + "' (absorbed or expanded)");
    } else if (a == "--chunk") f.chunk = parse_int(a, value(), 1, 1024);
    else if (a == "--ubatch") f.ubatch = parse_int(a, value(), 1, kMaxTokens);
    else if (a == "--seed") {
      const std::string v = value();
      f.seed = uint64_t(parse_int(a, v, 0, std::numeric_limits<int64_t>::max()));
    } else if (a == "--progress") no_value(), f.progress = true;
    else if (a == "--no-progress") no_value(), f.progress = false;
    else if (a == "--no-roofline") no_value(), f.roofline = false;
    else if (a == "--roofline-mib") f.roofline_mib = parse_int(a, value(), 16, 1 << 20);
    else if (a == "--numerics") {
      f.numerics = value();
      k3::ops::parse_numerics(f.numerics);
    } else if (a == "--cpu-isa") {
      f.cpu_isa = value();
      k3::ops::parse_cpu_isa(f.cpu_isa);
    } else if (a == "--device") {
      f.device = value();
      if (f.device != "cpu" && f.device != "cuda") throw Error("--device: unknown device '" + f.device + "' (cpu or cuda)");
    } else if (a == "--graphs") {
      f.graphs = value();
      if (f.graphs != "both" && f.graphs != "on" && f.graphs != "off")
        throw Error("--graphs: unknown mode '" + f.graphs + "' (both, on or off)");
    }
    else throw Error("unknown flag '" + a + "' (see k3 bench --help)");
  }
  if (f.help) return f;
  if (!have_model || f.model.empty()) throw Error("-m/--model DIR is required");
  if (f.device == "cuda" && f.numerics == "exact")
    throw Error("--numerics exact (fp64 sums) is CPU-only; with --device cuda use fp32 (parity mode) or fast (bf16)");
  if (f.device == "cuda" && f.mla == "expanded") throw Error("--mla expanded is CPU-only; the GPU runs MLA absorbed");
  if (std::all_of(f.n_prompt.begin(), f.n_prompt.end(), [](int64_t v) { return v == 0; }) &&
      std::all_of(f.n_gen.begin(), f.n_gen.end(), [](int64_t v) { return v == 0; }))
    throw Error("nothing to run: every -p and -n value is 0");
  return f;
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

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

using k3::human_bytes;

std::string human_count(int64_t n) {
  char buf[64];
  if (n >= 1000000000) std::snprintf(buf, sizeof buf, "%.2f B", double(n) / 1e9);
  else if (n >= 1000000) std::snprintf(buf, sizeof buf, "%.2f M", double(n) / 1e6);
  else if (n >= 1000) std::snprintf(buf, sizeof buf, "%.2f K", double(n) / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld", (long long)n);
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
  std::string name() const {
    std::string s = (pp ? "pp" : "tg") + std::to_string(n);
    if (depth > 0) s += " @ d" + std::to_string(depth);
    if (graphs >= 0) s += graphs ? " graphs" : " no-graphs";
    return s;
  }
};

struct Result {
  Test test;
  std::vector<int64_t> samples_ns;
  double avg_ts = 0, stddev_ts = 0;
  // Roofline ratio (0 when not measured): tg -> bytes/token x t/s / read bandwidth; pp -> weight
  // FLOPs/token x t/s / peak. On the CPU the roof is probed again around every repetition
  // (`around`: before the first, between two, after the last); repetition i divides by the larger
  // of the probes on its two sides, and `roofline_ratio` is the mean of those ratios, `roof` the
  // mean of those roofs. `ratio_start` divides the mean t/s by the probe taken before all tests.
  double roofline_ratio = 0, work_per_token = 0, roof = 0, start_roof = 0, ratio_start = 0;
  double lm_head_flops = 0;  // per logit row; a run computes logit_rows of them
  int64_t logit_rows = 0;
  std::vector<double> around, rep_ratios;
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
    const double ts = double(r.test.n) * 1e9 / double(std::max<int64_t>(r.samples_ns[i], 1));
    r.rep_ratios.push_back(ts * work / (roof * 1e9));
    sum_ratio += r.rep_ratios.back();
    sum_roof += roof;
  }
  r.roofline_ratio = sum_ratio / double(r.samples_ns.size());
  r.roof = sum_roof / double(r.samples_ns.size());
}

void summarize(Result& r) {
  std::vector<double> ts;
  for (int64_t ns : r.samples_ns) ts.push_back(double(r.test.n) * 1e9 / double(std::max<int64_t>(ns, 1)));
  double sum = 0;
  for (double v : ts) sum += v;
  r.avg_ts = sum / double(ts.size());
  double ss = 0;
  for (double v : ts) ss += (v - r.avg_ts) * (v - r.avg_ts);
  r.stddev_ts = ts.size() > 1 ? std::sqrt(ss / double(ts.size() - 1)) : 0.0;
}

struct Bench {
  const k3::Model& model;
  const Flags& f;
  k3::ForwardOptions opt;
  std::vector<float> logits;

  Bench(const k3::Model& m, const Flags& fl) : model(m), f(fl), logits(static_cast<size_t>(m.dims().vocab)) {
    opt.kda_algo = f.kda == "recurrent" ? k3::KdaAlgo::Recurrent : k3::KdaAlgo::Chunked;
    opt.mla_algo = f.mla == "expanded" ? k3::MlaAlgo::Expanded : k3::MlaAlgo::Absorbed;
    opt.kda_chunk = f.chunk;
    opt.numerics = k3::ops::parse_numerics(f.numerics);
  }

  // Prefill `ids` in --ubatch pieces (last-token logits of each piece); `tick(done)` after each.
  template <class Tick>
  void prefill(k3::Session& s, const int32_t* ids, int64_t n, Tick tick) {
    for (int64_t off = 0; off < n; off += f.ubatch) {
      const int64_t len = std::min(f.ubatch, n - off);
      model.forward(s, ids + off, len, false, logits.data(), opt);
      tick(off + len);
    }
  }

  int64_t argmax() const {
    return int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());  // first max on ties
  }

  // One timed run of `t` starting from a copy of `base` into `s`; the copy itself is not timed.
  // (Copying into the same session keeps its GPU buffers, so a captured decode graph is reused.)
  int64_t run_once(k3::Session& s, const k3::Session& base, const Test& t, const std::vector<int32_t>& prompt,
                   int32_t first) {
    s = base;
    if (t.graphs >= 0) model.set_gpu_graphs(t.graphs == 1);
    const auto t0 = std::chrono::steady_clock::now();
    if (t.pp) {
      prefill(s, prompt.data(), int64_t(prompt.size()), [](int64_t) {});
    } else {
      int32_t tok = first;
      if (model.on_gpu()) {  // the argmax on the device, as greedy decoding does there
        k3::ForwardOptions o = opt;
        o.argmax_out = &tok;
        for (int64_t i = 0; i < t.n; ++i) model.forward(s, &tok, 1, false, nullptr, o);
      } else {
        for (int64_t i = 0; i < t.n; ++i) {
          model.forward(s, &tok, 1, false, logits.data(), opt);
          tok = int32_t(argmax());
        }
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  }
};

// ---------------------------------------------------------------- output

struct ModelInfo {
  std::string name;
  uint64_t bytes = 0;
  int64_t n_params = 0, n_active = 0;
};

Json result_json(const ModelInfo& mi, const Flags& f, const Result& r) {
  Json j;
  j["model"] = mi.name;
  j["model_bytes"] = mi.bytes;
  j["n_params"] = mi.n_params;
  j["n_active_params"] = mi.n_active;
  j["threads"] = r.test.threads;
  j["n_prompt"] = r.test.pp ? r.test.n : 0;
  j["n_gen"] = r.test.pp ? 0 : r.test.n;
  j["n_depth"] = r.test.depth;
  j["test"] = r.test.name();
  j["samples_ns"] = r.samples_ns;
  j["avg_ts"] = r.avg_ts;
  j["stddev_ts"] = r.stddev_ts;
  j["kda"] = f.kda;
  j["mla"] = f.mla;
  j["kda_chunk"] = f.chunk;
  j["n_ubatch"] = f.ubatch;
  j["numerics"] = f.numerics;
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
  }
  return j;
}

struct MdTable {
  std::vector<size_t> w;
  MdTable(size_t model_w, size_t test_w, bool roofline)
      : w{std::max<size_t>(model_w, 5), 10, 10, 7, std::max<size_t>(test_w, 4), 20} {
    if (roofline) w.push_back(12);
  }
  static std::string pad(const std::string& s, size_t n, bool right) {
    // Width in characters, not bytes ("±" is two bytes of UTF-8).
    const size_t len = size_t(std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
    if (len >= n) return s;
    return right ? std::string(n - len, ' ') + s : s + std::string(n - len, ' ');
  }
  std::string row(const std::vector<std::string>& cells) const {
    std::string line = "|";
    for (size_t i = 0; i < cells.size(); ++i) line += " " + pad(cells[i], w[i], i != 0) + " |";
    return line + "\n";
  }
  std::string header() const {
    std::vector<std::string> names{"model", "size", "params", "threads", "test", "t/s"};
    if (w.size() > names.size()) names.push_back("roofline");
    std::string line = row(names) + "|";
    for (size_t i = 0; i < w.size(); ++i) line += " " + (i == 0 ? std::string(w[i], '-') : std::string(w[i] - 1, '-') + ":") + " |";
    return line + "\n";
  }
};

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

void out(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

int run(const Flags& f, int argc, char** argv) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(f.model, ec)) throw Error("model directory '" + f.model + "' does not exist");
  if (!fs::is_directory(f.model, ec)) throw Error("model path '" + f.model + "' is not a directory");

  std::unique_ptr<std::ofstream> json_file;
  if (!f.json_out.empty()) {
    json_file = std::make_unique<std::ofstream>(f.json_out, std::ios::binary | std::ios::trunc);
    if (!*json_file) throw Error("--json-out: cannot write " + f.json_out + ": " + std::strerror(errno));
  }

  if (!f.cpu_isa.empty()) k3::ops::set_cpu_isa(k3::ops::parse_cpu_isa(f.cpu_isa));
  auto model = k3::Model::load(f.model);
  const bool cuda = f.device == "cuda";
  int64_t max_ctx = 16;
  for (int64_t d : f.n_depth) max_ctx = std::max(max_ctx, d + std::max(*std::max_element(f.n_prompt.begin(), f.n_prompt.end()),
                                                                      *std::max_element(f.n_gen.begin(), f.n_gen.end())));
  if (cuda) k3::cli::move_to_device(*model, "cuda", f.graphs != "off", f.ubatch, max_ctx, !f.progress, "k3 bench");
  // Exact numerics run the scalar kernels whatever the CPU level (ops/cpu/isa.h).
  const std::string kernel_level = f.numerics == "exact" ? "scalar" : k3::ops::cpu_isa_name(k3::ops::cpu_isa());
  const k3::ModelConfig& cfg = model->config();
  const int64_t V = model->dims().vocab, max_pos = cfg.max_position_embeddings;
  if (max_pos > 0) {
    for (int64_t d : f.n_depth) {
      for (int64_t p : f.n_prompt)
        if (p > 0 && d + p > max_pos)
          throw Error("depth " + std::to_string(d) + " + prompt " + std::to_string(p) + " = " + std::to_string(d + p) +
                      " tokens exceeds the model's max_position_embeddings " + std::to_string(max_pos));
      for (int64_t n : f.n_gen)
        if (n > 0 && d + n > max_pos)
          throw Error("depth " + std::to_string(d) + " + generated " + std::to_string(n) + " = " + std::to_string(d + n) +
                      " tokens exceeds the model's max_position_embeddings " + std::to_string(max_pos));
    }
  }

  ModelInfo mi;
  {
    std::string dir = fs::path(f.model).lexically_normal().string();
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    mi.name = fs::path(dir).filename().string();
    if (mi.name.empty() || mi.name == ".") mi.name = fs::absolute(f.model, ec).lexically_normal().parent_path().filename().string();
    if (mi.name.empty()) mi.name = "model";
  }
  mi.bytes = model->checkpoint().total_tensor_bytes();
  const k3::ArchParams ap = k3::compute_arch_params(cfg);
  mi.n_params = ap.total;
  mi.n_active = ap.active_per_token;

  std::vector<int64_t> threads = f.threads;
  if (threads.empty() || cuda) threads = {cuda ? 1 : omp_get_max_threads()};  // -t is CPU-only
  const int64_t build_threads = *std::max_element(threads.begin(), threads.end());

  // Every test, in run order: per depth, per thread count, pp tests then tg tests.
  std::vector<Test> tests;
  for (size_t di = 0; di < f.n_depth.size(); ++di)
    for (int64_t t : threads) {
      for (int64_t p : f.n_prompt)
        if (p > 0) tests.push_back({true, p, f.n_depth[di], t, di});
      for (int64_t n : f.n_gen) {
        if (n <= 0) continue;
        if (!cuda) tests.push_back({false, n, f.n_depth[di], t, di});
        if (cuda && f.graphs != "off") tests.push_back({false, n, f.n_depth[di], t, di, 1});
        if (cuda && f.graphs != "on") tests.push_back({false, n, f.n_depth[di], t, di, 0});
      }
    }

  const std::string cpu = cpu_name();
  std::string gpu;
#ifdef K3_HAVE_CUDA
  if (cuda) gpu = k3::cuda::device_info().name;
#endif
  std::string algo = "KDA " + f.kda;
  if (f.kda == "chunked") algo += " (chunk " + std::to_string(f.chunk) + ")";
  algo += ", MLA " + f.mla + ", ubatch " + std::to_string(f.ubatch);
  std::string command;
  for (int i = 0; i < argc; ++i) command += std::string(i ? " " : "k3 ") + argv[i];

  Json doc;
  doc["build"] = {{"engine", "k3cpp"},
                  {"version", k3::version()},
                  {"compiler", compiler()},
                  {"cpu", cpu},
                  {"cpu_cores", omp_get_num_procs()},
                  {"date", utc_now()},
                  {"command", command}};
  if (cuda) doc["build"]["gpu"] = gpu;
  doc["settings"] = {{"kda", f.kda}, {"mla", f.mla}, {"kda_chunk", f.chunk}, {"n_ubatch", f.ubatch},
                     {"numerics", f.numerics}, {"cpu_isa", kernel_level}, {"device", f.device},
                     {"repetitions", f.reps}, {"seed", f.seed}, {"warmup_runs", 1}};
  doc["results"] = Json::array();

  size_t test_w = 4;
  for (const Test& t : tests) test_w = std::max(test_w, t.name().size());
  const MdTable table(mi.name.size(), test_w, f.roofline);
  Progress prog(f.progress);

  // Roofline probes, per thread count, before any test (the machine is otherwise idle then). On the
  // CPU the read probe keeps its buffer, so both probes run again around every timed repetition.
  std::map<int64_t, k3::ops::Roofline> roofs;
  std::map<int64_t, std::unique_ptr<k3::ops::ReadProbe>> read_probes;
  if (f.roofline) {
    Json rj = Json::array();
    for (int64_t t : threads) {
      if (roofs.count(t)) continue;
      prog.say("roofline probes (t=" + std::to_string(t) + ")");
      k3::ops::Roofline r;
      if (cuda) {
        r = gpu_roofline(uint64_t(f.roofline_mib) << 20);
      } else {
        auto& probe = read_probes[t] = std::make_unique<k3::ops::ReadProbe>(int(t), uint64_t(f.roofline_mib) << 20);
        r = k3::ops::measure_roofline(*probe, 5);
      }
      roofs[t] = r;
      rj.push_back({{"threads", t}, {"read_gbs", r.read_gbs}, {"peak_gflops", r.peak_gflops}, {"peak_kind", r.peak_kind},
                    {"probe_bytes", r.probe_bytes}});
    }
    doc["roofline"] = rj;
  }
  if (f.output == "md") {
    prog.done();
    std::string head = "k3 " + std::string(k3::version()) + " bench | " + (cuda ? "GPU: " + gpu + " | " : "") + "CPU: " + cpu + " (" +
                       std::to_string(omp_get_num_procs()) + " cores, " + kernel_level +
                       " kernels) | " + algo + " | numerics " + f.numerics + " | " + std::to_string(f.reps) +
                       " reps + 1 warm-up\n";
    for (const auto& [t, r] : roofs) {
      char line[256];
      if (cuda)
        std::snprintf(line, sizeof line, "roofline GPU: copy %.1f GB/s (read + write), peak %.1f GFLOP/s (%s)\n",
                      r.read_gbs, r.peak_gflops, r.peak_kind.c_str());
      else
        std::snprintf(line, sizeof line, "roofline t=%lld: read %.1f GB/s, peak %.1f GFLOP/s (%s)\n", (long long)t,
                      r.read_gbs, r.peak_gflops, r.peak_kind.c_str());
      head += line;
    }
    out(head + "\n" + table.header());
  }

  prog.say("loaded " + f.model + " (" + human_bytes(mi.bytes) + ", " + human_count(mi.n_params) + " params); " +
           std::to_string(tests.size()) + " tests");
  // Read every weight page in once, so no timed run pays for page faults of experts that the
  // warm-up happened not to route to.
  if (!cuda)
    model->checkpoint().prefault([&](uint64_t done, uint64_t total) {
      prog.say("reading weights " + std::to_string(done * 100 / std::max<uint64_t>(total, 1)) + "%");
    });
  Bench bench(*model, f);
  // Depth contexts are prefixes of one id stream: a deeper context extends the previous one
  // (so -d 0,1024,2048 prefills 2048 tokens, not 3072); a shallower one starts over.
  const std::vector<int32_t> ctx_ids = random_ids(f.seed, 0, *std::max_element(f.n_depth.begin(), f.n_depth.end()), V);
  k3::Session base(*model);  // the snapshot every repetition copies
  k3::Session work(*model);  // what each repetition runs in
  int64_t base_len = 0;
  size_t next = 0;
  for (size_t di = 0; di < f.n_depth.size(); ++di) {
    const int64_t d = f.n_depth[di];
    omp_set_num_threads(int(build_threads));
    if (d < base_len) base.reset(), base_len = 0;
    if (d > base_len) {
      const std::string dn = std::to_string(d);
      const int64_t from = base_len;
      prog.say("depth " + dn + ": prefill " + std::to_string(from) + "/" + dn);
      bench.prefill(base, ctx_ids.data() + from, d - from,
                    [&](int64_t done) { prog.say("depth " + dn + ": prefill " + std::to_string(from + done) + "/" + dn); });
      base_len = d;
    }
    for (; next < tests.size() && tests[next].depth_index == di; ++next) {
      const Test& t = tests[next];
      omp_set_num_threads(int(t.threads));
      const std::vector<int32_t> prompt = t.pp ? random_ids(f.seed, uint64_t(d) * 2 + 1, t.n, V) : std::vector<int32_t>{};
      const int32_t first = random_ids(f.seed, uint64_t(d) * 2 + 2, 1, V)[0];
      const std::string label = t.name() + " (t=" + std::to_string(t.threads) + ")";
      prog.say(label + ": warm-up");
      bench.run_once(work, base, t, prompt, first);
      Result r;
      r.test = t;
      // The roof of this test's kind, probed again (best of 3) before the first repetition and
      // after each one.
      const auto probe_it = read_probes.find(t.threads);
      auto probe_again = [&] {
        if (probe_it == read_probes.end()) return;
        prog.say(label + ": roofline probe");
        r.around.push_back(t.pp ? k3::ops::measure_peak_gflops(int(t.threads), 3) : probe_it->second->measure(3));
      };
      probe_again();
      for (int64_t rep = 0; rep < f.reps; ++rep) {
        prog.say(label + ": rep " + std::to_string(rep + 1) + "/" + std::to_string(f.reps));
        r.samples_ns.push_back(bench.run_once(work, base, t, prompt, first));
        probe_again();
      }
      summarize(r);
      if (auto it = roofs.find(t.threads); it != roofs.end()) {
        const k3::DecodeTraffic tr = k3::decode_traffic(*model, d);
        // A ppN run computes the logits of the last token of each --ubatch piece only.
        const int64_t pieces = (t.n + f.ubatch - 1) / f.ubatch;
        roofline_ratios(r, t.pp ? tr.prefill_flops_per_token(t.n, pieces) : double(tr.total()),
                        t.pp ? it->second.peak_gflops : it->second.read_gbs);
        r.lm_head_flops = tr.lm_head_flops;
        r.logit_rows = t.pp ? pieces : t.n;
      }
      Json rj = result_json(mi, f, r);
      if (f.output == "md") {
        char ts[64];
        std::snprintf(ts, sizeof ts, "%.2f ± %.2f", r.avg_ts, r.stddev_ts);
        prog.done();
        std::vector<std::string> cells{mi.name, human_bytes(mi.bytes), human_count(mi.n_params), std::to_string(t.threads),
                                       t.name(), ts};
        if (f.roofline) {
          char rl[64];
          std::snprintf(rl, sizeof rl, "%.1f%% %s", 100 * r.roofline_ratio, t.pp ? "peak" : cuda ? "HBM" : "BW");
          cells.push_back(rl);
        }
        out(table.row(cells));
      } else if (f.output == "jsonl") {
        prog.done();
        out(rj.dump() + "\n");
      }
      doc["results"].push_back(std::move(rj));
    }
  }
  prog.done();
  const std::string text = doc.dump(2) + "\n";
  if (f.output == "json") out(text);
  if (json_file) {
    *json_file << text;
    json_file->flush();
    if (!*json_file) throw Error("--json-out: write failed for " + f.json_out);
  }
  return 0;
}

int fail(const std::string& msg, int code) {
  std::string m = msg;
  std::replace(m.begin(), m.end(), '\n', ' ');
  std::fprintf(stderr, "k3 bench: error: %s\n", m.c_str());
  return code;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  try {
    const Flags f = parse_flags(argc, argv);
    if (f.help) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    return run(f, argc, argv);
  } catch (const k3::Error& e) {
    return fail(e.what(), e.exit_code());
  } catch (const std::bad_alloc&) {
    return fail("out of memory", 1);
  } catch (const std::exception& e) {
    return fail(std::string("internal error: ") + e.what(), 1);
  }
}
