// GPU matrix products (cuda_ops.h matmul / expert_matmul): GEMVs for T <= kGemvMaxT and experts
// (formats decoded in registers), tiled GEMMs above (fp32 SIMT, cuBLAS for BF16, bf16 mma.sync for MXFP4
// and FP8). FP8 weights come in their GPU form (weight.h: fp32 scales per row and 128 columns).
// Owns: the per-device cuBLAS handles and the grow-only bf16 activation scratch of the T > kGemvMaxT path.
// Must not: allocate, sync or read device data on the host in the GEMV / expert paths (CUDA graphs
// capture them), or expand MXFP4 weights in memory.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "ops/cuda/act.cuh"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/mma.cuh"

namespace k3::cuda {

namespace {
// Error messages are formatted into a buffer: this file is compiled as C++17 by nvcc, and string
// concatenation here would reference std::string members that the static library resolves from
// whichever C++20 object defines them first (dragging unrelated objects into every link).
[[noreturn]] void failf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fail(buf);
}
}  // namespace

const char* precision_name(Precision p) { return p == Precision::F32 ? "fp32" : "bf16"; }

Precision parse_precision(const char* name) {
  if (name && std::strcmp(name, "fp32") == 0) return Precision::F32;
  if (name && std::strcmp(name, "bf16") == 0) return Precision::BF16;
  failf("unknown matmul precision '%s' (expected fp32 or bf16)", name ? name : "");
}

namespace {

// ------------------------------------------------------------------ decoding helpers

constexpr int kGemvWarps = 4;  // warps per GEMV block (small blocks balance the tail across SMs)
constexpr int kGemvThreads = 32 * kGemvWarps;

template <WFormat F>
constexpr int64_t row_bytes(int64_t cols) {
  return F == WFormat::F32 ? cols * 4 : F == WFormat::MXFP4 ? cols / 2 : F == WFormat::FP8 ? cols : cols * 2;
}
// Bytes of one row's scales (MXFP4: E8M0 per 32 columns; FP8: fp32 per 128, the GPU form of weight.h).
template <WFormat F>
__host__ __device__ constexpr int64_t scale_row_bytes(int64_t cols) {
  return F == WFormat::MXFP4 ? cols / 32 : F == WFormat::FP8 ? 4 * ((cols + 127) / 128) : 0;
}
// float4s of activations per 16-byte weight chunk (4, 8, 16 or 32 columns).
template <WFormat F>
constexpr int chunk_f4() {
  return F == WFormat::F32 ? 1 : F == WFormat::MXFP4 ? 8 : F == WFormat::FP8 ? 4 : 2;
}

// Whether a GEMV of T tokens with R rows per warp lifts its activations by 2^64: MXFP4 decodes weights
// with a 2^-126 factor (decode_fp4x8), and when T <= R it is cheaper to lift the activations (exact
// while |x| < 2^64; products stay normal for |x| > 2^-64) and drop 2^62 at each block end than to
// lift every decoded weight; FP8 decodes with 2^-120 (decode_e4m3x4_lo) and always lifts them. The
// one rule for the staging (GemvCfg::lift_x), the direct loads (warp_gemv) and the sums (chunk_fma).
template <WFormat F, int T, int R>
constexpr bool lifts_x() {
  return (F == WFormat::MXFP4 && T <= R) || F == WFormat::FP8;
}

// GEMV shape for (format, T). Each lane owns 16-byte weight chunks of R rows, U chunks per row per
// step (R * U loads in flight), so every weight load is reused for all T tokens and every
// activation load for R rows. Limits beyond HBM seen on H200: (1) activation loads: lanes read 32
// different columns at a time, and through L1 each such strided load costs a cycle per cache line
// touched (32 for MXFP4: 128 bytes of x per lane) -- staging x in shared memory took MXFP4 T = 8
// from 131 to ~390 GB/s; (2) MXFP4 is then bound by the instruction issue of its in-register
// decode (~2.1 TB/s at T = 1; overlapping loads with math did not move it). SMEM path: x tiles
// staged in shared memory (swizzled, conflict-free 128-bit reads), the next tile's weight loads
// issued before the current tile is computed (double-buffered in registers; BF16 T = 8 went from
// 1.5 to 1.9 TB/s); MXFP4 and FP8 always, the others from 2 tokens (at T = 1 their direct loads are
// cheap, and one row per warp, the smallest work unit, balances the tail across SMs best: 3.7 TB/s).
// FP8 at T = 1 read directly was bound by (1): 64 bytes of x per 16 weight bytes, 31.6% of HBM on
// the H100 (docs/data/fp8-gpu-2026-12-05.json).
template <WFormat F, int T>
struct GemvCfg {
  static constexpr bool smem() { return F == WFormat::MXFP4 || F == WFormat::FP8 || T >= 2; }
  static constexpr int rows() {
    return F == WFormat::MXFP4 ? (T <= 4 ? 4 : 2) : T == 1 ? (F == WFormat::FP8 ? 2 : 1) : T > 4 ? 4 : 2;
  }
  // Loads per lane per step: the SMEM path holds two steps' worth (double buffer); the direct path
  // relies on other warps, and above 4 tokens its registers go to the accumulators.
  static constexpr int loads() { return smem() ? (F == WFormat::MXFP4 && T > 4 ? 2 : 4) : T > 4 ? 4 : 8; }
  static constexpr int u0() { return rows() >= loads() ? 1 : loads() / rows(); }
  // x tile = T x (32 U chunks), kept within 48 KB of static shared memory.
  static constexpr int U() { return T * 32 * u0() * chunk_f4<F>() * 16 <= 48 * 1024 ? u0() : 1; }
  static constexpr int tile_f4() { return 32 * U() * chunk_f4<F>(); }  // float4s per token per tile (a power of 2)
  static constexpr bool lift_x() { return lifts_x<F, T, rows()>(); }
};

// Position of float4 f of a staged x tile: XOR of the low 3 bits with bits 3..5 spreads the 8
// lanes of a 128-bit shared-memory phase (consecutive chunks) over all 32 banks for any chunk size.
__device__ __forceinline__ int swz(int f) { return f ^ ((f >> 3) & 7); }

// 16 weight bytes that are read exactly once: no L1 allocation (L1 keeps the activations), and a
// 256-byte L2 prefetch since the neighbouring lanes read the rest of the line.
__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  // volatile: keeps the issue order the pipelined loops rely on (loads ahead of math and barriers).
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_x4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// E8M0 scale 2^(s-127) from its exponent bits; s = 0 is the subnormal 2^-127, 255 is NaN (OCP MX),
// as core/dtype.h e8m0_to_f32.
__device__ __forceinline__ float e8m0_value(uint32_t s) {
  return __uint_as_float(s == 255u ? 0x7fc00000u : s == 0u ? 0x00400000u : s << 23);
}

// One E2M1 code (bit 3 = sign) exactly: the 3 magnitude bits placed at fp32 bits 22..24 read as
// E2M1 * 2^-126 (codes 0/1 land on fp32 subnormals, which have E2M1's own linear spacing), and the
// power-of-two multiply restores the value.
__device__ __forceinline__ float fp4_value(uint32_t code) {
  return __uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}

// The 8 E2M1 codes of a word (code i in bits 4i..4i+3) as fp32 E2M1 * 2^-126, exact (see
// fp4_value). The decode is integer work per element, so it is kept to ~2.6 instructions: a mask
// keeps codes k and k+4 (16 bits apart), and one multiply by a sum of two powers of two copies a
// code to bits 22..25 and 28..31 (the copies never overlap, so no carries); masking bits 22..24 and
// 31 leaves its magnitude and sign. The other code of the pair shifts out or lands below bit 22.
__device__ __forceinline__ void decode_fp4x8(uint32_t q, float (&w)[8]) {
  const uint32_t q2 = q >> 8;
  const uint32_t p0 = q & 0x000f000fu, p1 = q & 0x00f000f0u;    // codes 0,4 / 1,5
  const uint32_t p2 = q2 & 0x000f000fu, p3 = q2 & 0x00f000f0u;  // codes 2,6 / 3,7
  constexpr uint32_t kKeep = 0x81c00000u;
  w[0] = __uint_as_float((p0 * 0x10400000u) & kKeep);  // x (2^22 + 2^28)
  w[4] = __uint_as_float((p0 * 0x00001040u) & kKeep);  // x (2^6 + 2^12)
  w[1] = __uint_as_float((p1 * 0x01040000u) & kKeep);  // x (2^18 + 2^24)
  w[5] = __uint_as_float((p1 * 0x00000104u) & kKeep);  // x (2^2 + 2^8)
  w[2] = __uint_as_float((p2 * 0x10400000u) & kKeep);
  w[6] = __uint_as_float((p2 * 0x00001040u) & kKeep);
  w[3] = __uint_as_float((p3 * 0x01040000u) & kKeep);
  w[7] = __uint_as_float((p3 * 0x00000104u) & kKeep);
}

// Four E4M3 codes (code i in bits 8i..8i+7) as fp32 times 2^-120, exactly, in integer work (the GEMV's
// decode; conversions run at a quarter of the integer rate): a code's 7 magnitude bits placed at fp32
// bits 20..26 and its sign at 31 read as its value x 2^-120, subnormal codes as fp32 subnormals.
// The GEMV lifts the activations by 2^64 and drops 2^56 at each chunk's scale (as MXFP4 lifts by
// 2^64 and drops 2^62), so the products are those of the codes' values scaled by 2^-56.
__device__ __forceinline__ void decode_e4m3x4_lo(uint32_t q, float (&w)[4]) {
  w[0] = __uint_as_float(((q & 0x7fu) << 20) | ((q & 0x80u) << 24));
  w[1] = __uint_as_float(((q & 0x7f00u) << 12) | ((q & 0x8000u) << 16));
  w[2] = __uint_as_float(((q & 0x7f0000u) << 4) | ((q & 0x800000u) << 8));
  w[3] = __uint_as_float(((q >> 4) & 0x07f00000u) | (q & 0x80000000u));
}

// W[row, c] of any format, one element (the generic paths: unaligned rows, tiles, tails). FP8: the
// code's value times its block's scale, one fp32 multiply (WeightMat::at).
template <WFormat F>
__device__ __forceinline__ float load_weight(const uint8_t* W, const uint8_t* S, int64_t row, int64_t c, int64_t cols) {
  if constexpr (F == WFormat::FP8) {
    const float code = __half2float(
        __half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(__ldg(W + row * cols + c)), __NV_E4M3)));
    return code * __ldg(reinterpret_cast<const float*>(S + row * scale_row_bytes<F>(cols)) + c / 128);
  } else if constexpr (F == WFormat::F32) {
    return __ldg(reinterpret_cast<const float*>(W) + row * cols + c);
  } else if constexpr (F == WFormat::BF16) {
    return __uint_as_float(uint32_t(__ldg(reinterpret_cast<const unsigned short*>(W) + row * cols + c)) << 16);
  } else if constexpr (F == WFormat::F16) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(W) + row * cols + c)));
  } else {
    const uint32_t b = __ldg(W + row * (cols / 2) + c / 2);
    return fp4_value((c & 1) ? b >> 4 : b & 15u) * e8m0_value(__ldg(S + row * (cols / 32) + c / 32));
  }
}

