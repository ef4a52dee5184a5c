// `k3 plan --calibrate`: measures this machine's rates for the planner. CPU: the engine's own MXFP4
// expert GEMV at K3's expert shape (gate/up 3072 x 3584, down 3584 x 3072; the calls the CPU
// backend makes for one decode token: ops::matmul_shared_input over the top-k gate+up, then
// ops::matmul_many over the downs), the experts' GEMM with prefill rows, BF16 GEMV/GEMM, memory
// read and copy bandwidth; disk: sequential read of a temporary file written for it (O_DIRECT where
// the file system allows, else a buffered read after posix_fadvise DONTNEED, which is said);
// GPU (K3_CUDA builds with a GPU present; plan/calibrate_gpu.cpp): the engine's CUDA kernels.
// Must not: plan, or run on a hot path (each part allocates its buffers and takes seconds).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "plan/calibration.h"

namespace k3::plan {

struct CalibrateOptions {
  int threads = 0;                          // CPU threads (0: all)
  uint64_t pool_bytes = uint64_t(1) << 30;  // distinct weights the GEMV probes cycle through (>> caches)
  uint64_t disk_bytes = uint64_t(1) << 30;  // size of the temporary file read back
  std::string disk_dir;                     // where the temporary file goes ("" : $TMPDIR or /tmp)
  bool cpu = true, disk = true;
  bool gpu = false;                                  // measure the GPU part (refused in one line without a GPU)
  std::function<void(const std::string&)> progress;  // one line per step (stderr), may be empty
};

CpuCalibration measure_cpu(const CalibrateOptions& o, std::map<std::string, std::string>& sources);
DiskCalibration measure_disk(const CalibrateOptions& o, std::map<std::string, std::string>& sources);
// k3::Error (one line) when the build has no CUDA backend or no GPU is present.
GpuCalibration measure_gpu(const CalibrateOptions& o, std::map<std::string, std::string>& sources);
// Whether measure_gpu can run here ("" if so, else why not, one line).
std::string gpu_unavailable_reason();

}  // namespace k3::plan
