// Device tests of k3::cuda::matmul / expert_matmul (ops/cuda/gemm.cu) against the fp64 twin
// k3::ref::matmul: every format x T x precision on odd shapes, unaligned views, MXFP4 special
// scales, routed experts (repeated ids, x_div, bad ids), a captured graph that follows ids changed on
// the device, and CudaGemmBench (prints GB/s; asserts correctness only).
// Owns: the GPU GEMM tolerances below. Every output is pre-filled (NaN) to catch unwritten elements.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_util.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "common/weight_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/ops.h"

namespace {

using k3::WFormat;
using k3::cuda::Precision;
using k3test::count_nan;
using k3test::rel_l2;

// fp32 precision (and every GEMV / expert path, which read fp32 activations in both precisions):
// fp32 products and sums vs fp64, the project-wide fp32 reduction tolerance.
constexpr double kTolF32 = k3test::kTolReduce;
// BF16 precision at T > kGemvMaxT: activations rounded to bf16 (<= 2^-9 relative each, ~1e-3..5e-3
// aggregate over random-sign sums), so 1e-2 vs the exact product catches dropped or mis-paired
// terms; and it must equal the fp64 product of the ROUNDED activations to fp32 accuracy (weights
// are never rounded), the way tests/ops/test_gemm_levels.cpp holds the CPU Fast mode.
constexpr double kTolBf16VsExact = 1e-2;
constexpr double kTolBf16VsRounded = 1e-5;

// FP8 in its GPU form (per-row scales, k3test::upload_weight), as --trunk-fp8 places it.
const WFormat kFormats[] = {WFormat::F32, WFormat::F16, WFormat::BF16, WFormat::MXFP4, WFormat::FP8};
const int64_t kTs[] = {1, 3, 8, 9, 33, 100};
const Precision kPrecisions[] = {Precision::F32, Precision::BF16};

struct Shape {
  int64_t rows, cols;
};
// Rows never a multiple of the GEMV (8/16-row) or tile (64/128-row) blocks; columns with tails
// (37, 1000 = not a multiple of 16-byte chunks for F32/F16/BF16), aligned (4104 = 4096 + 8) and tiny.
std::vector<Shape> shapes(WFormat f) {
  if (f == WFormat::MXFP4) return {{37, 96}, {130, 1024}, {33, 3584}};
  // FP8: partial 128 x 128 blocks (1000, 37 columns; 130 rows) and whole 16-byte rows (the vector paths).
  if (f == WFormat::FP8) return {{37, 1000}, {19, 37}, {130, 4096}, {33, 3584}};
  return {{37, 1000}, {19, 37}, {70, 4104}, {3, 7}};
}

std::string label(WFormat f, int64_t rows, int64_t cols, int64_t T, Precision p) {
  return std::string(k3::wformat_name(f)) + " [" + std::to_string(rows) + ", " + std::to_string(cols) +
         "] T=" + std::to_string(T) + " " + k3::cuda::precision_name(p);
}

std::vector<float> round_bf16(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = k3::bf16_to_f32(k3::f32_to_bf16(x[i]));
  return r;
}

std::vector<float> ref_matmul(const k3::WeightMat& W, const std::vector<float>& X, int64_t T) {
  std::vector<float> y(size_t(T * W.rows), k3test::qnan());
  k3::ref::matmul(W, X.data(), T, y.data());
  return y;
}

std::vector<float> gpu_matmul(const k3::WeightMat& dev_w, const std::vector<float>& X, int64_t T, Precision p) {
  const auto dx = k3test::to_dev(X);
  auto dy = k3test::dev_nan(size_t(T * dev_w.rows));
  k3::cuda::matmul(dev_w, dx.as<float>(), T, dy.as<float>(), p, nullptr);
  k3::cuda::sync();
  return k3test::from_dev<float>(dy, size_t(T * dev_w.rows));
}

// Rows [r0, r0 + n) of a host or device view (k3::rows_of: MXFP4 scales follow, FP8 views keep their
// block row, or their per-row scales in the GPU form).
k3::WeightMat row_view(const k3::WeightMat& W, int64_t r0, int64_t n) { return k3::rows_of(W, r0, n); }

// The check every matmul result gets: all written, and within the tolerance of its path.
void expect_matches(const std::vector<float>& y, const std::vector<float>& exact, const std::vector<float>& rounded,
                    int64_t T, Precision p) {
  ASSERT_EQ(count_nan(y), 0u) << "unwritten (or NaN) outputs";
  if (p == Precision::F32 || T <= k3::cuda::kGemvMaxT) {
    EXPECT_LT(rel_l2(y, exact), kTolF32);
  } else {
    EXPECT_LT(rel_l2(y, exact), kTolBf16VsExact);
    EXPECT_LT(rel_l2(y, rounded), kTolBf16VsRounded);
  }
}

}  // namespace

TEST(CudaGemm, PrecisionNames) {
  K3_REQUIRE_GPU();
  for (Precision p : kPrecisions) EXPECT_EQ(k3::cuda::parse_precision(k3::cuda::precision_name(p)), p);
  EXPECT_STREQ(k3::cuda::precision_name(Precision::BF16), "bf16");
  EXPECT_THROW(k3::cuda::parse_precision("fp16"), k3::Error);
  EXPECT_THROW(k3::cuda::parse_precision(""), k3::Error);
}

TEST(CudaGemm, MatmulMatchesTwinEveryFormat) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(101);
  for (WFormat f : kFormats)
    for (const Shape& sh : shapes(f)) {
      const k3test::OwnedW W = k3test::make_weight(rng, f, sh.rows, sh.cols);
      const k3test::DevWeight dw = k3test::upload_weight(W.w);
      for (int64_t T : kTs) {
        const auto X = k3test::rand_vec(rng, size_t(T * sh.cols));
        const auto exact = ref_matmul(W.w, X, T);
        const auto rounded = T > k3::cuda::kGemvMaxT ? ref_matmul(W.w, round_bf16(X), T) : exact;
        for (Precision p : kPrecisions) {
          SCOPED_TRACE(label(f, sh.rows, sh.cols, T, p));
          expect_matches(gpu_matmul(dw.view, X, T, p), exact, rounded, T, p);
        }
      }
    }
}