// ------------------------------------------------------------------ GEMV (T <= kGemvMaxT, experts)

// One 16-byte chunk of each of R rows times T activation rows: acc[r][t] += W[r, chunk] . x[t, chunk].
// getx(t, k) returns float4 k of the chunk's activations of token t (lifted by 2^64 for kLiftX).
// MXFP4 chunks are exactly one 32-column scale block; FP8 chunks (16 columns) lie in one 128-column
// block: the codes' products are summed, then scaled once (sc[r] holds the fp32 scale's bits).
template <WFormat F, int T, int R, class GetX>
__device__ __forceinline__ void chunk_fma(const uint4 (&wv)[R], const uint32_t (&sc)[R], GetX getx,
                                          float (&acc)[R][T]) {
  if constexpr (F == WFormat::F32) {
    float4 xv[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xv[t] = getx(t, 0);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float w0 = __uint_as_float(wv[r].x), w1 = __uint_as_float(wv[r].y), w2 = __uint_as_float(wv[r].z),
                  w3 = __uint_as_float(wv[r].w);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float a = acc[r][t];
        a = fmaf(w0, xv[t].x, a);
        a = fmaf(w1, xv[t].y, a);
        a = fmaf(w2, xv[t].z, a);
        acc[r][t] = fmaf(w3, xv[t].w, a);
      }
    }
  } else if constexpr (F == WFormat::BF16 || F == WFormat::F16) {
    float4 xa[T], xb[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      xa[t] = getx(t, 0);
      xb[t] = getx(t, 1);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float w[8];
      const uint32_t u[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (F == WFormat::BF16) {
          w[2 * i] = __uint_as_float(u[i] << 16);
          w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        } else {
          __half2 h;
          std::memcpy(&h, &u[i], 4);
          const float2 f = __half22float2(h);
          w[2 * i] = f.x;
          w[2 * i + 1] = f.y;
        }
      }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float a = acc[r][t];
        a = fmaf(w[0], xa[t].x, a);
        a = fmaf(w[1], xa[t].y, a);
        a = fmaf(w[2], xa[t].z, a);
        a = fmaf(w[3], xa[t].w, a);
        a = fmaf(w[4], xb[t].x, a);
        a = fmaf(w[5], xb[t].y, a);
        a = fmaf(w[6], xb[t].z, a);
        acc[r][t] = fmaf(w[7], xb[t].w, a);
      }
    }
  } else if constexpr (F == WFormat::FP8) {
    float part[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) part[r][t] = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float4 xv[T];
#pragma unroll
      for (int t = 0; t < T; ++t) xv[t] = getx(t, k);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float w[4];
        decode_e4m3x4_lo(k == 0 ? wv[r].x : k == 1 ? wv[r].y : k == 2 ? wv[r].z : wv[r].w, w);
#pragma unroll
        for (int t = 0; t < T; ++t) {
          float a = part[r][t];
          a = fmaf(w[0], xv[t].x, a);
          a = fmaf(w[1], xv[t].y, a);
          a = fmaf(w[2], xv[t].z, a);
          part[r][t] = fmaf(w[3], xv[t].w, a);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float sf = __uint_as_float(sc[r]);
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] = fmaf(part[r][t] * 0x1p56f, sf, acc[r][t]);  // x 2^-56 undone
    }
  } else {
    constexpr bool kLiftX = lifts_x<F, T, R>();
    float part[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) part[r][t] = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float xv[T][8];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4 a = getx(t, 2 * k), b = getx(t, 2 * k + 1);
        xv[t][0] = a.x;
        xv[t][1] = a.y;
        xv[t][2] = a.z;
        xv[t][3] = a.w;
        xv[t][4] = b.x;
        xv[t][5] = b.y;
        xv[t][6] = b.z;
        xv[t][7] = b.w;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t q = k == 0 ? wv[r].x : k == 1 ? wv[r].y : k == 2 ? wv[r].z : wv[r].w;
        float w[8];
        decode_fp4x8(q, w);
        if constexpr (!kLiftX) {
#pragma unroll
          for (int i = 0; i < 8; ++i) w[i] *= 0x1p126f;
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
          float a = part[r][t];
#pragma unroll
          for (int i = 0; i < 8; ++i) a = fmaf(w[i], xv[t][i], a);
          part[r][t] = a;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float sf = e8m0_value(sc[r]);
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] = fmaf(kLiftX ? part[r][t] * 0x1p62f : part[r][t], sf, acc[r][t]);
    }
  }
}

template <int R, int T>
__device__ __forceinline__ void warp_sum(float (&acc)[R][T]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      acc[r][t] = v;
    }
}

// Issues the 16-byte loads (and MXFP4 / FP8 scales) of chunks j0 + 32u (u < U) of R rows.
template <WFormat F, int R, int U>
__device__ __forceinline__ void load_chunks(const uint8_t* const (&wr)[R], const uint8_t* const (&sr)[R], int64_t j0,
                                            int64_t nch, bool active, uint4 (&wv)[U][R], uint32_t (&sc)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t j = j0 + 32 * u;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wv[u][r] = make_uint4(0, 0, 0, 0);
      sc[u][r] = 127;
      if (active && j < nch) {
        wv[u][r] = ld_stream16(wr[r] + 16 * j);
        if constexpr (F == WFormat::MXFP4) sc[u][r] = __ldg(sr[r] + j);
        if constexpr (F == WFormat::FP8) sc[u][r] = __float_as_uint(__ldg(reinterpret_cast<const float*>(sr[r]) + j / 8));
      }
    }
  }
}

// One warp, activations read directly (L1): acc[r][t] = W[row[r], :] . x_t for R rows (indices
// into W, all valid) and T activation rows; every lane ends with the totals. VEC: rows start
// 16-byte aligned and are whole 16-byte chunks, activations 16-byte aligned; otherwise one
// element per lane step. WAIT: the kernel was launched as a programmatic dependent of the previous
// one (launch.cuh): it waits for that grid (pdl_enter) before its first load.
template <WFormat F, int T, int R, int U, bool VEC, bool WAIT = false>
__device__ __forceinline__ void warp_gemv(const uint8_t* W, const uint8_t* S, const int64_t (&row)[R], int64_t cols,
                                          const float* const (&xt)[T], float (&acc)[R][T]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
  const int lane = threadIdx.x & 31;
  if constexpr (VEC) {
    constexpr int E4 = chunk_f4<F>();
    constexpr float kLift = lifts_x<F, T, R>() ? 0x1p64f : 1.0f;
    const int64_t rb = row_bytes<F>(cols), nch = rb / 16;
    const uint8_t* wr[R];
    const uint8_t* sr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wr[r] = W + row[r] * rb;
      sr[r] = scale_row_bytes<F>(cols) ? S + row[r] * scale_row_bytes<F>(cols) : nullptr;
    }
    // The direct path waits before its first load: issuing the first step's loads ahead of the wait
    // kept all U x R of them live across it (56 registers instead of 32 for BF16 T = 1, occupancy
    // 9 blocks per SM instead of 16; the 7168^2 GEMV went from 3761 to 3347 GB/s on the H200).
    if constexpr (WAIT) pdl_enter();
    for (int64_t j0 = lane; j0 < nch; j0 += 32 * U) {
      uint4 wv[U][R];
      uint32_t sc[U][R];
      load_chunks<F, R, U>(wr, sr, j0, nch, true, wv, sc);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + 32 * u;
        if (j < nch)
          chunk_fma<F, T, R>(
              wv[u], sc[u],
              [&](int t, int k) {
                float4 v = ld_x4(xt[t] + (j * E4 + k) * 4);
                v.x *= kLift;
                v.y *= kLift;
                v.z *= kLift;
                v.w *= kLift;
                return v;
              },
              acc);
      }
    }
  } else {
    if constexpr (WAIT) pdl_enter();
    for (int64_t c = lane; c < cols; c += 32) {
      float xv[T];
#pragma unroll
      for (int t = 0; t < T; ++t) xv[t] = __ldg(xt[t] + c);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float w = load_weight<F>(W, S, row[r], c, cols);
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = fmaf(w, xv[t], acc[r][t]);
      }
    }
  }
  warp_sum<R, T>(acc);
}

