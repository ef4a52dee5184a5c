// CUDA elementwise ops, norms, embedding, argmax and the AttnRes mix (cuda_ops.h): each one has the
// meaning of its CPU twin in ops/ops.h (k3::ref is what the device tests compare against).
// Owns: rmsnorm, l2norm_scale, situ_glu, short_conv_silu (+ its varlen form), kda_gate, sigmoid_*, add_inplace,
// embed_rows, argmax_rows, attnres_mix, residual_norm, moe_tail.
// Must not: sync, allocate, or read host memory at run time (decode steps are captured as graphs).
// Launches: programmatic dependent launch on created streams (launch() below; graph-safe).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "ops/cuda/act.cuh"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/varlen.cuh"

namespace k3::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kEwThreads = 256;

// Grid for a grid-stride loop over n elements: enough blocks to fill the GPU, never more than n needs.
unsigned ew_blocks(int64_t n) {
  const int64_t b = (n + kEwThreads - 1) / kEwThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(b, 132 * 16)));
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A lane's fp64 sum of squares of its RC float4s, in order (the 16-byte norm paths).
template <int RC>
__device__ __forceinline__ double sumsq_f4(const float4 (&v)[RC]) {
  double ss = 0;
#pragma unroll
  for (int c = 0; c < RC; ++c) {
    ss = fma(double(v[c].x), double(v[c].x), ss);
    ss = fma(double(v[c].y), double(v[c].y), ss);
    ss = fma(double(v[c].z), double(v[c].z), ss);
    ss = fma(double(v[c].w), double(v[c].w), ss);
  }
  return ss;
}

// row[lane + 32c] = v[c] · f for the lane's float4s inside the row's nv.
template <int RC>
__device__ __forceinline__ void store_scaled_f4(float4* row, const float4 (&v)[RC], int lane, int nv, float f) {
#pragma unroll
  for (int c = 0; c < RC; ++c) {
    const int i = lane + 32 * c;
    if (i < nv) row[i] = make_float4(v[c].x * f, v[c].y * f, v[c].z * f, v[c].w * f);
  }
}

// Sum of one double per thread over the block (blockDim.x a multiple of 32, <= 1024); every thread
// gets the total. `red` holds 32 doubles of shared scratch; the leading sync protects its reuse.
__device__ double block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double t = lane < nw ? red[lane] : 0.0;
  return warp_sum(t);
}


// ---------------------------------------------------------------- rmsnorm / l2norm
// Sums of squares in fp64 (as the CPU kernels) so the scale factor is correctly rounded; the
// products themselves stay fp32 in the CPU order w·(x·inv). out may alias x: every element is read
// and written by the same thread, the write after the block/warp reduction.
// L2 (l2 = true): x ← x · scale/sqrt(Σx² + eps) (w ignored, out == x).
template <bool L2>
__global__ void norm_rows_warp(const float* x, int64_t rows, int64_t n, const float* w, float eps, float scale,
                               float* out) {
  pdl_enter();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const float* xr = x + r * n;
  double ss = 0;
  for (int64_t i = lane; i < n; i += 32) ss += double(xr[i]) * double(xr[i]);
  ss = warp_sum(ss);
  float* orow = out + r * n;
  if (L2) {
    const float f = float(double(scale) / sqrt(ss + double(eps)));
    for (int64_t i = lane; i < n; i += 32) orow[i] = xr[i] * f;
  } else {
    const float inv = float(1.0 / sqrt(ss / double(n) + double(eps)));
    for (int64_t i = lane; i < n; i += 32) orow[i] = w ? w[i] * (xr[i] * inv) : xr[i] * inv;
  }
}

