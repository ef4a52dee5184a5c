// core/comm_tcp: the rendezvous of processes started by hand (--rank/--world/--master), here as
// threads on loopback: every rank joins, rank 0's messages arrive whole and in order (empty, small,
// large), barriers meet; a rank that goes away ends the others' waits with a one-line error; a
// mismatched --world, a taken rank and a rank that never comes are one-line errors, not hangs; host
// float collectives refuse (GPU ranks use NCCL).
#include <gtest/gtest.h>

#include <functional>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/comm_mpi.h"
#include "core/comm_tcp.h"
#include "core/error.h"

namespace {

std::string one_line_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const k3::Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  return "";
}

TEST(TcpComm, RanksJoinAndRankZerosMessagesArriveInOrder) {
  const int world = 3;
  k3::tcp::Listener l("127.0.0.1:0");
  ASSERT_GT(l.port(), 0);
  const std::string at = "127.0.0.1:" + std::to_string(l.port());
  std::vector<std::vector<std::vector<uint8_t>>> got(world);
  std::vector<std::thread> ts;
  for (int r = 1; r < world; ++r)
    ts.emplace_back([&, r] {
      auto c = k3::tcp::connect(r, world, at, 10);
      EXPECT_EQ(c->rank(), r);
      EXPECT_EQ(c->size(), world);
      EXPECT_STREQ(c->name(), "tcp");
      for (int i = 0; i < 4; ++i) {
        std::vector<uint8_t> m{1, 2, 3};  // replaced by rank 0's
        c->broadcast_bytes(m, 0);
        got[size_t(r)].push_back(m);
        c->barrier();
      }
    });
  auto c0 = l.accept(world, 10);
  std::vector<std::vector<uint8_t>> sent{{}, {42}, std::vector<uint8_t>(3 << 20, 7), {9, 8, 7, 6}};
  for (auto& m : sent) {
    auto copy = m;
    c0->broadcast_bytes(copy, 0);
    c0->barrier();
  }
  for (auto& t : ts) t.join();
  for (int r = 1; r < world; ++r) EXPECT_EQ(got[size_t(r)], sent) << "rank " << r;
  float x = 1;
  EXPECT_NE(one_line_error([&] { c0->all_gather(&x, 1, &x); }).find("GPU ranks exchange their data through NCCL"),
            std::string::npos);
}

TEST(TcpComm, ARankThatGoesAwayEndsTheOthersWaits) {
  k3::tcp::Listener l("127.0.0.1:0");
  const std::string at = "127.0.0.1:" + std::to_string(l.port());
  std::string follower;
  std::thread t([&] {
    auto c = k3::tcp::connect(1, 2, at, 10);
    std::vector<uint8_t> m;
    follower = one_line_error([&] { c->broadcast_bytes(m, 0); });  // rank 0 aborts instead of sending
  });
  auto c0 = l.accept(2, 10);
  c0->abort("simulated failure on rank 0");
  t.join();
  EXPECT_NE(follower.find("the connection between rank 1 and rank 0 ended"), std::string::npos) << follower;
}

TEST(TcpComm, StartUpMistakesAreOneLineErrors) {
  {  // another --world
    k3::tcp::Listener l("127.0.0.1:0");
    const std::string at = "127.0.0.1:" + std::to_string(l.port());
    std::string rank1;
    std::thread t([&] { rank1 = one_line_error([&] { k3::tcp::connect(1, 3, at, 10); }); });
    const std::string e = one_line_error([&] { l.accept(2, 10); });
    t.join();
    EXPECT_NE(e.find("rank 1 was started with --world 3, rank 0 with --world 2"), std::string::npos) << e;
    EXPECT_NE(rank1.find("rank 0 at"), std::string::npos) << rank1;
  }
  {  // a rank that never comes
    k3::tcp::Listener l("127.0.0.1:0");
    const std::string e = one_line_error([&] { l.accept(3, 1); });
    EXPECT_NE(e.find("for rank(s) 1,2 to connect"), std::string::npos) << e;
  }
  {  // nobody listening
    const std::string e = one_line_error([] { k3::tcp::connect(1, 2, "127.0.0.1:1", 1); });
    EXPECT_NE(e.find("cannot reach rank 0 at 127.0.0.1:1"), std::string::npos) << e;
  }
  EXPECT_NE(one_line_error([] { k3::tcp::rendezvous(0, 2, "no-port-here"); }).find("give HOST:PORT"),
            std::string::npos);
  EXPECT_NE(one_line_error([] { k3::tcp::rendezvous(2, 2, "127.0.0.1:5"); }).find("--rank 2 of --world 2"),
            std::string::npos);
}

}  // namespace

namespace {
// Each process of a launch sees one GPU: its local rank's entry of CUDA_VISIBLE_DEVICES (or that
// index), from the launcher's variable or the fallback; nothing changes without a local rank or
// when the list is shorter.
TEST(BindLocalGpu, PicksTheLocalRanksDevice) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) ::unsetenv(v);
  ::setenv("CUDA_VISIBLE_DEVICES", "4,5,6", 1);
  EXPECT_EQ(k3::mpi::bind_local_gpu(), "");  // no local rank known
  EXPECT_STREQ(std::getenv("CUDA_VISIBLE_DEVICES"), "4,5,6");
  ::setenv("LOCAL_RANK", "1", 1);
  EXPECT_EQ(k3::mpi::bind_local_gpu(), "5");
  EXPECT_STREQ(std::getenv("CUDA_VISIBLE_DEVICES"), "5");
  ::setenv("CUDA_VISIBLE_DEVICES", "4", 1);
  EXPECT_EQ(k3::mpi::bind_local_gpu(), "");  // the list is shorter: left as it is
  EXPECT_STREQ(std::getenv("CUDA_VISIBLE_DEVICES"), "4");
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  ::setenv("LOCAL_RANK", "x", 1);  // not a number: the fallback
  EXPECT_EQ(k3::mpi::bind_local_gpu(2), "2");
  EXPECT_STREQ(std::getenv("CUDA_VISIBLE_DEVICES"), "2");
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("CUDA_VISIBLE_DEVICES");
}
}  // namespace
