// Runs sublayers and single decoder layers outside a Model (the layer fixtures, the layer bench):
// sequences in slots of their own state pool on the CPU backend, each step with the StepView a
// Model step would build. Not a serving path: it allocates per step.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "model/backends.h"
#include "model/layers.h"
#include "model/state_pool.h"

namespace k3 {

struct LayerRunner {
  std::unique_ptr<Backend> be = make_cpu_backend();
  StatePool pool;
  int32_t slot;  // a first sequence, allocated up front
  Workspace work;

  // is_kda[L] for layers 0..L of the pool (the layers the caller runs).
  LayerRunner(const ModelDims& d, std::vector<bool> is_kda, int64_t work_floats = int64_t(1) << 22)
      : pool(*be, d, std::move(is_kda)), slot(pool.alloc()), work(*be, work_floats) {}

  // fn(ctx) on the next n tokens of sequence `s`; the numerics hold for the ops fn calls.
  void step(int32_t s, int64_t n, const std::function<void(const StepCtx&)>& fn,
            StepNumerics num = StepNumerics::Exact) {
    pool.reserve_append(s, n);
    const std::vector<int32_t> cu{0, int32_t(n)}, slots{s};
    const std::vector<int64_t> pos0{pool.position(s)};
    const std::vector<int32_t>& table = pool.pages(s);
    const std::vector<int32_t> ids(size_t(n), 0);
    const StepView v{1,
                     n,
                     cu.data(),
                     slots.data(),
                     pos0.data(),
                     table.data(),
                     int64_t(table.size()),
                     pool.page_tokens(),
                     n,
                     pool.slot_capacity(),
                     pool.page_capacity(),
                     &pool,
                     pool.epoch()};
    work.rewind(0);
    be->begin_step(v, ids.data(), num, false);
    try {
      fn(StepCtx{*be, v, work, n});
    } catch (...) {
      be->abort_step();
      throw;
    }
    be->end_step();
    pool.advance(s, n);
  }
  void step(int64_t n, const std::function<void(const StepCtx&)>& fn, StepNumerics num = StepNumerics::Exact) {
    step(slot, n, fn, num);
  }
};

}  // namespace k3