template <bool L2>
__global__ void norm_rows_block(const float* x, int64_t rows, int64_t n, const float* w, float eps, float scale,
                                float* out) {
  pdl_enter();
  __shared__ double red[32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * n;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += double(xr[i]) * double(xr[i]);
  ss = block_sum(ss, red);
  float* orow = out + r * n;
  if (L2) {
    const float f = float(double(scale) / sqrt(ss + double(eps)));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * f;
  } else {
    const float inv = float(1.0 / sqrt(ss / double(n) + double(eps)));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = w ? w[i] * (xr[i] * inv) : xr[i] * inv;
  }
}

// 16-byte paths (n % 4 == 0, x/w/out 16-byte aligned): every float4 of the row a thread owns is
// loaded once into registers (all loads issued before the first use), so a row costs one memory
// latency, then the reduction, then the stores. Same per-element math as above; only the order of
// the fp64 partial sums differs.
// Warp per row, RC float4 per lane (n <= 128·RC); 4 rows per 128-thread block. GATE (RMSNorm only):
// then × σ(gate) of the same element (gate [rows, n]), the sigmoid_gate_mul kernel's math.
template <bool L2, int RC, bool GATE = false>
__global__ void __launch_bounds__(128)
    norm_rows_warp_vec(const float* x, int64_t rows, int64_t n, const float* w, float eps, float scale, float* out,
                       const float* gate = nullptr) {
  pdl_enter();
  const int64_t r = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31, nv = int(n / 4);
  const float4* xr = reinterpret_cast<const float4*>(x + r * n);
  float4 v[RC], wv[RC];
#pragma unroll
  for (int c = 0; c < RC; ++c) {
    const int i = lane + 32 * c;
    v[c] = wv[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < nv) v[c] = xr[i];
    if (!L2 && w && i < nv) wv[c] = reinterpret_cast<const float4*>(w)[i];
  }
  const double ss = warp_sum(sumsq_f4<RC>(v));
  float4* orow = reinterpret_cast<float4*>(out + r * n);
  if (L2) {
    store_scaled_f4<RC>(orow, v, lane, nv, float(double(scale) / sqrt(ss + double(eps))));
  } else {
    const float inv = float(1.0 / sqrt(ss / double(n) + double(eps)));
#pragma unroll
    for (int c = 0; c < RC; ++c) {
      const int i = lane + 32 * c;
      if (i >= nv) continue;
      const float4 a = v[c];
      float4 o =
          w ? make_float4(wv[c].x * (a.x * inv), wv[c].y * (a.y * inv), wv[c].z * (a.z * inv), wv[c].w * (a.w * inv))
            : make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
      if constexpr (GATE) {
        const float4 g = reinterpret_cast<const float4*>(gate + r * n)[i];
        o = make_float4(o.x * sigmoidf_(g.x), o.y * sigmoidf_(g.y), o.z * sigmoidf_(g.z), o.w * sigmoidf_(g.w));
      }
      orow[i] = o;
    }
  }
}

// Block per row, at most 2 float4 per thread (n <= 8192 with 1024 threads): row r of the block's
// norm (norm_rows_block_vec; moe_tail_kernel's first blocks).
template <bool L2>
__device__ __forceinline__ void norm_row_block_vec(const float* x, int64_t n, const float* w, float eps, float scale,
                                                   float* out, int64_t r) {
  __shared__ double red[32];
  const int nv = int(n / 4), tid = threadIdx.x, nt = blockDim.x;
  const float4* xr = reinterpret_cast<const float4*>(x + r * n);
  const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4 v0 = tid < nv ? xr[tid] : z, v1 = tid + nt < nv ? xr[tid + nt] : z;
  float4 w0 = z, w1 = z;
  if (!L2 && w) {
    if (tid < nv) w0 = reinterpret_cast<const float4*>(w)[tid];
    if (tid + nt < nv) w1 = reinterpret_cast<const float4*>(w)[tid + nt];
  }
  double ss = 0;
  ss = fma(double(v0.x), double(v0.x), ss);
  ss = fma(double(v0.y), double(v0.y), ss);
  ss = fma(double(v0.z), double(v0.z), ss);
  ss = fma(double(v0.w), double(v0.w), ss);
  ss = fma(double(v1.x), double(v1.x), ss);
  ss = fma(double(v1.y), double(v1.y), ss);
  ss = fma(double(v1.z), double(v1.z), ss);
  ss = fma(double(v1.w), double(v1.w), ss);
  ss = block_sum(ss, red);
  float4* orow = reinterpret_cast<float4*>(out + r * n);
  const auto put = [&](int i, const float4& a, const float4& wa) {
    if (i >= nv) return;
    if (L2) {
      const float f = float(double(scale) / sqrt(ss + double(eps)));
      orow[i] = make_float4(a.x * f, a.y * f, a.z * f, a.w * f);
    } else {
      const float inv = float(1.0 / sqrt(ss / double(n) + double(eps)));
      orow[i] = w ? make_float4(wa.x * (a.x * inv), wa.y * (a.y * inv), wa.z * (a.z * inv), wa.w * (a.w * inv))
                  : make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    }
  };
  put(tid, v0, w0);
  put(tid + nt, v1, w1);
}

template <bool L2>
__global__ void __launch_bounds__(1024)
    norm_rows_block_vec(const float* x, int64_t n, const float* w, float eps, float scale, float* out) {
  pdl_enter();
  norm_row_block_vec<L2>(x, n, w, eps, scale, out, blockIdx.x);
}

// The block-per-row norm's thread count for rows of n (n % 4 == 0, n <= 8192).
int norm_block_threads(int64_t n) {
  const int64_t nv = n / 4;
  return int(std::min<int64_t>(1024, std::max<int64_t>(64, ((nv + 1) / 2 + 31) / 32 * 32)));
}

// Short rows (KDA heads of 128, LoRA latents of 512): a warp per row; long rows (the 7168-wide
// hidden state): a block per row, sized so that each thread owns at most two float4.
template <bool L2>
void launch_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps, float scale, float* out, Stream s,
                 const char* name) {
  if (rows <= 0 || n <= 0) return;
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = n % 4 == 0 && al16(x) && al16(out) && (L2 || !w || al16(w));
  if (vec && n <= 512) {
    const unsigned blocks = unsigned((rows + 3) / 4);
    if (n <= 128)
      launch(norm_rows_warp_vec<L2, 1>, blocks, 128, 0, s, x, rows, n, w, eps, scale, out, nullptr);
    else if (n <= 256)
      launch(norm_rows_warp_vec<L2, 2>, blocks, 128, 0, s, x, rows, n, w, eps, scale, out, nullptr);
    else
      launch(norm_rows_warp_vec<L2, 4>, blocks, 128, 0, s, x, rows, n, w, eps, scale, out, nullptr);
  } else if (vec && n <= 8192) {
    launch(norm_rows_block_vec<L2>, unsigned(rows), norm_block_threads(n), 0, s, x, n, w, eps, scale, out);
  } else if (n <= 1024) {
    const int64_t per = kEwThreads / 32;
    launch(norm_rows_warp<L2>, unsigned((rows + per - 1) / per), kEwThreads, 0, s, x, rows, n, w, eps, scale, out);
  } else {
    launch(norm_rows_block<L2>, unsigned(rows), 512, 0, s, x, rows, n, w, eps, scale, out);
  }
  check_launch(name);
}

// ---------------------------------------------------------------- elementwise
// Elements i0, i0 + stride, ... of the SiTU GLU (each element alone: any grid gives the same bits).
__device__ __forceinline__ void situ_glu_elems(const float* g, const float* u, int64_t n, float b1, float b2, float* out,
                                               int64_t i0, int64_t stride) {
  for (int64_t i = i0; i < n; i += stride) {
    const float gi = g[i], ui = u[i];  // read both before the write: out may alias g
    out[i] = situ_glu_value(gi, ui, b1, b2);
  }
}

__global__ void situ_glu_kernel(const float* g, const float* u, int64_t n, float b1, float b2, float* out) {
  pdl_enter();
  situ_glu_elems(g, u, n, b1, b2, out, int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int64_t(gridDim.x) * blockDim.x);
}

// The MoE tail (moe_tail): blocks 0 .. rows-1 are the latent RMSNorm's rows (in place, block per row,
// norm_rows_block_vec's code and thread count), the others the shared experts' SiTU GLU (g <- situ(g, u)).
// Two independent ops in one launch; each gives the bits of its own kernel.
__global__ void __launch_bounds__(1024) moe_tail_kernel(float* agg, int64_t rows, int64_t n, const float* w, float eps,
                                                        float* g, const float* u, int64_t n_situ, float b1, float b2) {
  pdl_enter();
  if (int64_t(blockIdx.x) < rows) return norm_row_block_vec<false>(agg, n, w, eps, 1.0f, agg, blockIdx.x);
  const int64_t b = int64_t(blockIdx.x) - rows, nb = int64_t(gridDim.x) - rows;
  situ_glu_elems(g, u, n_situ, b1, b2, g, b * blockDim.x + threadIdx.x, nb * blockDim.x);
}

// The decay gate of one channel: lb·σ(exp(A_log)·(f + dt_bias)) (K3), or for lb == 0 the unbounded
// −exp(A_log)·softplus(f + dt_bias) (Kimi Linear).
__device__ __forceinline__ float kda_gate_value(float f, float A_log, float dt_bias, float lb) {
  const float a = expf(A_log), x = f + dt_bias;
  return lb != 0.0f ? lb * sigmoidf_(a * x) : -a * (x > 20.0f ? x : log1pf(expf(x)));
}

__global__ void kda_gate_kernel(const float* f, int64_t T, int64_t H, int64_t D, const float* A_log,
                                const float* dt_bias, float lb, float* g) {
  pdl_enter();
  const int64_t n = T * H * D, HD = H * D;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t hd = i % HD, h = hd / D;
    g[i] = kda_gate_value(f[i], A_log[h], dt_bias[hd], lb);
  }
}

