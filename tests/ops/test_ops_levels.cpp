// The KDA, MLA, norm and elementwise ops of ops.h on every CPU level this machine has (scalar,
// avx2, avx512; a level the CPU lacks is skipped with a message) against their fp64 twins in
// k3::ref, on seeded random non-zero inputs with NaN-prefilled outputs: odd shapes (vector and
// tile tails), the true K3 shapes where the twin is affordable, state carried across calls, the
// chunked-KDA chunk cut under strong decay, MLA key splits and token blocks, and results that do
// not depend on the OpenMP thread count.
// Owns: the tolerances below (the twin-test tolerances of test_ops_twins.cpp, held on every level).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_levels.h"
#include "common/kda_inputs.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/attn_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/ops.h"

namespace {

using k3::ops::CpuIsa;
using k3test::count_nan;
using k3test::nan_vec;
using k3test::rand_vec;
using k3test::rel_l2;

// Tolerances: tests/common/op_tolerances.h (the same bounds on every level), plus:
using k3test::kTolConv;
using k3test::kTolElementwise;
using k3test::kTolKda;
using k3test::kTolMla;
using k3test::kTolReduce;
// The vectorised exp (Cody-Waite + degree-6 polynomial): max relative error per value, ≈ 2 ulp.
constexpr double kTolExpRel = 2.5e-7;

// Sets the level under test (skipping levels this CPU lacks) and restores the default after. Every
// op runs in F32 numerics (kF32: Exact would run the scalar kernels on every level).
class OpsLevels : public k3test::CpuLevelTest {};

// Runs fn once per thread count of the pool and expects bit-identical outputs (fn returns them).
template <class Fn>
void expect_thread_independent(Fn&& fn) {
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 3}) {
    const k3::par::FixedThreads fixed(threads);
    outs.push_back(fn());
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    ASSERT_EQ(outs[i].size(), outs[0].size());
    EXPECT_EQ(std::memcmp(outs[i].data(), outs[0].data(), outs[0].size() * 4), 0) << "thread count run " << i;
  }
}

// ================================================================ vector exp
TEST_P(OpsLevels, VectorExpAccuracy) {
  const k3::ops::cpu::AttnKernels* kern = k3::ops::cpu::attn_kernels(k3::ops::kF32);
  if (GetParam() == CpuIsa::Scalar) {
    EXPECT_EQ(kern, nullptr);
    GTEST_SKIP() << "the scalar level has no vector exp (it calls libm)";
  }
  ASSERT_NE(kern, nullptr);
  std::vector<float> x;
  for (double v = -87.0; v <= 88.0; v += 0.0137) x.push_back(float(v));
  for (float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 0.34657359f, -0.34657359f, -80.0f, -5.0f, 1.0f}) x.push_back(v);
  auto y = nan_vec(x.size());
  kern->exp_n(x.data(), int64_t(x.size()), y.data());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = std::exp(double(x[i]));
    worst = std::max(worst, std::fabs(double(y[i]) - e) / e);
  }
  EXPECT_LT(worst, kTolExpRel);
  // Far below the range: exactly 0 (probabilities and decays vanish, no NaN or denormal garbage).
  const float lo[3] = {-100.0f, -1000.0f, -std::numeric_limits<float>::infinity()};
  float ylo[3];
  kern->exp_n(lo, 3, ylo);
  for (float v : ylo) EXPECT_EQ(v, 0.0f);
  // NaN stays NaN (a NaN activation must not be laundered into a finite decay or probability).
  const float nan_in = k3test::qnan();
  float nan_out = 0;
  kern->exp_n(&nan_in, 1, &nan_out);
  EXPECT_TRUE(std::isnan(nan_out));
  float g = nan_in, u = 1.0f, s = 0;
  k3::ops::situ_glu(k3::ops::kF32, &g, &u, 1, 4.0f, 25.0f, &s);
  EXPECT_TRUE(std::isnan(s));
}

