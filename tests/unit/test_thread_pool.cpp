// core/thread_pool: every index of a loop runs exactly once whatever the thread count, grain,
// nesting or exceptions; loops from two threads at once both complete; the workers take part.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace {

// Busy work of about `us` microseconds that the compiler cannot drop.
double spin_work(int us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  double x = 1;
  while (std::chrono::steady_clock::now() < end) x = x * 1.0000001 + 1e-9;
  return x;
}

TEST(ThreadPool, EveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    const k3::par::FixedThreads fixed(threads);
    for (int64_t n : {1, 2, 7, 64, 1000, 4097}) {
      for (int64_t grain : {1, 3, 64, 5000}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int64_t> calls{0};
        k3::par::parallel_for(n, grain, [&](int64_t b, int64_t e) {
          ASSERT_LT(b, e);
          ASSERT_LE(e - b, grain);
          ASSERT_EQ(b % grain, 0);
          for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
          calls.fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(hits[size_t(i)].load(), 1)
              << "threads " << threads << " n " << n << " grain " << grain << " i " << i;
        EXPECT_EQ(calls.load(), (n + grain - 1) / grain);
      }
    }
  }
}

TEST(ThreadPool, ZeroAndSerialLoops) {
  int calls = 0;
  k3::par::parallel_for(0, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
  std::vector<int64_t> order;
  k3::par::parallel_for(
      10, 3, [&](int64_t b, int64_t e) { order.push_back(b * 100 + e); }, /*parallel=*/false);
  EXPECT_EQ(order, (std::vector<int64_t>{3, 306, 609, 910}));
}

TEST(ThreadPool, NestedLoopsRunInline) {
  const k3::par::FixedThreads fixed(3);
  std::vector<std::atomic<int>> hits(40 * 40);
  std::atomic<int> nested_inline{0};
  k3::par::parallel_for_each(40, [&](int64_t i) {
    EXPECT_TRUE(k3::par::in_parallel());
    const std::thread::id me = std::this_thread::get_id();
    bool same_thread = true;
    k3::par::parallel_for_each(40, [&](int64_t j) {
      same_thread = same_thread && std::this_thread::get_id() == me;
      hits[size_t(i * 40 + j)].fetch_add(1);
    });
    if (same_thread) nested_inline.fetch_add(1);
  });
  EXPECT_FALSE(k3::par::in_parallel());
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_EQ(nested_inline.load(), 40);
}

TEST(ThreadPool, ExceptionReachesTheCallerAfterTheLoop) {
  const k3::par::FixedThreads fixed(3);
  // The first throw of a process is slow (unwind tables are looked up; several ms under ASan), and
  // the other threads keep taking ranges until the throwing one has unwound into the pool's catch.
  // Warm that path once, and give the loop far more ranges than can start in the meantime, so the
  // check below asks "did the pool stop handing out ranges" and not "was unwinding fast".
  try {
    throw std::runtime_error("warm-up");
  } catch (const std::runtime_error&) {
  }
  constexpr int64_t kRanges = 4000;
  std::atomic<int> running{0}, after_throw_started{0};
  std::atomic<bool> thrown{false};
  try {
    k3::par::parallel_for_each(kRanges, [&](int64_t i) {
      running.fetch_add(1);
      if (thrown.load()) after_throw_started.fetch_add(1);
      spin_work(50);
      if (i == 17) {
        thrown = true;
        running.fetch_sub(1);
        throw std::runtime_error("range 17 failed");
      }
      running.fetch_sub(1);
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "range 17 failed");
  }
  EXPECT_EQ(running.load(), 0) << "a range was still running when the exception reached the caller";
  EXPECT_LT(after_throw_started.load(), kRanges / 4)
      << "ranges kept being handed out after the exception (" << after_throw_started.load() << " of " << kRanges - 18
      << " started after it)";
  // The pool still works.
  std::atomic<int64_t> sum{0};
  k3::par::parallel_for_each(100, [&](int64_t i) { sum.fetch_add(i); });
  EXPECT_EQ(sum.load(), 4950);
}

TEST(ThreadPool, LoopsFromTwoThreadsAtOnceBothComplete) {
  const k3::par::FixedThreads fixed(2);
  std::atomic<int64_t> a{0}, b{0};
  auto body = [](std::atomic<int64_t>& s) {
    for (int rep = 0; rep < 200; ++rep) k3::par::parallel_for_each(50, [&](int64_t i) { s.fetch_add(i + 1); });
  };
  std::thread other([&] { body(b); });
  body(a);
  other.join();
  EXPECT_EQ(a.load(), 200 * 1275);
  EXPECT_EQ(b.load(), 200 * 1275);
}

TEST(ThreadPool, WorkersTakeRanges) {
  const k3::par::FixedThreads fixed(2);
  k3::par::reset_stats();
  // 400 ranges of ~100 us: a worker that is awake at all in these ~40 ms takes some of them.
  k3::par::parallel_for_each(400, [](int64_t) { spin_work(100); });
  const k3::par::Stats s = k3::par::stats();
  EXPECT_EQ(s.loops, 1);
  EXPECT_EQ(s.team_sum, 2);
  EXPECT_GT(s.worker_ranges, 0);
  EXPECT_LT(s.worker_ranges, 400);  // the calling thread works too
}

TEST(ThreadPool, SetupRunsOnEveryJoiningThreadBeforeItsRanges) {
  for (int threads : {1, 3}) {
    const k3::par::FixedThreads fixed(threads);
    std::mutex mu;
    std::set<std::thread::id> set_up;
    std::atomic<int> setups{0}, ranges_without_setup{0}, ranges{0};
    k3::par::parallel_for_each_setup(
        300,
        [&] {
          std::lock_guard<std::mutex> l(mu);
          EXPECT_TRUE(set_up.insert(std::this_thread::get_id()).second) << "setup twice on one thread";
          setups.fetch_add(1);
        },
        [&](int64_t) {
          {
            std::lock_guard<std::mutex> l(mu);
            if (!set_up.count(std::this_thread::get_id())) ranges_without_setup.fetch_add(1);
          }
          ranges.fetch_add(1);
          spin_work(20);
        });
    EXPECT_EQ(ranges.load(), 300);
    EXPECT_EQ(ranges_without_setup.load(), 0);
    EXPECT_GE(setups.load(), 1);
    EXPECT_LE(setups.load(), threads);
  }
  // Inline (not parallel): setup once, on the caller.
  int setups = 0, calls = 0;
  k3::par::parallel_for_setup(
      10, 2, [&] { ++setups; }, [&](int64_t, int64_t) { ++calls; }, /*parallel=*/false);
  EXPECT_EQ(setups, 1);
  EXPECT_EQ(calls, 5);
}

TEST(ThreadPool, SettingsAndScopes) {
  const int hw = k3::par::hardware_threads();
  EXPECT_GE(hw, 1);
  const int before = k3::par::max_threads();
  const bool adaptive_before = k3::par::adaptive();
  {
    const k3::par::FixedThreads fixed(7);
    EXPECT_EQ(k3::par::max_threads(), 7);
    EXPECT_FALSE(k3::par::adaptive());
  }
  EXPECT_EQ(k3::par::max_threads(), before);
  EXPECT_EQ(k3::par::adaptive(), adaptive_before);
  k3::par::set_max_threads(0);
  EXPECT_EQ(k3::par::max_threads(), hw);
  k3::par::set_max_threads(before);
  EXPECT_EQ(k3::par::balanced_grain(1), 1);
  const int64_t g = k3::par::balanced_grain(100000);
  EXPECT_GE(g * 4 * k3::par::max_threads(), 100000);
}

}  // namespace