// A device view that starts off 16-byte alignment (e.g. a slice at an odd element offset) must take
// the element-wise paths and still be right.
TEST(CudaGemm, UnalignedViewsMatchTwin) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(102);
  for (WFormat f : kFormats) {
    const int64_t rows = 21, cols = f == WFormat::MXFP4 ? 256 : 4104;
    const k3test::OwnedW W = k3test::make_weight(rng, f, rows, cols);
    const size_t n = k3test::weight_data_bytes(W.w);
    const size_t off = f == WFormat::F32 ? 4 : f == WFormat::MXFP4 || f == WFormat::FP8 ? 1 : 2;  // not 16-byte
    k3::cuda::DevBuf data(n + 16, "unaligned test weight"), scales;
    k3::cuda::h2d(static_cast<uint8_t*>(data.get()) + off, W.w.data, n);
    k3::WeightMat v = W.w;
    v.data = static_cast<uint8_t*>(data.get()) + off;
    if (f == WFormat::MXFP4) {
      scales = k3::cuda::DevBuf(size_t(rows * cols / 32), "unaligned test scales");
      k3::cuda::h2d(scales.get(), W.w.scales, size_t(rows * cols / 32));
      v.scales = scales.as<uint8_t>();
    }
    if (f == WFormat::FP8) {
      const k3test::DevWeight up = k3test::upload_weight(W.w);  // its per-row scales
      scales = k3::cuda::DevBuf(size_t(rows * k3::fp8_block_cols(cols)) * 4, "unaligned test scales");
      k3::cuda::d2d(scales.get(), up.scales.get(), size_t(rows * k3::fp8_block_cols(cols)) * 4);
      v.scales = scales.as<uint8_t>();
      v.block_scales = nullptr;
    }
    k3::cuda::sync();
    for (int64_t T : {int64_t(1), int64_t(5), int64_t(40)}) {
      const auto X = k3test::rand_vec(rng, size_t(T * cols));
      const auto exact = ref_matmul(W.w, X, T);
      const auto rounded = ref_matmul(W.w, round_bf16(X), T);
      for (Precision p : kPrecisions) {
        SCOPED_TRACE(label(f, rows, cols, T, p) + " view offset " + std::to_string(off));
        expect_matches(gpu_matmul(v, X, T, p), exact, rounded, T, p);
      }
    }
  }
}

// FP8 row views (--trunk-fp8's split ranks and fused projections take them at any row): a host view
// uploaded (its scales from its first row's block row on) and a view of the uploaded whole (the
// per-row scales advance with the rows, rows_of) both match the fp64 twin on the host view.
TEST(CudaGemm, Fp8RowViewsFindTheirScales) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(111);
  const k3test::OwnedW W = k3test::make_weight(rng, WFormat::FP8, 300, 1024);
  const k3test::DevWeight whole = k3test::upload_weight(W.w);
  for (const auto& [r0, n] : {std::pair<int64_t, int64_t>{77, 150}, {128, 100}, {1, 299}}) {
    const k3::WeightMat host = k3::rows_of(W.w, r0, n);
    const k3test::DevWeight up = k3test::upload_weight(host);
    const k3::WeightMat dev = k3::rows_of(whole.view, r0, n);
    for (int64_t T : {int64_t(1), int64_t(4), int64_t(16), int64_t(70)}) {
      const auto X = k3test::rand_vec(rng, size_t(T * W.w.cols));
      const auto exact = ref_matmul(host, X, T);
      const auto rounded = T > k3::cuda::kGemvMaxT ? ref_matmul(host, round_bf16(X), T) : exact;
      for (Precision p : kPrecisions) {
        SCOPED_TRACE("rows " + std::to_string(r0) + ".." + std::to_string(r0 + n) + " " + label(WFormat::FP8, n, 1024, T, p));
        expect_matches(gpu_matmul(up.view, X, T, p), exact, rounded, T, p);
        expect_matches(gpu_matmul(dev, X, T, p), exact, rounded, T, p);
      }
    }
  }
}

// E8M0 edge scales: 0 (the subnormal 2^-127), 1, 2 (tiny weights, ~1e-38), large ones, and 255
// (NaN: every output of a row holding such a block is NaN, the others unaffected).
TEST(CudaGemm, Mxfp4SpecialScales) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(103);
  const int64_t rows = 40, cols = 256;
  struct ScaleSet {
    const char* name;
    std::vector<uint8_t> values;
  };
  const ScaleSet sets[] = {{"tiny", {0, 1, 2, 3}}, {"huge", {150, 180, 200}}, {"mixed", {0, 1, 100, 127, 140}}};
  for (const ScaleSet& set : sets) {
    k3test::OwnedW W = k3test::make_weight(rng, WFormat::MXFP4, rows, cols);
    std::uniform_int_distribution<size_t> pick(0, set.values.size() - 1);
    for (auto& s : W.scales) s = set.values[pick(rng)];
    const std::vector<int64_t> nan_rows = {5, 17, 39};
    for (int64_t r : nan_rows) W.scales[size_t(r * (cols / 32) + (r % (cols / 32)))] = 255;
    const k3test::DevWeight dw = k3test::upload_weight(W.w);
    for (int64_t T : {int64_t(1), int64_t(3), int64_t(33)}) {
      const auto X = k3test::rand_vec(rng, size_t(T * cols));
      const auto exact = ref_matmul(W.w, X, T);
      const auto rounded = ref_matmul(W.w, round_bf16(X), T);
      for (Precision p : kPrecisions) {
        SCOPED_TRACE(std::string(set.name) + " " + label(WFormat::MXFP4, rows, cols, T, p));
        const auto dx = k3test::to_dev(X);
        auto dy = k3test::to_dev(std::vector<float>(size_t(T * rows), -7777.0f));  // sentinel: NaN is expected
        k3::cuda::matmul(dw.view, dx.as<float>(), T, dy.as<float>(), p, nullptr);
        const auto y = k3test::from_dev<float>(dy, size_t(T * rows));
        std::vector<float> got, want, want_rounded;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            const size_t i = size_t(t * rows + r);
            const bool nan_row = std::find(nan_rows.begin(), nan_rows.end(), r) != nan_rows.end();
            ASSERT_TRUE(std::isnan(exact[i]) == nan_row) << "reference at t=" << t << " r=" << r;
            if (nan_row) {
              EXPECT_TRUE(std::isnan(y[i])) << "t=" << t << " r=" << r << " got " << y[i];
            } else {
              ASSERT_NE(y[i], -7777.0f) << "unwritten output t=" << t << " r=" << r;
              got.push_back(y[i]);
              want.push_back(exact[i]);
              want_rounded.push_back(rounded[i]);
            }
          }
        expect_matches(got, want, want_rounded, T, p);
      }
    }
  }
}

