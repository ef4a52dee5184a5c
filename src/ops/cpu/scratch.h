// Per-thread scratch buffers of the CPU kernels that grow and are kept: once a step of the largest
// shape has run, a kernel's temporaries cost no heap traffic (the steady-state decode loop
// allocates nothing; tests/model/test_no_alloc.cpp counts). Contents are undefined on return.
// Owns: the ids of every kernel temporary. Must not: be used for anything that outlives one call.
// Each user names its own ScratchId, so buffers in use at the same time on one thread never
// alias; the pool's workers (core/thread_pool.h) each have their own set.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace k3::ops::cpu {

enum class ScratchId : uint8_t {
  ConvWeightsT,
  ConvHistory,
  KdaGateA,
  KdaHead,
  AttnPartAcc,
  AttnPartM,
  AttnPartZ,
  AttnBlock,
  AttnM,
  AttnZ,
  MlaLimits,
  MlaQt,
  MlaCh,
  MlaW,
  MlaTileLatent,
  MlaTileLatentT,
  MlaTileRope,
  MlaTileKeys,
  MlaTileValues,
  MlaRunM,
  MlaRunZ,
  RouterScores,
  RouterSelect,
  RouterOrder,
  GemmRows,
  GemmRounded,
  ScalarRows,
  Bf16PackedX,
  Bf16RowTile,
  kCount
};

// At least `bytes` bytes, 64-byte aligned, owned by the calling thread until its next call with `id`.
void* scratch_bytes(ScratchId id, size_t bytes);

template <class T>
T* scratch(ScratchId id, int64_t n) {
  return static_cast<T*>(scratch_bytes(id, sizeof(T) * size_t(n > 0 ? n : 1)));
}
// The same, zero-filled (for kernels that read parts of their scratch they do not write first).
template <class T>
T* scratch_zeroed(ScratchId id, int64_t n) {
  const size_t bytes = sizeof(T) * size_t(n > 0 ? n : 1);
  return static_cast<T*>(std::memset(scratch_bytes(id, bytes), 0, bytes));
}

}  // namespace k3::ops::cpu
