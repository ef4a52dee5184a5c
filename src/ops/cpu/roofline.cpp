// Roofline probes (see roofline.h): the loops themselves live in the per-ISA kernel files.
#include "ops/cpu/roofline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/gemm_kernels.h"
#include "ops/cpu/isa.h"

namespace k3::ops {

namespace {
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

const cpu::GemmKernels* probes() {
#if defined(K3_HAVE_X86_KERNELS)
  if (cpu_isa() == CpuIsa::Amx) return &cpu::avx512::kGemmAmx;
  if (cpu_isa() == CpuIsa::Avx512) return &cpu::avx512::kGemm;
  if (cpu_isa() == CpuIsa::Avx2) return &cpu::avx2::kGemm;
#endif
  return nullptr;
}

double scalar_read(const uint8_t* p, int64_t n) {
  uint64_t s = 0;  // unsigned: wraps by definition
  for (int64_t i = 0; i < n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    s += v;
  }
  return double(s >> 11);
}

double scalar_flops(int64_t iters) {
  float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int64_t it = 0; it < iters; ++it)
    for (float& x : a) x = x * 0.999f + 0.001f;
  return double(iters) * 8 * 2 + (a[0] == 12345.0f ? 1 : 0);
}
}  // namespace

constexpr int64_t kProbeChunk = 1 << 20;  // per-thread pieces of the buffer: a multiple of 256 bytes

ReadProbe::ReadProbe(int threads, uint64_t probe_bytes)
    : threads_(threads > 0 ? threads : par::max_threads()), buf_(nullptr, std::free) {
  bytes_ = std::max<uint64_t>(probe_bytes / kProbeChunk * kProbeChunk, kProbeChunk * uint64_t(threads_));
  buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes_)));
  if (!buf_) fail("roofline probe: cannot allocate " + std::to_string(bytes_ >> 20) + " MiB");
  const int64_t nchunks = int64_t(bytes_) / kProbeChunk;
  uint8_t* b = buf_.get();
  const par::FixedThreads fixed(threads_);
  par::parallel_for_each(nchunks,
                         [&](int64_t c) { std::memset(b + c * kProbeChunk, int(c & 0xff), size_t(kProbeChunk)); });
}

double ReadProbe::measure(int reps) const {
  const cpu::GemmKernels* K = probes();
  const int64_t nchunks = int64_t(bytes_) / kProbeChunk;
  const uint8_t* b = buf_.get();
  const par::FixedThreads fixed(threads_);
  std::vector<double> sums(static_cast<size_t>(nchunks));
  double sink = 0, best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now_s();
    par::parallel_for_each(nchunks, [&](int64_t c) {
      sums[size_t(c)] =
          K ? K->read_probe(b + c * kProbeChunk, kProbeChunk) : scalar_read(b + c * kProbeChunk, kProbeChunk);
    });
    best = std::max(best, double(bytes_) / (now_s() - t0) / 1e9);
    for (double v : sums) sink += v;
  }
  return sink == -1 ? best + 0 : best;  // keeps the sums observable
}

const char* peak_kind() {
  const cpu::GemmKernels* K = probes();
  if (!K) return "fp32 scalar";
  if (cpu_isa() == CpuIsa::Amx) return "bf16 amx tiles";
  return cpu_isa() == CpuIsa::Avx512 ? "bf16 vdpbf16ps" : "fp32 fma";
}

double measure_peak_gflops(int threads, int reps) {
  const cpu::GemmKernels* K = probes();
  const int n = threads > 0 ? threads : par::max_threads();
  const par::FixedThreads fixed(n);
  const int64_t iters = 20'000'000;
  std::vector<double> flops(static_cast<size_t>(n));
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now_s();
    // One probe per thread (each takes milliseconds, so every worker is awake to claim one).
    par::parallel_for_each(
        n, [&](int64_t i) { flops[size_t(i)] = K ? K->flops_probe(iters / 4) : scalar_flops(iters / 4); });
    double sum = 0;
    for (double f : flops) sum += f;
    best = std::max(best, sum / (now_s() - t0) / 1e9);
  }
  return best;
}

Roofline measure_roofline(int threads, uint64_t probe_bytes, int reps) {
  return measure_roofline(ReadProbe(threads, probe_bytes), reps);
}

Roofline measure_roofline(const ReadProbe& probe, int reps) {
  Roofline r;
  r.threads = probe.threads();
  r.probe_bytes = probe.bytes();
  r.read_gbs = probe.measure(reps);
  r.peak_gflops = measure_peak_gflops(r.threads, reps);
  r.peak_kind = peak_kind();
  return r;
}

}  // namespace k3::ops
