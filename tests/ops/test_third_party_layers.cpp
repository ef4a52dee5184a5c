// Third-party sublayer and decoder-layer fixtures (shared/fixtures/third-party/kimi-k3-in-c-ops):
// mla (mla_sublayer), kda_layer1/8 (kda_sublayer), moe (moe_sublayer), layer_kda / layer_mla
// (decoder_layer with Block AttnRes depth state). Weights are bound as F32 WeightMat views into the
// fixture. Pass rule (MANIFEST.json): |a - e| <= 1e-5 + 1e-4·|e| elementwise. Layouts are stated per test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cpu_levels.h"
#include "common/json_fixture.h"
#include "common/num_util.h"
#include "common/op_tolerances.h"
#include "model/layer_runner.h"
#include "model/layers.h"
#include "model/model.h"
#include "ops/cpu/isa.h"

namespace {

using k3test::all_close;
using k3test::count_nan;
using k3test::Fixture;
using k3test::nan_vec;

constexpr double kAbs = 1e-5;  // MANIFEST.json tolerance.fp32_abs
constexpr double kRel = 1e-4;  // MANIFEST.json tolerance.fp32_rel

// Config of the fixture model (MANIFEST.json "config"), as the layer tests need it.
constexpr int64_t kHidden = 128, kKdaHeads = 4, kKdaDim = 16, kConvK = 4;
constexpr int64_t kMlaHeads = 4, kQLora = 64, kKvLora = 32, kNope = 24, kRope = 8, kV = 16;
constexpr int64_t kExperts = 8, kTopK = 2, kLatent = 64, kMoeInter = 48, kSharedInter = 2 * 48;
constexpr float kEps = 1e-5f;

Fixture open_fx(const char* name) { return Fixture(k3test::third_party_ops_dir() / name); }

k3::WeightMat wm(Fixture& f, const std::string& key, int64_t rows, int64_t cols) {
  return k3::wmat_f32(f.arr(key, {rows, cols}).data(), rows, cols);
}
// Squeezed 1-D view of a fixture vector with the given shape (the fixture keeps the data alive).
k3::FVec vec(Fixture& f, const std::string& key, const std::vector<int64_t>& shape) {
  const auto& v = f.arr(key, shape);
  return k3::FVec{v.data(), int64_t(v.size())};
}

// ---------------------------------------------------------------- binders
k3::KdaDims kda_dims() {
  k3::KdaDims d;
  d.hidden = kHidden;
  d.heads = kKdaHeads;
  d.head_dim = kKdaDim;
  d.conv_k = kConvK;
  d.lower_bound = -5.0f;
  d.norm_eps = kEps;
  return d;
}

// names: the fixture's key for each KDA tensor (the standalone and the decoder-layer fixtures differ).
struct KdaNames {
  std::string q, k, v, g, o, fa, fb, b, qc, kc, vc, A, dt, on;
};
const KdaNames kKdaLayerNames{"q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a",     "f_b",
                              "b_proj", "q_conv", "k_conv", "v_conv", "A_log",  "dt_bias", "o_norm"};
const KdaNames kDecoderKdaNames{"self_attn_q_proj_weight",   "self_attn_k_proj_weight",   "self_attn_v_proj_weight",
                                "self_attn_g_proj_weight",   "self_attn_o_proj_weight",   "self_attn_f_a_proj_weight",
                                "self_attn_f_b_proj_weight", "self_attn_b_proj_weight",   "self_attn_q_conv1d_weight",
                                "self_attn_k_conv1d_weight", "self_attn_v_conv1d_weight", "self_attn_A_log",
                                "self_attn_dt_bias",         "self_attn_o_norm_weight"};

// KDA layout: projections [out, in] row-major (PyTorch Linear); conv [C,1,K] = [C,K] taps oldest→newest
// (K-1 = current input, as in shortconv.json); A_log [H] per head; dt_bias [H·D]; o_norm [D].
k3::KdaWeights bind_kda(Fixture& f, const KdaNames& n) {
  const int64_t P = kKdaHeads * kKdaDim;
  k3::KdaWeights w;
  w.q_proj = wm(f, n.q, P, kHidden);
  w.k_proj = wm(f, n.k, P, kHidden);
  w.v_proj = wm(f, n.v, P, kHidden);
  w.g_proj = wm(f, n.g, P, kHidden);
  w.o_proj = wm(f, n.o, kHidden, P);
  w.f_a_proj = wm(f, n.fa, kKdaDim, kHidden);
  w.f_b_proj = wm(f, n.fb, P, kKdaDim);
  w.b_proj = wm(f, n.b, kKdaHeads, kHidden);
  w.q_conv = vec(f, n.qc, {P, 1, kConvK});
  w.k_conv = vec(f, n.kc, {P, 1, kConvK});
  w.v_conv = vec(f, n.vc, {P, 1, kConvK});
  w.A_log = vec(f, n.A, {kKdaHeads});
  w.dt_bias = vec(f, n.dt, {P});
  w.o_norm = vec(f, n.on, {kKdaDim});
  return w;
}

k3::MlaDims mla_dims() {
  k3::MlaDims d;
  d.hidden = kHidden;
  d.heads = kMlaHeads;
  d.q_lora = kQLora;
  d.kv_lora = kKvLora;
  d.nope = kNope;
  d.rope = kRope;
  d.v = kV;
  d.lora_eps =
      kEps;  // the third-party project used rms_eps (1e-5) for the LoRA norms; the spec's 1e-6 is the real model's
  d.output_gate = true;
  return d;
}

// MLA layout: kv_a_proj_with_mqa [kv_lora + rope, hidden] (latent rows first, then k_r);
// kv_b_proj [heads·(nope+v), kv_lora] per head [W_UK rows | W_UV rows]; q_b_proj [heads·(nope+rope), q_lora]
// per head [nope | rope]; g_proj [heads·v, hidden]. `p` = key prefix ("" or "self_attn_").
k3::MlaWeights bind_mla(Fixture& f, const std::string& p) {
  k3::MlaWeights w;
  w.q_a_proj = wm(f, p + "q_a_proj_weight", kQLora, kHidden);
  w.q_b_proj = wm(f, p + "q_b_proj_weight", kMlaHeads * (kNope + kRope), kQLora);
  w.kv_a_proj = wm(f, p + "kv_a_proj_with_mqa_weight", kKvLora + kRope, kHidden);
  w.kv_b_proj = wm(f, p + "kv_b_proj_weight", kMlaHeads * (kNope + kV), kKvLora);
  w.g_proj = wm(f, p + "g_proj_weight", kMlaHeads * kV, kHidden);
  w.o_proj = wm(f, p + "o_proj_weight", kHidden, kMlaHeads * kV);
  w.q_a_norm = vec(f, p + "q_a_layernorm_weight", {kQLora});
  w.kv_a_norm = vec(f, p + "kv_a_layernorm_weight", {kKvLora});
  return w;
}

k3::MoeDims moe_dims() {
  k3::MoeDims d;
  d.hidden = kHidden;
  d.latent = kLatent;
  d.inter = kMoeInter;
  d.experts = kExperts;
  d.top_k = kTopK;
  d.renormalize = true;
  d.latent_norm = true;
  d.routed_scale = 1.0f;
  d.norm_eps = kEps;
  d.situ = {4.0f, 25.0f};
  return d;
}

// MoE layout: gate [E, hidden]; down_weight [latent, hidden] = routed_expert_down_proj; up_weight
// [hidden, latent]; norm_weight [latent] = routed_expert_norm; experts_e_w1/w3 [inter, latent] = gate/up,
// w2 [latent, inter] = down; shared_w1/w3 [2·inter, hidden], shared_w2 [hidden, 2·inter] = the fused
// shared MLP (gate/up/down). `p` = key prefix ("" or "mlp_").
k3::MoeWeights bind_moe(Fixture& f, const std::string& p) {
  k3::MoeWeights w;
  w.gate = wm(f, p + "gate_weight", kExperts, kHidden);
  w.bias = vec(f, p + "e_score_correction_bias", {kExperts});
  w.down_lat = wm(f, p + "down_weight", kLatent, kHidden);
  w.up_lat = wm(f, p + "up_weight", kHidden, kLatent);
  w.lat_norm = vec(f, p + "norm_weight", {kLatent});
  for (int64_t e = 0; e < kExperts; ++e) {
    const std::string q = p + "experts_" + std::to_string(e) + "_";
    k3::GluWeights g;
    g.gate = wm(f, q + "w1_weight", kMoeInter, kLatent);
    g.up = wm(f, q + "w3_weight", kMoeInter, kLatent);
    g.down = wm(f, q + "w2_weight", kLatent, kMoeInter);
    w.experts.push_back(g);
  }
  w.shared.gate = wm(f, p + "shared_w1_weight", kSharedInter, kHidden);
  w.shared.up = wm(f, p + "shared_w3_weight", kSharedInter, kHidden);
  w.shared.down = wm(f, p + "shared_w2_weight", kHidden, kSharedInter);
  return w;
}

// ================================================================ MLA
// mla.json — in [1,6,128] = [T, hidden] fed straight to the sublayer (already normed); out [1,6,128];
// kv_latent [1,6,32] = post-norm latent c per token = MlaCache::c; k_rope [1,6,8] = raw shared k_r =
// MlaCache::kr. Fresh cache, causal over the 6 tokens.
TEST(ThirdPartyLayers, Mla) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  Fixture f = open_fx("mla.json");
  ASSERT_EQ(f.val<int64_t>("n_heads"), kMlaHeads);
  ASSERT_EQ(f.val<int64_t>("qk_nope"), kNope);
  ASSERT_EQ(f.val<int64_t>("qk_rope"), kRope);
  ASSERT_EQ(f.val<int64_t>("kv_lora"), kKvLora);
  ASSERT_EQ(f.val<int64_t>("q_lora"), kQLora);
  ASSERT_EQ(f.val<int64_t>("v_head"), kV);
  ASSERT_FLOAT_EQ(f.val<float>("rms_eps"), kEps);
  ASSERT_NEAR(f.val<double>("scale"), 1.0 / std::sqrt(double(kNope + kRope)), 1e-7);
  const int64_t T = 6;
  const auto& x = f.arr("in", {1, T, kHidden});
  const auto& e = f.arr("out", {1, T, kHidden});
  const auto& e_c = f.arr("kv_latent", {1, T, kKvLora});
  const auto& e_kr = f.arr("k_rope", {1, T, kRope});
  const k3::MlaDims d = mla_dims();
  const k3::MlaWeights w = bind_mla(f, "");
  for (auto algo : {k3::MlaAlgo::Expanded, k3::MlaAlgo::Absorbed}) {
    const char* an = algo == k3::MlaAlgo::Expanded ? "Expanded" : "Absorbed";
    // Whole prompt in one call, then the same tokens fed as 4 + 2 and one at a time (cache reuse).
    for (const auto& split :
         {std::vector<int64_t>{6}, std::vector<int64_t>{4, 2}, std::vector<int64_t>{1, 1, 1, 1, 1, 1}}) {
      SCOPED_TRACE(std::string(an) + " calls=" + std::to_string(split.size()));
      k3::ModelDims md;
      md.mla = d;
      k3::LayerRunner seq(md, {false});
      auto out = nan_vec(e.size());
      int64_t t0 = 0;
      for (int64_t n : split) {
        seq.step(n, [&](const k3::StepCtx& c) {
          k3::mla_sublayer(c, d, w, seq.pool.mla(0), x.data() + t0 * kHidden, algo, out.data() + t0 * kHidden);
        });
        t0 += n;
      }
      EXPECT_EQ(count_nan(out), 0u);
      EXPECT_TRUE(all_close(out, e, kAbs, kRel)) << "out";
      EXPECT_EQ(seq.pool.position(seq.slot), T);
      std::vector<float> c, kr;
      seq.pool.read_mla(seq.slot, 0, c, kr);
      EXPECT_TRUE(all_close(c, e_c, kAbs, kRel)) << "cache c vs kv_latent";
      EXPECT_TRUE(all_close(kr, e_kr, kAbs, kRel)) << "cache k_r vs k_rope";
    }
  }
}

