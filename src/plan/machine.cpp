// Known GPU kinds, --gpus parsing, detection of this machine and the flag/detected/default merge
// (see machine.h). Must not: measure rates (plan/calibrate.cpp does) or guess a GPU kind from a
// partial name without saying so.
#include "plan/machine.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "ops/cpu/isa.h"
#include "plan/units.h"
#include "runtime/memory.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace k3::plan {

namespace {

std::string upper(std::string s) {
  for (auto& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Aliases accepted by --gpus (upper case) -> table key.
struct Alias {
  const char* alias;
  const char* key;
};
const Alias kAliases[] = {{"H200", "H200"},           {"H200-141G", "H200"},    {"H200-SXM", "H200"},
                          {"H100", "H100-80G"},       {"H100-80G", "H100-80G"}, {"H100-SXM", "H100-80G"},
                          {"H100-PCIE", "H100-PCIE"}, {"A100", "A100-80G"},     {"A100-80G", "A100-80G"}};

int parse_count(const std::string& s, const std::string& what, int lo, int hi) {
  if (s.empty() || s.size() > 4 || s.find_first_not_of("0123456789") != std::string::npos)
    fail(what + " must be a whole number " + std::to_string(lo) + ".." + std::to_string(hi) + ", got '" + s + "'");
  const int v = std::stoi(s);
  if (v < lo || v > hi)
    fail(what + " must be a whole number " + std::to_string(lo) + ".." + std::to_string(hi) + ", got '" + s + "'");
  return v;
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      if (p != std::string::npos) return line.substr(line.find_first_not_of(' ', p + 1));
    }
  return "";
}

uint64_t mem_total_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (f >> key >> kb >> unit)
    if (key == "MemTotal:") return kb * 1024;
  return 0;
}

}  // namespace

const std::vector<GpuSpec>& known_gpus() {
  // Nominal datasheet figures. NVIDIA quotes tensor-core rates "with sparsity"; the dense rate is
  // half of that. NVLink and PCIe are quoted as totals of both directions; one direction is half.
  static const std::vector<GpuSpec> kGpus = {
      // NVIDIA H200 datasheet / product page, https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM):
      // 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
      {"H200", "NVIDIA H200 SXM 141 GB", 141'000'000'000ULL, 4.8e12, 450e9, 989.5e12, 64e9,
       "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s, BF16 1979 TFLOPS "
       "sparse, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)"},
      // NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column):
      // 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
      {"H100-80G", "NVIDIA H100 SXM 80 GB", 80'000'000'000ULL, 3.35e12, 450e9, 989.5e12, 64e9,
       "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), SXM: 80 GB HBM3, 3.35 TB/s, BF16 1979 "
       "TFLOPS sparse, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)"},
      // Same datasheet, H100 PCIe column: 80 GB HBM2e, 2.0 TB/s, BF16 1,513 TFLOPS with sparsity,
      // NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s.
      {"H100-PCIE", "NVIDIA H100 PCIe 80 GB", 80'000'000'000ULL, 2.0e12, 300e9, 756.5e12, 64e9,
       "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), PCIe: 80 GB HBM2e, 2.0 TB/s, BF16 1513 "
       "TFLOPS sparse, NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s (both directions)"},
      // NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM):
      // 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS dense, NVLink 600 GB/s, PCIe Gen4 64 GB/s.
      {"A100-80G", "NVIDIA A100 SXM 80 GB", 80'000'000'000ULL, 2.039e12, 300e9, 312e12, 32e9,
       "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), 80GB SXM: 2039 GB/s, BF16 312 TFLOPS dense, "
       "NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions)"},
  };
  return kGpus;
}

const GpuSpec& find_gpu(const std::string& name) {
  const std::string u = upper(name);
  for (const Alias& a : kAliases)
    if (u == a.alias)
      for (const GpuSpec& g : known_gpus())
        if (g.name == a.key) return g;
  std::string known;
  for (const GpuSpec& g : known_gpus()) known += (known.empty() ? "" : ", ") + g.name;
  fail("unknown GPU '" + name + "' (known: " + known + "; or describe it with --gpu-mem and a calibration)");
}

