// What one decode step must read (bytes) and what one prefill token costs in weight FLOPs, from the
// bound weights' actual formats: the numerators of the roofline ratios `k3 bench` reports.
// Owns: the byte/FLOP accounting per tensor kind. Must not: time anything or touch weight values.
#pragma once
#include <cstdint>

namespace k3 {

class Model;

// One decode step of n_seqs sequences, one token each (n_seqs = 1: one token's traffic).
struct DecodeTraffic {
  int64_t n_seqs = 1;
  uint64_t trunk = 0;    // every weight matrix a token reads except routed experts (lm_head included),
                         // read once per step, plus one embedding row per sequence
  uint64_t experts = 0;  // experts_per_layer routed experts per MoE layer (bytes of the average expert)
  // min(n_seqs x top_k, experts of the layer), averaged over the MoE layers: the most experts the
  // union of the step's selections can hold (the union itself is known only after routing; for
  // n_seqs = 1 it is exactly top_k).
  double experts_per_layer = 0;
  uint64_t kda_state = 0;  // KDA recurrent + conv state of every sequence, read and written (2x its size)
  uint64_t mla_cache = 0;  // every sequence's latent cache read at the given context length (fp32 as held)
  uint64_t total() const { return trunk + experts + kda_state + mla_cache; }
  // Weight multiply-adds per token x 2 (= FLOPs of the GEMM-dominated part, attention excluded),
  // for a token whose logits are computed (top_k experts, whatever n_seqs); lm_head_flops is the
  // lm_head's part of it.
  double weight_flops = 0, lm_head_flops = 0;
  // Weight FLOPs per token of a prefill of n tokens in `pieces` forward calls that each compute
  // the logits of their last token only (the lm_head runs `pieces` times, not n).
  double prefill_flops_per_token(int64_t n, int64_t pieces) const {
    return weight_flops - lm_head_flops + lm_head_flops * double(pieces) / double(n);
  }
};

DecodeTraffic decode_traffic(const Model& m, int64_t context, int64_t n_seqs = 1);

}  // namespace k3
