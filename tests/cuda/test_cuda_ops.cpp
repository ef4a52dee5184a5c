// Device tests of the CUDA ops of cuda_ops.h except the matrix products: each kernel against its
// fp64 twin in k3::ref (or a double host loop), NaN-prefilled outputs, small odd shapes and K3
// shapes, KDA state carried across calls, MLA with the length on the device and a replayed graph;
// and the decode-size latency of the small ops (printed, with a same-bits check).
// Owns: nothing the engine uses (tolerances: tests/common/op_tolerances.h). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda_util.h"
#include "common/kda_inputs.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/ops.h"

namespace {

namespace cu = k3::cuda;
using k3test::count_nan;
using k3test::KdaInputs;
using k3test::kTolConv;
using k3test::kTolElementwise;
using k3test::kTolKda;
using k3test::kTolMla;
using k3test::kTolReduce;
using k3test::kTolRouter;
using k3test::make_kda;
using k3test::nan_vec;
using k3test::rand_vec;
using k3test::rel_l2;

template <class T>
cu::DevBuf up(const std::vector<T>& v) {
  return k3test::to_dev(v);
}
std::vector<float> down(const cu::DevBuf& b, size_t n) { return k3test::from_dev<float>(b, n); }
std::vector<int32_t> down_i(const cu::DevBuf& b, size_t n) { return k3test::from_dev<int32_t>(b, n); }

std::string dims(std::initializer_list<std::pair<const char*, int64_t>> kv) {
  std::string s;
  for (const auto& [k, v] : kv) s += std::string(s.empty() ? "" : " ") + k + "=" + std::to_string(v);
  return s;
}

// ================================================================ norms and elementwise
TEST(CudaOps, Rmsnorm) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(201);
  // n % 4 == 0: 16-byte paths (a warp per row up to 512, a block per row up to 8192, each thread
  // holding its float4s in registers); otherwise, or beyond 8192, the scalar kernels.
  for (auto [T, n] : {std::pair<int64_t, int64_t>{1, 7},
                      {3, 128},
                      {5, 333},
                      {1, 7168},
                      {3, 7168},
                      {96 * 2, 128},
                      {40, 512},
                      {2, 1500},
                      {1, 4096},
                      {1, 1024},
                      {3, 200},
                      {1, 8192},
                      {2, 10000}}) {
    for (bool with_w : {false, true}) {
      SCOPED_TRACE(dims({{"T", T}, {"n", n}, {"w", with_w}}));
      const auto x = rand_vec(rng, size_t(T * n), 0.05f, 3.0f);
      const auto w = rand_vec(rng, size_t(n), 0.5f, 1.5f);
      auto ref = nan_vec(x.size());
      k3::ref::rmsnorm(x.data(), T, n, with_w ? w.data() : nullptr, 1e-5f, ref.data());
      auto dx = up(x), dw = up(w), dout = k3test::dev_nan(x.size());
      cu::rmsnorm(dx.as<float>(), T, n, with_w ? dw.as<float>() : nullptr, 1e-5f, dout.as<float>(), nullptr);
      const auto got = down(dout, x.size());
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_LT(rel_l2(got, ref), kTolElementwise);
      // In place (the model normalises o and the LoRA latents in place): same numbers.
      cu::rmsnorm(dx.as<float>(), T, n, with_w ? dw.as<float>() : nullptr, 1e-5f, dx.as<float>(), nullptr);
      EXPECT_EQ(down(dx, x.size()), got);
    }
  }
}

// RMSNorm with the sigmoid output gate in one kernel (KDA's o_norm then gate): the bits of rmsnorm
// then sigmoid_gate_mul, in place and not, on the fused shapes (n % 4 == 0, n <= 512, aligned) and
// on the fallback (the two kernels).
TEST(CudaOps, RmsnormGateIsNormThenGate) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(231);
  for (auto [T, n, off] : {std::tuple<int64_t, int64_t, int64_t>{96, 128, 0},
                           {5, 64, 0},
                           {3, 256, 0},
                           {2, 512, 0},
                           {7, 100, 0},
                           {3, 37, 0},
                           {4, 1024, 0},
                           {6, 128, 1}}) {
    for (bool with_w : {false, true}) {
      SCOPED_TRACE(dims({{"T", T}, {"n", n}, {"offset", off}, {"w", with_w}}));
      const size_t len = size_t(T * n + off);
      const auto x = rand_vec(rng, len, 0.05f, 3.0f), g = rand_vec(rng, len, 0.05f, 4.0f);
      const auto w = rand_vec(rng, size_t(n + off), 0.5f, 1.5f);
      auto dx = up(x), dg = up(g), dw = up(w), dref = k3test::dev_nan(len), dout = k3test::dev_nan(len);
      const float* wp = with_w ? dw.as<float>() + off : nullptr;
      cu::rmsnorm(dx.as<float>() + off, T, n, wp, 1e-6f, dref.as<float>() + off, nullptr);
      cu::sigmoid_gate_mul(dref.as<float>() + off, dg.as<float>() + off, T * n, nullptr);
      cu::rmsnorm_gate(dx.as<float>() + off, T, n, wp, 1e-6f, dg.as<float>() + off, dout.as<float>() + off, nullptr);
      // (the elements from `off` on: the one before is the NaN fill or the input)
      const auto tail = [&](const cu::DevBuf& b) {
        const auto v = down(b, len);
        return std::vector<float>(v.begin() + off, v.end());
      };
      const auto want = tail(dref), got = tail(dout);
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_EQ(got, want);
      cu::rmsnorm_gate(dx.as<float>() + off, T, n, wp, 1e-6f, dg.as<float>() + off, dx.as<float>() + off, nullptr);
      EXPECT_EQ(tail(dx), want) << "in place";
    }
  }
}

