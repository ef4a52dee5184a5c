// GPU memory plan (always built, also without K3_CUDA: `k3 info` prints it): bytes of every weight
// the forward reads, per-session state and the activation workspace (gpu_work_sizes, which the
// GPU forward also allocates from, so the plan and the allocation cannot drift apart).
#include <algorithm>

#include "model/gpu_internal.h"

namespace k3 {

namespace {
size_t mat_bytes(const WeightMat& w) {
  if (w.empty()) return 0;
  switch (w.fmt) {
    case WFormat::F32: return size_t(w.rows * w.cols) * 4;
    case WFormat::F16:
    case WFormat::BF16: return size_t(w.rows * w.cols) * 2;
    case WFormat::MXFP4: return size_t(w.rows * w.cols / 2) + size_t(w.rows * (w.cols / 32));
  }
  return 0;
}
size_t vec_bytes(const std::vector<float>& v) { return v.size() * 4; }
size_t glu_bytes(const GluWeights& g) { return mat_bytes(g.gate) + mat_bytes(g.up) + mat_bytes(g.down); }
}  // namespace

GpuWorkSizes gpu_work_sizes(const ModelDims& d, int64_t T, int64_t dense_inter, int64_t shared_inter) {
  GpuWorkSizes w;
  w.tokens = T;
  w.hidden_bufs = 5;  // a, xn, y, h (output site), shared-expert output
  w.depth_slots = d.layers / std::max<int64_t>(1, d.block_size) + 2;
  const int64_t C = d.kda.dim(), D = d.kda.head_dim, Hk = d.kda.heads;
  w.kda = T * (10 * C + D + Hk);  // qh kh vh q k v f g r o, fa, beta
  const MlaDims& a = d.mla;
  w.mla = T * (a.q_lora + a.heads * (a.nope + a.rope) + a.kv_lora + a.rope + 2 * a.heads * a.v +
               2 * a.heads * a.kv_lora);  // qa, q, ckv, attn, gate, absorbed work (q_lat + o_lat)
  const MoeDims& e = d.moe;
  w.moe = T * (e.experts + 2 * e.top_k + 2 * e.latent + 2 * e.top_k * e.inter + e.top_k * e.latent +
               2 * shared_inter +  // router logits, idx + weights, z + agg, expert gate/up, expert out, shared
               2 * e.top_k * e.latent + 2 * e.top_k);  // prefill grouped by expert: rows in/out, row lists
  w.dense = T * 2 * dense_inter;
  w.logits = T * d.vocab;
  w.ids = T;
  return w;
}

GpuMemoryPlan gpu_memory_plan(const ModelConfig& c, size_t weight_bytes, const GpuOptions& o, int64_t context) {
  GpuMemoryPlan p;
  const ModelDims d = ModelDims::from_config(c);
  p.weights = weight_bytes;
  int64_t kda_layers = 0;
  for (int64_t L = 0; L < d.layers; ++L) kda_layers += c.is_kda(L) ? 1 : 0;
  const int64_t mla_layers = d.layers - kda_layers, C = d.kda.dim();
  p.state_fixed = size_t(kda_layers) * 4 * size_t(d.kda.heads * d.kda.head_dim * d.kda.head_dim + 3 * C * (d.kda.conv_k - 1));
  p.state_per_token = size_t(mla_layers) * 4 * size_t(d.mla.kv_lora + d.mla.rope);
  p.workspace = gpu_work_sizes(d, o.tokens_per_call, c.intermediate_size, c.shared_intermediate()).bytes(d.hidden);
  p.context = context;
  return p;
}

GpuMemoryPlan gpu_memory_plan(const Model& m, const GpuOptions& o, int64_t context) {
  size_t w = mat_bytes(m.embed) + mat_bytes(m.lm_head) + vec_bytes(m.final_norm) + vec_bytes(m.output_res.fold);
  for (const LayerWeights& l : m.layers) {
    w += vec_bytes(l.input_norm) + vec_bytes(l.post_norm) + vec_bytes(l.attn_res.fold) + vec_bytes(l.mlp_res.fold);
    if (l.is_kda) {
      const KdaWeights& k = l.kda;
      for (const WeightMat* x : {&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a_proj, &k.f_b_proj, &k.b_proj, &k.g_proj, &k.o_proj})
        w += mat_bytes(*x);
      for (const auto* v : {&k.q_conv, &k.k_conv, &k.v_conv, &k.A_log, &k.dt_bias, &k.o_norm}) w += vec_bytes(*v);
    } else {
      const MlaWeights& a = l.mla;
      for (const WeightMat* x : {&a.q_a_proj, &a.q_b_proj, &a.kv_a_proj, &a.kv_b_proj, &a.g_proj, &a.o_proj})
        w += mat_bytes(*x);
      w += vec_bytes(a.q_a_norm) + vec_bytes(a.kv_a_norm);
    }
    if (l.dense_ffn) {
      w += glu_bytes(l.dense);
    } else {
      const MoeWeights& e = l.moe;
      w += mat_bytes(e.gate) + vec_bytes(e.bias) + mat_bytes(e.down_lat) + vec_bytes(e.lat_norm) + mat_bytes(e.up_lat) +
           glu_bytes(e.shared);
      for (const GluWeights& x : e.experts) w += glu_bytes(x);
    }
  }
  return gpu_memory_plan(m.config(), w, o, context);
}

}  // namespace k3
