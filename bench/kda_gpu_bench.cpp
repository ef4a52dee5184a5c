// Our half of the side-by-side KDA benchmark (issue 19, goal 4): the CUDA KDA kernels timed at the
// shapes the peers publish (chunked prefill at B=1, D=128; varlen 8 x 1024 tokens; recurrent decode of
// 64 sequences), with CUDA events on one created stream, warm-up then median/min/max over --reps.
// tools/peer/kda_peers.py times FlashKDA and fla at the same shapes in the same device call and checks,
// on the arrays --dump writes, that they compute the same function as ours
// (scripts/measure_kda_peers.sh runs both and merges the two JSON documents).
// Must not: time anything but device work between two events (setup such as zeroing the state runs
// outside them), or change what the kernels compute (it only calls ops/cuda/cuda_ops.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/runtime.h"

namespace {

namespace cu = k3::cuda;
using Json = nlohmann::ordered_json;

constexpr int64_t kD = 128;           // Dk = Dv = 128 (the K3 head dim; FlashKDA supports only this)
constexpr float kLowerBound = -5.0f;  // K3's gate_lower_bound (ops.h kda_gate, bounded form)
constexpr float kEps = 1e-6f;         // the model's q/k L2-norm eps (model/layers.cpp)

// ---------------------------------------------------------------- inputs
// Gate distributions, both through the model's bounded gate g = lb·σ(exp(A_log[h])·(f + dt_bias[h,d])):
//   strong: f ~ N(0,1), A_log ~ U(0,1), dt_bias ~ U(0,1): FlashKDA's own benchmark inputs; g is about
//           −3 per token, so our chunked kernel cuts most chunks early (|Γ| > 80 in some channel).
//   mild:   f ~ U(−2,2), A_log = 0, dt_bias = −4.2: g in about [−0.5, −0.01], full 64-token chunks.
enum class Gate { Strong, Mild };
const char* gate_name(Gate g) { return g == Gate::Strong ? "strong" : "mild"; }

enum class Dist { Normal, Uniform01, UniformPm2 };

// Counter-based random numbers (splitmix64 of seed and index): any element is computed alone, so
// threads fill disjoint ranges and the values do not depend on the thread count.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
float draw(uint64_t seed, uint64_t i, Dist d) {
  const uint64_t h = mix64(seed * 0x100000001b3ull ^ mix64(i));
  switch (d) {
    case Dist::Normal: {  // Irwin-Hall of 4 uniforms, scaled to unit variance (close to N(0,1), bounded)
      float s = 0;
      for (int j = 0; j < 4; ++j) s += float((h >> (16 * j)) & 0xffff) * (1.0f / 65536.0f);
      return (s - 2.0f) * 1.7320508f;
    }
    case Dist::Uniform01:
      return float(h >> 40) * (1.0f / 16777216.0f);
    case Dist::UniformPm2:
      return float(h >> 40) * (4.0f / 16777216.0f) - 2.0f;
  }
  return 0;
}
// A device array of n floats from the generator, uploaded in slices (bounded host memory).
void fill_dev(float* dev, size_t n, uint64_t seed, Dist d, float scale = 1.0f, float shift = 0.0f) {
  constexpr size_t kSlice = size_t(1) << 24;
  std::vector<float> h(std::min(n, kSlice));
  for (size_t at = 0; at < n; at += kSlice) {
    const size_t m = std::min(kSlice, n - at);
    const size_t n0 = at;
    const size_t nt = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), m / 65536 + 1));
    std::vector<std::thread> th;
    for (size_t t = 0; t < nt; ++t)
      th.emplace_back([&, t] {
        for (size_t i = m * t / nt; i < m * (t + 1) / nt; ++i) h[i] = draw(seed, n0 + i, d) * scale + shift;
      });
    for (std::thread& x : th) x.join();
    cu::h2d(dev + at, h.data(), m * sizeof(float));
  }
  cu::sync();
}