// The MoE tail in one launch (the latent RMSNorm of the routed sum in place, the shared experts'
// SiTU GLU): the bits of rmsnorm and situ_glu, on the fused shapes, on the fallbacks (n % 4, an
// unaligned row, n > 8192) and with either half absent.
TEST(CudaOps, MoeTailIsNormAndSitu) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(241);
  struct Case {
    int64_t rows, n, n_situ, off;
  };
  for (const Case cs : {Case{1, 3584, 4096, 0}, Case{1, 256, 3, 0}, Case{64, 512, 64 * 1536, 0},
                        Case{512, 3584, 512 * 2048, 0}, Case{3, 102, 700, 0}, Case{2, 128, 300, 1},
                        Case{1, 9216, 50, 0}, Case{4, 512, 0, 0}, Case{0, 512, 1000, 0}}) {
    SCOPED_TRACE(dims({{"rows", cs.rows}, {"n", cs.n}, {"n_situ", cs.n_situ}, {"offset", cs.off}}));
    const size_t la = size_t(cs.rows * cs.n + cs.off), ls = size_t(std::max<int64_t>(cs.n_situ, 1));
    const auto a = rand_vec(rng, la, 0.05f, 3.0f), w = rand_vec(rng, size_t(cs.n + cs.off), 0.5f, 1.5f);
    const auto g = rand_vec(rng, ls, 0.05f, 6.0f), u = rand_vec(rng, ls, 0.05f, 6.0f);
    auto da = up(a), dw = up(w), dg = up(g), du = up(u);
    auto ra = up(a), rg = up(g);
    float* wp = dw.as<float>() + cs.off;
    // the reference: the two kernels
    cu::rmsnorm(ra.as<float>() + cs.off, cs.rows, cs.n, wp, 1e-6f, ra.as<float>() + cs.off, nullptr);
    cu::situ_glu(rg.as<float>(), du.as<float>(), cs.n_situ, 4.0f, 25.0f, rg.as<float>(), nullptr);
    cu::moe_tail(da.as<float>() + cs.off, cs.rows, cs.n, wp, 1e-6f, dg.as<float>(), du.as<float>(), cs.n_situ, 4.0f,
                 25.0f, nullptr);
    const auto got_a = down(da, la), got_g = down(dg, ls);
    ASSERT_EQ(count_nan(got_a), 0u);
    ASSERT_EQ(count_nan(got_g), 0u);
    EXPECT_EQ(got_a, down(ra, la)) << "the norm";
    EXPECT_EQ(got_g, down(rg, ls)) << "the SiTU GLU";
    if (cs.rows > 0 && cs.n_situ > 0) {  // and against the fp64 twins: the test of the two kernels holds
      std::vector<float> ref_g(ls);
      k3::ref::situ_glu(g.data(), u.data(), cs.n_situ, 4.0f, 25.0f, ref_g.data());
      EXPECT_LT(rel_l2(got_g, ref_g), kTolElementwise);
    }
  }
  EXPECT_THROW(cu::moe_tail(nullptr, -1, 8, nullptr, 1e-6f, nullptr, nullptr, 0, 0, 0, nullptr), k3::Error);
}

TEST(CudaOps, L2normScale) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(202);
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 16},
                         {7, 13},
                         {12, 128},
                         {96 * 3, 128},
                         {5, 33},
                         {2, 2000},
                         {32, 64},
                         {3, 384}}) {
    SCOPED_TRACE(dims({{"rows", rows}, {"n", n}}));
    const auto x = rand_vec(rng, size_t(rows * n), 0.05f, 2.0f);
    auto ref = x;
    const float scale = 1.0f / std::sqrt(float(n));
    k3::ref::l2norm_scale(ref.data(), rows, n, 1e-6f, scale);
    auto dx = up(x);
    cu::l2norm_scale(dx.as<float>(), rows, n, 1e-6f, scale, nullptr);
    const auto got = down(dx, x.size());
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, ref), kTolElementwise);
  }
}

TEST(CudaOps, SituGlu) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(203);
  for (int64_t n : {1, 17, 1000, 16 * 3072, 70001}) {
    for (float hi : {60.0f, 0.5f}) {  // saturated soft caps / small arguments
      SCOPED_TRACE(dims({{"n", n}}) + " hi=" + std::to_string(hi));
      const auto g = rand_vec(rng, size_t(n), 0.001f, hi), u = rand_vec(rng, size_t(n), 0.001f, hi);
      auto ref = nan_vec(size_t(n));
      k3::ref::situ_glu(g.data(), u.data(), n, 4.0f, 25.0f, ref.data());
      auto dg = up(g), du = up(u), dout = k3test::dev_nan(size_t(n));
      cu::situ_glu(dg.as<float>(), du.as<float>(), n, 4.0f, 25.0f, dout.as<float>(), nullptr);
      const auto got = down(dout, size_t(n));
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_LT(rel_l2(got, ref), kTolElementwise);
      EXPECT_TRUE(k3test::all_close(got, ref, 1e-30, 1e-5));
      // out aliasing g (the model writes the product over the gate buffer).
      cu::situ_glu(dg.as<float>(), du.as<float>(), n, 4.0f, 25.0f, dg.as<float>(), nullptr);
      EXPECT_EQ(down(dg, size_t(n)), got);
    }
  }
}

TEST(CudaOps, KdaGate) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(204);
  for (auto [T, H, D] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 1, 5}, {3, 4, 16}, {7, 3, 33}, {1, 96, 128}, {9, 96, 128}}) {
    SCOPED_TRACE(dims({{"T", T}, {"H", H}, {"D", D}}));
    const auto f = rand_vec(rng, size_t(T * H * D), 0.01f, 8.0f);
    const auto A_log = rand_vec(rng, size_t(H), 0.05f, 1.0f);
    const auto dt = rand_vec(rng, size_t(H * D), 0.05f, 1.0f);
    auto ref = nan_vec(f.size());
    k3::ref::kda_gate(f.data(), T, H, D, A_log.data(), dt.data(), -5.0f, ref.data());
    auto df = up(f), da = up(A_log), ddt = up(dt), dg = k3test::dev_nan(f.size());
    cu::kda_gate(df.as<float>(), T, H, D, da.as<float>(), ddt.as<float>(), -5.0f, dg.as<float>(), nullptr);
    const auto got = down(dg, f.size());
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, ref), kTolElementwise);
    EXPECT_TRUE(k3test::all_close(got, ref, 1e-30, 1e-5));
  }
}

TEST(CudaOps, SigmoidGateAndAdd) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(205);
  for (int64_t n : {1, 33, 12288, 100003}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const auto x = rand_vec(rng, size_t(n), 0.01f, 12.0f), gt = rand_vec(rng, size_t(n), 0.01f, 12.0f);
    std::vector<float> sig(static_cast<size_t>(n)), gated(static_cast<size_t>(n)), sum(static_cast<size_t>(n));
    for (size_t i = 0; i < size_t(n); ++i) {
      const double s = 1.0 / (1.0 + std::exp(-double(x[i])));
      sig[i] = float(s);
      gated[i] = float(double(x[i]) / (1.0 + std::exp(-double(gt[i]))));
      sum[i] = float(double(x[i]) + double(gt[i]));
    }
    auto a = up(x), b = up(x), c = up(x), dgt = up(gt);
    cu::sigmoid_inplace(a.as<float>(), n, nullptr);
    cu::sigmoid_gate_mul(b.as<float>(), dgt.as<float>(), n, nullptr);
    cu::add_inplace(c.as<float>(), dgt.as<float>(), n, nullptr);
    EXPECT_LT(rel_l2(down(a, size_t(n)), sig), kTolElementwise);
    EXPECT_LT(rel_l2(down(b, size_t(n)), gated), kTolElementwise);
    EXPECT_EQ(down(c, size_t(n)), sum);  // one fp32 add: exact against the rounded double sum
  }
}