// The weight decode the absorbed MLA uses (F32/F16/BF16 rows widened in the vector kernels): exact,
// every column including vector tails, from unaligned data as in an mmap'd shard.
TEST_P(OpsLevels, WidenRowsIsExact) {
  const k3::ops::cpu::AttnKernels* kern = k3::ops::cpu::attn_kernels(k3::ops::kF32);
  if (!kern) GTEST_SKIP() << "the scalar level decodes with dequant_row";
  std::mt19937 rng(100);
  for (k3::WFormat fmt : {k3::WFormat::F32, k3::WFormat::F16, k3::WFormat::BF16}) {
    for (int64_t cols : {1, 7, 8, 16, 37, 300}) {
      SCOPED_TRACE(std::string(k3::wformat_name(fmt)) + " cols=" + std::to_string(cols));
      const int64_t rows = 5, esz = fmt == k3::WFormat::F32 ? 4 : 2;
      k3test::OwnedW W = k3test::make_weight(rng, fmt, rows, cols);
      std::vector<uint8_t> bytes(size_t(rows * cols * esz) + 1);
      std::memcpy(bytes.data() + 1, W.w.data, bytes.size() - 1);
      const int code = fmt == k3::WFormat::F32 ? 0 : fmt == k3::WFormat::F16 ? 1 : 2;
      auto out = nan_vec(size_t(3 * cols));
      kern->widen_rows(bytes.data() + 1, code, cols, 1, 3, out.data());
      for (int64_t r = 0; r < 3; ++r)
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(out[size_t(r * cols + c)], W.w.at(1 + r, c)) << r << "," << c;
    }
  }
}

// ================================================================ norms and elementwise
TEST_P(OpsLevels, Rmsnorm) {
  std::mt19937 rng(101);
  for (auto [T, n] : {std::pair<int64_t, int64_t>{1, 7}, {3, 128}, {5, 333}, {2, 7168}, {40, 512}, {1, 17}}) {
    for (bool with_w : {false, true}) {
      SCOPED_TRACE("T=" + std::to_string(T) + " n=" + std::to_string(n) + " w=" + std::to_string(with_w));
      const auto x = rand_vec(rng, size_t(T * n), 0.05f, 3.0f);
      const auto w = rand_vec(rng, size_t(n), 0.5f, 1.5f);
      auto a = nan_vec(size_t(T * n)), b = nan_vec(size_t(T * n));
      k3::ops::rmsnorm(k3::ops::kF32, x.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, a.data());
      k3::ref::rmsnorm(x.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, b.data());
      ASSERT_EQ(count_nan(a), 0u);
      EXPECT_LT(rel_l2(a, b), kTolElementwise);
      auto inplace = x;  // the model normalises in place (o_norm, q_a_norm)
      k3::ops::rmsnorm(k3::ops::kF32, inplace.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, inplace.data());
      EXPECT_EQ(inplace, a);
    }
  }
}

TEST_P(OpsLevels, L2normScale) {
  std::mt19937 rng(102);
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 16}, {7, 13}, {12, 128}, {96 * 3, 128}, {5, 33}}) {
    SCOPED_TRACE("rows=" + std::to_string(rows) + " n=" + std::to_string(n));
    const auto x = rand_vec(rng, size_t(rows * n), 0.05f, 2.0f);
    auto a = x, b = x;
    const float scale = 1.0f / std::sqrt(float(n));
    k3::ops::l2norm_scale(k3::ops::kF32, a.data(), rows, n, 1e-6f, scale);
    k3::ref::l2norm_scale(b.data(), rows, n, 1e-6f, scale);
    EXPECT_LT(rel_l2(a, b), kTolElementwise);
  }
}

TEST_P(OpsLevels, SituGlu) {
  std::mt19937 rng(103);
  for (int64_t n : {1, 17, 1000, 70001}) {
    for (float hi : {60.0f, 0.5f}) {  // soft caps saturated / the small-argument tanh branch
      SCOPED_TRACE("n=" + std::to_string(n) + " hi=" + std::to_string(hi));
      const auto g = rand_vec(rng, size_t(n), 0.001f, hi), u = rand_vec(rng, size_t(n), 0.001f, hi);
      auto a = nan_vec(size_t(n)), b = nan_vec(size_t(n));
      k3::ops::situ_glu(k3::ops::kF32, g.data(), u.data(), n, 4.0f, 25.0f, a.data());
      k3::ref::situ_glu(g.data(), u.data(), n, 4.0f, 25.0f, b.data());
      ASSERT_EQ(count_nan(a), 0u);
      EXPECT_LT(rel_l2(a, b), kTolElementwise);
      // Elementwise as well: no value far off (a wrong branch would show on a few elements only).
      EXPECT_TRUE(k3test::all_close(a, b, 1e-30, 1e-5));
    }
  }
}