// The raw inputs of one shape (what FlashKDA and fla's fused mode take) and the prepared ones our KDA
// kernels take: q ← q·D^-½/‖q‖, k ← k/‖k‖, g = kda_gate(f), β = σ(β_logit) (model/layers.cpp order).
struct KdaInputs {
  int64_t rows = 0, H = 0;
  cu::DevBuf q, k, v, f, g, beta_logit, beta, A_log, dt_bias, o;
};
KdaInputs make_inputs(int64_t rows, int64_t H, Gate gate, uint64_t seed) {
  KdaInputs x;
  x.rows = rows;
  x.H = H;
  const size_t n = size_t(rows * H * kD), nb = size_t(rows * H);
  auto buf = [](size_t floats, const char* what) { return cu::DevBuf(std::max<size_t>(floats, 1) * 4, what); };
  x.q = buf(n, "q");
  x.k = buf(n, "k");
  x.v = buf(n, "v");
  x.f = buf(n, "f");
  x.g = buf(n, "g");
  x.o = buf(n, "o");
  x.beta_logit = buf(nb, "beta_logit");
  x.beta = buf(nb, "beta");
  x.A_log = buf(size_t(H), "A_log");
  x.dt_bias = buf(size_t(H * kD), "dt_bias");
  fill_dev(x.q.as<float>(), n, seed + 1, Dist::Normal);
  fill_dev(x.k.as<float>(), n, seed + 2, Dist::Normal);
  fill_dev(x.v.as<float>(), n, seed + 3, Dist::Normal);
  fill_dev(x.beta_logit.as<float>(), nb, seed + 4, Dist::Normal);
  if (gate == Gate::Strong) {
    fill_dev(x.f.as<float>(), n, seed + 5, Dist::Normal);
    fill_dev(x.A_log.as<float>(), size_t(H), seed + 6, Dist::Uniform01);
    fill_dev(x.dt_bias.as<float>(), size_t(H * kD), seed + 7, Dist::Uniform01);
  } else {
    fill_dev(x.f.as<float>(), n, seed + 5, Dist::UniformPm2);
    fill_dev(x.A_log.as<float>(), size_t(H), seed + 6, Dist::Uniform01, 0.0f, 0.0f);
    fill_dev(x.dt_bias.as<float>(), size_t(H * kD), seed + 7, Dist::Uniform01, 0.0f, -4.2f);
  }
  return x;
}
// The model's preparation of the KDA inputs (four launches on s). q and k are normalised in place (the
// same result when repeated); β is written from β_logit, so the raw logits stay.
void prepare(KdaInputs& x, cu::Stream s) {
  const int64_t R = x.rows * x.H;
  cu::l2norm_scale(x.q.as<float>(), R, kD, kEps, float(1.0 / std::sqrt(double(kD))), s);
  cu::l2norm_scale(x.k.as<float>(), R, kD, kEps, 1.0f, s);
  cu::kda_gate(x.f.as<float>(), x.rows, x.H, kD, x.A_log.as<float>(), x.dt_bias.as<float>(), kLowerBound,
               x.g.as<float>(), s);
  cu::d2d(x.beta.get(), x.beta_logit.get(), size_t(R) * 4, s);
  cu::sigmoid_inplace(x.beta.as<float>(), R, s);
}

// Device int32 cu_rows / slots of a varlen batch.
struct Batch {
  cu::DevBuf cu_rows, slots;
  cu::VarlenDev vd;
};
Batch make_batch(const std::vector<int64_t>& lens) {
  Batch b;
  std::vector<int32_t> c{0}, sl;
  for (size_t i = 0; i < lens.size(); ++i) {
    c.push_back(int32_t(c.back() + lens[i]));
    sl.push_back(int32_t(i));
  }
  b.cu_rows = cu::DevBuf(c.size() * 4, "cu_rows");
  b.slots = cu::DevBuf(sl.size() * 4, "slots");
  cu::h2d(b.cu_rows.get(), c.data(), c.size() * 4);
  cu::h2d(b.slots.get(), sl.data(), sl.size() * 4);
  cu::sync();
  b.vd.n_seqs = int64_t(lens.size());
  b.vd.rows = c.back();
  b.vd.cu_rows = b.cu_rows.as<int32_t>();
  b.vd.slots = b.slots.as<int32_t>();
  b.vd.n_slots = int64_t(lens.size());
  return b;
}

