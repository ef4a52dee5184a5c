// The machine `k3 plan` places a model on: GPUs (a table of known kinds with datasheet figures), nodes,
// host RAM, cores, memory bandwidth, PCIe, disk and network; this machine by default (a GPU only when
// the CUDA backend is built and one is present) or flags. Every figure says where it came from.
// Must not: measure anything (plan/calibrate.h does) or know about models.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace k3::plan {

// Nominal figures of one GPU kind (datasheet values; the public source is in `source`).
struct GpuSpec {
  std::string name;        // table key, e.g. "H200"
  std::string full_name;   // "NVIDIA H200 SXM 141 GB"
  uint64_t hbm_bytes = 0;  // memory capacity (datasheet, 1e9-byte GB)
  double hbm_Bps = 0;      // memory bandwidth, bytes/s
  double nvlink_Bps = 0;   // NVLink bandwidth per GPU and direction, bytes/s (0: none)
  double bf16_flops = 0;   // dense BF16 tensor-core rate, FLOP/s (0: unknown)
  double pcie_Bps = 0;     // host link per direction, bytes/s
  std::string source;      // where the figures are published
};

// The known GPU kinds (H200, H100-80G, H100-PCIE, A100-80G).
const std::vector<GpuSpec>& known_gpus();
// By table key or alias, case-insensitive ("h200", "H100", "H100-SXM"); k3::Error naming the known kinds.
const GpuSpec& find_gpu(const std::string& name);

// The table key a CUDA device name ("NVIDIA H200") matches, "" when none.
std::string gpu_table_key(const std::string& device_name);

struct GpuCount {
  int count = 0;                // 0: no GPU
  std::optional<GpuSpec> spec;  // set when count > 0
};
// "8xH200", "2xH100-80G", "H200" (one), "none" or "0" (no GPU); k3::Error otherwise.
GpuCount parse_gpus(const std::string& text);

// A value and where it came from ("--cpu-bw", "detected: /proc/meminfo", "datasheet: ...", "assumed: ...").
template <class T>
struct Sourced {
  T value{};
  std::string source;
};

struct Machine {
  std::string description;             // "this machine" | "described by flags"
  int nodes = 1;                       // hosts; GPUs per node below
  int gpus_per_node = 0;               // 0: CPU only
  std::optional<GpuSpec> gpu;          // the kind (figures nominal); set iff gpus_per_node > 0
  Sourced<uint64_t> gpu_mem;           // usable memory per GPU (--gpu-mem caps it)
  Sourced<uint64_t> ram;               // host RAM per node
  std::optional<uint64_t> ram_budget;  // --ram-budget: host bytes the weights may use (per node)
  Sourced<int> cores;                  // CPU cores per node
  Sourced<bool> cpu_amx;               // the cores run the prefill GEMMs on AMX tiles (the amx level)
  Sourced<double> cpu_bw;              // host memory bandwidth per node, bytes/s (nominal)
  Sourced<double> pcie;                // host <-> GPU, per GPU and direction (nominal)
  Sourced<double> disk;                // sequential read of the expert store (nominal)
  Sourced<double> nvlink;              // per GPU and direction (nominal)
  Sourced<double> net;                 // inter-node, per GPU (nominal)
  std::string cpu_name;                // "Intel(R) Xeon(R) ..." when detected
  int world() const { return nodes * gpus_per_node; }
};

// The flags that describe a machine (empty string: not given).
struct MachineFlags {
  std::string gpus, gpu_mem, ram, ram_budget, cpu_bw, cores, pcie, disk, net, nvlink;
  std::string cpu_isa;  // "avx512" | "amx" (empty: this machine's level, or avx512 for a described machine)
  int nodes = 1;
  bool any_description() const {
    return !gpus.empty() || !ram.empty() || !cpu_bw.empty() || !cores.empty() || !pcie.empty() || !disk.empty() ||
           !net.empty() || !nvlink.empty() || nodes != 1;
  }
};

// Detected facts of this machine (no measurement): cores, MemTotal, CPU model name, and the GPUs the
// CUDA runtime sees when the backend is built in (count 0 otherwise, with the reason in gpu_note).
struct DetectedMachine {
  int cores = 0;
  uint64_t ram_bytes = 0;
  std::string cpu_name;
  bool cpu_amx = false;  // the kernels' detected level is amx
  int gpu_count = 0;
  std::optional<GpuSpec> gpu;  // a table entry when the device name matches one, else its own figures
  std::string gpu_note;        // "no GPU: ...", "CUDA backend not built (K3_CUDA=OFF)", or the device
};
DetectedMachine detect_machine();

// The machine to plan for: flags over detected facts over stated defaults. k3::Error (one line) on
// a bad value (unknown GPU, bad suffix, zero/negative rate, --nodes < 1, --nodes > 1 without GPUs).
Machine build_machine(const MachineFlags& f, const DetectedMachine& here);

// Defaults used when a figure is neither given nor detectable (each is said to be assumed).
inline constexpr double kDefaultCpuBw = 50e9;  // one socket with a few DDR4/DDR5 channels
inline constexpr double kDefaultDisk = 7e9;    // one PCIe 4.0 x4 NVMe SSD, sequential read
inline constexpr double kDefaultNet = 50e9;    // InfiniBand NDR 400 Gb/s per GPU (one HCA per GPU)

}  // namespace k3::plan
