// The pool behind par::parallel_for. One loop at a time (the pool serves the thread that drives the
// model; a loop started inside a loop runs inline). How a loop runs:
//  - the caller publishes the loop (a new epoch) and works on it at once; workers that are awake
//    join while it is open and claim ranges from one atomic counter, so a worker the OS has not
//    scheduled simply takes no range, and the caller never waits for a worker that never joined;
//  - the caller closes the loop when no range is left and waits only for the workers that joined;
//  - between loops a worker spins for a short time (K3_SPIN_US, default 100 us), then sleeps on a
//    futex: on a busy machine idle workers give their core back instead of fighting for it.
// Adaptive team: at a loop's start the caller estimates how many of its CPUs other work keeps busy
// (LoadEstimate: runnable tasks of the machine, or under a cpuset the busy time of our CPUs) and
// offers max(1, CPUs - that) threads. A worker that joined and was then preempted
// holds the loop until the OS runs it again (milliseconds on a busy machine, against loops of
// microseconds): so when other processes want the cores, fewer threads are faster.
// Owns: worker threads and their waiting. Must not: allocate per loop, or depend on the work.
#include "core/thread_pool.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
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

// Reads a small /proc file into buf (no allocation); its length, or -1.
ssize_t read_proc(const char* path, char* buf, size_t cap) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t n = 0;
  for (ssize_t r; n + 1 < cap && (r = read(fd, buf + n, cap - 1 - n)) > 0;) n += size_t(r);
  close(fd);
  buf[n] = '\0';
  return ssize_t(n);
}

// How many of this process's CPUs other work keeps busy, as a moving average.
//  - Whole machine (the affinity mask has every online CPU): the runnable tasks of the machine
//    right now (/proc/loadavg, "R/total") minus this process's awake pool threads, every 10 ms.
//    Counting runnable tasks sees demand at once, also the demand our own threads crowd out.
//  - A cpuset (fewer CPUs than the machine): machine-wide counts say nothing about our CPUs, so
//    the busy time of our CPUs (/proc/stat) minus this process's CPU time, every 50 ms.
class LoadEstimate {
 public:
  LoadEstimate(int hw, long online) : hw_(hw), cpuset_(hw < online) {
    if (!cpuset_) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) mine_.push_back(c);
    stat_buf_.resize(size_t(64 + 200 * std::max<long>(online, 1)));
  }

  // Called at a loop's start; `ours`: this process's awake pool threads (the caller included).
  void sample(Clock::time_point now, int ours) {
    double others = 0;
    if (!cpuset_) {
      if (now - last_ < std::chrono::milliseconds(10)) return;
      last_ = now;
      char buf[128];
      double a, b, c;
      int running = 0, total = 0;
      if (read_proc("/proc/loadavg", buf, sizeof buf) < 0 ||
          std::sscanf(buf, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5)
        return;
      others = std::max(0, running - ours);
    } else {
      if (now - last_ < std::chrono::milliseconds(50)) return;
      double busy_s = 0, self_s = 0;
      if (!cpuset_busy(busy_s, self_s)) return;
      const double wall = std::chrono::duration<double>(now - last_).count();
      const bool first = last_ == Clock::time_point{};
      last_ = now;
      const double d_busy = busy_s - busy_prev_, d_self = self_s - self_prev_;
      busy_prev_ = busy_s;
      self_prev_ = self_s;
      if (first || wall <= 0) return;
      others = std::clamp((d_busy - d_self) / wall, 0.0, double(hw_));
    }
    avg_ = sampled_ ? 0.7 * avg_ + 0.3 * others : others;
    sampled_ = true;
  }
  // CPUs that other work keeps busy, rounded.
  int busy_cpus() const { return int(avg_ + 0.5); }

 private:
  // Busy seconds of our CPUs since boot (/proc/stat: user, nice, system, irq, softirq) and this
  // process's CPU seconds.
  bool cpuset_busy(double& busy_s, double& self_s) {
    if (mine_.empty() || read_proc("/proc/stat", stat_buf_.data(), stat_buf_.size()) <= 0) return false;
    static const double tick = 1.0 / double(std::max<long>(sysconf(_SC_CLK_TCK), 1));
    size_t next = 0;
    unsigned long long busy = 0;
    for (const char* p = stat_buf_.data(); *p && next < mine_.size();) {
      int cpu = -1;
      unsigned long long user, nice, system, idle, iowait, irq, softirq;
      if (std::strncmp(p, "cpu", 3) == 0 && p[3] >= '0' && p[3] <= '9' &&
          std::sscanf(p + 3, "%d %llu %llu %llu %llu %llu %llu %llu", &cpu, &user, &nice, &system, &idle, &iowait, &irq,
                      &softirq) == 8 &&
          cpu == mine_[next]) {
        busy += user + nice + system + irq + softirq;
        ++next;
      }
      const char* nl = std::strchr(p, '\n');
      if (!nl) break;
      p = nl + 1;
    }
    if (next != mine_.size()) return false;
    timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return false;
    busy_s = double(busy) * tick;
    self_s = double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
    return true;
  }

  const int hw_;
  const bool cpuset_;
  std::vector<int> mine_;       // our CPUs, ascending
  std::vector<char> stat_buf_;  // /proc/stat (sized once)
  Clock::time_point last_{};
  double busy_prev_ = 0, self_prev_ = 0;
  double avg_ = 0;
  bool sampled_ = false;
};