// ---------------------------------------------------------------- timing
struct Stat {
  double med = 0, mn = 0, mx = 0;
};
// warm-up runs, then `reps` runs each between its own pair of events; `setup` runs before each run,
// outside the events (it is enqueued on the same stream, so the GPU still runs it first).
Stat time_on(cu::Stream s, int warmup, int reps, const std::function<void()>& setup,
             const std::function<void()>& body) {
  for (int i = 0; i < warmup; ++i) {
    setup();
    body();
  }
  cu::sync(s);
  cu::EventMarks marks;
  std::vector<std::pair<int64_t, int64_t>> at;
  for (int i = 0; i < reps; ++i) {
    setup();
    const int64_t a = marks.record(s);
    body();
    at.emplace_back(a, marks.record(s));
  }
  std::vector<double> ms;
  for (const auto& [a, b] : at) ms.push_back(marks.ms_between(a, b));
  std::sort(ms.begin(), ms.end());
  Stat st;
  const size_t n = ms.size();
  st.med = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  st.mn = ms.front();
  st.mx = ms.back();
  return st;
}
Json stat_json(const Stat& s, int64_t rows, double state_bytes) {
  Json j{{"ms_median", s.med}, {"ms_min", s.mn}, {"ms_max", s.mx}, {"tokens_per_s", double(rows) / (s.med * 1e-3)}};
  if (state_bytes > 0) j["state_gbs"] = state_bytes / (s.med * 1e-3) / 1e9;
  return j;
}

// Our chunked kernel ends a chunk early where the running log-decay of any channel passes 80
// (kMaxLogDecay in ops/cuda/kda.cu); the mean chunk length this gives on the first tokens of
// sequence 0, over all heads, says how much of that the gate distribution causes.
double mean_chunk_len(const KdaInputs& x, int64_t T0, int64_t chunk) {
  const int64_t T = std::min<int64_t>(T0, 1024), H = x.H;
  std::vector<float> g(size_t(T * H * kD));
  cu::d2h(g.data(), x.g.get(), g.size() * 4);
  int64_t chunks = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t0 = 0; t0 < T;) {
      const int64_t CQ = std::min<int64_t>(T - t0, chunk);
      int64_t cut = CQ;
      for (int64_t d = 0; d < kD; ++d) {
        double acc = 0;
        for (int64_t i = 0; i < CQ; ++i) {
          acc += g[size_t(((t0 + i) * H + h) * kD + d)];
          if (i > 0 && std::fabs(acc) > 80.0) {
            cut = std::min(cut, i);
            break;
          }
        }
      }
      t0 += cut;
      ++chunks;
    }
  return double(T * H) / double(chunks);
}

// ---------------------------------------------------------------- cases
struct CaseDef {
  std::string name;
  bool decode;
  int64_t T, H;  // T: tokens per sequence
  int64_t seqs;
};
std::vector<CaseDef> all_cases() {
  return {{"prefill_T8192_H96", false, 8192, 96, 1},
          {"prefill_T8192_H64", false, 8192, 64, 1},
          {"prefill_T16384_H64", false, 16384, 64, 1},
          {"prefill_T32768_H12", false, 32768, 12, 1},
          {"prefill_T131072_H12", false, 131072, 12, 1},
          {"varlen_8x1024_H96", false, 1024, 96, 8},
          {"decode_N64_H96", true, 1, 96, 64}};
}

struct Opts {
  int warmup = 3, reps = 20;
  int64_t chunk = 64;
  std::vector<Gate> gates{Gate::Strong, Gate::Mild};
};

