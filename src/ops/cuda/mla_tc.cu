// MLA prefill attention on the tensor cores (cuda_ops.h mla_attend_tc_paged): the `fast` numerics'
// kernel for prefill pieces over a paged latent cache. The same function as k3::ref::mla_attend_expanded
// on the expanded keys and values (tests/cuda/test_cuda_varlen.cpp holds it to the fp64 twin).
// Must not: sync or allocate (the caller lends the workspace).
//
// Per sequence, the cache is taken in chunks of key_chunk keys:
//   1. gather: the chunk's latents c [kn, kv_lora] and rope keys k_r [kn, rope] from their pages, to bf16;
//   2. expand: [k_nope | v] [kn, heads·(nope + v)] = c · kv_bᵀ (cuBLAS, bf16 in and out, fp32 sums);
//   3. attend: one block per 64 query rows and head (4 warps × 16 rows), the key tiles of 64 in a
//      double-buffered cp.async pipeline: S = Q·Kᵀ on mma.sync (Q = [q_nope | q_rope] · scale·log2 e in
//      bf16 registers, K = [k_nope | k_r] rows in shared memory), the online softmax in fp32 registers
//      (FlashAttention-2), P·V with P rounded to bf16 from the score accumulators. A row's running
//      output, max and sum carry over to the next chunk in `out` and the workspace; the chunk holding
//      the row's own position writes its normalised output.
// Causality: a query at absolute position p sees keys 0..p; key tiles past the block's last query are
// never loaded, and a block whose rows all end before the chunk returns at once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/varlen.cuh"