TEST_P(OpsLevels, KdaGate) {
  std::mt19937 rng(104);
  for (auto [T, H, D] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 1, 5}, {3, 4, 16}, {7, 3, 33}, {2, 96, 128}, {9, 16, 128}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D));
    const auto f = rand_vec(rng, size_t(T * H * D), 0.01f, 8.0f);
    const auto A_log = rand_vec(rng, size_t(H), 0.05f, 1.0f);
    const auto dt = rand_vec(rng, size_t(H * D), 0.05f, 1.0f);
    auto a = nan_vec(f.size()), b = nan_vec(f.size());
    k3::ops::kda_gate(k3::ops::kF32, f.data(), T, H, D, A_log.data(), dt.data(), -5.0f, a.data());
    k3::ref::kda_gate(f.data(), T, H, D, A_log.data(), dt.data(), -5.0f, b.data());
    ASSERT_EQ(count_nan(a), 0u);
    EXPECT_LT(rel_l2(a, b), kTolElementwise);
    EXPECT_TRUE(k3test::all_close(a, b, 1e-30, 1e-5));
  }
}

TEST_P(OpsLevels, ShortConvSiluWithCarriedState) {
  std::mt19937 rng(105);
  for (auto [C, K, T1, T2] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{5, 4, 1, 1},
                              {37, 4, 3, 6},
                              {64, 4, 7, 1},
                              {9, 2, 4, 5},
                              {16, 3, 1, 9},
                              {12288, 4, 1, 1},
                              {3000, 4, 20, 1},
                              {33, 1, 2, 2},
                              {33, 1, 1, 3}}) {
    SCOPED_TRACE("C=" + std::to_string(C) + " K=" + std::to_string(K) + " T1=" + std::to_string(T1) +
                 " T2=" + std::to_string(T2));
    const int64_t T = T1 + T2, P = K - 1;
    const auto x = rand_vec(rng, size_t(T * C), 0.05f, 2.0f);
    const auto w = rand_vec(rng, size_t(C * K), 0.05f, 1.0f);
    const auto s0 = rand_vec(rng, size_t(C * P), 0.05f, 1.0f);
    auto st_ops = s0, st_ref = s0;
    auto o_ops = nan_vec(size_t(T * C)), o_ref = nan_vec(size_t(T * C));
    k3::ops::short_conv_silu(k3::ops::kF32, x.data(), T, C, w.data(), K, st_ops.data(), o_ops.data());
    k3::ref::short_conv_silu(x.data(), T, C, w.data(), K, st_ref.data(), o_ref.data());
    ASSERT_EQ(count_nan(o_ops), 0u);
    EXPECT_LT(rel_l2(o_ops, o_ref), kTolConv);
    EXPECT_EQ(st_ops, st_ref);  // the state holds exact copies of inputs
    // Two calls carrying the state equal one call (bitwise: a one-token call takes its own path).
    auto st = s0;
    auto o2 = nan_vec(size_t(T * C));
    k3::ops::short_conv_silu(k3::ops::kF32, x.data(), T1, C, w.data(), K, st.data(), o2.data());
    k3::ops::short_conv_silu(k3::ops::kF32, x.data() + T1 * C, T2, C, w.data(), K, st.data(), o2.data() + T1 * C);
    ASSERT_EQ(count_nan(o2), 0u);
    EXPECT_EQ(o2, o_ops);
    EXPECT_EQ(st, st_ops);
  }
}

TEST_P(OpsLevels, AttnresMix) {
  std::mt19937 rng(106);
  for (auto [n_src, T, H] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 8},
                             {2, 3, 37},
                             {9, 4, 128},
                             {5, 1, 129},
                             {9, 1, 7168},
                             {3, 40, 100},
                             {4, 17, 1000}}) {
    SCOPED_TRACE("n_src=" + std::to_string(n_src) + " T=" + std::to_string(T) + " H=" + std::to_string(H));
    std::vector<std::vector<float>> src;
    std::vector<const float*> ptr;
    for (int64_t j = 0; j < n_src; ++j) src.push_back(rand_vec(rng, size_t(T * H), 0.05f, 1.0f + float(j)));
    for (auto& s : src) ptr.push_back(s.data());
    const auto fold = rand_vec(rng, size_t(H), 0.05f, 0.3f);
    auto a = nan_vec(size_t(T * H)), b = nan_vec(size_t(T * H));
    k3::ops::attnres_mix(k3::ops::kF32, ptr.data(), n_src, T, H, fold.data(), 1e-5f, a.data());
    k3::ref::attnres_mix(ptr.data(), n_src, T, H, fold.data(), 1e-5f, b.data());
    ASSERT_EQ(count_nan(a), 0u);
    EXPECT_LT(rel_l2(a, b), kTolReduce);
  }
}

// ================================================================ KDA
using k3test::KdaInputs;
using k3test::make_kda;

struct KdaRun {
  std::vector<float> o, S;
};