Json run_case(const CaseDef& c, Gate gate, const Opts& op, cu::Stream s) {
  const int64_t rows = c.T * c.seqs, H = c.H;
  std::fprintf(stderr, "k3_kda_gpu_bench: %s gate=%s ...\n", c.name.c_str(), gate_name(gate));
  KdaInputs x = make_inputs(rows, H, gate, 1000 + uint64_t(rows) * 7 + uint64_t(H));
  prepare(x, s);
  cu::sync(s);
  const Batch b = make_batch(std::vector<int64_t>(size_t(c.seqs), c.T));
  const size_t state_floats = size_t(c.seqs * H * kD * kD);
  cu::DevBuf S(state_floats * 4, "S_pool");
  float *q = x.q.as<float>(), *k = x.k.as<float>(), *v = x.v.as<float>(), *g = x.g.as<float>(),
        *beta = x.beta.as<float>(), *o = x.o.as<float>(), *Sp = S.as<float>();
  auto zero_state = [&] { cu::dev_memset(Sp, 0, state_floats * 4, s); };
  auto nothing = [] {};
  auto kda = [&] {
    if (c.decode)
      cu::kda_recurrent_varlen(q, k, v, g, beta, b.vd, H, kD, kD, Sp, o, s);
    else
      cu::kda_chunked_varlen(q, k, v, g, beta, b.vd, H, kD, kD, op.chunk, Sp, o, s);
  };
  Json j{{"name", c.name},
         {"kind", c.decode ? "decode" : (c.seqs > 1 ? "varlen_prefill" : "prefill")},
         {"gate", gate_name(gate)},
         {"T", c.T},
         {"H", H},
         {"D", kD},
         {"seqs", c.seqs},
         {"rows", rows}};
  // Decode continues from a state (small random values, evolving over the reps); prefill starts
  // from zero every run, as the peers do with no initial state.
  double state_bytes = 0;
  if (c.decode) {
    fill_dev(Sp, state_floats, 77, Dist::Normal, 0.05f);
    state_bytes = 2.0 * double(state_floats) * 4;  // the whole fp32 state read once and written once
    j["state_bytes_read_written"] = state_bytes;
  }
  const std::function<void()> setup = c.decode ? std::function<void()>(nothing) : std::function<void()>(zero_state);
  Json var;
  const Stat st_kda = time_on(s, op.warmup, op.reps, setup, kda);
  var["kda"] = stat_json(st_kda, rows, state_bytes);
  var["kda"]["what"] = c.decode ? "cuda::kda_recurrent_varlen (the engine's decode call)"
                                : "cuda::kda_chunked_varlen (the engine's prefill call)";
  if (!c.decode && c.seqs == 1) {
    const Stat st = time_on(s, op.warmup, op.reps, zero_state,
                            [&] { cu::kda_chunked(q, k, v, g, beta, rows, H, kD, kD, op.chunk, Sp, o, s); });
    var["kda_single"] = stat_json(st, rows, 0);
    var["kda_single"]["what"] = "cuda::kda_chunked (one sequence, same block body)";
  }
  // The tensor-core kernel of fast numerics (bf16 operands): timed, and its output set beside the
  // fp32 kernel's on the same inputs (rel-L2; the fp32 kernel is held to the fp64 twin by the tests).
  std::function<void()> kda_tc;
  cu::DevBuf tc_work;
  if (!c.decode) {
    std::vector<int32_t> cu_host{0};
    for (int64_t i = 0; i < c.seqs; ++i) cu_host.push_back(int32_t(cu_host.back() + c.T));
    const int64_t all = cu::kda_tc_chunks(cu_host.data(), c.seqs);
    int64_t cap = all;  // at most ~2 GB of records: longer calls run in windows
    while (cap > 1 && cu::kda_tc_work_bytes(cap, H, kD) > (size_t(2) << 30)) cap = (cap + 1) / 2;
    tc_work = cu::DevBuf(cu::kda_tc_work_bytes(cap, H, kD), "kda tc workspace");
    kda_tc = [&, cu_host, cap] {
      cu::kda_chunked_tc_varlen(q, k, v, g, beta, b.vd, cu_host.data(), H, kD, kD, Sp, o, tc_work.get(), cap, s);
    };
    const size_t no = size_t(rows * H * kD);
    zero_state();
    kda();
    cu::sync(s);
    std::vector<float> o32(no), otc(no);
    cu::d2h(o32.data(), x.o.get(), no * 4);
    zero_state();
    kda_tc();
    cu::sync(s);
    cu::d2h(otc.data(), x.o.get(), no * 4);
    double num = 0, den = 0;
    for (size_t i = 0; i < no; ++i) {
      const double d = double(otc[i]) - double(o32[i]);
      num += d * d;
      den += double(o32[i]) * double(o32[i]);
    }
    const Stat st = time_on(s, op.warmup, op.reps, zero_state, kda_tc);
    var["kda_tc"] = stat_json(st, rows, 0);
    var["kda_tc"]["what"] = "cuda::kda_chunked_tc_varlen (the engine's prefill call in fast numerics: bf16 tensor cores)";
    var["kda_tc"]["windows_of_chunks"] = cap;
    var["kda_tc"]["rel_l2_vs_fp32_kernel"] = den > 0 ? std::sqrt(num / den) : 0.0;
    const Stat both = time_on(s, op.warmup, op.reps, zero_state, [&] {
      prepare(x, s);
      kda_tc();
    });
    var["prep_kda_tc"] = stat_json(both, rows, 0);
    var["prep_kda_tc"]["what"] = "prep + kda_tc: raw q, k, f, beta logits -> o on the tensor-core kernel";
  }
  const Stat st_prep = time_on(s, op.warmup, op.reps, nothing, [&] { prepare(x, s); });
  var["prep"] = stat_json(st_prep, rows, 0);
  var["prep"]["what"] =
      "l2norm_scale(q), l2norm_scale(k), kda_gate(f), beta = sigmoid(logit) (a d2d copy + sigmoid_inplace): what the "
      "peers fuse";
  const Stat st_both = time_on(s, op.warmup, op.reps, setup, [&] {
    prepare(x, s);
    kda();
  });
  var["prep_kda"] = stat_json(st_both, rows, state_bytes);
  var["prep_kda"]["what"] = "prep + kda: raw q, k, f, beta logits -> o (the scope of FlashKDA and fla's fused mode)";
  j["ms_median"] = st_kda.med;
  j["ms_min"] = st_kda.mn;
  j["ms_max"] = st_kda.mx;
  j["tokens_per_s"] = double(rows) / (st_kda.med * 1e-3);
  if (c.decode) j["state_gbs"] = state_bytes / (st_kda.med * 1e-3) / 1e9;
  cu::sync(s);
  if (!c.decode) j["mean_chunk_len_est"] = mean_chunk_len(x, c.T, op.chunk);
  j["variants"] = var;
  return j;
}