namespace k3::cuda {

namespace {

constexpr int kBM = 64;        // query rows per block
constexpr int kBN = 64;        // keys per tile
constexpr int kWarps = 4;      // 16 query rows each
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

template <int DQ, int DV>
struct Cfg {
  static_assert(DQ % 16 == 0 && DV % 16 == 0, "head widths in whole MMA tiles");
  static constexpr int ldk = DQ + 8, ldv = DV + 8;  // bf16 row strides (16-byte rows, fewer bank conflicts)
  static constexpr int tile_elems = kBN * (ldk + ldv);
  static constexpr size_t smem = size_t(2) * tile_elems * 2;  // two stages
};

struct TcArgs {
  const float* q;      // [T, heads, DQ] the sequence's rows
  const uint16_t* kv;  // [kn, heads, nope + v] bf16 (row stride ldkv)
  const uint16_t* kr;  // [kn, rope] bf16
  float* out;          // [T, heads, DV]
  float* ml;           // [T, heads, 2] running max (log2 units) and sum between chunks
  int64_t T, pos0, k0, ldkv;
  int kn, heads, nope, rope;
  float qscale;  // softmax scale · log2 e
};

// 1. The chunk's latents and rope keys, bf16, token-major; a key whose page is outside the pool or
// past its table reads NaN (loud, as the absorbed kernel).
__global__ void __launch_bounds__(256) mla_tc_gather_kernel(PagedCacheDev c, const int32_t* __restrict__ bt, int64_t k0,
                                                            int kn, int L, int R, uint16_t* __restrict__ lat,
                                                            uint16_t* __restrict__ kr) {
  const int key = blockIdx.x * 8 + int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  if (key >= kn) return;
  const float* row = paged_row(c, bt, k0 + key, L + R);
  for (int i = lane; i < L + R; i += 32) {
    const float x = row ? row[i] : __int_as_float(0x7fc00000);
    const uint16_t b = to_bf16_bits(x);
    if (i < L)
      lat[int64_t(key) * L + i] = b;
    else
      kr[int64_t(key) * R + (i - L)] = b;
  }
}

// One tile of keys [kb, kb + 64) of the chunk into shared memory: K rows [k_nope | k_r] and V rows;
// keys at or past key_end are zeros (their scores are masked, and 0 · 0 stays finite).
template <int DQ, int DV>
__device__ __forceinline__ void load_tile(uint16_t* sK, uint16_t* sV, const TcArgs& a, int h, int kb, int key_end) {
  using C = Cfg<DQ, DV>;
  constexpr int kc8 = DQ / 8, vc8 = DV / 8;
  const int64_t head_off = int64_t(h) * (a.nope + DV);
  for (int i = int(threadIdx.x); i < kBN * kc8; i += kThreads) {
    const int r = i / kc8, col = (i - r * kc8) * 8, key = kb + r;
    uint16_t* dst = sK + r * C::ldk + col;
    if (key < key_end) {
      const uint16_t* src = col < a.nope ? a.kv + int64_t(key) * a.ldkv + head_off + col
                                         : a.kr + int64_t(key) * a.rope + (col - a.nope);
      cp_async16(dst, src);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  for (int i = int(threadIdx.x); i < kBN * vc8; i += kThreads) {
    const int r = i / vc8, col = (i - r * vc8) * 8, key = kb + r;
    uint16_t* dst = sV + r * C::ldv + col;
    if (key < key_end)
      cp_async16(dst, a.kv + int64_t(key) * a.ldkv + head_off + a.nope + col);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// 3. Grid (query tiles, heads).
template <int DQ, int DV>
__global__ void __launch_bounds__(kThreads, 2) mla_tc_attend_kernel(TcArgs a) {
  using C = Cfg<DQ, DV>;
  extern __shared__ __align__(16) uint16_t smem[];
  const int h = int(blockIdx.y), warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int g = lane >> 2, t = lane & 3;
  const int64_t r0 = int64_t(blockIdx.x) * kBM;
  const int64_t last_row = r0 + kBM - 1 < a.T - 1 ? r0 + kBM - 1 : a.T - 1;
  const int64_t p_first = a.pos0 + r0, p_last = a.pos0 + last_row;
  if (p_last < a.k0) return;  // every row of the block ended before this chunk
  const int key_end = int(a.kn < p_last - a.k0 + 1 ? int64_t(a.kn) : p_last - a.k0 + 1);
  const int n_tiles = (key_end + kBN - 1) / kBN;

  // This thread's two rows (g and g + 8 of the warp's 16) and their positions (-1: no row).
  int64_t row[2];
  int64_t pos[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    row[x] = r0 + warp * 16 + g + 8 * x;
    pos[x] = row[x] < a.T ? a.pos0 + row[x] : -1;
  }
  // Q fragments, pre-scaled into log2 units.
  uint32_t qf[DQ / 16][4];
#pragma unroll
  for (int kk = 0; kk < DQ / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int x = e & 1, col = kk * 16 + 2 * t + ((e >> 1) << 3);
      float2 v = make_float2(0.0f, 0.0f);
      if (pos[x] >= 0) v = *reinterpret_cast<const float2*>(a.q + (row[x] * a.heads + h) * DQ + col);
      qf[kk][e] = pack_bf16x2(v.x * a.qscale, v.y * a.qscale);
    }
  // The running state: carried in from the previous chunk for rows that continue into this one.
  float o[DV / 8][4];
  float m[2], l[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const bool carry = a.k0 > 0 && pos[x] >= a.k0;
    const int64_t base = row[x] * a.heads + h;
    m[x] = carry ? a.ml[base * 2] : -INFINITY;
    l[x] = carry && t == 0 ? a.ml[base * 2 + 1] : 0.0f;  // the sum lives in one lane until the end
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt) {
      float2 v = make_float2(0.0f, 0.0f);
      if (carry) v = *reinterpret_cast<const float2*>(a.out + base * DV + nt * 8 + 2 * t);
      o[nt][2 * x] = v.x;
      o[nt][2 * x + 1] = v.y;
    }
  }

  load_tile<DQ, DV>(smem, smem + kBN * C::ldk, a, h, 0, key_end);
  cp_async_commit();
  for (int j = 0; j < n_tiles; ++j) {
    uint16_t* sK = smem + (j & 1) * C::tile_elems;  // stage j % 2
    uint16_t* sV = sK + kBN * C::ldk;
    if (j + 1 < n_tiles) {
      uint16_t* nK = smem + ((j + 1) & 1) * C::tile_elems;
      load_tile<DQ, DV>(nK, nK + kBN * C::ldk, a, h, (j + 1) * kBN, key_end);
    }
    cp_async_commit();
    cp_async_wait_group<1>();
    __syncthreads();

    float s[kBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DQ / 16; ++kk)
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
        uint32_t b[2];
        frag_b(b, sK, C::ldk, nt * 8, kk * 16, lane);
        mma_bf16(s[nt], qf[kk], b);
      }
    const int kb = j * kBN;
    if (kb + kBN > key_end || a.k0 + kb + kBN - 1 > p_first) {  // causal edge or the chunk's end
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kb + nt * 8 + 2 * t + (e & 1);
          if (key >= key_end || a.k0 + key > pos[e >> 1]) s[nt][e] = -INFINITY;
        }
    }
    // Online softmax per row (x = 0: accumulator elements 0, 1; x = 1: 2, 3).
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * x], s[nt][2 * x + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[x], mx);
      const float ref = mn == -INFINITY ? 0.0f : mn;  // a row with no key yet: every p is 0
      const float alpha = exp2f(m[x] - ref);
      m[x] = mn;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
        s[nt][2 * x] = exp2f(s[nt][2 * x] - ref);
        s[nt][2 * x + 1] = exp2f(s[nt][2 * x + 1] - ref);
        sum += s[nt][2 * x] + s[nt][2 * x + 1];
      }
      l[x] = l[x] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        o[nt][2 * x] *= alpha;
        o[nt][2 * x + 1] *= alpha;
      }
    }
    // O += P · V: the score accumulators of key n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      mma_row_kmajor<DV / 8>(o, pa, sV, C::ldv, 0, kk * 16, lane);
    }
    __syncthreads();  // the stage is refilled by the next iteration's prefetch
  }
  cp_async_wait_all();