namespace {

// Reference for expert_matmul: Y[n] = W_{ids[n]} . X[n / x_div] through the fp64 twin per slot.
std::vector<float> ref_experts(const k3::WeightMat& W, int64_t R, const std::vector<int32_t>& ids,
                               const std::vector<float>& X, int64_t x_div) {
  const int64_t N = int64_t(ids.size()), C = W.cols;
  std::vector<float> y(size_t(N * R), k3test::qnan());
  for (int64_t n = 0; n < N; ++n) {
    const k3::WeightMat We = row_view(W, int64_t(ids[size_t(n)]) * R, R);
    k3::ref::matmul(We, X.data() + (n / x_div) * C, 1, y.data() + n * R);
  }
  return y;
}

std::vector<float> gpu_experts(const k3::WeightMat& dev_w, int64_t R, const std::vector<int32_t>& ids,
                               const std::vector<float>& X, int64_t x_div, Precision p, float fill) {
  const auto dx = k3test::to_dev(X);
  const auto di = k3test::to_dev(ids);
  const size_t n = ids.size() * size_t(R);
  auto dy = k3test::to_dev(std::vector<float>(n, fill));
  k3::cuda::expert_matmul(dev_w, R, di.as<int32_t>(), int64_t(ids.size()), dx.as<float>(), x_div, dy.as<float>(), p,
                          nullptr);
  k3::cuda::sync();
  return k3test::from_dev<float>(dy, n);
}

}  // namespace

// Decode-sized N (one block column per slot) and prefill-sized N (experts grouped, weights shared by
// up to 8 slots); repeated ids; x_div = 1 (one activation row per slot) and = top_k (slots of a token
// share its row); 16-byte and element-wise paths (cols 96 / 37).
TEST(CudaGemm, ExpertMatmulMatchesTwin) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(104);
  const int64_t E = 6, R = 37, top_k = 4;
  for (WFormat f : kFormats)
    for (int64_t C : {int64_t(96), int64_t(37)}) {
      if (f == WFormat::MXFP4 && C % 32 != 0) continue;
      const k3test::OwnedW W = k3test::make_weight(rng, f, E * R, C);
      const k3test::DevWeight dw = k3test::upload_weight(W.w);
      for (int64_t N : {int64_t(12), int64_t(300)})
        for (int64_t x_div : {int64_t(1), top_k}) {
          std::uniform_int_distribution<int32_t> pick(0, int32_t(E - 1));
          std::vector<int32_t> ids(static_cast<size_t>(N));
          for (auto& i : ids) i = pick(rng);
          ids[1] = ids[0];  // a guaranteed repeat (N > E makes more)
          const auto X = k3test::rand_vec(rng, size_t((N / x_div) * C));
          const auto want = ref_experts(W.w, R, ids, X, x_div);
          for (Precision p : kPrecisions) {
            SCOPED_TRACE(label(f, E * R, C, 1, p) + " N=" + std::to_string(N) + " x_div=" + std::to_string(x_div));
            const auto y = gpu_experts(dw.view, R, ids, X, x_div, p, k3test::qnan());
            ASSERT_EQ(count_nan(y), 0u);
            EXPECT_LT(rel_l2(y, want), kTolF32);  // fp32 activations on every expert path
          }
        }
    }
}

// Several GEMVs in one launch (the decode step's projections): every job gives the bits of gemv_rows
// on it alone, and the fp64 twin's values. Mixed formats (grouped per format), more jobs of one
// format than one launch takes, an unaligned view (the single-kernel fallback), T from 1 to 16
// (16 on non-MXFP4 weights only), on a created stream (programmatic dependent launches, as the
// model runs them) after a kernel that writes the inputs.
TEST(CudaGemm, GemvBatchEqualsSeparateGemvsBitwise) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(110);
  struct Job {
    k3test::OwnedW w;
    k3test::DevWeight dev;
  };
  std::vector<Job> jobs;
  const int64_t C = 1024;
  for (int i = 0; i < 15; ++i) {  // 10 > kGemvBatchMax BF16 jobs among them
    const WFormat f = i < 10 ? WFormat::BF16
                      : i == 10 ? WFormat::MXFP4
                      : i == 11 ? WFormat::F32
                      : i == 12 ? WFormat::F16
                                : WFormat::FP8;
    const int64_t rows = 37 + 29 * i;
    k3test::OwnedW w = k3test::make_weight(rng, f, rows, C);
    k3test::DevWeight d = k3test::upload_weight(w.w);
    jobs.push_back({std::move(w), std::move(d)});
  }
  // An unaligned view: rows from 1 of a BF16 weight of 1000 columns (2000-byte rows, not 16-byte whole).
  {
    k3test::OwnedW w = k3test::make_weight(rng, WFormat::BF16, 50, 1000);
    k3test::DevWeight d = k3test::upload_weight(w.w);
    jobs.push_back({std::move(w), std::move(d)});
  }
  const k3::cuda::Stream st = k3::cuda::stream_create();
  for (int64_t T : {1, 3, 8, 16}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    std::vector<k3::cuda::GemvJob> batch;
    std::vector<k3::cuda::DevBuf> xs, ys;
    std::vector<std::vector<float>> hx;
    std::vector<size_t> used;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const k3::WeightMat& W = jobs[i].dev.view;
      if (T > k3::cuda::kGemvMaxT && !k3::cuda::gemv_wide_ok(W)) continue;
      hx.push_back(k3test::rand_vec(rng, size_t(T * W.cols)));
      xs.push_back(k3test::to_dev(hx.back()));
      ys.push_back(k3test::dev_nan(size_t(T * W.rows)));
      batch.push_back({&jobs[i].dev.view, xs.back().as<float>(), ys.back().as<float>()});
      used.push_back(i);
    }
    k3::cuda::gemv_batch(batch.data(), int64_t(batch.size()), T, st);
    k3::cuda::sync(st);
    for (size_t j = 0; j < batch.size(); ++j) {
      const k3::WeightMat& W = jobs[used[j]].dev.view;
      SCOPED_TRACE(label(W.fmt, W.rows, W.cols, T, Precision::F32));
      const auto got = k3test::from_dev<float>(ys[j], size_t(T * W.rows));
      auto alone = k3test::dev_nan(size_t(T * W.rows));
      k3::cuda::gemv_rows(W, xs[j].as<float>(), T, alone.as<float>(), st);
      k3::cuda::sync(st);
      ASSERT_EQ(count_nan(got), 0u);
      EXPECT_EQ(got, k3test::from_dev<float>(alone, size_t(T * W.rows)));
      EXPECT_LT(rel_l2(got, ref_matmul(jobs[used[j]].w.w, hx[j], T)), kTolF32);
    }
  }
  EXPECT_THROW(k3::cuda::gemv_batch(nullptr, -1, 1, st), k3::Error);
  k3::cuda::stream_destroy(st);
}

