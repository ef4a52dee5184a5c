// ops::matmul and ops::dequant_row: the threaded driver over the per-ISA kernels of
// gemm_kernels.h, plus the scalar level (plain loops, fp64-accumulated dots).
// Owns: threading (rows split across the pool's threads, core/thread_pool.h; each output element is computed by exactly
// one kernel call, so results do not depend on the thread count), token blocking for prefill GEMMs,
// the bf16 rounding of activations in Numerics::Fast, and the MXFP4 x permutation for GEMVs. FP8
// weights take the fp32 paths of F32/F16 weights (their dequantised values are not bf16 values): the
// FP8 GEMV at T = 1 in every SIMD numerics, and in Fast the bf16-rounded activations through gemm_f32.
// Must not: change results beyond fp32 rounding versus the fp64 twins in Numerics::Exact.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "ops/cpu/gemm_kernels.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/scalar_dot.h"
#include "ops/cpu/scratch.h"
#include "ops/ops.h"

namespace k3::ops {

namespace {
// Below this many multiply-adds a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 17;
// Prefill GEMMs walk tokens in blocks so the block's activations stay in L2 while W streams by.
constexpr int64_t kTokenBlock = 64;
constexpr int64_t kRowBlock = 16;

// Buffers of the bf16 GEMM (the packed activations, one row tile), the per-thread scratch of
// ops/cpu/scratch.h: a prefill makes hundreds of these calls, and fresh allocations of this size
// are fresh pages, faulted in and zeroed every time.
uint32_t* bf16_packed_x(size_t n) { return cpu::scratch<uint32_t>(cpu::ScratchId::Bf16PackedX, int64_t(n)); }
uint32_t* bf16_row_tile(size_t n) { return cpu::scratch<uint32_t>(cpu::ScratchId::Bf16RowTile, int64_t(n)); }
// Decode GEMVs hand out rows in chunks of about this many weight bytes (see gemv_threaded).
constexpr int64_t kGemvChunkBytes = int64_t(64) << 10;
// Rows of one such chunk for rows of `bytes` bytes each: whole 8-row tiles, at least one.
int64_t gemv_chunk_rows(int64_t bytes) {
  return std::max<int64_t>(8, kGemvChunkBytes / std::max<int64_t>(1, bytes) / 8 * 8);
}

const cpu::GemmKernels* kernels_for(CpuIsa isa) {
#if defined(K3_HAVE_X86_KERNELS)
  switch (isa) {
    case CpuIsa::Amx:
      return &cpu::avx512::kGemmAmx;
    case CpuIsa::Avx512:
      return &cpu::avx512::kGemm;
    case CpuIsa::Avx2:
      return &cpu::avx2::kGemm;
    case CpuIsa::Scalar:
      return nullptr;
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
    case WFormat::FP8: {  // the code's value times its block's scale: one fp32 multiply (WeightMat::at)
      const uint8_t* p = static_cast<const uint8_t*>(W.data) + r * n;
      const float* s = fp8_row_scales(W, r);
      for (int64_t c = 0; c < n; ++c) out[c] = kE4M3[p[c]] * s[c / kFp8Block];
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
  const auto buffer = [&] { return cpu::scratch<float>(cpu::ScratchId::ScalarRows, kRows * W.cols); };
  par::parallel_for_each_setup(
      nblocks, buffer,
      [&](int64_t b) {
        float* const buf = buffer();
        const int64_t r0 = b * kRows, r1 = std::min(W.rows, r0 + kRows);
        for (int64_t r = r0; r < r1; ++r) dequant_row_impl(W, r, buf + (r - r0) * W.cols);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = r0; r < r1; ++r)
            Y[t * W.rows + r] = dot_f64acc(buf + (r - r0) * W.cols, X + t * W.cols, W.cols);
      },
      W.rows * W.cols * std::max<int64_t>(T, 4) > kParallelMin);
}

// Activations rounded to bf16 and widened back (Numerics::Fast where there is no bf16 dot).
std::vector<float> round_to_bf16(const float* X, int64_t n) {
  std::vector<float> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[size_t(i)] = bf16_to_f32(f32_to_bf16(X[i]));
  return r;
}

// x in the nibble order of packed MXFP4 rows: per 32-block, the 16 even columns then the 16 odd.
void permute_x_mxfp4(const float* x, int64_t cols, float* xp) {
  for (int64_t b = 0; b < cols / 32; ++b)
    for (int64_t j = 0; j < 16; ++j) {
      xp[32 * b + j] = x[32 * b + 2 * j];
      xp[32 * b + 16 + j] = x[32 * b + 2 * j + 1];
    }
}

// The 8-bit activations of a fast MXFP4 GEMV, dequantised, in natural column order (scalar level).
std::vector<float> q8_dequantised(const float* x, int64_t cols) {
  const int64_t ng = cols / 128;
  std::vector<int8_t> xq(static_cast<size_t>(ng * 128));
  std::vector<int32_t> xc(static_cast<size_t>(ng * 16));
  std::vector<float> xs(static_cast<size_t>(ng * 16)), xr(static_cast<size_t>(cols)), deq(static_cast<size_t>(cols));
  cpu::quantize_q8_scalar(x, cols, xq.data(), xc.data(), xs.data(), xr.data());
  for (int64_t b = 0; b < cols / 32; ++b)
    for (int64_t j = 0; j < 16; ++j) {
      deq[size_t(32 * b + 2 * j)] = xr[size_t(32 * b + j)];
      deq[size_t(32 * b + 2 * j + 1)] = xr[size_t(32 * b + 16 + j)];
    }
  return deq;
}

// The prepared copies of one GEMV input (grown, never shrunk): no allocation per GEMV.
struct InputScratch {
  std::vector<int8_t> xq;
  std::vector<int32_t> xc;
  std::vector<float> xs, xr;
  std::vector<float> xp_bf16[16];  // by head column / 2
};
struct GemvChunk {
  int64_t w, r0, r1;  // rows [r0, r1) of weight w
};

// The input of T = 1 products, prepared once for all weights that share x.
struct GemvInput {
  const float* x = nullptr;       // natural order: BF16/F16/F32 weights
  const float* xp_mx = nullptr;   // MXFP4: x, or its 8-bit dequantisation in fast mode, permuted
  const float* xp_bf16[32] = {};  // BF16 with head h (cpu::bf16_head): x permuted from column h
  bool q8 = false;                // MXFP4 through gemv_mxfp4_q8 (xq, xc, xs)
  const int8_t* xq = nullptr;
  const int32_t* xc = nullptr;
  const float* xs = nullptr;
};

// Per-thread state of the T = 1 driver: the row chunks, and one prepared input per distinct x.
struct GemvScratch {
  std::vector<GemvChunk> chunks;
  std::vector<InputScratch> inputs;
  std::vector<GemvInput> prepared;
  std::vector<int64_t> input_of;  // per weight: its index into prepared
};
GemvScratch& gemv_scratch() {
  thread_local GemvScratch s;
  return s;
}

// Prepares x for the weights W[i] with input_of[i] == slot. fast: Numerics::Fast, which at T = 1
// applies to MXFP4 weights only (fast_applies); BF16 weights always take x unrounded.
GemvInput prepare_gemv(const cpu::GemmKernels& K, const WeightMat* const* W, int64_t n, const int64_t* input_of,
                       int64_t slot, const float* x, bool fast, InputScratch& s) {
  GemvInput in;
  in.x = x;
  int64_t cols = 0;
  bool mxfp4 = false;
  for (int64_t i = 0; i < n; ++i) {
    if (input_of[i] != slot) continue;
    cols = W[i]->cols;
    mxfp4 = mxfp4 || W[i]->fmt == WFormat::MXFP4;
    if (W[i]->fmt != WFormat::BF16 || !K.bf16_uses_xp) continue;
    // BF16 weights are dotted with x permuted from their head column.
    const int64_t h = cpu::bf16_head(W[i]->data, cols);
    if (h < 0 || in.xp_bf16[h]) continue;
    std::vector<float>& buf = s.xp_bf16[size_t(h / 2)];
    buf.resize(size_t(cols));
    permute_x_mxfp4(x + h, cols - h, buf.data());  // blocks from column h
    in.xp_bf16[h] = buf.data();
  }
  if (!mxfp4) return in;
  s.xr.resize(size_t(cols));
  in.xp_mx = s.xr.data();
  if (fast) {
    // 8-bit activations, through vpdpbusd where the level has it, else the same dequantised
    // activations through the fp32 kernel.
    const int64_t ng = cols / 128;
    s.xq.resize(size_t(ng * 128));
    s.xc.resize(size_t(ng * 16));
    s.xs.resize(size_t(ng * 16));
    (K.quantize_q8 ? K.quantize_q8 : cpu::quantize_q8_scalar)(x, cols, s.xq.data(), s.xc.data(), s.xs.data(),
                                                              s.xr.data());
    in.q8 = K.gemv_mxfp4_q8 != nullptr;
    in.xq = s.xq.data();
    in.xc = s.xc.data();
    in.xs = s.xs.data();
  } else {
    permute_x_mxfp4(x, cols, s.xr.data());
  }
  return in;
}

// Y[i] = X[i] · W[i]ᵀ for n weights, in one parallel region; weights whose inputs are the same
// pointer share one prepared copy of it (quantised or permuted once). The rows of all of them
// are cut into chunks of about kGemvChunkBytes (whole 8-row tiles) that the threads take in
// guided order: first long runs of consecutive chunks (long streams for the prefetchers; a
// chunk's kernel prefetches into the next chunk, usually taken by the same thread), then ever
// shorter ones, so a thread that reads memory faster takes more. On a shared VM two cores rarely
// read at the same rate: a static half each left ~10% of decode samples waiting in the barrier,
// ~6% after. Each output element is still computed by one kernel call with the same per-row
// arithmetic, so the result does not depend on the thread count or on who took which chunk.
void gemv_threaded(const cpu::GemmKernels& K, const WeightMat* const* W, int64_t n, const float* const* X, bool fast,
                   float* const* Y) {
  int64_t work = 0;
  GemvScratch& s = gemv_scratch();
  s.chunks.clear();
  s.input_of.assign(size_t(n), -1);
  int64_t slots = 0;
  for (int64_t i = 0; i < n; ++i) {
    const WeightMat& w = *W[i];
    for (int64_t j = 0; j < i && s.input_of[size_t(i)] < 0; ++j)
      if (X[j] == X[i] && W[j]->cols == w.cols) s.input_of[size_t(i)] = s.input_of[size_t(j)];
    if (s.input_of[size_t(i)] < 0) s.input_of[size_t(i)] = slots++;
    work += w.rows * w.cols;
    const int64_t bytes = row_bytes(w) + (w.fmt == WFormat::MXFP4 ? w.cols / 32 : 0);
    const int64_t step = gemv_chunk_rows(bytes);
    for (int64_t r = 0; r < w.rows; r += step) s.chunks.push_back({i, r, std::min(w.rows, r + step)});
  }
  if (s.inputs.size() < size_t(slots)) s.inputs.resize(size_t(slots));
  s.prepared.resize(size_t(slots));
  for (int64_t i = 0, next = 0; i < n; ++i)
    if (s.input_of[size_t(i)] == next) {
      s.prepared[size_t(next)] = prepare_gemv(K, W, n, s.input_of.data(), next, X[i], fast, s.inputs[size_t(next)]);
      ++next;
    }
  const auto nchunks = int64_t(s.chunks.size());
  const GemvChunk* chunks = s.chunks.data();
  const GemvInput* prepared = s.prepared.data();
  const int64_t* input_of = s.input_of.data();
  par::parallel_for_each(
      nchunks,
      [&](int64_t c) {
        const GemvChunk& ch = chunks[c];
        const WeightMat& w = *W[ch.w];
        const GemvInput& in = prepared[input_of[ch.w]];
        if (w.fmt == WFormat::BF16) {
          const int64_t h = cpu::bf16_head(w.data, w.cols);
          K.gemv(w, in.x, h >= 0 ? in.xp_bf16[h] : nullptr, ch.r0, ch.r1, Y[ch.w]);
        } else if (w.fmt != WFormat::MXFP4)
          K.gemv(w, in.x, nullptr, ch.r0, ch.r1, Y[ch.w]);
        else if (in.q8)
          K.gemv_mxfp4_q8(w, in.xq, in.xc, in.xs, in.xp_mx, ch.r0, ch.r1, Y[ch.w]);
        else
          K.gemv(w, in.x, in.xp_mx, ch.r0, ch.r1, Y[ch.w]);
      },
      work > kParallelMin);
}

void gemm_threaded(const cpu::GemmKernels& K, const WeightMat& W, const float* X, int64_t T, bool fast, float* Y) {
  const int64_t rows = W.rows, cols = W.cols, nrb = (rows + kRowBlock - 1) / kRowBlock;
  const bool parallel = rows * cols * T > kParallelMin;
  // The bf16 dot product is used only where the weights are exactly bf16 values (BF16, and MXFP4
  // whose E2M1 x 2^k values all are); F32/F16 weights keep fp32 products on the rounded activations.
  if (fast && K.gemm_bf16 && (W.fmt == WFormat::BF16 || W.fmt == WFormat::MXFP4)) {
    // The activations packed once (bf16 pairs, 16 tokens a vector), the weights read in place.
    // Passes of `tb` tokens keep the packed activations within L2; rows go out in chunks in
    // dynamic order (a shared machine's cores rarely run at one speed).
    const int64_t np = (cols + 31) / 32 * 32, tpad = (T + 15) / 16 * 16, ngroups = tpad / 16;
    const int64_t tb = std::clamp<int64_t>((int64_t(512) << 10) / (2 * np) / 64 * 64, 64, 256);
    const int64_t chunk = K.gemm_bf16_rows, nchunks = (rows + chunk - 1) / chunk;
    uint32_t* const Xp = bf16_packed_x(size_t(tpad * np / 2));
    par::parallel_for_each(
        ngroups, [&](int64_t g) { K.pack_x_bf16(X, cols, np, tpad, 16 * g, std::min(T, 16 * g + 16), Xp); }, parallel);
    const auto rows_buffer = [&] { return bf16_row_tile(size_t(16 * np + 512)); };
    for (int64_t t0 = 0; t0 < T; t0 += tb)
      par::parallel_for_each_setup(
          nchunks, rows_buffer,
          [&](int64_t c) {
            uint32_t* const rows_buf = rows_buffer();
            K.gemm_bf16(W, Xp + t0, tpad, np, std::min(tb, T - t0), c * chunk, std::min(rows, (c + 1) * chunk),
                        Y + t0 * rows, rows, rows_buf);
          },
          parallel);
    return;
  }
  if (fast) {
    float* const rounded = cpu::scratch<float>(cpu::ScratchId::GemmRounded, T * cols);
    for (int64_t i = 0; i < T * cols; ++i) rounded[i] = bf16_to_f32(f32_to_bf16(X[i]));
    X = rounded;
  }
  for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
    const int64_t tb = std::min(kTokenBlock, T - t0);
    const auto buffer = [&] { return cpu::scratch<float>(cpu::ScratchId::GemmRows, 4 * cols); };
    par::parallel_for_setup(
        nrb, par::balanced_grain(nrb), buffer,
        [&](int64_t b0, int64_t b1) {
          float* const scratch = buffer();
          for (int64_t b = b0; b < b1; ++b)
            K.gemm_f32(W, X + t0 * cols, tb, b * kRowBlock, std::min(rows, (b + 1) * kRowBlock), Y + t0 * rows, rows,
                       scratch);
        },
        parallel);
  }
}
}  // namespace

namespace cpu {
// x quantised per 32-column block to int8 (step = max|x| / 127, round to nearest) for the fast
// MXFP4 GEMV, in the layouts of GemmKernels::gemv_mxfp4_q8 (like llama.cpp's q8_0):
//   xq per 128-col group: 64 even-column values, then 64 odd; xc per group: 16 lanes, -12 * sum of
//   the lane's 8 values; xs per group: 16 lanes, block step / 2; xr: the dequantised x, per 32-block
//   the 16 even then the 16 odd columns (the activations the product is exactly taken with).
void quantize_q8_scalar(const float* x, int64_t cols, int8_t* xq, int32_t* xc, float* xs, float* xr) {
  const int64_t nb = cols / 32, ng = nb / 4;
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0;
    for (int64_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
    const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    int8_t q[32];
    for (int64_t j = 0; j < 32; ++j) {
      // Round to nearest, ties to even (as lrint), without a libm call: |x * inv| <= 127, so adding
      // and subtracting 1.5 * 2^23 leaves exactly the rounded integer (no -ffast-math here).
      q[j] = int8_t((x[32 * b + j] * inv + 12582912.0f) - 12582912.0f);
    }
    for (int64_t j = 0; j < 16; ++j) {
      xr[32 * b + j] = float(q[2 * j]) * d;
      xr[32 * b + 16 + j] = float(q[2 * j + 1]) * d;
    }
    if (b >= 4 * ng) continue;  // a tail block: only the fp32 path (xr) reads it
    const int64_t g = b / 4, jb = b % 4;
    for (int64_t j = 0; j < 16; ++j) {
      xq[128 * g + 16 * jb + j] = q[2 * j];
      xq[128 * g + 64 + 16 * jb + j] = q[2 * j + 1];
    }
    for (int64_t l = 0; l < 4; ++l) {
      int32_t sum = 0;
      for (int64_t j = 8 * l; j < 8 * l + 8; ++j) sum += q[j];
      xc[16 * g + 4 * jb + l] = -12 * sum;
      xs[16 * g + 4 * jb + l] = d * 0.5f;
    }
  }
}
}  // namespace cpu

void dequant_row(const WeightMat& W, int64_t r, float* out) { dequant_row_impl(W, r, out); }

void reserve_matmul(int64_t T, int64_t n, int64_t rows, int64_t cols, bool bf16) {
  // The bf16 GEMM's buffers (gemm_threaded): the packed activations and one row tile.
  const int64_t np = (cols + 31) / 32 * 32, tpad = (T + 15) / 16 * 16;
  bf16_packed_x(size_t(tpad * np / 2));
  bf16_row_tile(size_t(6 * np));
  // The one-row driver (gemv_threaded): row chunks of at least 8 rows, one prepared input per weight.
  GemvScratch& s = gemv_scratch();
  s.chunks.reserve(size_t(n * (rows / 8 + 1)));
  s.input_of.reserve(size_t(n));
  s.prepared.reserve(size_t(n));
  if (s.inputs.size() < size_t(n)) s.inputs.resize(size_t(n));
  for (InputScratch& in : s.inputs) {
    const size_t ng = size_t(cols / 128);
    in.xq.reserve(ng * 128);
    in.xc.reserve(ng * 16);
    in.xs.reserve(ng * 16);
    in.xr.reserve(size_t(cols));
    if (bf16)
      for (auto& b : in.xp_bf16) b.reserve(size_t(cols));
  }
}

bool fast_applies(Exec ex, const WeightMat& W, int64_t T) {
  return ex.fast() && (T >= kFastMinRows || (T == 1 && W.fmt == WFormat::MXFP4));
}

void matmul(Exec ex, const WeightMat& W, const float* X, int64_t T, float* Y) {
  const bool fast = fast_applies(ex, W, T);
  const cpu::GemmKernels* K = kernels_for(ex.level());
  if (!K) {
    if (!fast) return matmul_scalar(W, X, T, Y);
    const auto r = T == 1 ? q8_dequantised(X, W.cols) : round_to_bf16(X, T * W.cols);
    return matmul_scalar(W, r.data(), T, Y);
  }
  const WeightMat* w = &W;
  if (T == 1) return gemv_threaded(*K, &w, 1, &X, fast, &Y);
  gemm_threaded(*K, W, X, T, fast, Y);
}

void matmul_many(Exec ex, const WeightMat* const* W, const float* const* X, int64_t n, int64_t T, float* const* Y) {
  const cpu::GemmKernels* K = kernels_for(ex.level());
  // One parallel region for all of them where that is what one matmul would do (T = 1 on a SIMD
  // level). At T = 1 Numerics::Fast changes only MXFP4 products (fast_applies), which
  // prepare_gemv applies per weight.
  if (n > 0 && T == 1 && K) return gemv_threaded(*K, W, n, X, ex.fast(), Y);
  for (int64_t i = 0; i < n; ++i) matmul(ex, *W[i], X[i], T, Y[i]);
}

// T inputs of a dense weight, each as its own GEMV would compute it (gemv_multi), the rows cut
// into chunks the threads take in guided order as in gemv_threaded. BF16 rows with a head take
// each x permuted from that column, prepared once per call in per-thread buffers.
struct MultiScratch {
  std::vector<float> xp;
  std::vector<const float*> x, xpp;
};
MultiScratch& multi_scratch() {
  thread_local MultiScratch s;
  return s;
}

void gemv_multi_threaded(const cpu::GemmKernels& K, const WeightMat& W, const float* X, int64_t T, float* Y) {
  const int64_t cols = W.cols;
  MultiScratch& s = multi_scratch();
  s.x.resize(size_t(T));
  s.xpp.assign(size_t(T), nullptr);
  for (int64_t t = 0; t < T; ++t) s.x[size_t(t)] = X + t * cols;
  const int64_t h = W.fmt == WFormat::BF16 && K.bf16_uses_xp ? cpu::bf16_head(W.data, cols) : -1;
  if (h >= 0) {
    if (s.xp.size() < size_t(T * cols)) s.xp.resize(size_t(T * cols));
    for (int64_t t = 0; t < T; ++t) {
      permute_x_mxfp4(X + t * cols + h, cols - h, s.xp.data() + t * cols);
      s.xpp[size_t(t)] = s.xp.data() + t * cols;
    }
  }
  const int64_t step = gemv_chunk_rows(row_bytes(W));
  const int64_t nchunks = (W.rows + step - 1) / step;
  const float* const* x = s.x.data();
  const float* const* xp = s.xpp.data();
  par::parallel_for_each(
      nchunks, [&](int64_t c) { K.gemv_multi(W, x, xp, T, c * step, std::min(W.rows, (c + 1) * step), Y, W.rows); },
      W.rows * cols * T > kParallelMin);
}

void matmul_rowwise(Exec ex, const WeightMat& W, const float* X, int64_t T, float* Y) {
  const cpu::GemmKernels* K = kernels_for(ex.level());
  if (T > 1 && K && K->gemv_multi && W.fmt != WFormat::MXFP4 && W.fmt != WFormat::FP8)
    return gemv_multi_threaded(*K, W, X, T, Y);
  for (int64_t t = 0; t < T; ++t) matmul(ex, W, X + t * W.cols, 1, Y + t * W.rows);
}

void matmul_shared_input(Exec ex, const WeightMat* const* W, int64_t n, const float* X, int64_t T, float* const* Y) {
  for (int64_t i = 1; i < n; ++i) assert(W[i]->cols == W[0]->cols);
  constexpr int64_t kStack = 32;
  const float* stack[kStack];
  std::vector<const float*> heap(static_cast<size_t>(n > kStack ? n : 0), X);
  const float** xs = n > kStack ? heap.data() : stack;
  for (int64_t i = 0; i < n && n <= kStack; ++i) xs[i] = X;
  matmul_many(ex, W, xs, n, T, Y);
}

}  // namespace k3::ops
