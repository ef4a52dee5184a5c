// Builds without K3_CUDA: the CUDA backend refuses with one line (no silent CPU fallback).
#include "core/error.h"
#include "model/backends.h"

namespace k3 {
std::unique_ptr<Backend> make_cuda_backend(const Model&, const GpuOptions&) {
  fail("--device cuda: this k3 was built without the CUDA backend (configure with nvcc present, or -DK3_CUDA=ON)");
}
std::unique_ptr<Backend> make_cuda_backend_for_dims(const ModelDims&, const GpuOptions&) {
  fail("--device cuda: this k3 was built without the CUDA backend (configure with nvcc present, or -DK3_CUDA=ON)");
}
}  // namespace k3
