// Decode GEMVs against the read-bandwidth roofline measured in the same run: the two weight
// streams that dominate a K3 decode step, each over a working set far beyond the last-level cache.
//   trunk: BF16 matrices [rows, cols], one after another, each split across the threads
//          (ops::matmul with T = 1, as the attention and shared-expert projections run);
//   experts: MXFP4 GLU experts (gate, up [inter, latent], down [latent, inter]), top-k of a pool
//          per step, fast numerics (8-bit activations through vpdpbusd where the level has it; or
//          --numerics fp32, fp32 activations as the hybrid placement computes them):
//          the rows of all the selected experts in chunks over the threads, in two regions (as
//          moe_forward decodes), and whole experts per thread (the scheme it used before).
// Rate = weight bytes (incl. E8M0 scales) read per second; ratio = rate / probed read bandwidth.
// Usage: k3_gemv_bench [seconds per case] [--level scalar|avx2|avx512|amx] [--numerics fast|fp32]
//        (threads: OMP_NUM_THREADS)

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

double bytes_of(const k3::WeightMat& W) {
  return W.fmt == k3::WFormat::MXFP4 ? double(W.rows * W.cols) / 2 + double(W.rows * W.cols) / 32
                                     : double(W.rows * W.cols) * 2;
}

// Runs step() until min_s has passed (after one warm-up step); returns bytes per second.
template <class Fn>
double rate(double min_s, Fn&& step) {
  double b = step();
  (void)b;
  double bytes = 0;
  const auto t0 = Clock::now();
  double el = 0;
  do {
    bytes += step();
    el = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (el < min_s);
  return bytes / el;
}

}  // namespace

int main(int argc, char** argv) {
  double min_s = 2.0;
  std::string level;
  k3::ops::Exec ex = k3::ops::kFast;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--level") == 0 && i + 1 < argc)
      level = argv[++i];
    else if (std::strcmp(argv[i], "--numerics") == 0 && i + 1 < argc)
      ex = k3::ops::Exec{k3::ops::parse_numerics(argv[++i])};
    else
      min_s = std::atof(argv[i]);
  }
  if (!k3bench::select_level("k3_gemv_bench", level)) return 2;
  const int threads = k3::par::max_threads();
  const k3::ops::Roofline roof = k3::ops::measure_roofline(threads);
  std::printf("k3_gemv_bench: %d threads, level %s, %s numerics, read bandwidth %.1f GB/s\n", threads,
              k3::ops::cpu_isa_name(ex.level()), k3::ops::numerics_name(ex.numerics), roof.read_gbs);
  k3bench::Pool P;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(8192), y(8192);
  for (auto& v : x) v = u(rng);

  {  // trunk: 24 x [2048, 4096] BF16 = 384 MiB
    std::vector<k3::WeightMat> W;
    for (int i = 0; i < 24; ++i) W.push_back(P.bf16(2048, 4096));
    size_t next = 0;
    const double r = rate(min_s, [&] {
      const k3::WeightMat& w = W[next++ % W.size()];
      k3::ops::matmul(ex, w, x.data(), 1, y.data());
      return bytes_of(w);
    });
    std::printf("%-46s %8.2f GB/s %6.1f%% of read BW\n", "bf16 gemv [2048,4096], rows split", r / 1e9,
                100 * r / 1e9 / roof.read_gbs);
  }
  {  // experts: pool of 256 experts (latent 1024, inter 768), top-8 per step
    struct Glu {
      k3::WeightMat gate, up, down;
    };
    std::vector<Glu> E;
    for (int i = 0; i < 256; ++i) E.push_back({P.mxfp4(768, 1024), P.mxfp4(768, 1024), P.mxfp4(1024, 768)});
    std::vector<std::vector<float>> out(8, std::vector<float>(2048));
    std::uniform_int_distribution<int> pick(0, int(E.size()) - 1);
    const double whole = rate(min_s, [&] {  // the previous decode scheme, for comparison
      int ids[8];
      for (int& i : ids) i = pick(rng);
      double bytes = 0;
      k3::par::parallel_for_each(8, [&](int64_t i) {
        const Glu& g = E[size_t(ids[i])];
        float* o = out[size_t(i)].data();
        k3::ops::matmul(ex, g.gate, x.data(), 1, o);
        k3::ops::matmul(ex, g.up, x.data(), 1, o + 768);
        k3::ops::matmul(ex, g.down, o, 1, o + 1024);
      });
      for (int i = 0; i < 8; ++i) {
        const Glu& g = E[size_t(ids[i])];
        bytes += bytes_of(g.gate) + bytes_of(g.up) + bytes_of(g.down);
      }
      return bytes;
    });
    std::printf("%-46s %8.2f GB/s %6.1f%% of read BW\n", "mxfp4 experts top-8 of 256, whole per thread", whole / 1e9,
                100 * whole / 1e9 / roof.read_gbs);
    // As moe_forward decodes: two regions, rows in chunks, the experts drawn from `pool` (256: from
    // RAM; 2: the same two again, from the caches: the kernels' compute ceiling).
    const auto chunked = [&](int pool) {
      std::uniform_int_distribution<int> from(0, pool - 1);
      return rate(min_s, [&] {
        const k3::WeightMat* gu[16];
        const k3::WeightMat* dn[8];
        const float* dx[8];
        float* gy[16];
        float* dy[8];
        double bytes = 0;
        for (int i = 0; i < 8; ++i) {
          const Glu& g = E[size_t(from(rng))];
          float* o = out[size_t(i)].data();
          gu[2 * i] = &g.gate, gu[2 * i + 1] = &g.up, gy[2 * i] = o, gy[2 * i + 1] = o + 768;
          dn[i] = &g.down, dx[i] = o, dy[i] = o + 1024;
          bytes += bytes_of(g.gate) + bytes_of(g.up) + bytes_of(g.down);
        }
        k3::ops::matmul_shared_input(ex, gu, 16, x.data(), 1, gy);
        k3::ops::matmul_many(ex, dn, dx, 8, 1, dy);
        return bytes;
      });
    };
    const double chunks = chunked(256), cached = chunked(2);
    std::printf("%-46s %8.2f GB/s %6.1f%% of read BW\n", "mxfp4 experts top-8 of 256, rows in chunks", chunks / 1e9,
                100 * chunks / 1e9 / roof.read_gbs);
    std::printf("%-46s %8.2f GB/s (compute ceiling)\n", "mxfp4 experts top-8 of 2, in cache", cached / 1e9);
  }
  return 0;
}
