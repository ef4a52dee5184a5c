// Per-ISA kernels behind the KDA, MLA, norm and elementwise ops of ops.h (single-threaded bodies;
// the threaded drivers live in kda.cpp and cpu_ops.cpp).
// Owns: the contract between those drivers and the kernels compiled with -mavx2/-mavx512*
// (attn_avx2.cpp, attn_avx512.cpp, both built from attn_kernels.inc): argument layouts and the
// scratch each kernel needs (allocated by the caller, passed as raw pointers).
// Must not: be included by code that is not itself dispatch-guarded; the ISA translation units use
// only raw pointers, intrinsics and their own internal helpers (no std templates, no inline
// functions of other headers), so no function compiled with AVX-512 can be merged by the linker
// into code that runs on an older CPU. Keep this header free of inline functions for that reason.
#pragma once
#include <cstdint>

namespace k3::ops {
struct Exec;  // ops/cpu/isa.h
}

namespace k3::ops::cpu {

// Longest chunk of the chunked KDA kernel and the bound on |Γ| (cumulative log-decay from the
// chunk start) that it keeps, so that exp(±Γ) stays a normal fp32 number (e^80 ≈ 5.5e34).
#define K3_KDA_MAX_CHUNK 16
#define K3_KDA_MAX_LOGDECAY 80.0f
// Floats of scratch the KDA kernels need (one head at a time).
#define K3_KDA_REC_SCRATCH(Dk, Dv) (3 * (Dk) + 3 * (Dv) + 64)
#define K3_KDA_CHUNK_SCRATCH(Dk, Dv) \
  (5 * K3_KDA_MAX_CHUNK * (Dk) + 3 * K3_KDA_MAX_CHUNK * (Dv) + 4 * (Dk) + 4 * K3_KDA_MAX_CHUNK * K3_KDA_MAX_CHUNK + 64)
// Keys per block of the attention kernel; scores scratch = rows * K3_ATT_BLOCK + 4 * rows floats.
#define K3_ATT_BLOCK 64

// One block of query rows attending to keys [s0, s1) with an online (running-max) softmax.
// Row r: score(s) = scale·(q1_r·k1_s + q2_r·k2_s) for s < lim[r] (later keys are invisible);
// outputs m[r] (running max, -inf if no key was visible), z[r] = Σ exp(score − m) and
// acc[r] = Σ exp(score − m)·val_s (unnormalised), every element written.
struct AttendPart {
  int64_t rows = 0;
  const float* q1 = nullptr;  // [rows] x k1dim, row stride ldq1
  int64_t ldq1 = 0, k1dim = 0;
  const float* q2 = nullptr;  // [rows] x k2dim (k2dim may be 0)
  int64_t ldq2 = 0, k2dim = 0;
  const float* k1 = nullptr;  // key rows s (absolute index), stride ldk1
  int64_t ldk1 = 0;
  const float* k2 = nullptr;
  int64_t ldk2 = 0;
  const float* val = nullptr;  // value rows s, stride ldv, width vdim
  int64_t ldv = 0, vdim = 0;
  const int64_t* lim = nullptr;  // [rows]
  int64_t s0 = 0, s1 = 0;
  float scale = 1;
  float* m = nullptr;    // [rows]
  float* z = nullptr;    // [rows]
  float* acc = nullptr;  // [rows] x vdim, row stride ldacc
  int64_t ldacc = 0;
  float* scratch = nullptr;  // >= rows * K3_ATT_BLOCK + 4 * rows floats
  // Paged keys (the MLA latent cache): when pages is set, key row s lives at
  // pages[s / page_tokens] + (s % page_tokens) * ldk1, and k1/k2/val are k1_off/k2_off/val_off floats
  // into it (ldk1 == ldk2 == ldv: one interleaved row per token). Key blocks stop at page ends.
  const float* const* pages = nullptr;
  int64_t page_tokens = 0, k1_off = 0, k2_off = 0, val_off = 0;
  // m, z and acc already hold a running result over earlier keys (m = -inf, z = 0, acc = 0 before
  // any): continue it instead of starting over (keys taken in tiles, as the tiled MLA prefill does).
  bool resume = false;
  // Keys stored transposed (not with pages): element i of key s at k1[i·ldk1 + s] (and k2[i·ldk2 + s]),
  // so the scores are a broadcast GEMM (no horizontal sums): for short keys (the tiled MLA prefill's
  // per-head keys of nope + rope values).
  bool keys_t = false;
};

struct AttnKernels {
  // KDA recurrence (ops.h kda_recurrent) for head h over all T tokens, fp32 state S_h = S + h·Dk·Dv
  // updated in place. scratch: K3_KDA_REC_SCRATCH(Dk, Dv) floats.
  void (*kda_recurrent_head)(const float* q, const float* k, const float* v, const float* g, const float* beta,
                             int64_t T, int64_t H, int64_t Dk, int64_t Dv, int64_t h, float* S_h, float* o,
                             float* scratch);
  // Chunkwise KDA for head h; chunks of at most max_chunk (<= K3_KDA_MAX_CHUNK) tokens, cut earlier
  // where |Γ| would exceed K3_KDA_MAX_LOGDECAY. scratch: K3_KDA_CHUNK_SCRATCH(Dk, Dv) floats.
  void (*kda_chunked_head)(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                           int64_t H, int64_t Dk, int64_t Dv, int64_t h, int64_t max_chunk, float* S_h, float* o,
                           float* scratch);
  // mode 0: C = A·B; mode 1: C += A·B; mode 2: C[m,:] = cscale[m]·C[m,:] + A[m,:]·B.
  // A [M,K] (lda), B [K,N] (ldb), C [M,N] (ldc).
  void (*gemm_nn)(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                  int64_t ldc, int mode, const float* cscale);
  // C[m,n] = alpha·Σ_k A[m,k]·B[n,k]  (A [M,K] lda, B [N,K] ldb, C [M,N] ldc).
  void (*gemm_nt)(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                  int64_t ldc, float alpha);
  void (*attend_part)(const AttendPart& a);
  // Rows [r0, r1) of rmsnorm / l2norm_scale (ops.h semantics; sums of squares in fp64).
  void (*rmsnorm_rows)(const float* x, int64_t r0, int64_t r1, int64_t n, const float* w, float eps, float* out);
  void (*l2norm_rows)(float* x, int64_t r0, int64_t r1, int64_t n, float eps, float scale);
  // Elements [i0, i1) of situ_glu.
  void (*situ_glu)(const float* g, const float* u, int64_t i0, int64_t i1, float b1, float b2, float* out);
  // Channels [c0, c1) of short_conv_silu for all T tokens. wT [K, C] (transposed weights),
  // hist [K-1, C] (the carried inputs, oldest first, transposed); the state is updated by the caller.
  void (*short_conv_silu)(const float* x, int64_t T, int64_t C, const float* wT, int64_t K, const float* hist,
                          int64_t c0, int64_t c1, float* out);
  // One token (T = 1) of short_conv_silu for channels [c0, c1) in the op's own layouts (w [C, K],
  // state [C, K-1], updated here): no transposes. The same products and sigmoid as the T-token
  // kernel, so the same bits.
  void (*short_conv_step)(const float* x, int64_t C, const float* w, int64_t K, float* state, int64_t c0, int64_t c1,
                          float* out);
  // Rows [r0, r1) (a row = one token and head, D channels) of kda_gate; a[h] = exp(A_log[h]).
  void (*kda_gate)(const float* f, int64_t r0, int64_t r1, int64_t H, int64_t D, const float* a, const float* dt_bias,
                   float lower_bound, float* g);
  // Tokens [t0, t1) of attnres_mix (scores in fp64, mix in fp32).
  void (*attnres_mix)(const float* const* src, int64_t n_src, int64_t t0, int64_t t1, int64_t H, const float* fold,
                      float eps, float* out);
  // Rows [r0, r0 + nrows) of a row-major [*, cols] weight matrix widened exactly to fp32 rows of out.
  // fmt: 0 = F32, 1 = F16, 2 = BF16 (data may be unaligned, as in an mmap'd shard).
  void (*widen_rows)(const void* data, int fmt, int64_t cols, int64_t r0, int64_t nrows, float* out);
  // y[i] = exp(x[i]) for n values (the vectorised exp the kernels use; exposed for tests).
  void (*exp_n)(const float* x, int64_t n, float* y);
};

namespace avx2 {
extern const AttnKernels kAttn;
}
namespace avx512 {
extern const AttnKernels kAttn;
}

// The kernels of x's level (cpu_isa()), or nullptr at the scalar level (Numerics::Exact; defined
// in kda.cpp).
const AttnKernels* attn_kernels(const Exec& x);

}  // namespace k3::ops::cpu
