// Roofline probes (see roofline.h): the loops themselves live in the per-ISA kernel files.
#include "ops/cpu/roofline.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "ops/cpu/gemm_kernels.h"
#include "ops/cpu/isa.h"

namespace k3::ops {

namespace {
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

const cpu::GemmKernels* probes() {
#if defined(K3_HAVE_X86_KERNELS)
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
    : threads_(threads > 0 ? threads : omp_get_max_threads()), buf_(nullptr, std::free) {
  bytes_ = std::max<uint64_t>(probe_bytes / kProbeChunk * kProbeChunk, kProbeChunk * uint64_t(threads_));
  buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes_)));
  if (!buf_) fail("roofline probe: cannot allocate " + std::to_string(bytes_ >> 20) + " MiB");
  const int64_t nchunks = int64_t(bytes_) / kProbeChunk;
  uint8_t* b = buf_.get();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) std::memset(b + c * kProbeChunk, int(c & 0xff), size_t(kProbeChunk));
}

double ReadProbe::measure(int reps) const {
  const cpu::GemmKernels* K = probes();
  const int64_t nchunks = int64_t(bytes_) / kProbeChunk;
  const uint8_t* b = buf_.get();
  double sink = 0, best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now_s();
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : sink)
    for (int64_t c = 0; c < nchunks; ++c)
      sink += K ? K->read_probe(b + c * kProbeChunk, kProbeChunk) : scalar_read(b + c * kProbeChunk, kProbeChunk);
    best = std::max(best, double(bytes_) / (now_s() - t0) / 1e9);
  }
  return sink == -1 ? best + 0 : best;  // keeps the sum observable
}

const char* peak_kind() {
  const cpu::GemmKernels* K = probes();
  return !K ? "fp32 scalar" : cpu_isa() == CpuIsa::Avx512 ? "bf16 vdpbf16ps" : "fp32 fma";
}

double measure_peak_gflops(int threads, int reps) {
  const cpu::GemmKernels* K = probes();
  const int n = threads > 0 ? threads : omp_get_max_threads();
  const int64_t iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    double flops = 0;
    const double t0 = now_s();
#pragma omp parallel num_threads(n) reduction(+ : flops)
    flops += K ? K->flops_probe(iters / 4) : scalar_flops(iters / 4);
    best = std::max(best, flops / (now_s() - t0) / 1e9);
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