// ---------------------------------------------------------------- dump (correctness check input)
void write_f32(const std::filesystem::path& p, const std::vector<float>& a) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(a.data()), std::streamsize(a.size() * 4));
  if (!f) k3::fail("cannot write " + p.string());
}
std::vector<float> fetch(const cu::DevBuf& d, size_t floats) {
  std::vector<float> h(floats);
  cu::d2h(h.data(), d.get(), floats * 4);
  return h;
}

// One small case of each kind: prefill (one sequence of T tokens, zero state), varlen (4 sequences of
// uneven lengths summing to T, zero states) and decode (4 sequences, one token each, from a random
// state). Writes raw and prepared inputs, o and the final state as little-endian f32 files.
Json dump_case(const std::filesystem::path& dir, const std::string& tag, const std::vector<int64_t>& lens, int64_t H,
               bool decode, Gate gate, const Opts& op, cu::Stream s) {
  int64_t rows = 0;
  for (int64_t l : lens) rows += l;
  KdaInputs x = make_inputs(rows, H, gate, 4242 + uint64_t(rows) + uint64_t(H) * 31 + (decode ? 5 : 0));
  const size_t n = size_t(rows * H * kD), nb = size_t(rows * H), ns = lens.size() * size_t(H * kD * kD);
  Json files;
  auto put = [&](const std::string& name, const std::vector<float>& a) {
    const std::string fn = tag + "_" + name + ".f32";
    write_f32(dir / fn, a);
    files[name] = fn;
  };
  put("q_raw", fetch(x.q, n));
  put("k_raw", fetch(x.k, n));
  put("v", fetch(x.v, n));
  put("f", fetch(x.f, n));
  put("beta_logit", fetch(x.beta_logit, nb));
  put("A_log", fetch(x.A_log, size_t(H)));
  put("dt_bias", fetch(x.dt_bias, size_t(H * kD)));
  prepare(x, s);
  cu::sync(s);
  put("q", fetch(x.q, n));
  put("k", fetch(x.k, n));
  put("g", fetch(x.g, n));
  put("beta", fetch(x.beta, nb));
  const Batch b = make_batch(lens);
  cu::DevBuf S(ns * 4, "S_pool");
  if (decode)
    fill_dev(S.as<float>(), ns, 99, Dist::Normal, 0.05f);
  else
    cu::dev_memset(S.get(), 0, ns * 4, s);
  cu::sync(s);  // s does not wait for the legacy stream's copies (stream_create makes it non-blocking)
  put("S0", fetch(S, ns));
  if (decode)
    cu::kda_recurrent_varlen(x.q.as<float>(), x.k.as<float>(), x.v.as<float>(), x.g.as<float>(), x.beta.as<float>(),
                             b.vd, H, kD, kD, S.as<float>(), x.o.as<float>(), s);
  else
    cu::kda_chunked_varlen(x.q.as<float>(), x.k.as<float>(), x.v.as<float>(), x.g.as<float>(), x.beta.as<float>(), b.vd,
                           H, kD, kD, op.chunk, S.as<float>(), x.o.as<float>(), s);
  cu::sync(s);
  put("o", fetch(x.o, n));
  put("S", fetch(S, ns));
  Json cu_rows = Json::array({0});
  for (int64_t l : lens) cu_rows.push_back(cu_rows.back().get<int64_t>() + l);
  return {{"tag", tag},
          {"kind", decode ? "decode" : (lens.size() > 1 ? "varlen_prefill" : "prefill")},
          {"gate", gate_name(gate)},
          {"rows", rows},
          {"H", H},
          {"D", kD},
          {"seqs", int64_t(lens.size())},
          {"cu_seqlens", cu_rows},
          {"algo", decode ? "kda_recurrent_varlen" : "kda_chunked_varlen"},
          {"files", files}};
}

