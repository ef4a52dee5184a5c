// CPU and disk measurements of `k3 plan --calibrate` (see calibrate.h): the engine's own kernels
// (fast numerics) on random weights in the shipped formats, cycling pools larger than the caches.
// Must not: report a rate it did not time; a buffered disk read says the page cache may inflate it.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/roofline.h"
#include "ops/ops.h"
#include "ops/synthetic_weights.h"
#include "plan/calibrate.h"
#include "plan/units.h"

namespace k3::plan {

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// K3's routed expert (spec §2.8): gate/up [3072, 3584], down [3584, 3072]; top-16 per token.
constexpr int64_t kInter = 3072, kLatent = 3584, kTopK = 16;
// K3's widest trunk projection (KDA q/k/v/g: [12288, 7168]) for the BF16 GEMV probe.
constexpr int64_t kBf16Rows = 12288, kBf16Cols = 7168;

// The measured matrices (ops/synthetic_weights.h); floats(n): n values in [-1, 1).
struct Buffers : SyntheticWeights {
  Buffers() : SyntheticWeights(20261205) {}
  std::vector<float> floats(size_t n) { return SyntheticWeights::floats(int64_t(n), 0.0f, 1.0f); }
};

uint64_t mx_bytes(const WeightMat& w) {
  return uint64_t(w.rows) * uint64_t(w.cols) / 2 + uint64_t(w.rows * w.cols / 32);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Expert {
  WeightMat gate, up, down;
};

}  // namespace

CpuCalibration measure_cpu(const CalibrateOptions& o, std::map<std::string, std::string>& src) {
  if (o.threads > 0) par::set_max_threads(o.threads);
  const int threads = par::max_threads();
  const ops::Exec ex = ops::kFast;  // the CLI's default numerics (--numerics fast)
  const auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  CpuCalibration c;
  c.threads = threads;
  c.isa = ops::cpu_isa_name(ops::cpu_isa());
  c.numerics = ops::numerics_name(ex.numerics);
  Buffers B;

  // ---- MXFP4 experts: a pool of distinct experts, top-16 of them per decode token.
  const uint64_t per_expert = 3 * mx_bytes(WeightMat{WFormat::MXFP4, kInter, kLatent, nullptr, nullptr});
  const int64_t pool_n = std::max<int64_t>(kTopK, int64_t(o.pool_bytes / per_expert));
  say("MXFP4 expert pool: " + std::to_string(pool_n) + " experts x " + human_dec_bytes(double(per_expert)) + " (" +
      std::to_string(threads) + " threads, " + c.isa + ", numerics " + c.numerics + ")");
  std::vector<Expert> pool;
  for (int64_t e = 0; e < pool_n; ++e)
    pool.push_back({B.mxfp4(kInter, kLatent), B.mxfp4(kInter, kLatent), B.mxfp4(kLatent, kInter)});
  {
    // One decode token: the CPU backend's run_token (model/backend_cpu.cpp): gate+up of the top-k
    // experts as one shared-input GEMV region, SiTU, the k downs as one matmul_many region. In the
    // CLI's fast numerics (8-bit activations), and in fp32 activations: how the hybrid placement's
    // CPU computes them unless --cpu-experts-q8 (GpuOptions::cpu_experts_q8).
    const std::vector<float> z = B.floats(size_t(kLatent));
    std::vector<float> g(size_t(kTopK * kInter)), u(size_t(kTopK * kInter)), y(size_t(kTopK * kLatent));
    std::vector<const WeightMat*> wv, dv;
    std::vector<float*> yv, oy;
    std::vector<const float*> xv;
    int64_t next = 0;
    const auto decode_rate = [&](ops::Exec ex_run, size_t* samples) {
      std::vector<double> times;
      const double t_end = now_s() + 1.5;
      for (int it = 0; it < 400 && (it < 8 || now_s() < t_end); ++it) {
        wv.clear(), yv.clear(), dv.clear(), xv.clear(), oy.clear();
        for (int64_t j = 0; j < kTopK; ++j) {
          const Expert& e = pool[size_t((next + j) % pool_n)];
          wv.push_back(&e.gate), wv.push_back(&e.up);
          yv.push_back(g.data() + j * kInter), yv.push_back(u.data() + j * kInter);
          dv.push_back(&e.down);
          xv.push_back(g.data() + j * kInter);
          oy.push_back(y.data() + j * kLatent);
        }
        next = (next + kTopK) % pool_n;
        const double t0 = now_s();
        ops::matmul_shared_input(ex_run, wv.data(), 2 * kTopK, z.data(), 1, yv.data());
        ops::situ_glu(ex_run, g.data(), u.data(), kTopK * kInter, 4.0f, 25.0f, g.data());
        ops::matmul_many(ex_run, dv.data(), xv.data(), kTopK, 1, oy.data());
        if (it > 0) times.push_back(now_s() - t0);  // the first call sizes the kernels' buffers
      }
      *samples = times.size();
      return double(kTopK * per_expert) / median(times);
    };
    size_t n = 0;
    c.expert_gemv_Bps = decode_rate(ex, &n);
    src["cpu.expert_gemv_Bps"] = "measured: median of " + std::to_string(n) +
                                 " decode tokens (16 experts each, ops::matmul_shared_input + situ_glu + "
                                 "ops::matmul_many, numerics fast) over a pool of " +
                                 std::to_string(pool_n) + " distinct experts";
    say("  expert GEMV (decode): " + human_rate(c.expert_gemv_Bps));
    c.expert_gemv_f32_Bps = decode_rate(ops::kF32, &n);
    src["cpu.expert_gemv_f32_Bps"] = "measured: as cpu.expert_gemv_Bps in numerics fp32 (fp32 activations, the "
                                     "hybrid placement's default), median of " +
                                     std::to_string(n) + " decode tokens";
    say("  expert GEMV (decode, fp32 activations): " + human_rate(c.expert_gemv_f32_Bps));
  }
  {
    // Prefill: `rows` rows per expert, whole experts spread over the threads (backend_cpu.cpp run_batch).
    const int64_t rows = 64, n = std::max<int64_t>(2 * threads, 8);
    c.expert_gemm_rows = rows;
    const std::vector<float> z = B.floats(size_t(rows * kLatent));
    const size_t ns = size_t(n);
    std::vector<std::vector<float>> g(ns), u(ns), y(ns);
    for (int64_t i = 0; i < n; ++i) {
      g[size_t(i)].resize(size_t(rows * kInter));
      u[size_t(i)].resize(size_t(rows * kInter));
      y[size_t(i)].resize(size_t(rows * kLatent));
    }
    std::vector<double> times;
    for (int rep = 0; rep < 4; ++rep) {
      const double t0 = now_s();
      par::parallel_for_each_setup(
          n, [&] { ops::reserve_matmul(rows, 2, kLatent, kLatent, false); },
          [&](int64_t i) {
            const Expert& e = pool[size_t((i + rep * n) % pool_n)];
            const WeightMat* w2[] = {&e.gate, &e.up};
            float* y2[] = {g[size_t(i)].data(), u[size_t(i)].data()};
            ops::matmul_shared_input(ex, w2, 2, z.data(), rows, y2);
            ops::situ_glu(ex, g[size_t(i)].data(), u[size_t(i)].data(), rows * kInter, 4.0f, 25.0f,
                          g[size_t(i)].data());
            ops::matmul(ex, e.down, g[size_t(i)].data(), rows, y[size_t(i)].data());
          });
      if (rep > 0) times.push_back(now_s() - t0);
    }
    const double flops = 2.0 * double(n) * double(rows) * 3.0 * double(kInter) * double(kLatent);
    c.expert_gemm_flops = flops / median(times);
    src["cpu.expert_gemm_flops"] = "measured: " + std::to_string(n) + " experts x " + std::to_string(rows) +
                                   " rows, whole experts per thread (ops::matmul_shared_input + ops::matmul), "
                                   "median of 3";
    say("  expert GEMM (prefill, 64 rows/expert): " + human_flops(c.expert_gemm_flops));
  }
  pool.clear();
  B.bufs.clear();

  // ---- BF16 GEMV over a pool of distinct [12288, 7168] matrices, and a GEMM of 256 rows.
  {
    const uint64_t mat = uint64_t(kBf16Rows * kBf16Cols * 2);
    const int64_t n = std::max<int64_t>(2, int64_t(o.pool_bytes / mat));
    std::vector<WeightMat> mats;
    for (int64_t i = 0; i < n; ++i) mats.push_back(B.bf16(kBf16Rows, kBf16Cols));
    const std::vector<float> x = B.floats(size_t(256 * kBf16Cols));
    std::vector<float> y(size_t(256 * kBf16Rows));
    std::vector<double> times;
    const double t_end = now_s() + 1.0;
    for (int it = 0; it < 200 && (it < 8 || now_s() < t_end); ++it) {
      const double t0 = now_s();
      ops::matmul(ex, mats[size_t(it % n)], x.data(), 1, y.data());
      if (it > 0) times.push_back(now_s() - t0);
    }
    c.bf16_gemv_Bps = double(mat) / median(times);
    src["cpu.bf16_gemv_Bps"] = "measured: ops::matmul of one row on [12288, 7168] BF16, median of " +
                               std::to_string(times.size()) + " over " + std::to_string(n) + " distinct matrices";
    say("  BF16 GEMV: " + human_rate(c.bf16_gemv_Bps));
    const int64_t rows = 256;
    times.clear();
    for (int rep = 0; rep < 4; ++rep) {
      const double t0 = now_s();
      ops::matmul(ex, mats[size_t(rep % n)], x.data(), rows, y.data());
      if (rep > 0) times.push_back(now_s() - t0);
    }
    c.bf16_gemm_flops = 2.0 * double(rows) * double(kBf16Rows) * double(kBf16Cols) / median(times);
    src["cpu.bf16_gemm_flops"] =
        "measured: ops::matmul of 256 rows on [12288, 7168] BF16 (fast: bf16 "
        "activations), median of 3";
    say("  BF16 GEMM (256 rows): " + human_flops(c.bf16_gemm_flops));
  }
  B.bufs.clear();

  // ---- memory: the engine's read probe, and a parallel memcpy.
  {
    const ops::ReadProbe probe(threads, o.pool_bytes);
    c.mem_read_Bps = probe.measure(5) * 1e9;
    src["cpu.mem_read_Bps"] = "measured: ops::ReadProbe (" + human_dec_bytes(double(probe.bytes())) + ", best of 5, " +
                              std::to_string(threads) + " threads)";
    const size_t n = size_t(o.pool_bytes / 2) / (1 << 20) * (1 << 20);
    std::unique_ptr<uint8_t[]> a(new uint8_t[n]), b(new uint8_t[n]);
    const int64_t chunks = int64_t(n >> 20);
    par::parallel_for_each(chunks, [&](int64_t i) {
      std::memset(a.get() + (size_t(i) << 20), int(i & 0xff), 1 << 20);
      std::memset(b.get() + (size_t(i) << 20), 0, 1 << 20);
    });
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = now_s();
      par::parallel_for_each(
          chunks, [&](int64_t i) { std::memcpy(b.get() + (size_t(i) << 20), a.get() + (size_t(i) << 20), 1 << 20); });
      best = std::min(best, now_s() - t0);
    }
    c.mem_copy_Bps = double(n) / best;
    src["cpu.mem_copy_Bps"] =
        "measured: parallel memcpy of " + human_dec_bytes(double(n)) + " (bytes copied per second, best of 5)";
    say("  memory read " + human_rate(c.mem_read_Bps) + ", copy " + human_rate(c.mem_copy_Bps));
  }
  return c;
}

