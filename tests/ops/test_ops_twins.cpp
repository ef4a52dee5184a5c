// Twin tests: every CPU kernel in k3::ops against its fp64 scalar twin in k3::ref (ops/ops.h),
// on seeded random non-zero inputs with odd shapes, plus algebraic cross-checks between ops
// (chunked KDA vs the recurrence, absorbed vs expanded MLA, carried conv state, MXFP4 nibble order).
// Owns: the stated tolerance of each op (constants below). Every output is pre-filled with NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/kda_inputs.h"
#include "common/num_util.h"
#include "common/op_call.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/dtype.h"
#include "ops/ops.h"
#include "ops/weight.h"

namespace {

using k3test::count_nan;
using k3test::make_weight;
using k3test::nan_vec;
using k3test::OwnedW;
using k3test::rand_vec;
using k3test::rel_l2;

// Tolerances: tests/common/op_tolerances.h.
using k3test::kTolConv;
using k3test::kTolElementwise;
using k3test::kTolKda;
using k3test::kTolMla;
using k3test::kTolReduce;
using k3test::kTolRouter;
// dequant_row is exact by definition: decoded values must be bit-identical to WeightMat::at.

// ================================================================ matmul / dequant_row
struct MatmulCase {
  k3::WFormat fmt;
  int64_t rows, cols, T;
};

TEST(OpsTwins, MatmulAllFormats) {
  std::mt19937 rng(1234);
  const MatmulCase cases[] = {
      {k3::WFormat::F32, 7, 37, 1},     {k3::WFormat::F32, 19, 129, 5}, {k3::WFormat::F32, 64, 8, 3},
      {k3::WFormat::F16, 13, 33, 1},    {k3::WFormat::F16, 9, 101, 4},  {k3::WFormat::BF16, 11, 65, 1},
      {k3::WFormat::BF16, 17, 130, 6},  {k3::WFormat::MXFP4, 5, 32, 1}, {k3::WFormat::MXFP4, 21, 96, 3},
      {k3::WFormat::MXFP4, 33, 160, 7},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(k3::wformat_name(c.fmt)) + " rows=" + std::to_string(c.rows) +
                 " cols=" + std::to_string(c.cols) + " T=" + std::to_string(c.T));
    OwnedW W = make_weight(rng, c.fmt, c.rows, c.cols);
    const auto X = rand_vec(rng, size_t(c.T * c.cols));
    auto y_ops = nan_vec(size_t(c.T * c.rows)), y_ref = nan_vec(size_t(c.T * c.rows));
    k3::ops::matmul(k3::ops::kExact, W.w, X.data(), c.T, y_ops.data());
    k3::ref::matmul(W.w, X.data(), c.T, y_ref.data());
    ASSERT_EQ(count_nan(y_ops), 0u);
    ASSERT_EQ(count_nan(y_ref), 0u);
    EXPECT_LT(rel_l2(y_ops, y_ref), kTolReduce);
    // Independent spot check of the twin: one output element by hand in double from W.at.
    double acc = 0;
    const int64_t t = c.T - 1, r = c.rows / 2;
    for (int64_t k = 0; k < c.cols; ++k) acc += double(W.w.at(r, k)) * X[size_t(t * c.cols + k)];
    EXPECT_NEAR(y_ref[size_t(t * c.rows + r)], acc, 1e-6 * (1 + std::fabs(acc)));

    // dequant_row: exact, both implementations, every row.
    for (int64_t rr = 0; rr < c.rows; ++rr) {
      auto d_ops = nan_vec(size_t(c.cols)), d_ref = nan_vec(size_t(c.cols));
      k3::ops::dequant_row(W.w, rr, d_ops.data());
      k3::ref::dequant_row(W.w, rr, d_ref.data());
      for (int64_t k = 0; k < c.cols; ++k) {
        ASSERT_EQ(d_ops[size_t(k)], W.w.at(rr, k)) << "row " << rr << " col " << k;
        ASSERT_EQ(d_ref[size_t(k)], W.w.at(rr, k)) << "row " << rr << " col " << k;
      }
    }
  }
}

// Independent E2M1 table (OCP MX spec): sign bit 3, exponent bits 2..1, mantissa bit 0.
constexpr float kMyE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