__global__ void sigmoid_kernel(float* x, int64_t n) {
  pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = sigmoidf_(x[i]);
}

__global__ void sigmoid_gate_mul_kernel(float* x, const float* gate, int64_t n) {
  pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = x[i] * sigmoidf_(gate[i]);
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = y[i] + x[i];
}

// ---------------------------------------------------------------- short conv + SiLU
// Thread = (channel c, tile of kConvTile tokens). The K-1 inputs before the tile come from x or,
// for the first tile, from the carried state. kConvTile >= K-1 means only tile 0 ever reads the old
// state, so tile 0 (which has read it into registers first) is the one that writes the new state:
// no other thread reads it, no race, and the result does not depend on the tiling.
constexpr int kConvTile = 32;
constexpr int kConvMaxK = 16;

// The tile starting at token t0 of one sequence of T tokens (x, out at its first token; its state),
// channel c. Shared by the single-sequence and the varlen kernels, so both compute the same bits.
template <int KT>  // KT > 0: K known at compile time (registers); KT == 0: any K <= 16
__device__ __forceinline__ void short_conv_tile(const float* x, int64_t T, int64_t C, const float* w, int Krt,
                                                float* state, float* out, int64_t c, int64_t t0) {
  const int K = KT > 0 ? KT : Krt;
  const int64_t t1 = t0 + kConvTile < T ? t0 + kConvTile : T;
  constexpr int NW = KT > 0 ? KT : kConvMaxK;
  float win[NW], wc[NW], old[NW];
  for (int j = 0; j < K; ++j) wc[j] = w[c * K + j];
  if (t0 == 0)
    for (int j = 0; j < K - 1; ++j) old[j] = state[c * (K - 1) + j];
  // win[0 .. K-2] = inputs at positions t0-(K-1) .. t0-1 of [state | x].
  for (int j = 0; j < K - 1; ++j) {
    const int64_t idx = t0 - (K - 1) + j;
    win[j] = idx < 0 ? old[K - 1 + idx] : x[idx * C + c];
  }
  for (int64_t t = t0; t < t1; ++t) {
    win[K - 1] = x[t * C + c];
    float acc = wc[0] * win[0];
    for (int j = 1; j < K; ++j) acc = fmaf(wc[j], win[j], acc);
    out[t * C + c] = acc * sigmoidf_(acc);
    for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
  }
  if (t0 == 0)
    for (int j = 0; j < K - 1; ++j) {
      const int64_t idx = T + j - (K - 1);  // position T + j of [state | x], as an index into x
      state[c * (K - 1) + j] = idx < 0 ? old[K - 1 + idx] : x[idx * C + c];
    }
}

template <int KT>
__global__ void short_conv_kernel(const float* x, int64_t T, int64_t C, const float* w, int Krt, float* state,
                                  float* out) {
  pdl_enter();
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  short_conv_tile<KT>(x, T, C, w, Krt, state, out, c, int64_t(blockIdx.y) * kConvTile);
}

// Varlen: the tiles of every sequence in one grid whose size depends only on (rows, n_seqs).
// Sequence i owns the virtual tiles [v_i, v_{i+1}) with v_i = floor(cu_rows[i]/32) + i: that range
// holds at least ceil(T_i/32) tiles (floor(r_{i+1}/32) - floor(r_i/32) + 1 >= ceil(T_i/32)), and the
// last v_n = floor(rows/32) + n_seqs bounds the grid. Blocks past a sequence's last tile exit.
template <int KT>
__global__ void short_conv_varlen_kernel(const float* x, const int32_t* cu_rows, const int32_t* slots, int n_seqs,
                                         int n_slots, int64_t C, const float* w, int Krt, float* state_pool,
                                         float* out) {
  pdl_enter();
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t vt = blockIdx.y;
  const int i = last_le(
      n_seqs, [cu_rows](int j) { return int64_t(cu_rows[j] / kConvTile) + j; }, vt);
  const int64_t r0 = cu_rows[i], T = cu_rows[i + 1] - r0;
  const int64_t t0 = (vt - (r0 / kConvTile + i)) * kConvTile;
  if (t0 > 0 && t0 >= T) return;  // tile 0 always runs: with T = 0 it rewrites the state unchanged
  const int slot = slots[i];
  if (slot < 0 || slot >= n_slots) {  // a bad slot: never touched, the outputs loud
    for (int64_t t = t0; t < T && t < t0 + kConvTile; ++t) out[(r0 + t) * C + c] = __int_as_float(0x7fc00000);
    return;
  }
  const int K = KT > 0 ? KT : Krt;
  short_conv_tile<KT>(x + r0 * C, T, C, w, Krt, state_pool + int64_t(slot) * C * (K - 1), out + r0 * C, c, t0);
}

