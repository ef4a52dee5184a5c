// The MoE's shared experts left pending (moe_sublayer's shared_out, DepthState::pending2): the next
// residual site adds out + shared_out, so the MoE no longer adds them itself. The two parts must add
// up, bit for bit, to the sum the MoE forms when it is not lent the buffer (out = routed up-projection
// + shared experts, one fp32 add per element), on K3-nano's MoE layers, decode rows and a prefill
// chunk, in every numerics. Model-level equality (the forward always lends the buffer) is the
// whole-model gates' (test_model_gates, test_batch): unchanged logits against the fp64 reference.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/split_cases.h"
#include "common/step_view.h"
#include "model/backend.h"
#include "model/backends.h"
#include "model/layers.h"
#include "model/model.h"

namespace {

TEST(MoeParts, SharedExpertsLeftPendingAddUpToTheMoesOwnSum) {
  const auto m = k3::Model::load(k3test::split_model_dir("k3-nano"));
  const k3::ModelDims& d = m->dims();
  ASSERT_TRUE(d.moe.latent_proj) << "K3-nano has the latent MoE";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int64_t R : {int64_t(1), int64_t(3), int64_t(40)}) {
    for (k3::StepNumerics num : {k3::StepNumerics::Exact, k3::StepNumerics::F32, k3::StepNumerics::Fast}) {
      SCOPED_TRACE("rows " + std::to_string(R) + " numerics " + std::to_string(int(num)));
      const auto be = k3::make_cpu_backend();
      k3::Workspace work(*be, int64_t(1) << 22);
      // One sequence of R rows (the MoE keeps no state: the view only sizes the step).
      const k3test::HostStep st = k3test::host_step({int32_t(R)});
      const k3::StepView v = st.view();
      const std::vector<int32_t> ids(size_t(R), 1);
      const k3::StepCtx c{*be, v, work, R};
      int layers = 0;
      for (const k3::LayerWeights& lw : m->weights().layers) {
        if (lw.dense_ffn || lw.moe.shared.gate.empty()) continue;
        ++layers;
        std::vector<float> x(size_t(R * d.hidden));
        for (float& e : x) e = nd(rng);
        std::vector<float> whole(x.size()), routed(x.size()), shared(x.size());
        be->begin_step(v, ids.data(), num, false);
        const bool left_whole = k3::moe_sublayer(c, d.moe, lw.moe, x.data(), whole.data(), nullptr);
        const bool left_parts = k3::moe_sublayer(c, d.moe, lw.moe, x.data(), routed.data(), nullptr, shared.data());
        be->end_step();
        EXPECT_FALSE(left_whole) << "without a buffer the MoE adds its shared experts itself";
        EXPECT_TRUE(left_parts) << "with one it leaves them there";
        std::vector<float> sum(x.size());
        for (size_t i = 0; i < sum.size(); ++i) sum[i] = routed[i] + shared[i];  // the add op's y + x
        EXPECT_EQ(0, std::memcmp(sum.data(), whole.data(), sum.size() * 4)) << "routed + shared != the MoE's own sum";
        EXPECT_NE(0, std::memcmp(routed.data(), whole.data(), sum.size() * 4)) << "the shared part was not left out";
      }
      EXPECT_GT(layers, 0);
    }
  }
}

}  // namespace
