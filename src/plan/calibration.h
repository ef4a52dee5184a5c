// A calibration file: rates measured by `k3 plan --calibrate` or derived from recorded runs, its schema,
// strict reading, writing and default path ($XDG_CACHE_HOME/k3/calibration.json, ~/.cache/k3/...).
// Each part (cpu, disk, gpu) is optional: the planner takes a missing part nominally and says so.
// Must not: measure (plan/calibrate.h) or plan.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace k3::plan {

inline constexpr int kCalibrationVersion = 1;

struct CpuCalibration {
  int threads = 0;
  std::string isa, numerics;     // the kernel level and numerics the rates were taken with
  double expert_gemv_Bps = 0;    // MXFP4 routed-expert bytes per second, decode (one token, top_k experts)
  double expert_gemv_f32_Bps = 0;  // the same in fp32 activations (the hybrid's default); 0: not recorded
  double expert_gemm_flops = 0;  // MXFP4 routed experts with `expert_gemm_rows` rows each (prefill), FLOP/s
  int64_t expert_gemm_rows = 0;
  double bf16_gemv_Bps = 0;    // BF16 weight bytes per second, decode GEMV
  double bf16_gemm_flops = 0;  // BF16 GEMM (prefill rows), FLOP/s
  double mem_read_Bps = 0;     // streaming read bandwidth
  double mem_copy_Bps = 0;     // memcpy: bytes copied per second
};

struct DiskCalibration {
  double seq_read_Bps = 0;
  std::string method;  // "O_DIRECT" | "buffered after posix_fadvise(POSIX_FADV_DONTNEED)" | ...
  std::string path;    // the directory the temporary file was in
  uint64_t file_bytes = 0;
  std::string note;  // e.g. that the page cache may inflate a buffered read
};

struct GpuCalibration {
  std::string name;              // device name as reported ("NVIDIA H200")
  std::string table_name;        // the known-GPU key it matches ("H200"), "" if none
  uint64_t hbm_bytes = 0;        // device memory (0: not recorded)
  double hbm_copy_Bps = 0;       // device-to-device copy, bytes read + written per second
  double trunk_gemv_Bps = 0;     // BF16 weight bytes per second, decode (batch 1)
  double expert_gemv_Bps = 0;    // MXFP4 routed-expert bytes per second, decode (batch 1)
  double decode_flops = 0;       // decode GEMV compute rate once rows dominate (batched decode), FLOP/s
  double gemm_flops = 0;         // prefill: BF16 trunk weight products, FLOP/s (as the source says)
  double expert_gemm_flops = 0;  // prefill: MXFP4 routed-expert products, FLOP/s
  // Host link (0: not measured; the planner then uses the machine's nominal PCIe rate).
  double pcie_h2d_Bps = 0, pcie_d2h_Bps = 0;
  // Per decoder layer and decode step, the GPU time besides the weight reads (norms and residual
  // mixes, router, state preparation, attention, the gaps between launches); 0 where trunk_gemv_Bps
  // already holds it (rates from whole-layer timings); < 0: not recorded (the planner's default).
  double layer_s = -1;
  // The hybrid placement's handoff per MoE layer (the rows' routing and activations to the host, the
  // CPU's thread pool started twice, the sum back, the stream waiting): seconds; < 0: not measured
  // (the planner's --sync-us default).
  double handoff_s = -1;
};

struct Calibration {
  std::string file;   // where it was read from / written to
  std::string label;  // "this machine (k3 plan --calibrate)", "1xH200 (from the recorded runs)"
  std::string date, command, machine;
  std::optional<CpuCalibration> cpu;
  std::optional<DiskCalibration> disk;
  std::optional<GpuCalibration> gpu;
  // field ("gpu.trunk_gemv_Bps") -> where the value came from (records: "file: field"; measured:
  // what was timed). Printed next to each rate the planner takes from this file.
  std::map<std::string, std::string> sources;
};

// Reads and validates a calibration file; k3::Error "<file>: <problem>" (one line) on a missing
// file, bad JSON, a wrong version, a missing or non-positive rate in a part that is present.
Calibration read_calibration(const std::string& path);
std::string calibration_json(const Calibration& c);  // pretty-printed, ends with a newline
// Writes it (creating parent directories); k3::Error naming the path on failure.
void write_calibration(const Calibration& c, const std::string& path);
// $XDG_CACHE_HOME/k3/calibration.json, else $HOME/.cache/k3/calibration.json; k3::Error when
// neither variable is set.
std::string default_calibration_path();

}  // namespace k3::plan
