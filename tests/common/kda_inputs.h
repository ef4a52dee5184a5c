// Random KDA inputs shaped as the model produces them, shared by the KDA op tests (CPU:
// test_ops_twins.cpp, test_ops_levels.cpp; CUDA: test_cuda_ops.cpp, test_cuda_varlen.cpp). Test-only.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/num_util.h"
#include "ops/ops.h"

namespace k3test {

struct KdaInputs {
  std::vector<float> q, k, v, g, beta, S0;
};

// As in the CPU op tests: q, k L2-normalised per head (q scaled by Dk^-1/2), g from the
// lower-bound gate (g ∈ (-5, 0)), β = σ(random), a random non-zero initial state.
inline KdaInputs make_kda(std::mt19937& rng, int64_t T, int64_t H, int64_t Dk, int64_t Dv) {
  KdaInputs in;
  in.q = rand_vec(rng, size_t(T * H * Dk));
  in.k = rand_vec(rng, size_t(T * H * Dk));
  in.v = rand_vec(rng, size_t(T * H * Dv));
  k3::ref::l2norm_scale(in.q.data(), T * H, Dk, 1e-6f, 1.0f / std::sqrt(float(Dk)));
  k3::ref::l2norm_scale(in.k.data(), T * H, Dk, 1e-6f, 1.0f);
  const auto f = rand_vec(rng, size_t(T * H * Dk), 0.01f, 6.0f);
  const auto A_log = rand_vec(rng, size_t(H), 0.05f, 0.7f);
  std::vector<float> dt(static_cast<size_t>(H * Dk), -2.0f);
  in.g.resize(f.size());
  k3::ref::kda_gate(f.data(), T, H, Dk, A_log.data(), dt.data(), -5.0f, in.g.data());
  const auto b = rand_vec(rng, size_t(T * H), 0.05f, 3.0f);
  in.beta.resize(b.size());
  for (size_t i = 0; i < b.size(); ++i) in.beta[i] = 1.0f / (1.0f + std::exp(-b[i]));
  in.S0 = rand_vec(rng, size_t(H * Dk * Dv), 0.01f, 0.5f);
  return in;
}

}  // namespace k3test
