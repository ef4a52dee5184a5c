// core/comm: the in-process communicator. Every collective against a plain computation of what it
// defines (sums in rank order, so the expected values are exact here), the same bits on every rank,
// many collectives back to back (no rank runs ahead into another's data), aliasing of in/out
// buffers, and failure: a rank that throws ends the group with its error, never a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"
#include "core/error.h"

namespace {

// Rank r's value at index i: distinct per rank and index, with fractions that make the order of
// the sum matter in fp32 (so a sum out of rank order would show).
float val(int r, int64_t i) { return float(r + 1) * 1.0e-3f + float(i % 97) * 1.37e3f + (r % 2 ? 1e7f : 0.0f); }

std::vector<float> rank_order_sum(int size, int64_t n, int64_t off = 0) {
  std::vector<float> s(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float acc = val(0, off + i);
    for (int r = 1; r < size; ++r) acc += val(r, off + i);
    s[size_t(i)] = acc;
  }
  return s;
}

TEST(LocalComm, AllReduceAllGatherReduceScatter) {
  for (int size : {1, 2, 3, 4}) {
    SCOPED_TRACE("size " + std::to_string(size));
    auto group = k3::make_local_group(size);
    const int64_t n = 1000;
    std::vector<std::vector<float>> reduced(static_cast<size_t>(size)), gathered(static_cast<size_t>(size)),
        scattered(static_cast<size_t>(size));
    k3::run_ranks(group, [&](k3::Communicator& c) {
      EXPECT_EQ(c.size(), size);
      EXPECT_STREQ(c.name(), "local");
      const int r = c.rank();
      std::vector<float> buf(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) buf[size_t(i)] = val(r, i);
      c.all_reduce_sum(buf.data(), n);
      reduced[size_t(r)] = buf;
      std::vector<float> mine(static_cast<size_t>(n)), all(static_cast<size_t>(n * size));
      for (int64_t i = 0; i < n; ++i) mine[size_t(i)] = val(r, i);
      c.all_gather(mine.data(), n, all.data());
      gathered[size_t(r)] = all;
      std::vector<float> full(static_cast<size_t>(n * size)), part(static_cast<size_t>(n));
      for (int64_t i = 0; i < n * size; ++i) full[size_t(i)] = val(r, i);
      c.reduce_scatter_sum(full.data(), n, part.data());
      scattered[size_t(r)] = part;
    });
    const auto want = rank_order_sum(size, n);
    for (int r = 0; r < size; ++r) {
      EXPECT_EQ(reduced[size_t(r)], want) << "rank " << r;
      for (int q = 0; q < size; ++q)
        for (int64_t i = 0; i < n; i += 37) ASSERT_EQ(gathered[size_t(r)][size_t(q * n + i)], val(q, i));
      EXPECT_EQ(scattered[size_t(r)], rank_order_sum(size, n, r * n)) << "rank " << r;
    }
  }
}

// broadcast: every rank ends with the root's values, for every root, also back to back with the
// root changing each time (the chain a split model's expert-parallel MoE runs); a bad root is an error.
// Parts of different sizes (one rank sends nothing), in rank order; and the byte broadcast of the
// control channel (model/remote.h) from every root, the others' buffers resized to the root's.
TEST(LocalComm, AllGatherVAndByteBroadcast) {
  const int size = 3;
  auto group = k3::make_local_group(size);
  const std::vector<int64_t> counts{5, 0, 7};
  std::vector<std::vector<float>> got(size);
  std::vector<std::vector<std::vector<uint8_t>>> msgs(size);
  k3::run_ranks(group, [&](k3::Communicator& c) {
    const int r = c.rank();
    std::vector<float> mine(static_cast<size_t>(counts[size_t(r)]));
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = val(r, int64_t(i));
    std::vector<float> out(12, -1.0f);
    c.all_gather_v(mine.data(), int64_t(mine.size()), out.data(), counts.data());
    got[size_t(r)] = out;
    for (int root = 0; root < size; ++root) {
      std::vector<uint8_t> m(static_cast<size_t>(r + 2), uint8_t(0xee));  // non-roots: a wrong size and contents to be replaced
      if (r == root) m.assign(size_t(10 + root), uint8_t(root + 1));
      c.broadcast_bytes(m, root);
      msgs[size_t(r)].push_back(m);
    }
    EXPECT_THROW(c.all_gather_v(mine.data(), int64_t(mine.size()) + 1, out.data(), counts.data()), k3::Error);
  });
  std::vector<float> want;
  for (int r = 0; r < size; ++r)
    for (int64_t i = 0; i < counts[size_t(r)]; ++i) want.push_back(val(r, i));
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(got[size_t(r)], want) << "rank " << r;
    for (int root = 0; root < size; ++root)
      EXPECT_EQ(msgs[size_t(r)][size_t(root)], std::vector<uint8_t>(size_t(10 + root), uint8_t(root + 1)))
          << "rank " << r << " root " << root;
  }
}