// The whole block (it syncs; every warp calls it, `active` false for warps without rows), x staged
// in shared memory tile by tile: a tile is the 32 U chunks one warp step covers. Weight loads run a
// tile ahead: tile k+1's are issued before tile k's activations are staged and its math done, so
// the weight stream never waits for the decode. Same contract as warp_gemv<VEC = true>; all warps
// share the activations (token t's row at xrow(t)). WAIT: as warp_gemv's, after the first tile's
// weight loads.
template <WFormat F, int T, bool WAIT = false, class XRow>
__device__ __forceinline__ void block_gemv_smem_at(const uint8_t* W, const uint8_t* S,
                                                   const int64_t (&row)[GemvCfg<F, T>::rows()], bool active,
                                                   int64_t cols, XRow xrow, float (&acc)[GemvCfg<F, T>::rows()][T]) {
  using C = GemvCfg<F, T>;
  constexpr int R = C::rows(), U = C::U(), E4 = chunk_f4<F>(), kTileF4 = C::tile_f4();
  __shared__ float4 xs[T * kTileF4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
  const int lane = threadIdx.x & 31;
  const int64_t rb = row_bytes<F>(cols), nch = rb / 16;
  const uint8_t* wr[R];
  const uint8_t* sr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wr[r] = W + row[r] * rb;
    sr[r] = scale_row_bytes<F>(cols) ? S + row[r] * scale_row_bytes<F>(cols) : nullptr;
  }
  constexpr int kStage = (T * kTileF4 + kGemvThreads - 1) / kGemvThreads;  // float4s each thread stages
  constexpr int kBatch = kStage < 4 ? kStage : 4;                          // loaded before any is stored
  uint4 wv[U][R], wn[U][R];
  uint32_t sc[U][R], sn[U][R];
  load_chunks<F, R, U>(wr, sr, lane, nch, active, wv, sc);
  if constexpr (WAIT) pdl_enter();
  for (int64_t jt = 0; jt < nch; jt += 32 * U) {
    load_chunks<F, R, U>(wr, sr, jt + 32 * U + lane, nch, active, wn, sn);  // next tile, in flight meanwhile
    const int nf = int(min(int64_t(32 * U), nch - jt)) * E4;                // float4s per token in this tile
#pragma unroll
    for (int i0 = 0; i0 < kStage; i0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int e = int(threadIdx.x) + (i0 + i) * kGemvThreads, t = e / kTileF4, f = e % kTileF4;
        if (i0 + i < kStage && e < T * kTileF4 && f < nf) v[i] = ld_x4(xrow(t) + (jt * E4 + f) * 4);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int e = int(threadIdx.x) + (i0 + i) * kGemvThreads, t = e / kTileF4, f = e % kTileF4;
        if (i0 + i < kStage && e < T * kTileF4 && f < nf) {
          if constexpr (C::lift_x()) {
            v[i].x *= 0x1p64f;
            v[i].y *= 0x1p64f;
            v[i].z *= 0x1p64f;
            v[i].w *= 0x1p64f;
          }
          xs[t * kTileF4 + swz(f)] = v[i];
        }
      }
    }
    __syncthreads();
    if (active) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int jl = lane + 32 * u;
        if (jt + jl < nch)
          chunk_fma<F, T, R>(
              wv[u], sc[u], [&](int t, int k) { return xs[t * kTileF4 + swz(jl * E4 + k)]; }, acc);
      }
    }
    __syncthreads();  // the next tile overwrites xs
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[u][r] = wn[u][r];
        sc[u][r] = sn[u][r];
      }
  }
  warp_sum<R, T>(acc);
}
// The same with token t's activations at x0 + t x_stride.
template <WFormat F, int T, bool WAIT = false>
__device__ __forceinline__ void block_gemv_smem(const uint8_t* W, const uint8_t* S,
                                                const int64_t (&row)[GemvCfg<F, T>::rows()], bool active, int64_t cols,
                                                const float* x0, int64_t x_stride,
                                                float (&acc)[GemvCfg<F, T>::rows()][T]) {
  block_gemv_smem_at<F, T, WAIT>(W, S, row, active, cols, [=](int t) { return x0 + t * x_stride; }, acc);
}

// Block `blk` of a GEMV: Y[t, r] = W[r, :] . X[t, :] for T <= kGemvMaxT (or kGemvWideT); each warp
// owns R rows. The kernel is a programmatic dependent of the previous one: weights are read before
// the wait, activations after it (WAIT in the helpers; the non-vector path waits first).
template <WFormat F, int T, bool VEC>
__device__ __forceinline__ void gemv_block(const uint8_t* W, const uint8_t* S, int64_t rows, int64_t cols,
                                           const float* X, float* Y, int64_t blk) {
  using C = GemvCfg<F, T>;
  constexpr int R = C::rows();
  constexpr bool kSmem = VEC && C::smem();
  const int64_t r0 = (blk * kGemvWarps + threadIdx.x / 32) * R;
  const bool active = r0 < rows;
  if (!kSmem && !active) return;  // whole warps leave together, so the shuffles stay full-warp
  int64_t row[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = max(int64_t(0), min(r0 + r, rows - 1));  // clamped rows: computed, not stored
  float acc[R][T];
  if constexpr (kSmem) {
    block_gemv_smem<F, T, true>(W, S, row, active, cols, X, cols, acc);
  } else {
    const float* xt[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xt[t] = X + t * cols;
    warp_gemv<F, T, R, C::U(), VEC, true>(W, S, row, cols, xt, acc);
  }
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t)
      if (lane == (r * T + t) % 32 && r0 + r < rows) Y[t * rows + r0 + r] = acc[r][t];
}

template <WFormat F, int T, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_kernel(const uint8_t* W, const uint8_t* S, int64_t rows, int64_t cols, const float* X, float* Y) {
  gemv_block<F, T, VEC>(W, S, rows, cols, X, Y, blockIdx.x);
}

// Many tokens as T-token GEMVs (blockIdx.y = the chunk of T tokens): the fp32 products of few
// weight rows and many tokens (the router of a prefill chunk), where the SIMT tiles would be a
// handful of blocks. Same bits as gemv_kernel on each chunk.
template <WFormat F, int T, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_chunks_kernel(const uint8_t* W, const uint8_t* S, int64_t rows, int64_t cols, const float* X, float* Y) {
  const int64_t c = blockIdx.y;
  gemv_block<F, T, VEC>(W, S, rows, cols, X + c * T * cols, Y + c * T * rows, blockIdx.x);
}

// Several GEMVs of one format and T in one launch (gemv_batch): block b belongs to the job i with
// first_block[i] <= b < first_block[i + 1] and runs that job's gemv_block (16-byte path only).
struct GemvBatchArgs {
  const uint8_t* W[kGemvBatchMax];
  const uint8_t* S[kGemvBatchMax];
  int64_t rows[kGemvBatchMax], cols[kGemvBatchMax];
  const float* X[kGemvBatchMax];
  float* Y[kGemvBatchMax];
  int64_t first_block[kGemvBatchMax + 1];
  int n;
};

// (BF16 T = 1: 38 registers against gemv_kernel's 32, for the job lookup; holding it to 32 by launch
// bounds spilled 272 bytes.)
template <WFormat F, int T>
__global__ void __launch_bounds__(kGemvThreads) gemv_batch_kernel(const __grid_constant__ GemvBatchArgs a) {
  const int64_t b = blockIdx.x;
  int i = 0;
  while (i + 1 < a.n && b >= a.first_block[i + 1]) ++i;
  gemv_block<F, T, true>(a.W[i], a.S[i], a.rows[i], a.cols[i], a.X[i], a.Y[i], b - a.first_block[i]);
}

// The slot prologue of the expert kernels: waits for the previous kernel (the router wrote the ids),
// reads the slot's expert; a bad id (outside [0, E)) must not read outside W: the block writes its
// rows of y as NaN and false is returned. Otherwise row[] are the expert's rows r0 .. r0+R-1 (clamped).
template <int R>
__device__ __forceinline__ bool expert_slot_rows(const int32_t* ids, int64_t n, int64_t E, int64_t R_exp, int64_t r0,
                                                 bool active, float* y, int64_t (&row)[R]) {
  const int lane = threadIdx.x & 31;
  pdl_enter();
  const int64_t e = ids[n];
  if (e < 0 || e >= E) {
    if (active && lane < R && r0 + lane < R_exp) y[r0 + lane] = __uint_as_float(0x7fc00000u);
    return false;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = e * R_exp + max(int64_t(0), min(r0 + r, R_exp - 1));
  return true;
}

// Routed experts, one block column per n (decode: N = top_k distinct experts): Y[n, :] = W_{ids[n]} . X[n / x_div].
// ids are read here, on the device, so a captured graph follows whatever the router wrote.
template <WFormat F, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
    expert_gemv_kernel(const uint8_t* W, const uint8_t* S, int64_t R_exp, int64_t cols, int64_t E, const int32_t* ids,
                       const float* X, int64_t x_div, float* Y) {
  using C = GemvCfg<F, 1>;
  constexpr int R = C::rows();
  constexpr bool kSmem = VEC && C::smem();
  const int64_t n = blockIdx.y;
  const int64_t r0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32) * R;
  const bool active = r0 < R_exp;
  if (!kSmem && !active) return;
  const int lane = threadIdx.x & 31;
  float* y = Y + n * R_exp;
  int64_t row[R];
  if (!expert_slot_rows<R>(ids, n, E, R_exp, r0, active, y, row)) return;
  const float* xt[1] = {X + (n / x_div) * cols};
  float acc[R][1];
  if constexpr (kSmem)
    block_gemv_smem<F, 1>(W, S, row, active, cols, xt[0], 0, acc);
  else
    warp_gemv<F, 1, R, C::U(), VEC>(W, S, row, cols, xt, acc);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (lane == r && r0 + r < R_exp) y[r0 + r] = acc[r][0];
}

// The routed experts' gate and up products and the SiTU GLU in one kernel (expert_glu): H[n, r] =
// situ(W_gate{ids[n]}[r] . x, W_up{ids[n]}[r] . x) with x = X[n / x_div]. Each warp computes its
// rows of the gate, then the same rows of the up projection, exactly as expert_gemv_kernel does
// (same loads, same order), and applies situ_glu_value: the bits of expert_matmul x 2 + situ_glu.
// (Gate and up rows loaded together, 2R rows per warp, took 168 registers and ran no faster.)
template <WFormat F, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
    expert_glu_kernel(const uint8_t* Wg, const uint8_t* Sg, const uint8_t* Wu, const uint8_t* Su, int64_t R_exp,
                      int64_t cols, int64_t E, const int32_t* ids, const float* X, int64_t x_div, float b1, float b2,
                      float* H) {
  using C = GemvCfg<F, 1>;
  constexpr int R = C::rows();
  constexpr bool kSmem = VEC && C::smem();
  const int64_t n = blockIdx.y;
  const int64_t r0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32) * R;
  const bool active = r0 < R_exp;
  if (!kSmem && !active) return;
  const int lane = threadIdx.x & 31;
  float* h = H + n * R_exp;
  int64_t row[R];
  if (!expert_slot_rows<R>(ids, n, E, R_exp, r0, active, h, row)) return;
  const float* xt[1] = {X + (n / x_div) * cols};
  float g[R][1], u[R][1];
  if constexpr (kSmem) {
    block_gemv_smem<F, 1>(Wg, Sg, row, active, cols, xt[0], 0, g);
    block_gemv_smem<F, 1>(Wu, Su, row, active, cols, xt[0], 0, u);
  } else {
    warp_gemv<F, 1, R, C::U(), VEC>(Wg, Sg, row, cols, xt, g);
    warp_gemv<F, 1, R, C::U(), VEC>(Wu, Su, row, cols, xt, u);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (lane == r && r0 + r < R_exp) h[r0 + r] = situ_glu_value(g[r][0], u[r][0], b1, b2);
}

// Slots per launch of the per-slot kernel (the grid's y limit). It reads an expert once per slot,
// which measured faster than grouping slots by expert inside a kernel: a grouped kernel without
// shared-memory staging of the activations took 1.4 ms per expert product for 256 decode slots
// (32 sequences x top-8, gpu-bench, H200), 30 of the 38.6 ms step. Long chunks group on the host
// instead (one GEMM per selected expert).
constexpr int64_t kExpertSlotsPerLaunch = 65535;

// ------------------------------------------------------------------ routed experts grouped on the device
// (expert_ffn_grouped: decode steps of many sequences, where the per-slot kernels above would read an
// expert once per slot that chose it.)

// Sorts N routing slots by expert on one block, stably (ascending slot within an expert), into tiles
// of at most kGemvMaxT slots of one expert: sorted[N], tiles[*n_tiles] = (expert, first sorted
// position, slots). A bad id (outside [0, E)) is in no tile and its row of Y (L floats) is written NaN
// here. Shared memory: [E] counts, [E] first sorted positions, [E] first tiles, [N] ids.
constexpr int kSortThreads = 1024;
__global__ void __launch_bounds__(kSortThreads)
    expert_sort_kernel(const int32_t* ids, int32_t N, int32_t E, float* Y, int64_t L, int32_t* sorted,
                       ExpertTile* tiles, int32_t* n_tiles) {
  extern __shared__ int32_t sort_sm[];
  int32_t *cnt = sort_sm, *pos = sort_sm + E, *tile0 = sort_sm + 2 * E, *sid = sort_sm + 3 * E;
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, warps = kSortThreads / 32;
  pdl_enter();  // the router wrote the ids
  for (int e = tid; e < E; e += kSortThreads) cnt[e] = 0;
  __syncthreads();
  for (int n = tid; n < N; n += kSortThreads) {
    const int32_t e = ids[n];
    sid[n] = e;
    if (e >= 0 && e < E) {
      atomicAdd(&cnt[e], 1);
    } else {
      for (int64_t j = 0; j < L; ++j) Y[n * L + j] = __uint_as_float(0x7fc00000u);
    }
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scans of the counts and of the tiles per expert
    int run_p = 0, run_t = 0;
    for (int b = 0; b < E; b += 32) {
      const int e = b + lane, c = e < E ? cnt[e] : 0, t = (c + int(kGemvMaxT) - 1) / int(kGemvMaxT);
      int ic = c, it = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int vc = __shfl_up_sync(0xffffffffu, ic, o), vt = __shfl_up_sync(0xffffffffu, it, o);
        if (lane >= o) {
          ic += vc;
          it += vt;
        }
      }
      if (e < E) {
        pos[e] = run_p + ic - c;
        tile0[e] = run_t + it - t;
      }
      run_p += __shfl_sync(0xffffffffu, ic, 31);
      run_t += __shfl_sync(0xffffffffu, it, 31);
    }
    if (lane == 0) *n_tiles = run_t;
  }
  __syncthreads();
  for (int e = warp; e < E; e += warps) {  // a warp per expert: its slots in order, by ballots
    const int c = cnt[e];
    if (c == 0) continue;
    int p = pos[e];
    for (int b = 0; b < N && p < pos[e] + c; b += 32) {
      const int n = b + lane;
      const bool hit = n < N && sid[n] == e;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (hit) sorted[p + __popc(m & ((1u << lane) - 1u))] = n;
      p += __popc(m);
    }
    for (int t = lane; t * int(kGemvMaxT) < c; t += 32)
      tiles[tile0[e] + t] = {e, pos[e] + t * int(kGemvMaxT), min(int(kGemvMaxT), c - t * int(kGemvMaxT))};
  }
}

