// AVX-512 (F/BW/VL/DQ + BF16) weight-matmul kernels: GEMV straight from BF16/F16/F32 rows, from
// packed MXFP4 nibbles + E8M0 scales and from FP8 (E4M3 + 128 x 128 block scales); register-tiled 4x4 GEMMs in fp32
// (exact), and with vdpbf16ps (fast) on packed activations. Compiled with -mavx512*; called only through gemm.cpp after
// cpu_isa() said avx512.
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
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f,
                        -6.0f);
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
        if constexpr (F == WFormat::F32)
          _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 4 * c + 64), _MM_HINT_T0);
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

// ------------------------------------------------------------------ GEMV, FP8 (E4M3, 128 x 128 block scales)
// 16 E4M3 codes -> fp32: sign-extended to 16 bits and shifted left 7, a code's exponent and mantissa
// land in an f16's (1 + 4 + 3 bits into 1 + 5 + 10; the sign copy in bit 14 cleared), so vcvtph2ps
// gives the code's value times 2^-8 exactly, subnormals included (S.1111.111 would read as 480 x
// 2^-8, not NaN: the quantiser never writes it). The 2^8 goes into the block scale.
inline __m512 e4m3_16(__m128i b) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbfff)));
  return _mm512_cvtph_ps(h);
}

// R rows (codes p[i], block scales s[i] of their block row) . x over n columns: per 128-column block
// a sum of codes x x in fp32 (one FMA per 16 columns), then scaled into the row's sum; the tail of a
// partial last block masked. pf: where the next tile's rows start (prefetched meanwhile, as the
// dense GEMV does).
template <int R>
inline void gemv_fp8_rows(const uint8_t* const* p, const float* const* s, const float* x, int64_t n, float* y,
                          int64_t pf) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c0 = 0, b = 0; c0 < n; c0 += kFp8Block, ++b) {
    const int64_t c1 = c0 + kFp8Block < n ? c0 + kFp8Block : n;
    __m512 blk[R];
    for (int i = 0; i < R; ++i) blk[i] = _mm512_setzero_ps();
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      const __m512 x0 = _mm512_loadu_ps(x + c);
      for (int i = 0; i < R; ++i) {
        if ((c - c0) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + c), _MM_HINT_T1);
        const __m512 w = e4m3_16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i] + c)));
        blk[i] = _mm512_fmadd_ps(w, x0, blk[i]);
      }
    }
    if (c < c1) {
      const __mmask16 m = tail16(c1 - c);
      const __m512 x0 = _mm512_maskz_loadu_ps(m, x + c);
      for (int i = 0; i < R; ++i) blk[i] = _mm512_fmadd_ps(e4m3_16(_mm_maskz_loadu_epi8(m, p[i] + c)), x0, blk[i]);
    }
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(blk[i], _mm512_set1_ps(s[i][b] * 256.0f), acc[i]);
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(acc[i]);
}

constexpr int kFp8Tile = 8;  // rows per FP8 GEMV tile (as the dense GEMV: eight row streams)

// ------------------------------------------------------------------ helpers of the fast MXFP4 GEMV
bool scales_are_normal(const uint8_t* s, int64_t n) {
  // (s + 1) mod 256 <= 1 exactly for s = 255 and s = 0; 64 bytes per compare.
  const __m512i one = _mm512_set1_epi8(1);
  __mmask64 bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) bad |= _mm512_cmple_epu8_mask(_mm512_add_epi8(_mm512_loadu_si512(s + i), one), one);
  if (i < n) {
    const __mmask64 m = (~__mmask64(0)) >> (64 - (n - i));
    bad |= _mm512_mask_cmple_epu8_mask(m, _mm512_add_epi8(_mm512_maskz_loadu_epi8(m, s + i), one), one);
  }
  return bad == 0;
}

// ------------------------------------------------------------------ GEMV, MXFP4 on 8-bit activations
// x quantised per 32-block to int8 with a float step (quantize_q8 below; its scalar twin is gemm.cpp:
// quantize_q8_scalar). Per four blocks (64 packed bytes) and row: low and high nibbles through one byte table each to
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
      _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 64 * g), _MM_HINT_T1);
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

