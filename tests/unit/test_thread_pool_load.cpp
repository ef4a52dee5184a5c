// core/thread_pool's adaptive team: while other threads keep every CPU busy, loops run on fewer
// threads (the calling thread alone when the machine is full); once they stop, loops get the
// whole team back. On the whole machine and in a cpuset (taskset -c 0,1 on a larger machine). Runs alone (RUN_SERIAL):
// other tests' load would change what it measures.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

// `n` busy processes (children that spin until killed): other work, as the pool sees other
// programs (threads of this process would count as its own CPU time under a cpuset).
class Hogs {
 public:
  explicit Hogs(int n) {
    for (int i = 0; i < n; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        volatile double x = 1;
        for (;;) x = x * 1.0000001 + 1e-9;
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~Hogs() { stop(); }
  void stop() {
    for (pid_t p : pids_) kill(p, SIGKILL);
    for (pid_t p : pids_) waitpid(p, nullptr, 0);
    pids_.clear();
  }
  size_t size() const { return pids_.size(); }

 private:
  std::vector<pid_t> pids_;
};

// Runs short loops for `ms` milliseconds; the pool's statistics of those loops.
k3::par::Stats loops_for(int ms) {
  k3::par::reset_stats();
  std::atomic<int64_t> sink{0};
  const auto end = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < end) {
    k3::par::parallel_for_each(64, [&](int64_t i) {
      double x = double(i);
      for (int k = 0; k < 2000; ++k) x = x * 1.000001 + 1e-7;
      sink.fetch_add(int64_t(x) & 1, std::memory_order_relaxed);
    });
    // A gap between loops, as a model step has (norms, sampling): workers stay spinning.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return k3::par::stats();
}

TEST(ThreadPoolLoad, TeamShrinksWhileTheMachineIsBusyAndComesBack) {
  const int hw = k3::par::hardware_threads();
  if (hw < 2) GTEST_SKIP() << "one CPU: there is no team to shrink";
  if (access("/proc/loadavg", R_OK) != 0 || access("/proc/stat", R_OK) != 0)
    GTEST_SKIP() << "no /proc/loadavg or /proc/stat: the team is never adapted here";
  k3::par::set_max_threads(hw);
  k3::par::set_adaptive(true);

  const k3::par::Stats idle_before = loops_for(300);
  if (idle_before.mean_team() < hw - 0.5)
    GTEST_SKIP() << "the machine is not idle before the test (mean team " << idle_before.mean_team() << " of " << hw
                 << "): other processes' load would be in the measurement";
  // One busy process per CPU (children inherit this process's CPUs, a cpuset's too).
  Hogs hogs(hw);
  ASSERT_EQ(hogs.size(), size_t(hw));
  loops_for(300);  // the moving average settles
  const k3::par::Stats busy = loops_for(500);
  hogs.stop();
  loops_for(300);
  const k3::par::Stats idle_after = loops_for(500);

  std::printf("mean team: idle %.2f, busy %.2f, idle again %.2f (of %d)\n", idle_before.mean_team(), busy.mean_team(),
              idle_after.mean_team(), hw);
  ASSERT_GT(busy.loops, 0);
  EXPECT_GT(busy.shrunk_loops, busy.loops / 2) << "with every CPU busy, most loops should run on a smaller team";
  EXPECT_LT(busy.mean_team(), 1.0 + 0.5 * (hw - 1));
  EXPECT_GT(idle_after.mean_team(), busy.mean_team() + 0.5) << "the team did not come back after the load stopped";
}

TEST(ThreadPoolLoad, FixedThreadsIgnoreTheLoad) {
  const int hw = k3::par::hardware_threads();
  if (hw < 2) GTEST_SKIP() << "one CPU";
  Hogs hogs(hw);
  k3::par::Stats s;
  {
    const k3::par::FixedThreads fixed(hw);
    s = loops_for(200);
  }
  hogs.stop();
  ASSERT_GT(s.loops, 0);
  EXPECT_EQ(s.shrunk_loops, 0);
  EXPECT_DOUBLE_EQ(s.mean_team(), double(hw));
}

}  // namespace