TEST(OpsTwins, Mxfp4LowNibbleIsEvenColumn) {
  // One row of 64 columns (two scale groups). Byte 0 = 0x62: low nibble 0x2 (1.0), high 0x6 (4.0).
  // If low nibble = even column then col0 = 1.0·s and col1 = 4.0·s; the swapped reading gives 4, 1.
  std::vector<uint8_t> packed(32), scales = {127, 129};  // group 0: ×1, group 1: ×4
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = uint8_t((i * 37 + 11) & 0xff);
  packed[0] = 0x62;
  packed[16] = 0xA3;  // group 1, cols 32/33: low 0x3 (1.5) and high 0xA (-1.0)
  const k3::WeightMat W{k3::WFormat::MXFP4, 1, 64, packed.data(), scales.data()};
  auto d_ops = nan_vec(64), d_ref = nan_vec(64);
  k3::ops::dequant_row(W, 0, d_ops.data());
  k3::ref::dequant_row(W, 0, d_ref.data());
  EXPECT_EQ(d_ops[0], 1.0f);
  EXPECT_EQ(d_ops[1], 4.0f);
  EXPECT_EQ(d_ops[32], 1.5f * 4.0f);
  EXPECT_EQ(d_ops[33], -1.0f * 4.0f);
  for (int64_t c = 0; c < 64; ++c) {
    const uint8_t b = packed[size_t(c / 2)];
    const float expect = kMyE2M1[(c % 2 == 0) ? (b & 0xf) : (b >> 4)] * (c < 32 ? 1.0f : 4.0f);
    EXPECT_EQ(d_ops[size_t(c)], expect) << "col " << c;
    EXPECT_EQ(d_ref[size_t(c)], expect) << "col " << c;
    EXPECT_EQ(W.at(0, c), expect) << "col " << c;
  }
  // matmul with unit vectors picks single columns: e0 → 1.0, e1 → 4.0.
  for (int col : {0, 1, 32, 33}) {
    std::vector<float> x(64, 0.0f);
    x[size_t(col)] = 1.0f;
    float y_ops = k3test::qnan(), y_ref = k3test::qnan();
    k3::ops::matmul(k3::ops::kExact, W, x.data(), 1, &y_ops);
    k3::ref::matmul(W, x.data(), 1, &y_ref);
    EXPECT_EQ(y_ops, d_ops[size_t(col)]) << "col " << col;
    EXPECT_EQ(y_ref, d_ops[size_t(col)]) << "col " << col;
  }
}

// ================================================================ elementwise and norms
TEST(OpsTwins, Rmsnorm) {
  std::mt19937 rng(7);
  for (auto [T, n] : {std::pair<int64_t, int64_t>{1, 7}, {3, 128}, {5, 333}}) {
    for (bool with_w : {false, true}) {
      SCOPED_TRACE("T=" + std::to_string(T) + " n=" + std::to_string(n) + " w=" + std::to_string(with_w));
      const auto x = rand_vec(rng, size_t(T * n), 0.05f, 3.0f);
      const auto w = rand_vec(rng, size_t(n), 0.5f, 1.5f);
      auto a = nan_vec(size_t(T * n)), b = nan_vec(size_t(T * n));
      k3::ops::rmsnorm(k3::ops::kExact, x.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, a.data());
      k3::ref::rmsnorm(x.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, b.data());
      ASSERT_EQ(count_nan(a), 0u);
      ASSERT_EQ(count_nan(b), 0u);
      EXPECT_LT(rel_l2(a, b), kTolElementwise);
      if (!with_w)  // unit gain: every row has mean square ≈ 1 (eps is tiny next to mean(x²) ≥ 0.0025)
        for (int64_t t = 0; t < T; ++t) {
          double ss = 0;
          for (int64_t i = 0; i < n; ++i) ss += double(b[size_t(t * n + i)]) * b[size_t(t * n + i)];
          EXPECT_NEAR(ss / double(n), 1.0, 1e-2);
        }
    }
  }
}

TEST(OpsTwins, L2normScale) {
  std::mt19937 rng(8);
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 16}, {7, 13}, {12, 128}}) {
    SCOPED_TRACE("rows=" + std::to_string(rows) + " n=" + std::to_string(n));
    const auto x = rand_vec(rng, size_t(rows * n), 0.05f, 2.0f);
    auto a = x, b = x;
    const float scale = 1.0f / std::sqrt(float(n));
    k3::ops::l2norm_scale(k3::ops::kExact, a.data(), rows, n, 1e-6f, scale);
    k3::ref::l2norm_scale(b.data(), rows, n, 1e-6f, scale);
    EXPECT_LT(rel_l2(a, b), kTolElementwise);
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(a[size_t(r * n + i)]) * a[size_t(r * n + i)];
      EXPECT_NEAR(std::sqrt(ss), scale, 1e-5 * scale);  // sum (not mean) of squares normalised
    }
  }
}