TEST(CudaOps, ShortConvSiluWithCarriedState) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(206);
  for (auto [C, K, T1, T2] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{5, 4, 1, 1},
                              {37, 4, 3, 6},
                              {64, 4, 7, 1},
                              {9, 2, 4, 5},
                              {16, 3, 1, 9},
                              {12288, 4, 1, 1},
                              {3000, 4, 40, 33},
                              {33, 1, 2, 2},
                              {20, 7, 2, 70},
                              {12288, 4, 70, 2}}) {
    SCOPED_TRACE(dims({{"C", C}, {"K", K}, {"T1", T1}, {"T2", T2}}));
    const int64_t T = T1 + T2, P = K - 1;
    const auto x = rand_vec(rng, size_t(T * C), 0.05f, 2.0f);
    const auto w = rand_vec(rng, size_t(C * K), 0.05f, 1.0f);
    const auto s0 = rand_vec(rng, size_t(C * std::max<int64_t>(P, 1)), 0.05f, 1.0f);
    auto st_ref = s0;
    auto o_ref = nan_vec(size_t(T * C));
    k3::ref::short_conv_silu(x.data(), T, C, w.data(), K, st_ref.data(), o_ref.data());
    auto dx = up(x), dw = up(w), dst = up(s0), dout = k3test::dev_nan(size_t(T * C));
    cu::short_conv_silu(dx.as<float>(), T, C, dw.as<float>(), K, dst.as<float>(), dout.as<float>(), nullptr);
    const auto o = down(dout, size_t(T * C));
    ASSERT_EQ(count_nan(o), 0u);
    EXPECT_LT(rel_l2(o, o_ref), kTolConv);
    if (P > 0) {  // the state holds exact copies of inputs
      EXPECT_EQ(down(dst, size_t(C * P)), std::vector<float>(st_ref.begin(), st_ref.begin() + C * P));
    }
    // Two calls carrying the state equal one call, bit for bit.
    auto dst2 = up(s0), dout2 = k3test::dev_nan(size_t(T * C));
    cu::short_conv_silu(dx.as<float>(), T1, C, dw.as<float>(), K, dst2.as<float>(), dout2.as<float>(), nullptr);
    cu::short_conv_silu(dx.as<float>() + T1 * C, T2, C, dw.as<float>(), K, dst2.as<float>(), dout2.as<float>() + T1 * C,
                        nullptr);
    EXPECT_EQ(down(dout2, size_t(T * C)), o);
    if (P > 0) {
      EXPECT_EQ(down(dst2, size_t(C * P)), down(dst, size_t(C * P)));
    }
  }
}

TEST(CudaOps, EmbedRowsAllFormats) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(207);
  for (k3::WFormat fmt : {k3::WFormat::F32, k3::WFormat::F16, k3::WFormat::BF16}) {
    for (auto [V, D] : {std::pair<int64_t, int64_t>{11, 7}, {300, 7168}}) {
      SCOPED_TRACE(std::string(k3::wformat_name(fmt)) + " " + dims({{"V", V}, {"D", D}}));
      k3test::OwnedW E = k3test::make_weight(rng, fmt, V, D);
      const std::vector<int32_t> ids = {0, int32_t(V - 1), 3, 3, int32_t(V / 2)};
      const auto T = int64_t(ids.size());
      k3test::DevWeight dE = k3test::upload_weight(E.w);
      auto dids = up(ids), dout = k3test::dev_nan(size_t(T * D));
      cu::embed_rows(dE.view, dids.as<int32_t>(), T, dout.as<float>(), nullptr);
      const auto got = down(dout, size_t(T * D));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < D; ++c) ASSERT_EQ(got[size_t(t * D + c)], E.w.at(ids[size_t(t)], c)) << t << "," << c;
    }
  }
}

TEST(CudaOps, ArgmaxRowsLowestIndexOnTies) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(208);
  for (auto [T, V] : {std::pair<int64_t, int64_t>{1, 1}, {3, 37}, {4, 5000}, {2, 163840}}) {
    SCOPED_TRACE(dims({{"T", T}, {"V", V}}));
    auto x = rand_vec(rng, size_t(T * V), 0.05f, 10.0f);
    // Row 1 (if any): the maximum appears three times; the lowest index must win.
    if (T > 1 && V > 30) {
      for (int64_t v = 0; v < V; ++v) x[size_t(V + v)] = std::min(x[size_t(V + v)], 9.0f);
      for (int64_t v : {int64_t(29), int64_t(7), V - 1}) x[size_t(V + v)] = 12.5f;
    }
    std::vector<int32_t> ref(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      int32_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (x[size_t(t * V + v)] > x[size_t(t * V + best)]) best = int32_t(v);
      ref[size_t(t)] = best;
    }
    if (T > 1 && V > 30) {
      ASSERT_EQ(ref[1], 7);
    }
    auto dx = up(x), dout = up(std::vector<int32_t>(size_t(T), -7));
    cu::argmax_rows(dx.as<float>(), T, V, dout.as<int32_t>(), nullptr);
    EXPECT_EQ(down_i(dout, size_t(T)), ref);
  }
}

TEST(CudaOps, AttnresMix) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(209);
  // T <= 64: one cluster of blocks per token (hidden split across them); larger T: a block per token.
  for (auto [n_src, T, H] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 8},
                             {2, 3, 37},
                             {9, 4, 128},
                             {5, 1, 129},
                             {9, 1, 7168},
                             {9, 3, 7168},
                             {3, 40, 100},
                             {32, 2, 1000},
                             {3, 1, 4096},
                             {17, 1, 4100},
                             {4, 70, 256},
                             {32, 1, 7168}}) {
    SCOPED_TRACE(dims({{"n_src", n_src}, {"T", T}, {"H", H}}));
    std::vector<std::vector<float>> src;
    std::vector<const float*> ptr;
    std::vector<cu::DevBuf> dsrc;
    std::vector<const float*> dptr;
    for (int64_t j = 0; j < n_src; ++j) src.push_back(rand_vec(rng, size_t(T * H), 0.05f, 1.0f + float(j % 5)));
    for (auto& s : src) {
      ptr.push_back(s.data());
      dsrc.push_back(up(s));
      dptr.push_back(dsrc.back().as<float>());
    }
    const auto fold = rand_vec(rng, size_t(H), 0.05f, 0.3f);
    auto ref = nan_vec(size_t(T * H));
    k3::ref::attnres_mix(ptr.data(), n_src, T, H, fold.data(), 1e-5f, ref.data());
    auto dfold = up(fold), dout = k3test::dev_nan(size_t(T * H));
    cu::attnres_mix(dptr.data(), n_src, T, H, dfold.as<float>(), 1e-5f, dout.as<float>(), nullptr);
    const auto got = down(dout, size_t(T * H));
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, ref), kTolReduce);
    // Deterministic, and the same bits on a created stream (the model's launch path).
    cu::Stream st = cu::stream_create();
    auto dout2 = k3test::dev_nan(size_t(T * H));
    cu::attnres_mix(dptr.data(), n_src, T, H, dfold.as<float>(), 1e-5f, dout2.as<float>(), st);
    cu::sync(st);
    cu::stream_destroy(st);
    EXPECT_EQ(down(dout2, size_t(T * H)), got);
  }
  // More sources than the kernel's pointer list holds: a one-line k3::Error, nothing launched.
  std::vector<const float*> too_many(size_t(cu::kMaxAttnResSources + 1), nullptr);
  try {
    cu::attnres_mix(too_many.data(), int64_t(too_many.size()), 1, 8, nullptr, 1e-5f, nullptr, nullptr);
    FAIL() << "33 sources were accepted";
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("attnres_mix"), std::string::npos) << e.what();
  }
}