// ops (recurrent or chunked) over [t0, t1) of `in`, starting from state S.
void kda_ops(bool chunked, const KdaInputs& in, int64_t t0, int64_t t1, int64_t H, int64_t Dk, int64_t Dv,
             int64_t chunk, std::vector<float>& S, float* o) {
  const int64_t T = t1 - t0, qk = t0 * H * Dk, vo = t0 * H * Dv, b = t0 * H;
  if (chunked)
    k3::ops::kda_chunked(k3::ops::kF32, in.q.data() + qk, in.k.data() + qk, in.v.data() + vo, in.g.data() + qk,
                         in.beta.data() + b, T, H, Dk, Dv, chunk, S.data(), o);
  else
    k3::ops::kda_recurrent(k3::ops::kF32, in.q.data() + qk, in.k.data() + qk, in.v.data() + vo, in.g.data() + qk,
                           in.beta.data() + b, T, H, Dk, Dv, S.data(), o);
}

KdaRun kda_twin(const KdaInputs& in, int64_t T, int64_t H, int64_t Dk, int64_t Dv) {
  KdaRun r{nan_vec(size_t(T * H * Dv)), in.S0};
  k3::ref::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H, Dk, Dv, r.S.data(),
                         r.o.data());
  return r;
}

TEST_P(OpsLevels, KdaRecurrentTwinAndCarriedState) {
  std::mt19937 rng(107);
  for (auto [T, H, Dk, Dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 16, 16},
                              {1, 3, 16, 8},
                              {9, 2, 12, 20},
                              {70, 3, 16, 16},
                              {5, 2, 33, 70},
                              {1, 96, 128, 128},
                              {1, 16, 128, 128},
                              {6, 4, 128, 128}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " Dk=" + std::to_string(Dk) +
                 " Dv=" + std::to_string(Dv));
    const auto in = make_kda(rng, T, H, Dk, Dv);
    const KdaRun ref = kda_twin(in, T, H, Dk, Dv);
    // One call.
    auto S = in.S0;
    auto o = nan_vec(size_t(T * H * Dv));
    kda_ops(false, in, 0, T, H, Dk, Dv, 0, S, o.data());
    ASSERT_EQ(count_nan(o), 0u);
    EXPECT_LT(rel_l2(o, ref.o), kTolKda);
    EXPECT_LT(rel_l2(S, ref.S), kTolKda);
    // Decode: one token per call, state carried.
    auto S1 = in.S0;
    auto o1 = nan_vec(size_t(T * H * Dv));
    for (int64_t t = 0; t < T; ++t) kda_ops(false, in, t, t + 1, H, Dk, Dv, 0, S1, o1.data() + t * H * Dv);
    ASSERT_EQ(count_nan(o1), 0u);
    EXPECT_LT(rel_l2(o1, ref.o), kTolKda);
    EXPECT_LT(rel_l2(S1, ref.S), kTolKda);
  }
}

TEST_P(OpsLevels, KdaChunkedMatchesRecurrenceWithCarriedState) {
  std::mt19937 rng(108);
  struct C {
    int64_t T, H, Dk, Dv, split;
  };
  // T not a multiple of any chunk; splits inside chunks; vector tails in Dk and Dv; the K3 head size.
  const C cases[] = {{1, 2, 16, 16, 0},  {5, 2, 16, 8, 2},    {37, 3, 16, 16, 20},   {131, 2, 16, 16, 67},
                     {70, 1, 32, 24, 1}, {45, 2, 12, 20, 17}, {64, 2, 128, 128, 31}, {40, 3, 33, 129, 39}};
  for (const auto& c : cases) {
    const auto in = make_kda(rng, c.T, c.H, c.Dk, c.Dv);
    const KdaRun ref = kda_twin(in, c.T, c.H, c.Dk, c.Dv);
    for (int64_t chunk : {1, 3, 16, 64}) {
      SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " Dk=" + std::to_string(c.Dk) +
                   " Dv=" + std::to_string(c.Dv) + " chunk=" + std::to_string(chunk));
      auto S = in.S0;
      auto o = nan_vec(size_t(c.T * c.H * c.Dv));
      kda_ops(true, in, 0, c.T, c.H, c.Dk, c.Dv, chunk, S, o.data());
      ASSERT_EQ(count_nan(o), 0u);
      EXPECT_LT(rel_l2(o, ref.o), kTolKda) << "single call, output";
      EXPECT_LT(rel_l2(S, ref.S), kTolKda) << "single call, final state";
      if (c.split > 0) {
        auto S2 = in.S0;
        auto o2 = nan_vec(size_t(c.T * c.H * c.Dv));
        kda_ops(true, in, 0, c.split, c.H, c.Dk, c.Dv, chunk, S2, o2.data());
        kda_ops(true, in, c.split, c.T, c.H, c.Dk, c.Dv, chunk, S2, o2.data() + c.split * c.H * c.Dv);
        ASSERT_EQ(count_nan(o2), 0u);
        EXPECT_LT(rel_l2(o2, ref.o), kTolKda) << "split at " << c.split << ", output";
        EXPECT_LT(rel_l2(S2, ref.S), kTolKda) << "split at " << c.split << ", final state";
      }
    }
  }
}