DiskCalibration measure_disk(const CalibrateOptions& o, std::map<std::string, std::string>& src) {
  namespace fs = std::filesystem;
  DiskCalibration d;
  std::string dir = o.disk_dir;
  if (dir.empty()) {
    const char* t = std::getenv("TMPDIR");
    dir = t && *t ? t : "/tmp";
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("--disk-dir " + dir + " is not a directory");
  d.path = dir;
  const std::string file = (fs::path(dir) / ("k3-plan-calibrate-" + std::to_string(::getpid()) + ".bin")).string();
  constexpr size_t kChunk = size_t(4) << 20;  // 4 MiB reads, like a few experts at a time
  const size_t total = std::max<size_t>(kChunk, size_t(o.disk_bytes) / kChunk * kChunk);
  d.file_bytes = total;
  if (o.progress) o.progress("disk: writing " + human_dec_bytes(double(total)) + " to " + file);
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, kChunk) != 0) fail("disk calibration: cannot allocate a 4 MiB aligned buffer");
  std::unique_ptr<uint8_t, void (*)(void*)> buf(static_cast<uint8_t*>(raw), std::free);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < kChunk; i += 8) {
    const uint64_t r = rng();
    std::memcpy(buf.get() + i, &r, 8);
  }
  struct Remove {
    std::string f;
    ~Remove() {
      std::error_code e;
      std::filesystem::remove(f, e);
    }
  } cleanup{file};
  {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) fail("disk calibration: cannot create " + file + ": " + std::strerror(errno));
    for (size_t off = 0; off < total; off += kChunk)
      if (::pwrite(fd, buf.get(), kChunk, off_t(off)) != ssize_t(kChunk)) {
        ::close(fd);
        fail("disk calibration: write error on " + file + " (disk full?)");
      }
    ::fsync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // drop the written pages from the page cache
    ::close(fd);
  }
  struct statfs sf {};
  const bool tmpfs = ::statfs(dir.c_str(), &sf) == 0 && sf.f_type == 0x01021994;  // TMPFS_MAGIC
  int fd = ::open(file.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) {
    d.method = "O_DIRECT";
    d.note = "read with O_DIRECT (the page cache is bypassed)";
  } else {
    fd = ::open(file.c_str(), O_RDONLY);
    if (fd < 0) fail("disk calibration: cannot reopen " + file + ": " + std::strerror(errno));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    d.method = "buffered after posix_fadvise(POSIX_FADV_DONTNEED)";
    d.note =
        "O_DIRECT refused by the file system: a buffered read after dropping the file's pages; the page "
        "cache may still inflate this rate";
  }
  if (tmpfs) d.note += "; WARNING: " + dir + " is tmpfs (memory, not a disk): pass --disk-dir on the expert disk";
  const double t0 = now_s();
  for (size_t off = 0; off < total; off += kChunk) {
    const ssize_t r = ::pread(fd, buf.get(), kChunk, off_t(off));
    if (r != ssize_t(kChunk)) {
      ::close(fd);
      fail("disk calibration: read error on " + file + (r < 0 ? std::string(": ") + std::strerror(errno) : ""));
    }
  }
  const double dt = now_s() - t0;
  ::close(fd);
  d.seq_read_Bps = double(total) / dt;
  src["disk.seq_read_Bps"] = "measured: sequential 4 MiB reads of a " + human_dec_bytes(double(total)) +
                             " file written in " + dir + ", " + d.method;
  if (o.progress) o.progress("  sequential read " + human_rate(d.seq_read_Bps) + " (" + d.method + ")");
  return d;
}

}  // namespace k3::plan