TEST(OpsTwins, SituGlu) {
  std::mt19937 rng(9);
  for (int64_t n : {1, 17, 1000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    // Magnitudes up to 60 so both soft caps (4 and 25) saturate on some elements.
    const auto g = rand_vec(rng, size_t(n), 0.01f, 60.0f), u = rand_vec(rng, size_t(n), 0.01f, 60.0f);
    auto a = nan_vec(size_t(n)), b = nan_vec(size_t(n));
    k3::ops::situ_glu(k3::ops::kExact, g.data(), u.data(), n, 4.0f, 25.0f, a.data());
    k3::ref::situ_glu(g.data(), u.data(), n, 4.0f, 25.0f, b.data());
    ASSERT_EQ(count_nan(a), 0u);
    ASSERT_EQ(count_nan(b), 0u);
    EXPECT_LT(rel_l2(a, b), kTolElementwise);
    for (int64_t i = 0; i < n; ++i) EXPECT_LE(std::fabs(b[size_t(i)]), 100.0f);  // |out| ≤ β₁β₂
  }
}

TEST(OpsTwins, KdaGate) {
  std::mt19937 rng(10);
  for (auto [T, H, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 5}, {3, 4, 16}, {7, 3, 33}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D));
    const auto f = rand_vec(rng, size_t(T * H * D), 0.01f, 4.0f);
    const auto A_log = rand_vec(rng, size_t(H), 0.05f, 1.0f);
    const auto dt = rand_vec(rng, size_t(H * D), 0.05f, 1.0f);
    auto a = nan_vec(f.size()), b = nan_vec(f.size());
    k3::ops::kda_gate(k3::ops::kExact, f.data(), T, H, D, A_log.data(), dt.data(), -5.0f, a.data());
    k3::ref::kda_gate(f.data(), T, H, D, A_log.data(), dt.data(), -5.0f, b.data());
    ASSERT_EQ(count_nan(a), 0u);
    ASSERT_EQ(count_nan(b), 0u);
    EXPECT_LT(rel_l2(a, b), kTolElementwise);
    for (float x : a) {
      EXPECT_LT(x, 0.0f);
      EXPECT_GT(x, -5.0f);
    }
  }
}

// ================================================================ short conv
TEST(OpsTwins, ShortConvSiluTwinAndCarriedState) {
  std::mt19937 rng(11);
  for (auto [C, K, T1, T2] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{5, 4, 1, 1},
                              {37, 4, 3, 6},
                              {64, 4, 7, 1},
                              {9, 2, 4, 5},
                              {16, 3, 1, 9}}) {
    SCOPED_TRACE("C=" + std::to_string(C) + " K=" + std::to_string(K) + " T1=" + std::to_string(T1) +
                 " T2=" + std::to_string(T2));
    const int64_t T = T1 + T2, P = K - 1;
    const auto x = rand_vec(rng, size_t(T * C), 0.05f, 2.0f);
    const auto w = rand_vec(rng, size_t(C * K), 0.05f, 1.0f);
    const auto s0 = rand_vec(rng, size_t(C * P), 0.05f, 1.0f);  // non-zero incoming state

    // One call on the whole sequence: ops vs ref (outputs and state).
    auto st_ops = s0, st_ref = s0;
    auto o_ops = nan_vec(size_t(T * C)), o_ref = nan_vec(size_t(T * C));
    k3::ops::short_conv_silu(k3::ops::kExact, x.data(), T, C, w.data(), K, st_ops.data(), o_ops.data());
    k3::ref::short_conv_silu(x.data(), T, C, w.data(), K, st_ref.data(), o_ref.data());
    ASSERT_EQ(count_nan(o_ops), 0u);
    ASSERT_EQ(count_nan(o_ref), 0u);
    EXPECT_LT(rel_l2(o_ops, o_ref), kTolConv);
    EXPECT_LT(rel_l2(st_ops, st_ref), kTolConv);
    // The state after the call holds the last K-1 inputs oldest→newest (exact copies).
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < P; ++j) {
        const int64_t src = T - P + j;  // index into the window [s0 | x]
        const float expect = src >= 0 ? x[size_t(src * C + c)] : s0[size_t(c * P + (P + src))];
        EXPECT_EQ(st_ops[size_t(c * P + j)], expect);
        EXPECT_EQ(st_ref[size_t(c * P + j)], expect);
      }
    // Split into two calls carrying the state: same outputs and final state as one call.
    for (int impl = 0; impl < 2; ++impl) {
      const k3test::OpImpl im{impl == 0 ? "ops" : "ref", impl != 0, k3::ops::kExact};
      auto fn = K3_OP(im, short_conv_silu);
      auto st = s0;
      auto o = nan_vec(size_t(T * C));
      fn(x.data(), T1, C, w.data(), K, st.data(), o.data());
      fn(x.data() + T1 * C, T2, C, w.data(), K, st.data(), o.data() + T1 * C);
      ASSERT_EQ(count_nan(o), 0u);
      const auto& whole = impl == 0 ? o_ops : o_ref;
      EXPECT_LT(rel_l2(o, whole), kTolConv) << (impl == 0 ? "ops" : "ref");
      EXPECT_EQ(st, impl == 0 ? st_ops : st_ref) << (impl == 0 ? "ops" : "ref");
    }
    // One hand-computed element in double (last token, channel C/2).
    {
      const int64_t c = C / 2, t = T - 1;
      double acc = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t - (K - 1) + j;
        const double in = src >= 0 ? x[size_t(src * C + c)] : s0[size_t(c * P + (P + src))];
        acc += double(w[size_t(c * K + j)]) * in;
      }
      const double expect = acc / (1.0 + std::exp(-acc));
      EXPECT_NEAR(o_ref[size_t(t * C + c)], expect, 1e-6 * (1 + std::fabs(expect)));
    }
  }
}