TEST_P(OpsLevels, KdaChunkedStrongDecayCutsChunks) {
  // Constant per-token log-decays: -4.99 (the K3 bound: 16 tokens stay within |Γ| <= 80), -30
  // (chunks of 2 tokens), -100 (every token its own chunk; e^-100 underflows fp32). Mixed: random
  // channels at -60, the rest from the gate. Chunked must still equal the recurrence.
  std::mt19937 rng(109);
  const int64_t T = 100, H = 2, Dk = 16, Dv = 16;
  for (float gval : {-4.99f, -30.0f, -100.0f, 0.0f}) {
    SCOPED_TRACE("g=" + std::to_string(gval));
    auto in = make_kda(rng, T, H, Dk, Dv);
    if (gval != 0.0f) {
      std::fill(in.g.begin(), in.g.end(), gval);
    } else {
      std::uniform_int_distribution<int> pick(0, 5);
      for (float& x : in.g)
        if (pick(rng) == 0) x = -60.0f;
    }
    const KdaRun ref = kda_twin(in, T, H, Dk, Dv);
    for (bool chunked : {false, true}) {
      auto S = in.S0;
      auto o = nan_vec(size_t(T * H * Dv));
      kda_ops(chunked, in, 0, T, H, Dk, Dv, 64, S, o.data());
      ASSERT_EQ(count_nan(o), 0u);
      ASSERT_EQ(count_nan(S), 0u);
      EXPECT_LT(rel_l2(o, ref.o), kTolKda) << (chunked ? "chunked" : "recurrent");
      EXPECT_LT(rel_l2(S, ref.S), kTolKda) << (chunked ? "chunked" : "recurrent");
    }
  }
}

TEST_P(OpsLevels, KdaThreadCountIndependent) {
  std::mt19937 rng(110);
  const int64_t T = 21, H = 5, Dk = 64, Dv = 48;
  const auto in = make_kda(rng, T, H, Dk, Dv);
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recurrent");
    expect_thread_independent([&] {
      auto S = in.S0;
      auto o = nan_vec(size_t(T * H * Dv));
      kda_ops(chunked, in, 0, T, H, Dk, Dv, 16, S, o.data());
      o.insert(o.end(), S.begin(), S.end());
      return o;
    });
  }
}

// ================================================================ MLA
struct MlaCase {
  int64_t heads, nope, rope, v, kv_lora, S, T;
  k3::WFormat fmt;
};

std::string mla_name(const MlaCase& c) {
  return "heads=" + std::to_string(c.heads) + " nope=" + std::to_string(c.nope) + " rope=" + std::to_string(c.rope) +
         " v=" + std::to_string(c.v) + " L=" + std::to_string(c.kv_lora) + " S=" + std::to_string(c.S) +
         " T=" + std::to_string(c.T) + " " + k3::wformat_name(c.fmt);
}

struct MlaData {
  k3::MlaAttnDims d;
  k3test::OwnedW kvb;
  std::vector<float> q, cl, kr, kn, vv;
};

MlaData make_mla(std::mt19937& rng, const MlaCase& c) {
  MlaData m;
  const int64_t dq = c.nope + c.rope, per = c.nope + c.v;
  m.d.heads = c.heads;
  m.d.nope = c.nope;
  m.d.rope = c.rope;
  m.d.v = c.v;
  m.d.kv_lora = c.kv_lora;
  m.d.scale = 1.0f / std::sqrt(float(dq));
  const float amp = c.fmt == k3::WFormat::MXFP4 ? 1.0f : 0.5f;
  m.kvb = k3test::make_weight(rng, c.fmt, c.heads * per, c.kv_lora, amp);
  m.q = rand_vec(rng, size_t(c.T * c.heads * dq));
  m.cl = rand_vec(rng, size_t(c.S * c.kv_lora));
  m.kr = rand_vec(rng, size_t(c.S * c.rope));
  // Expanded keys/values from the latent cache (fp64 sums of exact weights).
  m.kn.resize(size_t(c.S * c.heads * c.nope));
  m.vv.resize(size_t(c.S * c.heads * c.v));
  std::vector<float> row(static_cast<size_t>(c.kv_lora));
  for (int64_t h = 0; h < c.heads; ++h)
    for (int64_t i = 0; i < per; ++i) {
      k3::ref::dequant_row(m.kvb.w, h * per + i, row.data());
      for (int64_t s = 0; s < c.S; ++s) {
        double acc = 0;
        for (int64_t l = 0; l < c.kv_lora; ++l) acc += double(row[size_t(l)]) * m.cl[size_t(s * c.kv_lora + l)];
        if (i < c.nope)
          m.kn[size_t((s * c.heads + h) * c.nope + i)] = float(acc);
        else
          m.vv[size_t((s * c.heads + h) * c.v + i - c.nope)] = float(acc);
      }
    }
  return m;
}