// The experts' gate, up and SiTU in one kernel == expert_matmul x 2 + situ_glu, bit for bit, and the
// fp64 twin's values; every format, 16-byte and element paths, decode and many slots, x_div 1 and
// top_k, caps on (K3) and off (SiLU GLU, Kimi Linear); a bad id gives NaN rows; a gate and up of
// different shapes are a one-line error.
TEST(CudaGemm, ExpertGluEqualsMatmulsAndSituBitwise) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(111);
  const int64_t E = 5, R = 40, top_k = 4;
  const k3::cuda::Stream st = k3::cuda::stream_create();
  for (WFormat f : kFormats)
    for (int64_t C : {int64_t(96), int64_t(37)}) {
      if (f == WFormat::MXFP4 && C % 32 != 0) continue;
      const k3test::OwnedW G = k3test::make_weight(rng, f, E * R, C), U = k3test::make_weight(rng, f, E * R, C);
      const k3test::DevWeight dg = k3test::upload_weight(G.w), du = k3test::upload_weight(U.w);
      for (int64_t N : {int64_t(8), int64_t(300)})
        for (int64_t x_div : {int64_t(1), top_k})
          for (const auto& [b1, b2] : {std::pair<float, float>{4.0f, 25.0f}, std::pair<float, float>{0.0f, 0.0f}}) {
            SCOPED_TRACE(label(f, E * R, C, 1, Precision::F32) + " N=" + std::to_string(N) +
                         " x_div=" + std::to_string(x_div) + " caps " + std::to_string(b1));
            std::uniform_int_distribution<int32_t> pick(0, int32_t(E - 1));
            std::vector<int32_t> ids(static_cast<size_t>(N));
            for (auto& i : ids) i = pick(rng);
            ids[2] = int32_t(E);  // bad ids: NaN rows, nothing read
            ids[5] = -3;
            const auto X = k3test::rand_vec(rng, size_t((N / x_div) * C), 0.05f, 3.0f);
            const auto dx = k3test::to_dev(X);
            const auto di = k3test::to_dev(ids);
            const size_t n = size_t(N * R);
            auto h = k3test::dev_nan(n), g = k3test::dev_nan(n), u = k3test::dev_nan(n);
            k3::cuda::expert_glu(dg.view, du.view, R, di.as<int32_t>(), N, dx.as<float>(), x_div, b1, b2, h.as<float>(),
                                 st);
            k3::cuda::expert_matmul(dg.view, R, di.as<int32_t>(), N, dx.as<float>(), x_div, g.as<float>(),
                                    Precision::F32, st);
            k3::cuda::expert_matmul(du.view, R, di.as<int32_t>(), N, dx.as<float>(), x_div, u.as<float>(),
                                    Precision::F32, st);
            k3::cuda::situ_glu(g.as<float>(), u.as<float>(), int64_t(n), b1, b2, g.as<float>(), st);
            k3::cuda::sync(st);
            const auto got = k3test::from_dev<float>(h, n), sep = k3test::from_dev<float>(g, n);
            std::vector<float> got_ok, sep_ok, want_ok;
            std::vector<int32_t> good = ids;
            good[2] = good[5] = 0;
            const auto rg = ref_experts(G.w, R, good, X, x_div), ru = ref_experts(U.w, R, good, X, x_div);
            std::vector<float> want(n);
            k3::ref::situ_glu(rg.data(), ru.data(), int64_t(n), b1, b2, want.data());
            for (int64_t s = 0; s < N; ++s)
              for (int64_t r = 0; r < R; ++r) {
                const size_t i = size_t(s * R + r);
                if (s == 2 || s == 5) {
                  EXPECT_TRUE(std::isnan(got[i])) << "slot " << s;
                  continue;
                }
                got_ok.push_back(got[i]);
                sep_ok.push_back(sep[i]);
                want_ok.push_back(want[i]);
              }
            ASSERT_EQ(count_nan(got_ok), 0u);
            EXPECT_EQ(got_ok, sep_ok);
            EXPECT_LT(rel_l2(got_ok, want_ok), kTolF32);
          }
    }
  const k3test::OwnedW A = k3test::make_weight(rng, WFormat::BF16, 2 * 16, 64),
                       B = k3test::make_weight(rng, WFormat::BF16, 2 * 8, 64);
  const k3test::DevWeight da = k3test::upload_weight(A.w), db = k3test::upload_weight(B.w);
  EXPECT_THROW(k3::cuda::expert_glu(da.view, db.view, 8, nullptr, 1, nullptr, 1, 0, 0, nullptr, st), k3::Error);
  k3::cuda::stream_destroy(st);
}