// One residual site in one kernel (Backend::residual_norm) against the separate kernels in that order
// (add or copy, attnres_mix over the blocks and the new partial sum, rmsnorm): the new partial sum
// bit for bit, xn within kTolElementwise (only the order of the norm's fp64 sum differs; fp64 sums of
// fp32 squares round the same nearly always), and the same bits again on a created stream. With a
// second part y2 (the MoE's shared experts), the reference first adds y2 into y (the MoE's own add);
// the fused kernel leaves y as it was.
TEST(CudaOps, ResidualNormIsTheSeparateOps) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(227);
  enum Y { None, Add, Replace };
  struct Case {
    int64_t blocks, T, H;
    bool mix;
    Y y;
    bool misalign;  // pointers one float off 16 bytes: the scalar path
  };
  const Case cases[] = {{0, 1, 8, false, Add, false},     {0, 1, 7168, false, Add, false},
                        {0, 3, 4096, false, None, false},  {0, 70, 256, false, Add, false},
                        {0, 1, 7168, true, None, false},   {3, 1, 7168, true, Add, false},
                        {3, 1, 7168, true, Replace, false}, {8, 2, 7168, true, Add, false},
                        {2, 3, 37, true, Add, false},       {5, 1, 129, true, Replace, false},
                        {9, 64, 1000, true, Add, false},    {9, 65, 1000, true, Add, false},
                        {3, 200, 4096, true, Add, false},   {17, 1, 4100, true, Add, false},
                        {31, 2, 7168, true, Add, false},    {31, 70, 512, true, Replace, false},
                        {4, 1, 4096, true, Add, true},      {4, 90, 4096, true, Add, true},
                        {0, 90, 4096, false, Add, true}};
  for (const Case& c : cases)
  for (bool two : {false, true}) {
    if (two && c.y == None) continue;
    SCOPED_TRACE(dims({{"blocks", c.blocks}, {"T", c.T}, {"H", c.H}, {"mix", c.mix}, {"y", int64_t(c.y)},
                       {"misalign", c.misalign}, {"y2", two}}));
    const int64_t n = c.T * c.H, off = c.misalign ? 1 : 0;
    std::vector<cu::DevBuf> dblk;
    std::vector<const float*> bptr;
    for (int64_t j = 0; j < c.blocks; ++j) {
      dblk.push_back(up(rand_vec(rng, size_t(n + off), 0.05f, 1.0f + float(j % 5))));
      bptr.push_back(dblk.back().as<float>() + off);
    }
    const auto partial0 = rand_vec(rng, size_t(n + off), 0.05f, 2.0f), y = rand_vec(rng, size_t(n + off), 0.05f, 1.5f);
    const auto y2 = rand_vec(rng, size_t(n + off), 0.05f, 1.0f);
    auto dy = up(y), dy2 = up(y2), dysum = up(y), dfold = up(rand_vec(rng, size_t(c.H + off), 0.05f, 0.3f)),
         dw = up(rand_vec(rng, size_t(c.H + off), 0.5f, 1.5f));
    const float* yp = c.y == None ? nullptr : dy.as<float>() + off;
    const float* y2p = two ? dy2.as<float>() + off : nullptr;
    if (two) cu::add_inplace(dysum.as<float>() + off, y2p, n, nullptr);  // what the MoE added itself
    const float* yr = c.y == None ? nullptr : dysum.as<float>() + off;
    const float* fold = c.mix ? dfold.as<float>() + off : nullptr;
    const float* w = dw.as<float>() + off;
    // The separate kernels.
    auto p_ref = up(partial0), a_ref = k3test::dev_nan(size_t(n + off)), x_ref = k3test::dev_nan(size_t(n + off));
    float* pr = p_ref.as<float>() + off;
    if (c.y == Add) cu::add_inplace(pr, yr, n, nullptr);
    if (c.y == Replace) cu::d2d(pr, yr, size_t(n) * 4, nullptr);
    const float* xr = pr;
    if (c.mix) {
      std::vector<const float*> src = bptr;
      src.push_back(pr);
      cu::attnres_mix(src.data(), int64_t(src.size()), c.T, c.H, fold, 1e-5f, a_ref.as<float>() + off, nullptr);
      xr = a_ref.as<float>() + off;
    }
    cu::rmsnorm(xr, c.T, c.H, w, 1e-6f, x_ref.as<float>() + off, nullptr);
    // The fused kernel.
    auto p_got = up(partial0), x_got = k3test::dev_nan(size_t(n + off));
    cu::residual_norm(bptr.data(), c.blocks, p_got.as<float>() + off, yp, y2p, c.y == Replace, fold, 1e-5f, w, 1e-6f,
                      c.T, c.H, x_got.as<float>() + off, nullptr);
    // (the elements from `off` on: the one before is the NaN fill or the input)
    const auto tail = [&](const cu::DevBuf& b) {
      const auto v = down(b, size_t(n + off));
      return std::vector<float>(v.begin() + off, v.end());
    };
    const auto want = tail(x_ref), got = tail(x_got);
    EXPECT_EQ(tail(p_got), tail(p_ref)) << "the new partial sum";
    EXPECT_EQ(down(dy, size_t(n + off)), y) << "y is read only";
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, want), kTolElementwise);
    // Deterministic, and the same bits on a created stream (the model's launch path).
    cu::Stream st = cu::stream_create();
    auto p2 = up(partial0), x2 = k3test::dev_nan(size_t(n + off));
    cu::residual_norm(bptr.data(), c.blocks, p2.as<float>() + off, yp, y2p, c.y == Replace, fold, 1e-5f, w, 1e-6f, c.T,
                      c.H, x2.as<float>() + off, st);
    cu::sync(st);
    cu::stream_destroy(st);
    EXPECT_EQ(tail(x2), got);
  }
  // Bad arguments: one-line k3::Errors naming the op, nothing launched.
  std::vector<const float*> too_many(size_t(cu::kMaxAttnResSources), nullptr);
  auto buf = k3test::dev_nan(64);
  float* b = buf.as<float>();
  const auto refused = [](const char* what, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << " was accepted";
    } catch (const k3::Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("residual_norm"), std::string::npos) << e.what();
    }
  };
  refused("32 blocks", [&] {
    cu::residual_norm(too_many.data(), int64_t(too_many.size()), b, nullptr, nullptr, false, b + 8, 1e-5f, b + 16, 1e-6f, 1, 8,
                      b + 24, nullptr);
  });
  refused("blocks without scores", [&] {
    cu::residual_norm(too_many.data(), 1, b, nullptr, nullptr, false, nullptr, 1e-5f, b + 16, 1e-6f, 1, 8, b + 24, nullptr);
  });
  refused("xn == partial",
          [&] { cu::residual_norm(nullptr, 0, b, nullptr, nullptr, false, nullptr, 1e-5f, b + 16, 1e-6f, 1, 8, b, nullptr); });
  refused("no norm weight",
          [&] { cu::residual_norm(nullptr, 0, b, nullptr, nullptr, false, nullptr, 1e-5f, nullptr, 1e-6f, 1, 8, b + 8, nullptr); });
  refused("y2 without y", [&] {
    cu::residual_norm(nullptr, 0, b, nullptr, b + 32, false, nullptr, 1e-5f, b + 16, 1e-6f, 1, 8, b + 8, nullptr);
  });
}