TEST_P(OpsLevels, MlaAbsorbedAndExpandedMatchTwins) {
  std::mt19937 rng(111);
  // pos0 = S - T (the last T cached tokens are the queries). Covers tiles/tails (heads not a
  // multiple of 16, widths not multiples of 8/16), causal prefill (T > 1), key splits into parts
  // (T = 1 with S > 512), the K3 head shapes (96 heads, kv_lora 512, nope 128, rope 64, v 128),
  // and token blocks of the absorbed form (heads·kv_lora large enough that T spans two blocks).
  const MlaCase cases[] = {
      {1, 8, 4, 8, 20, 1, 1, k3::WFormat::F32},          {3, 12, 8, 10, 20, 9, 4, k3::WFormat::F32},
      {4, 24, 8, 16, 32, 7, 1, k3::WFormat::F32},        {2, 16, 8, 12, 32, 13, 13, k3::WFormat::BF16},
      {3, 10, 6, 7, 64, 11, 5, k3::WFormat::MXFP4},      {17, 16, 8, 24, 96, 70, 70, k3::WFormat::BF16},
      {5, 16, 8, 16, 64, 1500, 1, k3::WFormat::BF16},    {2, 8, 4, 8, 32, 2100, 3, k3::WFormat::F16},
      {96, 128, 64, 128, 512, 33, 1, k3::WFormat::BF16}, {128, 8, 4, 8, 512, 80, 66, k3::WFormat::BF16},
      {3, 10, 6, 7, 64, 11, 1, k3::WFormat::MXFP4},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(mla_name(c));
    const MlaData m = make_mla(rng, c);
    const int64_t pos0 = c.S - c.T;
    const size_t nO = size_t(c.T * c.heads * c.v);
    auto e_ref = nan_vec(nO), e_ops = nan_vec(nO), a_ops = nan_vec(nO), a_ref = nan_vec(nO);
    k3::ref::mla_attend_expanded(m.q.data(), c.T, m.kn.data(), m.kr.data(), m.vv.data(), c.S, pos0, m.d, e_ref.data());
    k3::ops::mla_attend_expanded(k3::ops::kF32, m.q.data(), c.T, m.kn.data(), m.kr.data(), m.vv.data(), c.S, pos0, m.d,
                                 e_ops.data());
    k3::ops::mla_attend_absorbed(k3::ops::kF32, m.q.data(), c.T, m.cl.data(), m.kr.data(), c.S, pos0, m.kvb.w, m.d,
                                 a_ops.data());
    ASSERT_EQ(count_nan(e_ops), 0u);
    ASSERT_EQ(count_nan(a_ops), 0u);
    EXPECT_LT(rel_l2(e_ops, e_ref), kTolMla) << "expanded: ops vs ref";
    EXPECT_LT(rel_l2(a_ops, e_ref), kTolMla) << "absorbed ops vs expanded ref";
    if (c.T * c.heads * c.S * c.kv_lora <= 5'000'000) {  // the absorbed twin itself where affordable
      k3::ref::mla_attend_absorbed(m.q.data(), c.T, m.cl.data(), m.kr.data(), c.S, pos0, m.kvb.w, m.d, a_ref.data());
      EXPECT_LT(rel_l2(a_ops, a_ref), kTolMla) << "absorbed: ops vs ref";
    }
    // Causality: changing the last cached token changes only the last query's outputs.
    if (c.T > 1) {
      auto cl2 = m.cl;
      for (int64_t l = 0; l < c.kv_lora; ++l) cl2[size_t((c.S - 1) * c.kv_lora + l)] += 0.5f;
      auto a2 = nan_vec(nO);
      k3::ops::mla_attend_absorbed(k3::ops::kF32, m.q.data(), c.T, cl2.data(), m.kr.data(), c.S, pos0, m.kvb.w, m.d,
                                   a2.data());
      const size_t per_t = size_t(c.heads * c.v);
      EXPECT_EQ(std::memcmp(a2.data(), a_ops.data(), (size_t(c.T) - 1) * per_t * 4), 0) << "future token leaked";
      EXPECT_NE(std::memcmp(a2.data() + (c.T - 1) * per_t, a_ops.data() + (c.T - 1) * per_t, per_t * 4), 0);
    }
  }
}