// The decode steps' experts grouped by expert on the device (expert_ffn_grouped): every slot's
// output within fp32 tolerance of the per-slot kernels (expert_glu, then expert_matmul of the down
// stack) and of the fp64 twin, for every format, experts chosen by 1 to 20 slots (one tile and
// several), x_div 1 and top_k, bad ids as NaN rows; the grouping is read from the device ids, so a
// second call with other ids on the same buffers follows them; shapes it does not take are refused.
TEST(CudaGemm, GroupedExpertFfnMatchesPerSlotKernels) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(113);
  const int64_t E = 7, I = 64, L = 48, C = 64, top_k = 4;  // I: a whole MXFP4 block row of the down stack
  const k3::cuda::Stream st = k3::cuda::stream_create();
  for (WFormat f : kFormats) {
    const k3test::OwnedW G = k3test::make_weight(rng, f, E * I, C), U = k3test::make_weight(rng, f, E * I, C),
                         D = k3test::make_weight(rng, f, E * L, I);
    const k3test::DevWeight dg = k3test::upload_weight(G.w), du = k3test::upload_weight(U.w),
                            dd = k3test::upload_weight(D.w);
    for (int64_t N : {int64_t(12), int64_t(160)})
      for (int64_t x_div : {int64_t(1), top_k}) {
        SCOPED_TRACE(std::string(k3::wformat_name(f)) + " N=" + std::to_string(N) + " x_div=" + std::to_string(x_div));
        const auto X = k3test::rand_vec(rng, size_t((N / x_div) * C), 0.05f, 3.0f);
        const auto dx = k3test::to_dev(X);
        auto h = k3test::dev_nan(size_t(N * I)), y = k3test::dev_nan(size_t(N * L));
        auto hs = k3test::dev_nan(size_t(N * I)), ys = k3test::dev_nan(size_t(N * L));
        auto sorted = k3test::to_dev(std::vector<int32_t>(size_t(2 * N), -1));
        auto tiles = k3test::to_dev(std::vector<int32_t>(size_t(3 * k3::cuda::expert_grouped_tiles_max(N, E)), -1));
        ASSERT_TRUE(k3::cuda::expert_grouped_ok(dg.view, du.view, dd.view, I, N, dx.as<float>(), h.as<float>()));
        for (int round = 0; round < 2; ++round) {
          std::uniform_int_distribution<int32_t> pick(0, int32_t(E - 1));
          std::vector<int32_t> ids(static_cast<size_t>(N));
          for (auto& i : ids) i = round == 0 ? pick(rng) : int32_t(E - 1 - (pick(rng) % 3));  // round 1: 3 experts
          ids[2] = int32_t(E);  // bad ids
          ids[N - 1] = -2;
          const auto di = k3test::to_dev(ids);
          k3::cuda::expert_ffn_grouped(dg.view, du.view, dd.view, I, di.as<int32_t>(), N, dx.as<float>(), x_div, 4.0f,
                                       25.0f, h.as<float>(), y.as<float>(), sorted.as<int32_t>(),
                                       reinterpret_cast<k3::cuda::ExpertTile*>(tiles.as<int32_t>()),
                                       sorted.as<int32_t>() + N, st);
          k3::cuda::expert_glu(dg.view, du.view, I, di.as<int32_t>(), N, dx.as<float>(), x_div, 4.0f, 25.0f,
                               hs.as<float>(), st);
          k3::cuda::expert_matmul(dd.view, L, di.as<int32_t>(), N, hs.as<float>(), 1, ys.as<float>(), Precision::F32, st);
          k3::cuda::sync(st);
          const auto got = k3test::from_dev<float>(y, size_t(N * L)), sep = k3test::from_dev<float>(ys, size_t(N * L));
          std::vector<int32_t> good = ids;
          good[2] = good[size_t(N - 1)] = 0;
          const auto rg = ref_experts(G.w, I, good, X, x_div), ru = ref_experts(U.w, I, good, X, x_div);
          std::vector<float> hr(size_t(N * I));
          k3::ref::situ_glu(rg.data(), ru.data(), N * I, 4.0f, 25.0f, hr.data());
          const auto want = ref_experts(D.w, L, good, hr, 1);
          std::vector<float> got_ok, sep_ok, want_ok;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t r = 0; r < L; ++r) {
              const size_t i = size_t(n * L + r);
              if (n == 2 || n == N - 1) {
                EXPECT_TRUE(std::isnan(got[i])) << "bad id, slot " << n;
                continue;
              }
              got_ok.push_back(got[i]);
              sep_ok.push_back(sep[i]);
              want_ok.push_back(want[i]);
            }
          ASSERT_EQ(count_nan(got_ok), 0u) << "round " << round;
          EXPECT_LT(rel_l2(got_ok, sep_ok), kTolF32) << "round " << round;
          EXPECT_LT(rel_l2(got_ok, want_ok), kTolF32) << "round " << round;
        }
      }
  }
  // Refused: gate and up of other shapes, a down stack whose columns are not I.
  const k3test::OwnedW A = k3test::make_weight(rng, WFormat::BF16, 2 * 16, 64),
                       B = k3test::make_weight(rng, WFormat::BF16, 2 * 8, 64);
  const k3test::DevWeight da = k3test::upload_weight(A.w), db = k3test::upload_weight(B.w);
  const auto x = k3test::dev_nan(size_t(64 * 64));
  EXPECT_FALSE(k3::cuda::expert_grouped_ok(da.view, db.view, da.view, 16, 8, x.as<float>(), x.as<float>()));
  EXPECT_FALSE(k3::cuda::expert_grouped_ok(da.view, da.view, da.view, 16, 8, x.as<float>(), x.as<float>()));
  EXPECT_THROW(k3::cuda::expert_ffn_grouped(da.view, db.view, da.view, 16, nullptr, 8, x.as<float>(), 1, 0, 0,
                                            nullptr, nullptr, nullptr, nullptr, nullptr, st),
               k3::Error);
  k3::cuda::stream_destroy(st);
}