// One tile of the sort above per blockIdx.y (past *n_tiles: nothing), rows of its expert per
// blockIdx.x as gemv_block's: the tile's slots as one T = kGemvMaxT GEMV (its expert's weights read
// once; token t past the tile's slots repeats its last one, computed and not stored). x rows of token
// t: GLU (DOWN false) X[sorted[row0 + t] / x_div] and H[row0 + t] = situ(gate . x, up . x); DOWN: the
// tile's H rows and Y[sorted[row0 + t]] = down . h (scattered back to slot order).
template <WFormat F, bool DOWN>
__global__ void __launch_bounds__(kGemvThreads)
    expert_grouped_kernel(const uint8_t* Wg, const uint8_t* Sg, const uint8_t* Wu, const uint8_t* Su, int64_t R_exp,
                          int64_t cols, const ExpertTile* tiles, const int32_t* n_tiles, const int32_t* sorted,
                          const float* X, int64_t x_div, float b1, float b2, float* Y) {
  constexpr int T = int(kGemvMaxT);
  using C = GemvCfg<F, T>;
  constexpr int R = C::rows();
  static_assert(C::smem(), "the grouped expert kernel stages its tokens in shared memory");
  __shared__ const float* xp[T];
  __shared__ int32_t out_row[T];
  pdl_enter();  // the sort (and, for DOWN, the GLU) wrote what is read here
  if (int32_t(blockIdx.y) >= *n_tiles) return;
  const ExpertTile tl = tiles[blockIdx.y];
  if (threadIdx.x < T) {
    const int t = min(int(threadIdx.x), tl.rows - 1), at = tl.row0 + t;
    xp[threadIdx.x] = DOWN ? X + int64_t(at) * cols : X + int64_t(sorted[at] / x_div) * cols;
    out_row[threadIdx.x] = DOWN ? sorted[at] : at;
  }
  __syncthreads();
  const int64_t r0 = (int64_t(blockIdx.x) * kGemvWarps + threadIdx.x / 32) * R;
  const bool active = r0 < R_exp;
  int64_t row[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = int64_t(tl.expert) * R_exp + max(int64_t(0), min(r0 + r, R_exp - 1));
  const auto xrow = [&](int t) { return xp[t]; };
  float g[R][T];
  block_gemv_smem_at<F, T>(Wg, Sg, row, active, cols, xrow, g);
  const int lane = threadIdx.x & 31;
  if constexpr (DOWN) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t)
        if (lane == (r * T + t) % 32 && r0 + r < R_exp && t < tl.rows) Y[int64_t(out_row[t]) * R_exp + r0 + r] = g[r][t];
  } else {
    float u[R][T];
    block_gemv_smem_at<F, T>(Wu, Su, row, active, cols, xrow, u);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t)
        if (lane == (r * T + t) % 32 && r0 + r < R_exp && t < tl.rows)
          Y[int64_t(out_row[t]) * R_exp + r0 + r] = situ_glu_value(g[r][t], u[r][t], b1, b2);
  }
}

// ------------------------------------------------------------------ T > kGemvMaxT: fp32 SIMT tiles