// ================================================================ KDA
struct KdaRun {
  std::vector<float> o, S;
};

KdaRun kda_twin(const KdaInputs& in, int64_t T, int64_t H, int64_t Dk, int64_t Dv) {
  KdaRun r{nan_vec(size_t(T * H * Dv)), in.S0};
  k3::ref::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, H, Dk, Dv, r.S.data(),
                         r.o.data());
  return r;
}

struct KdaDev {
  cu::DevBuf q, k, v, g, beta;
  explicit KdaDev(const KdaInputs& in) : q(up(in.q)), k(up(in.k)), v(up(in.v)), g(up(in.g)), beta(up(in.beta)) {}
};

// The device op (recurrent, or chunked with `chunk`) over tokens [t0, t1) from state S, into o.
void kda_dev(int64_t chunk, const KdaDev& d, int64_t t0, int64_t t1, int64_t H, int64_t Dk, int64_t Dv, float* S,
             float* o) {
  const int64_t T = t1 - t0, qk = t0 * H * Dk, vo = t0 * H * Dv, b = t0 * H;
  if (chunk > 0)
    cu::kda_chunked(d.q.as<float>() + qk, d.k.as<float>() + qk, d.v.as<float>() + vo, d.g.as<float>() + qk,
                    d.beta.as<float>() + b, T, H, Dk, Dv, chunk, S, o, nullptr);
  else
    cu::kda_recurrent(d.q.as<float>() + qk, d.k.as<float>() + qk, d.v.as<float>() + vo, d.g.as<float>() + qk,
                      d.beta.as<float>() + b, T, H, Dk, Dv, S, o, nullptr);
}

TEST(CudaOps, KdaRecurrentTwinAndCarriedState) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(210);
  for (auto [T, H, Dk, Dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 16, 16},
                              {1, 3, 16, 8},
                              {9, 2, 12, 20},
                              {70, 3, 16, 16},
                              {5, 2, 33, 70},
                              {1, 96, 128, 128},
                              {6, 4, 128, 128},
                              {4, 2, 256, 256},
                              {3, 2, 200, 40},
                              {7, 96, 128, 128}}) {
    SCOPED_TRACE(dims({{"T", T}, {"H", H}, {"Dk", Dk}, {"Dv", Dv}}));
    const auto in = make_kda(rng, T, H, Dk, Dv);
    const KdaRun ref = kda_twin(in, T, H, Dk, Dv);
    const KdaDev d(in);
    const size_t nO = size_t(T * H * Dv), nS = in.S0.size();
    // One call.
    auto S = up(in.S0), o = k3test::dev_nan(nO);
    kda_dev(0, d, 0, T, H, Dk, Dv, S.as<float>(), o.as<float>());
    const auto o1 = down(o, nO);
    ASSERT_EQ(count_nan(o1), 0u);
    EXPECT_LT(rel_l2(o1, ref.o), kTolKda);
    EXPECT_LT(rel_l2(down(S, nS), ref.S), kTolKda);
    // Decode: one token per call, state carried.
    auto S2 = up(in.S0), o2 = k3test::dev_nan(nO);
    for (int64_t t = 0; t < T; ++t) kda_dev(0, d, t, t + 1, H, Dk, Dv, S2.as<float>(), o2.as<float>() + t * H * Dv);
    const auto o2h = down(o2, nO);
    ASSERT_EQ(count_nan(o2h), 0u);
    EXPECT_EQ(o2h, o1);  // the same per-token arithmetic whether the tokens come in one call or many
    EXPECT_EQ(down(S2, nS), down(S, nS));
  }
}

TEST(CudaOps, KdaChunkedMatchesRecurrenceWithCarriedState) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(211);
  struct C {
    int64_t T, H, Dk, Dv, split;
  };
  // T not a multiple of any chunk; splits inside chunks; odd Dk/Dv; Dv over one 32-column block;
  // Dk = Dv = 256 (the limit); the K3 head shape with all 96 heads.
  const C cases[] = {{1, 2, 16, 16, 0},     {5, 2, 16, 8, 2},     {37, 3, 16, 16, 20},   {131, 2, 16, 16, 67},
                     {70, 1, 32, 24, 1},    {45, 2, 12, 20, 17},  {64, 2, 128, 128, 31}, {40, 3, 33, 129, 39},
                     {30, 1, 256, 256, 13}, {21, 96, 128, 128, 9}};
  for (const auto& c : cases) {
    const auto in = make_kda(rng, c.T, c.H, c.Dk, c.Dv);
    const KdaRun ref = kda_twin(in, c.T, c.H, c.Dk, c.Dv);
    const KdaDev d(in);
    const size_t nO = size_t(c.T * c.H * c.Dv), nS = in.S0.size();
    for (int64_t chunk : {4, 16, 64, 3}) {
      SCOPED_TRACE(dims({{"T", c.T}, {"H", c.H}, {"Dk", c.Dk}, {"Dv", c.Dv}, {"chunk", chunk}}));
      auto S = up(in.S0), o = k3test::dev_nan(nO);
      kda_dev(chunk, d, 0, c.T, c.H, c.Dk, c.Dv, S.as<float>(), o.as<float>());
      const auto oh = down(o, nO);
      ASSERT_EQ(count_nan(oh), 0u);
      EXPECT_LT(rel_l2(oh, ref.o), kTolKda) << "single call, output";
      EXPECT_LT(rel_l2(down(S, nS), ref.S), kTolKda) << "single call, final state";
      if (c.split > 0) {
        auto S2 = up(in.S0), o2 = k3test::dev_nan(nO);
        kda_dev(chunk, d, 0, c.split, c.H, c.Dk, c.Dv, S2.as<float>(), o2.as<float>());
        kda_dev(chunk, d, c.split, c.T, c.H, c.Dk, c.Dv, S2.as<float>(), o2.as<float>() + c.split * c.H * c.Dv);
        const auto o2h = down(o2, nO);
        ASSERT_EQ(count_nan(o2h), 0u);
        EXPECT_LT(rel_l2(o2h, ref.o), kTolKda) << "split at " << c.split << ", output";
        EXPECT_LT(rel_l2(down(S2, nS), ref.S), kTolKda) << "split at " << c.split << ", final state";
      }
    }
  }
}

