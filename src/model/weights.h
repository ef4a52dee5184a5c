// The weights of a K3 model as views, the same structs on every backend: a WeightMat or FVec points
// at host memory (the mmap'd shards, decoded small vectors) after binding, and at device memory
// after a backend placed them (Backend::place). Owns: the list of a model's weights (the visitor
// for_each_weight, which binding checks, placement, the memory plan, the traffic count and the FP8
// trunk's quantiser walk), the role of each (WeightRole::Trunk is what --trunk-fp8 quantises) and the
// byte count of each (weight_bytes).
// Must not: own weight memory (the bound Model and the backends do) or know tensor names.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/weight.h"

namespace k3 {

// A small fp32 vector (norm gains, conv taps, biases), decoded at bind time; a view.
struct FVec {
  const float* p = nullptr;
  int64_t n = 0;
  const float* data() const { return p; }
  size_t size() const { return size_t(n); }
  bool empty() const { return n == 0; }
  float operator[](size_t i) const { return p[i]; }
};

// Bytes of a [rows, cols] matrix in FP8: the E4M3 bytes and one fp32 scale per 128 x 128 block.
inline uint64_t fp8_matrix_bytes(int64_t rows, int64_t cols) {
  return uint64_t(rows) * uint64_t(cols) +
         4 * uint64_t((rows + kFp8Block - 1) / kFp8Block) * uint64_t(fp8_block_cols(cols));
}

// Stored bytes of a weight matrix (MXFP4: packed nibbles + E8M0 scales; FP8: E4M3 bytes + the block
// scales of the block rows it covers, so that a row view counts the scales it reads); 0 for an empty
// one.
inline uint64_t weight_bytes(const WeightMat& w) {
  if (w.empty()) return 0;
  const uint64_t data = uint64_t(w.rows) * uint64_t(row_bytes(w));
  if (w.fmt == WFormat::FP8) {
    const int64_t block_rows = w.rows == 0 ? 0 : (w.row0 + w.rows - 1) / kFp8Block - w.row0 / kFp8Block + 1;
    return data + 4 * uint64_t(block_rows) * uint64_t(fp8_block_cols(w.cols));
  }
  return w.fmt == WFormat::MXFP4 ? data + uint64_t(w.rows) * uint64_t(w.cols / 32) : data;
}
inline uint64_t weight_bytes(const FVec& v) { return uint64_t(v.n) * 4; }

// Bytes of `w` on the GPU as the CUDA backend uploads it: an FP8 matrix with per-row block scales
// (weight.h's GPU form, 4 B per row and 128 columns), or in fp32 where kv_b (an MLA layer's kv_b_proj:
// the absorbed attention kernels read F32/F16/BF16); any other as stored.
inline uint64_t gpu_weight_bytes(const WeightMat& w, bool kv_b) {
  if (w.empty() || w.fmt != WFormat::FP8) return weight_bytes(w);
  const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols);
  return kv_b ? 4 * n : n + 4 * uint64_t(w.rows) * uint64_t(fp8_block_cols(w.cols));
}

struct KdaWeights {
  WeightMat q_proj, k_proj, v_proj;  // [heads*head_dim, hidden]
  WeightMat f_a_proj;                // [head_dim, hidden]   decay-gate low-rank A
  WeightMat f_b_proj;                // [heads*head_dim, head_dim]
  WeightMat b_proj;                  // [heads, hidden]      β logits
  WeightMat g_proj;                  // [heads*head_dim, hidden] output gate (full rank, K3)
  WeightMat g_a_proj, g_b_proj;      // or low rank: [head_dim, hidden], [heads*head_dim, head_dim] (Kimi Linear)
  WeightMat o_proj;                  // [hidden, heads*head_dim]
  FVec q_conv, k_conv, v_conv;       // [heads*head_dim, conv_k] taps oldest→newest
  FVec A_log;                        // [heads] (first `heads` of the padded checkpoint vector)
  FVec dt_bias;                      // [heads*head_dim]
  FVec o_norm;                       // [head_dim] shared by all heads
};

struct MlaWeights {
  WeightMat q_proj;     // [heads*(nope+rope), hidden] when there is no query LoRA (Kimi Linear)
  WeightMat q_a_proj;   // [q_lora, hidden]
  WeightMat q_b_proj;   // [heads*(nope+rope), q_lora]
  WeightMat kv_a_proj;  // [kv_lora+rope, hidden]   rows [0,kv_lora) latent c, then shared k_r
  WeightMat kv_b_proj;  // [heads*(nope+v), kv_lora] per head: W_UK rows then W_UV rows
  WeightMat g_proj;     // [heads*v, hidden] (empty when output_gate is false)
  WeightMat o_proj;     // [hidden, heads*v]
  FVec q_a_norm;        // [q_lora]
  FVec kv_a_norm;       // [kv_lora]
};

struct GluWeights {
  WeightMat gate, up;  // [inter, in]
  WeightMat down;      // [out, inter]
};

