// CUDA kernels of the K3 forward pass (namespace k3::cuda), on device pointers, fp32 activations.
// Each function has the same meaning as its CPU twin in ops/ops.h (k3::ref is the fp64 reference
// the device tests compare against) and only enqueues work on `s`: no host sync, no allocation
// on the decode path (T == 1), so a decode step can be captured in a CUDA graph.
// Positions that change per step (the MLA cache length) are read from device memory for the same
// reason. Plain C++ header: no CUDA includes (model/ uses it).
// Must not: know tensor names or layer order (that is model/).
#pragma once
#include <cstdint>

#include "ops/cuda/runtime.h"
#include "ops/ops.h"
#include "ops/weight.h"

namespace k3::cuda {

// Matrix-product precision. F32: fp32 operands and accumulation everywhere (the parity mode the
// gates use). BF16: activations rounded to bf16 for the tensor-core GEMMs of T > kGemvMaxT tokens,
// fp32 accumulation (the default). GEMVs (T <= kGemvMaxT) read fp32 activations in both modes.
enum class Precision : uint8_t { F32 = 0, BF16 = 1 };
const char* precision_name(Precision p);
Precision parse_precision(const char* name);  // "fp32" | "bf16"; k3::Error otherwise
constexpr int64_t kGemvMaxT = 8;

// ------------------------------------------------------------------ matrix products (gemm.cu)
// Y[T, W.rows] = X[T, W.cols] · Wᵀ. W is a device view (data/scales in GPU memory) in any WFormat;
// MXFP4 is decoded inside the kernel (packed nibbles + E8M0 scales, never expanded in memory).
void matmul(const WeightMat& W, const float* X, int64_t T, float* Y, Precision p, Stream s);
// Y[T, W.rows] = X[T, W.cols] · Wᵀ with bf16 X and Y (cuBLAS, fp32 accumulation): W a 16-byte aligned
// BF16 view with rows and cols multiples of 8, X and Y 16-byte aligned; k3::Error otherwise.
void matmul_bf16_out(const WeightMat& W, const void* X, int64_t T, void* Y, Stream s);
// Decode rows of many sequences together: the GEMV kernels (fp32 activations, weights read once)
// for T <= kGemvMaxT, or T == kGemvWideT on non-MXFP4 weights (gemv_wide_ok); k3::Error otherwise.
constexpr int64_t kGemvWideT = 16;
bool gemv_wide_ok(const WeightMat& W);
// Whether matmul(Precision::F32) of T > kGemvMaxT tokens on `rows` weight rows runs as chunked GEMVs
// (kGemvMaxT tokens per chunk, the same bits as gemv_rows on each) instead of the fp32 SIMT tiles:
// when the tiles would leave most SMs idle (few rows: the router).
bool matmul_f32_by_gemv(int64_t rows, int64_t T);
void gemv_rows(const WeightMat& W, const float* X, int64_t T, float* Y, Stream s);
// Several GEMVs of T rows each (the gemv_rows contract per job), in as few launches as possible: one
// per weight format for up to kGemvBatchMax jobs (decode: a sublayer's projections of one input in
// one launch). Same bits as gemv_rows on each job. Outputs must not overlap any job's input.
struct GemvJob {
  const WeightMat* W;
  const float* X;
  float* Y;
};
constexpr int kGemvBatchMax = 8;
void gemv_batch(const GemvJob* jobs, int64_t n, int64_t T, Stream s);
// Routed experts stacked along rows: W = [E * R, C] (expert e owns rows [e*R, (e+1)*R)).
// Y[n, R] = W_{ids[n]} · X[n / x_div] for n in [0, N). ids (device, int32) are read by the kernel,
// so a graph replays with whatever the router wrote.
void expert_matmul(const WeightMat& W, int64_t R, const int32_t* ids, int64_t N, const float* X, int64_t x_div,
                   float* Y, Precision p, Stream s);

// The experts' GLU in one kernel: H[n, r] = situ_glu(gate_{ids[n]}[r] . x, up_{ids[n]}[r] . x) with
// x = X[n / x_div]; gate and up stacked as expert_matmul's W, of one format and shape. The same bits
// as expert_matmul(gate), expert_matmul(up) and situ_glu (caps b1, b2; 0 = none).
void expert_glu(const WeightMat& gate, const WeightMat& up, int64_t R, const int32_t* ids, int64_t N, const float* X,
                int64_t x_div, float b1, float b2, float* H, Stream s);

// cuBLAS set up for stream s (handle, workspace, bf16 activations of x_elems): a recorded step
// (graph capture) may then run bf16 products of up to x_elems activations on s; past it they fail in
// one line there (allocation is not allowed while capturing).
void cublas_prepare(Stream s, int64_t x_elems);

// The routed experts' FFN of N slots grouped by expert on the device (decode steps of many
// sequences; graph-safe: the ids are read by the kernels): slot n (expert ids[n], x = X[n / x_div])
// gets Y[n, :] = down_e . situ_glu(gate_e . x, up_e . x) (caps b1, b2), as expert_glu then
// expert_matmul(down) give per slot, up to rounding (a tile's slots run as one kGemvMaxT-token GEMV,
// so its expert's rows are read once for all of them, not once per slot). Bad ids: NaN rows of Y.
// Scratch: H [N, I] floats, sorted [N] and *n_tiles int32, tiles [expert_grouped_tiles_max(N, E)].
// expert_grouped_ok: the shapes, formats and sizes it takes (else a one-line error here).
int64_t expert_grouped_tiles_max(int64_t N, int64_t E);
bool expert_grouped_ok(const WeightMat& gate, const WeightMat& up, const WeightMat& down, int64_t I, int64_t N,
                       const float* X, const float* H);
struct ExpertTile;
void expert_ffn_grouped(const WeightMat& gate, const WeightMat& up, const WeightMat& down, int64_t I,
                        const int32_t* ids, int64_t N, const float* X, int64_t x_div, float b1, float b2, float* H,
                        float* Y, int32_t* sorted, ExpertTile* tiles, int32_t* n_tiles, Stream s);

// Prefill's routed experts grouped by expert (T > kGemvMaxT rows, Precision::BF16, MXFP4 stacks): a
// device list of tiles, each up to kExpertTileRows consecutive rows of X that go to one expert; for
// each tile and each of the n_mats (1 or 2) stacks W[z] (one shape, [E * R, C]):
//   Y[z][row0 + t, :] = W[z]_{expert} · X[row0 + t]   (t < rows; Y[z] row stride R)
// in one launch, on bf16 tensor cores (activations rounded to bf16, MXFP4 decoded exactly, fp32
// accumulation): the same bits as matmul(W_expert, X + row0, rows, BF16) for each tile.
struct ExpertTile {
  int32_t expert, row0, rows;
};
constexpr int kExpertTileRows = 64;
bool expert_gemm_grouped_ok(const WeightMat& W, int64_t R);
void expert_gemm_grouped(const WeightMat* const* W, float* const* Y, int n_mats, int64_t R, const ExpertTile* tiles,
                         int64_t n_tiles, const float* X, Stream s);

// ------------------------------------------------------------------ elementwise + norms (elementwise.cu)
void rmsnorm(const float* x, int64_t T, int64_t n, const float* w, float eps, float* out, Stream s);  // w may be null
void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale, Stream s);
void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out, Stream s);
// The MoE's two tails in one launch (model/backend.h MoeTail): agg [rows, n] <- RMSNorm(agg) (x) w (none
// when rows or n is 0) and g <- situ_glu(g, u) over n_situ elements (none when 0). The bits of rmsnorm
// and situ_glu; shapes the fused kernel does not take (n % 4, n > 8192, unaligned) run those two.
void moe_tail(float* agg, int64_t rows, int64_t n, const float* w, float eps, float* g, const float* u, int64_t n_situ,
              float b1, float b2, Stream s);