GpuCount parse_gpus(const std::string& text) {
  GpuCount r;
  const std::string u = upper(text);
  if (u == "NONE" || u == "0") return r;
  const auto x = u.find('X');
  // "8xH200": a count, 'x', a kind. A kind alone ("H200") is one GPU. ("H100-80G" has no 'x'.)
  if (x != std::string::npos && x > 0 && std::all_of(u.begin(), u.begin() + long(x), ::isdigit)) {
    r.count = parse_count(u.substr(0, x), "--gpus count (in " + text + ")", 1, 64);
    r.spec = find_gpu(text.substr(x + 1));
  } else {
    r.count = 1;
    r.spec = find_gpu(text);
  }
  return r;
}

std::string gpu_table_key(const std::string& device_name) {
  const std::string n = upper(device_name);
  if (n.find("H200") != std::string::npos) return "H200";
  if (n.find("H100") != std::string::npos) return n.find("PCIE") != std::string::npos ? "H100-PCIE" : "H100-80G";
  if (n.find("A100") != std::string::npos) return "A100-80G";
  return "";
}

DetectedMachine detect_machine() {
  DetectedMachine d;
  d.cores = int(std::max(1u, std::thread::hardware_concurrency()));
  d.ram_bytes = mem_total_bytes();
  d.cpu_name = cpu_model_name();
  d.cpu_amx = ops::cpu_isa_detected() == ops::CpuIsa::Amx;
#ifdef K3_HAVE_CUDA
  d.gpu_count = cuda::device_count();
  if (d.gpu_count == 0) {
    d.gpu_note = "no GPU: " + cuda::unavailable_reason();
  } else {
    const cuda::DeviceInfo info = cuda::device_info();
    std::optional<GpuSpec> spec;
    const std::string key = gpu_table_key(info.name);
    if (!key.empty()) {
      spec = find_gpu(key);
    } else {
      GpuSpec g;  // not in the table: what the device reports, compute rate unknown
      g.name = info.name;
      g.full_name = info.name;
      g.hbm_Bps = info.peak_bandwidth_gbs() * 1e9;
      g.source = "reported by the CUDA runtime (not in the table: BF16 rate, NVLink and PCIe unknown)";
      spec = g;
    }
    spec->hbm_bytes = info.total_bytes;  // what this device really has
    d.gpu = spec;
    d.gpu_note = std::to_string(d.gpu_count) + " x " + info.name + " (" + human_bytes(info.total_bytes) + ")";
  }
#else
  d.gpu_note = "no GPU: this k3 was built without the CUDA backend (K3_CUDA=OFF)";
#endif
  return d;
}

