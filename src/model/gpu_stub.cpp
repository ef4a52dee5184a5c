// Builds without K3_CUDA: the GPU entry points exist and refuse with one line (no silent CPU
// fallback); the handles are always empty.
#include "core/error.h"
#include "model/gpu_internal.h"

namespace k3 {

void GpuModelDeleter::operator()(GpuModel*) const {}
GpuStateHandle::GpuStateHandle(const GpuStateHandle&) {}
GpuStateHandle& GpuStateHandle::operator=(const GpuStateHandle&) { return *this; }
GpuStateHandle& GpuStateHandle::operator=(GpuStateHandle&&) noexcept { return *this; }
GpuStateHandle::~GpuStateHandle() = default;

void Model::use_gpu(const GpuOptions&) {
  fail("--device cuda: this k3 was built without the CUDA backend (configure with nvcc present, or -DK3_CUDA=ON)");
}
void Model::set_gpu_graphs(bool) const { fail("GPU graphs need a K3_CUDA build"); }
GpuSessionState* gpu_session_new(const Model&) { fail("GPU sessions need a K3_CUDA build"); }
void gpu_session_reset(GpuSessionState*) {}
void gpu_forward(const Model&, GpuSessionState*, const int32_t*, int64_t, bool, float*, const ForwardOptions&) {
  fail("GPU forward needs a K3_CUDA build");
}
void Session::gpu_pull(bool) const {}
void Session::gpu_push(bool) {}

}  // namespace k3
