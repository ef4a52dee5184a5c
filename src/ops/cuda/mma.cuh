// bf16 tensor-core pieces shared by the CUDA kernels that use mma.sync (gemm.cu's MXFP4 GEMM,
// kda_tc.cu's chunked KDA): bf16 packing, the m16n8k16 MMA, fragment loads from shared memory
// and asynchronous 16-byte copies into it.
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): lane = 4·g + t (g = lane/4, t = lane%4);
//   A (16×16, row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16×8, k × n):       b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C (16×8, fp32):        c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// Must not: be included by host-only code (it is CUDA source).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {
namespace {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}
__device__ __forceinline__ uint16_t to_bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// c += a · b (bf16 operands, fp32 accumulation).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The A fragment of the 16×16 tile at (row r0, column k0) of a row-major bf16 array with row stride
// ld (elements, even; ld/2 ≡ 4 mod 32 words keeps the loads conflict-free).
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const uint16_t* base, int ld, int r0, int k0, int lane) {
  const uint16_t* p = base + (r0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
  a[0] = *reinterpret_cast<const uint32_t*>(p);
  a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * ld);
  a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * ld + 8);
}
// The B fragment of the 16×8 (k × n) tile at (k0, n0) of an array stored n-major: base[n·ld + k].
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const uint16_t* base, int ld, int n0, int k0, int lane) {
  const uint16_t* p = base + (n0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
  b[0] = *reinterpret_cast<const uint32_t*>(p);
  b[1] = *reinterpret_cast<const uint32_t*>(p + 8);
}

// Four 8 × 8 bf16 matrices from shared memory, transposed (ldmatrix .trans): lanes 8j..8j+7 give
// the 16-byte row addresses of matrix j, and register j receives that matrix's (rows 2t, 2t+1;
// column g) pair. Rows 16-byte aligned.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
// The A fragment of the 16×16 tile at (m0, k0) of a matrix stored k-major: base[k·ld + m]
// (ld·2 bytes and m0 multiples of 16 bytes / 8 elements).
__device__ __forceinline__ void frag_a_kmajor(uint32_t (&a)[4], const uint16_t* base, int ld, int m0, int k0,
                                              int lane) {
  const int j = lane >> 3, r = lane & 7;
  ldsm_x4_trans(a, base + (k0 + r + ((j >> 1) << 3)) * ld + m0 + ((j & 1) << 3));
}
// The B fragments of the two 16×8 (k × n) tiles at (k0, n0) and (k0, n0 + 8) of a matrix stored
// k-major: base[k·ld + n].
__device__ __forceinline__ void frag_b2_kmajor(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* base, int ld,
                                               int n0, int k0, int lane) {
  const int j = lane >> 3, r = lane & 7;
  uint32_t t[4];
  ldsm_x4_trans(t, base + (k0 + r + ((j & 1) << 3)) * ld + n0 + ((j >> 1) << 3));
  b0[0] = t[0];
  b0[1] = t[1];
  b1[0] = t[2];
  b1[1] = t[3];
}

// acc[nt] += a · B[k0..k0+15][n0 + 8nt ..] for the NT (even) n-tiles of one row block, B stored
// k-major (base[k·ld + n]).
template <int NT>
__device__ __forceinline__ void mma_row_kmajor(float (&acc)[NT][4], const uint32_t (&a)[4], const uint16_t* base,
                                               int ld, int n0, int k0, int lane) {
  static_assert(NT % 2 == 0, "n-tiles in pairs");
#pragma unroll
  for (int nt = 0; nt < NT; nt += 2) {
    uint32_t b0[2], b1[2];
    frag_b2_kmajor(b0, b1, base, ld, n0 + 8 * nt, k0, lane);
    mma_bf16(acc[nt], a, b0);
    mma_bf16(acc[nt + 1], a, b1);
  }
}

// 16 bytes global -> shared without passing through registers (both 16-byte aligned).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Until at most N of this thread's newest commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace
}  // namespace k3::cuda
