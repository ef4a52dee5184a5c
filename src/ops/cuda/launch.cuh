// Programmatic dependent launch for the small kernels of a decode step (elementwise.cu, kda.cu,
// mla.cu include this): one definition of the launch helper and of the in-kernel entry barrier.
// Must not: be included by host-only code (it is CUDA source).
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "core/error.h"
#include "ops/cuda/runtime.h"

namespace k3::cuda {
namespace {

// On a created stream (the model's; decode graphs keep these as programmatic edges) the kernels of
// the including file are launched with programmatic stream serialization, so that the next kernel's blocks
// can be scheduled while this one runs and its launch latency is hidden. Every kernel starts with
// pdl_enter(): wait until the previous grid has completed and its writes are visible (a no-op after
// a plain launch), then let the next grid be scheduled (it waits in its own pdl_enter). Nothing
// is read or written before the wait, so the ordering is exactly that of plain launches. The null
// stream gets plain launches.
constexpr bool kPdl = true;

__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, Stream s, A&&... args) {
  if (!kPdl || s == nullptr) {
    kernel<<<grid, block, smem, s>>>(std::forward<A>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
  // The error normally stays pending for the caller's check_launch; make sure it is not lost.
  if (e != cudaSuccess && cudaPeekAtLastError() == cudaSuccess)
    fail(std::string("CUDA: kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace
}  // namespace k3::cuda