Json dump_all(const std::string& dir_s, int64_t T, int64_t H, const Opts& op, cu::Stream s) {
  const std::filesystem::path dir(dir_s);
  std::filesystem::create_directories(dir);
  if (T < 16) k3::fail("--dump-T must be >= 16");
  const int64_t a = T * 3 / 7, b = T / 2 - a, c = T / 4, d = T - a - b - c;
  Json cases = Json::array();
  for (const Gate g : op.gates) {
    const std::string gn = gate_name(g);
    cases.push_back(dump_case(dir, gn + "_prefill", {T}, H, false, g, op, s));
    cases.push_back(dump_case(dir, gn + "_varlen", {a, b, c, d}, H, false, g, op, s));
    cases.push_back(dump_case(dir, gn + "_decode", {1, 1, 1, 1}, H, true, g, op, s));
  }
  Json m{{"layout",
          "little-endian f32, row-major: q_raw,k_raw,q,k,f,g [rows,H,D]; v,o [rows,H,D]; beta_logit,beta [rows,H]; "
          "A_log [H]; dt_bias [H,D]; S0 (initial) and S (final) [seqs,H,Dk,Dv] (key index first)"},
         {"semantics",
          "q = q_raw*D^-1/2/sqrt(sum q_raw^2+eps), k = k_raw/sqrt(sum k_raw^2+eps), "
          "g = lower_bound*sigmoid(exp(A_log[h])*(f+dt_bias[h,d])), beta = sigmoid(beta_logit); per token "
          "S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; o = S^T q (q already scaled: kernel scale 1)"},
         {"eps", kEps},
         {"q_scale", 1.0 / std::sqrt(double(kD))},
         {"lower_bound", kLowerBound},
         {"chunk", op.chunk},
         {"cases", cases}};
  std::ofstream f(dir / "kda_dump.json");
  f << m.dump(2) << "\n";
  if (!f) k3::fail("cannot write " + (dir / "kda_dump.json").string());
  return {{"dir", dir_s}, {"cases", int64_t(cases.size())}};
}

