// AVX-512 (F/BW/VL/DQ + BF16) weight-matmul kernels: GEMV straight from BF16/F16/F32 rows and from
// packed MXFP4 nibbles + E8M0 scales; register-tiled 4x4 GEMMs in fp32 (exact) and with vdpbf16ps
// (fast). Compiled with -mavx512*; called only through gemm.cpp after cpu_isa() said avx512.
// Must not: use std templates or anything with external linkage besides kGemm (see gemm_kernels.h).
#include <immintrin.h>

#include "ops/cpu/gemm_kernels.h"

namespace k3::ops::cpu::avx512 {
namespace {

inline float e8m0(uint8_t s) {
  const uint32_t u = s == 255 ? 0x7fc00000u : s == 0 ? 0x00400000u : uint32_t(s) << 23;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// E2M1 code -> value (bit 3 = sign), as one register for vpermps (which reads the low 4 index bits).
inline __m512 e2m1_lut() {
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                        -4.0f, -6.0f);
}

inline __mmask16 tail16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }
inline __mmask32 tail32(int64_t n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u); }

inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// 16 consecutive weights of a row from element c, masked to m (masked-off lanes read as 0).
template <WFormat F>
inline __m512 load16(const uint8_t* row, int64_t c, __mmask16 m) {
  if constexpr (F == WFormat::F32) return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + c);
  const __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * c);
  if constexpr (F == WFormat::F16) return _mm512_cvtph_ps(h);
  return widen_bf16(h);
}
template <WFormat F>
inline __m512 load16(const uint8_t* row, int64_t c) {
  if constexpr (F == WFormat::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + c);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c));
  if constexpr (F == WFormat::F16) return _mm512_cvtph_ps(h);
  return widen_bf16(h);
}

constexpr int64_t esize(WFormat F) { return F == WFormat::F32 ? 4 : 2; }

// ------------------------------------------------------------------ GEMV, dense formats
// R rows at once share each load of x; two accumulators per row hide the FMA latency.
// BF16 rows with a usable head h (gemm_kernels.h: bf16_head; xp non-null) are widened without a
// shuffle: from column h on they are read in aligned 64-byte loads (a load that splits two cache
// lines costs twice; mmap'd safetensors data sits at any 8-byte offset), and in the 16 dwords of
// 32 packed bf16 values the even columns are the low halves (<< 16 makes them fp32) and the odd
// ones the high halves (AND 0xffff0000), multiplied by xp (x permuted per block, even then odd).
// Two ALU uops per 64 bytes instead of two shuffles and two shifts: measured 48 GB/s per core from
// L2 against 35-38 for 32-byte loads + vpmovzxwd.
// pf: where the next tile's rows start (this tile's rows + R rows); each step prefetches the same
// offset there, so the next tile is in cache when it starts. The hardware prefetchers stop at 4 KiB
// page boundaries and mmap'd weights have 4 KiB pages; measured +25-30% decode bandwidth.
template <WFormat F, int R>
inline void gemv_rows(const uint8_t* const* p, const float* x, const float* xp, int64_t n, float* y, int64_t pf) {
  __m512 a[R], b[R];
  for (int i = 0; i < R; ++i) a[i] = b[i] = _mm512_setzero_ps();
  int64_t c = 0;
  const int64_t h = F == WFormat::BF16 && xp ? bf16_head(p[0], n) : -1;
  if (h >= 0) {
    for (int64_t c0 = 0; c0 < h; c0 += 16) {  // the head, in natural order
      const __mmask16 m = tail16(h - c0);
      const __m512 x0 = _mm512_maskz_loadu_ps(m, x + c0);
      for (int i = 0; i < R; ++i) b[i] = _mm512_fmadd_ps(load16<F>(p[i], c0, m), x0, b[i]);
    }
    const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
    for (c = h; c + 32 <= n; c += 32) {
      const __m512 xe = _mm512_loadu_ps(xp + (c - h)), xo = _mm512_loadu_ps(xp + (c - h) + 16);
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 2 * c), _MM_HINT_T1);
        const __m512i v = _mm512_load_si512(p[i] + 2 * c);
        a[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), xe, a[i]);
        b[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi)), xo, b[i]);
      }
    }
  } else {
    for (; c + 32 <= n; c += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + esize(F) * c), _MM_HINT_T1);
        if constexpr (F == WFormat::F32) _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 4 * c + 64), _MM_HINT_T0);
        a[i] = _mm512_fmadd_ps(load16<F>(p[i], c), x0, a[i]);
        b[i] = _mm512_fmadd_ps(load16<F>(p[i], c + 16), x1, b[i]);
      }
    }
  }
  for (; c < n; c += 16) {  // the columns past the last whole block, in natural order
    const __mmask16 m = tail16(n - c);
    const __m512 x0 = _mm512_maskz_loadu_ps(m, x + c);
    for (int i = 0; i < R; ++i) a[i] = _mm512_fmadd_ps(load16<F>(p[i], c, m), x0, a[i]);
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i]));
}

