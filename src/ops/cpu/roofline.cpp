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
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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

Roofline measure_roofline(int threads, uint64_t probe_bytes, int reps) {
  Roofline r;
  r.threads = threads > 0 ? threads : omp_get_max_threads();
  const cpu::GemmKernels* K = probes();
  r.peak_kind = !K ? "fp32 scalar" : cpu_isa() == CpuIsa::Avx512 ? "bf16 vdpbf16ps" : "fp32 fma";
  const int64_t chunk = 1 << 20;  // per-thread pieces of the buffer: a multiple of 256 bytes
  probe_bytes = std::max<uint64_t>(probe_bytes / chunk * chunk, chunk * uint64_t(r.threads));
  r.probe_bytes = probe_bytes;
  std::unique_ptr<uint8_t, decltype(&std::free)> buf(static_cast<uint8_t*>(std::aligned_alloc(64, probe_bytes)), &std::free);
  if (!buf) fail("roofline probe: cannot allocate " + std::to_string(probe_bytes >> 20) + " MiB");
  const int64_t nchunks = int64_t(probe_bytes) / chunk;
#pragma omp parallel for num_threads(r.threads) schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) std::memset(buf.get() + c * chunk, int(c & 0xff), size_t(chunk));
  double sink = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now_s();
#pragma omp parallel for num_threads(r.threads) schedule(static) reduction(+ : sink)
    for (int64_t c = 0; c < nchunks; ++c)
      sink += K ? K->read_probe(buf.get() + c * chunk, chunk) : scalar_read(buf.get() + c * chunk, chunk);
    r.read_gbs = std::max(r.read_gbs, double(probe_bytes) / (now_s() - t0) / 1e9);
  }
  const int64_t iters = 20'000'000;
  for (int rep = 0; rep < reps; ++rep) {
    double flops = 0;
    const double t0 = now_s();
#pragma omp parallel num_threads(r.threads) reduction(+ : flops)
    flops += K ? K->flops_probe(iters / 4) : scalar_flops(iters / 4);
    r.peak_gflops = std::max(r.peak_gflops, flops / (now_s() - t0) / 1e9);
  }
  if (sink == -1) r.read_gbs += 0;  // keeps the sum observable
  return r;
}

}  // namespace k3::ops
