// Entry points between Model/Session (model.cpp) and the GPU forward (gpu_forward.cpp, or
// gpu_stub.cpp when built without K3_CUDA). Internal to model/.
#pragma once
#include <cstdint>

#include "model/model.h"

namespace k3 {

GpuSessionState* gpu_session_new(const Model& m);
void gpu_session_reset(GpuSessionState* s);
// Model::forward on the GPU (ids already validated); logits to host memory like the CPU path.
void gpu_forward(const Model& m, GpuSessionState* s, const int32_t* ids, int64_t T, bool all_logits, float* logits,
                 const ForwardOptions& opt);

// Device activation buffers of one forward of up to Tcap tokens (floats unless noted); the one
// list both the allocation (gpu_forward.cpp) and the memory plan (gpu_plan.cpp) use.
struct GpuWorkSizes {
  int64_t tokens = 0;        // Tcap
  int64_t hidden_bufs = 0;   // each [Tcap, hidden]: a, xn, y, h, shared-expert out
  int64_t depth_slots = 0;   // each [Tcap, hidden]: block snapshots + the partial sum
  int64_t kda = 0, mla = 0, moe = 0, dense = 0, logits = 0;  // per-family scratch (floats, for Tcap)
  int64_t ids = 0;                                           // int32
  size_t bytes(int64_t hidden) const {
    return size_t(4) * size_t((hidden_bufs + depth_slots) * tokens * hidden + kda + mla + moe + dense + logits + ids);
  }
};
GpuWorkSizes gpu_work_sizes(const ModelDims& d, int64_t Tcap, int64_t dense_inter, int64_t shared_inter);

}  // namespace k3
