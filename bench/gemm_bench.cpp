// Prefill GEMMs against the peak multiply-add rate probed in the same run: the weight products of a
// prefill chunk in fast numerics (activations rounded to bf16, vdpbf16ps on avx512), at the shapes
// of the generated K3-shaped cpu-bench checkpoint: BF16 trunk matrices over a 128-token chunk, and
// MXFP4 routed experts over the ~16 tokens a 128-token chunk gives each of 64 experts (top-8).
// Rate = 2 x rows x cols x T / second; ratio = rate / probed peak.
// Usage: k3_gemm_bench [seconds per case] [--level scalar|avx2|avx512|amx] [--case I]   (threads: OMP_NUM_THREADS)

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/roofline.h"
#include "ops/ops.h"
#include "weight_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  double min_s = 1.0;
  std::string level;
  int only = -1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--level") == 0 && i + 1 < argc)
      level = argv[++i];
    else if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc)
      only = std::atoi(argv[++i]);
    else
      min_s = std::atof(argv[i]);
  }
  if (!k3bench::select_level("k3_gemm_bench", level)) return 2;
  const int threads = k3::par::max_threads();
  const double peak = k3::ops::measure_peak_gflops(threads, 5);
  std::printf("k3_gemm_bench: %d threads, level %s, fast numerics, peak %.1f GFLOP/s (%s)\n", threads,
              k3::ops::cpu_isa_name(k3::ops::kFast.level()), peak, k3::ops::peak_kind());
  k3bench::Pool P;
  struct Case {
    bool mx;
    int64_t rows, cols, T;
  };
  const std::vector<Case> cases = {{false, 2048, 2048, 128}, {false, 4096, 2048, 128}, {false, 2048, 4096, 128},
                                   {false, 2048, 2048, 512}, {true, 768, 1024, 16},    {true, 1024, 768, 16},
                                   {true, 768, 1024, 7},     {true, 768, 1024, 64}};
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    if (only >= 0 && size_t(only) != ci) continue;
    const Case& c = cases[ci];
    // "cached": one matrix, in the caches after the first call; "from RAM": a pool of distinct
    // matrices of >= 512 MiB taken in turn, as a prefill meets its weights.
    const double mbytes = c.mx ? double(c.rows * c.cols) * (0.5 + 1.0 / 32) : double(c.rows * c.cols) * 2;
    const auto pool_n = int64_t((512.0 * (1 << 20)) / mbytes) + 1;
    std::vector<k3::WeightMat> pool;
    for (int64_t i = 0; i < pool_n; ++i) pool.push_back(c.mx ? P.mxfp4(c.rows, c.cols) : P.bf16(c.rows, c.cols));
    std::vector<float> X(size_t(c.T * c.cols)), Y(size_t(c.T * c.rows));
    for (auto& v : X) v = u(rng);
    for (int cold = 0; cold < 2; ++cold) {
      k3::ops::matmul(k3::ops::kFast, pool[0], X.data(), c.T, Y.data());  // warm-up
      int64_t n = 0;
      const auto t0 = Clock::now();
      double el = 0;
      do {
        k3::ops::matmul(k3::ops::kFast, pool[size_t(cold ? n % pool_n : 0)], X.data(), c.T, Y.data());
        ++n;
        el = std::chrono::duration<double>(Clock::now() - t0).count();
      } while (el < min_s);
      const double gf = 2.0 * double(c.rows * c.cols * c.T) * double(n) / el / 1e9;
      char name[96];
      std::snprintf(name, sizeof name, "%s [%lld,%lld] T=%lld %s", c.mx ? "mxfp4" : "bf16", (long long)c.rows,
                    (long long)c.cols, (long long)c.T, cold ? "from RAM" : "cached");
      std::printf("%-36s %8.1f GFLOP/s %6.1f%% of peak\n", name, gf, 100 * gf / peak);
    }
    P.bufs.clear();
  }
  return 0;
}
