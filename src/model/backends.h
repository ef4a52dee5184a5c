// The backends there are: the CPU one (model/backend_cpu.cpp) and, in K3_CUDA builds, the CUDA one
// (model/backend_cuda.cpp; without K3_CUDA, backend_cuda_stub.cpp refuses in one line).
#pragma once
#include <memory>

#include "model/backend.h"

namespace k3 {
class Model;
struct GpuOptions;
std::unique_ptr<Backend> make_cpu_backend();
// Checks that a usable GPU exists and that the model fits in its free memory (one-line k3::Error
// naming the sizes otherwise).
std::unique_ptr<Backend> make_cuda_backend(const Model& m, const GpuOptions& o);
// A CUDA backend for layers run outside a Model (the layer bench): checks the GPU, not the memory.
std::unique_ptr<Backend> make_cuda_backend_for_dims(const ModelDims& d, const GpuOptions& o);
}  // namespace k3