// Y tile of 64 tokens x 64 rows per block, 4x4 per thread, k-steps of 16 staged in shared memory
// as fp32 (weights decoded from any format on the way in). ROUND_X: activations rounded to bf16
// first (Precision::BF16 for weights the tensor-core paths do not take: F16/F32 keep their exact
// values, so the result is the fp32-accumulated product of the rounded activations).
constexpr int kSimtTile = 64, kSimtBK = 16, kSimtThreads = 256;
// Below this many 64 x 64 tiles (two per SM of an H100/H200), fp32 products run as chunked GEMVs
// (matmul_f32_by_gemv): the router of a 512-token chunk (64 experts) was 8 SIMT blocks, 0.62 ms.
constexpr int64_t kSmallSimtGrid = 264;
template <WFormat F, bool ROUND_X>
__global__ void __launch_bounds__(kSimtThreads) gemm_simt_kernel(const uint8_t* W, const uint8_t* S, int64_t rows,
                                                                 int64_t cols, const float* X, int64_t T, float* Y) {
  __shared__ __align__(16) float Xs[kSimtBK][kSimtTile + 4];
  __shared__ __align__(16) float Ws[kSimtBK][kSimtTile + 4];
  const int tid = threadIdx.x, tr = tid % 16, tt = tid / 16;
  const int64_t r0 = int64_t(blockIdx.x) * kSimtTile, t0 = int64_t(blockIdx.y) * kSimtTile;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < cols; k0 += kSimtBK) {
#pragma unroll
    for (int i = 0; i < kSimtTile * kSimtBK / kSimtThreads; ++i) {
      const int idx = tid + kSimtThreads * i, kk = idx % kSimtBK, m = idx / kSimtBK;
      const int64_t c = k0 + kk;
      float xv = 0.0f, wv = 0.0f;
      if (c < cols) {
        if (t0 + m < T) {
          xv = __ldg(X + (t0 + m) * cols + c);
          if constexpr (ROUND_X) xv = __bfloat162float(__float2bfloat16_rn(xv));
        }
        if (r0 + m < rows) wv = load_weight<F>(W, S, r0 + m, c, cols);
      }
      Xs[kk][m] = xv;
      Ws[kk][m] = wv;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtBK; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&Xs[kk][tt * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&Ws[kk][tr * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t t = t0 + tt * 4 + i, r = r0 + tr * 4 + j;
      if (t < T && r < rows) Y[t * rows + r] = acc[i][j];
    }
}

// ------------------------------------------------------------------ T > kGemvMaxT, BF16: MXFP4 and FP8 on tensor cores

// mma.sync m16n8k16 (bf16 in, fp32 accumulate) on tiles of 128 weight rows x 64 tokens, k-steps
// of 32 columns = one MXFP4 scale block. While staging, the E2M1 codes are decoded to bf16 (exact:
// 2 significant bits, never subnormal) and activations rounded to bf16 (RNE). Each k-step
// accumulates into fresh registers, which are then scaled by the row's E8M0 block scale and added
// in fp32: scales never meet bf16 range limits or subnormal handling, and any truncation inside the
// tensor-core accumulation is limited to 32 terms. Tiles are double-buffered through registers: the
// next k-step's global loads are in flight during the current step's MMAs. FP8 (the GPU form: an fp32
// scale per row and 128 columns) takes the same tile: its E4M3 codes are bf16 values too (3 mantissa
// bits; subnormals become normal bf16), and each 32-column k-step lies in one 128-column block, whose
// scale multiplies the step's sums as an E8M0 scale does.
constexpr int kMmaBM = 128, kMmaBN = 64, kMmaBK = 32, kMmaLd = kMmaBK + 8,
              kMmaThreads = 256;  // ld 40: conflict-free fragments

// One block's tile: weight rows [r0, r0 + 128) x tokens [t0, t0 + 64) of Y[T, rows] = X[T, cols] · Wᵀ.
// Shared by the plain and the grouped (per-expert tile list) kernels, so both compute the same bits.
template <WFormat F>
__device__ __forceinline__ void mma_q_tile(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S, int64_t rows,
                                             int64_t cols, const float* __restrict__ X, int64_t T,
                                             float* __restrict__ Y, int64_t r0, int64_t t0) {
  static_assert(F == WFormat::MXFP4 || F == WFormat::FP8, "the tensor-core tile decodes MXFP4 or FP8");
  __shared__ __align__(16) uint16_t Ws[2][kMmaBM][kMmaLd];
  __shared__ __align__(16) uint16_t Xs[2][kMmaBN][kMmaLd];
  __shared__ float Ss[2][kMmaBM];  // block scale of each weight row for the staged k-step
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;   // mma fragment coordinates
  const int wm = warp & 3, wn = warp >> 2;  // warp tile: 32 rows x 32 tokens
  const int nk = int(cols / kMmaBK);

  // Staging roles: two threads per weight row (16 codes each: 8 bytes of MXFP4, 16 of FP8), four
  // per token (8 floats). Rows/tokens past the end load a valid one; their outputs are never stored.
  constexpr int kStepBytes = F == WFormat::FP8 ? kMmaBK : kMmaBK / 2;  // a row's bytes per k-step
  const int w_row = tid >> 1, w_half = tid & 1;
  const int64_t wr = min(r0 + w_row, rows - 1);
  const uint8_t* wp = W + wr * row_bytes<F>(cols) + (kStepBytes / 2) * w_half;
  const uint8_t* sp = S + wr * scale_row_bytes<F>(cols);
  const int x_tok = tid >> 2, x_k = (tid & 3) * 8;
  const float* xp = X + min(t0 + x_tok, T - 1) * cols + x_k;

  uint4 wreg = make_uint4(0, 0, 0, 0);
  uint32_t sreg = 0;
  float4 xa = make_float4(0, 0, 0, 0), xb = xa;
  auto load = [&](int kt) {
    if constexpr (F == WFormat::FP8) {
      wreg = __ldg(reinterpret_cast<const uint4*>(wp + int64_t(kt) * kStepBytes));
      sreg = __float_as_uint(__ldg(reinterpret_cast<const float*>(sp) + kt / 4));  // 4 k-steps per block
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(wp + int64_t(kt) * kStepBytes));
      wreg.x = v.x;
      wreg.y = v.y;
      sreg = __ldg(sp + kt);
    }
    xa = ld_x4(xp + int64_t(kt) * kMmaBK);
    xb = ld_x4(xp + int64_t(kt) * kMmaBK + 4);
  };
  auto store = [&](int buf) {
    if (w_half == 0) Ss[buf][w_row] = F == WFormat::FP8 ? __uint_as_float(sreg) : e8m0_value(sreg);
    uint32_t out[8];
    if constexpr (F == WFormat::FP8) {
      const uint32_t q[4] = {wreg.x, wreg.y, wreg.z, wreg.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float w[4];
        decode_e4m3x4_lo(q[i], w);  // x 2^120 below: exact; E4M3 values are bf16 values
        out[2 * i] = pack_bf16x2(w[0] * 0x1p120f, w[1] * 0x1p120f);
        out[2 * i + 1] = pack_bf16x2(w[2] * 0x1p120f, w[3] * 0x1p120f);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t byte = ((i < 4 ? wreg.x : wreg.y) >> (8 * (i & 3))) & 0xffu;
        const float lo = fp4_value(byte & 15u), hi = fp4_value(byte >> 4);
        out[i] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);  // exact: low bits are zero
      }
    }
    *reinterpret_cast<uint4*>(&Ws[buf][w_row][16 * w_half]) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(&Ws[buf][w_row][16 * w_half + 8]) = make_uint4(out[4], out[5], out[6], out[7]);
    *reinterpret_cast<uint4*>(&Xs[buf][x_tok][x_k]) =
        make_uint4(pack_bf16x2(xa.x, xa.y), pack_bf16x2(xa.z, xa.w), pack_bf16x2(xb.x, xb.y), pack_bf16x2(xb.z, xb.w));
  };

  float acc[2][4][4] = {};
  load(0);
  store(0);
  __syncthreads();
  for (int kt = 0; kt < nk; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < nk) load(kt + 1);
    float step[2][4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kMmaBK; ks += 16) {
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const uint16_t* p = &Ws[buf][wm * 32 + mi * 16 + g][ks + 2 * tq];
        a[mi][0] = *reinterpret_cast<const uint32_t*>(p);
        a[mi][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kMmaLd);
        a[mi][2] = *reinterpret_cast<const uint32_t*>(p + 8);
        a[mi][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kMmaLd + 8);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const uint16_t* p = &Xs[buf][wn * 32 + ni * 8 + g][ks + 2 * tq];
        b[ni][0] = *reinterpret_cast<const uint32_t*>(p);
        b[ni][1] = *reinterpret_cast<const uint32_t*>(p + 8);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16(step[mi][ni], a[mi], b[ni]);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const float s_lo = Ss[buf][wm * 32 + mi * 16 + g], s_hi = Ss[buf][wm * 32 + mi * 16 + g + 8];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mi][ni][i] = fmaf(step[mi][ni][i], i < 2 ? s_lo : s_hi, acc[mi][ni][i]);
    }
    if (kt + 1 < nk) store(buf ^ 1);  // that buffer was last read before the previous barrier
    __syncthreads();
  }
  // C fragment: c0,c1 = (row g, tokens 2tq, 2tq+1), c2,c3 = (row g+8, same tokens).
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t r = r0 + wm * 32 + mi * 16 + g + (i >= 2 ? 8 : 0);
        const int64_t t = t0 + wn * 32 + ni * 8 + 2 * tq + (i & 1);
        if (r < rows && t < T) Y[t * rows + r] = acc[mi][ni][i];
      }
}

template <WFormat F>
__global__ void __launch_bounds__(kMmaThreads) gemm_mma_q_kernel(const uint8_t* W, const uint8_t* S, int64_t rows,
                                                                   int64_t cols, const float* X, int64_t T, float* Y) {
  mma_q_tile<F>(W, S, rows, cols, X, T, Y, int64_t(blockIdx.x) * kMmaBM, int64_t(blockIdx.y) * kMmaBN);
}

// Grouped experts: block (x, y, z) computes row tile x of matrix z for tile y of the list: expert
// e = tiles[y].expert's [R, cols] block of the stacked W_z times X rows [row0, row0 + rows), into
// Y_z rows [row0, row0 + rows) (row stride R). One launch serves every expert of a prefill chunk.
static_assert(kExpertTileRows == kMmaBN, "a grouped tile is one token tile of the mma kernel");
struct GroupedMmaArgs {
  const uint8_t* W[2];
  const uint8_t* S[2];
  float* Y[2];
  const float* X;
  const ExpertTile* tiles;
  int64_t R, cols;
};