TEST(CudaOps, KdaChunkedStrongDecayCutsChunks) {
  K3_REQUIRE_GPU();
  // Constant log-decays -4.99 (the K3 bound), -30 (chunks of 2 tokens), -100 (every token its own
  // chunk; e^-100 underflows fp32); mixed: random channels at -60. Chunked must equal the recurrence.
  std::mt19937 rng(212);
  const int64_t T = 100, H = 2, Dk = 16, Dv = 40;
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
    const KdaDev d(in);
    for (int64_t chunk : {0, 64}) {
      SCOPED_TRACE(chunk ? "chunked" : "recurrent");
      auto S = up(in.S0), o = k3test::dev_nan(size_t(T * H * Dv));
      kda_dev(chunk, d, 0, T, H, Dk, Dv, S.as<float>(), o.as<float>());
      const auto oh = down(o, size_t(T * H * Dv)), Sh = down(S, in.S0.size());
      ASSERT_EQ(count_nan(oh), 0u);
      ASSERT_EQ(count_nan(Sh), 0u);
      EXPECT_LT(rel_l2(oh, ref.o), kTolKda);
      EXPECT_LT(rel_l2(Sh, ref.S), kTolKda);
    }
  }
}

// ================================================================ MLA
struct MlaCase {
  int64_t heads, nope, rope, v, kv_lora, pos0, T;
  k3::WFormat fmt;
};

std::string mla_name(const MlaCase& c) {
  return dims({{"heads", c.heads},
               {"nope", c.nope},
               {"rope", c.rope},
               {"v", c.v},
               {"L", c.kv_lora},
               {"pos0", c.pos0},
               {"T", c.T}}) +
         " " + k3::wformat_name(c.fmt);
}

k3::MlaAttnDims mla_dims(const MlaCase& c) {
  return k3::MlaAttnDims{c.heads, c.nope, c.rope, c.v, c.kv_lora, 1.0f / std::sqrt(float(c.nope + c.rope))};
}

TEST(CudaOps, MlaAbsorbedMatchesTwin) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(213);
  // Decode (T = 1) with pos0 = 0 and > 0, a long cache (key splits), prefill with pos0 = 0 and > 0,
  // T across the GEMV/tiled boundary (8) and the split counts, heads not a multiple of the group,
  // kv_lora in each register-tiling class (<= 256, <= 512, <= 1024), every weight format, widths
  // that rule out the 16-byte load paths (kv_lora 20 in bf16, 30; rope 6), and the K3 shapes
  // (96 heads, nope 128, rope 64, v 128, kv_lora 512).
  const MlaCase cases[] = {
      {1, 8, 4, 8, 20, 0, 1, k3::WFormat::F32},          {3, 12, 8, 10, 20, 7, 1, k3::WFormat::F32},
      {4, 24, 8, 16, 32, 0, 9, k3::WFormat::BF16},       {2, 16, 8, 12, 32, 13, 5, k3::WFormat::F16},
      {17, 16, 8, 24, 96, 40, 12, k3::WFormat::BF16},    {5, 16, 8, 16, 64, 1500, 1, k3::WFormat::BF16},
      {3, 8, 4, 8, 300, 50, 40, k3::WFormat::F32},       {2, 8, 4, 8, 600, 20, 3, k3::WFormat::F32},
      {33, 16, 8, 16, 64, 0, 70, k3::WFormat::F16},      {3, 12, 8, 10, 20, 4, 2, k3::WFormat::BF16},
      {3, 10, 6, 7, 30, 9, 3, k3::WFormat::F16},         {96, 128, 64, 128, 512, 33, 1, k3::WFormat::BF16},
      {96, 128, 64, 128, 512, 20, 4, k3::WFormat::BF16}, {96, 128, 64, 128, 512, 0, 10, k3::WFormat::BF16},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(mla_name(c));
    const k3::MlaAttnDims d = mla_dims(c);
    const int64_t dq = c.nope + c.rope, S = c.pos0 + c.T, cap = S + 5;
    k3test::OwnedW kvb = k3test::make_weight(rng, c.fmt, c.heads * (c.nope + c.v), c.kv_lora, 0.5f);
    const auto q = rand_vec(rng, size_t(c.T * c.heads * dq));
    const auto cl = rand_vec(rng, size_t(S * c.kv_lora)), kr = rand_vec(rng, size_t(S * c.rope));
    const size_t nO = size_t(c.T * c.heads * c.v);
    auto ref = nan_vec(nO);
    k3::ref::mla_attend_absorbed(q.data(), c.T, cl.data(), kr.data(), S, c.pos0, kvb.w, d, ref.data());
    // Device cache with capacity beyond S filled with NaN: a read past the visible keys would show.
    auto cl_cap = cl, kr_cap = kr;
    cl_cap.resize(size_t(cap * c.kv_lora), k3test::qnan());
    kr_cap.resize(size_t(cap * c.rope), k3test::qnan());
    k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
    auto dq_ = up(q), dc = up(cl_cap), dkr = up(kr_cap), dlen = up(std::vector<int32_t>{int32_t(c.pos0)});
    auto work = k3test::dev_nan(size_t(cu::mla_absorbed_work_floats(c.T, d)));
    for (cu::Precision p : {cu::Precision::F32, cu::Precision::BF16}) {
      SCOPED_TRACE(p == cu::Precision::F32 ? "fp32" : "bf16");
      auto dout = k3test::dev_nan(nO);
      cu::mla_attend_absorbed(dq_.as<float>(), c.T, dc.as<float>(), dkr.as<float>(), dlen.as<int32_t>(), dkvb.view, d,
                              work.as<float>(), dout.as<float>(), p, nullptr);
      const auto got = down(dout, nO);
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_LT(rel_l2(got, ref), kTolMla);
    }
    EXPECT_EQ(down_i(dlen, 1)[0], int32_t(c.pos0));  // attention never moves the length
  }
}

TEST(CudaOps, MlaCacheAppend) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(214);
  for (auto [L, R, pos0, T] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{20, 4, 0, 1},
                               {32, 8, 5, 3},
                               {512, 64, 17, 1},
                               {512, 64, 0, 40}}) {
    SCOPED_TRACE(dims({{"L", L}, {"R", R}, {"pos0", pos0}, {"T", T}}));
    const int64_t cap = pos0 + T + 2;
    const auto ckv = rand_vec(rng, size_t(T * (L + R)), 0.05f, 3.0f), w = rand_vec(rng, size_t(L), 0.5f, 1.5f);
    const auto c0 = rand_vec(rng, size_t(cap * L)), k0 = rand_vec(rng, size_t(cap * R));
    auto c_ref = c0, k_ref = k0;
    for (int64_t t = 0; t < T; ++t) {
      k3::ref::rmsnorm(ckv.data() + t * (L + R), 1, L, w.data(), 1e-6f, c_ref.data() + (pos0 + t) * L);
      std::copy_n(ckv.data() + t * (L + R) + L, R, k_ref.data() + (pos0 + t) * R);
    }
    auto dckv = up(ckv), dw = up(w), dc = up(c0), dk = up(k0), dlen = up(std::vector<int32_t>{int32_t(pos0)});
    cu::mla_cache_append(dckv.as<float>(), T, L, R, dw.as<float>(), 1e-6f, dlen.as<int32_t>(), dc.as<float>(),
                         dk.as<float>(), nullptr);
    const auto c = down(dc, c0.size()), k = down(dk, k0.size());
    EXPECT_EQ(k, k_ref);  // raw copy
    // Rows outside [pos0, pos0 + T) untouched; the appended rows normalised.
    for (int64_t s = 0; s < cap; ++s) {
      const std::vector<float> a(c.begin() + s * L, c.begin() + (s + 1) * L),
          b(c_ref.begin() + s * L, c_ref.begin() + (s + 1) * L);
      if (s < pos0 || s >= pos0 + T)
        EXPECT_EQ(a, b) << "row " << s;
      else
        EXPECT_LT(rel_l2(a, b), kTolElementwise) << "row " << s;
    }
    cu::advance_len(dlen.as<int32_t>(), T, nullptr);
    EXPECT_EQ(down_i(dlen, 1)[0], int32_t(pos0 + T));
  }
}

