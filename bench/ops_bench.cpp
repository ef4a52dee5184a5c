// Times the attention-side ops on every CPU level this machine has (scalar, avx2, avx512):
//   kda_recurrent, one decode token, H=96 and H=16 heads of 128x128 state (rate: state bytes read
//     and written, 2·H·Dk·Dv·4, per second);
//   kda_chunked, a 512-token prefill, H=16, Dk=Dv=128 (rate: recurrence-equivalent GFLOP/s,
//     6·Dk·Dv flops per token and head: prediction, write and read of the state);
//   mla_attend_absorbed, one decode token over S=4096 cached latents, 16 heads, kv_lora 512,
//     nope 128, rope 64, v 128, BF16 kv_b (rate: GFLOP/s of q̃, scores, context and W_UV, and the
//     GB/s of the latent cache + kv_b read once);
//   MLA prefill, the last 512 of 4096 tokens, absorbed vs mla_attend_tiled_paged, fp32 and fast
//     numerics, SIMD levels only.
// Usage: k3_ops_bench [min_seconds_per_case]   (threads: OMP_NUM_THREADS)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "ops/cpu/isa.h"
#include "ops/ops.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<float> rnd(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// Seconds per call: one warm-up call, then repeats until min_s has passed (at least 2 calls).
template <class Fn>
double time_per_call(double min_s, Fn&& fn) {
  fn();
  int64_t n = 0;
  const auto t0 = Clock::now();
  double el = 0;
  do {
    fn();
    ++n;
    el = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (el < min_s || n < 2);
  return el / double(n);
}

struct Kda {
  int64_t T, H, D;
  std::vector<float> q, k, v, g, beta, S, o;
  Kda(std::mt19937& rng, int64_t T_, int64_t H_, int64_t D_) : T(T_), H(H_), D(D_) {
    const size_t n = size_t(T * H * D);
    q = rnd(rng, n, -1, 1);
    k = rnd(rng, n, -1, 1);
    v = rnd(rng, n, -1, 1);
    k3::ref::l2norm_scale(q.data(), T * H, D, 1e-6f, 1.0f / std::sqrt(float(D)));
    k3::ref::l2norm_scale(k.data(), T * H, D, 1e-6f, 1.0f);
    g = rnd(rng, n, -5.0f, -0.01f);
    beta = rnd(rng, size_t(T * H), 0.1f, 0.9f);
    S = rnd(rng, size_t(H * D * D), -0.1f, 0.1f);
    o.resize(n);
  }
};

void row(const char* op, const char* level, double s, double rate, const char* unit) {
  std::printf("%-44s %-7s %12.3f ms %10.2f %s\n", op, level, s * 1e3, rate, unit);
}

}  // namespace

