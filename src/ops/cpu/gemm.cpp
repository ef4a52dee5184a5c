// ops::matmul and ops::dequant_row: the threaded driver over the per-ISA kernels of
// gemm_kernels.h, plus the scalar level (plain loops, fp64-accumulated dots).
// Owns: threading (rows split across OpenMP threads; each output element is computed by exactly
// one kernel call, so results do not depend on the thread count), token blocking for prefill GEMMs,
// the bf16 rounding of activations in Numerics::Fast, and the MXFP4 x permutation for GEMVs.
// Must not: change results beyond fp32 rounding versus the fp64 twins in Numerics::Exact.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/gemm_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/scalar_dot.h"
#include "ops/ops.h"

namespace k3::ops {

namespace {
// Below this many multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 17;
// Prefill GEMMs walk tokens in blocks so the block's activations stay in L2 while W streams by.
constexpr int64_t kTokenBlock = 64;
constexpr int64_t kRowBlock = 16;

const cpu::GemmKernels* kernels_for(CpuIsa isa) {
#if defined(K3_HAVE_X86_KERNELS)
  switch (isa) {
    case CpuIsa::Avx512: return &cpu::avx512::kGemm;
    case CpuIsa::Avx2: return &cpu::avx2::kGemm;
    case CpuIsa::Scalar: return nullptr;
  }
#endif
  (void)isa;
  return nullptr;
}

void dequant_row_impl(const WeightMat& W, int64_t r, float* out) {
  const int64_t n = W.cols;
  switch (W.fmt) {
    case WFormat::F32:
      std::memcpy(out, static_cast<const uint8_t*>(W.data) + 4 * r * n, size_t(n) * 4);
      break;
    case WFormat::BF16: {  // rows may be unaligned inside the mmap'd shard: byte loads only
      const uint8_t* p = static_cast<const uint8_t*>(W.data) + 2 * r * n;
      for (int64_t c = 0; c < n; ++c) out[c] = bf16_to_f32(load_u16(p + 2 * c));
      break;
    }
    case WFormat::F16: {
      const uint8_t* p = static_cast<const uint8_t*>(W.data) + 2 * r * n;
      for (int64_t c = 0; c < n; ++c) out[c] = f16_to_f32(load_u16(p + 2 * c));
      break;
    }
    case WFormat::MXFP4: {
      const uint8_t* p = static_cast<const uint8_t*>(W.data) + r * (n / 2);
      const uint8_t* s = W.scales + r * (n / 32);
      for (int64_t gi = 0; gi < n / 32; ++gi) {
        const float sc = e8m0_to_f32(s[gi]);
        for (int64_t j = 0; j < 16; ++j) {
          const uint8_t b = p[gi * 16 + j];
          out[gi * 32 + 2 * j] = kE2M1[b & 0x0f] * sc;    // low nibble = even column
          out[gi * 32 + 2 * j + 1] = kE2M1[b >> 4] * sc;  // high nibble = odd column
        }
      }
      break;
    }
  }
}

void matmul_scalar(const WeightMat& W, const float* X, int64_t T, float* Y) {
  constexpr int64_t kRows = 8;
  const int64_t nblocks = (W.rows + kRows - 1) / kRows;
#pragma omp parallel if (W.rows * W.cols * std::max<int64_t>(T, 4) > kParallelMin)
  {
    std::vector<float> buf(static_cast<size_t>(kRows * W.cols));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t r0 = b * kRows, r1 = std::min(W.rows, r0 + kRows);
      for (int64_t r = r0; r < r1; ++r) dequant_row_impl(W, r, buf.data() + (r - r0) * W.cols);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = r0; r < r1; ++r)
          Y[t * W.rows + r] = dot_f64acc(buf.data() + (r - r0) * W.cols, X + t * W.cols, W.cols);
    }
  }
}

// Activations rounded to bf16 and widened back (Numerics::Fast where there is no bf16 dot).
std::vector<float> round_to_bf16(const float* X, int64_t n) {
  std::vector<float> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[size_t(i)] = bf16_to_f32(f32_to_bf16(X[i]));
  return r;
}

// x in the nibble order of packed MXFP4 rows: per 32-block, the 16 even columns then the 16 odd.
std::vector<float> permute_x_mxfp4(const float* x, int64_t cols) {
  std::vector<float> xp(static_cast<size_t>(cols));
  for (int64_t b = 0; b < cols / 32; ++b)
    for (int64_t j = 0; j < 16; ++j) {
      xp[size_t(32 * b + j)] = x[32 * b + 2 * j];
      xp[size_t(32 * b + 16 + j)] = x[32 * b + 2 * j + 1];
    }
  return xp;
}

// x quantised per 32-column block to int8 (step = max|x| / 127, round to nearest) for the fast
// MXFP4 GEMV, in the layouts of GemmKernels::gemv_mxfp4_q8; deq receives the dequantised x
// (natural order): the activations the product is exactly taken with. Like llama.cpp's q8_0.
struct Q8x {
  std::vector<int8_t> q;     // per 128-col group: 64 even-column values, then 64 odd
  std::vector<int32_t> c;    // per group: 16 lanes, -12 * sum of the lane's 8 values
  std::vector<float> s;      // per group: 16 lanes, block step / 2
  std::vector<float> deq;    // natural order
};