// A decode step (append + attend + advance) captured once as a graph and replayed 3 times with new
// inputs each time: the length grows on the device and the attention sees it (the grid is fixed).
TEST(CudaOps, MlaDecodeGraphReplayGrowsCache) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(215);
  for (const MlaCase& c :
       {MlaCase{5, 16, 8, 12, 64, 6, 1, k3::WFormat::BF16}, MlaCase{96, 128, 64, 128, 512, 40, 1, k3::WFormat::BF16}}) {
    SCOPED_TRACE(mla_name(c));
    const k3::MlaAttnDims d = mla_dims(c);
    const int64_t L = c.kv_lora, R = c.rope, dq = c.nope + c.rope, steps = 3, cap = c.pos0 + steps;
    const float eps = 1e-6f;
    k3test::OwnedW kvb = k3test::make_weight(rng, c.fmt, c.heads * (c.nope + c.v), L, 0.5f);
    const auto norm_w = rand_vec(rng, size_t(L), 0.5f, 1.5f);
    // Host mirror of the cache: pos0 tokens already there.
    std::vector<float> hc = rand_vec(rng, size_t(c.pos0 * L)), hk = rand_vec(rng, size_t(c.pos0 * R));
    auto init_c = hc, init_k = hk;
    init_c.resize(size_t(cap * L), k3test::qnan());
    init_k.resize(size_t(cap * R), k3test::qnan());
    k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
    auto dc = up(init_c), dk = up(init_k), dlen = up(std::vector<int32_t>{int32_t(c.pos0)}), dnw = up(norm_w);
    auto dckv = k3test::dev_nan(size_t(L + R)), dq_ = k3test::dev_nan(size_t(c.heads * dq));
    auto dout = k3test::dev_nan(size_t(c.heads * c.v));
    auto work = k3test::dev_nan(size_t(cu::mla_absorbed_work_floats(1, d)));
    cu::Stream s = cu::stream_create();
    cu::capture_begin(s);
    cu::mla_cache_append(dckv.as<float>(), 1, L, R, dnw.as<float>(), eps, dlen.as<int32_t>(), dc.as<float>(),
                         dk.as<float>(), s);
    cu::mla_attend_absorbed(dq_.as<float>(), 1, dc.as<float>(), dk.as<float>(), dlen.as<int32_t>(), dkvb.view, d,
                            work.as<float>(), dout.as<float>(), cu::Precision::F32, s);
    cu::advance_len(dlen.as<int32_t>(), 1, s);
    cu::GraphExec graph = cu::capture_end(s);
    for (int64_t step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const auto ckv = rand_vec(rng, size_t(L + R), 0.05f, 3.0f), q = rand_vec(rng, size_t(c.heads * dq));
      cu::h2d(dckv.get(), ckv.data(), ckv.size() * 4, s);
      cu::h2d(dq_.get(), q.data(), q.size() * 4, s);
      cu::graph_launch(graph, s);
      std::vector<float> got(size_t(c.heads * c.v));
      cu::d2h(got.data(), dout.get(), got.size() * 4, s);
      // Reference decode step.
      const int64_t pos = c.pos0 + step;
      hc.resize(size_t((pos + 1) * L));
      hk.resize(size_t((pos + 1) * R));
      k3::ref::rmsnorm(ckv.data(), 1, L, norm_w.data(), eps, hc.data() + pos * L);
      std::copy_n(ckv.data() + L, R, hk.data() + pos * R);
      auto ref = nan_vec(got.size());
      k3::ref::mla_attend_absorbed(q.data(), 1, hc.data(), hk.data(), pos + 1, pos, kvb.w, d, ref.data());
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_LT(rel_l2(got, ref), kTolMla);
    }
    cu::sync(s);
    EXPECT_EQ(down_i(dlen, 1)[0], int32_t(c.pos0 + steps));
    cu::graph_destroy(graph);
    cu::stream_destroy(s);
  }
}

// ================================================================ MoE
TEST(CudaOps, RouterTopkMatchesTwin) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(216);
  // E <= 1024 and k <= 32 take the warp-merge kernel (one to eight warps, the last one partly
  // filled); beyond either limit the block-round kernel.
  for (auto [T, E, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 8, 2},
                         {3, 64, 6},
                         {5, 896, 16},
                         {2, 1000, 1},
                         {1, 64, 8},
                         {2, 130, 6},
                         {1, 1024, 32},
                         {2, 300, 33},
                         {1, 1100, 8}}) {
    for (bool with_bias : {false, true})
      for (bool renorm : {true, false}) {
        const float scale = renorm ? 2.5f : 1.0f;
        SCOPED_TRACE(dims({{"T", T}, {"E", E}, {"k", K}, {"bias", with_bias}, {"renorm", renorm}}));
        auto logits = rand_vec(rng, size_t(T * E), 0.01f, 4.0f);
        const auto bias = rand_vec(rng, size_t(E), 0.001f, 0.3f);
        // Exact ties in the last token: equal logits for a run of experts (lower index first).
        if (E >= 16)
          for (int64_t e = 3; e < 12; ++e) logits[size_t((T - 1) * E + e)] = 3.9f;
        std::vector<int32_t> i_ref(size_t(T * K));
        std::vector<float> w_ref(size_t(T * K));
        for (int64_t t = 0; t < T; ++t)
          k3::ref::router_topk(logits.data() + t * E, with_bias ? bias.data() : nullptr, E, K, renorm, scale,
                               i_ref.data() + t * K, w_ref.data() + t * K);
        auto dl = up(logits), db = up(bias), di = up(std::vector<int32_t>(size_t(T * K), -1));
        auto dw = k3test::dev_nan(size_t(T * K));
        cu::router_topk(dl.as<float>(), with_bias ? db.as<float>() : nullptr, T, E, K, renorm, scale, di.as<int32_t>(),
                        dw.as<float>(), nullptr);
        EXPECT_EQ(down_i(di, size_t(T * K)), i_ref);
        const auto w = down(dw, size_t(T * K));
        ASSERT_EQ(count_nan(w), 0u);
        EXPECT_LT(rel_l2(w, w_ref), kTolRouter);
      }
  }
}

