// The op modes Kimi Linear adds (ops.h): the SiLU-GLU (situ_glu with caps 0, 0) and the unbounded
// KDA decay gate −exp(A_log)·softplus(f + dt_bias) (kda_gate with lower_bound 0), against their fp64
// twins in k3::ref and against the formulas written out here, on every CPU level this machine has
// (a level it lacks is skipped by name) and in exact numerics.
// Owns: nothing beyond the shared op tolerances (tests/common/op_tolerances.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_levels.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "ops/cpu/isa.h"
#include "ops/ops.h"

namespace {

using k3test::count_nan;
using k3test::kTolElementwise;
using k3test::nan_vec;
using k3test::rand_vec;
using k3test::rel_l2;

class KimiLinearOps : public k3test::CpuLevelTest {};

// g·σ(g)·u in fp64, written out (no caps).
double silu_glu(double g, double u) { return g / (1 + std::exp(-g)) * u; }
// −exp(A)·softplus(x), softplus(x) = x above 20 (the threshold of transformers and fla).
double unbounded_gate(double A_log, double x) { return -std::exp(A_log) * (x > 20 ? x : std::log1p(std::exp(x))); }

TEST_P(KimiLinearOps, SiluGlu) {
  std::mt19937 rng(201);
  for (int64_t n : {1, 17, 1000, 70001}) {
    for (float hi : {60.0f, 0.5f}) {  // large (would saturate the SiTU caps) and small arguments
      SCOPED_TRACE("n=" + std::to_string(n) + " hi=" + std::to_string(hi));
      const auto g = rand_vec(rng, size_t(n), 0.001f, hi), u = rand_vec(rng, size_t(n), 0.001f, hi);
      for (const auto& ex : {k3::ops::kF32, k3::ops::kExact}) {
        auto a = nan_vec(size_t(n)), b = nan_vec(size_t(n));
        std::vector<double> want(static_cast<size_t>(n));
        k3::ops::situ_glu(ex, g.data(), u.data(), n, 0.0f, 0.0f, a.data());
        k3::ref::situ_glu(g.data(), u.data(), n, 0.0f, 0.0f, b.data());
        for (int64_t i = 0; i < n; ++i) want[size_t(i)] = silu_glu(g[size_t(i)], u[size_t(i)]);
        ASSERT_EQ(count_nan(a), 0u);
        EXPECT_LT(rel_l2(a, b), kTolElementwise);
        EXPECT_TRUE(k3test::all_close(a, b, 1e-30, 1e-5));
        for (int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(b[size_t(i)], want[size_t(i)], 1e-6 * std::fabs(want[size_t(i)]) + 1e-30) << i;
      }
    }
  }
}

TEST_P(KimiLinearOps, UnboundedKdaGate) {
  std::mt19937 rng(202);
  for (auto [T, H, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 5}, {3, 4, 16}, {7, 3, 33}, {2, 32, 128}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D));
    // f up to ±30 crosses the softplus threshold (20) on some elements.
    const auto f = rand_vec(rng, size_t(T * H * D), 0.01f, 30.0f);
    const auto A_log = rand_vec(rng, size_t(H), 0.05f, 2.0f);
    const auto dt = rand_vec(rng, size_t(H * D), 0.05f, 2.0f);
    for (const auto& ex : {k3::ops::kF32, k3::ops::kExact}) {
      auto a = nan_vec(f.size()), b = nan_vec(f.size());
      k3::ops::kda_gate(ex, f.data(), T, H, D, A_log.data(), dt.data(), 0.0f, a.data());
      k3::ref::kda_gate(f.data(), T, H, D, A_log.data(), dt.data(), 0.0f, b.data());
      ASSERT_EQ(count_nan(a), 0u);
      EXPECT_LT(rel_l2(a, b), kTolElementwise);
      EXPECT_TRUE(k3test::all_close(a, b, 1e-30, 1e-5));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const size_t i = size_t((t * H + h) * D + d);
            const double want = unbounded_gate(A_log[size_t(h)], double(f[i]) + dt[size_t(h * D + d)]);
            ASSERT_NEAR(b[i], want, 1e-6 * std::fabs(want) + 1e-30) << i;
            ASSERT_LE(a[i], 0.0f);  // a log decay
          }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Level, KimiLinearOps, k3test::all_cpu_levels(), k3test::cpu_level_name);

}  // namespace