__global__ void __launch_bounds__(kMmaThreads) grouped_mma_fp4_kernel(const __grid_constant__ GroupedMmaArgs a) {
  const ExpertTile t = a.tiles[blockIdx.y];
  const int z = int(blockIdx.z);
  const int64_t e = t.expert;
  mma_q_tile<WFormat::MXFP4>(a.W[z] + e * a.R * (a.cols / 2), a.S[z] + e * a.R * (a.cols / 32), a.R, a.cols,
               a.X + int64_t(t.row0) * a.cols, t.rows, a.Y[z] + int64_t(t.row0) * a.R, int64_t(blockIdx.x) * kMmaBM, 0);
}

// fp32 -> bf16 (RNE) copy of the activations for cuBLAS.
__global__ void to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* y) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = __float2bfloat16_rn(x[i]);
}

// ------------------------------------------------------------------ host side

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t host_row_bytes(const WeightMat& W) {
  switch (W.fmt) {
    case WFormat::F32:
      return W.cols * 4;
    case WFormat::F16:
    case WFormat::BF16:
      return W.cols * 2;
    case WFormat::MXFP4:
      return W.cols / 2;
    case WFormat::FP8:
      return W.cols;
  }
  return 0;
}

// The 16-byte GEMV path: every row start 16-byte aligned and activations rows too.
bool gemv_vec_ok(const WeightMat& W, const float* X) {
  return aligned16(W.data) && host_row_bytes(W) % 16 == 0 && aligned16(X) && W.cols % 4 == 0;
}

void check_weight(const WeightMat& W, const char* what) {
  const char* problem = nullptr;
  const size_t esize = W.fmt == WFormat::F32 ? 4 : W.fmt == WFormat::MXFP4 || W.fmt == WFormat::FP8 ? 1 : 2;
  if (W.rows < 0 || W.cols < 0)
    problem = "has a negative shape";
  else if (W.data == nullptr && W.rows * W.cols > 0)
    problem = "has no data";
  else if (reinterpret_cast<uintptr_t>(W.data) % esize != 0)
    problem = "data is not aligned to its element size";
  else if (W.fmt == WFormat::MXFP4 && W.cols % 32 != 0)
    problem = "MXFP4 columns must be a multiple of 32";
  else if (W.fmt == WFormat::MXFP4 && W.scales == nullptr && W.rows * W.cols > 0)
    problem = "MXFP4 weight has no scales";
  else if (W.fmt == WFormat::FP8 && (W.scales == nullptr || W.block_scales != nullptr) && W.rows * W.cols > 0)
    problem = "FP8 weight is not in its GPU form (per-row scales, as the CUDA backend uploads it)";
  if (problem)
    failf("%s: %s [%lld, %lld] %s", what, wformat_name(W.fmt), (long long)W.rows, (long long)W.cols, problem);
}

template <WFormat F, int T>
void launch_gemv_t(const WeightMat& W, const float* X, float* Y, Stream s) {
  constexpr int R = GemvCfg<F, T>::rows();
  const int64_t blocks = (W.rows + int64_t(kGemvWarps) * R - 1) / (int64_t(kGemvWarps) * R);
  const auto* w = static_cast<const uint8_t*>(W.data);
  if (gemv_vec_ok(W, X))
    launch(gemv_kernel<F, T, true>, unsigned(blocks), kGemvThreads, 0, s, w, W.scales, W.rows, W.cols, X, Y);
  else
    launch(gemv_kernel<F, T, false>, unsigned(blocks), kGemvThreads, 0, s, w, W.scales, W.rows, W.cols, X, Y);
  check_launch("gemv kernel");
}

// Calls f(std::integral_constant<int, T>) with the GEMV row count as a compile-time constant:
// 1..kGemvMaxT (larger T: kGemvMaxT), or kGemvWideT on non-MXFP4 formats.
template <WFormat F, class Fn>
void with_gemv_rows(int64_t T, Fn&& f) {
  if constexpr (F != WFormat::MXFP4) {
    if (T == kGemvWideT) return f(std::integral_constant<int, int(kGemvWideT)>{});
  }
  switch (T) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

// Calls f(std::integral_constant<WFormat, F>) with the weight format as a compile-time constant.
template <class Fn>
void with_format(WFormat fmt, Fn&& f) {
  switch (fmt) {
    case WFormat::F32:
      return f(std::integral_constant<WFormat, WFormat::F32>{});
    case WFormat::F16:
      return f(std::integral_constant<WFormat, WFormat::F16>{});
    case WFormat::BF16:
      return f(std::integral_constant<WFormat, WFormat::BF16>{});
    case WFormat::MXFP4:
      return f(std::integral_constant<WFormat, WFormat::MXFP4>{});
    case WFormat::FP8:
      return f(std::integral_constant<WFormat, WFormat::FP8>{});
  }
}

template <WFormat F>
void launch_gemv_f(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s) {
  with_gemv_rows<F>(T, [&](auto t) { launch_gemv_t<F, decltype(t)::value>(W, X, Y, s); });
}

// T tokens as chunks of kGemvMaxT (one launch) and a last chunk of T % kGemvMaxT (gemv_rows).
template <WFormat F>
void launch_gemv_chunks_f(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s) {
  constexpr int C = int(kGemvMaxT);
  constexpr int R = GemvCfg<F, C>::rows();
  const int64_t blocks = (W.rows + int64_t(kGemvWarps) * R - 1) / (int64_t(kGemvWarps) * R), full = T / C;
  const auto* w = static_cast<const uint8_t*>(W.data);
  if (full > 0) {
    const dim3 grid{unsigned(blocks), unsigned(full), 1u};
    if (gemv_vec_ok(W, X))
      launch(gemv_chunks_kernel<F, C, true>, grid, kGemvThreads, 0, s, w, W.scales, W.rows, W.cols, X, Y);
    else
      launch(gemv_chunks_kernel<F, C, false>, grid, kGemvThreads, 0, s, w, W.scales, W.rows, W.cols, X, Y);
    check_launch("gemv chunks kernel");
  }
  if (T % C) launch_gemv_f<F>(W, X + full * C * W.cols, T % C, Y + full * C * W.rows, s);
}

template <bool ROUND_X>
void launch_simt(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s) {
  const dim3 grid(unsigned((W.rows + kSimtTile - 1) / kSimtTile), unsigned((T + kSimtTile - 1) / kSimtTile));
  const auto* w = static_cast<const uint8_t*>(W.data);
  with_format(W.fmt, [&](auto f) {
    gemm_simt_kernel<decltype(f)::value, ROUND_X><<<grid, kSimtThreads, 0, s>>>(w, W.scales, W.rows, W.cols, X, T, Y);
  });
  check_launch("gemm simt kernel");
}

// cuBLAS state per device (handle) and per (device, stream) (bf16 activations + workspace: two
// streams never share a buffer). A recorded step (a graph) may call it only within what
// cublas_prepare set up; elsewhere growing is allowed: it frees the old buffer, and cudaFree waits
// for the device. Handles and buffers live until
// process exit on purpose (destroying them from static destructors races the CUDA runtime teardown).
constexpr int kMaxDevices = 64;
constexpr size_t kCublasWorkspace = size_t(32) << 20;
struct StreamScratch {
  DevBuf xb, ws;
};
std::mutex g_cublas_mu;
cublasHandle_t g_handles[kMaxDevices] = {};
std::map<std::pair<int, Stream>, StreamScratch>* g_scratch = nullptr;

void cublas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) failf("cuBLAS: %s: %s", what, cublasGetStatusString(st));
}

// The calling device's cuBLAS handle set to stream s with its workspace, and that stream's
// scratch (the caller holds g_cublas_mu).
std::pair<cublasHandle_t, StreamScratch*> cublas_on(Stream s) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) failf("CUDA: matmul: no current device");
  cublasHandle_t& h = g_handles[dev];
  if (!h) {
    load_cublas();  // one line naming the library if it is missing
    cublas_check(cublasCreate(&h), "create handle");
  }
  if (!g_scratch) g_scratch = new std::map<std::pair<int, Stream>, StreamScratch>();
  StreamScratch& sc = (*g_scratch)[{dev, s}];
  if (!sc.ws) sc.ws = DevBuf(kCublasWorkspace, "cuBLAS workspace");
  cublas_check(cublasSetStream(h, s), "set stream");
  cublas_check(cublasSetWorkspace(h, sc.ws.get(), sc.ws.bytes()), "set workspace");  // after SetStream (it resets it)
  return {h, &sc};
}

bool stream_capturing(Stream s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return s != nullptr && cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &st) == cudaSuccess &&
         st == cudaStreamCaptureStatusActive;
}

// The bf16 activations buffer of stream s grown to `need` bytes (the caller holds g_cublas_mu).
void grow_xb(StreamScratch& sc, size_t need) {
  if (sc.xb.bytes() >= need) return;
  sc.xb = DevBuf();
  sc.xb = DevBuf(need, "bf16 activations for cuBLAS");
}

void matmul_cublas_bf16(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s) {
  std::lock_guard<std::mutex> lock(g_cublas_mu);
  auto [h, sc] = cublas_on(s);
  const size_t need = size_t(T * W.cols) * sizeof(__nv_bfloat16);
  // Exactly what the widest product needs (the memory plan counts tokens_per_call x the widest input).
  if (sc->xb.bytes() < need && stream_capturing(s))
    failf("internal error: cuBLAS needs %zu bytes of bf16 activations in a recorded step (cublas_prepare)", need);
  grow_xb(*sc, need);
  auto* xb = sc->xb.as<__nv_bfloat16>();
  const int64_t n = T * W.cols;
  to_bf16_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, s>>>(X, n, xb);
  check_launch("to_bf16 kernel");
  // Column-major view: Y^T [rows, T] (ld rows) = W [rows, cols] (= W^T col-major, ld cols)^T . X^T [cols, T] (ld cols).
  const float alpha = 1.0f, beta = 0.0f;
  cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(W.rows), int(T), int(W.cols), &alpha, W.data, CUDA_R_16BF,
                            int(W.cols), xb, CUDA_R_16BF, int(W.cols), &beta, Y, CUDA_R_32F, int(W.rows),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "bf16 GEMM");
}