// ---------------------------------------------------------------- KDA decode inputs, fused
// One warp per (row, head) of decode rows (row i = sequence i, one token each); lane owns channels
// h·D + 4·(lane + 32·c) .. + 3 (c < RC): short conv + SiLU of q, k, v from the carried state
// (short_conv_tile, as short_conv_varlen_kernel), then the L2 norms of q (× q_scale) and k in
// norm_rows_warp_vec<true, RC>'s order, the decay gate (kda_gate_value) and, lane 0, β = σ(b):
// the bits of the seven separate kernels, in one launch.
template <int KT, int RC>
__global__ void __launch_bounds__(128) kda_prepare_decode_kernel(KdaPrepDev a, const int32_t* slots, int64_t n_slots,
                                                                 int64_t rows) {
  pdl_enter();
  const int64_t gw = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (gw >= rows * a.H) return;
  const int64_t row = gw / a.H, h = gw % a.H, C = a.C, D = a.D;
  const int lane = threadIdx.x & 31, nv = int(D / 4);
  const int K = KT > 0 ? KT : a.K;
  const int slot = slots[row];
  const bool bad = slot < 0 || slot >= n_slots;
  for (int m = 0; m < 3; ++m)
#pragma unroll
    for (int c = 0; c < RC; ++c) {
      const int i = lane + 32 * c;
      if (i >= nv) continue;
      for (int e = 0; e < 4; ++e) {
        const int64_t ch = h * D + 4 * i + e;
        if (bad)
          a.out[m][row * C + ch] = __int_as_float(0x7fc00000);
        else
          short_conv_tile<KT>(a.in[m] + row * C, 1, C, a.w[m], K, a.state[m] + int64_t(slot) * C * (K - 1),
                              a.out[m] + row * C, ch, 0);
      }
    }
  for (int m = 0; m < 2; ++m) {  // q, k: L2 norm over the head (this lane's values just written by it)
    float4* hv = reinterpret_cast<float4*>(a.out[m] + row * C + h * D);
    float4 v[RC];
#pragma unroll
    for (int c = 0; c < RC; ++c) {
      const int i = lane + 32 * c;
      v[c] = i < nv ? hv[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const double ss = warp_sum(sumsq_f4<RC>(v));
    store_scaled_f4<RC>(hv, v, lane, nv, float(double(m == 0 ? a.q_scale : 1.0f) / sqrt(ss + double(a.eps))));
  }
  const float Ah = a.A_log[h];
  for (int i = lane; i < D; i += 32) {
    const int64_t ch = h * D + i;
    a.g[row * C + ch] = kda_gate_value(a.f[row * C + ch], Ah, a.dt_bias[ch], a.lb);
  }
  if (lane == 0) a.beta[row * a.H + h] = sigmoidf_(a.beta[row * a.H + h]);
}

// ---------------------------------------------------------------- embedding / argmax
template <int FMT>  // 0 F32, 1 F16, 2 BF16
__device__ __forceinline__ float load_w(const void* p, int64_t i) {
  if constexpr (FMT == 0) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (FMT == 1) {
    return __half2float(static_cast<const __half*>(p)[i]);
  } else {
    const unsigned short b = static_cast<const unsigned short*>(p)[i];
    return __uint_as_float(uint32_t(b) << 16);
  }
}

template <int FMT>
__global__ void embed_kernel(const void* E, int64_t rows, int64_t cols, const int32_t* ids, float* out) {
  pdl_enter();
  const int64_t t = blockIdx.y;
  const int32_t id = ids[t];
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x)
    // An id outside the vocabulary cannot be reported from here without a sync: NaN makes it loud.
    out[t * cols + c] = (id >= 0 && id < rows) ? load_w<FMT>(E, int64_t(id) * cols + c) : __int_as_float(0x7fc00000);
}

__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  // Larger wins; equal values keep the lower index; NaN never wins.
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

__global__ void argmax_kernel(const float* logits, int64_t V, bool vec4, int32_t* out) {
  pdl_enter();
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = logits + int64_t(blockIdx.x) * V;
  float bv = -INFINITY;
  int bi = INT_MAX;
  if (vec4) {  // 16-byte loads, 4 in flight per thread: one SM streams a 160k vocabulary row
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int64_t n4 = V / 4;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
      const float4 v = r4[i];
      const int b = int(i * 4);
      better(bv, bi, v.x, b);
      better(bv, bi, v.y, b + 1);
      better(bv, bi, v.z, b + 2);
      better(bv, bi, v.w, b + 3);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) better(bv, bi, row[i], int(i));
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    bv = lane < nw ? sv[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : INT_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      better(bv, bi, ov, oi);
    }
    if (lane == 0) out[blockIdx.x] = bi == INT_MAX ? 0 : bi;  // all-NaN row: 0 rather than garbage
  }
}

// ---------------------------------------------------------------- AttnRes mix
struct SrcList {
  const float* p[kMaxAttnResSources];
};

// Both AttnRes kernels: this thread's fp64 partial <x_j, fold> and <x_j, x_j> over the vectors
// i = first, first + stride, ... < last of token t, summed over the warp; lane 0 leaves the warp's
// sums in red[warp][2j] and red[warp][2j + 1]. The caller syncs before reading red.
template <int NS, int VEC>
__device__ __forceinline__ void mix_partials(const SrcList& src, int n_src, int64_t t, int64_t H, const float* fold,
                                             int64_t first, int64_t last, int64_t stride, int lane, int warp,
                                             double (*red)[2 * NS]) {
  using VT = typename std::conditional<VEC == 4, float4, float>::type;
  double dt[NS], ss[NS];
#pragma unroll
  for (int j = 0; j < NS; ++j) dt[j] = ss[j] = 0.0;
  for (int64_t i = first; i < last; i += stride) {
    const VT f = reinterpret_cast<const VT*>(fold)[i];
#pragma unroll
    for (int j = 0; j < NS; ++j)
      if (j < n_src) {
        const VT v = reinterpret_cast<const VT*>(src.p[j] + t * H)[i];
        if constexpr (VEC == 4) {
          dt[j] = fma(double(v.x), double(f.x), dt[j]);
          dt[j] = fma(double(v.y), double(f.y), dt[j]);
          dt[j] = fma(double(v.z), double(f.z), dt[j]);
          dt[j] = fma(double(v.w), double(f.w), dt[j]);
          ss[j] = fma(double(v.x), double(v.x), ss[j]);
          ss[j] = fma(double(v.y), double(v.y), ss[j]);
          ss[j] = fma(double(v.z), double(v.z), ss[j]);
          ss[j] = fma(double(v.w), double(v.w), ss[j]);
        } else {
          dt[j] = fma(double(v), double(f), dt[j]);
          ss[j] = fma(double(v), double(v), ss[j]);
        }
      }
  }
#pragma unroll
  for (int j = 0; j < NS; ++j)
    if (j < n_src) {
      double a = dt[j], b = ss[j];
      for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
      }
      if (lane == 0) {
        red[warp][2 * j] = a;
        red[warp][2 * j + 1] = b;
      }
    }
}

