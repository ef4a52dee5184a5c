// Per-ISA weight-matmul kernels (one thread's share of rows) behind ops::matmul (gemm.cpp).
// Owns: the contract between the threaded driver and the kernels compiled with -mavx2/-mavx512*.
// Must not: be included by code that is not itself dispatch-guarded; the ISA translation units
// use only raw pointers and intrinsics (no std templates), so no inline function compiled with
// AVX-512 can be merged by the linker into code that runs on an older CPU.
#pragma once
#include <cstdint>

#include "ops/weight.h"

namespace k3::ops::cpu {

// All kernels compute Y[t*ldy + r] for r in [r0, r1) with fp32 accumulation.
struct GemmKernels {
  // T = 1. x: [cols] fp32. For MXFP4, xp is x permuted per 32-block into (even cols, odd cols)
  // (16 + 16 values), which matches the nibble order of the packed bytes; x is unused then.
  // For BF16 where bf16_uses_xp and bf16_head(W.data, cols) = h >= 0, xp is the same permutation
  // of x's columns from h on (blocks [h + 32k, h + 32k + 32)): the kernel reads the rows from
  // their first 64-byte boundary (column h) in aligned 64-byte loads, whose dword halves are the
  // even and odd columns; x serves the columns before h and after the last whole block.
  // Other formats (F32, F16, FP8) read x only; xp may be null for them.
  void (*gemv)(const WeightMat& W, const float* x, const float* xp, int64_t r0, int64_t r1, float* y);
  bool bf16_uses_xp;
  // Exact: X [T, cols] fp32. scratch: >= 4*cols floats (rows of W widened to fp32).
  void (*gemm_f32)(const WeightMat& W, const float* X, int64_t T, int64_t r0, int64_t r1, float* Y, int64_t ldy,
                   float* scratch);
  // Fast (activations rounded to bf16, vdpbf16ps): Xp[kp * tpad + t] holds token t's bf16 pair kp
  // (columns 2kp, 2kp + 1), tpad >= T a multiple of 16, written by pack_x_bf16 for tokens [t0, t1)
  // (t0 % 16 == 0; up to ceil16(t1) zero filled; columns in [cols, cols_pad) zero; cols_pad = cols
  // rounded up to 32). gemm_bf16 computes rows [r0, r1) for tokens [0, T); each output is one
  // accumulation over the pairs in order, so it does not depend on T, the other tokens or [r0, r1).
  // scratch: >= 16 * cols_pad + 512 uint32 on a 64-byte boundary (rows decoded to bf16 pairs).
  // nullptr when the ISA has no bf16 dot product.
  void (*pack_x_bf16)(const float* X, int64_t cols, int64_t cols_pad, int64_t tpad, int64_t t0, int64_t t1,
                      uint32_t* Xp);
  void (*gemm_bf16)(const WeightMat& W, const uint32_t* Xp, int64_t tpad, int64_t cols_pad, int64_t T, int64_t r0,
                    int64_t r1, float* Y, int64_t ldy, uint32_t* scratch);
  // Fast MXFP4 GEMV on 8-bit activations (vpdpbusd): per 128-column group, xq holds the int8 x of
  // the 64 even then the 64 odd columns, xc the 16 dword-lane corrections (-12 * the lane's x sum),
  // xs the 16 lane steps (block step / 2); xr is the dequantised x in the even/odd order of `gemv`'s
  // xp. nullptr when the ISA lacks VNNI.
  void (*gemv_mxfp4_q8)(const WeightMat& W, const int8_t* xq, const int32_t* xc, const float* xs, const float* xr,
                        int64_t r0, int64_t r1, float* y);
  // The activations of gemv_mxfp4_q8 from x [cols] (cols % 32 == 0): xq, xc, xs for the cols/128
  // whole groups, xr (the dequantised x, per 32-block even then odd columns) for all cols.
  // Bit-identical to quantize_q8_scalar (below). nullptr when gemv_mxfp4_q8 is.
  void (*quantize_q8)(const float* x, int64_t cols, int8_t* xq, int32_t* xc, float* xs, float* xr);
  // Roofline probes (ops/cpu/roofline.cpp). Sum of n bytes read with full-width loads (n % 512 == 0;
  // the result only keeps the reads from being optimised away).
  double (*read_probe)(const uint8_t* p, int64_t n);
  // Runs `iters` iterations of independent multiply-adds at this level's widest product (vdpbf16ps
  // on avx512, fp32 FMA on avx2) and returns the FLOPs done (2 per multiply-add).
  double (*flops_probe)(int64_t iters);
  // T inputs through dense rows (F32/F16/BF16; never MXFP4 or FP8): Y[t * ldy + r] for t < T and r in
  // [r0, r1) is bit-identical to gemv(W, x[t], xp[t], ..) alone (the same operations per output),
  // with each weight load shared by all T inputs. xp[t] as gemv's xp (the BF16 head permutation of
  // x[t]) or null, for every t alike. nullptr where the level has none (T separate GEMVs then).
  void (*gemv_multi)(const WeightMat& W, const float* const* x, const float* const* xp, int64_t T, int64_t r0,
                     int64_t r1, float* Y, int64_t ldy);
  // Rows per gemm_bf16 call handed to a thread (a multiple of the kernel's row tile; 0: no gemm_bf16).
  int64_t gemm_bf16_rows;
};

// The BF16 GEMV head (see GemmKernels::gemv): the columns before the rows' first 64-byte boundary,
// or -1 where the aligned path does not apply (rows not all equally aligned, or not on 4 bytes).
// static: each translation unit, ISA-flagged or not, gets its own copy.
static inline int64_t bf16_head(const void* data, int64_t cols) {
  const auto m = int64_t(reinterpret_cast<uintptr_t>(data) % 64);
  if (cols % 32 != 0 || m % 4 != 0) return -1;
  const int64_t h = (64 - m) % 64 / 2;
  return h < cols ? h : -1;
}

// The scalar twin of GemmKernels::quantize_q8 (gemm.cpp), used where the level has no kernel for it.
void quantize_q8_scalar(const float* x, int64_t cols, int8_t* xq, int32_t* xc, float* xs, float* xr);

namespace avx2 {
extern const GemmKernels kGemm;
}
namespace avx512 {
extern const GemmKernels kGemm;
extern const GemmKernels kGemmAmx;  // kGemm with gemm_bf16 and flops_probe on AMX tiles
}

}  // namespace k3::ops::cpu