// fp32 products of few weight rows and many tokens (the router of a prefill chunk) run as chunked
// GEMVs: the same bits as gemv_rows on each 8-token chunk (and the last, shorter one); a wide one
// takes the SIMT tiles. Both match the fp64 twin.
TEST(CudaGemm, F32SkinnyMatmulIsChunkedGemvs) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(141);
  struct Case {
    WFormat f;
    int64_t rows, cols, T;
    bool by_gemv;
  };
  const Case cases[] = {{WFormat::BF16, 64, 520, 515, true},
                        {WFormat::MXFP4, 40, 256, 100, true},
                        {WFormat::F32, 19, 37, 9, true},
                        {WFormat::BF16, 2200, 72, 520, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(label(c.f, c.rows, c.cols, c.T, Precision::F32));
    EXPECT_EQ(k3::cuda::matmul_f32_by_gemv(c.rows, c.T), c.by_gemv);
    const k3test::OwnedW W = k3test::make_weight(rng, c.f, c.rows, c.cols);
    const k3test::DevWeight dw = k3test::upload_weight(W.w);
    const auto X = k3test::rand_vec(rng, size_t(c.T * c.cols), -1.0f, 1.0f);
    const auto y = gpu_matmul(dw.view, X, c.T, Precision::F32);
    ASSERT_EQ(count_nan(y), 0u);
    EXPECT_LT(rel_l2(y, ref_matmul(W.w, X, c.T)), kTolF32);
    if (!c.by_gemv) continue;
    const auto dx = k3test::to_dev(X);
    auto dy = k3test::dev_nan(size_t(c.T * c.rows));
    for (int64_t t0 = 0; t0 < c.T; t0 += k3::cuda::kGemvMaxT) {
      const int64_t n = std::min<int64_t>(k3::cuda::kGemvMaxT, c.T - t0);
      k3::cuda::gemv_rows(dw.view, dx.as<float>() + t0 * c.cols, n, dy.as<float>() + t0 * c.rows, nullptr);
    }
    k3::cuda::sync();
    EXPECT_EQ(y, k3test::from_dev<float>(dy, size_t(c.T * c.rows)));
  }
}

// Prefill's grouped expert GEMM (one launch for all experts' tiles, gate and up together) gives the
// same bits as one matmul per expert view and tile rows, and matches the fp64 twin at the bf16 tolerance.
TEST(CudaGemm, GroupedExpertGemmEqualsPerExpertMatmulBitwise) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(131);
  const int64_t E = 6, R = 200, C = 96;  // R not a multiple of the 128-row tile
  const k3::cuda::Stream st = k3::cuda::stream_create();
  const k3test::OwnedW G = k3test::make_weight(rng, WFormat::MXFP4, E * R, C),
                       U = k3test::make_weight(rng, WFormat::MXFP4, E * R, C);
  const k3test::DevWeight dg = k3test::upload_weight(G.w), du = k3test::upload_weight(U.w);
  ASSERT_TRUE(k3::cuda::expert_gemm_grouped_ok(dg.view, R));
  // Rows per expert: none, one, a partial tile, exactly a tile, several tiles with a tail.
  const int64_t per_expert[E] = {0, 1, 37, 64, 150, 9};
  std::vector<k3::cuda::ExpertTile> tiles;
  int64_t N = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < per_expert[e]; o += k3::cuda::kExpertTileRows)
      tiles.push_back({int32_t(e), int32_t(N + o), int32_t(std::min<int64_t>(64, per_expert[e] - o))});
    N += per_expert[e];
  }
  const auto X = k3test::rand_vec(rng, size_t(N * C), 0.05f, 3.0f);
  const auto dx = k3test::to_dev(X);
  const auto dt = k3test::to_dev(tiles);
  auto yg = k3test::dev_nan(size_t(N * R)), yu = k3test::dev_nan(size_t(N * R));
  const k3::WeightMat* W[2] = {&dg.view, &du.view};
  float* Y[2] = {yg.as<float>(), yu.as<float>()};
  k3::cuda::expert_gemm_grouped(W, Y, 2, R, dt.as<k3::cuda::ExpertTile>(), int64_t(tiles.size()), dx.as<float>(), st);
  k3::cuda::sync(st);
  const auto got_g = k3test::from_dev<float>(yg, size_t(N * R)), got_u = k3test::from_dev<float>(yu, size_t(N * R));
  ASSERT_EQ(count_nan(got_g), 0u);
  ASSERT_EQ(count_nan(got_u), 0u);
  int64_t row0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = per_expert[e];
    if (n == 0) continue;
    SCOPED_TRACE("expert " + std::to_string(e) + ", " + std::to_string(n) + " rows");
    const std::vector<float> Xe(X.begin() + row0 * C, X.begin() + (row0 + n) * C);
    for (int m = 0; m < 2; ++m) {
      const k3test::DevWeight& dw = m == 0 ? dg : du;
      const k3test::OwnedW& hw = m == 0 ? G : U;
      const std::vector<float>& got = m == 0 ? got_g : got_u;
      const std::vector<float> mine(got.begin() + row0 * R, got.begin() + (row0 + n) * R);
      // Per tile, as the engine did before grouping: one matmul per expert and tile of rows.
      std::vector<float> sep;
      for (int64_t o = 0; o < n; o += 64) {
        const int64_t tn = std::min<int64_t>(64, n - o);
        const std::vector<float> Xt(Xe.begin() + o * C, Xe.begin() + (o + tn) * C);
        const auto part = gpu_matmul(row_view(dw.view, e * R, R), Xt, tn, Precision::BF16);
        sep.insert(sep.end(), part.begin(), part.end());
      }
      if (n > k3::cuda::kGemvMaxT) {  // a tile of GEMV size takes the GEMV there (fp32 activations)
        EXPECT_EQ(mine, sep) << "matrix " << m;
      }
      const k3::WeightMat hv = row_view(hw.w, e * R, R);
      EXPECT_LT(rel_l2(mine, ref_matmul(hv, Xe, n)), kTolBf16VsExact) << "matrix " << m;
      EXPECT_LT(rel_l2(mine, ref_matmul(hv, round_bf16(Xe), n)), kTolBf16VsRounded) << "matrix " << m;
    }
    row0 += n;
  }
  // Not an aligned MXFP4 stack: a clear error.
  const k3test::OwnedW B = k3test::make_weight(rng, WFormat::BF16, 2 * 16, 64);
  const k3test::DevWeight db = k3test::upload_weight(B.w);
  EXPECT_FALSE(k3::cuda::expert_gemm_grouped_ok(db.view, 16));
  const k3::WeightMat* Wb[1] = {&db.view};
  EXPECT_THROW(k3::cuda::expert_gemm_grouped(Wb, Y, 1, 16, dt.as<k3::cuda::ExpertTile>(), 1, dx.as<float>(), st),
               k3::Error);
  k3::cuda::stream_destroy(st);
}