// ================================================================ KDA
using k3test::KdaInputs;
using k3test::make_kda;

TEST(OpsTwins, KdaRecurrentTwin) {
  std::mt19937 rng(12);
  for (auto [T, H, Dk, Dv] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 16, 16}, {1, 3, 16, 8}, {9, 2, 12, 20}, {70, 3, 16, 16}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " Dk=" + std::to_string(Dk) +
                 " Dv=" + std::to_string(Dv));
    const auto in = make_kda(rng, T, H, Dk, Dv);
    auto S_ops = in.S0, S_ref = in.S0;
    auto o_ops = nan_vec(size_t(T * H * Dv)), o_ref = nan_vec(size_t(T * H * Dv));
    k3::ops::kda_recurrent(k3::ops::kExact, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H,
                           Dk, Dv, S_ops.data(), o_ops.data());
    k3::ref::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H, Dk, Dv,
                           S_ref.data(), o_ref.data());
    ASSERT_EQ(count_nan(o_ops), 0u);
    ASSERT_EQ(count_nan(o_ref), 0u);
    EXPECT_LT(rel_l2(o_ops, o_ref), kTolKda);
    EXPECT_LT(rel_l2(S_ops, S_ref), kTolKda);
  }
}

TEST(OpsTwins, KdaRecurrentOneStepByHand) {
  // One token, one head, Dk=2, Dv=3: S_t = (I − β k kᵀ) Diag(α) S + β k vᵀ, o = S_tᵀ q.
  const float q[2] = {0.3f, -0.7f}, k[2] = {0.6f, 0.8f}, v[3] = {1.0f, -2.0f, 0.5f}, g[2] = {-0.2f, -1.5f};
  const float beta = 0.7f;
  std::vector<float> S0 = {0.1f, 0.2f, -0.3f, 0.4f, -0.5f, 0.6f};  // [Dk=2][Dv=3]
  double Sd[2][3], o[3];
  const double a[2] = {std::exp(double(g[0])), std::exp(double(g[1]))};
  for (int j = 0; j < 3; ++j) {
    const double s0 = a[0] * S0[size_t(j)], s1 = a[1] * S0[size_t(3 + j)];
    const double u = s0 * k[0] + s1 * k[1];
    Sd[0][j] = s0 + beta * k[0] * (v[j] - u);
    Sd[1][j] = s1 + beta * k[1] * (v[j] - u);
    o[j] = Sd[0][j] * q[0] + Sd[1][j] * q[1];
  }
  for (int impl = 0; impl < 3; ++impl) {
    auto S = S0;
    auto out = nan_vec(3);
    if (impl == 0) k3::ops::kda_recurrent(k3::ops::kExact, q, k, v, g, &beta, 1, 1, 2, 3, S.data(), out.data());
    if (impl == 1) k3::ref::kda_recurrent(q, k, v, g, &beta, 1, 1, 2, 3, S.data(), out.data());
    if (impl == 2) k3::ops::kda_chunked(k3::ops::kExact, q, k, v, g, &beta, 1, 1, 2, 3, 64, S.data(), out.data());
    for (int j = 0; j < 3; ++j) {
      EXPECT_NEAR(out[size_t(j)], o[j], 1e-6) << "impl " << impl << " j " << j;
      EXPECT_NEAR(S[size_t(j)], Sd[0][j], 1e-6) << "impl " << impl;
      EXPECT_NEAR(S[size_t(3 + j)], Sd[1][j], 1e-6) << "impl " << impl;
    }
  }
}