#pragma unroll
  for (int x = 0; x < 2; ++x) {
    float lt = l[x];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    if (pos[x] < a.k0) continue;  // no row, or a row that ended in an earlier chunk
    const int64_t base = row[x] * a.heads + h;
    const bool last = pos[x] < a.k0 + a.kn;  // the chunk holding the row's own key
    const float inv = last ? 1.0f / lt : 1.0f;
#pragma unroll
    for (int nt = 0; nt < DV / 8; ++nt)
      *reinterpret_cast<float2*>(a.out + base * DV + nt * 8 + 2 * t) =
          make_float2(o[nt][2 * x] * inv, o[nt][2 * x + 1] * inv);
    if (!last && t == 0) {
      a.ml[base * 2] = m[x];
      a.ml[base * 2 + 1] = lt;
    }
  }
}

template <int DQ, int DV>
void launch_attend(const TcArgs& a, Stream s) {
  using C = Cfg<DQ, DV>;
  static bool configured = false;  // per instantiation; the attribute is per device function
  if (!configured) {
    if (cudaFuncSetAttribute(mla_tc_attend_kernel<DQ, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(C::smem)) != cudaSuccess)
      fail("mla_attend_tc_paged: this GPU cannot give " + std::to_string(C::smem) + " bytes of shared memory a block");
    configured = true;
  }
  const dim3 grid(unsigned((a.T + kBM - 1) / kBM), unsigned(a.heads));
  mla_tc_attend_kernel<DQ, DV><<<grid, kThreads, C::smem, s>>>(a);
}

void check_tc(const WeightMat& kv_b, const MlaAttnDims& d, int64_t key_chunk) {
  if (!mla_tc_supported(d))
    fail("mla_attend_tc_paged: head widths nope " + std::to_string(d.nope) + " + rope " + std::to_string(d.rope) +
         ", v " + std::to_string(d.v) + " are not compiled for the tensor-core kernel");
  if (kv_b.rows != d.heads * (d.nope + d.v) || kv_b.cols != d.kv_lora)
    fail("mla_attend_tc_paged: kv_b is " + std::to_string(kv_b.rows) + "x" + std::to_string(kv_b.cols) +
         ", expected " + std::to_string(d.heads * (d.nope + d.v)) + "x" + std::to_string(d.kv_lora));
  if (!mla_tc_weight_ok(kv_b)) fail("mla_attend_tc_paged: kv_b must be a 16-byte aligned BF16 view");
  if (key_chunk < kBN || key_chunk % kBN != 0 || key_chunk > (int64_t(1) << 24))
    fail("mla_attend_tc_paged: key_chunk " + std::to_string(key_chunk) + " is not a multiple of 64 in 64..2^24");
  if (d.heads > 65535) fail("mla_attend_tc_paged: more than 65535 heads");
}

}  // namespace