thread_local bool tl_in_parallel = false;

// Every range of a loop on the calling thread, in order.
void run_here(int64_t n, int64_t grain, detail::RangeFn fn, void* ctx, detail::SetupFn setup, void* setup_ctx) {
  struct Flag {
    Flag() { tl_in_parallel = true; }
    ~Flag() { tl_in_parallel = false; }
  } flag;
  if (setup) setup(setup_ctx);
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

  void run(int64_t n, int64_t grain, detail::RangeFn fn, void* ctx, detail::SetupFn setup, void* setup_ctx) {
    const int team = choose_team();
    loops_.fetch_add(1, std::memory_order_relaxed);
    team_sum_.fetch_add(team, std::memory_order_relaxed);
    if (team < max_threads()) shrunk_loops_.fetch_add(1, std::memory_order_relaxed);
    if (team <= 1) return run_here(n, grain, fn, ctx, setup, setup_ctx);  // the machine is busy: as -t 1 would
    ensure_workers(max_threads() - 1);  // all at once: a growing team then never creates a thread
    set_team_workers(team - 1);

    n_ = n;
    grain_ = grain;
    fn_ = fn;
    ctx_ = ctx;
    setup_ = setup;
    setup_ctx_ = setup_ctx;
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
  Pool() : hw_(affinity_cpus()), load_(hw_, std::max<long>(hw_, sysconf(_SC_NPROCESSORS_ONLN))) {
    max_threads_ = hw_;
    spin_ns_ = int64_t(env_int("K3_SPIN_US", 100)) * 1000;
    adaptive_ = env_int("K3_ADAPTIVE_THREADS", 0) != 0;
  }

  // Claims and runs ranges until none is left (the caller and joined workers alike).
  // The loop's setup on this thread, then its ranges.
  int64_t work() {
    if (setup_) {
      try {
        setup_(setup_ctx_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_, std::memory_order_relaxed);
        return 0;
      }
    }
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
    // Our own runnable threads: this one and every worker not asleep on a futex.
    load_.sample(Clock::now(), 1 + int(workers_.size()) - asleep_.load(std::memory_order_relaxed));
    return std::clamp(hw_ - load_.busy_cpus(), 1, mx);
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
  std::atomic<bool> busy_{false};
  std::atomic<int> max_threads_{1};
  std::atomic<bool> adaptive_{false};
  int64_t spin_ns_ = 100000;

  // The current loop (written by the caller before it publishes the epoch).
  int64_t n_ = 0, grain_ = 1;
  detail::RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  detail::SetupFn setup_ = nullptr;
  void* setup_ctx_ = nullptr;
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
  LoadEstimate load_;                 // touched by the caller's thread

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
void run(int64_t n, int64_t grain, RangeFn fn, void* ctx, SetupFn setup, void* setup_ctx) {
  Pool& pool = Pool::get();
  if (!pool.try_acquire())
    return run_here(n, grain, fn, ctx, setup, setup_ctx);  // another thread's loop holds the pool
  struct Release {
    Pool& p;
    ~Release() { p.release(); }
  } release{pool};
  pool.run(n, grain, fn, ctx, setup, setup_ctx);
}
}  // namespace detail

}  // namespace k3::par