// ================================================================ KDA layer
// kda_layer1/8.json — in [1,T,128] = [T, hidden] fed straight to kda_sublayer (already normed: the
// fixture has no norm weight); zero initial recurrent and conv state; out [1,T,128];
// state_out [1,4,16,16] = [H, Dk, Dv] (key rows; the layout kda_recur*.json confirmed) = KdaState::S.
void check_kda_layer(const char* file) {
  Fixture f = open_fx(file);
  const int64_t T = f.val<int64_t>("T");
  ASSERT_EQ(f.val<int64_t>("H"), kKdaHeads);
  ASSERT_EQ(f.val<int64_t>("d_k"), kKdaDim);
  ASSERT_EQ(f.val<int64_t>("conv_k"), kConvK);
  ASSERT_FLOAT_EQ(f.val<float>("lower_bound"), -5.0f);
  ASSERT_FLOAT_EQ(f.val<float>("rms_eps"), kEps);
  const auto& x = f.arr("in", {1, T, kHidden});
  const auto& e = f.arr("out", {1, T, kHidden});
  const auto& e_S = f.arr("state_out", {1, kKdaHeads, kKdaDim, kKdaDim});
  const k3::KdaDims d = kda_dims();
  const k3::KdaWeights w = bind_kda(f, kKdaLayerNames);
  struct Run {
    const char* name;
    k3::KdaAlgo algo;
    int64_t chunk;
    std::vector<int64_t> split;
  };
  std::vector<Run> runs = {{"Recurrent", k3::KdaAlgo::Recurrent, 0, {T}},
                           {"Chunked(64)", k3::KdaAlgo::Chunked, 64, {T}},
                           {"Chunked(3)", k3::KdaAlgo::Chunked, 3, {T}}};
  if (T > 1) {
    runs.push_back({"Chunked(3) split 5+rest", k3::KdaAlgo::Chunked, 3, {5, T - 5}});
    runs.push_back({"Recurrent token by token", k3::KdaAlgo::Recurrent, 0, std::vector<int64_t>(size_t(T), 1)});
  }
  for (const auto& r : runs) {
    SCOPED_TRACE(std::string(file) + " " + r.name);
    k3::ModelDims md;
    md.kda = d;
    k3::LayerRunner seq(md, {true});
    auto out = nan_vec(e.size());
    int64_t t0 = 0;
    for (int64_t n : r.split) {
      seq.step(n, [&](const k3::StepCtx& c) {
        k3::kda_sublayer(c, d, w, seq.pool.kda(0), x.data() + t0 * kHidden, r.algo, std::max<int64_t>(r.chunk, 1),
                         out.data() + t0 * kHidden);
      });
      t0 += n;
    }
    EXPECT_EQ(count_nan(out), 0u);
    EXPECT_TRUE(all_close(out, e, kAbs, kRel)) << "out";
    std::vector<float> S, conv[3];
    seq.pool.read_kda(seq.slot, 0, S, conv);
    EXPECT_TRUE(all_close(S, e_S, kAbs, kRel)) << "state_out";
  }
}
TEST(ThirdPartyLayers, KdaLayer1) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  check_kda_layer("kda_layer1.json");
}
TEST(ThirdPartyLayers, KdaLayer8) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  check_kda_layer("kda_layer8.json");
}