// A routing id outside [0, E) must not read outside W: that slot's rows become NaN, others are right.
TEST(CudaGemm, ExpertMatmulBadIdGivesNanRows) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(105);
  const int64_t E = 4, R = 24, C = 64;
  const k3test::OwnedW W = k3test::make_weight(rng, WFormat::MXFP4, E * R, C);
  const k3test::DevWeight dw = k3test::upload_weight(W.w);
  for (int64_t N : {int64_t(8), int64_t(200)}) {
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i % E);
    ids[3] = int32_t(E);
    ids[5] = -1;
    const auto X = k3test::rand_vec(rng, size_t(N * C));
    const auto y = gpu_experts(dw.view, R, ids, X, 1, Precision::F32, -7777.0f);
    std::vector<int32_t> good_ids = ids;
    good_ids[3] = good_ids[5] = 0;
    const auto want = ref_experts(W.w, R, good_ids, X, 1);
    std::vector<float> got_ok, want_ok;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t r = 0; r < R; ++r) {
        const float v = y[size_t(n * R + r)];
        SCOPED_TRACE("N=" + std::to_string(N) + " n=" + std::to_string(n) + " r=" + std::to_string(r));
        if (n == 3 || n == 5) {
          EXPECT_TRUE(std::isnan(v)) << v;
        } else {
          ASSERT_NE(v, -7777.0f);
          got_ok.push_back(v);
          want_ok.push_back(want[size_t(n * R + r)]);
        }
      }
    EXPECT_LT(rel_l2(got_ok, want_ok), kTolF32) << "N=" << N;
  }
}

// The decode step is captured once and replayed: ids are read on the device at replay time, so new
// routing written into the same buffer selects the new experts without re-capturing.
TEST(CudaGemm, GraphReplayFollowsDeviceIds) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(106);
  const int64_t E = 8, R = 64, C = 256, top_k = 4;
  const k3test::OwnedW We = k3test::make_weight(rng, WFormat::MXFP4, E * R, C);
  const k3test::OwnedW Wd = k3test::make_weight(rng, WFormat::BF16, 96, C);
  const k3test::DevWeight dwe = k3test::upload_weight(We.w), dwd = k3test::upload_weight(Wd.w);
  const auto X = k3test::rand_vec(rng, size_t(C));
  const std::vector<int32_t> ids0 = {1, 6, 3, 0}, ids1 = {7, 2, 5, 6};
  auto dx = k3test::to_dev(X);
  auto di = k3test::to_dev(ids0);
  auto dy1 = k3test::dev_nan(size_t(Wd.w.rows)), dy2 = k3test::dev_nan(size_t(top_k * R));
  k3::cuda::Stream s = k3::cuda::stream_create();
  k3::cuda::capture_begin(s);
  k3::cuda::matmul(dwd.view, dx.as<float>(), 1, dy1.as<float>(), Precision::BF16, s);
  k3::cuda::expert_matmul(dwe.view, R, di.as<int32_t>(), top_k, dx.as<float>(), top_k, dy2.as<float>(), Precision::BF16,
                          s);
  k3::cuda::GraphExec g = k3::cuda::capture_end(s);
  const auto dense_want = ref_matmul(Wd.w, X, 1);
  for (const auto* ids : {&ids0, &ids1}) {
    k3::cuda::h2d(di.get(), ids->data(), ids->size() * sizeof(int32_t), s);
    k3::cuda::dev_memset(dy2.get(), 0xff, size_t(top_k * R) * sizeof(float), s);  // NaN pattern: must be rewritten
    k3::cuda::graph_launch(g, s);
    k3::cuda::sync(s);
    const auto y1 = k3test::from_dev<float>(dy1, size_t(Wd.w.rows));
    const auto y2 = k3test::from_dev<float>(dy2, size_t(top_k * R));
    ASSERT_EQ(count_nan(y1), 0u);
    ASSERT_EQ(count_nan(y2), 0u);
    EXPECT_LT(rel_l2(y1, dense_want), kTolF32);
    EXPECT_LT(rel_l2(y2, ref_experts(We.w, R, *ids, X, top_k)), kTolF32) << "ids set " << (ids == &ids0 ? 0 : 1);
  }
  k3::cuda::graph_destroy(g);
  k3::cuda::stream_destroy(s);
}

namespace {

struct Timed {
  double ms;  // per call
};
template <class Fn>
Timed time_calls(k3::cuda::Stream s, int reps, Fn&& fn) {
  for (int i = 0; i < 5; ++i) fn();
  k3::cuda::EventTimer timer;
  timer.start(s);
  for (int i = 0; i < reps; ++i) fn();
  timer.stop(s);
  return {timer.ms() / reps};
}

// Row subsets [0, 64) and the last 64 rows of each token's output against the twin.
void check_row_subsets(const k3::WeightMat& W, const std::vector<float>& X, int64_t T, const std::vector<float>& y,
                       double tol, const std::vector<float>* X_for_ref = nullptr) {
  for (int64_t r0 : {int64_t(0), W.rows - 64}) {
    const k3::WeightMat v = row_view(W, r0, 64);
    const auto want = ref_matmul(v, X_for_ref ? *X_for_ref : X, T);
    std::vector<float> got(want.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < 64; ++r) got[size_t(t * 64 + r)] = y[size_t(t * W.rows + r0 + r)];
    ASSERT_EQ(count_nan(got), 0u);
    EXPECT_LT(rel_l2(got, want), tol) << "rows from " << r0 << " T=" << T;
  }
}

}  // namespace

