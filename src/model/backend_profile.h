// Per-op time of the forward (k3 bench --profile): a Backend that forwards every op to the real one
// and, while a sink is set, adds the op's time to it by op name. On a backend with device marks
// (CUDA: events) that is the device time between a mark before and one after the op, read at the
// end of the step; elsewhere the host clock around the op. It asks for no graph replay while
// timing, so ops run as separate launches: the total is near an unprofiled no-graph step.
// Owns: the op names of the table. Must not: change what an op computes.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "model/backend.h"

namespace k3 {

struct OpProfile {
  struct Entry {
    int64_t calls = 0;
    double seconds = 0;
  };
  std::map<std::string, Entry> ops;  // by op name ("matmul", "kda", "moe_routed", ...)
  int64_t steps = 0;                 // begin_step .. end_step pairs seen
  // The routed experts the run chose: router calls seen and, summed over them, the distinct experts
  // each call's rows selected (for a decode step, the union its MoE layer reads). Read back after
  // each router op, outside its timing.
  int64_t router_calls = 0;
  double distinct_experts = 0;
  void clear() { *this = {}; }
  double total_seconds() const {
    double s = 0;
    for (const auto& [name, e] : ops) s += e.seconds;
    return s;
  }
};

// Wraps `inner`; `sink` may be null (then nothing is timed) and can be changed later by
// set_profile_sink on the returned backend.
std::unique_ptr<Backend> make_profiling_backend(std::unique_ptr<Backend> inner, OpProfile* sink);
// Sets the sink of a backend made by make_profiling_backend; false for any other backend.
bool set_profile_sink(Backend& be, OpProfile* sink);

}  // namespace k3