// ================================================================ MoE
// moe_sublayer on rows [t0, t0 + n) of x (a sequence of its own: the MoE keeps no state).
void run_moe(const k3::MoeWeights& w, const float* x, int64_t n, float* out,
             k3::StepNumerics num = k3::StepNumerics::Exact) {
  k3::LayerRunner seq(k3::ModelDims{}, {});
  seq.step(
      n, [&](const k3::StepCtx& c) { k3::moe_sublayer(c, moe_dims(), w, x, out, nullptr); }, num);
}
// moe.json — in [1,3,128] = [T, hidden] fed straight to moe_sublayer (already post-norm); out [1,3,128]
// = routed (latent, normed aggregate, up) + shared MLP. Weight layout as in bind_moe.
TEST(ThirdPartyLayers, Moe) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  Fixture f = open_fx("moe.json");
  ASSERT_EQ(f.val<int64_t>("hidden"), kHidden);
  ASSERT_EQ(f.val<int64_t>("latent"), kLatent);
  ASSERT_EQ(f.val<int64_t>("moe_inter"), kMoeInter);
  ASSERT_EQ(f.val<int64_t>("n_experts"), kExperts);
  ASSERT_EQ(f.val<int64_t>("top_k"), kTopK);
  ASSERT_EQ(f.val<int64_t>("n_shared") * kMoeInter, kSharedInter);
  ASSERT_EQ(f.val<int>("renorm"), 1);
  ASSERT_EQ(f.val<int>("latent_norm"), 1);
  ASSERT_FLOAT_EQ(f.val<float>("routed_scale"), 1.0f);
  ASSERT_FLOAT_EQ(f.val<float>("rms_eps"), kEps);
  ASSERT_FLOAT_EQ(f.val<float>("situ_b1"), 4.0f);
  ASSERT_FLOAT_EQ(f.val<float>("situ_b2"), 25.0f);
  const int64_t T = 3;
  const auto& x = f.arr("in", {1, T, kHidden});
  const auto& e = f.arr("out", {1, T, kHidden});
  const k3::MoeWeights w = bind_moe(f, "");
  auto out = nan_vec(e.size());
  run_moe(w, x.data(), T, out.data());
  EXPECT_EQ(count_nan(out), 0u);
  EXPECT_TRUE(all_close(out, e, kAbs, kRel));
  // Token by token gives the same result (no cross-token state in the MoE).
  auto out1 = nan_vec(e.size());
  for (int64_t t = 0; t < T; ++t) run_moe(w, x.data() + t * kHidden, 1, out1.data() + t * kHidden);
  EXPECT_TRUE(all_close(out1, e, kAbs, kRel)) << "one token per call";
}