// ------------------------------------------------------------------ GEMV, MXFP4
// Per 32-column block and row: 16 packed bytes -> even columns (low nibbles) and odd columns (high
// nibbles) through the E2M1 table, dotted with the matching halves of the permuted x, then scaled.
template <int R>
inline void gemv_mxfp4_rows(const uint8_t* const* p, const uint8_t* const* s, const float* xp, int64_t nb, float* y) {
  const __m512 lut = e2m1_lut();
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 xe = _mm512_loadu_ps(xp + 32 * b), xo = _mm512_loadu_ps(xp + 32 * b + 16);
    for (int i = 0; i < R; ++i) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i] + 16 * b)));
      const __m512 we = _mm512_permutexvar_ps(idx, lut);
      const __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut);
      const __m512 t = _mm512_fmadd_ps(wo, xo, _mm512_mul_ps(we, xe));
      acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(e8m0(s[i][b])), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(acc[i]);
}

// ------------------------------------------------------------------ helpers of the fast MXFP4 GEMV
bool scales_are_normal(const uint8_t* s, int64_t n) {
  // (s + 1) mod 256 <= 1 exactly for s = 255 and s = 0; 64 bytes per compare.
  const __m512i one = _mm512_set1_epi8(1);
  __mmask64 bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    bad |= _mm512_cmple_epu8_mask(_mm512_add_epi8(_mm512_loadu_si512(s + i), one), one);
  if (i < n) {
    const __mmask64 m = (~__mmask64(0)) >> (64 - (n - i));
    bad |= _mm512_mask_cmple_epu8_mask(m, _mm512_add_epi8(_mm512_maskz_loadu_epi8(m, s + i), one), one);
  }
  return bad == 0;
}

// ------------------------------------------------------------------ GEMV, MXFP4 on 8-bit activations
// x quantised per 32-block to int8 with a float step (quantize_q8 below; its scalar twin is gemm.cpp: quantize_q8_scalar). Per four
// blocks (64 packed bytes) and row: low and high nibbles through one byte table each to
// u8 = 2*E2M1 + 12 (0..24), then vpdpbusd against the int8 x of the even and odd columns: in each
// dword lane j the four bytes 4j..4j+3 belong to block j/4 (of the four). The +12 offset adds
// 12 * (sum of the lane's x), which the accumulator starts out subtracting (xc); the integer dot
// is exact. Lanes 4L..4L+3 are then scaled by 2^(s_L - 127) * step_L / 2.
// The four E8M0 scales arrive as one broadcast dword; a per-lane rotate moves byte L/4 of it to the
// exponent field of lane L and an AND clears the rest, i.e. 2^(s - 127) as float: three uops, none
// on the shuffle port that the nibble lookups already load.
// pf: byte distance ahead at which each row is prefetched (the next tiles' rows: the hardware
// prefetchers stop at 4 KiB pages, and short MXFP4 rows need more than one tile of lead).
template <int R>
inline void gemv_mxfp4_q8_rows(const uint8_t* const* p, const uint8_t* const* s, const int8_t* xq, const int32_t* xc,
                               const float* xs, int64_t ng, float* y, int64_t pf) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i m0f = _mm512_set1_epi8(0x0f);
  const __m512i rot = _mm512_setr_epi32(23, 23, 23, 23, 15, 15, 15, 15, 7, 7, 7, 7, 31, 31, 31, 31);
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const __m512i xe = _mm512_loadu_si512(xq + 128 * g), xo = _mm512_loadu_si512(xq + 128 * g + 64);
    const __m512i c = _mm512_loadu_si512(xc + 16 * g);
    const __m512 sx = _mm512_loadu_ps(xs + 16 * g);
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 64 * g), _MM_HINT_T0);
      const __m512i P = _mm512_loadu_si512(p[i] + 64 * g);
      const __m512i wl = _mm512_shuffle_epi8(lut, _mm512_and_si512(P, m0f));
      const __m512i wh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(P, 4), m0f));
      const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, wl, xe), wh, xo);
      uint32_t s4;
      __builtin_memcpy(&s4, s[i] + 4 * g, 4);
      const __m512i ws = _mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi32(int(s4)), rot), expo);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_castsi512_ps(ws), sx), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(acc[i]);
}