Machine build_machine(const MachineFlags& f, const DetectedMachine& here) {
  Machine m;
  m.description =
      f.any_description() ? "described by flags (unset figures: this machine's or stated defaults)" : "this machine";
  if (f.nodes < 1 || f.nodes > 64) fail("--nodes must be 1..64, got " + std::to_string(f.nodes));
  m.nodes = f.nodes;
  if (!f.gpus.empty()) {
    const GpuCount g = parse_gpus(f.gpus);
    m.gpus_per_node = g.count;
    m.gpu = g.spec;
  } else if (here.gpu_count > 0) {
    m.gpus_per_node = here.gpu_count;
    m.gpu = here.gpu;
  }
  if (m.nodes > 1 && m.gpus_per_node == 0) fail("--nodes " + std::to_string(m.nodes) + " needs --gpus (GPUs per node)");
  const std::string gpu_src = f.gpus.empty() ? "detected: CUDA runtime" : "datasheet (--gpus " + f.gpus + ")";
  if (m.gpu) {
    m.gpu_mem = {m.gpu->hbm_bytes, gpu_src};
    if (!f.gpu_mem.empty()) {
      const uint64_t cap = parse_size(f.gpu_mem, "--gpu-mem");
      m.gpu_mem = {std::min(cap, m.gpu->hbm_bytes), cap < m.gpu->hbm_bytes
                                                        ? "--gpu-mem " + f.gpu_mem
                                                        : "--gpu-mem " + f.gpu_mem + " (capped at the GPU's memory)"};
    }
  } else if (!f.gpu_mem.empty()) {
    fail("--gpu-mem " + f.gpu_mem + " given, but there is no GPU (pass --gpus, e.g. --gpus 1xH200)");
  }
  if (!f.ram.empty())
    m.ram = {parse_size(f.ram, "--ram"), "--ram " + f.ram};
  else
    m.ram = {here.ram_bytes, "detected: /proc/meminfo MemTotal"};
  if (m.ram.value == 0) fail("host RAM is unknown (/proc/meminfo unreadable): pass --ram");
  if (!f.ram_budget.empty()) {
    m.ram_budget = parse_size(f.ram_budget, "--ram-budget");
    if (*m.ram_budget > m.ram.value)
      fail("--ram-budget " + f.ram_budget + " (" + human_bytes(*m.ram_budget) + ") exceeds the host RAM (" +
           human_bytes(m.ram.value) + ", " + m.ram.source + ")");
  }
  if (!f.cores.empty())
    m.cores = {parse_count(f.cores, "--cores", 1, 4096), "--cores " + f.cores};
  else
    m.cores = {here.cores, "detected: hardware threads"};
  m.cpu_name = f.cores.empty() && f.cpu_bw.empty() ? here.cpu_name : "";
  if (f.cpu_isa == "amx" || f.cpu_isa == "avx512")
    m.cpu_amx = {f.cpu_isa == "amx", "--cpu-isa " + f.cpu_isa};
  else if (!f.cpu_isa.empty())
    fail("--cpu-isa " + f.cpu_isa + ": expected avx512 or amx (the CPU level of the planned cores)");
  else if (f.any_description())
    m.cpu_amx = {false, "assumed avx512 (pass --cpu-isa amx for cores with AMX tiles)"};
  else
    m.cpu_amx = {here.cpu_amx, std::string("detected: this CPU's kernel level is ") +
                                   (here.cpu_amx ? "amx" : "not amx")};
  if (!f.cpu_bw.empty())
    m.cpu_bw = {parse_rate(f.cpu_bw, "--cpu-bw"), "--cpu-bw " + f.cpu_bw};
  else
    m.cpu_bw = {kDefaultCpuBw,
                "assumed default 50 GB/s (not detectable without measuring: pass --cpu-bw or "
                "--calibration)"};
  if (!f.disk.empty())
    m.disk = {parse_rate(f.disk, "--disk"), "--disk " + f.disk};
  else
    m.disk = {kDefaultDisk, "assumed default 7 GB/s (a PCIe 4.0 x4 NVMe SSD, sequential read): pass --disk"};
  if (m.gpu) {
    if (!f.pcie.empty())
      m.pcie = {parse_rate(f.pcie, "--pcie"), "--pcie " + f.pcie};
    else if (m.gpu->pcie_Bps > 0)
      m.pcie = {m.gpu->pcie_Bps, "datasheet: " + m.gpu->name + " host link, one direction"};
    else
      fail("the PCIe rate of " + m.gpu->name + " is unknown: pass --pcie");
    if (!f.nvlink.empty())
      m.nvlink = {parse_rate(f.nvlink, "--nvlink"), "--nvlink " + f.nvlink};
    else
      m.nvlink = {m.gpu->nvlink_Bps, "datasheet: " + m.gpu->name + " NVLink, one direction"};
    if (!f.net.empty())
      m.net = {parse_rate(f.net, "--net"), "--net " + f.net};
    else
      // InfiniBand NDR: 400 Gb/s per port = 50 GB/s (NVIDIA Quantum-2 / ConnectX-7 NDR,
      // https://www.nvidia.com/en-us/networking/quantum2/), one HCA per GPU as in DGX/HGX H100/H200 nodes.
      m.net = {kDefaultNet, "default: InfiniBand NDR 400 Gb/s = 50 GB/s per GPU (NVIDIA Quantum-2 / ConnectX-7)"};
  } else {
    for (const auto& [flag, v] :
         {std::pair<const char*, const std::string&>{"--pcie", f.pcie}, {"--nvlink", f.nvlink}, {"--net", f.net}})
      if (!v.empty()) fail(std::string(flag) + " " + v + " given, but there is no GPU (pass --gpus)");
  }
  return m;
}

}  // namespace k3::plan