// The MoE's SIMD decode path (all experts' products in two parallel regions) on every CPU level (one
// test per level; those this CPU lacks skip by name), in fp32 and fast numerics (the fixture has no
// MXFP4 weights, so fast is fp32 at T = 1): fp32 sums, so the project's fp32 reduction tolerance
// (relative L2), not the fp64 fixture's.
class ThirdPartyMoeLevels : public k3test::CpuLevelTest {};

TEST_P(ThirdPartyMoeLevels, OneTokenPerCallMatchesFixture) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  Fixture f = open_fx("moe.json");
  const int64_t T = 3;
  const auto& x = f.arr("in", {1, T, kHidden});
  const auto& e = f.arr("out", {1, T, kHidden});
  const k3::MoeWeights w = bind_moe(f, "");
  for (auto num : {k3::ops::Numerics::F32, k3::ops::Numerics::Fast}) {
    const auto sn = num == k3::ops::Numerics::F32 ? k3::StepNumerics::F32 : k3::StepNumerics::Fast;
    auto o = nan_vec(e.size());
    for (int64_t t = 0; t < T; ++t) run_moe(w, x.data() + t * kHidden, 1, o.data() + t * kHidden, sn);
    EXPECT_EQ(count_nan(o), 0u);
    EXPECT_LE(k3test::rel_l2(o, e), k3test::kTolReduce)
        << k3::ops::cpu_isa_name(GetParam()) << " " << k3::ops::numerics_name(num) << ", one token per call";
  }
}

