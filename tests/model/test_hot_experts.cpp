// The host's half of the GPU's hot-expert cache (issue 20, GpuOptions::hot_experts): the CPU backend
// computes only the routed experts MoeWeights::elsewhere does not flag, leaves the flagged slots'
// terms untouched, and the two halves together are bit for bit the terms of all experts: the GPU
// then fills the flagged slots and sums every row in top-k slot order. On K3-nano's MoE layers, for
// decode rows of several sequences (the one-row path) and a prefill chunk (grouped by expert), in
// fp32 and fast numerics. The GPU half is CudaModel.HotExpertCacheGivesTheSameTokens.
// Owns: nothing the engine uses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/split_cases.h"
#include "common/step_view.h"
#include "core/error.h"
#include "model/backend.h"
#include "model/backends.h"
#include "model/model.h"

namespace {

TEST(HotExperts, HostHalfLeavesTheCachedSlotsAndTheHalvesMakeTheWhole) {
  const auto m = k3::Model::load(k3test::split_model_dir("k3-nano"));
  const k3::ModelDims& d = m->dims();
  std::mt19937 rng(7);
  for (const std::vector<int32_t>& shape : {std::vector<int32_t>{1, 1, 1, 1, 1}, std::vector<int32_t>{6}}) {
    const k3test::HostStep st = k3test::host_step(shape);
    const int64_t R = st.rows(), K = d.moe.top_k, L = d.moe.latent;
    for (k3::StepNumerics num : {k3::StepNumerics::F32, k3::StepNumerics::Fast}) {
      SCOPED_TRACE("rows " + std::to_string(R) + (num == k3::StepNumerics::Fast ? " fast" : " fp32"));
      const auto be = k3::make_cpu_backend();
      const std::vector<int32_t> ids(size_t(R), 1);
      int layers = 0;
      for (const k3::LayerWeights& lw : m->weights().layers) {
        if (lw.dense_ffn || lw.moe.experts.empty()) continue;
        ++layers;
        const k3::MoeWeights& w = lw.moe;
        const int64_t E = int64_t(w.experts.size());
        std::uniform_int_distribution<int32_t> pick(0, int32_t(E - 1));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<int32_t> idx(size_t(R * K));
        for (int64_t r = 0; r < R; ++r)  // distinct experts per row, as the router gives
          for (int64_t j = 0; j < K; ++j) {
            int32_t e;
            do e = pick(rng);
            while (std::find(idx.begin() + r * K, idx.begin() + r * K + j, e) != idx.begin() + r * K + j);
            idx[size_t(r * K + j)] = e;
          }
        std::vector<float> z(size_t(R * L)), wt(size_t(R * K), 0.25f);
        for (float& x : z) x = nd(rng);
        std::vector<uint8_t> hot(static_cast<size_t>(E)), cold(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) hot[size_t(e)] = e % 3 == 0, cold[size_t(e)] = !hot[size_t(e)];
        const float kUntouched = std::nanf("");
        const auto terms_of = [&](const uint8_t* elsewhere) {
          k3::MoeWeights v = w;
          v.elsewhere = elsewhere;
          std::vector<float> t(size_t(R * K * L), kUntouched), agg(size_t(R * L));
          be->begin_step(st.view(), ids.data(), num, false);
          be->moe_routed(v, L, d.moe.situ, z.data(), idx.data(), wt.data(), R, K, agg.data(), nullptr, t.data());
          be->end_step();
          return t;
        };
        const auto all = terms_of(nullptr), host = terms_of(hot.data()), gpu = terms_of(cold.data());
        int64_t hot_slots = 0;
        for (int64_t s = 0; s < R * K; ++s) {
          const bool is_hot = hot[size_t(idx[size_t(s)])];
          hot_slots += is_hot;
          const float* a = all.data() + s * L;
          const float* h = host.data() + s * L;
          const float* g = gpu.data() + s * L;
          const float* mine = is_hot ? g : h;   // the half that computes this slot
          const float* other = is_hot ? h : g;  // the half that must leave it alone
          EXPECT_EQ(0, std::memcmp(mine, a, size_t(L) * 4)) << "slot " << s << " differs from all experts'";
          for (int64_t c = 0; c < L; ++c)
            ASSERT_TRUE(std::isnan(other[c])) << "slot " << s << " written by the other half";
        }
        EXPECT_GT(hot_slots, 0);
        EXPECT_LT(hot_slots, R * K);
      }
      EXPECT_GT(layers, 0);
    }
  }
}

}  // namespace

// --gpu-mem (GpuOptions::gpu_mem, fit_gpu_mem): the placement asked for where its plan fits the cap;
// else the routed experts in host RAM with the largest whole number of each layer's experts cached
// that keeps the plan within the cap; a one-line error where even the trunk, state and workspace do
// not fit. On K3-nano, planned from its bound weights (no GPU needed).
TEST(GpuMem, FitChoosesTheSplitThatHonoursTheCap) {
  auto m = k3::Model::load(k3test::split_model_dir("k3-nano"));
  k3::GpuOptions o;
  o.initial_context = 1024;
  const size_t all = k3::gpu_memory_plan(*m, o, o.initial_context).total();
  k3::GpuOptions h = o;
  h.experts_on_cpu = true;
  const size_t base = k3::gpu_memory_plan(*m, h, h.initial_context).total();
  ASSERT_LT(base, all);
  // A cap above the whole plan: unchanged.
  o.gpu_mem = all + 1;
  std::string how;
  k3::GpuOptions r = k3::fit_gpu_mem(*m, o, &how);
  EXPECT_FALSE(r.experts_on_cpu);
  EXPECT_NE(how.find("fits"), std::string::npos) << how;
  // Between: experts on the CPU, a whole number of experts per layer cached, the plan within the cap,
  // and one more expert per layer would not be.
  const int64_t E = 32;  // K3-nano's routed experts per MoE layer
  o.gpu_mem = base + (all - base) / 2;
  r = k3::fit_gpu_mem(*m, o, &how);
  EXPECT_TRUE(r.experts_on_cpu);
  EXPECT_GT(r.hot_experts, 0.0);
  EXPECT_LT(r.hot_experts, 1.0);
  const double per_layer = r.hot_experts * double(E);
  EXPECT_DOUBLE_EQ(per_layer, std::round(per_layer));
  EXPECT_LE(k3::gpu_memory_plan(*m, r, r.initial_context).total(), o.gpu_mem);
  k3::GpuOptions more = r;
  more.hot_experts = (per_layer + 1) / double(E);
  EXPECT_GT(k3::gpu_memory_plan(*m, more, more.initial_context).total(), o.gpu_mem);
  EXPECT_NE(how.find("host RAM"), std::string::npos) << how;
  // Just the trunk: nothing cached.
  o.gpu_mem = base;
  r = k3::fit_gpu_mem(*m, o);
  EXPECT_TRUE(r.experts_on_cpu);
  EXPECT_EQ(r.hot_experts, 0.0);
  // Below the trunk, state and workspace: one line naming the cap.
  o.gpu_mem = base / 2;
  try {
    k3::fit_gpu_mem(*m, o);
    FAIL() << "a cap below the trunk was taken";
  } catch (const k3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("--gpu-mem ", 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}