TEST(LocalComm, BroadcastFromEveryRoot) {
  for (int size : {1, 2, 3, 4}) {
    SCOPED_TRACE("size " + std::to_string(size));
    auto group = k3::make_local_group(size);
    const int64_t n = 777;
    std::vector<int> bad(static_cast<size_t>(size), 0);
    k3::run_ranks(group, [&](k3::Communicator& c) {
      std::vector<float> buf(static_cast<size_t>(n));
      for (int rep = 0; rep < 50; ++rep)
        for (int root = 0; root < size; ++root) {
          for (int64_t i = 0; i < n; ++i) buf[size_t(i)] = val(c.rank(), i + rep);
          c.broadcast(buf.data(), n, root);
          for (int64_t i = 0; i < n; ++i) bad[size_t(c.rank())] += buf[size_t(i)] != val(root, i + rep);
        }
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(bad[size_t(r)], 0) << "rank " << r;
  }
  auto one = k3::make_local_group(1);
  float x = 0;
  EXPECT_THROW(one[0]->broadcast(&x, 1, 1), k3::Error);
}

// Thousands of small collectives in a row with ranks that run at different speeds: every result is
// that call's (a fast rank never publishes its next buffer into a slow rank's current sum).
TEST(LocalComm, BackToBackCollectivesStayInStep) {
  const int size = 4, steps = 3000;
  auto group = k3::make_local_group(size);
  std::vector<int> bad(static_cast<size_t>(size), 0);
  k3::run_ranks(group, [&](k3::Communicator& c) {
    for (int s = 0; s < steps; ++s) {
      float x[3] = {float(s), float(c.rank()), 1.0f};
      if ((s + c.rank()) % 7 == 0) std::this_thread::yield();
      c.all_reduce_sum(x, 3);
      if (x[0] != float(s * size) || x[1] != float(size * (size - 1) / 2) || x[2] != float(size))
        ++bad[size_t(c.rank())];
      float y = float(s * 10 + c.rank()), g[size];
      c.all_gather(&y, 1, g);
      for (int q = 0; q < size; ++q) bad[size_t(c.rank())] += g[q] != float(s * 10 + q);
    }
    c.barrier();
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(bad[size_t(r)], 0) << "rank " << r;
}

// In place: all_gather into a buffer whose first part is the send buffer, reduce_scatter with out
// aliasing this rank's slice of send.
TEST(LocalComm, AliasedBuffers) {
  const int size = 3;
  const int64_t n = 5;
  auto group = k3::make_local_group(size);
  std::vector<std::vector<float>> got(static_cast<size_t>(size)), got2(static_cast<size_t>(size));
  k3::run_ranks(group, [&](k3::Communicator& c) {
    const int r = c.rank();
    std::vector<float> buf(static_cast<size_t>(n * size), -1.0f);
    for (int64_t i = 0; i < n; ++i) buf[size_t(i)] = val(r, i);
    c.all_gather(buf.data(), n, buf.data());
    got[size_t(r)] = buf;
    std::vector<float> full(static_cast<size_t>(n * size));
    for (int64_t i = 0; i < n * size; ++i) full[size_t(i)] = val(r, i);
    c.reduce_scatter_sum(full.data(), n, full.data() + r * n);
    got2[size_t(r)].assign(full.begin() + r * n, full.begin() + (r + 1) * n);
  });
  for (int r = 0; r < size; ++r) {
    for (int q = 0; q < size; ++q)
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[size_t(r)][size_t(q * n + i)], val(q, i));
    EXPECT_EQ(got2[size_t(r)], rank_order_sum(size, n, r * n));
  }
}

// A rank that throws (here before its second collective) ends the group: the others' collectives
// throw instead of waiting, and run_ranks rethrows the first rank's own error. Timed: a hang fails.
TEST(LocalComm, FailingRankEndsTheGroupWithItsError) {
  const int size = 4;
  auto group = k3::make_local_group(size);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    k3::run_ranks(group, [&](k3::Communicator& c) {
      float x = 1;
      c.all_reduce_sum(&x, 1);
      if (c.rank() == 2) throw std::runtime_error("rank two ran out of memory");
      for (int i = 0; i < 100; ++i) c.all_reduce_sum(&x, 1);
    });
    FAIL() << "run_ranks returned normally";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank two ran out of memory");
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  // The group stays failed: a later collective on it throws at once, naming the cause.
  try {
    group[0]->barrier();
    FAIL() << "barrier on an aborted group returned";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2: rank two ran out of memory"), std::string::npos) << e.what();
  }
}

TEST(LocalComm, BadSizesAreErrors) {
  EXPECT_THROW(k3::make_local_group(0), k3::Error);
  EXPECT_THROW(k3::make_local_group(1025), k3::Error);
  auto group = k3::make_local_group(1);
  float x = 2;
  EXPECT_THROW(group[0]->all_reduce_sum(&x, -1), k3::Error);
  group[0]->all_reduce_sum(&x, 1);  // one rank: the identity
  EXPECT_EQ(x, 2.0f);
}

}  // namespace
