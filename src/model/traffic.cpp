// Decode traffic and weight FLOPs per token (see traffic.h), by walking every weight once.
#include "model/traffic.h"

#include "model/model.h"

namespace k3 {

DecodeTraffic decode_traffic(const Model& m, int64_t context) {
  const ModelDims& d = m.dims();
  DecodeTraffic t;
  uint64_t trunk = 0, expert_bytes = 0;
  double trunk_flops = 0, expert_flops = 0;
  int64_t experts = 0;
  for_each_weight(
      m.weights(),
      [&](const WeightMat& w, WeightRole role) {
        const double flops = 2.0 * double(w.rows) * double(w.cols);
        switch (role) {
          case WeightRole::Embedding: trunk += weight_bytes(w) / uint64_t(d.vocab); break;  // one row looked up
          case WeightRole::RoutedExpert:
            expert_bytes += weight_bytes(w);
            expert_flops += flops;
            break;
          case WeightRole::LmHead: t.lm_head_flops = flops; [[fallthrough]];
          case WeightRole::Trunk:
          case WeightRole::Router:
            trunk += weight_bytes(w);
            trunk_flops += flops;
            break;
        }
      },
      [](const FVec&) {});  // norm gains and biases: not counted (a few KiB)
  int64_t moe_layers = 0;
  for (const LayerWeights& L : m.layers)
    if (!L.dense_ffn) {
      experts += int64_t(L.moe.experts.size());
      ++moe_layers;
    }
  // top_k of the average expert per MoE layer.
  if (experts > 0) {
    const double per_layer = double(d.moe.top_k) * double(moe_layers) / double(experts);
    t.experts = uint64_t(double(expert_bytes) * per_layer);
    expert_flops *= per_layer;
  }
  t.kda_state = 2 * d.kda_state_bytes();  // read and written
  t.mla_cache = d.mla_bytes_per_token() * uint64_t(context);
  t.trunk = trunk;
  t.weight_flops = trunk_flops + expert_flops;
  return t;
}

}  // namespace k3