// Warp 0 of both AttnRes kernels: lane j < n_src holds source j's block-wide sums a = <x_j, fold>,
// b = <x_j, x_j>; writes the fp64 softmax over the scores a / rms into p[0, n_src).
__device__ __forceinline__ void mix_softmax(int lane, int n_src, double a, double b, int64_t H, float eps, float* p) {
  const double sc = lane < n_src ? a / sqrt(b / double(H) + double(eps)) : -INFINITY;
  double mx = sc;
  for (int o = 16; o > 0; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const double e = lane < n_src ? exp(sc - mx) : 0.0;
  double z = e;
  for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  if (lane < n_src) p[lane] = float(e / z);
}

// out[t] over vectors i = first, first + stride, ... < last: Σ_j p[j] · x_j (fp32, in source order).
template <int NS, int VEC>
__device__ __forceinline__ void mix_weighted_sum(const SrcList& src, int n_src, int64_t t, int64_t H, const float* p,
                                                 int64_t first, int64_t last, int64_t stride, float* out) {
  using VT = typename std::conditional<VEC == 4, float4, float>::type;
  for (int64_t i = first; i < last; i += stride) {
    VT acc = reinterpret_cast<const VT*>(src.p[0] + t * H)[i];
    if constexpr (VEC == 4) {
      acc.x *= p[0];
      acc.y *= p[0];
      acc.z *= p[0];
      acc.w *= p[0];
    } else {
      acc *= p[0];
    }
#pragma unroll
    for (int j = 1; j < NS; ++j)
      if (j < n_src) {
        const VT v = reinterpret_cast<const VT*>(src.p[j] + t * H)[i];
        if constexpr (VEC == 4) {
          acc.x = fmaf(p[j], v.x, acc.x);
          acc.y = fmaf(p[j], v.y, acc.y);
          acc.z = fmaf(p[j], v.z, acc.z);
          acc.w = fmaf(p[j], v.w, acc.w);
        } else {
          acc = fmaf(p[j], v, acc);
        }
      }
    reinterpret_cast<VT*>(out + t * H)[i] = acc;
  }
}

// The block-per-token kernels' mix weights p[0, n_src) of token t: the block's partial dots and sums
// of squares, then warp 0 (lane j sums source j over the warps) does the fp64 softmax across the
// lanes. Ends with a block barrier: p is ready.
template <int NS, int VEC, int THREADS>
__device__ __forceinline__ void mix_block_weights(const SrcList& src, int n_src, int64_t t, int64_t H,
                                                  const float* fold, float eps, double (*red)[2 * NS], float* p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  mix_partials<NS, VEC>(src, n_src, t, H, fold, threadIdx.x, H / VEC, THREADS, lane, warp, red);
  __syncthreads();
  if (warp == 0) {
    double a = 0, b = 0;
    if (lane < n_src)
      for (int w = 0; w < THREADS / 32; ++w) {
        a += red[w][2 * lane];
        b += red[w][2 * lane + 1];
      }
    mix_softmax(lane, n_src, a, b, H, eps, p);
  }
  __syncthreads();
}

// Larger T (prefill): one block per token, one pass over the sources for every score: each thread
// keeps fp64 partial dots and sums of squares of its elements per source (registers: NS source
// slots, unrolled), the block sums them, warp 0 does the fp64 softmax (as the CPU kernel), then the
// fp32 weighted sum of the RAW sources in source order. VEC = 4: 16-byte loads.
template <int NS, int VEC, int THREADS>  // source slots: n_src <= NS
__global__ void __launch_bounds__(THREADS)
    attnres_kernel(SrcList src, int n_src, int64_t H, const float* fold, float eps, float* out) {
  pdl_enter();
  __shared__ double red[THREADS / 32][2 * NS];
  __shared__ float p[NS];
  const int64_t t = blockIdx.x;
  mix_block_weights<NS, VEC, THREADS>(src, n_src, t, H, fold, eps, red, p);
  mix_weighted_sum<NS, VEC>(src, n_src, t, H, p, threadIdx.x, H / VEC, THREADS, out);
}

// Small T (decode): one cluster of kMixCluster blocks per token, block r owning the r-th
// contiguous slice of the hidden dimension, so the sources are streamed by 8 SMs instead of one.
// Each block reduces its slice's fp64 partial dots and sums of squares (fixed order) into its own
// shared memory; after one cluster barrier every block reads the 8 partials through distributed
// shared memory and sums them in rank order (the same bits in every block, no atomics), does the
// fp64 softmax, and writes the fp32 weighted sum of its slice (the same per-element math as above).
// The second cluster barrier also keeps every block's partials alive until all have read them.
constexpr int kMixCluster = 8, kMixThreads = 128;
constexpr int64_t kMixClusterMaxT = 64;

// The cluster kernels' mix weights p[0, n_src) of token t: each block's partial dots over its slice
// [i0, i1) into `part`, a cluster barrier, then warp 0 sums the blocks' partials in rank order and
// does the softmax. The caller syncs before reading p, and keeps `part` alive with a later cluster
// barrier until every block has read it.
template <int NS, int VEC>
__device__ __forceinline__ void mix_cluster_weights(cg::cluster_group& cluster, const SrcList& src, int n_src,
                                                    int64_t t, int64_t H, const float* fold, float eps, int64_t i0,
                                                    int64_t i1, double (*red)[2 * NS], double* part, float* p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  mix_partials<NS, VEC>(src, n_src, t, H, fold, i0 + threadIdx.x, i1, kMixThreads, lane, warp, red);
  __syncthreads();
  if (int(threadIdx.x) < 2 * n_src) {
    double a = 0;
    for (int w = 0; w < kMixThreads / 32; ++w) a += red[w][threadIdx.x];
    part[threadIdx.x] = a;
  }
  cluster.sync();
  if (warp == 0) {
    double a = 0, b = 0;
    if (lane < n_src)
      for (int r = 0; r < kMixCluster; ++r) {
        const double* rp = cluster.map_shared_rank(part, r);
        a += rp[2 * lane];
        b += rp[2 * lane + 1];
      }
    mix_softmax(lane, n_src, a, b, H, eps, p);
  }
}

template <int NS, int VEC>
__global__ void __cluster_dims__(kMixCluster, 1, 1) __launch_bounds__(kMixThreads)
    attnres_cluster_kernel(SrcList src, int n_src, int64_t H, const float* fold, float eps, float* out) {
  pdl_enter();
  __shared__ double red[kMixThreads / 32][2 * NS];
  __shared__ double part[2 * NS];
  __shared__ float p[NS];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t t = blockIdx.y, nv = H / VEC, chunk = (nv + kMixCluster - 1) / kMixCluster;
  const int64_t i0 = rank * chunk, i1 = i0 + chunk < nv ? i0 + chunk : nv;
  mix_cluster_weights<NS, VEC>(cluster, src, n_src, t, H, fold, eps, i0, i1, red, part, p);
  cluster.sync();  // p is ready, and every block has read the others' `part`
  mix_weighted_sum<NS, VEC>(src, n_src, t, H, p, i0 + threadIdx.x, i1, kMixThreads, out);
}

template <int NS>
void launch_attnres(const SrcList& l, int n, int64_t T, int64_t H, const float* fold, float eps, float* out, bool vec,
                    Stream s) {
  // 32 fp64 slot pairs need the register room of 256-thread blocks.
  constexpr int TH = NS <= 16 ? 512 : 256;
  if (T <= kMixClusterMaxT) {
    const dim3 grid(kMixCluster, unsigned(T));
    if (vec)
      launch(attnres_cluster_kernel<NS, 4>, grid, kMixThreads, 0, s, l, n, H, fold, eps, out);
    else
      launch(attnres_cluster_kernel<NS, 1>, grid, kMixThreads, 0, s, l, n, H, fold, eps, out);
  } else if (vec)
    launch(attnres_kernel<NS, 4, TH>, unsigned(T), TH, 0, s, l, n, H, fold, eps, out);
  else
    launch(attnres_kernel<NS, 1, TH>, unsigned(T), TH, 0, s, l, n, H, fold, eps, out);
}

// ---------------------------------------------------------------- residual site
// Backend::residual_norm in one kernel: the pending sublayer output enters the partial sum (the add
// kernel's math, partial = partial + y, or partial = y; with a second part y2, y + y2 is added: the
// add kernel's y + y2 first, as the MoE did), the AttnRes mix above over the blocks and the
// new partial sum (MIX = false: a = the partial sum), then RMSNorm of a (the norm kernels' math:
// fp64 sum of squares, inv = 1/sqrt(ss/H + eps) rounded to fp32, w·(a·inv)). Each thread owns the
// same vectors i = first, first + stride, ... in every phase, so it reads back only what it wrote
// itself (the new partial sum, then the mix in xn) and no barrier is needed between those.
struct ResidualArgs {
  SrcList src;  // the blocks, then the partial sum (src.p[n_src - 1] == partial)
  int n_src;
  int64_t H;
  const float* fold;
  float mix_eps;
  float* partial;
  const float* y;   // null: nothing to add
  const float* y2;  // null, or y's second part
  int y_replaces;
  const float* w;
  float norm_eps;
  float* xn;
};

// a + b per element (the add kernel's math: a on the left).
__device__ __forceinline__ float vsum(float a, float b) { return a + b; }
__device__ __forceinline__ float4 vsum(const float4& a, const float4& b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <int VEC>
__device__ __forceinline__ void residual_take(const ResidualArgs& a, int64_t t, int64_t first, int64_t last,
                                              int64_t stride) {
  if (!a.y) return;
  using VT = typename std::conditional<VEC == 4, float4, float>::type;
  VT* p = reinterpret_cast<VT*>(a.partial + t * a.H);
  const VT* y = reinterpret_cast<const VT*>(a.y + t * a.H);
  const VT* y2 = a.y2 ? reinterpret_cast<const VT*>(a.y2 + t * a.H) : nullptr;
  for (int64_t i = first; i < last; i += stride) {
    VT v = y[i];
    if (y2) v = vsum(v, y2[i]);
    if (!a.y_replaces) v = vsum(p[i], v);
    p[i] = v;
  }
}

// This thread's fp64 sum of squares of row[i] over its vectors.
template <int VEC>
__device__ __forceinline__ double residual_sumsq(const float* row, int64_t first, int64_t last, int64_t stride) {
  double ss = 0;
  if constexpr (VEC == 4) {
    for (int64_t i = first; i < last; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(row)[i];
      ss = fma(double(v.x), double(v.x), ss);
      ss = fma(double(v.y), double(v.y), ss);
      ss = fma(double(v.z), double(v.z), ss);
      ss = fma(double(v.w), double(v.w), ss);
    }
  } else {
    for (int64_t i = first; i < last; i += stride) ss = fma(double(row[i]), double(row[i]), ss);
  }
  return ss;
}

// out[i] = w[i]·(x[i]·inv) over this thread's vectors (x may be out).
template <int VEC>
__device__ __forceinline__ void residual_scale(const float* x, const float* w, float inv, float* out, int64_t first,
                                               int64_t last, int64_t stride) {
  if constexpr (VEC == 4) {
    for (int64_t i = first; i < last; i += stride) {
      const float4 a = reinterpret_cast<const float4*>(x)[i], b = reinterpret_cast<const float4*>(w)[i];
      reinterpret_cast<float4*>(out)[i] = make_float4(b.x * (a.x * inv), b.y * (a.y * inv), b.z * (a.z * inv),
                                                      b.w * (a.w * inv));
    }
  } else {
    for (int64_t i = first; i < last; i += stride) out[i] = w[i] * (x[i] * inv);
  }
}

// Larger T: one block per token (as attnres_kernel).
template <int NS, int VEC, int THREADS, bool MIX>
__global__ void __launch_bounds__(THREADS) residual_norm_kernel(ResidualArgs a) {
  pdl_enter();
  __shared__ double red[THREADS / 32][2 * NS];
  __shared__ double nred[32];
  __shared__ float p[NS];
  const int64_t t = blockIdx.x, nv = a.H / VEC;
  residual_take<VEC>(a, t, threadIdx.x, nv, THREADS);
  if constexpr (MIX) {
    mix_block_weights<NS, VEC, THREADS>(a.src, a.n_src, t, a.H, a.fold, a.mix_eps, red, p);
    mix_weighted_sum<NS, VEC>(a.src, a.n_src, t, a.H, p, threadIdx.x, nv, THREADS, a.xn);
  }
  const float* x = (MIX ? a.xn : a.partial) + t * a.H;
  const double ss = block_sum(residual_sumsq<VEC>(x, threadIdx.x, nv, THREADS), nred);
  const float inv = float(1.0 / sqrt(ss / double(a.H) + double(a.norm_eps)));
  residual_scale<VEC>(x, a.w, inv, a.xn + t * a.H, threadIdx.x, nv, THREADS);
}

// Small T (decode): one cluster per token, as attnres_cluster_kernel; the norm's sum of squares is
// reduced over the cluster the same way (each block's partial, then every block sums them in rank order).
template <int NS, int VEC, bool MIX>
__global__ void __cluster_dims__(kMixCluster, 1, 1) __launch_bounds__(kMixThreads)
    residual_norm_cluster_kernel(ResidualArgs a) {
  pdl_enter();
  __shared__ double red[kMixThreads / 32][2 * NS];
  __shared__ double part[2 * NS];
  __shared__ double nred[32];
  __shared__ double npart, ntotal;
  __shared__ float p[NS];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t t = blockIdx.y, nv = a.H / VEC, chunk = (nv + kMixCluster - 1) / kMixCluster;
  const int64_t i0 = rank * chunk, i1 = i0 + chunk < nv ? i0 + chunk : nv;
  residual_take<VEC>(a, t, i0 + threadIdx.x, i1, kMixThreads);
  if constexpr (MIX) {
    mix_cluster_weights<NS, VEC>(cluster, a.src, a.n_src, t, a.H, a.fold, a.mix_eps, i0, i1, red, part, p);
    __syncthreads();  // p is ready (`part` stays alive until the norm's cluster barrier below)
    mix_weighted_sum<NS, VEC>(a.src, a.n_src, t, a.H, p, i0 + threadIdx.x, i1, kMixThreads, a.xn);
  }
  const float* x = (MIX ? a.xn : a.partial) + t * a.H;
  const double ss = block_sum(residual_sumsq<VEC>(x, i0 + threadIdx.x, i1, kMixThreads), nred);
  if (threadIdx.x == 0) npart = ss;
  // (also: every block has read the others' `part` before any block can leave)
  cluster.sync();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int r = 0; r < kMixCluster; ++r) s += *cluster.map_shared_rank(&npart, r);
    ntotal = s;
  }
  // every block has read the others' `npart`; ntotal is visible to the block
  cluster.sync();
  const float inv = float(1.0 / sqrt(ntotal / double(a.H) + double(a.norm_eps)));
  residual_scale<VEC>(x, a.w, inv, a.xn + t * a.H, i0 + threadIdx.x, i1, kMixThreads);
}