// Tiles of kMxRows rows whose prefetch runs this many tiles ahead (measured on 768- and 1024-column
// expert rows on a Xeon: 1 tile 53%, 2-8 tiles 60-62% of the read bandwidth; 3 chosen). The
// prefetch goes to L2 (T1): into L1 (T0) the expert GEMVs read 15-18 GB/s from RAM on 2 Zen 4
// cores, against 21-27 GB/s into L2 (k3_gemv_bench, same machine, same hour); 8-row tiles
// measured no faster than 4.
constexpr int64_t kMxfp4PrefetchTiles = 3;
constexpr int kMxRows = 4;

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
    if (r + kMxRows <= r1 && scales_are_normal(W.scales + r * nb, kMxRows * nb)) {
      const uint8_t* p[kMxRows];
      const uint8_t* sp[kMxRows];
      for (int i = 0; i < kMxRows; ++i) p[i] = pb + (r + i) * nb * 16, sp[i] = W.scales + (r + i) * nb;
      gemv_mxfp4_q8_rows<kMxRows>(p, sp, xq, xc, xs, ng, y + r, kMxfp4PrefetchTiles * kMxRows * nb * 16);
      for (int i = 0; i < kMxRows; ++i) tail(r + i, y + r + i);
      r += kMxRows;
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
    case WFormat::FP8: {
      // code x 2^-8 (e4m3_16) times scale x 2^8: the one rounding of code x scale, as dequant_row.
      const uint8_t* p = base + r * n;
      const float* s = W.block_scales + ((W.row0 + r) / kFp8Block) * ((n + kFp8Block - 1) / kFp8Block);
      for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = tail16(n - c);
        const __m512 w = e4m3_16(_mm_maskz_loadu_epi8(m, p + c));
        _mm512_mask_storeu_ps(out + c, m, _mm512_mul_ps(w, _mm512_set1_ps(s[c / kFp8Block] * 256.0f)));
      }
      return;
    }
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
    case 3:
      tile_f32<R, 3>(w, X + t * n, n, n, Y + t * ldy, ldy);
      break;
    case 2:
      tile_f32<R, 2>(w, X + t * n, n, n, Y + t * ldy, ldy);
      break;
    case 1:
      tile_f32<R, 1>(w, X + t * n, n, n, Y + t * ldy, ldy);
      break;
    default:
      break;
  }
}

// ------------------------------------------------------------------ GEMM bf16 (fast)
// Tokens in the lanes: the activations are packed once per call (pack_x_bf16: Xp[kp * tpad + t],
// 16 tokens per vector, kp = column pair 2kp, 2kp + 1), the weights need no packing: each
// vdpbf16ps multiplies one weight pair, broadcast straight from the row (BF16) or from the row
// decoded to bf16 pairs (MXFP4), by 16 tokens' pairs, adding both products into 16 accumulators.
// A tile is 6 rows x up to 4 token vectors (12 rows for calls of up to 24 tokens). Each output is
// one chain over the pairs in column order, so it does not depend on T, the other tokens or the
// rows around it. Measured on Zen 4
// (2048 x 2048 BF16, T = 128, one core): 85-91% of the vdpbf16ps peak, against 70% for the
// weights packed into 32-row panels (rows in the lanes), whose packing alone cost a quarter of the
// time; a packed panel is reused only across the tokens of one call.

// 16 x 16 dwords transposed in registers: r[i] lane j -> c[j] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + q]: rows 4g..4g+3 of column 4k + q in each 128-bit lane k.
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88), v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88),
                  v3 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xdd);
    r[q] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[8 + q] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[4 + q] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// The 16 column pairs of block b (columns 32b..32b+31) of row r as bf16 pair dwords (zero beyond
// the row's columns). Exact: BF16 is copied; MXFP4 values (E2M1 x 2^k) are bf16 values, so the
// upper half of their fp32 bits is the value (a subnormal or infinite product stays what
// vdpbf16ps, which reads subnormals as zero, would make of its rounding).
inline __m512i pairs_of(const WeightMat& W, int64_t r, int64_t b) {
  const int64_t n = W.cols;
  if (W.fmt == WFormat::BF16) {
    const uint8_t* p = static_cast<const uint8_t*>(W.data) + 2 * (r * n + 32 * b);
    if (n - 32 * b >= 32) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi16(tail32(n - 32 * b), p);
  }
  const uint8_t* p = static_cast<const uint8_t*>(W.data) + r * (n / 2) + 16 * b;
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 sc = _mm512_set1_ps(e8m0(W.scales[r * (n / 32) + b]));
  const __m512 lut = e2m1_lut();
  const __m512i we = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), sc));
  const __m512i wo = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut), sc));
  return _mm512_mask_blend_epi16(__mmask32(0xaaaaaaaau), _mm512_srli_epi32(we, 16), wo);
}