TEST(OpsTwins, KdaChunkedMatchesRecurrenceWithCarriedState) {
  std::mt19937 rng(13);
  struct C {
    int64_t T, H, Dk, Dv, split;
  };
  // T not a multiple of any chunk size; split points cut inside chunks; T > 64 for the 64-chunk.
  const C cases[] = {
      {1, 2, 16, 16, 0}, {5, 2, 16, 8, 2}, {37, 3, 16, 16, 20}, {131, 2, 16, 16, 67}, {70, 1, 32, 24, 1}};
  for (const auto& c : cases) {
    const auto in = make_kda(rng, c.T, c.H, c.Dk, c.Dv);
    const size_t nO = size_t(c.T * c.H * c.Dv);
    // fp64 twin of the recurrence over the whole sequence.
    auto S_ref = in.S0;
    auto o_ref = nan_vec(nO);
    k3::ref::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.T, c.H, c.Dk, c.Dv,
                           S_ref.data(), o_ref.data());
    ASSERT_EQ(count_nan(o_ref), 0u);
    for (int64_t chunk : {1, 3, 16, 64}) {
      SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " Dk=" + std::to_string(c.Dk) +
                   " Dv=" + std::to_string(c.Dv) + " chunk=" + std::to_string(chunk));
      // One call.
      auto S = in.S0;
      auto o = nan_vec(nO);
      k3::ops::kda_chunked(k3::ops::kExact, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.T,
                           c.H, c.Dk, c.Dv, chunk, S.data(), o.data());
      ASSERT_EQ(count_nan(o), 0u);
      EXPECT_LT(rel_l2(o, o_ref), kTolKda) << "single call, output";
      EXPECT_LT(rel_l2(S, S_ref), kTolKda) << "single call, final state";
      // Two calls with the state carried: [0, split) then [split, T).
      if (c.split > 0) {
        auto S2 = in.S0;
        auto o2 = nan_vec(nO);
        const int64_t T1 = c.split, T2 = c.T - c.split;
        const int64_t qk1 = T1 * c.H * c.Dk, v1 = T1 * c.H * c.Dv, b1 = T1 * c.H;
        k3::ops::kda_chunked(k3::ops::kExact, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T1,
                             c.H, c.Dk, c.Dv, chunk, S2.data(), o2.data());
        k3::ops::kda_chunked(k3::ops::kExact, in.q.data() + qk1, in.k.data() + qk1, in.v.data() + v1, in.g.data() + qk1,
                             in.beta.data() + b1, T2, c.H, c.Dk, c.Dv, chunk, S2.data(), o2.data() + v1);
        ASSERT_EQ(count_nan(o2), 0u);
        EXPECT_LT(rel_l2(o2, o_ref), kTolKda) << "split at " << c.split << ", output";
        EXPECT_LT(rel_l2(S2, S_ref), kTolKda) << "split at " << c.split << ", final state";
      }
    }
    // ref::kda_chunked (defined as the recurrence) agrees too, with any chunk.
    auto S3 = in.S0;
    auto o3 = nan_vec(nO);
    k3::ref::kda_chunked(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.T, c.H, c.Dk, c.Dv, 3,
                         S3.data(), o3.data());
    EXPECT_LT(rel_l2(o3, o_ref), kTolKda);
  }
}

TEST(OpsTwins, KdaChunkedStrongDecayNoOverflow) {
  // g = -5 everywhere: Γ reaches -320 in a 64-chunk; exp(Γ_i)·exp(-Γ_j) would overflow fp32/underflow.
  std::mt19937 rng(14);
  const int64_t T = 100, H = 1, Dk = 16, Dv = 16;
  auto in = make_kda(rng, T, H, Dk, Dv);
  std::fill(in.g.begin(), in.g.end(), -4.99f);
  auto S_ref = in.S0, S = in.S0;
  auto o_ref = nan_vec(size_t(T * H * Dv)), o = nan_vec(size_t(T * H * Dv));
  k3::ref::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H, Dk, Dv, S_ref.data(),
                         o_ref.data());
  k3::ops::kda_chunked(k3::ops::kExact, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H, Dk,
                       Dv, 64, S.data(), o.data());
  ASSERT_EQ(count_nan(o), 0u);
  ASSERT_EQ(count_nan(S), 0u);
  EXPECT_LT(rel_l2(o, o_ref), kTolKda);
  EXPECT_LT(rel_l2(S, S_ref), kTolKda);
}

