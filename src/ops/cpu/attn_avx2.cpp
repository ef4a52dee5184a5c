// AVX2 + FMA build of the attention/KDA/elementwise kernels of attn_kernels.h: the vector
// vocabulary of attn_kernels.inc on 8-lane ymm registers (vmaskmov for tails).
// Compiled with -mavx2 -mfma -mf16c; called only through kda.cpp / cpu_ops.cpp after cpu_isa() said avx2.
// Must not: use std templates or anything with external linkage besides kAttn (see attn_kernels.h).
#include <immintrin.h>

#include "ops/cpu/attn_kernels.h"

namespace k3::ops::cpu::avx2 {
namespace {

typedef __m256 vf;
typedef __m256i vm;
typedef __m256 vc;
constexpr int64_t VW = 8;
constexpr int kGemmMR = 6, kGemmNV = 2;  // 12 accumulators of 16 ymm registers
constexpr int kDotMR = 2, kDotNR = 4;    // 8 accumulators

inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vm vmask(int64_t n) {
  const int c = n >= 8 ? 8 : n <= 0 ? 0 : int(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vloadm(const float* p, vm m) { return _mm256_maskload_ps(p, m); }
inline void vstorem(float* p, vf v, vm m) { _mm256_maskstore_ps(p, m, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline vf vcopysign(vf mag, vf sgn) {
  const vf s = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(s, mag), _mm256_and_ps(s, sgn));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y·2^n for integral n in [-127, 127] (n = -127 gives 0: exponent field 0).
inline vf vscale2(vf y, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline vc vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline vf vblend(vc c, vf t, vf f) { return _mm256_blendv_ps(f, t, c); }
inline float vhsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 (or the first n < 8) 16-bit values; the tail goes through a zeroed copy (no 16-bit masked loads).
inline __m128i vload_u16x8(const uint16_t* p, int64_t n) {
  if (n >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  __builtin_memcpy(buf, p, size_t(n > 0 ? n : 0) * 2);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
}
inline vf vload_f16(const uint16_t* p, int64_t n) { return _mm256_cvtph_ps(vload_u16x8(p, n)); }
inline vf vload_bf16(const uint16_t* p, int64_t n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(vload_u16x8(p, n)), 16));
}
inline vf viota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }

}  // namespace

#include "ops/cpu/attn_kernels.inc"

}  // namespace k3::ops::cpu::avx2