void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* out,
                     Stream s);
void kda_gate(const float* f, int64_t T, int64_t H, int64_t D, const float* A_log, const float* dt_bias,
              float lower_bound, float* g, Stream s);
void sigmoid_inplace(float* x, int64_t n, Stream s);                      // x ← σ(x)
void sigmoid_gate_mul(float* x, const float* gate, int64_t n, Stream s);  // x ← x · σ(gate)
// out = RMSNorm(x) ⊙ w · σ(gate) per row (gate [T, n], not out unless x is out too): rmsnorm then
// sigmoid_gate_mul, in one kernel for n % 4 == 0, n <= 512 and 16-byte aligned rows; the same bits.
void rmsnorm_gate(const float* x, int64_t T, int64_t n, const float* w, float eps, const float* gate, float* out,
                  Stream s);
void add_inplace(float* y, const float* x, int64_t n, Stream s);          // y ← y + x
// out[t] = row ids[t] of E (F32/F16/BF16 device view), ids on the device.
void embed_rows(const WeightMat& E, const int32_t* ids, int64_t T, float* out, Stream s);
// out[t] = argmax_v logits[t, v] (lowest index on ties), device int32.
void argmax_rows(const float* logits, int64_t T, int64_t V, int32_t* out, Stream s);
// Block AttnRes over n_src (<= kMaxAttnResSources) device arrays [T, H]; the pointer list is
// passed by value. Same formula as ops.h attnres_mix.
constexpr int kMaxAttnResSources = 32;
void attnres_mix(const float* const* src, int64_t n_src, int64_t T, int64_t H, const float* fold, float eps, float* out,
                 Stream s);
