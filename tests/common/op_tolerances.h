// The stated tolerance of each op (relative L2 error of a CPU kernel, at any level, vs its fp64
// twin in k3::ref unless stated), shared by the op tests (test_ops_twins, test_ops_levels,
// test_gemm_levels) so each is stated once. Never loosened to make a test pass.
#pragma once

namespace k3test {

// Elementwise ops (situ_glu, kda_gate, rmsnorm, l2norm_scale): a handful of fp32 roundings per
// element (exp/tanh/sqrt/div, <= ~2 ulp each for the vector versions) ≈ 1e-7 relative, so 1e-6
// leaves ~10x headroom.
constexpr double kTolElementwise = 1e-6;
// Short conv + SiLU: a K-term fp32 dot per element then SiLU; cancellation in the dot can push
// single elements' relative error up, but the aggregate stays ~1e-7; 1e-6.
constexpr double kTolConv = 1e-6;
// Reductions over up to a few hundred terms in fp32 (matmul, attention, AttnRes mix): error grows
// like sqrt(n)·ulp ≈ 1e-6 for these sizes; 1e-5 is the project-wide fp32 reduction tolerance.
constexpr double kTolReduce = 1e-5;
// KDA (recurrent kernel vs twin, chunked vs recurrence, with carried state; fp32 state and
// factored decays in the SIMD versions): the brief's bound.
constexpr double kTolKda = 1e-5;
// KDA on the tensor cores (cuda::kda_chunked_tc_varlen, the bf16 prefill of `fast` numerics): every
// matrix operand rounded to bf16 (2^-9 relative) with fp32 accumulation and an fp32 state; per-op
// errors of ~3e-3 relative that the delta rule and the decay keep from growing along the sequence
// (as fla's and FlashKDA's bf16 kernels). 2e-2 rel-L2 on outputs and final states.
constexpr double kTolKdaBf16 = 2e-2;
// MLA absorbed vs expanded: the same math re-associated through the latent, fp32 dots over up to
// kv_lora = 512 terms and an fp32 online softmax; the fp32 reduction bound.
constexpr double kTolMla = 1e-5;
// The GPU's tensor-core MLA prefill (mla_attend_tc_paged) against the fp64 twin: q, the latents, the
// expanded keys and values and the softmax weights are rounded to bf16 (2^-9 each), fp32 sums.
constexpr double kTolMlaTc = 1e-2;
// Router weights: one sigmoid + one division per weight in fp32.
constexpr double kTolRouter = 1e-6;

}  // namespace k3test