template <WFormat F>
void launch_expert_f(const WeightMat& W, int64_t R, const int32_t* ids, int64_t N, const float* X, int64_t x_div,
                     float* Y, Stream s) {
  const int64_t E = W.rows / R;
  const auto* w = static_cast<const uint8_t*>(W.data);
  constexpr int Rw = GemvCfg<F, 1>::rows();
  // Launches of whole x_div groups, so each launch's slots start at an activation row.
  const int64_t per = std::max<int64_t>(x_div, kExpertSlotsPerLaunch / x_div * x_div);
  for (int64_t n0 = 0; n0 < N; n0 += per) {
    const int64_t n = std::min(per, N - n0);
    const float* x = X + (n0 / x_div) * W.cols;
    const dim3 grid(unsigned((R + int64_t(kGemvWarps) * Rw - 1) / (int64_t(kGemvWarps) * Rw)), unsigned(n));
    if (gemv_vec_ok(W, x))
      launch(expert_gemv_kernel<F, true>, grid, kGemvThreads, 0, s, w, W.scales, R, W.cols, E, ids + n0, x, x_div,
             Y + n0 * R);
    else
      launch(expert_gemv_kernel<F, false>, grid, kGemvThreads, 0, s, w, W.scales, R, W.cols, E, ids + n0, x, x_div,
             Y + n0 * R);
    check_launch("expert gemv kernel");
  }
}

template <WFormat F>
void launch_expert_glu_f(const WeightMat& G, const WeightMat& U, int64_t R, const int32_t* ids, int64_t N,
                         const float* X, int64_t x_div, float b1, float b2, float* H, Stream s) {
  const int64_t E = G.rows / R;
  const auto *wg = static_cast<const uint8_t*>(G.data), *wu = static_cast<const uint8_t*>(U.data);
  constexpr int Rw = GemvCfg<F, 1>::rows();
  const int64_t per = std::max<int64_t>(x_div, kExpertSlotsPerLaunch / x_div * x_div);
  for (int64_t n0 = 0; n0 < N; n0 += per) {
    const int64_t n = std::min(per, N - n0);
    const float* x = X + (n0 / x_div) * G.cols;
    const dim3 grid(unsigned((R + int64_t(kGemvWarps) * Rw - 1) / (int64_t(kGemvWarps) * Rw)), unsigned(n));
    if (gemv_vec_ok(G, x) && gemv_vec_ok(U, x))
      launch(expert_glu_kernel<F, true>, grid, kGemvThreads, 0, s, wg, G.scales, wu, U.scales, R, G.cols, E, ids + n0,
             x, x_div, b1, b2, H + n0 * R);
    else
      launch(expert_glu_kernel<F, false>, grid, kGemvThreads, 0, s, wg, G.scales, wu, U.scales, R, G.cols, E, ids + n0,
             x, x_div, b1, b2, H + n0 * R);
    check_launch("expert glu kernel");
  }
}

template <WFormat F, int T>
void launch_gemv_batch_t(const GemvJob* jobs, int64_t n, Stream s) {
  constexpr int R = GemvCfg<F, T>::rows();
  GemvBatchArgs a = {};
  a.n = int(n);
  int64_t blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const WeightMat& W = *jobs[i].W;
    a.W[i] = static_cast<const uint8_t*>(W.data);
    a.S[i] = W.scales;
    a.rows[i] = W.rows;
    a.cols[i] = W.cols;
    a.X[i] = jobs[i].X;
    a.Y[i] = jobs[i].Y;
    a.first_block[i] = blocks;
    blocks += (W.rows + int64_t(kGemvWarps) * R - 1) / (int64_t(kGemvWarps) * R);
  }
  a.first_block[n] = blocks;
  if (blocks > (int64_t(1) << 31) - 1) failf("gemv_batch: too many rows for one launch");
  launch(gemv_batch_kernel<F, T>, unsigned(blocks), kGemvThreads, 0, s, a);
  check_launch("gemv batch kernel");
}

template <WFormat F>
void launch_gemv_batch_f(const GemvJob* jobs, int64_t n, int64_t T, Stream s) {
  with_gemv_rows<F>(T, [&](auto t) { launch_gemv_batch_t<F, decltype(t)::value>(jobs, n, s); });
}

}  // namespace

void matmul(const WeightMat& W, const float* X, int64_t T, float* Y, Precision p, Stream s) {
  check_weight(W, "matmul");
  if (T <= 0 || W.rows == 0) return;
  if (T > 65535LL * kSimtTile || W.rows > (int64_t(1) << 31) - 1) failf("matmul: shape too large for the GPU kernels");
  if (W.cols == 0) return dev_memset(Y, 0, size_t(T * W.rows) * sizeof(float), s);
  if (T <= kGemvMaxT) return with_format(W.fmt, [&](auto f) { launch_gemv_f<decltype(f)::value>(W, X, T, Y, s); });
  if (p == Precision::F32 && matmul_f32_by_gemv(W.rows, T))
    return with_format(W.fmt, [&](auto f) { launch_gemv_chunks_f<decltype(f)::value>(W, X, T, Y, s); });
  if (p == Precision::F32) return launch_simt<false>(W, X, T, Y, s);
  // Precision::BF16: activations rounded to bf16, weights exact, fp32 accumulation, on every path.
  if (W.fmt == WFormat::BF16 && aligned16(W.data) && aligned16(X)) return matmul_cublas_bf16(W, X, T, Y, s);
  if ((W.fmt == WFormat::MXFP4 || W.fmt == WFormat::FP8) && aligned16(W.data) && aligned16(X) &&
      W.cols % kMmaBK == 0 && host_row_bytes(W) % 16 == 0) {
    const dim3 grid(unsigned((W.rows + kMmaBM - 1) / kMmaBM), unsigned((T + kMmaBN - 1) / kMmaBN));
    const auto* w = static_cast<const uint8_t*>(W.data);
    if (W.fmt == WFormat::FP8)
      gemm_mma_q_kernel<WFormat::FP8><<<grid, kMmaThreads, 0, s>>>(w, W.scales, W.rows, W.cols, X, T, Y);
    else
      gemm_mma_q_kernel<WFormat::MXFP4><<<grid, kMmaThreads, 0, s>>>(w, W.scales, W.rows, W.cols, X, T, Y);
    check_launch("gemm mma kernel");
    return;
  }
  // F16 / F32 weights (bf16 tensor cores would round them) and unaligned BF16 / MXFP4 views.
  launch_simt<true>(W, X, T, Y, s);
}

void matmul_bf16_out(const WeightMat& W, const void* X, int64_t T, void* Y, Stream s) {
  if (W.fmt != WFormat::BF16 || !aligned16(W.data) || !aligned16(X) || !aligned16(Y) || W.cols % 8 != 0 ||
      W.rows % 8 != 0)
    failf("matmul_bf16_out: needs a 16-byte aligned BF16 weight with rows and cols multiples of 8 (got %s %lldx%lld)",
          wformat_name(W.fmt), (long long)W.rows, (long long)W.cols);
  if (T <= 0) return;
  if (T > INT32_MAX || W.rows > INT32_MAX || W.cols > INT32_MAX) failf("matmul_bf16_out: shape too large");
  std::lock_guard<std::mutex> lock(g_cublas_mu);
  const cublasHandle_t h = cublas_on(s).first;
  const float alpha = 1.0f, beta = 0.0f;
  cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(W.rows), int(T), int(W.cols), &alpha, W.data, CUDA_R_16BF,
                            int(W.cols), X, CUDA_R_16BF, int(W.cols), &beta, Y, CUDA_R_16BF, int(W.rows),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "bf16 GEMM (bf16 out)");
}

bool matmul_f32_by_gemv(int64_t rows, int64_t T) {
  const int64_t tiles = ((rows + kSimtTile - 1) / kSimtTile) * ((T + kSimtTile - 1) / kSimtTile);
  return T > kGemvMaxT && T / kGemvMaxT <= 65535 && tiles < kSmallSimtGrid;
}

bool expert_gemm_grouped_ok(const WeightMat& W, int64_t R) {
  return W.fmt == WFormat::MXFP4 && W.data && W.scales && R > 0 && W.rows % R == 0 && W.cols > 0 &&
         W.cols % kMmaBK == 0 && aligned16(W.data) && (R * W.cols / 2) % 16 == 0 &&
         W.rows / R <= (int64_t(1) << 31) - 1;
}

void expert_gemm_grouped(const WeightMat* const* W, float* const* Y, int n_mats, int64_t R, const ExpertTile* tiles,
                         int64_t n_tiles, const float* X, Stream s) {
  if (n_mats < 1 || n_mats > 2) failf("expert_gemm_grouped: %d matrices (1 or 2)", n_mats);
  GroupedMmaArgs a{};
  for (int z = 0; z < n_mats; ++z) {
    check_weight(*W[z], "expert_gemm_grouped");
    if (!expert_gemm_grouped_ok(*W[z], R))
      failf("expert_gemm_grouped: a %s [%lld, %lld] stack of %lld-row experts is not an aligned MXFP4 stack",
            wformat_name(W[z]->fmt), (long long)W[z]->rows, (long long)W[z]->cols, (long long)R);
    if (W[z]->rows != W[0]->rows || W[z]->cols != W[0]->cols)
      failf("expert_gemm_grouped: the matrices differ in shape");
    a.W[z] = static_cast<const uint8_t*>(W[z]->data);
    a.S[z] = W[z]->scales;
    a.Y[z] = Y[z];
  }
  if (!aligned16(X)) failf("expert_gemm_grouped: activations not 16-byte aligned");
  if (n_tiles <= 0) return;
  if (n_tiles > 65535) failf("expert_gemm_grouped: %lld tiles (at most 65535 per launch)", (long long)n_tiles);
  a.X = X;
  a.tiles = tiles;
  a.R = R;
  a.cols = W[0]->cols;
  const dim3 grid(unsigned((R + kMmaBM - 1) / kMmaBM), unsigned(n_tiles), unsigned(n_mats));
  grouped_mma_fp4_kernel<<<grid, kMmaThreads, 0, s>>>(a);
  check_launch("grouped mma fp4 kernel");
}

