// Nominal x efficiency rates and calibration overrides (see rates.h). Every efficiency factor is
// stated here once, with the record or the assumption behind it.
// Must not: invent a rate silently: each one names its source in the report.
#include "plan/rates.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "plan/units.h"

namespace k3::plan {

// docs/data/k3-layer-bench-gpu.json (true-width K3 layers, one H200): extrapolated
// decode_bytes_per_token / decode_s_per_token = 137.24 GB / 52.48 ms = 2.615 TB/s = 0.545 of the
// datasheet's 4.8 TB/s (trunk and experts together; the record does not split them).
const Efficiency kEffGpuGemv{0.545,
                             "true-width K3 layers on an H200 read 2.615 TB/s of 4.8 TB/s nominal "
                             "(docs/data/k3-layer-bench-gpu.json)"};
// Same record, decode_by_batch[batch 32].lm_head_ms = 3.569 ms for 2 x 163840 x 7168 x 32 FLOP =
// 21.1 TFLOP/s = 0.0213 of the dense 989.5 TFLOP/s (the engine's batched GEMVs are not tensor-core GEMMs).
const Efficiency kEffGpuDecodeFlops{0.0213,
                                    "the H200's lm_head at 32 decode rows ran 21.1 TFLOP/s of 989.5 "
                                    "nominal (docs/data/k3-layer-bench-gpu.json)"};
// Same record, extrapolated.prefill_s_per_token = 3.892 ms for the 206.0 GFLOP of weight products of
// one token through 69 KDA + 24 MLA MoE layers (top-16 experts) = 52.9 TFLOP/s = 0.0535 of 989.5.
const Efficiency kEffGpuGemm{0.0535,
                             "true-width K3 prefill (4096 tokens) on an H200 ran 52.9 TFLOP/s effective "
                             "of 989.5 nominal (docs/data/k3-layer-bench-gpu.json)"};
// Assumed: a streaming read reaches ~0.75 of nominal DRAM bandwidth (STREAM-like; not measured on a
// 2-socket server here), and the engine's decode reads at 0.935 of the measured read bandwidth
// (docs/data/k3-layer-bench.json decode_fraction_of_read_bw): 0.75 x 0.935 = 0.70.
const Efficiency kEffCpuMem{0.70,
                            "assumed 0.75 of nominal DRAM bandwidth for a streaming read x the engine's "
                            "0.935 of the read bandwidth (docs/data/k3-layer-bench.json)"};
// Assumed: PCIe Gen5 x16 moves ~54 GB/s of its 64 GB/s per direction (encoding and packet overhead).
const Efficiency kEffPcie{0.85, "assumed (PCIe encoding and packet overhead)"};
const Efficiency kEffDisk{0.90, "assumed (large sequential reads of expert tensors)"};
// Assumed: NCCL reaches ~0.8 of the link rate as bus bandwidth on large messages.
const Efficiency kEffNvlink{0.80, "assumed (collective bus bandwidth on NVLink)"};
const Efficiency kEffNet{0.80, "assumed (collective bus bandwidth on InfiniBand)"};
// Per-core caps: docs/data/calibration-devvm-1thread.json (`k3 plan --calibrate -t 1` on one core
// of the dev VM's AVX-512 Xeon, fast numerics). One core's GEMV rate is what a core can stream and
// decode; the CPU rates are min(bandwidth x 0.70, cores x these). Scaling to many cores linearly is
// an assumption (clock and memory-controller limits are not modelled).
const Efficiency kCpuCoreExpertBps{12.4e9,
                                   "per core, MXFP4 expert GEMV on 1 thread "
                                   "(docs/data/calibration-devvm-1thread.json)"};
const Efficiency kCpuCoreBf16Bps{16.7e9, "per core, BF16 GEMV on 1 thread (docs/data/calibration-devvm-1thread.json)"};
const Efficiency kCpuCoreExpertF32Bps{5.55e9,
                                      "per core, MXFP4 expert GEMV in fp32 activations on 1 thread "
                                      "(docs/data/calibration-devvm-1thread-2026-12-05.json)"};
const Efficiency kCpuCoreExpertFlops{108e9,
                                     "per core, MXFP4 expert GEMM of 64 rows on 1 thread "
                                     "(docs/data/calibration-devvm-1thread.json)"};
const Efficiency kCpuCoreBf16Flops{71.4e9,
                                   "per core, BF16 GEMM of 256 rows on 1 thread "
                                   "(docs/data/calibration-devvm-1thread.json)"};
// The same two on AMX tiles (the amx level; decode GEMVs do not use the tiles).
const Efficiency kCpuCoreExpertFlopsAmx{553e9,
                                        "per core, MXFP4 expert GEMM of 64 rows on 1 thread, amx level "
                                        "(docs/data/calibration-devvm-1thread-amx.json)"};
const Efficiency kCpuCoreBf16FlopsAmx{243e9,
                                      "per core, BF16 GEMM of 256 rows on 1 thread, amx level "
                                      "(docs/data/calibration-devvm-1thread-amx.json)"};

namespace {

std::string pct(double f) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", f);
  return b;
}

Sourced<double> nominal(double value, const std::string& what, const Efficiency& e) {
  return {value * e.value, "nominal " + what + " x " + pct(e.value) + " (" + e.why + ")"};
}

Sourced<double> from_cal(const Calibration& c, const std::string& field, double v) {
  const auto it = c.sources.find(field);
  return {v, "calibration " + c.file + ": " + field + (it != c.sources.end() ? " (" + it->second + ")" : "")};
}

// CPU rate = min(bandwidth x eff, cores x per-core rate), saying which bound it is.
Sourced<double> cpu_bound(const Machine& m, const Efficiency& per_core) {
  const double bw = m.cpu_bw.value * kEffCpuMem.value, cores = double(m.cores.value) * per_core.value;
  if (bw <= cores)
    return {bw, "nominal " + human_rate(m.cpu_bw.value) + " (" + m.cpu_bw.source + ") x " + pct(kEffCpuMem.value) +
                    " (" + kEffCpuMem.why + ")"};
  return {cores, std::to_string(m.cores.value) + " cores x " + human_rate(per_core.value) + " (" + per_core.why +
                     "; below the memory bound " + human_rate(bw) + ")"};
}

}  // namespace