// Tiles of four rows whose prefetch runs this many tiles ahead (measured on 768- and 1024-column
// expert rows: 1 tile 53%, 2-8 tiles 60-62% of the read bandwidth; 3 chosen).
constexpr int64_t kMxfp4PrefetchTiles = 3;

void gemv_mxfp4_q8(const WeightMat& W, const int8_t* xq, const int32_t* xc, const float* xs, const float* xr,
                   int64_t r0, int64_t r1, float* y) {
  const int64_t nb = W.cols / 32, ng = nb / 4;
  const uint8_t* pb = static_cast<const uint8_t*>(W.data);
  auto tail = [&](int64_t r, float* out) {  // blocks [4*ng, nb) of row r, added to *out
    if (ng * 4 == nb) return;
    const uint8_t* p[1] = {pb + r * nb * 16 + ng * 64};
    const uint8_t* sp[1] = {W.scales + r * nb + ng * 4};
    float t;
    gemv_mxfp4_rows<1>(p, sp, xr + ng * 128, nb - ng * 4, &t);
    *out += t;
  };
  int64_t r = r0;
  for (; r < r1;) {
    if (r + 4 <= r1 && scales_are_normal(W.scales + r * nb, 4 * nb)) {
      const uint8_t* p[4] = {pb + r * nb * 16, pb + (r + 1) * nb * 16, pb + (r + 2) * nb * 16, pb + (r + 3) * nb * 16};
      const uint8_t* sp[4] = {W.scales + r * nb, W.scales + (r + 1) * nb, W.scales + (r + 2) * nb, W.scales + (r + 3) * nb};
      gemv_mxfp4_q8_rows<4>(p, sp, xq, xc, xs, ng, y + r, kMxfp4PrefetchTiles * 4 * nb * 16);
      for (int i = 0; i < 4; ++i) tail(r + i, y + r + i);
      r += 4;
    } else {
      const uint8_t* p[1] = {pb + r * nb * 16};
      const uint8_t* sp[1] = {W.scales + r * nb};
      if (scales_are_normal(sp[0], nb)) {
        gemv_mxfp4_q8_rows<1>(p, sp, xq, xc, xs, ng, y + r, nb * 16);
        tail(r, y + r);
      } else {
        gemv_mxfp4_rows<1>(p, sp, xr, nb, y + r);
      }
      r += 1;
    }
  }
}

// The activations of gemv_mxfp4_q8, bit-identical to gemm.cpp's quantize_q8_scalar (same
// fp32 operations; cvtps rounds to nearest even as its 1.5 * 2^23 trick does). Per 32-block: the
// even and odd columns are separated first (vpermt2ps), then quantised, so xq and xr come out in
// the kernel's order directly.
void quantize_q8(const float* x, int64_t cols, int8_t* xq, int32_t* xc, float* xs, float* xr) {
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const int64_t nb = cols / 32, ng = nb / 4;
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    const __m512 vd = _mm512_set1_ps(d), vinv = _mm512_set1_ps(inv);
    const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, ie, hi), vinv));
    const __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, io, hi), vinv));
    _mm512_storeu_ps(xr + 32 * b, _mm512_mul_ps(_mm512_cvtepi32_ps(qe), vd));
    _mm512_storeu_ps(xr + 32 * b + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(qo), vd));
    if (b >= 4 * ng) continue;  // a tail block: only the fp32 path (xr) reads it
    const int64_t g = b / 4, j = b % 4;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 128 * g + 16 * j), _mm512_cvtepi32_epi8(qe));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 128 * g + 64 + 16 * j), _mm512_cvtepi32_epi8(qo));
    int32_t t[16];
    _mm512_storeu_si512(t, _mm512_add_epi32(qe, qo));
    for (int64_t l = 0; l < 4; ++l) {
      xc[16 * g + 4 * j + l] = -12 * (t[4 * l] + t[4 * l + 1] + t[4 * l + 2] + t[4 * l + 3]);
      xs[16 * g + 4 * j + l] = d * 0.5f;
    }
  }
}