bool gemv_wide_ok(const WeightMat& W) { return W.fmt != WFormat::MXFP4; }

void gemv_rows(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s) {
  check_weight(W, "gemv_rows");
  if (T <= 0 || W.rows == 0) return;
  if (T > kGemvMaxT && !(T == kGemvWideT && gemv_wide_ok(W)))
    failf("gemv_rows: %lld rows (at most %lld, or %lld on non-MXFP4 weights)", (long long)T, (long long)kGemvMaxT,
          (long long)kGemvWideT);
  if (W.cols == 0) return dev_memset(Y, 0, size_t(T * W.rows) * sizeof(float), s);
  with_format(W.fmt, [&](auto f) { launch_gemv_f<decltype(f)::value>(W, X, T, Y, s); });
}

void gemv_batch(const GemvJob* jobs, int64_t n, int64_t T, Stream s) {
  if (n < 0) failf("gemv_batch: %lld jobs", (long long)n);
  if (T <= 0) return;
  // Jobs the batched kernel takes (16-byte path, non-empty), grouped by format in launches of up
  // to kGemvBatchMax; any other job runs alone through gemv_rows (same bits either way).
  constexpr int kFormats = int(WFormat::FP8) + 1;
  GemvJob group[kFormats][kGemvBatchMax];
  int64_t count[kFormats] = {};
  const auto flush = [&](int f) {
    if (count[f] == 0) return;
    with_format(WFormat(f), [&](auto fc) { launch_gemv_batch_f<decltype(fc)::value>(group[f], count[f], T, s); });
    count[f] = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const WeightMat& W = *jobs[i].W;
    check_weight(W, "gemv_batch");
    if (T > kGemvMaxT && !(T == kGemvWideT && gemv_wide_ok(W)))
      failf("gemv_batch: %lld rows (at most %lld, or %lld on non-MXFP4 weights)", (long long)T, (long long)kGemvMaxT,
            (long long)kGemvWideT);
    const int f = int(W.fmt);
    if (f < 0 || f >= kFormats || W.rows == 0 || W.cols == 0 || !gemv_vec_ok(W, jobs[i].X)) {
      gemv_rows(W, jobs[i].X, T, jobs[i].Y, s);
      continue;
    }
    group[f][count[f]++] = jobs[i];
    if (count[f] == kGemvBatchMax) flush(f);
  }
  for (int f = 0; f < kFormats; ++f) flush(f);
}

void expert_glu(const WeightMat& gate, const WeightMat& up, int64_t R, const int32_t* ids, int64_t N, const float* X,
                int64_t x_div, float b1, float b2, float* H, Stream s) {
  check_weight(gate, "expert_glu");
  check_weight(up, "expert_glu");
  if (gate.fmt != up.fmt || gate.rows != up.rows || gate.cols != up.cols)
    failf("expert_glu: gate %s [%lld, %lld] and up %s [%lld, %lld] differ", wformat_name(gate.fmt),
          (long long)gate.rows, (long long)gate.cols, wformat_name(up.fmt), (long long)up.rows, (long long)up.cols);
  if (R <= 0 || gate.rows % R != 0)
    failf("expert_glu: %lld stacked rows are not a multiple of %lld rows per expert", (long long)gate.rows,
          (long long)R);
  if (x_div < 1 || x_div > kExpertSlotsPerLaunch) failf("expert_glu: x_div must be in 1..65535");
  if (N <= 0) return;
  if (N > (int64_t(1) << 31) - 1 || gate.rows / R > 65534)
    failf("expert_glu: too many slots or experts for the GPU kernels");
  if (gate.cols == 0) {  // both products are 0: situ(0, 0) = 0
    return dev_memset(H, 0, size_t(N * R) * sizeof(float), s);
  }
  with_format(gate.fmt,
              [&](auto f) { launch_expert_glu_f<decltype(f)::value>(gate, up, R, ids, N, X, x_div, b1, b2, H, s); });
}

void cublas_prepare(Stream s, int64_t x_elems) {
  std::lock_guard<std::mutex> lock(g_cublas_mu);
  auto [h, sc] = cublas_on(s);
  (void)h;
  grow_xb(*sc, size_t(std::max<int64_t>(x_elems, 0)) * sizeof(__nv_bfloat16));
}

int64_t expert_grouped_tiles_max(int64_t N, int64_t E) {
  return (N + kGemvMaxT - 1) / kGemvMaxT + std::min(E, N);
}

namespace {
size_t expert_sort_smem(int64_t N, int64_t E) { return size_t(3 * E + N) * 4; }
}  // namespace

bool expert_grouped_ok(const WeightMat& gate, const WeightMat& up, const WeightMat& down, int64_t I, int64_t N,
                       const float* X, const float* H) {
  if (I <= 0 || gate.rows % I != 0 || N <= 0) return false;
  const int64_t E = gate.rows / I;
  return gate.fmt == up.fmt && gate.rows == up.rows && gate.cols == up.cols && down.cols == I && E > 0 &&
         down.rows % E == 0 && expert_sort_smem(N, E) <= 48 * 1024 && expert_grouped_tiles_max(N, E) <= 65535 &&
         gemv_vec_ok(gate, X) && gemv_vec_ok(up, X) && gemv_vec_ok(down, H);
}

void expert_ffn_grouped(const WeightMat& gate, const WeightMat& up, const WeightMat& down, int64_t I,
                        const int32_t* ids, int64_t N, const float* X, int64_t x_div, float b1, float b2, float* H,
                        float* Y, int32_t* sorted, ExpertTile* tiles, int32_t* n_tiles, Stream s) {
  check_weight(gate, "expert_ffn_grouped");
  check_weight(up, "expert_ffn_grouped");
  check_weight(down, "expert_ffn_grouped");
  if (x_div < 1) failf("expert_ffn_grouped: x_div must be >= 1");
  if (N <= 0) return;
  if (!expert_grouped_ok(gate, up, down, I, N, X, H))
    failf("expert_ffn_grouped: %lld slots on %s [%lld, %lld] / [%lld, %lld] experts of %lld rows: not a grouped "
          "shape (expert_grouped_ok)",
          (long long)N, wformat_name(gate.fmt), (long long)gate.rows, (long long)gate.cols, (long long)down.rows,
          (long long)down.cols, (long long)I);
  const int64_t E = gate.rows / I, L = down.rows / E, tiles_max = expert_grouped_tiles_max(N, E);
  launch(expert_sort_kernel, 1, kSortThreads, expert_sort_smem(N, E), s, ids, int32_t(N), int32_t(E), Y, L, sorted,
         tiles, n_tiles);
  check_launch("expert sort kernel");
  const auto grid = [&](int64_t R_exp, int rows_per_warp) {
    return dim3(unsigned((R_exp + int64_t(kGemvWarps) * rows_per_warp - 1) / (int64_t(kGemvWarps) * rows_per_warp)),
                unsigned(tiles_max));
  };
  with_format(gate.fmt, [&](auto fc) {
    constexpr WFormat F = decltype(fc)::value;
    constexpr int Rw = GemvCfg<F, int(kGemvMaxT)>::rows();
    const auto *wg = static_cast<const uint8_t*>(gate.data), *wu = static_cast<const uint8_t*>(up.data);
    launch(expert_grouped_kernel<F, false>, grid(I, Rw), kGemvThreads, 0, s, wg, gate.scales, wu, up.scales, I,
           gate.cols, tiles, n_tiles, sorted, X, x_div, b1, b2, H);
    check_launch("grouped expert glu kernel");
  });
  with_format(down.fmt, [&](auto fc) {
    constexpr WFormat F = decltype(fc)::value;
    constexpr int Rw = GemvCfg<F, int(kGemvMaxT)>::rows();
    const auto* wd = static_cast<const uint8_t*>(down.data);
    launch(expert_grouped_kernel<F, true>, grid(L, Rw), kGemvThreads, 0, s, wd, down.scales, wd, down.scales, L, I,
           tiles, n_tiles, sorted, H, int64_t(1), 0.0f, 0.0f, Y);
    check_launch("grouped expert down kernel");
  });
}

void expert_matmul(const WeightMat& W, int64_t R, const int32_t* ids, int64_t N, const float* X, int64_t x_div,
                   float* Y, Precision p, Stream s) {
  check_weight(W, "expert_matmul");
  if (R <= 0 || W.rows % R != 0)
    failf("expert_matmul: %lld stacked rows are not a multiple of %lld rows per expert", (long long)W.rows,
          (long long)R);
  if (x_div < 1 || x_div > kExpertSlotsPerLaunch) failf("expert_matmul: x_div must be in 1..65535");
  if (N <= 0) return;
  if (N > (int64_t(1) << 31) - 1 || W.rows / R > 65534)
    failf("expert_matmul: too many slots or experts for the GPU kernels");
  if (W.cols == 0) return dev_memset(Y, 0, size_t(N * R) * sizeof(float), s);
  // Both precisions: fp32 activations (GEMV-style kernels, like the T <= kGemvMaxT matmul).
  (void)p;
  with_format(W.fmt, [&](auto f) { launch_expert_f<decltype(f)::value>(W, R, ids, N, X, x_div, Y, s); });
}

}  // namespace k3::cuda
