// The pool behind par::parallel_for. One loop at a time (the pool serves the thread that drives the
// model; a loop started inside a loop runs inline). How a loop runs:
//  - the caller publishes the loop (a new epoch) and works on it at once; workers that are awake
//    join while it is open and claim ranges from one atomic counter, so a worker the OS has not
//    scheduled simply takes no range, and the caller never waits for a worker that never joined;
//  - the caller closes the loop when no range is left and waits only for the workers that joined;
//  - between loops a worker spins for a short time (K3_SPIN_US, default 100 us), then sleeps on a
//    futex: on a busy machine idle workers give their core back instead of fighting for it.
// Adaptive team: every 10 ms (at a loop's start) the caller reads the number of runnable tasks of the
// machine (/proc/loadavg), subtracts its own awake threads, and keeps a moving average of the rest
// (scaled to this process's share of the CPUs under a cpuset); the loop then offers
// max(1, CPUs - that) threads. A worker that joined and was then preempted
// holds the loop until the OS runs it again (milliseconds on a busy machine, against loops of
// microseconds): so when other processes want the cores, fewer threads are faster.
// Owns: worker threads and their waiting. Must not: allocate per loop, or depend on the work.
#include "core/thread_pool.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace k3::par {
namespace {

using Clock = std::chrono::steady_clock;

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return end && *end == '\0' && x >= 0 && x <= INT_MAX ? int(x) : fallback;
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

// Runnable tasks of the whole machine right now (the 4th field of /proc/loadavg: "R/total"),
// or -1 when it cannot be read.
int machine_runnable() {
  char buf[128];
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return -1;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  double a, b, c;
  int running = 0, total = 0;
  return std::sscanf(buf, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) == 5 ? running : -1;
}

thread_local bool tl_in_parallel = false;

// Every range of a loop on the calling thread, in order.
void run_here(int64_t n, int64_t grain, detail::RangeFn fn, void* ctx) {
  struct Flag {
    Flag() { tl_in_parallel = true; }
    ~Flag() { tl_in_parallel = false; }
  } flag;
  for (int64_t b = 0; b < n; b += grain) fn(ctx, b, std::min(n, b + grain));
}

// ctl_ word of the current loop: epoch (bits 63..32) | closed (bit 31) | workers joined (30..0).
constexpr uint64_t kClosed = uint64_t(1) << 31;
constexpr uint64_t kJoinedMask = kClosed - 1;

class Pool {
 public:
  static Pool& get() {
    static Pool* const pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  int max_threads() const { return max_threads_.load(std::memory_order_relaxed); }
  void set_max_threads(int n) { max_threads_.store(n > 0 ? n : hw_, std::memory_order_relaxed); }
  int hw() const { return hw_; }
  bool adaptive() const { return adaptive_.load(std::memory_order_relaxed); }
  void set_adaptive(bool on) { adaptive_.store(on, std::memory_order_relaxed); }

  Stats stats() const {
    Stats s;
    s.loops = loops_.load(std::memory_order_relaxed);
    s.worker_ranges = worker_ranges_.load(std::memory_order_relaxed);
    s.team_sum = team_sum_.load(std::memory_order_relaxed);
    s.shrunk_loops = shrunk_loops_.load(std::memory_order_relaxed);
    return s;
  }
  void reset_stats() {
    loops_ = 0;
    worker_ranges_ = 0;
    team_sum_ = 0;
    shrunk_loops_ = 0;
  }

  // False when another thread's loop is running (the caller then runs its loop inline).
  bool try_acquire() { return !busy_.exchange(true, std::memory_order_acquire); }
  void release() { busy_.store(false, std::memory_order_release); }

  void run(int64_t n, int64_t grain, detail::RangeFn fn, void* ctx) {
    const int team = choose_team();
    loops_.fetch_add(1, std::memory_order_relaxed);
    team_sum_.fetch_add(team, std::memory_order_relaxed);
    if (team < max_threads()) shrunk_loops_.fetch_add(1, std::memory_order_relaxed);
    if (team <= 1) return run_here(n, grain, fn, ctx);  // the machine is busy: as -t 1 would
    ensure_workers(max_threads() - 1);                  // all at once: a growing team then never creates a thread
    set_team_workers(team - 1);

    n_ = n;
    grain_ = grain;
    fn_ = fn;
    ctx_ = ctx;
    error_ = nullptr;
    next_.store(0, std::memory_order_relaxed);
    left_.store(0, std::memory_order_relaxed);
    const uint32_t e = ++epoch_counter_;
    ctl_.store(uint64_t(e) << 32, std::memory_order_seq_cst);
    epoch_.store(e, std::memory_order_seq_cst);
    if (asleep_on_epoch_.load(std::memory_order_seq_cst) > 0) futex_wake_all(epoch_);

    tl_in_parallel = true;
    work();
    tl_in_parallel = false;

    // Close: no worker joins after this; wait for those that did.
    uint64_t c = ctl_.load(std::memory_order_seq_cst);
    while (!ctl_.compare_exchange_weak(c, c | kClosed, std::memory_order_seq_cst)) {
    }
    const uint32_t joined = uint32_t(c & kJoinedMask);
    for (int spins = 0; left_.load(std::memory_order_acquire) < joined; ++spins) {
      if (spins < 4096)
        cpu_relax();
      else
        sched_yield();  // a joined worker was preempted: let it run
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  Pool() : hw_(affinity_cpus()), online_(std::max<long>(hw_, sysconf(_SC_NPROCESSORS_ONLN))) {
    max_threads_ = hw_;
    spin_ns_ = int64_t(env_int("K3_SPIN_US", 100)) * 1000;
    adaptive_ = env_int("K3_ADAPTIVE_THREADS", 1) != 0;
  }

  // Claims and runs ranges until none is left (the caller and joined workers alike).
  int64_t work() {
    int64_t ranges = 0;
    for (;;) {
      const int64_t b = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (b >= n_) break;
      try {
        fn_(ctx_, b, std::min(n_, b + grain_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_, std::memory_order_relaxed);  // stop handing out ranges
      }
      ++ranges;
    }
    return ranges;
  }

  int choose_team() {
    const int mx = max_threads();
    if (!adaptive() || mx <= 1) return mx;
    const Clock::time_point now = Clock::now();
    if (now - last_sample_ >= std::chrono::milliseconds(10)) {
      last_sample_ = now;
      const int runnable = machine_runnable();
      if (runnable >= 0) {
        // Our own runnable threads: this one and every worker not asleep on a futex.
        const int ours = 1 + int(workers_.size()) - asleep_.load(std::memory_order_relaxed);
        // Runnable tasks count the whole machine; when this process may use only some of its
        // CPUs (a cpuset), count the others' share of those CPUs.
        const double others = double(std::max(0, runnable - ours)) * double(hw_) / double(online_);
        others_avg_ = sampled_ ? 0.7 * others_avg_ + 0.3 * others : others;
        sampled_ = true;
      }
    }
    const int busy = int(others_avg_ + 0.5);
    return std::clamp(hw_ - busy, 1, mx);
  }

  // Called before the next loop is published: a new worker waits for loops after the current one.
  void ensure_workers(int n) {
    while (int(workers_.size()) < n) {
      const int index = int(workers_.size());
      const uint32_t seen = epoch_.load(std::memory_order_seq_cst);
      workers_.emplace_back([this, index, seen] { worker_main(index, seen); });
      workers_.back().detach();
    }
  }

  void set_team_workers(int n) {
    if (team_workers_.load(std::memory_order_relaxed) == n) return;
    const bool grow = n > team_workers_.load(std::memory_order_relaxed);
    team_workers_.store(n, std::memory_order_seq_cst);
    if (grow) {
      team_gen_.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(team_gen_);
    }
  }

  // Returns when a loop newer than `seen` was published (spinning first, then asleep).
  void wait_for_loop(int index, uint32_t& seen) {
    for (;;) {
      if (index >= team_workers_.load(std::memory_order_seq_cst)) {
        // Outside the team: sleep until the team changes, then wait for the next loop.
        // (`seen` stays: if a loop was published meanwhile, the worker tries to join it; the ctl_
        // word refuses a loop that has closed.)
        const uint32_t g = team_gen_.load(std::memory_order_seq_cst);
        if (index >= team_workers_.load(std::memory_order_seq_cst)) {
          asleep_.fetch_add(1, std::memory_order_relaxed);
          futex_wait(team_gen_, g);
          asleep_.fetch_sub(1, std::memory_order_relaxed);
        }
        continue;
      }
      const Clock::time_point start = Clock::now();
      for (int i = 0;; ++i) {
        if (epoch_.load(std::memory_order_acquire) != seen) return;
        cpu_relax();
        if ((i & 63) == 63 && Clock::now() - start >= std::chrono::nanoseconds(spin_ns_)) break;
      }
      asleep_on_epoch_.fetch_add(1, std::memory_order_seq_cst);
      asleep_.fetch_add(1, std::memory_order_relaxed);
      if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(epoch_, seen);
      asleep_.fetch_sub(1, std::memory_order_relaxed);
      asleep_on_epoch_.fetch_sub(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_acquire) != seen) return;
    }
  }

  [[noreturn]] void worker_main(int index, uint32_t seen) {
    tl_in_parallel = false;
    for (;;) {
      wait_for_loop(index, seen);
      uint64_t c = ctl_.load(std::memory_order_seq_cst);
      seen = uint32_t(c >> 32);
      if (index >= team_workers_.load(std::memory_order_seq_cst)) continue;
      bool joined = false;
      while (!(c & kClosed) && uint32_t(c >> 32) == seen) {
        if (ctl_.compare_exchange_weak(c, c + 1, std::memory_order_seq_cst)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;  // the loop closed before this worker got to it
      tl_in_parallel = true;
      const int64_t ranges = work();
      tl_in_parallel = false;
      if (ranges) worker_ranges_.fetch_add(ranges, std::memory_order_relaxed);
      left_.fetch_add(1, std::memory_order_release);
    }
  }

  const int hw_;
  const long online_;  // CPUs of the machine (>= hw_)
  std::atomic<bool> busy_{false};
  std::atomic<int> max_threads_{1};
  std::atomic<bool> adaptive_{true};
  int64_t spin_ns_ = 100000;

  // The current loop (written by the caller before it publishes the epoch).
  int64_t n_ = 0, grain_ = 1;
  detail::RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mu_;
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<uint64_t> ctl_{0};
  alignas(64) std::atomic<uint32_t> epoch_{0};  // futex word: the newest loop's epoch
  alignas(64) std::atomic<uint32_t> left_{0};
  std::atomic<int> asleep_on_epoch_{0};
  std::atomic<int> asleep_{0};         // workers asleep on either futex
  std::atomic<int> team_workers_{0};   // workers with index < this may join
  std::atomic<uint32_t> team_gen_{0};  // futex word of workers outside the team
  uint32_t epoch_counter_ = 0;

  std::vector<std::thread> workers_;  // grows only; touched by the caller's thread
  Clock::time_point last_sample_{};
  double others_avg_ = 0;
  bool sampled_ = false;

  std::atomic<int64_t> loops_{0}, worker_ranges_{0}, team_sum_{0}, shrunk_loops_{0};
};

}  // namespace

int hardware_threads() { return Pool::get().hw(); }
int max_threads() { return Pool::get().max_threads(); }
void set_max_threads(int n) { Pool::get().set_max_threads(n); }
void set_adaptive(bool on) { Pool::get().set_adaptive(on); }
bool adaptive() { return Pool::get().adaptive(); }
bool in_parallel() { return tl_in_parallel; }
FixedThreads::FixedThreads(int n) : saved_threads_(max_threads()), saved_adaptive_(adaptive()) {
  set_max_threads(n);
  set_adaptive(false);
}
FixedThreads::~FixedThreads() {
  set_max_threads(saved_threads_);
  set_adaptive(saved_adaptive_);
}
Stats stats() { return Pool::get().stats(); }
void reset_stats() { Pool::get().reset_stats(); }

namespace detail {
bool run_inline(int64_t n, int64_t grain) { return tl_in_parallel || n <= grain || Pool::get().max_threads() <= 1; }
void run(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
  Pool& pool = Pool::get();
  if (!pool.try_acquire()) return run_here(n, grain, fn, ctx);  // another thread's loop holds the pool
  struct Release {
    Pool& p;
    ~Release() { p.release(); }
  } release{pool};
  pool.run(n, grain, fn, ctx);
}
}  // namespace detail

}  // namespace k3::par