// X rows [t0, t1) rounded to bf16 (vcvtne2ps2bf16: nearest even, as f32_to_bf16; subnormals
// become zero, which is what vdpbf16ps makes of them anyway) as pairs, 16 tokens by 16 pairs at a
// time transposed into Xp; tokens in [t1, ceil16(t1)) and columns in [cols, np) are zero.
void pack_x_bf16(const float* X, int64_t cols, int64_t np, int64_t tpad, int64_t t0, int64_t t1, uint32_t* Xp) {
  __m512i v[16];
  for (int64_t tb = t0; tb < t1; tb += 16)
    for (int64_t b = 0; b < np / 32; ++b) {
      const int64_t c = 32 * b;
      for (int64_t i = 0; i < 16; ++i) {
        if (tb + i >= t1 || c >= cols) {
          v[i] = _mm512_setzero_si512();
          continue;
        }
        const float* x = X + (tb + i) * cols + c;
        const __m512 lo = _mm512_maskz_loadu_ps(tail16(cols - c), x);
        const __m512 hi = _mm512_maskz_loadu_ps(cols - c > 16 ? tail16(cols - c - 16) : __mmask16(0), x + 16);
        v[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      transpose16(v);
      for (int64_t k = 0; k < 16; ++k) _mm512_storeu_si512(Xp + (16 * b + k) * tpad + tb, v[k]);
    }
}

// R weight rows (bf16 pairs as dwords: w[i][kp]) x V vectors of 16 tokens, plus H = 1 half vector
// (the next 8 tokens, in a ymm register: half the work of a zmm on Zen 4, and a second port on
// Intel), over nkp pairs; out[i * 64 + token]. pf: the rows to prefetch meanwhile (the next tile's),
// one cache line per 16 pairs.
template <int R, int V, int H>
inline void tok_tile(const uint32_t* const* w, const uint32_t* const* pf, const uint32_t* Xp, int64_t tpad, int64_t nkp,
                     float* out) {
  __m512 a[R][V > 0 ? V : 1];
  __m256 h[R];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) a[i][v] = _mm512_setzero_ps();
    h[i] = _mm256_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < nkp; k0 += 16) {
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf[i] + k0), _MM_HINT_T0);
    const int64_t k1 = k0 + 16 < nkp ? k0 + 16 : nkp;
    for (int64_t kp = k0; kp < k1; ++kp) {
      __m512bh x[V > 0 ? V : 1];
      for (int v = 0; v < V; ++v) x[v] = (__m512bh)_mm512_loadu_si512(Xp + kp * tpad + 16 * v);
      __m256bh xh;
      if constexpr (H) xh = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Xp + kp * tpad + 16 * V));
      for (int i = 0; i < R; ++i) {
        uint32_t wv;
        __builtin_memcpy(&wv, w[i] + kp, 4);
        const __m512i wb = _mm512_set1_epi32(int(wv));
        for (int v = 0; v < V; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], x[v], (__m512bh)wb);
        if constexpr (H) h[i] = _mm256_dpbf16_ps(h[i], xh, (__m256bh)_mm512_castsi512_si256(wb));
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + i * 64 + 16 * v, a[i][v]);
    if constexpr (H) _mm256_storeu_ps(out + i * 64 + 16 * V, h[i]);
  }
}

// The tile for nt <= 64 tokens: whole vectors, and the last 1..8 tokens as a half vector.
template <int R, int V>
void tok_tiles(int64_t nt, const uint32_t* const* w, const uint32_t* const* pf, const uint32_t* Xp, int64_t tpad,
               int64_t nkp, float* out) {
  if constexpr (V >= 0) {
    if (nt > 16 * V + 8) return tok_tile<R, V + 1, 0>(w, pf, Xp, tpad, nkp, out);
    if (nt > 16 * V) return tok_tile<R, V, 1>(w, pf, Xp, tpad, nkp, out);
    if (nt == 16 * V && V > 0) return tok_tile<R, (V > 0 ? V : 1), 0>(w, pf, Xp, tpad, nkp, out);
    tok_tiles<R, V - 1>(nt, w, pf, Xp, tpad, nkp, out);
  }
}

// Rows per tile: 6 when the tokens fill 2 or more vectors (up to 24 accumulators); 12 for calls of
// at most 24 tokens, so the 12-24 accumulator chains still cover the latency of vdpbf16ps.
constexpr int64_t kTokRowsMax = 12;