template <int NS, bool MIX>
void launch_residual(const ResidualArgs& a, int64_t T, bool vec, Stream s) {
  constexpr int TH = NS <= 16 ? 512 : 256;
  // A cluster spreads the block mix's reads over several SMs; a plain residual + norm of a few rows
  // is one block's work, where the cluster's two barriers added latency (5.3 us a site on the H100 at
  // H = 2304, docs/data/kl-full-e128-h100-2026-12-05b-kernels.md).
  if (MIX && T <= kMixClusterMaxT) {
    const dim3 grid(kMixCluster, unsigned(T));
    if (vec)
      launch(residual_norm_cluster_kernel<NS, 4, MIX>, grid, kMixThreads, 0, s, a);
    else
      launch(residual_norm_cluster_kernel<NS, 1, MIX>, grid, kMixThreads, 0, s, a);
  } else if (vec) {
    launch(residual_norm_kernel<NS, 4, TH, MIX>, unsigned(T), TH, 0, s, a);
  } else {
    launch(residual_norm_kernel<NS, 1, TH, MIX>, unsigned(T), TH, 0, s, a);
  }
}

// Calls f(std::integral_constant<int, KT>) with the conv kernels' compile-time width for K (0: any).
template <class F>
void with_conv_width(int64_t K, F&& f) {
  switch (K) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 0>{});
      break;
  }
}