// The interleaved paged latent cache of m (c then k_r per token), pages of P tokens.
struct MlaPaged {
  std::vector<float> rows;
  std::vector<const float*> pages;
  k3::ops::LatentPages lp;
};
MlaPaged paged(const MlaData& m, const MlaCase& c, int64_t P) {
  MlaPaged p;
  const int64_t W = c.kv_lora + c.rope + 3;  // a stride wider than the row, as pool pages may be
  p.rows = nan_vec(size_t(((c.S + P - 1) / P) * P * W));
  for (int64_t s = 0; s < c.S; ++s) {
    std::copy_n(m.cl.begin() + s * c.kv_lora, c.kv_lora, p.rows.begin() + s * W);
    std::copy_n(m.kr.begin() + s * c.rope, c.rope, p.rows.begin() + s * W + c.kv_lora);
  }
  for (int64_t s = 0; s < c.S; s += P) p.pages.push_back(p.rows.data() + s * W);
  p.lp = {p.pages.data(), P, W};
  return p;
}

// The expanded form in key tiles (long prefill pieces) against the fp64 expanded twin: one or many
// tiles (forced small), queries that start before, inside or after a tile (groups that see none of
// a tile's keys are skipped), token groups with tails, pages that cut tiles, every weight format,
// and the K3 head shapes. At the scalar level it is the absorbed kernel (checked the same way).
TEST_P(OpsLevels, MlaTiledMatchesTwins) {
  std::mt19937 rng(113);
  struct TiledCase {
    MlaCase c;
    int64_t page, tile;
  };
  const TiledCase cases[] = {
      {{3, 12, 8, 10, 20, 9, 4, k3::WFormat::F32}, 4, 0},
      {{2, 8, 4, 8, 32, 700, 500, k3::WFormat::BF16}, 7, 64},
      {{5, 16, 8, 16, 64, 300, 300, k3::WFormat::MXFP4}, 300, 128},
      {{4, 16, 8, 12, 48, 1200, 37, k3::WFormat::F16}, 16, 0},
      {{96, 128, 64, 128, 512, 150, 70, k3::WFormat::BF16}, 64, 64},
  };
  for (const auto& [c, page, tile] : cases) {
    SCOPED_TRACE(mla_name(c) + " page=" + std::to_string(page) + " tile=" + std::to_string(tile));
    const MlaData m = make_mla(rng, c);
    const MlaPaged p = paged(m, c, page);
    const int64_t pos0 = c.S - c.T;
    const size_t nO = size_t(c.T * c.heads * c.v);
    auto e_ref = nan_vec(nO), t_ops = nan_vec(nO);
    k3::ref::mla_attend_expanded(m.q.data(), c.T, m.kn.data(), m.kr.data(), m.vv.data(), c.S, pos0, m.d, e_ref.data());
    k3::ops::mla_attend_tiled_paged(k3::ops::kF32, m.q.data(), c.T, p.lp, c.S, pos0, m.kvb.w, m.d, t_ops.data(), tile);
    ASSERT_EQ(count_nan(t_ops), 0u);
    EXPECT_LT(rel_l2(t_ops, e_ref), kTolMla) << "tiled ops vs expanded ref";
    // Causality: changing the last cached token changes only the last query's outputs.
    if (c.T > 1) {
      MlaPaged p2 = p;
      p2.pages.clear();
      for (size_t i = 0; i < p.pages.size(); ++i) p2.pages.push_back(p2.rows.data() + (p.pages[i] - p.rows.data()));
      p2.lp.pages = p2.pages.data();
      const int64_t last = c.S - 1;
      float* row = p2.rows.data() + (last / page) * page * p.lp.stride + (last % page) * p.lp.stride;
      for (int64_t l = 0; l < c.kv_lora; ++l) row[l] += 0.5f;
      auto t2 = nan_vec(nO);
      k3::ops::mla_attend_tiled_paged(k3::ops::kF32, m.q.data(), c.T, p2.lp, c.S, pos0, m.kvb.w, m.d, t2.data(), tile);
      const size_t per_t = size_t(c.heads * c.v);
      EXPECT_EQ(std::memcmp(t2.data(), t_ops.data(), (size_t(c.T) - 1) * per_t * 4), 0) << "future token leaked";
      EXPECT_NE(std::memcmp(t2.data() + (c.T - 1) * per_t, t_ops.data() + (c.T - 1) * per_t, per_t * 4), 0);
    }
  }
  // A head's result does not depend on the other heads of the call (a tensor-parallel rank runs a
  // slice of them): 8 heads of K3's widths in one call and as two calls of 4, bitwise, default tiles.
  {
    const MlaCase c{8, 128, 64, 128, 512, 700, 600, k3::WFormat::BF16};
    const MlaData m = make_mla(rng, c);
    const MlaPaged p = paged(m, c, 64);
    const int64_t pos0 = c.S - c.T, dq = c.nope + c.rope, ph = c.nope + c.v, Hs = c.heads / 2;
    auto all = nan_vec(size_t(c.T * c.heads * c.v)), halves = nan_vec(all.size());
    k3::ops::mla_attend_tiled_paged(k3::ops::kF32, m.q.data(), c.T, p.lp, c.S, pos0, m.kvb.w, m.d, all.data());
    k3::MlaAttnDims dh = m.d;
    dh.heads = Hs;
    for (int64_t part = 0; part < 2; ++part) {
      std::vector<float> q(size_t(c.T * Hs * dq)), o(size_t(c.T * Hs * c.v));
      for (int64_t t = 0; t < c.T; ++t)
        std::copy_n(m.q.begin() + (t * c.heads + part * Hs) * dq, Hs * dq, q.begin() + t * Hs * dq);
      k3::ops::mla_attend_tiled_paged(k3::ops::kF32, q.data(), c.T, p.lp, c.S, pos0,
                                      k3::rows_of(m.kvb.w, part * Hs * ph, Hs * ph), dh, o.data());
      for (int64_t t = 0; t < c.T; ++t)
        std::copy_n(o.begin() + t * Hs * c.v, Hs * c.v, halves.begin() + (t * c.heads + part * Hs) * c.v);
    }
    EXPECT_EQ(std::memcmp(all.data(), halves.data(), all.size() * 4), 0) << "8 heads vs 2 x 4";
  }
  // A key tile that is not a whole number of attention blocks is refused.
  const MlaCase c{2, 8, 4, 8, 32, 10, 4, k3::WFormat::F32};
  const MlaData m = make_mla(rng, c);
  const MlaPaged p = paged(m, c, 10);
  auto o = nan_vec(size_t(c.T * c.heads * c.v));
  if (GetParam() != CpuIsa::Scalar) {
    EXPECT_THROW(k3::ops::mla_attend_tiled_paged(k3::ops::kF32, m.q.data(), c.T, p.lp, c.S, c.S - c.T, m.kvb.w, m.d,
                                                 o.data(), 100),
                 k3::Error);
  }
}