// GEMV bandwidth: bytes of weights (+ scales) read per second at T = 1 (the decode step), and a few
// larger T; prefill rates of the tensor-core paths for reference. Correctness is asserted, speed is
// only printed (it depends on the machine).
TEST(CudaGemmBench, GemvBandwidth) {
  K3_REQUIRE_GPU();
  const auto info = k3::cuda::device_info();
  std::printf("device: %s, %d SMs, datasheet HBM %.0f GB/s\n", info.name.c_str(), info.multiprocessors,
              info.peak_bandwidth_gbs());
  std::mt19937 rng(107);
  k3::cuda::Stream s = k3::cuda::stream_create();
  struct Case {
    WFormat f;
    int64_t rows, cols;
  };
  for (const Case& c : {Case{WFormat::BF16, 7168, 7168}, Case{WFormat::MXFP4, 16 * 3072, 3584}}) {
    const k3test::OwnedW W = k3test::make_weight(rng, c.f, c.rows, c.cols);
    const k3test::DevWeight dw = k3test::upload_weight(W.w);
    const double bytes =
        double(k3test::weight_data_bytes(W.w)) + (c.f == WFormat::MXFP4 ? double(c.rows * c.cols / 32) : 0.0);
    for (int64_t T : {int64_t(1), int64_t(2), int64_t(4), int64_t(8)}) {
      const auto X = k3test::rand_vec(rng, size_t(T * c.cols));
      const auto dx = k3test::to_dev(X);
      auto dy = k3test::dev_nan(size_t(T * c.rows));
      const Timed tm =
          time_calls(s, 50, [&] { k3::cuda::matmul(dw.view, dx.as<float>(), T, dy.as<float>(), Precision::BF16, s); });
      std::printf("matmul %-5s [%6lld, %5lld] T=%lld: %8.1f us  %7.0f GB/s (%.0f%% of datasheet)\n",
                  k3::wformat_name(c.f), (long long)c.rows, (long long)c.cols, (long long)T, tm.ms * 1e3,
                  bytes / (tm.ms * 1e-3) / 1e9, 100.0 * bytes / (tm.ms * 1e-3) / 1e9 / info.peak_bandwidth_gbs());
      const auto y = k3test::from_dev<float>(dy, size_t(T * c.rows));
      if (T == 1 && c.f == WFormat::BF16) {
        ASSERT_EQ(count_nan(y), 0u);
        EXPECT_LT(rel_l2(y, ref_matmul(W.w, X, 1)), kTolF32);
      } else {
        check_row_subsets(W.w, X, T, y, kTolF32);
      }
    }
    if (c.f == WFormat::MXFP4) {
      // The same bytes as 16 routed experts of [3072, 3584] for one token (decode, top_k = 16).
      const int64_t R = 3072, N = 16;
      std::vector<int32_t> ids(N);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      const auto X = k3test::rand_vec(rng, size_t(c.cols));
      const auto dx = k3test::to_dev(X);
      const auto di = k3test::to_dev(ids);
      auto dy = k3test::dev_nan(size_t(N * R));
      const Timed tm = time_calls(s, 50, [&] {
        k3::cuda::expert_matmul(dw.view, R, di.as<int32_t>(), N, dx.as<float>(), N, dy.as<float>(), Precision::BF16, s);
      });
      std::printf("expert_matmul MXFP4 16 x [3072, 3584] N=16: %8.1f us  %7.0f GB/s\n", tm.ms * 1e3,
                  bytes / (tm.ms * 1e-3) / 1e9);
      const auto y = k3test::from_dev<float>(dy, size_t(N * R));
      ASSERT_EQ(count_nan(y), 0u);
      for (int64_t n : {int64_t(0), N - 1}) {
        const k3::WeightMat We = row_view(W.w, int64_t(ids[size_t(n)]) * R, R);
        const auto want = ref_matmul(We, X, 1);
        EXPECT_LT(rel_l2(y.data() + n * R, want.data(), size_t(R)), kTolF32) << "slot " << n;
      }
    }
  }
  // Prefill (T = 512) on the BF16-precision tensor-core paths: cuBLAS (BF16) and mma.sync (MXFP4).
  for (WFormat f : {WFormat::BF16, WFormat::MXFP4}) {
    const int64_t rows = 7168, cols = 7168, T = 512;
    const k3test::OwnedW W = k3test::make_weight(rng, f, rows, cols);
    const k3test::DevWeight dw = k3test::upload_weight(W.w);
    const auto X = k3test::rand_vec(rng, size_t(T * cols));
    const auto dx = k3test::to_dev(X);
    auto dy = k3test::dev_nan(size_t(T * rows));
    const Timed tm =
        time_calls(s, 10, [&] { k3::cuda::matmul(dw.view, dx.as<float>(), T, dy.as<float>(), Precision::BF16, s); });
    std::printf("matmul %-5s [%lld, %lld] T=%lld bf16: %8.1f us  %6.1f TFLOP/s\n", k3::wformat_name(f), (long long)rows,
                (long long)cols, (long long)T, tm.ms * 1e3, 2.0 * double(rows * cols * T) / (tm.ms * 1e-3) / 1e12);
    const auto y = k3test::from_dev<float>(dy, size_t(T * rows));
    // Subset check on 8 tokens x 128 rows (the full fp64 twin would take minutes).
    const int64_t Tc = 8;
    const std::vector<float> Xc(X.begin(), X.begin() + Tc * cols);
    const auto Xr = round_bf16(Xc);
    std::vector<float> yc(size_t(Tc * rows));
    for (int64_t t = 0; t < Tc; ++t)
      for (int64_t r = 0; r < rows; ++r) yc[size_t(t * rows + r)] = y[size_t(t * rows + r)];
    check_row_subsets(W.w, Xc, Tc, yc, kTolBf16VsRounded, &Xr);
  }
  k3::cuda::stream_destroy(s);
}
