// Runs sublayers and single decoder layers outside a Model (the layer fixtures, the layer bench):
// sequences in slots of their own state pool on the CPU backend, each step with the StepView a
// Model step would build. Not a serving path: it allocates per step.
#pragma once
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include "model/backends.h"
#include "model/layers.h"
#include "model/state_pool.h"

namespace k3 {

struct LayerRunner {
  std::unique_ptr<Backend> owned;  // the CPU backend made here, unless one was lent
  Backend* be;
  StatePool pool;
  int32_t slot;  // a first sequence, allocated up front
  Workspace work;

  // is_kda[L] for layers 0..L of the pool (the layers the caller runs); on a CPU backend of its own,
  // or on `lent` (the layer bench's GPU mode; it must outlive the runner).
  LayerRunner(const ModelDims& d, std::vector<bool> is_kda, int64_t work_floats = int64_t(1) << 22,
              Backend* lent = nullptr)
      : owned(lent ? nullptr : make_cpu_backend()),
        be(lent ? lent : owned.get()),
        pool(*be, d, std::move(is_kda)),
        slot(pool.alloc()),
        work(*be, work_floats) {}

  // fn(ctx) on the next n tokens of each sequence in `seqs` (one step, rows packed in that order);
  // the numerics hold for the ops fn calls. replayable: a decode step (n == 1) the backend may
  // record and replay (a CUDA graph): when it replays, fn is not called.
  void step_many(const std::vector<int32_t>& seqs, int64_t n, const std::function<void(const StepCtx&)>& fn,
                 StepNumerics num = StepNumerics::Exact, bool replayable = false) {
    const int64_t N = int64_t(seqs.size()), rows = N * n;
    std::vector<int32_t> cu{0};
    std::vector<int64_t> pos0;
    int64_t max_pages = 0;
    for (const int32_t s : seqs) {
      pool.reserve_append(s, n);
      cu.push_back(cu.back() + int32_t(n));
      pos0.push_back(pool.position(s));
      max_pages = std::max<int64_t>(max_pages, int64_t(pool.pages(s).size()));
    }
    std::vector<int32_t> table(size_t(N * std::max<int64_t>(max_pages, 1)), -1);
    for (int64_t i = 0; i < N; ++i) {
      const std::vector<int32_t>& t = pool.pages(seqs[size_t(i)]);
      std::copy(t.begin(), t.end(), table.begin() + i * std::max<int64_t>(max_pages, 1));
    }
    const std::vector<int32_t> ids(size_t(rows), 0);
    const StepView v{N,
                     rows,
                     cu.data(),
                     seqs.data(),
                     pos0.data(),
                     table.data(),
                     std::max<int64_t>(max_pages, 1),
                     pool.page_tokens(),
                     n,
                     pool.slot_capacity(),
                     pool.page_capacity(),
                     &pool,
                     pool.epoch()};
    work.rewind(0);
    if (be->begin_step(v, ids.data(), num, replayable && n == 1)) {
      try {
        fn(StepCtx{*be, v, work, rows});
      } catch (...) {
        be->abort_step();
        throw;
      }
    }
    be->end_step();
    for (const int32_t s : seqs) pool.advance(s, n);
  }
  void step(int32_t s, int64_t n, const std::function<void(const StepCtx&)>& fn,
            StepNumerics num = StepNumerics::Exact) {
    step_many({s}, n, fn, num);
  }
  void step(int64_t n, const std::function<void(const StepCtx&)>& fn, StepNumerics num = StepNumerics::Exact) {
    step(slot, n, fn, num);
  }
};

}  // namespace k3
