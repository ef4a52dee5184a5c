// What one decode step must read (bytes) and what one prefill token costs in weight FLOPs, from the
// bound weights' actual formats: the numerators of the roofline ratios `k3 bench` reports.
// Owns: the byte/FLOP accounting per tensor kind. Must not: time anything or touch weight values.
#pragma once
#include <cstdint>

namespace k3 {

class Model;




struct DecodeTraffic {
  uint64_t trunk = 0;     // every weight matrix a token reads except routed experts (lm_head included,
                          // the embedding table counted as one row)
  uint64_t experts = 0;   // top_k routed experts per MoE layer (bytes of the average expert)
  uint64_t kda_state = 0; // KDA recurrent + conv state, read and written (2x its size)
  uint64_t mla_cache = 0; // latent cache read at the given context length (fp32 as held)
  uint64_t total() const { return trunk + experts + kda_state + mla_cache; }
  // Weight multiply-adds per token x 2 (= FLOPs of the GEMM-dominated part, attention excluded),
  // for a token whose logits are computed; lm_head_flops is the lm_head's part of it.
  double weight_flops = 0, lm_head_flops = 0;
  // Weight FLOPs per token of a prefill of n tokens in `pieces` forward calls that each compute
  // the logits of their last token only (the lm_head runs `pieces` times, not n).
  double prefill_flops_per_token(int64_t n, int64_t pieces) const {
    return weight_flops - lm_head_flops + lm_head_flops * double(pieces) / double(n);
  }
};

DecodeTraffic decode_traffic(const Model& m, int64_t context);

}  // namespace k3