// Rows [r0, r1) of Y, tokens [0, T) (Xp from pack_x_bf16 with tpad >= T). scratch (MXFP4, and
// BF16 rows of odd length): kTokRowsMax rows of np / 2 dwords, 64-byte aligned.
void gemm_bf16(const WeightMat& W, const uint32_t* Xp, int64_t tpad, int64_t np, int64_t T, int64_t r0, int64_t r1,
               float* Y, int64_t ldy, uint32_t* scratch) {
  const int64_t n = W.cols, nkp = np / 2;
  // BF16 rows are read in place: a row of odd length has no whole last pair, so such rows
  // (rare; never in K3) take the decoded path too.
  const bool direct = W.fmt == WFormat::BF16 && n % 2 == 0;
  const int64_t R = T <= 24 ? 12 : 6;
  alignas(64) float out[kTokRowsMax * 64];
  const uint32_t* w[kTokRowsMax];
  const uint32_t* pf[kTokRowsMax];
  auto row = [&](int64_t r) {
    return reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(W.data) + 2 * r * n);
  };
  for (int64_t r = r0; r < r1; r += R) {
    const int64_t nr = r1 - r < R ? r1 - r : R;
    for (int64_t i = 0; i < nr; ++i) {
      if (direct) {
        w[i] = row(r + i);
        pf[i] = row(r + R + i < r1 ? r + R + i : r + i);
      } else {  // decoded to bf16 pairs, zero beyond the row's columns
        uint32_t* dst = scratch + i * nkp;
        for (int64_t b = 0; b < np / 32; ++b) _mm512_store_si512(dst + 16 * b, pairs_of(W, r + i, b));
        w[i] = pf[i] = dst;
      }
    }
    for (int64_t i = nr; i < R; ++i) w[i] = pf[i] = w[0];  // a short last tile: rows computed, not stored
    for (int64_t t = 0; t < T; t += 64) {
      const int64_t nt = T - t < 64 ? T - t : 64;
      if (R == 12)
        tok_tiles<12, 1>(nt, w, pf, Xp + t, tpad, direct ? n / 2 : nkp, out);
      else
        tok_tiles<6, 3>(nt, w, pf, Xp + t, tpad, direct ? n / 2 : nkp, out);
      for (int64_t j = 0; j < nt; ++j)
        for (int64_t i = 0; i < nr; ++i) Y[(t + j) * ldy + r + i] = out[i * 64 + j];
    }
  }
}