void check_conv_width(const char* what, int64_t K) {
  if (K < 1 || K > kConvMaxK)
    fail(std::string(what) + ": kernel width " + std::to_string(K) + " outside 1.." + std::to_string(kConvMaxK));
}

}  // namespace

// ================================================================ host API
void rmsnorm(const float* x, int64_t T, int64_t n, const float* w, float eps, float* out, Stream s) {
  launch_norm<false>(x, T, n, w, eps, 1.0f, out, s, "rmsnorm");
}

void rmsnorm_gate(const float* x, int64_t rows, int64_t n, const float* w, float eps, const float* gate, float* out,
                  Stream s) {
  if (rows <= 0 || n <= 0) return;
  if (gate == out && x != out) fail("rmsnorm_gate: the gate must not be the output");
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!(n % 4 == 0 && n <= 512 && al16(x) && al16(out) && al16(gate) && (!w || al16(w)))) {
    rmsnorm(x, rows, n, w, eps, out, s);  // (other shapes: the two kernels)
    return sigmoid_gate_mul(out, gate, rows * n, s);
  }
  const unsigned blocks = unsigned((rows + 3) / 4);
  if (n <= 128)
    launch(norm_rows_warp_vec<false, 1, true>, blocks, 128, 0, s, x, rows, n, w, eps, 1.0f, out, gate);
  else if (n <= 256)
    launch(norm_rows_warp_vec<false, 2, true>, blocks, 128, 0, s, x, rows, n, w, eps, 1.0f, out, gate);
  else
    launch(norm_rows_warp_vec<false, 4, true>, blocks, 128, 0, s, x, rows, n, w, eps, 1.0f, out, gate);
  check_launch("rmsnorm_gate");
}

void moe_tail(float* agg, int64_t rows, int64_t n, const float* w, float eps, float* g, const float* u, int64_t n_situ,
              float b1, float b2, Stream s) {
  if (rows < 0 || n_situ < 0) fail("moe_tail: negative sizes");
  const bool norm = rows > 0 && n > 0;
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!norm || n_situ == 0 || !(n % 4 == 0 && n <= 8192 && al16(agg) && (!w || al16(w))) ||
      n_situ > int64_t(INT32_MAX)) {  // (one of them, or shapes the fused kernel does not take: the two kernels)
    if (norm) rmsnorm(agg, rows, n, w, eps, agg, s);
    return situ_glu(g, u, n_situ, b1, b2, g, s);
  }
  if (rows > 65535) fail("moe_tail: more than 65535 rows");
  const int threads = norm_block_threads(n);
  const int64_t situ_blocks = std::min<int64_t>((n_situ + threads - 1) / threads, 2048);
  launch(moe_tail_kernel, unsigned(rows + situ_blocks), threads, 0, s, agg, rows, n, w, eps, g, u, n_situ, b1, b2);
  check_launch("moe_tail");
}

void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale, Stream s) {
  launch_norm<true>(x, rows, n, nullptr, eps, scale, x, s, "l2norm_scale");
}

void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out, Stream s) {
  if (n <= 0) return;
  launch(situ_glu_kernel, ew_blocks(n), kEwThreads, 0, s, g, u, n, b1, b2, out);
  check_launch("situ_glu");
}

void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* out,
                     Stream s) {
  check_conv_width("short_conv_silu", K);
  if (T <= 0 || C <= 0) return;
  const dim3 grid(unsigned((C + 127) / 128), unsigned((T + kConvTile - 1) / kConvTile));
  with_conv_width(K, [&](auto kt) {
    launch(short_conv_kernel<decltype(kt)::value>, grid, 128, 0, s, x, T, C, w, int(K), state, out);
  });
  check_launch("short_conv_silu");
}

void short_conv_silu_varlen(const float* x, const VarlenDev& b, int64_t C, const float* w, int64_t K, float* state_pool,
                            float* out, Stream s) {
  check_conv_width("short_conv_silu_varlen", K);
  check_varlen("short_conv_silu_varlen", b, true);
  if (C <= 0 || b.rows <= 0) return;  // no rows: every state stays as it is
  const int64_t tiles = b.rows / kConvTile + b.n_seqs;
  if (tiles > 65535)
    fail("short_conv_silu_varlen: " + std::to_string(b.rows) + " rows of " + std::to_string(b.n_seqs) +
         " sequences exceed the kernel's grid (65535 tiles)");
  const dim3 grid(unsigned((C + 127) / 128), unsigned(tiles));
  with_conv_width(K, [&](auto kt) {
    launch(short_conv_varlen_kernel<decltype(kt)::value>, grid, 128, 0, s, x, b.cu_rows, b.slots, int(b.n_seqs),
           int(b.n_slots), C, w, int(K), state_pool, out);
  });
  check_launch("short_conv_silu_varlen");
}

void kda_gate(const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
              float lower_bound, float* g, Stream s) {
  const int64_t n = T * H * D;
  if (n <= 0) return;
  launch(kda_gate_kernel, ew_blocks(n), kEwThreads, 0, s, f, T, H, D, A_log, dt_bias, lower_bound, g);
  check_launch("kda_gate");
}

bool kda_prepare_decode_ok(const KdaPrepDev& a) {
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return a.D % 4 == 0 && a.D > 0 && a.D <= 512 && a.C == a.H * a.D && a.K >= 1 && a.K <= kConvMaxK &&
         al16(a.out[0]) && al16(a.out[1]) && (a.C * 4) % 16 == 0;
}

