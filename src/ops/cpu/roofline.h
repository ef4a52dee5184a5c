// Roofline measurements of this machine, taken in the same run as a benchmark so that ratios
// (achieved / possible) compare like with like: streaming read bandwidth and the peak multiply-add
// rate of the widest product the active CPU level has (vdpbf16ps for avx512, fp32 FMA otherwise).
// Owns: the probe loops' timing and threading. Must not: be called on hot paths (each call takes
// ~0.1-1 s and allocates the probe buffer).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace k3::ops {

struct Roofline {
  int threads = 0;
  double read_gbs = 0;       // best of reps, GB/s (1e9 bytes), reading a buffer >> last-level cache
  double peak_gflops = 0;    // best of reps, GFLOP/s (1e9, 2 per multiply-add)
  std::string peak_kind;     // "bf16 vdpbf16ps", "fp32 fma" or "fp32 scalar"
  uint64_t probe_bytes = 0;  // buffer size read by the bandwidth probe
};

// Both measurements with `threads` threads of the pool (0 = the current -t setting), never fewer.
Roofline measure_roofline(int threads = 0, uint64_t probe_bytes = uint64_t(1) << 30, int reps = 5);

// The two probes on their own, for probing again between timed runs (a shared machine's
// bandwidth moves within seconds): ReadProbe keeps its buffer, so each measure() only reads it.
class ReadProbe {
 public:
  ReadProbe(int threads, uint64_t probe_bytes);  // allocates and fills the buffer (k3::Error if it cannot)
  double measure(int reps) const;                // best of reps, GB/s
  uint64_t bytes() const { return bytes_; }
  int threads() const { return threads_; }

 private:
  int threads_ = 0;
  uint64_t bytes_ = 0;
  std::unique_ptr<uint8_t, void (*)(void*)> buf_;
};
// Both probes with an existing read probe (its threads, its buffer).
Roofline measure_roofline(const ReadProbe& probe, int reps = 5);
double measure_peak_gflops(int threads, int reps);  // best of reps, GFLOP/s
const char* peak_kind();                            // what measure_peak_gflops times

}  // namespace k3::ops