// ------------------------------------------------------------------ row widening
// Row r of W as fp32 in natural column order.
void widen_row(const WeightMat& W, int64_t r, float* out) {
  const int64_t n = W.cols;
  const uint8_t* base = static_cast<const uint8_t*>(W.data);
  switch (W.fmt) {
    case WFormat::F32:
      for (int64_t c = 0; c < n; c += 16)
        _mm512_mask_storeu_ps(out + c, tail16(n - c), load16<WFormat::F32>(base + r * n * 4, c, tail16(n - c)));
      return;
    case WFormat::F16:
      for (int64_t c = 0; c < n; c += 16)
        _mm512_mask_storeu_ps(out + c, tail16(n - c), load16<WFormat::F16>(base + r * n * 2, c, tail16(n - c)));
      return;
    case WFormat::BF16:
      for (int64_t c = 0; c < n; c += 16)
        _mm512_mask_storeu_ps(out + c, tail16(n - c), load16<WFormat::BF16>(base + r * n * 2, c, tail16(n - c)));
      return;
    case WFormat::MXFP4: {
      const int64_t nb = n / 32;
      const uint8_t* p = base + r * nb * 16;
      const uint8_t* s = W.scales + r * nb;
      const __m512 lut = e2m1_lut();
      const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * b)));
        const __m512 sc = _mm512_set1_ps(e8m0(s[b]));
        const __m512 we = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), sc);
        const __m512 wo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut), sc);
        _mm512_storeu_ps(out + 32 * b, _mm512_permutex2var_ps(we, lo, wo));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_permutex2var_ps(we, hi, wo));
      }
      return;
    }
  }
}

// ------------------------------------------------------------------ GEMM fp32 (exact)
// Tile of R weight rows x N tokens: R*N accumulators, one FMA per (row, token) per 16 columns.
template <int R, int N>
inline void tile_f32(const float* const* w, const float* X, int64_t ldx, int64_t n, float* Y, int64_t ldy) {
  __m512 acc[R][N];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = tail16(n - c);
    __m512 xv[N];
    for (int j = 0; j < N; ++j) xv[j] = _mm512_maskz_loadu_ps(m, X + j * ldx + c);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w[i] + c);
      for (int j = 0; j < N; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j) Y[j * ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int R>
inline void tiles_f32(const float* const* w, const float* X, int64_t T, int64_t n, float* Y, int64_t ldy) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) tile_f32<R, 4>(w, X + t * n, n, n, Y + t * ldy, ldy);
  switch (T - t) {
    case 3: tile_f32<R, 3>(w, X + t * n, n, n, Y + t * ldy, ldy); break;
    case 2: tile_f32<R, 2>(w, X + t * n, n, n, Y + t * ldy, ldy); break;
    case 1: tile_f32<R, 1>(w, X + t * n, n, n, Y + t * ldy, ldy); break;
    default: break;
  }
}