// ================================================================ MLA
struct MlaCase {
  int64_t heads, nope, rope, v, kv_lora, S, T;
  k3::WFormat fmt;
};

TEST(OpsTwins, MlaAbsorbedEqualsExpanded) {
  std::mt19937 rng(15);
  // pos0 = S - T: a cache of S tokens whose last T are the new queries.
  const MlaCase cases[] = {
      {1, 8, 4, 8, 20, 1, 1, k3::WFormat::F32},     {3, 12, 8, 10, 20, 9, 4, k3::WFormat::F32},
      {4, 24, 8, 16, 32, 7, 1, k3::WFormat::F32},   {2, 16, 8, 12, 32, 13, 13, k3::WFormat::BF16},
      {3, 10, 6, 7, 64, 11, 5, k3::WFormat::MXFP4},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("heads=" + std::to_string(c.heads) + " S=" + std::to_string(c.S) + " T=" + std::to_string(c.T) +
                 " fmt=" + k3::wformat_name(c.fmt));
    const int64_t dq = c.nope + c.rope, per = c.nope + c.v, pos0 = c.S - c.T;
    k3::MlaAttnDims d;
    d.heads = c.heads;
    d.nope = c.nope;
    d.rope = c.rope;
    d.v = c.v;
    d.kv_lora = c.kv_lora;
    d.scale = 1.0f / std::sqrt(float(dq));
    const float amp = c.fmt == k3::WFormat::MXFP4 ? 1.0f : 0.5f;  // MXFP4 values are scaled by 2^-7..2^3
    OwnedW kvb = make_weight(rng, c.fmt, c.heads * per, c.kv_lora, amp);
    const auto q = rand_vec(rng, size_t(c.T * c.heads * dq));
    const auto cl = rand_vec(rng, size_t(c.S * c.kv_lora));
    const auto kr = rand_vec(rng, size_t(c.S * c.rope));
    // Expand: k_nope[s,h,i] = Σ_l kv_b[h·per + i, l] c[s,l];  v[s,h,j] = Σ_l kv_b[h·per + nope + j, l] c[s,l].
    std::vector<float> kn(static_cast<size_t>(c.S * c.heads * c.nope)), vv(size_t(c.S * c.heads * c.v));
    for (int64_t s = 0; s < c.S; ++s)
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t i = 0; i < c.nope; ++i) {
          double acc = 0;
          for (int64_t l = 0; l < c.kv_lora; ++l)
            acc += double(kvb.w.at(h * per + i, l)) * cl[size_t(s * c.kv_lora + l)];
          kn[size_t((s * c.heads + h) * c.nope + i)] = float(acc);
        }
        for (int64_t j = 0; j < c.v; ++j) {
          double acc = 0;
          for (int64_t l = 0; l < c.kv_lora; ++l)
            acc += double(kvb.w.at(h * per + c.nope + j, l)) * cl[size_t(s * c.kv_lora + l)];
          vv[size_t((s * c.heads + h) * c.v + j)] = float(acc);
        }
      }
    const size_t nO = size_t(c.T * c.heads * c.v);
    auto e_ref = nan_vec(nO), e_ops = nan_vec(nO), a_ref = nan_vec(nO), a_ops = nan_vec(nO);
    k3::ref::mla_attend_expanded(q.data(), c.T, kn.data(), kr.data(), vv.data(), c.S, pos0, d, e_ref.data());
    k3::ops::mla_attend_expanded(k3::ops::kExact, q.data(), c.T, kn.data(), kr.data(), vv.data(), c.S, pos0, d,
                                 e_ops.data());
    k3::ref::mla_attend_absorbed(q.data(), c.T, cl.data(), kr.data(), c.S, pos0, kvb.w, d, a_ref.data());
    k3::ops::mla_attend_absorbed(k3::ops::kExact, q.data(), c.T, cl.data(), kr.data(), c.S, pos0, kvb.w, d,
                                 a_ops.data());
    for (const auto* o : {&e_ref, &e_ops, &a_ref, &a_ops}) ASSERT_EQ(count_nan(*o), 0u);
    EXPECT_LT(rel_l2(e_ops, e_ref), kTolMla) << "expanded: ops vs ref";
    EXPECT_LT(rel_l2(a_ref, e_ref), kTolMla) << "absorbed ref vs expanded ref";
    EXPECT_LT(rel_l2(a_ops, e_ref), kTolMla) << "absorbed ops vs expanded ref";
    EXPECT_LT(rel_l2(a_ops, a_ref), kTolMla) << "absorbed: ops vs ref";

    // Hand check of one output of the twin: last query, head 0, softmax over all S keys in double.
    {
      const int64_t t = c.T - 1, h = 0;
      std::vector<double> sc(static_cast<size_t>(c.S));
      double m = -1e300;
      for (int64_t s = 0; s < c.S; ++s) {
        double acc = 0;
        for (int64_t i = 0; i < c.nope; ++i)
          acc += double(q[size_t((t * c.heads + h) * dq + i)]) * kn[size_t((s * c.heads + h) * c.nope + i)];
        for (int64_t i = 0; i < c.rope; ++i)
          acc += double(q[size_t((t * c.heads + h) * dq + c.nope + i)]) * kr[size_t(s * c.rope + i)];
        sc[size_t(s)] = acc / std::sqrt(double(dq));
        m = std::max(m, sc[size_t(s)]);
      }
      double z = 0, o0 = 0;
      for (int64_t s = 0; s < c.S; ++s) z += std::exp(sc[size_t(s)] - m);
      for (int64_t s = 0; s < c.S; ++s) o0 += std::exp(sc[size_t(s)] - m) / z * vv[size_t((s * c.heads + h) * c.v)];
      EXPECT_NEAR(e_ref[size_t((t * c.heads + h) * c.v)], o0, 1e-5 * (1 + std::fabs(o0)));
    }
    // Causality: changing the last cached token changes only the last query's output.
    if (c.T > 1) {
      auto cl2 = cl;
      for (int64_t l = 0; l < c.kv_lora; ++l) cl2[size_t((c.S - 1) * c.kv_lora + l)] += 0.5f;
      auto a2 = nan_vec(nO);
      k3::ops::mla_attend_absorbed(k3::ops::kExact, q.data(), c.T, cl2.data(), kr.data(), c.S, pos0, kvb.w, d,
                                   a2.data());
      const size_t per_t = size_t(c.heads * c.v);
      for (size_t i = 0; i < (size_t(c.T) - 1) * per_t; ++i)
        EXPECT_EQ(a2[i], a_ops[i]) << "future token leaked, i=" << i;
      double diff = 0;
      for (size_t i = (size_t(c.T) - 1) * per_t; i < nO; ++i) diff += std::fabs(a2[i] - a_ops[i]);
      EXPECT_GT(diff, 0.0);
    }
  }
}

