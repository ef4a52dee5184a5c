// The NCCL wrapper (ops/cuda/nccl_lazy.cpp) on the device, one rank: NCCL opens from the machine's
// library, a communicator of one GPU forms, and all_gather / broadcast / all_gather_v leave the data
// as a one-rank group must (out == send, in place too). With several GPUs the same calls run across
// processes (scripts/multi_gpu_check.sh); one GPU cannot hold two ranks (NCCL refuses a device twice).
#include <gtest/gtest.h>

#include <vector>

#include "common/cuda_util.h"
#include "ops/cuda/runtime.h"

namespace cu = k3::cuda;

TEST(CudaNccl, OneRankCollectivesOnTheDevice) {
  K3_REQUIRE_GPU();
  const std::vector<uint8_t> id = cu::nccl_unique_id();
  EXPECT_EQ(id.size(), 128u);
  cu::NcclComm* c = cu::nccl_init(id, 1, 0);
  const int64_t n = 1000;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float(i) * 0.5f - 7.0f;
  const cu::DevBuf send = k3test::to_dev(x);
  const cu::Stream s = cu::stream_create();
  {
    cu::DevBuf out = k3test::dev_nan(size_t(n));
    cu::nccl_all_gather(c, send.as<float>(), n, out.as<float>(), s);
    cu::sync(s);
    EXPECT_EQ(k3test::from_dev<float>(out, size_t(n)), x) << "all_gather";
  }
  {
    cu::DevBuf out = k3test::dev_nan(size_t(n));
    const int64_t counts[1] = {n};
    cu::nccl_all_gather_v(c, send.as<float>(), out.as<float>(), counts, 1, 0, s);
    cu::sync(s);
    EXPECT_EQ(k3test::from_dev<float>(out, size_t(n)), x) << "all_gather_v";
  }
  {
    cu::DevBuf buf = k3test::to_dev(x);
    cu::nccl_broadcast(c, buf.as<float>(), n, 0, s);
    cu::nccl_all_gather(c, buf.as<float>(), n, buf.as<float>(), s);  // in place
    cu::sync(s);
    EXPECT_EQ(k3test::from_dev<float>(buf, size_t(n)), x) << "broadcast, in-place all_gather";
  }
  cu::stream_destroy(s);
  cu::nccl_destroy(c);
}