void kda_prepare_decode(const KdaPrepDev& a, const VarlenDev& b, Stream s) {
  check_varlen("kda_prepare_decode", b, true);
  if (b.rows != b.n_seqs) fail("kda_prepare_decode: decode rows only (one row per sequence)");
  if (!kda_prepare_decode_ok(a)) fail("kda_prepare_decode: shapes or alignment the fused kernel does not take");
  if (b.rows <= 0) return;
  const unsigned blocks = unsigned((b.rows * a.H + 3) / 4);
  const auto go = [&](auto rc) {
    constexpr int RC = decltype(rc)::value;
    with_conv_width(a.K, [&](auto kt) {
      launch(kda_prepare_decode_kernel<decltype(kt)::value, RC>, blocks, 128, 0, s, a, b.slots, b.n_slots, b.rows);
    });
  };
  if (a.D <= 128)
    go(std::integral_constant<int, 1>{});
  else if (a.D <= 256)
    go(std::integral_constant<int, 2>{});
  else
    go(std::integral_constant<int, 4>{});
  check_launch("kda_prepare_decode");
}

void sigmoid_inplace(float* x, int64_t n, Stream s) {
  if (n <= 0) return;
  launch(sigmoid_kernel, ew_blocks(n), kEwThreads, 0, s, x, n);
  check_launch("sigmoid_inplace");
}

void sigmoid_gate_mul(float* x, const float* gate, int64_t n, Stream s) {
  if (n <= 0) return;
  launch(sigmoid_gate_mul_kernel, ew_blocks(n), kEwThreads, 0, s, x, gate, n);
  check_launch("sigmoid_gate_mul");
}

void add_inplace(float* y, const float* x, int64_t n, Stream s) {
  if (n <= 0) return;
  launch(add_kernel, ew_blocks(n), kEwThreads, 0, s, y, x, n);
  check_launch("add_inplace");
}

void embed_rows(const WeightMat& E, const int32_t* ids, int64_t T, float* out, Stream s) {
  if (T <= 0) return;
  const dim3 grid(unsigned(std::min<int64_t>((E.cols + kEwThreads - 1) / kEwThreads, 64)), unsigned(T));
  switch (E.fmt) {
    case WFormat::F32:
      launch(embed_kernel<0>, grid, kEwThreads, 0, s, E.data, E.rows, E.cols, ids, out);
      break;
    case WFormat::F16:
      launch(embed_kernel<1>, grid, kEwThreads, 0, s, E.data, E.rows, E.cols, ids, out);
      break;
    case WFormat::BF16:
      launch(embed_kernel<2>, grid, kEwThreads, 0, s, E.data, E.rows, E.cols, ids, out);
      break;
    case WFormat::MXFP4:
    case WFormat::FP8:
      fail(std::string("embed_rows: an ") + wformat_name(E.fmt) +
           " embedding table is not supported on the GPU (F32/F16/BF16 only)");
  }
  check_launch("embed_rows");
}

void argmax_rows(const float* logits, int64_t T, int64_t V, int32_t* out, Stream s) {
  if (T <= 0) return;
  // Row starts are 16-byte aligned when the base is and V is a multiple of 4.
  const bool vec4 = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  launch(argmax_kernel, unsigned(T), 1024, 0, s, logits, V, vec4, out);
  check_launch("argmax_rows");
}

void attnres_mix(const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold, float eps, float* out,
                 Stream s) {
  if (n_src < 1 || n_src > kMaxAttnResSources)
    fail("attnres_mix: " + std::to_string(n_src) + " sources; the GPU kernel takes 1.." +
         std::to_string(kMaxAttnResSources));
  if (T <= 0) return;
  SrcList l{};
  for (int64_t j = 0; j < n_src; ++j) l.p[j] = src[j];
  const int n = int(n_src);
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool vec = H % 4 == 0 && al16(fold) && al16(out);
  for (int64_t j = 0; j < n_src; ++j) vec = vec && al16(src[j]);
  if (n <= 4)
    launch_attnres<4>(l, n, T, H, fold, eps, out, vec, s);
  else if (n <= 8)
    launch_attnres<8>(l, n, T, H, fold, eps, out, vec, s);
  else if (n <= 16)
    launch_attnres<16>(l, n, T, H, fold, eps, out, vec, s);
  else
    launch_attnres<32>(l, n, T, H, fold, eps, out, vec, s);
  check_launch("attnres_mix");
}


void residual_norm(const float* const* blocks, int64_t n_blocks, float* partial, const float* y, const float* y2,
                   bool y_replaces, const float* fold, float mix_eps, const float* norm_w, float norm_eps, int64_t T,
                   int64_t H, float* xn, Stream s) {
  const bool mix = fold != nullptr;
  if (n_blocks < 0 || n_blocks + 1 > kMaxAttnResSources)
    fail("residual_norm: " + std::to_string(n_blocks) + " blocks; the GPU kernel takes 0.." +
         std::to_string(kMaxAttnResSources - 1));
  if (!mix && n_blocks > 0) fail("residual_norm: blocks without the site's scores");
  if (!norm_w) fail("residual_norm: no norm weight");
  if (y == partial || xn == partial || (y && y == xn)) fail("residual_norm: y, partial and xn must not alias");
  if (y2 && (!y || y2 == partial || y2 == xn)) fail("residual_norm: y2 without y, or aliasing partial or xn");
  if (T <= 0 || H <= 0) return;
  if (T > 0x7fffffff) fail("residual_norm: too many rows for the grid");
  ResidualArgs a{};
  for (int64_t j = 0; j < n_blocks; ++j) a.src.p[j] = blocks[j];
  a.src.p[n_blocks] = partial;
  a.n_src = int(n_blocks + 1);
  a.H = H;
  a.fold = fold;
  a.mix_eps = mix_eps;
  a.partial = partial;
  a.y = y;
  a.y2 = y2;
  a.y_replaces = y_replaces ? 1 : 0;
  a.w = norm_w;
  a.norm_eps = norm_eps;
  a.xn = xn;
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool vec = H % 4 == 0 && al16(partial) && al16(norm_w) && al16(xn) && (!y || al16(y)) && (!y2 || al16(y2)) && (!mix || al16(fold));
  for (int64_t j = 0; j < n_blocks; ++j) vec = vec && al16(blocks[j]);
  const int n = a.n_src;
  if (!mix)
    launch_residual<1, false>(a, T, vec, s);
  else if (n <= 4)
    launch_residual<4, true>(a, T, vec, s);
  else if (n <= 8)
    launch_residual<8, true>(a, T, vec, s);
  else if (n <= 16)
    launch_residual<16, true>(a, T, vec, s);
  else
    launch_residual<32, true>(a, T, vec, s);
  check_launch("residual_norm");
}

}  // namespace k3::cuda