struct MoeWeights {
  int64_t layer = -1;               // decoder layer index (the key an ExpertSource is asked for)
  WeightMat gate;                   // [experts, hidden] router
  FVec bias;                        // [experts] e_score_correction_bias (selection only)
  WeightMat down_lat;               // [latent, hidden]
  FVec lat_norm;                    // [latent]
  WeightMat up_lat;                 // [hidden, latent]
  std::vector<GluWeights> experts;  // gate=w1 [inter, latent], up=w3, down=w2 [latent, inter]
                                    // (never read when an ExpertSource is given)
  // The routed experts stacked along rows ([E*inter, latent], [E*inter, latent], [E*latent, inter]),
  // when a backend placed them so (CUDA: kernels index experts on the device); then experts[e] are
  // views into these. Empty on the CPU.
  GluWeights stacked;
  GluWeights shared;  // fused shared experts [n_shared*inter, hidden]; empty if none
  // The routed experts this model computes: [local_begin, local_end) of `experts` (one rank of an
  // expert-parallel split, model/parallel.h: the others are empty views, held by other ranks, and
  // moe_routed leaves them out of the sum). -1: all of them.
  int64_t local_begin = 0, local_end = -1;
  // Experts another device computes for this model (the GPU's cache of hot experts in the hybrid
  // placement, GpuOptions::hot_experts): [experts] flags, left out as another rank's are; null: none.
  const uint8_t* elsewhere = nullptr;
  bool is_local(int64_t e) const {
    return e >= local_begin && (local_end < 0 || e < local_end) && !(elsewhere && elsewhere[e]);
  }
};

// Block AttnRes site: fold = w_norm ⊙ w_proj, folded at bind time (§3.3).
struct AttnResSite {
  FVec fold;  // [hidden]
};

struct LayerWeights {
  FVec input_norm;                // [hidden] input_layernorm
  FVec post_norm;                 // [hidden] post_attention_layernorm
  AttnResSite attn_res, mlp_res;  // self_attention_res_*, mlp_res_*
  bool is_kda = true;
  KdaWeights kda;
  MlaWeights mla;
  bool dense_ffn = false;
  GluWeights dense;  // layer < first_k_dense_replace
  MoeWeights moe;
};

struct ModelWeights {
  WeightMat embed, lm_head;  // [vocab, hidden]
  FVec final_norm;           // [hidden]
  AttnResSite output_res;    // output_attn_res_*
  std::vector<LayerWeights> layers;
};

// Whether m is (the object of) an MLA layer's kv_b_proj in w.
inline bool is_mla_kv_b(const ModelWeights& w, const WeightMat& m) {
  for (const LayerWeights& l : w.layers)
    if (!l.is_kda && &l.mla.kv_b_proj == &m) return true;
  return false;
}

// What a weight is, for visitors that treat kinds differently (placement stacks routed experts; the
// traffic count reads top_k of them per token and one row of the embedding).
enum class WeightRole : uint8_t { Trunk, Embedding, LmHead, Router, RoutedExpert };

// Calls mat(WeightMat&, WeightRole) for every non-empty matrix and vec(FVec&) for every non-empty
// vector of `w`, in forward order. Routed experts are visited expert by expert (w1, w3, w2), after the
// router and before the shared experts; `stacked` is not visited. Works on const models through
// for_each_weight(const ModelWeights&, ...), whose callbacks get const references.
template <class W, class MatFn, class VecFn>
void for_each_weight_impl(W& w, MatFn&& mat, VecFn&& vec) {
  const auto m = [&](auto& x, WeightRole r) {
    if (!x.empty()) mat(x, r);
  };
  const auto v = [&](auto& x) {
    if (!x.empty()) vec(x);
  };
  const auto glu = [&](auto& g, WeightRole r) {
    m(g.gate, r);
    m(g.up, r);
    m(g.down, r);
  };
  m(w.embed, WeightRole::Embedding);
  for (auto& l : w.layers) {
    v(l.input_norm);
    v(l.post_norm);
    v(l.attn_res.fold);
    v(l.mlp_res.fold);
    if (l.is_kda) {
      auto& k = l.kda;
      for (auto* x : {&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a_proj, &k.f_b_proj, &k.b_proj, &k.g_proj, &k.g_a_proj,
                      &k.g_b_proj, &k.o_proj})
        m(*x, WeightRole::Trunk);
      for (auto* x : {&k.q_conv, &k.k_conv, &k.v_conv, &k.A_log, &k.dt_bias, &k.o_norm}) v(*x);
    } else {
      auto& a = l.mla;
      for (auto* x : {&a.q_proj, &a.q_a_proj, &a.q_b_proj, &a.kv_a_proj, &a.kv_b_proj, &a.g_proj, &a.o_proj})
        m(*x, WeightRole::Trunk);
      v(a.q_a_norm);
      v(a.kv_a_norm);
    }
    if (l.dense_ffn) {
      glu(l.dense, WeightRole::Trunk);
    } else {
      auto& e = l.moe;
      m(e.gate, WeightRole::Router);
      v(e.bias);
      m(e.down_lat, WeightRole::Trunk);
      v(e.lat_norm);
      m(e.up_lat, WeightRole::Trunk);
      for (auto& x : e.experts) glu(x, WeightRole::RoutedExpert);
      glu(e.shared, WeightRole::Trunk);
    }
  }
  v(w.final_norm);
  v(w.output_res.fold);
  m(w.lm_head, WeightRole::LmHead);
}
template <class MatFn, class VecFn>
void for_each_weight(ModelWeights& w, MatFn&& mat, VecFn&& vec) {
  for_each_weight_impl(w, mat, vec);
}
template <class MatFn, class VecFn>
void for_each_weight(const ModelWeights& w, MatFn&& mat, VecFn&& vec) {
  for_each_weight_impl(w, mat, vec);
}

// Bytes of every weight of `w` on the GPU (gpu_weight_bytes: what the CUDA backend holding all of it uploads).
inline uint64_t total_gpu_weight_bytes(const ModelWeights& w) {
  uint64_t n = 0;
  for_each_weight(
      w, [&](const WeightMat& x, WeightRole) { n += gpu_weight_bytes(x, is_mla_kv_b(w, x)); },
      [&](const FVec& x) { n += weight_bytes(x); });
  return n;
}

}  // namespace k3