// ------------------------------------------------------------------ GEMM bf16 on AMX tiles (fast)
// The Amx level's gemm_bf16, same contract as gemm_bf16 above. C = rows x tokens: the weights are
// the A tiles (16 rows x 16 pairs from a panel of 32 rows as bf16 pairs, zero beyond the rows and
// columns), the packed activations are the B tiles as pack_x_bf16 leaves them (pair kp of 16 tokens
// at Xp + kp * tpad: 64 bytes, one tile row per pair),
// and tdpbf16ps adds each output's products pair by pair in column order into its fp32 accumulator.
// An output reads only its own row and token, so it does not depend on T, the other tokens or
// [r0, r1). A block is 32 rows x 32 tokens: 4 accumulator tiles and 2 + 2 operand tiles.
struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void amx_tiles_on() {
  TileConfig c;
  __builtin_memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// A stored 16 x 16 accumulator tile c (rows x tokens) into Y, the outputs inside nr x nt; transposed
// in registers, so token j's outputs are one masked 64-byte store.
inline void amx_store(const float* c, int64_t nr, int64_t nt, float* Y, int64_t ldy) {
  __m512i v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(c + 16 * i);
  transpose16(v);
  const __mmask16 m = tail16(nr);
  for (int64_t j = 0; j < nt; ++j) _mm512_mask_storeu_ps(Y + j * ldy, m, _mm512_castsi512_ps(v[j]));
}

void gemm_bf16_amx(const WeightMat& W, const uint32_t* Xp, int64_t tpad, int64_t np, int64_t T, int64_t r0,
                   int64_t r1, float* Y, int64_t ldy, uint32_t* scratch) {
  if (T <= 0 || r1 <= r0) return;
  amx_tiles_on();
  const int64_t nkp = np / 2, nk = np / 32, t16 = (T + 15) / 16 * 16;
  const int64_t xs = 4 * tpad;  // bytes from one pair's 16 tokens to the next pair's
  alignas(64) float c[4][256];
  for (int64_t r = r0; r < r1; r += 32) {
    const int64_t nr = r1 - r < 32 ? r1 - r : 32;
    // The panel: the 32 rows as bf16 pairs (MXFP4 decoded; BF16 copied, which measured faster than
    // reading the rows in place: their stride is often a multiple of 4 KiB, so the 16 rows of a tile
    // load share L1 sets; the panel's stride is one cache line more), zero rows past r1.
    const int64_t ps = nkp + 16;
    for (int64_t i = 0; i < 32; ++i)
      for (int64_t b = 0; b < nk; ++b)
        _mm512_store_si512(scratch + i * ps + 16 * b, i < nr ? pairs_of(W, r + i, b) : _mm512_setzero_si512());
    const uint8_t* a0 = reinterpret_cast<const uint8_t*>(scratch);
    const uint8_t* a1 = a0 + 64 * ps;
    const int64_t as = 4 * ps;  // bytes from one panel row to the next
    for (int64_t t = 0; t < t16; t += 32) {
      const bool two = t + 16 < t16;  // a second 16-token tile
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint8_t* x = reinterpret_cast<const uint8_t*>(Xp + t);
      for (int64_t k = 0; k < nk; ++k) {
        _tile_loadd(4, a0 + 64 * k, as);
        _tile_loadd(5, a1 + 64 * k, as);
        _tile_loadd(6, x + 16 * k * xs, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, x + 16 * k * xs + 64, xs);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      const int64_t nt0 = T - t < 16 ? T - t : 16;
      float* y = Y + t * ldy + r;
      amx_store(c[0], nr < 16 ? nr : 16, nt0, y, ldy);
      if (nr > 16) amx_store(c[1], nr - 16, nt0, y + 16, ldy);
      if (two) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        const int64_t nt1 = T - t - 16 < 16 ? T - t - 16 : 16;
        amx_store(c[2], nr < 16 ? nr : 16, nt1, y + 16 * ldy, ldy);
        if (nr > 16) amx_store(c[3], nr - 16, nt1, y + 16 * ldy + 16, ldy);
      }
    }
  }
  _tile_release();
}

constexpr int kDenseTile = 8;     // rows per dense GEMV tile (32 zmm registers hold 16 accumulators)
#include "ops/cpu/gemm_rows.inc"  // gemv_dense, gemv_mxfp4, gemv, gemm_f32 over the kernels above

// ------------------------------------------------------------------ GEMV of several inputs
// M inputs through the same R dense rows: every output (row i, input j) gets exactly the operations
// gemv_rows gives it alone (the same head/body/tail split, the same two accumulators, the same
// final sum), so each input's result is bit-identical to its own GEMV, while each 64-byte weight
// load serves all M inputs. The inputs are read from L1 per row (R * M accumulators fill the
// registers: R = 2, M = 4 is 16 of 32).
template <WFormat F, int R, int M>
inline void gemv_rows_multi(const uint8_t* const* p, const float* const* x, const float* const* xp, int64_t n,
                            float* const* y, int64_t pf) {
  __m512 a[R][M], b[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) a[i][j] = b[i][j] = _mm512_setzero_ps();
  int64_t c = 0;
  const int64_t h = F == WFormat::BF16 && xp[0] ? bf16_head(p[0], n) : -1;
  if (h >= 0) {
    for (int64_t c0 = 0; c0 < h; c0 += 16) {
      const __mmask16 m = tail16(h - c0);
      for (int i = 0; i < R; ++i) {
        const __m512 w = load16<F>(p[i], c0, m);
        for (int j = 0; j < M; ++j) b[i][j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x[j] + c0), b[i][j]);
      }
    }
    const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
    for (c = h; c + 32 <= n; c += 32) {
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + 2 * c), _MM_HINT_T1);
        const __m512i v = _mm512_load_si512(p[i] + 2 * c);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        for (int j = 0; j < M; ++j) {
          a[i][j] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xp[j] + (c - h)), a[i][j]);
          b[i][j] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xp[j] + (c - h) + 16), b[i][j]);
        }
      }
    }
  } else {
    for (; c + 32 <= n; c += 32) {
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(p[i] + pf + esize(F) * c), _MM_HINT_T1);
        const __m512 w0 = load16<F>(p[i], c), w1 = load16<F>(p[i], c + 16);
        for (int j = 0; j < M; ++j) {
          a[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + c), a[i][j]);
          b[i][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + c + 16), b[i][j]);
        }
      }
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 m = tail16(n - c);
    for (int i = 0; i < R; ++i) {
      const __m512 w = load16<F>(p[i], c, m);
      for (int j = 0; j < M; ++j) a[i][j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x[j] + c), a[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) y[j][i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][j], b[i][j]));
}