// ================================================================ router
TEST(OpsTwins, RouterTopkBiasChangesSelection) {
  // 8 experts, k = 2. Unbiased scores favour experts 0 and 1; the bias lifts 5 and 6 above them.
  const int64_t E = 8, K = 2;
  const float logits[E] = {2.0f, 1.5f, -0.3f, 0.1f, -1.0f, 0.4f, 0.3f, -2.0f};
  const float bias[E] = {-0.2f, -0.2f, 0.0f, 0.0f, 0.0f, 0.3f, 0.35f, 0.0f};
  double s[E], sel[E];
  for (int e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-double(logits[e])));
    sel[e] = s[e] + bias[e];
  }
  // Expected by hand: s+bias = {0.681, 0.618, 0.426, 0.525, 0.269, 0.899, 0.924, 0.119} → [6, 5].
  const int32_t expect_idx[K] = {6, 5};
  ASSERT_GT(sel[6], sel[5]);
  ASSERT_GT(sel[5], sel[0]);
  ASSERT_GT(s[0], s[5]);  // without the bias, expert 0 would be chosen: the bias changes the selection
  for (float scale : {1.0f, 2.5f}) {
    for (bool renorm : {true, false}) {
      for (int impl = 0; impl < 2; ++impl) {
        SCOPED_TRACE("impl=" + std::to_string(impl) + " renorm=" + std::to_string(renorm) +
                     " scale=" + std::to_string(scale));
        int32_t idx[K] = {-1, -1};
        float w[K] = {k3test::qnan(), k3test::qnan()};
        const k3test::OpImpl im{impl == 0 ? "ops" : "ref", impl != 0, k3::ops::kExact};
        K3_OP(im, router_topk)(logits, bias, E, K, renorm, scale, idx, w);
        EXPECT_EQ(idx[0], expect_idx[0]);
        EXPECT_EQ(idx[1], expect_idx[1]);
        const double sum = s[6] + s[5];
        for (int j = 0; j < K; ++j) {
          const double e = (renorm ? s[expect_idx[j]] / sum : s[expect_idx[j]]) * scale;  // UNBIASED s
          EXPECT_NEAR(w[j], e, kTolRouter * e);
        }
        if (renorm) {
          EXPECT_NEAR(double(w[0]) + w[1], scale, kTolRouter * scale);
        }
      }
    }
  }
}