Latencies default_latencies() {
  // Assumed, not measured here: a GPU->CPU->GPU handoff is an event wait plus two small copies
  // (~10-20 us each way on PCIe); a small NCCL all-reduce / all-to-all costs ~15 us on NVLink and
  // ~30 us across InfiniBand nodes.
  // The GPU's per-layer time: measured on the H200 (2026-12-05, docs/data/cuda-profile-gpu-bench-2026-12-05.json):
  // the backend ops of a gpu-bench decode step other than its weight products (matmul*, moe_routed)
  // took 36.65 ms over 64 steps of 8 layers under CUDA events: 72 us per layer.
  return {{20e-6, "assumed 20 us (--sync-us)"},
          {72e-6,
           "72 us measured on the H200: a decode step's ops besides the weight products, per layer "
           "(docs/data/cuda-profile-gpu-bench-2026-12-05.json; --layer-us)"},
          {15e-6, "assumed 15 us (--coll-us)"},
          {30e-6, "assumed 30 us (--net-coll-us)"}};
}

Rates derive_rates(const Machine& m, const Calibration* cal, const Latencies& lat) {
  Rates r;
  r.lat = lat;
  const bool gpu_cal = cal && cal->gpu, cpu_cal = cal && cal->cpu, disk_cal = cal && cal->disk;
  if (!cal) {
    r.mode = "nominal (no calibration)";
  } else {
    std::string parts;
    for (const auto& [name, on] : {std::pair<const char*, bool>{"gpu", gpu_cal}, {"cpu", cpu_cal}, {"disk", disk_cal}})
      parts += std::string(parts.empty() ? "" : ", ") + name + (on ? " from it" : " nominal");
    r.mode = "calibration " + cal->file + " (" + cal->label + "; " + parts + ")";
  }

  // ---- GPU
  if (m.gpu) {
    const GpuSpec& g = *m.gpu;
    if (gpu_cal) {
      const GpuCalibration& x = *cal->gpu;
      if (x.table_name.empty() ? x.name != g.name : x.table_name != g.name)
        fail("calibration " + cal->file + " was measured on " + x.name +
             (x.table_name.empty() ? "" : " (" + x.table_name + ")") + ", but the planned GPU is " + g.name +
             ": plan that GPU without --calibration, or calibrate on it");
      r.gpu_trunk_Bps = from_cal(*cal, "gpu.trunk_gemv_Bps", x.trunk_gemv_Bps);
      r.gpu_expert_Bps = from_cal(*cal, "gpu.expert_gemv_Bps", x.expert_gemv_Bps);
      r.gpu_decode_flops = from_cal(*cal, "gpu.decode_flops", x.decode_flops);
      r.gpu_gemm_flops = from_cal(*cal, "gpu.gemm_flops", x.gemm_flops);
      r.gpu_expert_gemm_flops = from_cal(*cal, "gpu.expert_gemm_flops", x.expert_gemm_flops);
      if (x.layer_s >= 0 && lat.gpu_layer.source.rfind("--layer-us", 0) != 0)
        r.lat.gpu_layer = from_cal(*cal, "gpu.layer_s", x.layer_s);
      if (x.handoff_s >= 0 && lat.sync.source.rfind("--sync-us", 0) != 0)
        r.lat.sync = from_cal(*cal, "gpu.handoff_s", x.handoff_s);
    } else {
      if (g.hbm_Bps <= 0 || g.bf16_flops <= 0)
        fail("GPU " + g.name +
             " has no datasheet rates in the table of known GPUs and no calibration: run k3 plan "
             "--calibrate on it, or pass --gpus with a known kind");
      const std::string hbm = human_rate(g.hbm_Bps) + " HBM (" + g.name + " datasheet)";
      const std::string tf = human_flops(g.bf16_flops) + " dense BF16 (" + g.name + " datasheet)";
      r.gpu_trunk_Bps = nominal(g.hbm_Bps, hbm, kEffGpuGemv);
      r.gpu_expert_Bps = nominal(g.hbm_Bps, hbm, kEffGpuGemv);
      r.gpu_decode_flops = nominal(g.bf16_flops, tf, kEffGpuDecodeFlops);
      r.gpu_gemm_flops = nominal(g.bf16_flops, tf, kEffGpuGemm);
      r.gpu_expert_gemm_flops = r.gpu_gemm_flops;
    }
    if (gpu_cal && cal->gpu->pcie_h2d_Bps > 0) {
      r.pcie_Bps = from_cal(*cal, "gpu.pcie_h2d_Bps", std::min(cal->gpu->pcie_h2d_Bps, cal->gpu->pcie_d2h_Bps));
      if (m.pcie.source.rfind("--pcie", 0) == 0) r.notes.push_back(m.pcie.source + " overridden by the calibration");
    } else {
      r.pcie_Bps = nominal(m.pcie.value, human_rate(m.pcie.value) + " PCIe (" + m.pcie.source + ")", kEffPcie);
    }
    r.nvlink_Bps =
        nominal(m.nvlink.value, human_rate(m.nvlink.value) + " NVLink (" + m.nvlink.source + ")", kEffNvlink);
    r.net_Bps = nominal(m.net.value, human_rate(m.net.value) + " network (" + m.net.source + ")", kEffNet);
  } else if (gpu_cal) {
    r.notes.push_back("the calibration's GPU part (" + cal->gpu->name + ") is unused: the machine has no GPU");
  }

  // ---- CPU
  if (cpu_cal) {
    const CpuCalibration& x = *cal->cpu;
    r.cpu_expert_Bps = from_cal(*cal, "cpu.expert_gemv_Bps", x.expert_gemv_Bps);
    if (x.expert_gemv_f32_Bps > 0) {
      r.cpu_expert_f32_Bps = from_cal(*cal, "cpu.expert_gemv_f32_Bps", x.expert_gemv_f32_Bps);
    } else {  // (a calibration from before 2026-12-05): the fast rate x the measured fp32 / fast ratio of one core
      const double f = kCpuCoreExpertF32Bps.value / kCpuCoreExpertBps.value;
      r.cpu_expert_f32_Bps = {x.expert_gemv_Bps * f, "cpu.expert_gemv_Bps x " + std::to_string(f).substr(0, 4) +
                                                         " (fp32 / fast activations on one dev VM core; the "
                                                         "calibration has no cpu.expert_gemv_f32_Bps)"};
    }
    r.cpu_expert_flops = from_cal(*cal, "cpu.expert_gemm_flops", x.expert_gemm_flops);
    r.cpu_bf16_Bps = from_cal(*cal, "cpu.bf16_gemv_Bps", x.bf16_gemv_Bps);
    r.cpu_bf16_flops = from_cal(*cal, "cpu.bf16_gemm_flops", x.bf16_gemm_flops);
    r.cpu_mem_Bps = from_cal(*cal, "cpu.mem_read_Bps", x.mem_read_Bps);
    for (const std::string* s : {&m.cpu_bw.source, &m.cores.source})
      if (s->rfind("--", 0) == 0) r.notes.push_back(*s + " overridden by the calibration's CPU part");
  } else {
    r.cpu_expert_Bps = cpu_bound(m, kCpuCoreExpertBps);
    r.cpu_expert_f32_Bps = cpu_bound(m, kCpuCoreExpertF32Bps);
    r.cpu_bf16_Bps = cpu_bound(m, kCpuCoreBf16Bps);
    r.cpu_mem_Bps = nominal(m.cpu_bw.value, human_rate(m.cpu_bw.value) + " DRAM (" + m.cpu_bw.source + ")", kEffCpuMem);
    const auto per_core = [&](const Efficiency& e) -> Sourced<double> {
      return {double(m.cores.value) * e.value,
              std::to_string(m.cores.value) + " cores x " + human_flops(e.value) + " (" + e.why + ")"};
    };
    r.cpu_expert_flops = per_core(kCpuCoreExpertFlops);
    r.cpu_bf16_flops = per_core(kCpuCoreBf16Flops);
  }
  r.cpu_expert_prefill_flops = r.cpu_expert_flops;
  r.cpu_bf16_prefill_flops = r.cpu_bf16_flops;
  if (!cpu_cal && m.cpu_amx.value) {  // (a calibration measured the GEMMs at its own level)
    r.cpu_expert_prefill_flops = {double(m.cores.value) * kCpuCoreExpertFlopsAmx.value,
                                  std::to_string(m.cores.value) + " cores x " +
                                      human_flops(kCpuCoreExpertFlopsAmx.value) + " (" +
                                      kCpuCoreExpertFlopsAmx.why + ")"};
    r.cpu_bf16_prefill_flops = {double(m.cores.value) * kCpuCoreBf16FlopsAmx.value,
                                std::to_string(m.cores.value) + " cores x " + human_flops(kCpuCoreBf16FlopsAmx.value) +
                                    " (" + kCpuCoreBf16FlopsAmx.why + ")"};
  }
  if (disk_cal) {
    r.disk_Bps = from_cal(*cal, "disk.seq_read_Bps", cal->disk->seq_read_Bps);
    if (m.disk.source.rfind("--disk", 0) == 0) r.notes.push_back(m.disk.source + " overridden by the calibration");
  } else {
    r.disk_Bps = nominal(m.disk.value, human_rate(m.disk.value) + " (" + m.disk.source + ")", kEffDisk);
  }
  return r;
}

}  // namespace k3::plan