std::vector<std::string> split(const std::string& v) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= v.size();) {
    const size_t comma = std::min(v.find(',', at), v.size());
    if (comma > at) out.push_back(v.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

int usage() {
  std::fprintf(stderr,
               "usage: k3_kda_gpu_bench [--cases all|NAME,...] [--gate strong|mild|both] [--reps N] [--warmup N]\n"
               "                        [--chunk N] [--dump DIR [--dump-T 512] [--dump-H 4]] [--dump-only]\n"
               "cases:");
  for (const CaseDef& c : all_cases()) std::fprintf(stderr, " %s", c.name.c_str());
  std::fprintf(stderr, "\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Opts op;
  std::string cases_arg = "all", dump_dir;
  int64_t dump_T = 512, dump_H = 4;
  bool dump_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "k3_kda_gpu_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--cases")
        cases_arg = next();
      else if (a == "--reps")
        op.reps = std::stoi(next());
      else if (a == "--warmup")
        op.warmup = std::stoi(next());
      else if (a == "--chunk")
        op.chunk = std::stoll(next());
      else if (a == "--gate") {
        const std::string v = next();
        if (v == "strong")
          op.gates = {Gate::Strong};
        else if (v == "mild")
          op.gates = {Gate::Mild};
        else if (v == "both")
          op.gates = {Gate::Strong, Gate::Mild};
        else
          return usage();
      } else if (a == "--dump")
        dump_dir = next();
      else if (a == "--dump-T")
        dump_T = std::stoll(next());
      else if (a == "--dump-H")
        dump_H = std::stoll(next());
      else if (a == "--dump-only")
        dump_only = true;
      else
        return usage();
    } catch (const std::logic_error&) {
      std::fprintf(stderr, "k3_kda_gpu_bench: %s needs a number\n", a.c_str());
      return 2;
    }
  }
  if (op.reps < 1 || op.warmup < 0 || op.chunk < 1 || dump_H < 1) return usage();
  std::vector<CaseDef> cases;
  if (cases_arg == "all") {
    cases = all_cases();
  } else {
    for (const std::string& nm : split(cases_arg)) {
      bool found = false;
      for (const CaseDef& c : all_cases())
        if (c.name == nm) {
          cases.push_back(c);
          found = true;
        }
      if (!found) {
        std::fprintf(stderr, "k3_kda_gpu_bench: unknown case '%s'\n", nm.c_str());
        return usage();
      }
    }
  }
  if (cu::device_count() < 1) {
    std::fprintf(stderr, "k3_kda_gpu_bench: no CUDA device: %s\n", cu::unavailable_reason().c_str());
    return 3;
  }
  try {
    const cu::DeviceInfo dev = cu::device_info();
    cu::Stream s = cu::stream_create();
    Json j{
        {"tool", "k3_kda_gpu_bench"},
        {"gpu", dev.name},
        {"sm", std::to_string(dev.sm_major) + "." + std::to_string(dev.sm_minor)},
        {"multiprocessors", dev.multiprocessors},
        {"D", kD},
        {"chunk", op.chunk},
        {"lower_bound", kLowerBound},
        {"warmup", op.warmup},
        {"reps", op.reps},
        {"timing",
         "CUDA events around each run on one created stream; median/min/max over reps after warm-up; "
         "state zeroing (prefill) and other setup outside the events"},
        {"gates",
         {{"strong", "f~N(0,1), A_log~U(0,1), dt_bias~U(0,1) (FlashKDA's benchmark inputs), g=-5*sigmoid(...)"},
          {"mild", "f~U(-2,2), A_log=0, dt_bias=-4.2: g in about [-0.5,-0.01]"}}},
        {"inputs", "q,k,v,beta_logit ~ N(0,1) (Irwin-Hall approximation), q,k then L2-normalised as the model does"}};
    if (!dump_dir.empty()) j["dump"] = dump_all(dump_dir, dump_T, dump_H, op, s);
    Json rows = Json::array();
    if (!dump_only)
      for (const CaseDef& c : cases)
        for (const Gate g : op.gates) rows.push_back(run_case(c, g, op, s));
    j["cases"] = rows;
    cu::stream_destroy(s);
    std::printf("%s\n", j.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3_kda_gpu_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
