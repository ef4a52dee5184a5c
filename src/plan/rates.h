// The rates the cost model uses (bytes/s, FLOP/s, seconds), each with where it came from: a
// calibration file's field, or a machine figure (flag / datasheet / default) times a stated
// efficiency factor ("rates: nominal (no calibration)"). The factors are in one table here.
// Must not: measure, or plan placements.
#pragma once
#include <string>
#include <vector>

#include "plan/calibration.h"
#include "plan/machine.h"

namespace k3::plan {

// Efficiency factors applied to nominal figures when no calibration gives the rate.
struct Efficiency {
  double value;
  const char* why;
};
// GPU decode GEMV (trunk and MXFP4 experts): fraction of nominal HBM bandwidth.
extern const Efficiency kEffGpuGemv;
// GPU batched-decode compute (rows x weights once rows dominate): fraction of nominal dense BF16.
extern const Efficiency kEffGpuDecodeFlops;
// GPU prefill (effective, attention included): fraction of nominal dense BF16.
extern const Efficiency kEffGpuGemm;
// CPU memory-bound GEMV (experts, bf16 trunk) and streaming reads: fraction of nominal DRAM bandwidth.
extern const Efficiency kEffCpuMem;
extern const Efficiency kEffPcie, kEffDisk, kEffNvlink, kEffNet;
// Per-core caps of the CPU rates (the rates are min(bandwidth x eff, cores x per-core rate)).
extern const Efficiency kCpuCoreExpertBps, kCpuCoreBf16Bps, kCpuCoreExpertFlops, kCpuCoreBf16Flops,
    kCpuCoreExpertF32Bps;
extern const Efficiency kCpuCoreExpertFlopsAmx, kCpuCoreBf16FlopsAmx;  // the amx level's GEMMs

// Latencies (seconds), with the flags that set them.
struct Latencies {
  Sourced<double> sync;        // per MoE layer and micro-batch: GPU -> CPU experts -> GPU handoff
  // Per decoder layer and decode step on a GPU: the work besides the weight reads (norms, residual
  // mixes, router, state preparation, attention, launch gaps). A calibration's gpu.layer_s replaces
  // the default unless --layer-us is given.
  Sourced<double> gpu_layer;
  Sourced<double> coll_intra;  // one collective within a node (NVLink)
  Sourced<double> coll_inter;  // one collective across nodes
};
Latencies default_latencies();

struct Rates {
  std::string mode;                // "nominal (no calibration)" | "calibration FILE (...)"
  std::vector<std::string> notes;  // flags a calibration overrode, parts taken nominally
  // GPU, per GPU.
  Sourced<double> gpu_trunk_Bps, gpu_expert_Bps, gpu_decode_flops, gpu_gemm_flops, gpu_expert_gemm_flops;
  Sourced<double> pcie_Bps, nvlink_Bps, net_Bps;
  // CPU, per node.
  Sourced<double> cpu_expert_Bps, cpu_expert_flops, cpu_bf16_Bps, cpu_bf16_flops, cpu_mem_Bps;
  // The CPU expert GEMV in fp32 activations: the hybrid placement's CPU experts (unless --cpu-experts-q8).
  Sourced<double> cpu_expert_f32_Bps;
  // The GEMM rates of prefill chunks: the same as above except on AMX cores (Machine::cpu_amx), whose
  // tiles serve the prefill GEMMs only (a decode step's rows run as GEMVs, each sequence's alone).
  Sourced<double> cpu_expert_prefill_flops, cpu_bf16_prefill_flops;
  Sourced<double> disk_Bps;
  Latencies lat;
};

// Rates for `m`: from `cal` where it has the part (its GPU must be the planned GPU kind: k3::Error
// otherwise), else nominal x efficiency. `cal` may be null.
Rates derive_rates(const Machine& m, const Calibration* cal, const Latencies& lat);

}  // namespace k3::plan