INSTANTIATE_TEST_SUITE_P(Level, ThirdPartyMoeLevels, k3test::all_cpu_levels(), k3test::cpu_level_name);

// ================================================================ decoder layer
// layer_kda.json / layer_mla.json — one whole decoder layer (§3.3 steps 1-7) on T=4 tokens.
// Depth state: block_residual_in [T, nblocks, H] → DepthState::blocks[j][t·H + i] =
// block_residual_in[(t·nblocks + j)·H + i]; `in` [1,T,H] = the incoming partial sum P. Expected:
// `out` [1,T,H] = the new partial sum, block_residual_out [T, nblocks', H] = blocks after the layer
// (layer 3 with block size 3 snapshots P, so nblocks' = 3 there; layer 1 leaves the 2 blocks).
// AttnRes folds = *_res_norm_weight ⊙ *_res_proj_weight ([1,H] squeezed). Layer ≥ 1 → MoE FFN.
k3::ModelDims model_dims(Fixture& f) {
  k3::ModelDims d;
  d.hidden = kHidden;
  d.vocab = 256;
  d.layers = 13;
  d.block_size = f.val<int64_t>("attn_res_block_size");
  d.eps = f.val<float>("rms_eps");
  d.kda = kda_dims();
  d.mla = mla_dims();
  d.moe = moe_dims();
  d.situ = {4.0f, 25.0f};
  return d;
}

k3::AttnResSite fold(Fixture& f, const std::string& p, std::vector<float>& keep) {
  const auto& nw = f.arr(p + "_norm_weight", {kHidden});
  const auto& pw = f.arr(p + "_proj_weight", {1, kHidden});
  keep.resize(size_t(kHidden));
  for (int64_t i = 0; i < kHidden; ++i) keep[size_t(i)] = nw[size_t(i)] * pw[size_t(i)];
  return k3::AttnResSite{k3::FVec{keep.data(), kHidden}};
}

