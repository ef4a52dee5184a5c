// Kernels of the K3 forward pass on fp32 activations (CPU implementations, namespace k3::ops).
// Every op has a scalar fp64 twin with the same signature in k3::ref (ops/reference/ref_ops.h);
// tests compare the two. Layouts are row-major; shapes are given as [outer, ..., inner].
// Must not: allocate per call on hot paths beyond small scratch, or know tensor names.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/cpu/isa.h"
#include "ops/weight.h"

namespace k3 {

struct MlaAttnDims {
  int64_t heads = 0, nope = 0, rope = 0, v = 0, kv_lora = 0;
  float scale = 0;  // softmax scale = (nope + rope)^-1/2
};

// The GPU's absorbed paged MLA kernel (ops/cuda/mla.cu), sized here for the same reason. A step's
// rows are split over key ranges until 16 blocks per multiprocessor run (`sms`: the GPU's count);
// its workspace holds q̃ / o_lat [rows, heads, kv_lora], the split partials [slots, heads, kv_lora + 2]
// when there are more slots than rows, and the row / slot plan.
constexpr int64_t kMlaPagedHeadGroup = 16;  // heads per block of the attention kernel (mla.cu's kHG)
inline int64_t paged_mla_slots(int64_t rows, int64_t heads, int64_t sms) {
  const int64_t groups = (heads + kMlaPagedHeadGroup - 1) / kMlaPagedHeadGroup;
  const int64_t want = (16 * sms + groups - 1) / groups;
  return rows > want ? rows : want;
}
inline int64_t paged_mla_work_floats(int64_t rows, const MlaAttnDims& d, int64_t sms) {
  const int64_t slots = paged_mla_slots(rows, d.heads, sms), parts = slots > rows ? slots * d.heads : 0;
  return rows * d.heads * d.kv_lora + parts * (d.kv_lora + 2) + 4 * rows + 2 * slots;
}
// The most any step of 1 .. rows rows takes (fewer rows may take more: their split partials).
inline int64_t paged_mla_work_floats_max(int64_t rows, const MlaAttnDims& d, int64_t sms) {
  int64_t m = 1;
  for (int64_t r = 1; r <= rows; ++r) {
    const int64_t f = paged_mla_work_floats(r, d, sms);
    m = f > m ? f : m;
  }
  return m;
}

// The GPU's MLA prefill on the tensor cores (ops/cuda/mla_tc.cu: the expanded form in key chunks,
// FlashAttention-style), planned here so that the memory plan (k3 info) counts what it allocates.
// Head widths it is compiled for: (nope + rope, v) = (192, 128) (K3, Kimi Linear), (96, 64), (48, 64)
// (K3-nano), nope and rope multiples of 8.
inline bool mla_tc_supported(const MlaAttnDims& d) {
  const int64_t dq = d.nope + d.rope;
  return d.heads >= 1 && d.nope % 8 == 0 && d.rope % 8 == 0 && d.kv_lora % 8 == 0 && d.kv_lora > 0 &&
         ((dq == 192 && d.v == 128) || (dq == 96 && d.v == 64) || (dq == 48 && d.v == 64));
}
// A sequence takes it when its piece of the step has at least this many rows (prefill); fewer
// (decode rows) stay on the absorbed kernel, which never expands the cache.
constexpr int64_t kMlaTcMinRows = 16;
// Keys expanded at a time: as many as fit 256 MiB of bf16 per-head keys and values, in [64, 16384].
inline int64_t mla_tc_key_chunk(const MlaAttnDims& d) {
  const int64_t per_key = d.heads * (d.nope + d.v) * 2;
  const int64_t kc = per_key > 0 ? (int64_t(256) << 20) / per_key / 64 * 64 : 16384;
  return kc < 64 ? 64 : kc > 16384 ? 16384 : kc;
}
// Its workspace for steps of up to `rows` rows (256-byte aligned parts): bf16 latents [chunk, kv_lora]
// and rope keys [chunk, rope], bf16 expanded keys and values [chunk, heads, nope + v], and fp32
// running max and sum [rows, heads, 2] carried between chunks.
inline uint64_t mla_tc_part_bytes(uint64_t b) { return (b + 255) / 256 * 256; }
inline uint64_t mla_tc_work_bytes(int64_t key_chunk, int64_t rows, const MlaAttnDims& d) {
  const uint64_t kc = uint64_t(key_chunk);
  return mla_tc_part_bytes(kc * uint64_t(d.kv_lora) * 2) + mla_tc_part_bytes(kc * uint64_t(d.rope) * 2) +
         mla_tc_part_bytes(kc * uint64_t(d.heads * (d.nope + d.v)) * 2) +
         mla_tc_part_bytes(uint64_t(rows) * uint64_t(d.heads) * 8);
}

#define K3_OPS_DECLARE(...)                                                                                            \
  /* Y[T, rows] = X[T, cols] · Wᵀ  (W in any WFormat, fp32 accumulate on CPU, fp64 in ref). */                      \
  void matmul(__VA_ARGS__ const WeightMat& W, const float* X, int64_t T, float* Y);                                    \
  /* Y[i] = matmul(*W[i], X, T) for n weights of equal cols sharing the input, with the same results; the              \
     CPU does a decode step's (T = 1) products in one parallel region and prepares X once. */                          \
  void matmul_shared_input(__VA_ARGS__ const WeightMat* const* W, int64_t n, const float* X, int64_t T,                \
                           float* const* Y);                                                                           \
  /* Y[i] = matmul(*W[i], X[i], T) for n weights, each with its own input, with the same results; the CPU does         \
     a decode step's products in one parallel region and prepares each distinct X[i] once. */                          \
  void matmul_many(__VA_ARGS__ const WeightMat* const* W, const float* const* X, int64_t n, int64_t T,                 \
                   float* const* Y);                                                                                   \
  /* out[cols] = row r of W decoded exactly. */                                                                        \
  void dequant_row(const WeightMat& W, int64_t r, float* out);                                                         \
  /* out[t] = w ⊙ x[t] / sqrt(mean(x[t]²) + eps) for T rows of n; w == nullptr means ones. */                       \
  void rmsnorm(__VA_ARGS__ const float* x, int64_t T, int64_t n, const float* w, float eps, float* out);               \
  /* In place, per row of n: x ← scale · x / sqrt(Σx² + eps)  (KDA q/k L2 norm, eps inside). */                   \
  void l2norm_scale(__VA_ARGS__ float* x, int64_t rows, int64_t n, float eps, float scale);                            \
  /* out = [b1·tanh(g/b1)·σ(g)] · [b2·tanh(u/b2)]  (SiTU-GLU; σ of the uncapped gate). A cap of 0 is no cap:      \
     b1 = b2 = 0 gives the SiLU-GLU g·σ(g)·u. */                                                                     \
  void situ_glu(__VA_ARGS__ const float* g, const float* u, int64_t n, float b1, float b2, float* out);                \
  /* Depthwise causal conv + SiLU. x,out [T,C]; w [C,K] (w[c,K-1] multiplies the current input);                       \
     state [C,K-1] holds the previous K-1 inputs oldest→newest and is updated. */                                    \
  void short_conv_silu(__VA_ARGS__ const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state,      \
                       float* out);                                                                                    \
  /* KDA log-decay: g[t,h,d] = lb·σ(exp(A_log[h])·(f[t,h,d] + dt_bias[h,d])). f,g [T,H*D]. lb == 0 selects the      \
     unbounded gate −exp(A_log[h])·softplus(f + dt_bias) (softplus(x) = x above 20). */                              \
  void kda_gate(__VA_ARGS__ const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias, \
                float lower_bound, float* g);                                                                          \
  /* Gated delta rule, token by token. q (pre-normalised and scaled), k [T,H,Dk]; v [T,H,Dv];                          \
     g log-decay [T,H,Dk]; beta [T,H]; S [H,Dk,Dv] in/out; o [T,H,Dv]. */                                              \
  void kda_recurrent(__VA_ARGS__ const float* q, const float* k, const float* v, const float* g, const float* beta,    \
                     int64_t T, int64_t H, int64_t Dk, int64_t Dv, float* S, float* o);                                \
  /* Same result by the chunkwise-parallel UT/WY form with chunk size `chunk`. */                                      \
  void kda_chunked(__VA_ARGS__ const float* q, const float* k, const float* v, const float* g, const float* beta,      \
                   int64_t T, int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o);                   \
  /* MLA over expanded heads. q [T,heads,nope+rope]; k_nope [S,heads,nope]; k_r [S,rope] shared by heads;              \
     v [S,heads,v]; query t sits at absolute position pos0+t and sees s <= pos0+t. out [T,heads,v]. */                 \
  void mla_attend_expanded(__VA_ARGS__ const float* q, int64_t T, const float* k_nope, const float* k_r,               \
                           const float* v, int64_t S, int64_t pos0, const MlaAttnDims& d, float* out);                 \
  /* MLA absorbed over the latent cache: c [S,kv_lora] (post-norm), k_r [S,rope]; kv_b [heads*(nope+v), kv_lora]       \
     (per head rows [0,nope) = W_UK, [nope,nope+v) = W_UV). Same output as the expanded form. */                       \
  void mla_attend_absorbed(__VA_ARGS__ const float* q, int64_t T, const float* c, const float* k_r, int64_t S,         \
                           int64_t pos0, const WeightMat& kv_b, const MlaAttnDims& d, float* out);                     \
  /* Router for one token: s = σ(logits); select top-k of s + bias; weights from the UNBIASED s,                      \
     renormalised (Σ + 1e-20) when renorm, times scale. idx/w [k], in descending order of s + bias. */                \
  void router_topk(__VA_ARGS__ const float* logits, const float* bias, int64_t E, int64_t k, bool renorm, float scale, \
                   int32_t* idx, float* w);                                                                            \
  /* Block AttnRes for T tokens: out[t] = Σ_j softmax_j(<v_j[t], fold> / rms(v_j[t])) · v_j[t], where src[j] is a    \
     [T,H] array and fold = w_norm ⊙ w_proj. Values are the RAW sources. */                                          \
  void attnres_mix(__VA_ARGS__ const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold,        \
                   float eps, float* out);

namespace ops {
K3_OPS_DECLARE(Exec ex, )

// A latent cache in pages (the state pool's MLA layout): token s at pages[s / page_tokens] +
// (s % page_tokens) * stride, its post-norm latent c (kv_lora floats) first, then k_r (rope floats).
struct LatentPages {
  const float* const* pages = nullptr;
  int64_t page_tokens = 0, stride = 0;
};
// mla_attend_absorbed over a paged cache (same results as over the same tokens stored contiguously,
// up to the order of fp32 sums at page ends).
void mla_attend_absorbed_paged(Exec ex, const float* q, int64_t T, const LatentPages& cache, int64_t S, int64_t pos0,
                               const WeightMat& kv_b, const MlaAttnDims& d, float* out);
// The expanded form over a paged latent cache in key tiles (prefill): each tile of cached latents
// is expanded into per-head k_nope and v (c · kv_bᵀ, fp32 products) in a bounded buffer, and the
// queries' online softmax continues over the tiles. Same output as mla_attend_absorbed_paged up
// to fp32 rounding; fewer FLOPs than the absorbed form when T is large (about
// T·S·heads·(nope+rope+v) + S·heads·(nope+v)·kv_lora multiply-adds against T·S·heads·(2·kv_lora+rope)).
// At the Scalar level (exact numerics) it runs mla_attend_absorbed_paged. key_tile: keys per tile, a
// multiple of 64 (0: mla_tiled_key_tile(d); tests force small tiles).
void mla_attend_tiled_paged(Exec ex, const float* q, int64_t T, const LatentPages& cache, int64_t S, int64_t pos0,
                            const WeightMat& kv_b, const MlaAttnDims& d, float* out, int64_t key_tile = 0);
// Keys per tile of mla_attend_tiled_paged (256 whatever the dimensions: a head's result does not
// depend on how many heads share the call).
int64_t mla_tiled_key_tile(const MlaAttnDims& d);
// Whether mla_attend_tiled_paged is the cheaper form for T queries over S cached tokens (the last T
// of them are the queries'): by multiply-adds, weighted by the two kernels' measured rates.
bool mla_tiled_pays(int64_t T, int64_t S, const MlaAttnDims& d);
// Sizes the calling thread's matmul buffers for products of 1..T rows with up to `n` weights at once
// (matmul_many / matmul_shared_input) of up to `rows` rows and `cols` columns (`bf16`: some of them
// BF16), so that a later call within those sizes allocates nothing on this thread. For parallel
// loops whose threads take matmuls of different sizes in dynamic order (whole experts), where a
// thread would otherwise first meet a size at any later step.
void reserve_matmul(int64_t T, int64_t n, int64_t rows, int64_t cols, bool bf16);
// Y[t] = matmul(ex, W, X + t * cols, 1, Y + t * rows) for each of T rows, bit for bit (each row as
// a decode GEMV computes it alone), reading W once for all of them where the level has a
// multi-input GEMV (dense formats on avx512; elsewhere T separate GEMVs). For the decode rows of
// several sequences in one step: each sequence gets exactly its result alone.
void matmul_rowwise(Exec ex, const WeightMat& W, const float* X, int64_t T, float* Y);
}  // namespace ops
namespace ref {
K3_OPS_DECLARE()
}

}  // namespace k3