int main(int argc, char** argv) {
  const double min_s = argc > 1 ? std::atof(argv[1]) : 0.5;
  std::printf("k3_ops_bench: %d threads, detected level %s\n", k3::par::max_threads(),
              k3::ops::cpu_isa_name(k3::ops::cpu_isa_detected()));
  std::printf("%-44s %-7s %15s %10s\n", "op", "level", "time/call", "rate");
  std::mt19937 rng(1);
  Kda dec96(rng, 1, 96, 128), dec16(rng, 1, 16, 128), pre(rng, 512, 16, 128);
  // MLA decode case.
  const int64_t heads = 16, L = 512, nope = 128, rope = 64, vd = 128, S = 4096;
  k3::MlaAttnDims d{heads, nope, rope, vd, L, float(1.0 / std::sqrt(double(nope + rope)))};
  const auto wf = rnd(rng, size_t(heads * (nope + vd) * L), -0.05f, 0.05f);
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = k3::f32_to_bf16(wf[i]);
  const k3::WeightMat kvb{k3::WFormat::BF16, heads * (nope + vd), L, wb.data(), nullptr};
  const auto mq = rnd(rng, size_t(heads * (nope + rope)), -1, 1), mc = rnd(rng, size_t(S * L), -1, 1),
             mkr = rnd(rng, size_t(S * rope), -1, 1);
  std::vector<float> mo(size_t(heads * vd));
  // MLA prefill case: the same cache interleaved per token (c then k_r), as the state pool pages it.
  std::vector<float> pcache(size_t(S * (L + rope)));
  for (int64_t t = 0; t < S; ++t) {
    std::copy_n(mc.begin() + t * L, L, pcache.begin() + t * (L + rope));
    std::copy_n(mkr.begin() + t * rope, rope, pcache.begin() + t * (L + rope) + L);
  }
  const float* pages0 = pcache.data();
  const auto pq = rnd(rng, size_t(512 * heads * (nope + rope)), -1, 1);
  std::vector<float> po(size_t(512 * heads * vd));

  for (auto level : {k3::ops::CpuIsa::Scalar, k3::ops::CpuIsa::Avx2, k3::ops::CpuIsa::Avx512, k3::ops::CpuIsa::Amx}) {
    if (int(level) > int(k3::ops::cpu_isa_detected())) continue;
    k3::ops::set_cpu_isa(level);
    const char* ln = k3::ops::cpu_isa_name(level);
    // The scalar kernels run under exact numerics, the SIMD ones under fp32.
    const k3::ops::Exec ex{level == k3::ops::CpuIsa::Scalar ? k3::ops::Numerics::Exact : k3::ops::Numerics::F32};
    for (Kda* c : {&dec96, &dec16}) {
      const double s = time_per_call(min_s, [&] {
        k3::ops::kda_recurrent(ex, c->q.data(), c->k.data(), c->v.data(), c->g.data(), c->beta.data(), 1, c->H, c->D,
                               c->D, c->S.data(), c->o.data());
      });
      const std::string name = "kda_recurrent T=1 H=" + std::to_string(c->H) + " D=128";
      row(name.c_str(), ln, s, 2.0 * double(c->H * c->D * c->D) * 4 / s / 1e9, "GB/s (state r+w)");
    }
    {
      const double s = time_per_call(min_s, [&] {
        k3::ops::kda_chunked(ex, pre.q.data(), pre.k.data(), pre.v.data(), pre.g.data(), pre.beta.data(), pre.T, pre.H,
                             pre.D, pre.D, 64, pre.S.data(), pre.o.data());
      });
      row("kda_chunked T=512 H=16 D=128", ln, s, 6.0 * double(pre.T * pre.H * pre.D * pre.D) / s / 1e9,
          "GFLOP/s (recurrence-equiv.)");
    }
    {
      const double s = time_per_call(min_s, [&] {
        k3::ops::mla_attend_absorbed(ex, mq.data(), 1, mc.data(), mkr.data(), S, S - 1, kvb, d, mo.data());
      });
      const double flops = 2.0 * double(heads) * double(nope * L + S * (L + rope) + S * L + vd * L);
      const double bytes = double(S * (L + rope)) * 4 + double(wb.size()) * 2;
      row("mla_attend_absorbed T=1 S=4096 h=16 L=512", ln, s, flops / s / 1e9, "GFLOP/s");
      std::printf("%-44s %-7s %15s %10.2f %s\n", "", "", "", bytes / s / 1e9, "GB/s (cache + kv_b once)");
    }
    for (const k3::ops::Exec pex : {ex, k3::ops::kFast}) {
      if (level == k3::ops::CpuIsa::Scalar) break;
      const std::string nm = pex.fast() ? " fast" : " fp32";
      // Prefill piece: the last T=512 of S=4096 tokens, both forms over the same (one-page) cache.
      // Rates count each form's own multiply-adds (causal pairs only), as mla_tiled_pays does.
      const int64_t T = 512, pos0 = S - T;
      const k3::ops::LatentPages lp{&pages0, S, L + rope};
      const double vis = double(T) * double(pos0) + double(T) * double(T + 1) / 2;
      const double fa = 2.0 * heads * (double(T) * (nope + vd) * L + vis * (2 * L + rope));
      const double ft = 2.0 * heads * (double(S) * (nope + vd) * L + vis * (nope + rope + vd));
      const double sa = time_per_call(min_s, [&] {
        k3::ops::mla_attend_absorbed_paged(pex, pq.data(), T, lp, S, pos0, kvb, d, po.data());
      });
      row(("mla prefill absorbed T=512 S=4096 h=16" + nm).c_str(), ln, sa, fa / sa / 1e9, "GFLOP/s (its own FLOPs)");
      const double st = time_per_call(min_s, [&] {
        k3::ops::mla_attend_tiled_paged(pex, pq.data(), T, lp, S, pos0, kvb, d, po.data());
      });
      row(("mla prefill tiled T=512 S=4096 h=16" + nm).c_str(), ln, st, ft / st / 1e9, "GFLOP/s (its own FLOPs)");
    }
  }
  k3::ops::set_cpu_isa(k3::ops::cpu_isa_detected());
  return 0;
}