TEST(CudaOps, MoeCombine) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(217);
  for (auto [T, K, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 5}, {3, 4, 37}, {1, 16, 3584}, {20, 16, 3584}}) {
    SCOPED_TRACE(dims({{"T", T}, {"k", K}, {"n", n}}));
    const auto y = rand_vec(rng, size_t(T * K * n)), w = rand_vec(rng, size_t(T * K), 0.01f, 1.0f);
    std::vector<float> ref(size_t(T * n));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += double(w[size_t(t * K + j)]) * y[size_t((t * K + j) * n + c)];
        ref[size_t(t * n + c)] = float(acc);
      }
    auto dy = up(y), dw = up(w), dagg = k3test::dev_nan(size_t(T * n));
    cu::moe_combine(dy.as<float>(), dw.as<float>(), T, K, n, dagg.as<float>(), nullptr);
    const auto got = down(dagg, size_t(T * n));
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, ref), kTolReduce);
  }
}

// ================================================================ decode-size latency
// The small ops at T = 1 and K3 / gpu-bench shapes, as a decode step runs them: 20 calls back to
// back captured in one graph on a created stream (the model's launch path), the graph replayed;
// microseconds per call printed (speed depends on the machine, so it is only printed). Asserted:
// after the replays each output holds the same bits as after a single call (every op here is
// deterministic and idempotent: out-of-place, inputs untouched).
TEST(CudaOpsBench, DecodeSmallOpLatency) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(300);
  cu::Stream s = cu::stream_create();
  const auto bench = [&](const std::string& name, const auto& op, const cu::DevBuf& out, size_t n_words) {
    SCOPED_TRACE(name);
    op();
    cu::sync(s);
    const auto once = k3test::from_dev<uint32_t>(out, n_words);
    constexpr int kCalls = 20, kReplays = 10;
    cu::capture_begin(s);
    for (int i = 0; i < kCalls; ++i) op();
    cu::GraphExec g = cu::capture_end(s);
    cu::graph_launch(g, s);
    cu::EventTimer timer;
    timer.start(s);
    for (int r = 0; r < kReplays; ++r) cu::graph_launch(g, s);
    timer.stop(s);
    const double us = timer.ms() * 1000.0 / (kCalls * kReplays);
    cu::sync(s);
    cu::graph_destroy(g);
    std::printf("[op-latency] %-44s %7.2f us/call\n", name.c_str(), us);
    EXPECT_EQ(k3test::from_dev<uint32_t>(out, n_words), once);
  };
  for (int64_t H : {4096, 7168}) {
    const auto x = rand_vec(rng, size_t(H), 0.05f, 3.0f), w = rand_vec(rng, size_t(H), 0.5f, 1.5f);
    auto dx = up(x), dw = up(w), dout = k3test::dev_nan(size_t(H));
    bench(
        "rmsnorm n=" + std::to_string(H),
        [&] { cu::rmsnorm(dx.as<float>(), 1, H, dw.as<float>(), 1e-5f, dout.as<float>(), s); }, dout, size_t(H));
    for (int64_t n_src : {3, 9}) {
      std::vector<cu::DevBuf> dsrc;
      std::vector<const float*> dptr;
      for (int64_t j = 0; j < n_src; ++j) {
        dsrc.push_back(up(rand_vec(rng, size_t(H), 0.05f, 2.0f)));
        dptr.push_back(dsrc.back().as<float>());
      }
      bench(
          "attnres_mix n_src=" + std::to_string(n_src) + " H=" + std::to_string(H),
          [&] { cu::attnres_mix(dptr.data(), n_src, 1, H, dw.as<float>(), 1e-5f, dout.as<float>(), s); }, dout,
          size_t(H));
      // The same site as one kernel with its add and norm (partial = y each call, so every call is alike).
      auto dp = up(rand_vec(rng, size_t(H), 0.05f, 2.0f)), dy = up(rand_vec(rng, size_t(H), 0.05f, 2.0f));
      bench(
          "residual_norm blocks=" + std::to_string(n_src - 1) + " H=" + std::to_string(H),
          [&] {
            cu::residual_norm(dptr.data(), n_src - 1, dp.as<float>(), dy.as<float>(), nullptr, true, dw.as<float>(), 1e-5f,
                              dw.as<float>(), 1e-6f, 1, H, dout.as<float>(), s);
          },
          dout, size_t(H));
    }
  }
  for (auto [E, K] : {std::pair<int64_t, int64_t>{64, 8}, {896, 16}}) {
    auto dl = up(rand_vec(rng, size_t(E), 0.01f, 4.0f)), db = up(rand_vec(rng, size_t(E), 0.001f, 0.3f));
    auto di = up(std::vector<int32_t>(size_t(K), -1));
    auto dwt = k3test::dev_nan(size_t(K));
    bench(
        "router_topk E=" + std::to_string(E) + " k=" + std::to_string(K),
        [&] {
          cu::router_topk(dl.as<float>(), db.as<float>(), 1, E, K, true, 2.5f, di.as<int32_t>(), dwt.as<float>(), s);
        },
        di, size_t(K));
  }
  {  // the KDA head norms (32 heads x 128) and the LoRA latent norm
    auto dx = up(rand_vec(rng, 32 * 128, 0.05f, 2.0f)), dout = k3test::dev_nan(32 * 128);
    auto dw = up(rand_vec(rng, 128, 0.5f, 1.5f));
    bench(
        "rmsnorm rows=32 n=128",
        [&] { cu::rmsnorm(dx.as<float>(), 32, 128, dw.as<float>(), 1e-5f, dout.as<float>(), s); }, dout, 32 * 128);
  }
  for (int64_t pos0 : {0, 3072}) {  // gpu-bench MLA: 32 heads, nope 128, rope 64, v 128, kv_lora 512
    const MlaCase c{32, 128, 64, 128, 512, pos0, 1, k3::WFormat::BF16};
    const k3::MlaAttnDims d = mla_dims(c);
    const int64_t S = pos0 + 1;
    k3test::OwnedW kvb = k3test::make_weight(rng, c.fmt, c.heads * (c.nope + c.v), c.kv_lora, 0.5f);
    k3test::DevWeight dkvb = k3test::upload_weight(kvb.w);
    auto dq_ = up(rand_vec(rng, size_t(c.heads * (c.nope + c.rope))));
    auto dc = up(rand_vec(rng, size_t(S * c.kv_lora))), dk = up(rand_vec(rng, size_t(S * c.rope)));
    auto dlen = up(std::vector<int32_t>{int32_t(pos0)});
    auto work = k3test::dev_nan(size_t(cu::mla_absorbed_work_floats(1, d)));
    auto dout = k3test::dev_nan(size_t(c.heads * c.v));
    bench(
        "mla_attend_absorbed T=1 pos0=" + std::to_string(pos0),
        [&] {
          cu::mla_attend_absorbed(dq_.as<float>(), 1, dc.as<float>(), dk.as<float>(), dlen.as<int32_t>(), dkvb.view, d,
                                  work.as<float>(), dout.as<float>(), cu::Precision::F32, s);
        },
        dout, size_t(c.heads * c.v));
  }
  cu::stream_destroy(s);
}

}  // namespace
