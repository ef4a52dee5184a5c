// `k3 plan --calibrate`: this machine's rates for the planner, timed on the engine's own kernels at
// K3's shapes: CPU (MXFP4 expert GEMV as the CPU backend calls it for a decode token, expert GEMM,
// BF16 GEMV/GEMM, read/copy bandwidth), disk (O_DIRECT read of a file it writes), GPU (calibrate_gpu.cpp).
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