void check_decoder_layer(const char* file, bool expect_mla) {
  Fixture f = open_fx(file);
  ASSERT_EQ(f.val<bool>("is_mla"), expect_mla);
  ASSERT_EQ(f.val<int64_t>("hidden"), kHidden);
  const int64_t L = f.val<int64_t>("layer_idx"), T = 4;
  const k3::ModelDims d = model_dims(f);
  k3::LayerWeights w;
  w.input_norm = vec(f, "input_layernorm_weight", {kHidden});
  w.post_norm = vec(f, "post_attention_layernorm_weight", {kHidden});
  std::vector<float> attn_fold, mlp_fold;
  w.attn_res = fold(f, "self_attention_res", attn_fold);
  w.mlp_res = fold(f, "mlp_res", mlp_fold);
  w.is_kda = !expect_mla;
  if (expect_mla)
    w.mla = bind_mla(f, "self_attn_");
  else
    w.kda = bind_kda(f, kDecoderKdaNames);
  w.dense_ffn = false;
  w.moe = bind_moe(f, "mlp_");

  const auto& in = f.arr("in", {1, T, kHidden});
  const auto& bri_shape = f.shape("block_residual_in");
  const auto& bro_shape = f.shape("block_residual_out");
  ASSERT_EQ(bri_shape.size(), 3u);
  ASSERT_EQ(bro_shape.size(), 3u);
  const int64_t nb_in = bri_shape[1], nb_out = bro_shape[1];
  const auto& bri = f.arr("block_residual_in", {T, nb_in, kHidden});
  const auto& bro = f.arr("block_residual_out", {T, nb_out, kHidden});
  const auto& e = f.arr("out", {1, T, kHidden});
  EXPECT_EQ(nb_out, nb_in + (L % d.block_size == 0 ? 1 : 0)) << "fixture's block count follows the snapshot rule";

  std::vector<k3::ForwardOptions> opts(3);
  opts[0].kda_algo = k3::KdaAlgo::Recurrent;
  opts[0].mla_algo = k3::MlaAlgo::Expanded;
  opts[1].kda_algo = k3::KdaAlgo::Chunked;
  opts[1].kda_chunk = 64;
  opts[1].mla_algo = k3::MlaAlgo::Absorbed;
  opts[2].kda_algo = k3::KdaAlgo::Chunked;
  opts[2].kda_chunk = 3;
  opts[2].mla_algo = k3::MlaAlgo::Expanded;
  for (size_t oi = 0; oi < opts.size(); ++oi) {
    SCOPED_TRACE(std::string(file) + " options #" + std::to_string(oi));
    // The incoming blocks and partial sum, and spare buffers for a snapshot's new partial sum.
    std::vector<std::vector<float>> bufs(size_t(nb_out + 2), std::vector<float>(size_t(T * kHidden)));
    k3::DepthState depth;
    for (int64_t j = 0; j < nb_in; ++j) {
      std::vector<float>& b = bufs[size_t(j)];
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(bri.begin() + (t * nb_in + j) * kHidden, kHidden, b.begin() + t * kHidden);
      depth.blocks.push_back(b.data());
    }
    std::vector<float*> spare;
    for (auto& b : bufs) spare.push_back(b.data());
    std::copy(in.begin(), in.end(), bufs[size_t(nb_in)].begin());
    depth.partial = bufs[size_t(nb_in)].data();
    depth.partial_empty = false;
    std::vector<bool> kinds(size_t(L + 1), true);
    kinds[size_t(L)] = !expect_mla;
    k3::LayerRunner seq(d, kinds);
    std::vector<float> a(size_t(T * kHidden)), xn(a.size()), y(a.size());
    seq.step(T, [&](const k3::StepCtx& c) {
      k3::decoder_layer(c, d, L, w, seq.pool, depth, spare.data(), a.data(), xn.data(), y.data(), opts[oi]);
      k3::settle_depth(c, depth, kHidden);
    });
    const std::vector<float> partial(depth.partial, depth.partial + T * kHidden);
    EXPECT_EQ(count_nan(partial), 0u);
    EXPECT_TRUE(all_close(partial, e, kAbs, kRel)) << "out (new partial sum)";
    ASSERT_EQ(int64_t(depth.blocks.size()), nb_out);
    std::vector<float> blocks_flat(bro.size(), k3test::qnan());
    for (int64_t j = 0; j < nb_out; ++j)
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(depth.blocks[size_t(j)] + t * kHidden, kHidden, blocks_flat.begin() + (t * nb_out + j) * kHidden);
    EXPECT_TRUE(all_close(blocks_flat, bro, kAbs, kRel)) << "block_residual_out";
  }
}
TEST(ThirdPartyLayers, DecoderLayerKda) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  check_decoder_layer("layer_kda.json", false);
}
TEST(ThirdPartyLayers, DecoderLayerMla) {
  K3_REQUIRE_THIRD_PARTY_OPS();
  check_decoder_layer("layer_mla.json", true);
}

}  // namespace