// One residual site (model/backend.h ResidualNorm) in one kernel: partial ← partial + y (or ← y when
// y_replaces; y may be null; with y2 non-null, y + y2 in place of y; y is not written), a = attnres_mix(blocks ∪ {partial}) (a = partial when fold is null; then
// n_blocks must be 0), xn = RMSNorm(a) ⊙ norm_w. n_blocks + 1 <= kMaxAttnResSources; y, partial and xn
// distinct. The same math as those ops in that order, except the order of the norm's fp64 sum.
void residual_norm(const float* const* blocks, int64_t n_blocks, float* partial, const float* y, const float* y2,
                   bool y_replaces, const float* fold, float mix_eps, const float* norm_w, float norm_eps, int64_t T,
                   int64_t H, float* xn, Stream s);

// ------------------------------------------------------------------ KDA (kda.cu)
void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int64_t H, int64_t Dk, int64_t Dv, float* S, float* o, Stream s);
void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                 int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S, float* o, Stream s);

// ------------------------------------------------------------------ MLA (mla.cu)
// Appends T tokens to a latent cache: c_cache[len + t] = RMSNorm(ckv[t, :kv_lora]) ⊙ norm_w,
// kr_cache[len + t] = ckv[t, kv_lora:kv_lora+rope], where len = *len_dev (device int32, the
// tokens cached before this call; not modified here).
void mla_cache_append(const float* ckv, int64_t T, int64_t kv_lora, int64_t rope, const float* norm_w, float eps,
                      const int32_t* len_dev, float* c_cache, float* kr_cache, Stream s);
// Absorbed MLA over the latent cache (ops.h mla_attend_absorbed) with pos0 = *len_dev and
// S = pos0 + T cached tokens (the T new ones already appended). kv_b is a device view.
// `work` is device scratch of at least mla_absorbed_work_floats(T, d) floats.
int64_t mla_absorbed_work_floats(int64_t T, const MlaAttnDims& d);
void mla_attend_absorbed(const float* q, int64_t T, const float* c, const float* k_r, const int32_t* len_dev,
                         const WeightMat& kv_b, const MlaAttnDims& d, float* work, float* out, Precision p, Stream s);
// out ← *len_dev += T (after every layer of a forward has used the old value).
void advance_len(int32_t* len_dev, int64_t T, Stream s);

// ------------------------------------------------------------------ MoE (moe.cu)
// Router for T tokens (ops.h router_topk per row): idx/w [T, k] on the device; bias may be null.
void router_topk(const float* logits, const float* bias, int64_t T, int64_t E, int64_t k, bool renorm, float scale,
                 int32_t* idx, float* w, Stream s);
// agg[t] = Σ_j w[t, j] · y[t*k + j]  (j ascending), agg [T, n] overwritten.
void moe_combine(const float* y, const float* w, int64_t T, int64_t k, int64_t n, float* agg, Stream s);

