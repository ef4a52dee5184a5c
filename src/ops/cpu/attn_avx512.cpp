// AVX-512 (F/BW/VL/DQ) build of the attention/KDA/elementwise kernels of attn_kernels.h: the
// vector vocabulary of attn_kernels.inc on 16-lane zmm registers with mask registers for tails.
// Compiled with -mavx512*; called only through kda.cpp / cpu_ops.cpp after cpu_isa() said avx512.
// Must not: use std templates or anything with external linkage besides kAttn (see attn_kernels.h).
#include <immintrin.h>

#include "ops/cpu/attn_kernels.h"

namespace k3::ops::cpu::avx512 {
namespace {

typedef __m512 vf;
typedef __mmask16 vm;
typedef __mmask16 vc;
constexpr int64_t VW = 16;
constexpr int kGemmMR = 8, kGemmNV = 2;  // 16 accumulators, 10 loads per 16 FMAs
constexpr int kDotMR = 4, kDotNR = 4;    // 16 accumulators

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vm vmask(int64_t n) { return n >= 16 ? vm(0xffff) : n <= 0 ? vm(0) : vm((1u << n) - 1u); }
inline vf vloadm(const float* p, vm m) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstorem(float* p, vf v, vm m) { _mm512_mask_storeu_ps(p, m, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vabs(vf x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}
inline vf vcopysign(vf mag, vf sgn) {
  const __m512i s = _mm512_set1_epi32(int(0x80000000u));
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_andnot_si512(s, _mm512_castps_si512(mag)), _mm512_and_si512(s, _mm512_castps_si512(sgn))));
}
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }
inline vc vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline vf vblend(vc c, vf t, vf f) { return _mm512_mask_blend_ps(c, f, t); }
inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vload_f16(const uint16_t* p, int64_t n) {
  return _mm512_cvtph_ps(n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi16(__mmask16(vmask(n)), p));
}
inline vf vload_bf16(const uint16_t* p, int64_t n) {
  const __m256i h = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                            : _mm256_maskz_loadu_epi16(__mmask16(vmask(n)), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf viota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

}  // namespace

#include "ops/cpu/attn_kernels.inc"

}  // namespace k3::ops::cpu::avx512