bool mla_tc_weight_ok(const WeightMat& kv_b) {
  return kv_b.fmt == WFormat::BF16 && reinterpret_cast<uintptr_t>(kv_b.data) % 16 == 0 && kv_b.rows % 8 == 0 &&
         kv_b.cols % 8 == 0;
}

void mla_attend_tc_paged(const float* q, const VarlenDev& b, const PagedCacheDev& c, const int32_t* cu_rows_host,
                         const int64_t* pos0_host, const uint8_t* use, const WeightMat& kv_b, const MlaAttnDims& d,
                         int64_t key_chunk, void* work, float* out, Stream s) {
  check_varlen("mla_attend_tc_paged", b, false);
  check_paged("mla_attend_tc_paged", c);
  check_tc(kv_b, d, key_chunk);
  if (b.rows <= 0) return;
  if (cu_rows_host == nullptr || pos0_host == nullptr || work == nullptr)
    fail("mla_attend_tc_paged: cu_rows_host, pos0_host and work are required");
  const int64_t L = d.kv_lora, R = d.rope, dq = d.nope + d.rope, per = d.nope + d.v, kc = key_chunk;
  auto* base = static_cast<char*>(work);
  auto* lat = reinterpret_cast<uint16_t*>(base);
  base += mla_tc_part_bytes(uint64_t(kc * L) * 2);
  auto* kr = reinterpret_cast<uint16_t*>(base);
  base += mla_tc_part_bytes(uint64_t(kc * R) * 2);
  auto* kv = reinterpret_cast<uint16_t*>(base);
  base += mla_tc_part_bytes(uint64_t(kc * d.heads * per) * 2);
  auto* ml = reinterpret_cast<float*>(base);
  for (int64_t i = 0; i < b.n_seqs; ++i) {
    const int64_t r0 = cu_rows_host[i], T = cu_rows_host[i + 1] - r0;
    if (T <= 0 || (use != nullptr && !use[i])) continue;
    const int64_t pos0 = pos0_host[i], S = pos0 + T;
    if (pos0 < 0 || S > c.max_pages * c.page_tokens)
      fail("mla_attend_tc_paged: sequence " + std::to_string(i) + " reaches position " + std::to_string(S) +
           ", past its block table (" + std::to_string(c.max_pages * c.page_tokens) + ")");
    const int32_t* bt = c.block_table + i * c.max_pages;
    TcArgs a{};
    a.q = q + r0 * d.heads * dq;
    a.kv = kv;
    a.kr = kr;
    a.out = out + r0 * d.heads * d.v;
    a.ml = ml;
    a.T = T;
    a.pos0 = pos0;
    a.ldkv = d.heads * per;
    a.heads = int(d.heads);
    a.nope = int(d.nope);
    a.rope = int(R);
    a.qscale = d.scale * kLog2e;
    for (int64_t k0 = 0; k0 < S; k0 += kc) {
      const int kn = int(std::min(kc, S - k0));
      mla_tc_gather_kernel<<<unsigned((kn + 7) / 8), 256, 0, s>>>(c, bt, k0, kn, int(L), int(R), lat, kr);
      check_launch("mla_attend_tc_paged (gather)");
      matmul_bf16_out(kv_b, lat, kn, kv, s);
      a.k0 = k0;
      a.kn = kn;
      if (dq == 192)
        launch_attend<192, 128>(a, s);
      else if (dq == 96)
        launch_attend<96, 64>(a, s);
      else
        launch_attend<48, 64>(a, s);
      check_launch("mla_attend_tc_paged (attend)");
    }
  }
}

}  // namespace k3::cuda
