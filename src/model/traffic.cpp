// Decode traffic and weight FLOPs per token (see traffic.h), by walking every weight once.
#include "model/traffic.h"

#include <algorithm>

#include "core/error.h"
#include "model/model.h"

namespace k3 {

DecodeTraffic decode_traffic(const Model& m, int64_t context, int64_t n_seqs) {
  if (n_seqs < 1) throw Error("decode_traffic: n_seqs must be >= 1");
  const ModelDims& d = m.dims();
  DecodeTraffic t;
  t.n_seqs = n_seqs;
  uint64_t trunk = 0, expert_bytes = 0;
  double trunk_flops = 0, expert_flops = 0;
  int64_t experts = 0;
  for_each_weight(
      m.weights(),
      [&](const WeightMat& w, WeightRole role) {
        const double flops = 2.0 * double(w.rows) * double(w.cols);
        switch (role) {
          case WeightRole::Embedding:  // one row looked up per sequence
            trunk += weight_bytes(w) / uint64_t(d.vocab) * uint64_t(n_seqs);
            break;
          case WeightRole::RoutedExpert:
            expert_bytes += weight_bytes(w);
            expert_flops += flops;
            break;
          case WeightRole::LmHead:
            t.lm_head_flops = flops;
            [[fallthrough]];
          case WeightRole::Trunk:
          case WeightRole::Router:
            trunk += weight_bytes(w);
            trunk_flops += flops;
            break;
        }
      },
      [](const FVec&) {});              // norm gains and biases: not counted (a few KiB)
  int64_t moe_layers = 0, touched = 0;  // touched: experts read per step, summed over the MoE layers
  for (const LayerWeights& L : m.layers)
    if (!L.dense_ffn) {
      const int64_t e = int64_t(L.moe.experts.size());
      experts += e;
      touched += std::min(n_seqs * d.moe.top_k, e);
      ++moe_layers;
    }
  // Bytes of the average expert x the experts a step reads; a token's FLOPs: top_k of them per layer.
  if (experts > 0) {
    t.experts = uint64_t(double(expert_bytes) * (double(touched) / double(experts)));
    t.experts_per_layer = double(touched) / double(moe_layers);
    expert_flops *= double(d.moe.top_k) * double(moe_layers) / double(experts);
  }
  t.kda_state = 2 * d.kda_state_bytes() * uint64_t(n_seqs);  // read and written
  t.mla_cache = d.mla_bytes_per_token() * uint64_t(context) * uint64_t(n_seqs);
  t.trunk = trunk;
  t.weight_flops = trunk_flops + expert_flops;
  return t;
}

}  // namespace k3