template <WFormat F, int R>
void gemv_multi_tile(const uint8_t* const* p, const float* const* x, const float* const* xp, int64_t T, int64_t n,
                     float* Y, int64_t ldy, int64_t r, int64_t pf) {
  for (int64_t t = 0; t < T; t += 4) {
    float* y[4];
    const int64_t m = T - t < 4 ? T - t : 4;
    for (int64_t j = 0; j < m; ++j) y[j] = Y + (t + j) * ldy + r;
    switch (m) {
      case 4:
        gemv_rows_multi<F, R, 4>(p, x + t, xp + t, n, y, pf);
        break;
      case 3:
        gemv_rows_multi<F, R, 3>(p, x + t, xp + t, n, y, pf);
        break;
      case 2:
        gemv_rows_multi<F, R, 2>(p, x + t, xp + t, n, y, pf);
        break;
      default:
        gemv_rows_multi<F, R, 1>(p, x + t, xp + t, n, y, pf);
        break;
    }
  }
}

template <WFormat F>
void gemv_multi_dense(const WeightMat& W, const float* const* x, const float* const* xp, int64_t T, int64_t r0,
                      int64_t r1, float* Y, int64_t ldy) {
  const int64_t n = W.cols, rb = n * esize(F);
  const uint8_t* base = static_cast<const uint8_t*>(W.data);
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {
    const uint8_t* p[2] = {base + r * rb, base + (r + 1) * rb};
    gemv_multi_tile<F, 2>(p, x, xp, T, n, Y, ldy, r, 4 * rb);
  }
  if (r < r1) {
    const uint8_t* p[1] = {base + r * rb};
    gemv_multi_tile<F, 1>(p, x, xp, T, n, Y, ldy, r, 2 * rb);
  }
}

void gemv_multi(const WeightMat& W, const float* const* x, const float* const* xp, int64_t T, int64_t r0, int64_t r1,
                float* Y, int64_t ldy) {
  switch (W.fmt) {
    case WFormat::F32:
      return gemv_multi_dense<WFormat::F32>(W, x, xp, T, r0, r1, Y, ldy);
    case WFormat::F16:
      return gemv_multi_dense<WFormat::F16>(W, x, xp, T, r0, r1, Y, ldy);
    case WFormat::BF16:
      return gemv_multi_dense<WFormat::BF16>(W, x, xp, T, r0, r1, Y, ldy);
    case WFormat::MXFP4:
    case WFormat::FP8:
      break;  // the driver never passes MXFP4 or FP8 here
  }
}

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

double flops_probe_amx(int64_t iters) {
  // Four accumulator tiles, each tdpbf16ps 16 x 16 outputs x 16 pairs; a quarter of the calls of the
  // vdpbf16ps probe's iterations (each does 16 times the work of its 12 vector products).
  amx_tiles_on();
  alignas(64) uint16_t one[16 * 32];
  for (uint16_t& v : one) v = 0x3c00;  // bf16 2^-7
  _tile_loadd(4, one, 64);
  _tile_loadd(5, one, 64);
  _tile_loadd(6, one, 64);
  _tile_loadd(7, one, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t n = iters / 4 > 0 ? iters / 4 : 1;
  for (int64_t it = 0; it < n; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[256];
  _tile_stored(0, c, 64);
  _tile_release();
  return double(n) * 4 * 16 * 16 * 32 * 2 + (c[0] == 12345.0f ? 1 : 0);
}

}  // namespace

// (gemm_bf16: 48-row chunks, whole 6- and 12-row tiles; gemm_bf16_amx: 64, two 32-row groups)
const GemmKernels kGemm = {gemv,          true,        gemm_f32,   pack_x_bf16, gemm_bf16,
                           gemv_mxfp4_q8, quantize_q8, read_probe, flops_probe, gemv_multi,
                           48};
const GemmKernels kGemmAmx = {gemv,          true,        gemm_f32,   pack_x_bf16,     gemm_bf16_amx,
                              gemv_mxfp4_q8, quantize_q8, read_probe, flops_probe_amx, gemv_multi,
                              64};

}  // namespace k3::ops::cpu::avx512