// ------------------------------------------------------------------ GEMM bf16 (fast)
// vdpbf16ps: each fp32 lane accumulates the products of one adjacent bf16 pair.
template <int R, int N>
inline void tile_bf16(const uint16_t* const* w, const uint16_t* X, int64_t ldx, int64_t n, float* Y, int64_t ldy) {
  __m512 acc[R][N];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 32) {
    __m512i xv[N];
    for (int j = 0; j < N; ++j) xv[j] = _mm512_loadu_si512(X + j * ldx + c);
    for (int i = 0; i < R; ++i) {
      const __m512i wv = _mm512_loadu_si512(w[i] + c);
      for (int j = 0; j < N; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < N; ++j) Y[j * ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int R>
inline void tiles_bf16(const uint16_t* const* w, const uint16_t* X, int64_t ldx, int64_t T, float* Y, int64_t ldy) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) tile_bf16<R, 4>(w, X + t * ldx, ldx, ldx, Y + t * ldy, ldy);
  switch (T - t) {
    case 3: tile_bf16<R, 3>(w, X + t * ldx, ldx, ldx, Y + t * ldy, ldy); break;
    case 2: tile_bf16<R, 2>(w, X + t * ldx, ldx, ldx, Y + t * ldy, ldy); break;
    case 1: tile_bf16<R, 1>(w, X + t * ldx, ldx, ldx, Y + t * ldy, ldy); break;
    default: break;
  }
}

// Row r of W as bf16, zero padded to np columns (exact for BF16 and MXFP4; RNE for F32/F16).
void row_bf16(const WeightMat& W, int64_t r, int64_t np, uint16_t* out, float* tmp) {
  const int64_t n = W.cols;
  if (W.fmt == WFormat::BF16) {
    const uint8_t* p = static_cast<const uint8_t*>(W.data) + 2 * r * n;
    for (int64_t c = 0; c < np; c += 32)
      _mm512_storeu_si512(out + c, _mm512_maskz_loadu_epi16(c < n ? tail32(n - c) : 0, p + 2 * c));
    return;
  }
  widen_row(W, r, tmp);
  for (int64_t c = 0; c < np; c += 32) {
    const __m512 a = _mm512_maskz_loadu_ps(c < n ? tail16(n - c) : 0, tmp + c);
    const __m512 b = _mm512_maskz_loadu_ps(c + 16 < n ? tail16(n - c - 16) : 0, tmp + c + 16);
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

void gemm_bf16(const WeightMat& W, const uint16_t* Xb, int64_t np, int64_t T, int64_t r0, int64_t r1, float* Y,
               int64_t ldy, uint16_t* scratch) {
  // scratch: 4 bf16 rows of np, then (for non-BF16 formats) one fp32 row of W.cols.
  float* tmp = reinterpret_cast<float*>(scratch + 4 * np);
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t R = r1 - r < 4 ? r1 - r : 4;
    const uint16_t* w[4];
    for (int64_t i = 0; i < R; ++i) {
      row_bf16(W, r + i, np, scratch + i * np, tmp);
      w[i] = scratch + i * np;
    }
    switch (R) {
      case 4: tiles_bf16<4>(w, Xb, np, T, Y + r, ldy); break;
      case 3: tiles_bf16<3>(w, Xb, np, T, Y + r, ldy); break;
      case 2: tiles_bf16<2>(w, Xb, np, T, Y + r, ldy); break;
      default: tiles_bf16<1>(w, Xb, np, T, Y + r, ldy); break;
    }
  }
}

constexpr int kDenseTile = 8;  // rows per dense GEMV tile (32 zmm registers hold 16 accumulators)
#include "ops/cpu/gemm_rows.inc"  // gemv_dense, gemv_mxfp4, gemv, gemm_f32 over the kernels above

// ------------------------------------------------------------------ roofline probes
double read_probe(const uint8_t* p, int64_t n) {
  // Eight concurrent streams (like a GEMV over several rows): one stream alone leaves the
  // hardware prefetchers short of what the memory system can deliver.
  // XOR, not add: the sum only has to depend on every byte, and must not overflow (UBSan).
  const int64_t q = n / 8;
  __m512i a[8];
  for (int s = 0; s < 8; ++s) a[s] = _mm512_setzero_si512();
  for (int64_t i = 0; i < q; i += 64)
    for (int s = 0; s < 8; ++s) a[s] = _mm512_xor_si512(a[s], _mm512_loadu_si512(p + s * q + i));
  for (int s = 1; s < 8; ++s) a[0] = _mm512_xor_si512(a[0], a[s]);
  uint64_t lanes[8], x = 0;
  _mm512_storeu_si512(lanes, a[0]);
  for (uint64_t v : lanes) x ^= v;
  return double(x >> 11);
}

double flops_probe(int64_t iters) {
  // 12 independent accumulators cover the latency of vdpbf16ps on current cores.
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3c00);  // bf16 1.0 and 2^-7
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  return double(iters) * 12 * 32 * 2 + (sink == 12345.0f ? 1 : 0);
}

}  // namespace

const GemmKernels kGemm = {gemv, true, gemm_f32, gemm_bf16, gemv_mxfp4_q8, quantize_q8, read_probe, flops_probe};

}  // namespace k3::ops::cpu::avx512