// ------------------------------------------------------------------ varlen batches (continuous batching)
// A step's rows are the tokens of n_seqs sequences, packed: rows [cu_rows[i], cu_rows[i+1]) belong to
// sequence i, whose state lives in slot slots[i] of a state pool. The arrays are DEVICE int32 arrays, so a
// captured CUDA graph replays with whatever was copied there last; n_seqs and rows (= cu_rows[n_seqs]) are
// host values fixed per launch shape. A sequence may have no rows (its state is then left as it is);
// the slots of one batch must be distinct (two sequences updating one slot would race). A slot
// outside [0, n_slots) is never read or written: that sequence's outputs are set to NaN (loud).
struct VarlenDev {
  int64_t n_seqs = 0, rows = 0;
  const int32_t* cu_rows = nullptr;  // [n_seqs + 1], cu_rows[0] = 0, non-decreasing
  const int32_t* slots = nullptr;    // [n_seqs] (read by the KDA and conv ops only)
  int64_t n_slots = 0;               // host: slots in the state pool (the bound for slots[i]; KDA and conv)
};
// KDA gated delta rule for every sequence from its own state: S_pool [n_slots, H, Dk, Dv] fp32; sequence i
// reads and updates S_pool + slots[i]*H*Dk*Dv. q,k,g [rows,H,Dk]; v,o [rows,H,Dv]; beta [rows,H]. Same math
// as kda_recurrent (ops.h) per sequence, and the same bits as cuda::kda_recurrent on that sequence alone.
// Grid: (Dv/32, H, n_seqs) blocks, each walking its sequence's rows: the decode kernel.
void kda_recurrent_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          const VarlenDev& b, int64_t H, int64_t Dk, int64_t Dv, float* S_pool, float* o, Stream s);
// The same result by the chunkwise form (as kda_chunked, same bits as it per sequence): for prefill chunks.
void kda_chunked_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const VarlenDev& b, int64_t H, int64_t Dk, int64_t Dv, int64_t chunk, float* S_pool, float* o,
                        Stream s);
// The same function on the tensor cores (kda_tc.cu): bf16 operands, fp32 accumulation and state, for
// the `fast` numerics mode's prefill. Dk = Dv in {16, 32, 64, 128} (kda_tc_supported). Chunks of 64
// tokens; `work` holds kda_tc_work_bytes(work_chunks, H, Dk) bytes (any number >= 1: a call with more
// chunks runs in windows of that many, the state carried between them). cu_rows_host is the host copy
// of b.cu_rows (it decides the windows; the kernels read the device one). Not for graph capture of
// steps whose sequence lengths change.
bool kda_tc_supported(int64_t Dk, int64_t Dv);
size_t kda_tc_work_bytes(int64_t chunks, int64_t H, int64_t D);
int64_t kda_tc_chunks(const int32_t* cu_rows_host, int64_t n_seqs);  // the chunks a call has (per head)
void kda_chunked_tc_varlen(const float* q, const float* k, const float* v, const float* g, const float* beta,
                           const VarlenDev& b, const int32_t* cu_rows_host, int64_t H, int64_t Dk, int64_t Dv,
                           float* S_pool, float* o, void* work, int64_t work_chunks, Stream s);
// Depthwise causal conv + SiLU per sequence with its own carried inputs: state_pool [n_slots, C, K-1]
// (same layout as short_conv_silu's state), sequence i uses state_pool + slots[i]*C*(K-1). x,out [rows,C].
// Same bits as short_conv_silu on each sequence alone.
void short_conv_silu_varlen(const float* x, const VarlenDev& b, int64_t C, const float* w, int64_t K, float* state_pool,
                            float* out, Stream s);

// The KDA inputs of decode rows in one kernel (row i = sequence i, one token each): q, k, v =
// SiLU(causal conv(qh, kh, vh)) with each sequence's carried state (short_conv_silu_varlen on
// state[m] pools), q ← q·q_scale/‖q‖, k ← k/‖k‖ per head (l2norm_scale, eps), g = kda_gate(f) and
// beta ← σ(beta) in place. The same bits as those kernels. kda_prepare_decode_ok: the shapes it takes
// (D % 4 == 0, D <= 512, C = H·D, q and k 16-byte aligned); otherwise run the separate kernels.
struct KdaPrepDev {
  const float* in[3];  // qh, kh, vh [rows, C]
  float* out[3];       // q, k, v [rows, C]
  const float* w[3];   // conv weights [C, K]
  float* state[3];     // conv state pools [n_slots, C, K-1]
  int64_t C = 0, H = 0, D = 0;
  int K = 0;
  float q_scale = 1.0f, eps = 1e-6f;
  const float* f = nullptr;  // [rows, C]
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  float lb = 0.0f;
  float* g = nullptr;     // [rows, C]
  float* beta = nullptr;  // [rows, H], in place
};
bool kda_prepare_decode_ok(const KdaPrepDev& a);
void kda_prepare_decode(const KdaPrepDev& a, const VarlenDev& b, Stream s);