Q8x quantize_x_mxfp4_q8(const float* x, int64_t cols) {
  Q8x r;
  const int64_t nb = cols / 32, ng = nb / 4;
  std::vector<int8_t> q(static_cast<size_t>(cols));
  std::vector<float> step(static_cast<size_t>(nb));
  r.deq.resize(size_t(cols));
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0;
    for (int64_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
    const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    step[size_t(b)] = d;
    for (int64_t j = 0; j < 32; ++j) {
      // Round to nearest, ties to even (as lrint), without a libm call: |x * inv| <= 127, so adding
      // and subtracting 1.5 * 2^23 leaves exactly the rounded integer (no -ffast-math here).
      const auto v = int8_t((x[32 * b + j] * inv + 12582912.0f) - 12582912.0f);
      q[size_t(32 * b + j)] = v;
      r.deq[size_t(32 * b + j)] = float(v) * d;
    }
  }
  r.q.resize(size_t(ng * 128));
  r.c.resize(size_t(ng * 16));
  r.s.resize(size_t(ng * 16));
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t i = 0; i < 64; ++i) {
      r.q[size_t(128 * g + i)] = q[size_t(128 * g + 2 * i)];
      r.q[size_t(128 * g + 64 + i)] = q[size_t(128 * g + 2 * i + 1)];
    }
    for (int64_t j = 0; j < 16; ++j) {
      int32_t sum = 0;
      for (int64_t i = 4 * j; i < 4 * j + 4; ++i) sum += q[size_t(128 * g + 2 * i)] + q[size_t(128 * g + 2 * i + 1)];
      r.c[size_t(16 * g + j)] = -12 * sum;
      r.s[size_t(16 * g + j)] = step[size_t(4 * g + j / 4)] * 0.5f;
    }
  }
  return r;
}

void gemv_threaded(const cpu::GemmKernels& K, const WeightMat& W, const float* x, bool fast, float* y) {
  // Fast applies to a GEMV only for MXFP4 (fast_applies): 8-bit activations, through vpdpbusd where
  // the level has it, else the same dequantised activations through the fp32 kernel.
  std::vector<float> xp;
  Q8x q8;
  const bool q8_kernel = fast && K.gemv_mxfp4_q8;
  if (fast) {
    q8 = quantize_x_mxfp4_q8(x, W.cols);
    x = q8.deq.data();
  }
  if (W.fmt == WFormat::MXFP4) xp = permute_x_mxfp4(x, W.cols);
#pragma omp parallel if (W.rows * W.cols > kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = ((W.rows + nt - 1) / nt + 3) / 4 * 4;
    const int64_t r0 = std::min(W.rows, id * per), r1 = std::min(W.rows, r0 + per);
    if (r0 < r1) {
      if (q8_kernel) K.gemv_mxfp4_q8(W, q8.q.data(), q8.c.data(), q8.s.data(), xp.data(), r0, r1, y);
      else K.gemv(W, x, xp.data(), r0, r1, y);
    }
  }
}

void gemm_threaded(const cpu::GemmKernels& K, const WeightMat& W, const float* X, int64_t T, bool fast, float* Y) {
  const int64_t rows = W.rows, cols = W.cols, nrb = (rows + kRowBlock - 1) / kRowBlock;
  const bool par = rows * cols * T > kParallelMin;
  // The bf16 dot product is used only where the weights are exactly bf16 values (BF16, and MXFP4
  // whose E2M1 x 2^k values all are); F32/F16 weights keep fp32 products on the rounded activations.
  if (fast && K.gemm_bf16 && (W.fmt == WFormat::BF16 || W.fmt == WFormat::MXFP4)) {
    const int64_t np = (cols + 31) / 32 * 32;
    std::vector<uint16_t> Xb(static_cast<size_t>(T * np), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < cols; ++c) Xb[size_t(t * np + c)] = f32_to_bf16(X[t * cols + c]);
#pragma omp parallel if (par)
    {
      std::vector<uint16_t> scratch(static_cast<size_t>(4 * np + 2 * cols));
      for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
        const int64_t tb = std::min(kTokenBlock, T - t0);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nrb; ++b)
          K.gemm_bf16(W, Xb.data() + t0 * np, np, tb, b * kRowBlock, std::min(rows, (b + 1) * kRowBlock),
                      Y + t0 * rows, rows, scratch.data());
      }
    }
    return;
  }
  std::vector<float> rounded;
  if (fast) {
    rounded = round_to_bf16(X, T * cols);
    X = rounded.data();
  }
#pragma omp parallel if (par)
  {
    std::vector<float> scratch(static_cast<size_t>(4 * cols));
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
      const int64_t tb = std::min(kTokenBlock, T - t0);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < nrb; ++b)
        K.gemm_f32(W, X + t0 * cols, tb, b * kRowBlock, std::min(rows, (b + 1) * kRowBlock), Y + t0 * rows, rows,
                   scratch.data());
    }
  }
}
}  // namespace

void dequant_row(const WeightMat& W, int64_t r, float* out) { dequant_row_impl(W, r, out); }

bool fast_applies(const WeightMat& W, int64_t T) {
  return current_numerics() == Numerics::Fast && (T >= kFastMinRows || (T == 1 && W.fmt == WFormat::MXFP4));
}

void matmul(const WeightMat& W, const float* X, int64_t T, float* Y) {
  const bool fast = fast_applies(W, T);
  const cpu::GemmKernels* K = kernels_for(active_kernel_level());
  if (!K) {
    if (!fast) return matmul_scalar(W, X, T, Y);
    const auto r = T == 1 ? quantize_x_mxfp4_q8(X, W.cols).deq : round_to_bf16(X, T * W.cols);
    return matmul_scalar(W, r.data(), T, Y);
  }
  if (T == 1) return gemv_threaded(*K, W, X, fast, Y);
  gemm_threaded(*K, W, X, T, fast, Y);
}

}  // namespace k3::ops