TEST_P(OpsLevels, MlaThreadCountIndependent) {
  std::mt19937 rng(112);
  for (const MlaCase& c :
       {MlaCase{6, 16, 8, 16, 64, 1300, 1, k3::WFormat::BF16}, MlaCase{20, 16, 8, 12, 48, 40, 9, k3::WFormat::BF16}}) {
    SCOPED_TRACE(mla_name(c));
    const MlaData m = make_mla(rng, c);
    const int64_t pos0 = c.S - c.T;
    const size_t nO = size_t(c.T * c.heads * c.v);
    expect_thread_independent([&] {
      auto a = nan_vec(nO);
      k3::ops::mla_attend_absorbed(k3::ops::kF32, m.q.data(), c.T, m.cl.data(), m.kr.data(), c.S, pos0, m.kvb.w, m.d,
                                   a.data());
      return a;
    });
    expect_thread_independent([&] {
      auto e = nan_vec(nO);
      k3::ops::mla_attend_expanded(k3::ops::kF32, m.q.data(), c.T, m.kn.data(), m.kr.data(), m.vv.data(), c.S, pos0,
                                   m.d, e.data());
      return e;
    });
    const MlaPaged p = paged(m, c, 16);
    expect_thread_independent([&] {
      auto t = nan_vec(nO);
      k3::ops::mla_attend_tiled_paged(k3::ops::kF32, m.q.data(), c.T, p.lp, c.S, pos0, m.kvb.w, m.d, t.data(), 64);
      return t;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Level, OpsLevels, k3test::all_cpu_levels(), k3test::cpu_level_name);

}  // namespace