TEST(OpsTwins, RouterTopkRandomTwin) {
  std::mt19937 rng(16);
  for (auto [E, K] : {std::pair<int64_t, int64_t>{8, 2}, {33, 5}, {128, 16}}) {
    SCOPED_TRACE("E=" + std::to_string(E) + " K=" + std::to_string(K));
    for (int rep = 0; rep < 20; ++rep) {
      const auto logits = rand_vec(rng, size_t(E), 0.01f, 4.0f);
      const auto bias = rand_vec(rng, size_t(E), 0.001f, 0.2f);
      std::vector<int32_t> i_ops(static_cast<size_t>(K), -1), i_ref(size_t(K), -1);
      auto w_ops = nan_vec(size_t(K)), w_ref = nan_vec(size_t(K));
      k3::ops::router_topk(k3::ops::kExact, logits.data(), bias.data(), E, K, true, 1.0f, i_ops.data(), w_ops.data());
      k3::ref::router_topk(logits.data(), bias.data(), E, K, true, 1.0f, i_ref.data(), w_ref.data());
      ASSERT_EQ(count_nan(w_ops), 0u);
      EXPECT_EQ(i_ops, i_ref);
      EXPECT_LT(rel_l2(w_ops, w_ref), kTolRouter);
      double sum = 0;
      for (float x : w_ops) sum += x;
      EXPECT_NEAR(sum, 1.0, 1e-6);
      // Indices are distinct and in descending order of s + bias.
      auto sel = [&](int32_t e) { return 1.0 / (1.0 + std::exp(-double(logits[size_t(e)]))) + bias[size_t(e)]; };
      for (int64_t j = 1; j < K; ++j) EXPECT_GE(sel(i_ops[size_t(j - 1)]), sel(i_ops[size_t(j)]));
      std::vector<int32_t> sorted = i_ops;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
    }
  }
}

// ================================================================ AttnRes
TEST(OpsTwins, AttnresMix) {
  std::mt19937 rng(17);
  for (auto [n_src, T, H] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 8}, {2, 3, 37}, {9, 4, 128}, {5, 1, 129}}) {
    SCOPED_TRACE("n_src=" + std::to_string(n_src) + " T=" + std::to_string(T) + " H=" + std::to_string(H));
    std::vector<std::vector<float>> src;
    std::vector<const float*> ptr;
    for (int64_t j = 0; j < n_src; ++j) src.push_back(rand_vec(rng, size_t(T * H), 0.05f, 1.0f + float(j)));
    for (auto& s : src) ptr.push_back(s.data());
    const auto fold = rand_vec(rng, size_t(H), 0.05f, 0.3f);
    auto a = nan_vec(size_t(T * H)), b = nan_vec(size_t(T * H));
    k3::ops::attnres_mix(k3::ops::kExact, ptr.data(), n_src, T, H, fold.data(), 1e-5f, a.data());
    k3::ref::attnres_mix(ptr.data(), n_src, T, H, fold.data(), 1e-5f, b.data());
    ASSERT_EQ(count_nan(a), 0u);
    ASSERT_EQ(count_nan(b), 0u);
    EXPECT_LT(rel_l2(a, b), kTolReduce);
    if (n_src == 1) {  // softmax over one source = 1: the raw value comes back
      EXPECT_LT(rel_l2(a, src[0]), 1e-6);
    }
    // Hand check of token 0, element 0 of the twin: raw values mixed, keys RMS-normalised.
    std::vector<double> sc(static_cast<size_t>(n_src));
    double m = -1e300;
    for (int64_t j = 0; j < n_src; ++j) {
      double dot = 0, ss = 0;
      for (int64_t i = 0; i < H; ++i) {
        dot += double(src[size_t(j)][size_t(i)]) * fold[size_t(i)];
        ss += double(src[size_t(j)][size_t(i)]) * src[size_t(j)][size_t(i)];
      }
      sc[size_t(j)] = dot / std::sqrt(ss / double(H) + 1e-5);
      m = std::max(m, sc[size_t(j)]);
    }
    double z = 0, o = 0;
    for (double x : sc) z += std::exp(x - m);
    for (int64_t j = 0; j < n_src; ++j) o += std::exp(sc[size_t(j)] - m) / z * src[size_t(j)][0];
    EXPECT_NEAR(b[0], o, 1e-6 * (1 + std::fabs(o)));
  }
}

}  // namespace
