// The CUDA runtime wrapper: device discovery, copies round-trip, allocation failures are one-line
// k3::Errors naming the size, and a captured graph replays the work it captured.
#include <gtest/gtest.h>

#include <random>

#include "common/cuda_util.h"
#include "common/num_util.h"
#include "core/error.h"
#include "ops/cuda/cuda_ops.h"

TEST(CudaRuntime, DeviceInfoAndRoundTrip) {
  K3_REQUIRE_GPU();
  const auto d = k3::cuda::device_info();
  EXPECT_FALSE(d.name.empty());
  EXPECT_GT(d.total_bytes, size_t(0));
  EXPECT_GT(d.multiprocessors, 0);
  std::mt19937 rng(1);
  const auto v = k3test::rand_vec(rng, 12345);
  const auto b = k3test::to_dev(v);
  EXPECT_EQ(k3test::from_dev<float>(b, v.size()), v);
}

TEST(CudaRuntime, AllocationFailureIsAClearError) {
  K3_REQUIRE_GPU();
  try {
    k3::cuda::DevBuf huge(size_t(1) << 50, "a test tensor");
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const k3::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of GPU memory"), std::string::npos) << m;
    EXPECT_NE(m.find("a test tensor"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST(CudaRuntime, GraphReplaysCapturedWork) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(2);
  const auto x = k3test::rand_vec(rng, 4096), y0 = k3test::rand_vec(rng, 4096);
  auto dx = k3test::to_dev(x), dy = k3test::to_dev(y0);
  k3::cuda::Stream s = k3::cuda::stream_create();
  k3::cuda::capture_begin(s);
  k3::cuda::add_inplace(dy.as<float>(), dx.as<float>(), 4096, s);
  auto g = k3::cuda::capture_end(s);
  for (int i = 0; i < 3; ++i) k3::cuda::graph_launch(g, s);
  k3::cuda::sync(s);
  const auto y = k3test::from_dev<float>(dy, 4096);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_FLOAT_EQ(y[i], ((y0[i] + x[i]) + x[i]) + x[i]) << i;
  k3::cuda::graph_destroy(g);
  k3::cuda::stream_destroy(s);
}
