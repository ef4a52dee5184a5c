// The CPU's parallel loops: one process-wide pool of worker threads that join the calling thread
// on a loop split into ranges, claimed one at a time by whichever thread is free. Workers spin
// briefly between loops, then sleep; optionally (K3_ADAPTIVE_THREADS=1) the team shrinks while other
// processes keep the cores busy (docs/performance.md, "Threads on a busy machine").
// Owns: the worker threads, how they wait, how many take part. Must not: know what the work is,
// or let the result depend on which thread ran a range (callers write disjoint outputs).
#pragma once
#include <cstdint>
#include <type_traits>

namespace k3::par {

// CPUs this process may run on (its affinity mask); at least 1.
int hardware_threads();
// Threads a loop may use, the calling thread included (the -t setting); at least 1.
int max_threads();
// n <= 0: the default (hardware_threads()). Takes effect at the next loop; call it from the thread
// that runs the loops, not inside one.
void set_max_threads(int n);
// Adaptive team size (default off; K3_ADAPTIVE_THREADS=1 turns it on): before a loop the pool
// estimates how many of this machine's CPUs other processes keep busy and uses at most the rest,
// never fewer than the calling thread: it leaves the cores to other work. Off: every loop may use
// max_threads(); claimed ranges already keep a busy machine from stalling the loops, and measured
// with other processes busy, the whole team was faster than a shrunk one (docs/performance.md).
void set_adaptive(bool on);
bool adaptive();
// True on a thread that is running a range of a parallel loop (a nested loop then runs inline).
bool in_parallel();

// For its lifetime, loops may use exactly n threads (n <= 0: hardware_threads()) whatever the
// machine's load (the roofline probes, which measure what n threads can do); restores both
// settings after.
class FixedThreads {
 public:
  explicit FixedThreads(int n);
  ~FixedThreads();
  FixedThreads(const FixedThreads&) = delete;
  FixedThreads& operator=(const FixedThreads&) = delete;

 private:
  int saved_threads_;
  bool saved_adaptive_;
};

// What the pool did since the process started or the last reset_stats() (bench and tests).
struct Stats {
  int64_t loops = 0;          // loops run on the pool (not those run inline)
  int64_t worker_ranges = 0;  // ranges taken by workers (the rest ran on the calling thread)
  int64_t team_sum = 0;       // sum over loops of the team size offered (calling thread included)
  int64_t shrunk_loops = 0;   // loops whose team the busy machine made smaller than max_threads()
  double mean_team() const { return loops ? double(team_sum) / double(loops) : 0.0; }
};
Stats stats();
void reset_stats();

namespace detail {
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
using SetupFn = void (*)(void* ctx);
// Runs fn over [0, n) in ranges of `grain` on the pool, setup (if any) once on each thread that
// joins; rethrows the first exception of a range or setup after every range has finished.
void run(int64_t n, int64_t grain, RangeFn fn, void* ctx, SetupFn setup, void* setup_ctx);
bool run_inline(int64_t n, int64_t grain);
}  // namespace detail

// Calls fn(begin, end) for the ranges [0, g), [g, 2g), ... covering [0, n) (g = grain >= 1), each
// exactly once, in parallel when `parallel` and there is more than one range; returns when all
// are done. Ranges are claimed in increasing order by whichever thread is free, so fn must give
// the same result whichever thread runs it (write disjoint outputs; use per-thread scratch).
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn, bool parallel = true) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (!parallel || detail::run_inline(n, grain)) {
    for (int64_t b = 0; b < n; b += grain) fn(b, b + grain < n ? b + grain : n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  detail::run(
      n, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&fn)), nullptr, nullptr);
}

// parallel_for, and setup() once on every thread that joins the loop, before it claims a range (also
// on a thread that then finds none left), and once on the caller when the loop runs inline. For
// per-thread buffers: sized there, they grow when a thread joins a loop of a new size, not whenever
// it first happens to win a range of one (a warm-up then sizes every awake worker's buffers).
template <class S, class F>
void parallel_for_setup(int64_t n, int64_t grain, S&& setup, F&& fn, bool parallel = true) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (!parallel || detail::run_inline(n, grain)) {
    setup();
    for (int64_t b = 0; b < n; b += grain) fn(b, b + grain < n ? b + grain : n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  using Sn = std::remove_reference_t<S>;
  detail::run(
      n, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&fn)), [](void* ctx) { (*static_cast<Sn*>(ctx))(); },
      const_cast<void*>(static_cast<const void*>(&setup)));
}

// fn(i) for every i in [0, n), one index per claim (for items of uneven or large cost).
template <class F>
void parallel_for_each(int64_t n, F&& fn, bool parallel = true) {
  parallel_for(
      n, 1,
      [&fn](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) fn(i);
      },
      parallel);
}

// parallel_for_setup with one index per claim.
template <class S, class F>
void parallel_for_each_setup(int64_t n, S&& setup, F&& fn, bool parallel = true) {
  parallel_for_setup(
      n, 1, setup,
      [&fn](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) fn(i);
      },
      parallel);
}

// A grain that gives each thread about 4 ranges of an even loop (load balance on shared cores).
inline int64_t balanced_grain(int64_t n) {
  const int64_t parts = 4 * int64_t(max_threads());
  return n <= parts ? 1 : (n + parts - 1) / parts;
}

}  // namespace k3::par