// A paged MLA latent cache of one layer: pages [n_pages, page_tokens, kv_lora + rope] fp32; per token the
// RMS-normed latent c (kv_lora floats) then the raw shared rope key k_r (rope floats). Token position p of
// sequence i lives in page block_table[i*max_pages + p/page_tokens], row p % page_tokens.
// Entries the kernels meet outside [0, n_pages), or positions past max_pages pages, are never written
// through (append skips the row) and read as NaN (attention): a bad table is loud, not a stray write.
struct PagedCacheDev {
  float* pages = nullptr;
  int64_t page_tokens = 64;              // the engine uses 64; kernels must accept any value >= 1
  const int32_t* block_table = nullptr;  // device [n_seqs, max_pages]
  int64_t max_pages = 0;                 // host: the table's row length (fixed capacity)
  const int32_t* pos0 = nullptr;         // device [n_seqs]: tokens cached for sequence i BEFORE this step
  int64_t n_pages = 0;                   // host: pages in the pool (the bound for block-table entries)
};
// Appends the step's rows: row cu_rows[i]+j goes to position pos0[i]+j of sequence i:
// c = RMSNorm_eps(ckv[row, :kv_lora]) * norm_w, k_r = ckv[row, kv_lora:kv_lora+rope]. ckv [rows, kv_lora+rope].
// Same bits as mla_cache_append.
void mla_cache_append_paged(const float* ckv, const VarlenDev& b, const PagedCacheDev& c, int64_t kv_lora, int64_t rope,
                            const float* norm_w, float eps, Stream s);
// Absorbed MLA (same meaning as ops.h mla_attend_absorbed) for every sequence over its own pages, AFTER the
// append: row cu_rows[i]+j sits at absolute position pos0[i]+j and attends to positions 0..pos0[i]+j.
// q [rows, heads, nope+rope], out [rows, heads, v]; kv_b a device view. work: >= mla_paged_work_floats(...) floats.
// Long key ranges are split over blocks in proportion to each row's keys (a plan computed on the
// device from pos0, so the grid is fixed per (rows, heads) while contexts differ and grow).
int64_t mla_paged_work_floats(int64_t rows, int64_t n_seqs, const MlaAttnDims& d);
// skip (optional, device int32 [n_seqs]): a sequence with skip[i] != 0 is given only its first key
// (its outputs are not meaningful): the rows another kernel computes (mla_attend_tc_paged) cost nothing.
void mla_attend_absorbed_paged(const float* q, const VarlenDev& b, const PagedCacheDev& c, const WeightMat& kv_b,
                               const MlaAttnDims& d, float* work, float* out, Precision p, Stream s,
                               const int32_t* skip = nullptr);

// The same attention for prefill pieces on the tensor cores (mla_tc.cu), the `fast` numerics'
// kernel: per sequence i with use[i] (host flags; null: every sequence with rows), the cache in
// chunks of `key_chunk` keys (a multiple of 64; ops.h mla_tc_key_chunk): the latents gathered to
// bf16, expanded into per-head keys and values by kv_b (a bf16 GEMM, bf16 out), then a
// FlashAttention-style kernel (bf16 mma.sync, fp32 online softmax carried from chunk to chunk in
// `out` and the workspace). kv_b: a 16-byte aligned BF16 device view; dims: ops.h mla_tc_supported.
// cu_rows_host / pos0_host: host copies of the batch's cu_rows and c.pos0 (they size the launches).
// work: mla_tc_work_bytes(key_chunk, b.rows, d) bytes. Not for graph capture.
bool mla_tc_weight_ok(const WeightMat& kv_b);
void mla_attend_tc_paged(const float* q, const VarlenDev& b, const PagedCacheDev& c, const int32_t* cu_rows_host,
                         const int64_t* pos0_host, const uint8_t* use, const WeightMat& kv_b, const MlaAttnDims& d,
                         int64_t key_chunk, void* work, float* out, Stream s);

}  // namespace k3::cuda

namespace k3::cuda {
// ------------------------------------------------------------------ row gather / scatter (rows.cu)
// For grouping MoE prefill by expert: dst[i] = src[rows[i]] (gather) or dst[rows[i]] = src[i]
// (scatter; each destination row written once), i < n, rows of `width` floats, rows on the device.
void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst, Stream s);
void scatter_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst, Stream s);
// dst[i] = src[i] for the rows i < n with ids[i] >= 0, the others untouched (ids on the device): the
// GPU-computed slots of a hybrid MoE step over the host-computed ones.
void copy_rows_where(const float* src, const int32_t* ids, int64_t n, int64_t width, float* dst, Stream s);
}  // namespace k3::cuda
