// Decode traffic and weight FLOPs per token (see traffic.h).
#include "model/traffic.h"

#include "model/model.h"

namespace k3 {

uint64_t weight_bytes(const WeightMat& w) {
  if (w.empty()) return 0;
  const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols);
  switch (w.fmt) {
    case WFormat::F32: return 4 * n;
    case WFormat::F16:
    case WFormat::BF16: return 2 * n;
    case WFormat::MXFP4: return n / 2 + n / 32;
  }
  return 0;
}

namespace {
double macs(const WeightMat& w) { return w.empty() ? 0.0 : double(w.rows) * double(w.cols); }

struct Acc {
  uint64_t bytes = 0;
  double flops = 0;
  void add(const WeightMat& w) {
    bytes += weight_bytes(w);
    flops += 2 * macs(w);
  }
  void add(const GluWeights& g) {
    add(g.gate);
    add(g.up);
    add(g.down);
  }
};
}  // namespace

DecodeTraffic decode_traffic(const Model& m, int64_t context) {
  const ModelDims& d = m.dims();
  DecodeTraffic t;
  Acc trunk;
  trunk.bytes += weight_bytes(m.embed) / uint64_t(d.vocab);  // one row looked up
  trunk.add(m.lm_head);
  t.lm_head_flops = 2 * macs(m.lm_head);
  double expert_flops = 0;
  for (const LayerWeights& L : m.layers) {
    if (L.is_kda) {
      for (const WeightMat* w : {&L.kda.q_proj, &L.kda.k_proj, &L.kda.v_proj, &L.kda.f_a_proj, &L.kda.f_b_proj,
                                 &L.kda.b_proj, &L.kda.g_proj, &L.kda.o_proj})
        trunk.add(*w);
      const uint64_t C = uint64_t(d.kda.dim());
      t.kda_state += 2 * 4 * (uint64_t(d.kda.heads) * d.kda.head_dim * d.kda.head_dim + 3 * C * uint64_t(d.kda.conv_k - 1));
    } else {
      for (const WeightMat* w : {&L.mla.q_a_proj, &L.mla.q_b_proj, &L.mla.kv_a_proj, &L.mla.kv_b_proj, &L.mla.g_proj,
                                 &L.mla.o_proj})
        trunk.add(*w);
      t.mla_cache += uint64_t(context) * uint64_t(d.mla.kv_lora + d.mla.rope) * 4;
    }
    if (L.dense_ffn) {
      trunk.add(L.dense);
    } else {
      trunk.add(L.moe.gate);
      trunk.add(L.moe.down_lat);
      trunk.add(L.moe.up_lat);
      trunk.add(L.moe.shared);
      Acc all;
      for (const GluWeights& e : L.moe.experts) all.add(e);
      const double n = double(L.moe.experts.size());
      if (n > 0) {
        t.experts += uint64_t(double(all.bytes) / n * double(d.moe.top_k));
        expert_flops += all.flops / n * double(d.moe.top_k);
      }
    }
  }
  t.trunk = trunk.bytes;
  t.weight_flops = trunk.flops + expert_flops;
  return t;
}

}  // namespace k3
