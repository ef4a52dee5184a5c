// The planner's cost model (see planner.h and docs/hybrid.md, which states the same formulas).
// Must not: do I/O, or hide a term: every second of a prediction is one of the DecodeTerms /
// PrefillTerms fields the report prints.
#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "plan/units.h"
#include "runtime/memory.h"

namespace k3::plan {

namespace {

constexpr double kGpuReserve = double(512 << 20);  // CUDA context + cuBLAS: gpu_fit_line's margin
constexpr int64_t kDecodeRows = 256;               // GpuOptions::tokens_per_call (the GPU step's rows)
constexpr int64_t kMaxChunk = 4096;                // longest prefill chunk planned
constexpr int64_t kStreamGroup = 64;               // experts per streamed group (two staged at a time)
constexpr int64_t kHostRows = 512;                 // the CPU's --ubatch default

std::string gb(double b) { return human_dec_bytes(b); }
std::string rate(double b) { return human_rate(b); }
std::string fl(double f) { return human_flops(f); }
std::string sec(double t) { return human_seconds(t); }
std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", v);
  return b;
}
// "name = formula = numbers = value"
std::string line(const std::string& name, const std::string& formula, const std::string& numbers, double s) {
  return name + " = " + formula + (numbers.empty() ? "" : " = " + numbers) + " = " + sec(s);
}

// Sizes with the FP8 trunk applied.
struct Eff {
  double trunk, shared, lm_head, embed;
};
Eff effective(const ModelSizes& s, bool fp8, bool on_gpu) {
  if (!fp8) return {s.trunk_bytes, s.shared_bytes, s.lm_head_bytes, s.embed_bytes};
  const Fp8Trunk f = fp8_trunk(s, on_gpu);
  return {f.trunk_bytes, f.shared_bytes, f.lm_head_bytes, s.embed_bytes};
}

// What one evaluation needs beside the inputs.
struct Layout {
  std::string kind;
  int tp = 1, ep = 1, dp = 1, world = 0;
  double hit = 0;    // fraction of routed-expert reads served on GPUs
  double f_ram = 1;  // of the routed-expert bytes not on GPUs: the fraction in host RAM (rest: disk)
  Eff eff{};
};

struct Env {
  const ModelConfig& cfg;
  const ModelSizes& s;
  const Machine& m;
  const Rates& r;
  const PlanRequest& q;
};

// The hybrid placement's CPU expert GEMV rate: fp32 activations unless --cpu-experts-q8 (GpuOptions).
double hybrid_cpu_expert_Bps(const Env& e) {
  return e.q.cpu_experts_q8 ? e.r.cpu_expert_Bps.value : e.r.cpu_expert_f32_Bps.value;
}

double intra_rate(const Env& e) { return e.r.nvlink_Bps.value > 0 ? e.r.nvlink_Bps.value : e.r.pcie_Bps.value; }

// Ring all-reduce of `bytes` over `ranks` GPUs (hierarchical when they span nodes: intra-node
// reduce-scatter + all-gather on NVLink, the 1/gpn share across nodes on the network).
double allreduce_s(const Env& e, double bytes, int ranks) {
  if (ranks <= 1) return 0;
  const int gpn = e.m.gpus_per_node;
  if (ranks <= gpn) return e.r.lat.coll_intra.value + 2.0 * (ranks - 1) / ranks * bytes / intra_rate(e);
  const int nodes = ranks / gpn;
  return e.r.lat.coll_inter.value + 2.0 * (gpn - 1) / gpn * bytes / intra_rate(e) +
         2.0 * (nodes - 1) / nodes * (bytes / gpn) / e.r.net_Bps.value;
}

// All-to-all where every rank sends `bytes` spread evenly over the `ranks` ranks (its own share stays).
double alltoall_s(const Env& e, double bytes, int ranks) {
  if (ranks <= 1) return 0;
  const int gpn = e.m.gpus_per_node, local = std::min(ranks, gpn);
  const double intra = bytes * double(local - 1) / ranks / intra_rate(e);
  const double inter = bytes * double(ranks - local) / ranks / e.r.net_Bps.value;
  return (ranks > gpn ? e.r.lat.coll_inter.value : e.r.lat.coll_intra.value) + std::max(intra, inter);
}

// EP group geometry for the hybrid CPU share: how many EP groups one node's GPUs form and how many
// nodes one EP group spans.
double groups_per_node(const Env& e, int ep) { return std::max(1.0, double(e.m.gpus_per_node) / ep); }
double nodes_per_group(const Env& e, int ep) { return std::max(1.0, double(ep) / std::max(1, e.m.gpus_per_node)); }

DecodeTerms decode_gpu(const Env& e, const Layout& L, int64_t B) {
  const ModelSizes& s = e.s;
  const Rates& r = e.r;
  DecodeTerms d;
  d.batch = B;
  const double Bdp = std::ceil(double(B) / L.dp);  // sequences of one TP group
  const double Bep = double(B) * L.ep / L.world;   // tokens routed inside one EP group
  const double nm = double(s.moe_layers);
  // Trunk: bytes once per step, or rows x weights once rows dominate.
  const double t_bytes = (L.eff.trunk + L.eff.lm_head) / L.tp, t_params = (s.trunk_params + s.lm_head_params) / L.tp;
  d.gpu_trunk = std::max(t_bytes / r.gpu_trunk_Bps.value, 2.0 * t_params * Bdp / r.gpu_decode_flops.value);
  d.gpu_shared = d.gpu_trunk * (L.eff.shared * nm / L.tp) / t_bytes;
  d.gpu_state =
      Bdp * (2.0 * s.kda_state_bytes / L.tp + double(e.q.ctx) * s.mla_bytes_per_token) / r.gpu_trunk_Bps.value;
  // Routed experts: distinct per layer in the EP group; the busiest GPU's share of them.
  d.distinct = expected_distinct_experts(s.experts, s.top_k, Bep);
  d.max_shard = L.ep > 1 ? expected_max_shard_load(s.experts, L.ep, d.distinct) : d.distinct;
  const double rows = d.distinct > 0 ? Bep * double(s.top_k) / d.distinct : 0;  // tokens per selected expert
  const double per_expert =
      std::max(s.expert_bytes / r.gpu_expert_Bps.value, 2.0 * rows * s.expert_params / r.gpu_decode_flops.value);
  d.gpu_experts = nm * L.hit * d.max_shard * per_expert;
  // Collectives: 2 all-reduces of [tokens, hidden] bf16 per layer (TP), dispatch + combine of
  // top_k latents per token per MoE layer (EP).
  d.comm = 2.0 * double(s.layers) * allreduce_s(e, Bdp * double(s.hidden) * 2.0, L.tp) +
           2.0 * nm * alltoall_s(e, Bep / L.ep * double(s.top_k) * double(s.latent) * 2.0, L.ep);
  d.gpu_layers = double(s.layers) * r.lat.gpu_layer.value;
  d.gpu_total = d.gpu_trunk + d.gpu_state + d.gpu_experts + d.comm + d.gpu_layers;
  // The CPU's share (hybrid): misses of the node's EP groups, from RAM or disk.
  if (L.hit < 1) {
    const double share = groups_per_node(e, L.ep) / nodes_per_group(e, L.ep);
    const double miss_bytes = nm * (1 - L.hit) * d.distinct * share * s.expert_bytes;
    const double pairs = Bep * double(s.top_k) * (1 - L.hit) * share;  // token-expert products per layer
    d.cpu_experts = std::max(miss_bytes / hybrid_cpu_expert_Bps(e),
                             2.0 * pairs * s.expert_params * nm / r.cpu_expert_flops.value);
    d.disk = miss_bytes * (1 - L.f_ram) / r.disk_Bps.value;
    d.pcie = nm * Bdp * (2.0 * double(s.latent) * 4.0 + double(s.top_k) * 8.0) / r.pcie_Bps.value;
    d.sync = nm * r.lat.sync.value;
  }
  d.cpu_total = d.cpu_experts + d.disk;
  auto& A = d.arithmetic;
  A.push_back(line("GPU trunk", "max((trunk + lm_head)/TP / trunk GEMV rate, 2 x params/TP x seqs / decode FLOP rate)",
                   "max(" + gb(t_bytes) + " / " + rate(r.gpu_trunk_Bps.value) + ", 2 x " + num(t_params) + " x " +
                       num(Bdp) + " / " + fl(r.gpu_decode_flops.value) + ")",
                   d.gpu_trunk));
  A.push_back(line("  of which shared experts", "GPU trunk x shared bytes / trunk bytes",
                   sec(d.gpu_trunk) + " x " + gb(L.eff.shared * nm / L.tp) + " / " + gb(t_bytes), d.gpu_shared));
  A.push_back(line("GPU state", "seqs x (2 x KDA state/TP + ctx x MLA bytes/token) / trunk GEMV rate",
                   num(Bdp) + " x (2 x " + gb(s.kda_state_bytes / L.tp) + " + " + std::to_string(e.q.ctx) + " x " +
                       gb(s.mla_bytes_per_token) + ") / " + rate(r.gpu_trunk_Bps.value),
                   d.gpu_state));
  A.push_back("distinct experts per MoE layer = E x (1 - (1 - k/E)^tokens) = " + std::to_string(s.experts) +
              " x (1 - (1 - " + std::to_string(s.top_k) + "/" + std::to_string(s.experts) + ")^" + num(Bep) +
              ") = " + num(d.distinct) +
              (L.ep > 1 ? "; busiest of " + std::to_string(L.ep) + " EP shards: " + num(d.max_shard) : ""));
  A.push_back(line("GPU experts",
                   "MoE layers x hit x experts on the busiest GPU x max(expert bytes / expert rate, "
                   "2 x rows x params / decode FLOP rate)",
                   num(nm) + " x " + num(L.hit) + " x " + num(d.max_shard) + " x max(" + gb(s.expert_bytes) + " / " +
                       rate(r.gpu_expert_Bps.value) + ", 2 x " + num(rows) + " x " + num(s.expert_params) + " / " +
                       fl(r.gpu_decode_flops.value) + ")",
                   d.gpu_experts));
  if (L.world > 1)
    A.push_back(line("collectives",
                     "2 x layers x all-reduce(seqs x hidden x 2 B, TP) + 2 x MoE layers x "
                     "all-to-all(tokens/EP x k x latent x 2 B, EP)",
                     "2 x " + std::to_string(s.layers) + " x " +
                         sec(allreduce_s(e, Bdp * double(s.hidden) * 2.0, L.tp)) + " + 2 x " + num(nm) + " x " +
                         sec(alltoall_s(e, Bep / L.ep * double(s.top_k) * double(s.latent) * 2.0, L.ep)),
                     d.comm));
  A.push_back(line("GPU per-layer work", "layers x (norms, mixes, router, state, attention, launch gaps per layer)",
                   std::to_string(s.layers) + " x " + sec(r.lat.gpu_layer.value), d.gpu_layers));
  if (L.hit < 1) {
    const double share = groups_per_node(e, L.ep) / nodes_per_group(e, L.ep);
    A.push_back(line("CPU experts",
                     "max(miss bytes / CPU expert rate, 2 x token-expert pairs x params x MoE layers / "
                     "CPU expert FLOP rate), miss bytes = MoE layers x (1 - hit) x distinct x "
                     "expert bytes",
                     "max(" + gb(nm * (1 - L.hit) * d.distinct * share * s.expert_bytes) + " / " +
                         rate(hybrid_cpu_expert_Bps(e)) + ", 2 x " + num(Bep * double(s.top_k) * (1 - L.hit) * share) +
                         " x " + num(s.expert_params) + " x " + num(nm) + " / " + fl(r.cpu_expert_flops.value) + ")",
                     d.cpu_experts));
    A.push_back(line("disk", "miss bytes x (1 - in RAM) / disk rate",
                     gb(nm * (1 - L.hit) * d.distinct * share * s.expert_bytes) + " x " + num(1 - L.f_ram) + " / " +
                         rate(r.disk_Bps.value),
                     d.disk));
    A.push_back(line("PCIe", "MoE layers x seqs x (2 x latent x 4 B + k x 8 B) / PCIe rate",
                     num(nm) + " x " + num(Bdp) + " x " + gb(2.0 * double(s.latent) * 4.0 + double(s.top_k) * 8.0) +
                         " / " + rate(r.pcie_Bps.value),
                     d.pcie));
    A.push_back(line("sync", "MoE layers x handoff latency", num(nm) + " x " + sec(r.lat.sync.value), d.sync));
  }
  const double beside = d.gpu_shared + d.gpu_experts;  // GPU work that can run while the CPU works
  d.serial = d.cpu_total > 0 ? d.gpu_total - beside + std::max(beside, d.cpu_total) + d.pcie + d.sync : d.gpu_total;
  d.ideal = std::max(d.gpu_total, d.cpu_total) + d.pcie + d.sync;
  A.push_back(line("GPU total", "trunk + state + experts + collectives + per-layer work",
                   sec(d.gpu_trunk) + " + " + sec(d.gpu_state) + " + " + sec(d.gpu_experts) + " + " + sec(d.comm) +
                       " + " + sec(d.gpu_layers),
                   d.gpu_total));
  if (d.cpu_total > 0) {
    A.push_back(line("CPU total", "CPU experts + disk", sec(d.cpu_experts) + " + " + sec(d.disk), d.cpu_total));
    A.push_back(line("serial",
                     "GPU total - beside + max(beside, CPU total) + PCIe + sync, beside = shared + GPU experts",
                     sec(d.gpu_total) + " - " + sec(beside) + " + max(" + sec(beside) + ", " + sec(d.cpu_total) +
                         ") + " + sec(d.pcie) + " + " + sec(d.sync),
                     d.serial));
    A.push_back(line("ideal overlap (issue 20's bound)", "max(GPU total, CPU total) + PCIe + sync",
                     "max(" + sec(d.gpu_total) + ", " + sec(d.cpu_total) + ") + " + sec(d.pcie) + " + " + sec(d.sync),
                     d.ideal));
  }
  return d;
}

DecodeTerms decode_cpu(const Env& e, const Layout& L, int64_t B) {
  const ModelSizes& s = e.s;
  const Rates& r = e.r;
  DecodeTerms d;
  d.batch = B;
  const double nm = double(s.moe_layers), b = double(B);
  d.gpu_trunk = 0;
  // The CPU-only step: trunk, state, experts, one after another on the same cores.
  const double t_bytes = L.eff.trunk + L.eff.lm_head, t_params = s.trunk_params + s.lm_head_params;
  const double trunk = std::max(t_bytes / r.cpu_bf16_Bps.value, 2.0 * t_params * b / r.cpu_bf16_flops.value);
  const double state = b * (2.0 * s.kda_state_bytes + double(e.q.ctx) * s.mla_bytes_per_token) / r.cpu_mem_Bps.value;
  d.distinct = d.max_shard = expected_distinct_experts(s.experts, s.top_k, b);
  const double bytes = nm * d.distinct * s.expert_bytes;
  d.cpu_experts = std::max(bytes / r.cpu_expert_Bps.value,
                           2.0 * b * double(s.top_k) * s.expert_params * nm / r.cpu_expert_flops.value);
  d.disk = bytes * (1 - L.f_ram) / r.disk_Bps.value;
  d.gpu_state = state;  // reported in the state row (on the CPU here)
  d.cpu_total = trunk + state + d.cpu_experts + d.disk;
  d.gpu_total = 0;
  d.gpu_trunk = trunk;  // reported in the trunk row (on the CPU here)
  d.serial = d.ideal = d.cpu_total;
  auto& A = d.arithmetic;
  A.push_back(line("CPU trunk", "max((trunk + lm_head) / CPU BF16 GEMV rate, 2 x params x seqs / CPU BF16 FLOP rate)",
                   "max(" + gb(t_bytes) + " / " + rate(r.cpu_bf16_Bps.value) + ", 2 x " + num(t_params) + " x " +
                       num(b) + " / " + fl(r.cpu_bf16_flops.value) + ")",
                   trunk));
  A.push_back(line("CPU state", "seqs x (2 x KDA state + ctx x MLA bytes/token) / CPU read rate",
                   num(b) + " x (2 x " + gb(s.kda_state_bytes) + " + " + std::to_string(e.q.ctx) + " x " +
                       gb(s.mla_bytes_per_token) + ") / " + rate(r.cpu_mem_Bps.value),
                   state));
  A.push_back("distinct experts per MoE layer = E x (1 - (1 - k/E)^seqs) = " + num(d.distinct));
  A.push_back(line("CPU experts",
                   "max(MoE layers x distinct x expert bytes / CPU expert rate, 2 x seqs x k x params x "
                   "MoE layers / CPU expert FLOP rate)",
                   "max(" + gb(bytes) + " / " + rate(r.cpu_expert_Bps.value) + ", 2 x " + num(b) + " x " +
                       std::to_string(s.top_k) + " x " + num(s.expert_params) + " x " + num(nm) + " / " +
                       fl(r.cpu_expert_flops.value) + ")",
                   d.cpu_experts));
  A.push_back(line("disk", "expert bytes x (1 - in RAM) / disk rate",
                   gb(bytes) + " x " + num(1 - L.f_ram) + " / " + rate(r.disk_Bps.value), d.disk));
  A.push_back(line("step", "trunk + state + experts + disk",
                   sec(trunk) + " + " + sec(state) + " + " + sec(d.cpu_experts) + " + " + sec(d.disk), d.cpu_total));
  return d;
}

DecodeTerms decode(const Env& e, const Layout& L, int64_t B) {
  DecodeTerms d = L.kind == "cpu" ? decode_cpu(e, L, B) : decode_gpu(e, L, B);
  d.step = d.serial;
  if (L.kind == "cpu") {
    d.how = "CPU only: trunk + state + experts + disk, one after another";
  } else if (d.cpu_total <= 0) {
    d.how = "all on GPUs: trunk + state + experts + collectives";
  } else if (B < 2) {
    d.how =
        "one sequence: layer L+1 needs layer L's experts, so only the shared experts (and GPU-cached ones) "
        "run beside the CPU's: serial = GPU - beside + max(beside, CPU) + PCIe + sync";
  } else {
    // Two micro-batches in flight: the GPU runs one's layer while the CPU runs the other's experts;
    // each micro-batch reads the trunk once.
    const DecodeTerms a = decode_gpu(e, L, B / 2), b = decode_gpu(e, L, B - B / 2);
    d.overlapped = std::max(a.gpu_total + b.gpu_total, a.cpu_total + b.cpu_total) + a.pcie + b.pcie + a.sync + b.sync;
    if (d.overlapped < d.serial) {
      d.step = d.overlapped;
      d.how = "two micro-batches of " + std::to_string(B / 2) + " + " + std::to_string(B - B / 2) +
              " in flight: max(GPU_a + GPU_b, CPU_a + CPU_b) + PCIe + sync (beats one micro-batch)";
    } else {
      d.how = "one micro-batch (two in flight would read the trunk twice and be slower)";
    }
  }
  d.tokens_per_s = double(B) / d.step;
  return d;
}

// Longest prefill chunk (the prompt up to kMaxChunk tokens, else powers of two down to 64) whose GPU
// workspace beyond the decode workspace fits in `room` bytes; 0 if none.
int64_t fitting_chunk(const Env& e, double room) {
  const double base = gpu_workspace_bytes(e.cfg, kDecodeRows);
  for (int64_t u = std::min<int64_t>(e.q.prompt, kMaxChunk); u >= 1;) {
    if (gpu_workspace_bytes(e.cfg, u) - base <= room) return u;
    if (u <= 64) break;
    int64_t p = 1;
    while (p * 2 < u) p *= 2;
    u = std::max<int64_t>(64, p);
  }
  return 0;
}

PrefillTerms prefill(const Env& e, const Layout& L, const Plan& p) {
  const ModelSizes& s = e.s;
  const Rates& r = e.r;
  PrefillTerms f;
  f.prompt = e.q.prompt;
  const double nm = double(s.moe_layers);
  f.flops_experts = 2.0 * double(s.top_k) * s.expert_params * nm;
  const auto per_token_trunk = [&](int64_t u) { return 2.0 * s.trunk_params + 2.0 * s.lm_head_params / double(u); };
  const auto set_chunk = [&](int64_t u) {
    f.chunk = u;
    f.chunks = (f.prompt + u - 1) / u;
    f.flops_trunk = per_token_trunk(u);
  };
  if (L.kind == "cpu") {
    set_chunk(std::min<int64_t>(f.prompt, kMaxChunk));
    const double U = double(f.chunk);
    f.cpu = U * (f.flops_trunk / r.cpu_bf16_prefill_flops.value + f.flops_experts / r.cpu_expert_prefill_flops.value);
    f.disk = nm * expected_distinct_experts(s.experts, s.top_k, U) * s.expert_bytes * (1 - L.f_ram) / r.disk_Bps.value;
    f.seconds = double(f.chunks) * (f.cpu + f.disk);
    f.choice = "CPU only: chunks of " + std::to_string(f.chunk) + " tokens, compute + expert reads from disk";
  } else {
    // Chunk: as long as the spare GPU memory allows (the hot-expert cache yields to the workspace).
    const double room = p.gpu_cache;
    const int64_t u = fitting_chunk(e, room);
    if (u == 0) {
      f.seconds = INFINITY;
      f.choice = "no prefill chunk of >= 64 tokens fits in the GPU memory left";
      return f;
    }
    set_chunk(u);
    const double U = double(u), D = expected_distinct_experts(s.experts, s.top_k, U);
    const double comm = 2.0 * double(s.layers) * allreduce_s(e, U * double(s.hidden) * 2.0, L.tp) +
                        2.0 * nm * alltoall_s(e, U / L.tp * double(s.top_k) * double(s.latent) * 2.0, L.ep);
    f.comm = comm;
    const double trunk_gpu = U * f.flops_trunk / L.tp / r.gpu_gemm_flops.value;
    if (L.hit >= 1) {
      f.gpu = trunk_gpu + U * f.flops_experts / L.ep / r.gpu_expert_gemm_flops.value;
      f.seconds = double(f.chunks) * (f.gpu + comm);
      f.choice = "all on GPUs: chunks of " + std::to_string(u) + " tokens";
    } else {
      const double share = groups_per_node(e, L.ep) / nodes_per_group(e, L.ep);
      const double miss = 1 - L.hit;
      // A: CPU computes the misses; the GPU the trunk and its cached experts; chunks pipeline
      // (chunk i+1's GPU work beside chunk i's CPU work): n * max + min, + PCIe + sync per chunk.
      f.a_gpu = trunk_gpu + U * L.hit * f.flops_experts / L.ep / r.gpu_expert_gemm_flops.value + comm;
      const double miss_bytes = nm * D * miss * share * s.expert_bytes;
      f.a_cpu =
          std::max(U * miss * share * f.flops_experts / r.cpu_expert_prefill_flops.value,
                   miss_bytes / hybrid_cpu_expert_Bps(e)) +
          miss_bytes * (1 - L.f_ram) / r.disk_Bps.value;
      f.a_pcie =
          nm * U * (2.0 * double(s.latent) * 4.0 + double(s.top_k) * 8.0) / r.pcie_Bps.value + nm * r.lat.sync.value;
      const double n = double(f.chunks);
      f.a_total = n * std::max(f.a_gpu, f.a_cpu) + std::min(f.a_gpu, f.a_cpu) + n * f.a_pcie;
      // B: the missing experts of each layer streamed to the GPU in groups of 64, two staged at a
      // time, overlapped with the GPU's compute; misses on disk read at the disk rate meanwhile.
      const double staging = 2.0 * kStreamGroup * s.expert_bytes;
      f.b_possible = p.gpu_cache >= staging + (gpu_workspace_bytes(e.cfg, u) - gpu_workspace_bytes(e.cfg, kDecodeRows));
      f.b_compute = trunk_gpu + U * f.flops_experts / L.ep / r.gpu_expert_gemm_flops.value + comm;
      f.b_stream = nm * (D / L.ep) * miss * s.expert_bytes / r.pcie_Bps.value;
      f.b_disk = miss_bytes * (1 - L.f_ram) / r.disk_Bps.value;
      f.b_total = n * std::max({f.b_compute, f.b_stream, f.b_disk});
      char buf[200];
      if (f.b_possible && f.b_total < f.a_total) {
        f.seconds = f.b_total;
        std::snprintf(buf, sizeof buf, "stream experts to the GPU (%.3g s) beats CPU computes experts (%.3g s)",
                      f.b_total, f.a_total);
      } else {
        f.seconds = f.a_total;
        if (f.b_possible)
          std::snprintf(buf, sizeof buf, "CPU computes experts (%.3g s) beats stream experts to the GPU (%.3g s)",
                        f.a_total, f.b_total);
        else
          std::snprintf(buf, sizeof buf,
                        "CPU computes experts (streaming needs %s of GPU staging + workspace: "
                        "not free)",
                        gb(staging).c_str());
      }
      f.choice = buf;
      f.choice += "; chunks of " + std::to_string(u) + " tokens";
    }
  }
  auto& A = f.arithmetic;
  A.push_back("weight FLOPs per token: trunk 2 x " + num(s.trunk_params) + " + lm_head 2 x " + num(s.lm_head_params) +
              " / chunk = " + fl(f.flops_trunk).substr(0, fl(f.flops_trunk).size() - 2) + ", experts 2 x " +
              std::to_string(s.top_k) + " x " + num(s.expert_params) + " x " + num(nm) + " = " +
              fl(f.flops_experts).substr(0, fl(f.flops_experts).size() - 2));
  if (L.kind == "cpu") {
    A.push_back(line("chunk", "chunk x (trunk FLOPs / CPU BF16 FLOP rate + expert FLOPs / CPU expert FLOP rate)",
                     std::to_string(f.chunk) + " x (" + num(f.flops_trunk) + " / " + fl(r.cpu_bf16_prefill_flops.value) +
                         " + " + num(f.flops_experts) + " / " + fl(r.cpu_expert_prefill_flops.value) + ")",
                     f.cpu));
    A.push_back(line("disk per chunk", "MoE layers x distinct(chunk) x expert bytes x (1 - in RAM) / disk rate",
                     num(nm) + " x " + num(expected_distinct_experts(s.experts, s.top_k, double(f.chunk))) + " x " +
                         gb(s.expert_bytes) + " x " + num(1 - L.f_ram) + " / " + rate(r.disk_Bps.value),
                     f.disk));
    A.push_back(line("prompt", "chunks x (chunk + disk)",
                     std::to_string(f.chunks) + " x (" + sec(f.cpu) + " + " + sec(f.disk) + ")", f.seconds));
  } else if (L.hit >= 1) {
    A.push_back(line("chunk", "chunk x (trunk FLOPs/TP / GPU GEMM rate + expert FLOPs/EP / GPU expert GEMM rate)",
                     std::to_string(f.chunk) + " x (" + num(f.flops_trunk) + "/" + std::to_string(L.tp) + " / " +
                         fl(r.gpu_gemm_flops.value) + " + " + num(f.flops_experts) + "/" + std::to_string(L.ep) +
                         " / " + fl(r.gpu_expert_gemm_flops.value) + ")",
                     f.gpu));
    if (L.world > 1)
      A.push_back(line("collectives per chunk",
                       "2 x layers x all-reduce(chunk x hidden x 2 B, TP) + 2 x MoE layers x "
                       "all-to-all(chunk/TP x k x latent x 2 B, EP)",
                       "", f.comm));
    A.push_back(line("prompt", "chunks x (chunk + collectives)",
                     std::to_string(f.chunks) + " x (" + sec(f.gpu) + " + " + sec(f.comm) + ")", f.seconds));
  } else if (f.chunk > 0) {
    A.push_back(line("A: GPU per chunk",
                     "chunk x (trunk FLOPs/TP / GPU GEMM rate + hit x expert FLOPs/EP / GPU expert "
                     "GEMM rate) + collectives",
                     std::to_string(f.chunk) + " x (" + num(f.flops_trunk) + "/" + std::to_string(L.tp) + " / " +
                         fl(r.gpu_gemm_flops.value) + " + " + num(L.hit) + " x " + num(f.flops_experts) + "/" +
                         std::to_string(L.ep) + " / " + fl(r.gpu_expert_gemm_flops.value) + ") + " + sec(f.comm),
                     f.a_gpu));
    A.push_back(line("A: CPU per chunk",
                     "max(chunk x (1 - hit) x expert FLOPs / CPU expert FLOP rate, miss bytes / CPU "
                     "expert rate) + disk",
                     std::to_string(f.chunk) + " x " + num(1 - L.hit) + " x " + num(f.flops_experts) + " / " +
                         fl(r.cpu_expert_prefill_flops.value),
                     f.a_cpu));
    A.push_back(line("A: PCIe + sync per chunk",
                     "MoE layers x chunk x (2 x latent x 4 B + k x 8 B) / PCIe + MoE "
                     "layers x sync",
                     num(nm) + " x " + std::to_string(f.chunk) + " x " +
                         gb(2.0 * double(s.latent) * 4.0 + double(s.top_k) * 8.0) + " / " + rate(r.pcie_Bps.value) +
                         " + " + num(nm) + " x " + sec(r.lat.sync.value),
                     f.a_pcie));
    A.push_back(line("A: prompt", "chunks x max(GPU, CPU) + min(GPU, CPU) + chunks x (PCIe + sync)",
                     std::to_string(f.chunks) + " x max(" + sec(f.a_gpu) + ", " + sec(f.a_cpu) + ") + min + " +
                         std::to_string(f.chunks) + " x " + sec(f.a_pcie),
                     f.a_total));
    A.push_back(line("B: GPU compute per chunk",
                     "chunk x (trunk FLOPs/TP / GPU GEMM rate + expert FLOPs/EP / GPU "
                     "expert GEMM rate) + collectives",
                     std::to_string(f.chunk) + " x (" + num(f.flops_trunk) + "/" + std::to_string(L.tp) + " / " +
                         fl(r.gpu_gemm_flops.value) + " + " + num(f.flops_experts) + "/" + std::to_string(L.ep) +
                         " / " + fl(r.gpu_expert_gemm_flops.value) + ") + " + sec(f.comm),
                     f.b_compute));
    A.push_back("B: staging " + gb(2.0 * kStreamGroup * s.expert_bytes) + " (two groups of " +
                std::to_string(kStreamGroup) + " experts) + chunk workspace: " +
                (f.b_possible ? "fits in the GPU memory left" : "does not fit in the GPU memory left"));
    A.push_back(line("B: stream per chunk", "MoE layers x distinct(chunk)/EP x (1 - hit) x expert bytes / PCIe",
                     num(nm) + " x " + num(expected_distinct_experts(s.experts, s.top_k, double(f.chunk)) / L.ep) +
                         " x " + num(1 - L.hit) + " x " + gb(s.expert_bytes) + " / " + rate(r.pcie_Bps.value),
                     f.b_stream));
    A.push_back(line(
        "B: prompt", "chunks x max(compute, stream, disk)",
        std::to_string(f.chunks) + " x max(" + sec(f.b_compute) + ", " + sec(f.b_stream) + ", " + sec(f.b_disk) + ")",
        f.b_total));
  }
  f.tokens_per_s = double(f.prompt) / f.seconds;
  return f;
}

std::string over_by(double need, double have) { return gb(need) + " > " + gb(have) + ", over by " + gb(need - have); }

}  // namespace

double expected_distinct_experts(int64_t experts, int64_t top_k, double batch) {
  if (experts <= 0 || batch <= 0) return 0;
  const double E = double(experts), k = double(std::min(top_k, experts));
  return -E * std::expm1(batch * std::log1p(-k / E));  // E (1 - (1 - k/E)^B), accurate at B = 1
}

double expected_max_shard_load(int64_t experts, int64_t ranks, double picks) {
  if (ranks <= 1) return picks;
  const int64_t N = experts, K = experts / ranks;
  const auto e_max = [&](int64_t n) {
    if (n <= 0) return 0.0;
    n = std::min(n, N);
    // Hypergeometric pmf of one shard's count, via log-binomials.
    const auto lc = [](double a, double b) { return std::lgamma(a + 1) - std::lgamma(b + 1) - std::lgamma(a - b + 1); };
    std::vector<double> cdf;
    double acc = 0;
    for (int64_t x = 0; x <= std::min(n, K); ++x) {
      if (n - x > N - K) {
        cdf.push_back(acc);
        continue;
      }
      acc += std::exp(lc(double(K), double(x)) + lc(double(N - K), double(n - x)) - lc(double(N), double(n)));
      cdf.push_back(std::min(acc, 1.0));
    }
    // E[max] = sum_{m >= 1} P(max >= m) = sum (1 - F(m-1)^ranks).
    double e = 0;
    for (size_t m = 1; m < cdf.size() + 1; ++m)
      e += 1.0 - std::pow(m - 1 < cdf.size() ? cdf[m - 1] : 1.0, double(ranks));
    return e;
  };
  const int64_t lo = int64_t(std::floor(picks));
  const double t = picks - double(lo);
  return (1 - t) * e_max(lo) + t * e_max(lo + 1);
}

double host_weight_budget(const Machine& m) {
  if (m.ram_budget) return double(*m.ram_budget);
  const double ram = double(m.ram.value);
  return ram - std::clamp(0.05 * ram, double(uint64_t(4) << 30), double(uint64_t(32) << 30));
}

Plan evaluate(const ModelConfig& cfg, const ModelSizes& s, const Machine& m, const Rates& r, const PlanRequest& q,
              const std::string& kind, int tp, int ep) {
  const Env e{cfg, s, m, r, q};
  Plan p;
  p.kind = kind;
  Layout L;
  L.kind = kind;
  L.eff = effective(s, q.trunk_fp8, kind != "cpu");
  const double experts_total = s.experts_total_bytes(), eb = s.expert_bytes;
  const double B = double(std::max<int64_t>(q.batch, 1));
  const std::string trunk_fmt = q.trunk_fp8 ? "FP8" : "bf16";
  if (kind == "cpu") {
    p.world = 0;
    p.tp = p.ep = p.dp = 1;
    // Host: everything but the routed experts must fit; experts fill the rest, then disk.
    const double state = B * (s.kda_state_bytes + double(q.ctx) * s.mla_bytes_per_token);
    const double scratch = host_scratch_bytes(cfg, q.ctx, kHostRows);
    const double fixed = L.eff.trunk + L.eff.lm_head + L.eff.embed + state + scratch;
    p.host_budget = host_weight_budget(m);
    p.fits = fixed <= p.host_budget;
    if (!p.fits)
      p.why_not = "CPU only: trunk + embedding + lm_head " + gb(L.eff.trunk + L.eff.lm_head + L.eff.embed) +
                  " + state " + gb(state) + " + buffers " + gb(scratch) + " = " + over_by(fixed, p.host_budget) +
                  " of host budget";
    const double ram_experts = std::clamp(p.host_budget - fixed, 0.0, experts_total);
    L.f_ram = experts_total > 0 ? ram_experts / experts_total : 1;
    p.host_used = fixed + ram_experts;
    p.frac_ram = L.f_ram;
    p.frac_disk = 1 - L.f_ram;
    p.items = {{"trunk: attention, shared experts, router, latent proj.", "host RAM", L.eff.trunk, trunk_fmt},
               {"embedding + lm_head", "host RAM", L.eff.embed + L.eff.lm_head, ""},
               {"KDA state + MLA cache (" + std::to_string(q.batch) + " x " + std::to_string(q.ctx) + " tokens, fp32)",
                "host RAM", state, ""},
               {"buffers (ubatch 512)", "host RAM", scratch, "plan_memory"},
               {"routed experts in RAM", "host RAM", ram_experts, ""},
               {"routed experts on disk", "disk", experts_total - ram_experts, "read on use"}};
  } else {
    if (m.world() == 0) {
      p.why_not = "placement " + kind + " needs a GPU (the machine has none)";
      return p;
    }
    p.world = m.world();
    p.tp = tp;
    p.ep = ep;
    p.dp = p.world / tp;
    L.tp = tp;
    L.ep = ep;
    L.dp = p.dp;
    L.world = p.world;
    const double Bdp = std::ceil(B / p.dp);
    p.gpu_budget = double(m.gpu_mem.value);
    p.gpu_reserve = kGpuReserve;
    p.gpu_workspace = gpu_workspace_bytes(cfg, kDecodeRows);
    p.gpu_state = Bdp * (s.kda_state_bytes / tp + double(q.ctx) * s.mla_bytes_per_token);
    const double trunk_rank = (L.eff.trunk + L.eff.lm_head + L.eff.embed) / tp;
    const double base = trunk_rank + p.gpu_state + p.gpu_workspace + p.gpu_reserve;
    const std::string per = p.world > 1 ? " per GPU (TP" + std::to_string(tp) + ")" : "";
    if (kind == "gpu") {
      const double experts_rank = experts_total / ep;
      p.gpu_weights = trunk_rank + experts_rank;
      const double need = base + experts_rank;
      p.fits = need <= p.gpu_budget;
      if (!p.fits)
        p.why_not = "all on GPUs: per GPU trunk " + gb(trunk_rank) + " + routed experts " + gb(experts_rank) + " (1/" +
                    std::to_string(ep) + ") + state " + gb(p.gpu_state) + " + workspace " + gb(p.gpu_workspace) +
                    " + reserve " + gb(p.gpu_reserve) + " = " + over_by(need, p.gpu_budget) + " (" + m.gpu_mem.source +
                    ")";
      p.gpu_cache = std::max(0.0, p.gpu_budget - need);
      L.hit = 1;
      p.hit = 1;
      p.frac_gpu = 1;
      p.hit_source = "every routed expert resident on a GPU";
    } else {  // hybrid
      p.gpu_weights = trunk_rank;
      p.fits = base <= p.gpu_budget;
      if (!p.fits)
        p.why_not = "GPU trunk" + per + ": trunk + embedding + lm_head " + gb(trunk_rank) + " (" + trunk_fmt +
                    ") + state " + gb(p.gpu_state) + " + workspace " + gb(p.gpu_workspace) + " + reserve " +
                    gb(p.gpu_reserve) + " = " + over_by(base, p.gpu_budget) + " (" + m.gpu_mem.source + ")";
      p.gpu_cache = std::max(0.0, p.gpu_budget - base);
      const double cached_rank = std::floor(p.gpu_cache / eb) * eb;
      double cached = std::min(experts_total, cached_rank * ep);
      if (q.hot_experts) {  // the run's --hot-experts F: that share, if the spare memory holds it
        const double want = std::floor(*q.hot_experts * experts_total / eb) * eb;
        if (want > cached)
          p.notes.push_back("--hot-experts " + num(*q.hot_experts) + ": the spare GPU memory holds " +
                            gb(cached) + " of the " + gb(want) + " asked for");
        cached = std::min(cached, want);  // (the rest of the spare memory stays free: prefill chunks use it)
      }
      p.frac_gpu = experts_total > 0 ? cached / experts_total : 1;
      if (q.expert_hit) {
        p.hit = *q.expert_hit;
        char buf[160];
        std::snprintf(buf, sizeof buf, "--expert-hit %.3g (uniform routing over the cached %.3g%% would give %.3g)",
                      *q.expert_hit, 100 * p.frac_gpu, p.frac_gpu);
        p.hit_source = buf;
      } else {
        p.hit = p.frac_gpu;
        char buf[160];
        std::snprintf(buf, sizeof buf, "the GPU cache holds %.3g%% of the experts; uniform routing: hit = %.3g",
                      100 * p.frac_gpu, p.frac_gpu);
        p.hit_source = buf;
      }
      L.hit = p.hit;
      // Host: the routed experts not cached on GPUs (a node holds its EP groups' share), then disk.
      const double need_node = experts_total * (1 - p.frac_gpu) / nodes_per_group(e, ep);
      p.host_budget = host_weight_budget(m);
      const double ram = std::clamp(p.host_budget, 0.0, need_node);
      L.f_ram = need_node > 0 ? ram / need_node : 1;
      p.host_used = ram;
      p.frac_ram = (1 - p.frac_gpu) * L.f_ram;
      p.frac_disk = (1 - p.frac_gpu) * (1 - L.f_ram);
    }
    const std::string on_gpu = p.world > 1 ? std::to_string(p.world) + " GPUs" : "GPU";
    p.items = {{"trunk: attention, shared experts, router, latent proj.", on_gpu, L.eff.trunk * (p.dp),
                trunk_fmt + (tp > 1 ? ", split " + std::to_string(tp) + " ways (TP)" : "") +
                    (p.dp > 1 ? ", " + std::to_string(p.dp) + " replicas" : "")},
               {"embedding + lm_head", on_gpu, (L.eff.embed + L.eff.lm_head) * p.dp,
                tp > 1 ? "vocab split " + std::to_string(tp) + " ways" : ""},
               {"KDA state (" + std::to_string(q.batch) + " seq, fp32)", on_gpu, B * s.kda_state_bytes,
                tp > 1 ? "heads split (TP)" : ""},
               {"MLA cache (" + std::to_string(q.batch) + " x " + std::to_string(q.ctx) + " tokens, fp32)", on_gpu,
                B * double(q.ctx) * s.mla_bytes_per_token * (tp > 1 ? tp : 1),
                tp > 1 ? "latent replicated in each TP group rank" : ""},
               {"workspace (" + std::to_string(kDecodeRows) + " rows) + reserve", on_gpu,
                (p.gpu_workspace + p.gpu_reserve) * p.world, "gpu_memory_plan + CUDA context"}};
    if (kind == "gpu") {
      p.items.push_back({"routed experts", on_gpu, experts_total * (p.world / ep),
                         ep > 1 ? "sharded " + std::to_string(ep) + " ways (EP)" : "resident"});
    } else {
      p.items.push_back({"routed experts, hot cache", on_gpu, experts_total * p.frac_gpu, "spare GPU memory"});
      p.items.push_back(
          {"routed experts in host RAM", "host RAM", experts_total * p.frac_ram, "CPU computes them (AVX-512)"});
      p.items.push_back({"routed experts on disk", "disk", experts_total * p.frac_disk, "read on use"});
    }
  }
  p.decode1 = decode(e, L, 1);
  p.decodeB = decode(e, L, std::max<int64_t>(q.batch, 1));
  p.prefill = prefill(e, L, p);
  if (kind == "hybrid" && p.frac_gpu >= 1) p.notes.push_back("every routed expert fits on the GPUs: same as 'gpu'");
  // What k3 itself runs of this placement today (the planner plans ahead of the engine).
  if (kind == "hybrid" && p.frac_gpu < 1)
    p.notes.push_back(
        "hybrid runs as: k3 run --device cuda --cpu-experts" +
        (q.hot_experts ? " --hot-experts " + num(*q.hot_experts) : std::string(" --hot-experts auto")));
  if (p.world > 1)
    p.notes.push_back(
        "several GPUs: k3 splits TP/EP on the CPU backend only so far (docs/multi-gpu.md); the NCCL "
        "communicator and multi-node start-up are not built");
  if (p.world > 1 && tp != ep)
    p.notes.push_back("TP" + std::to_string(tp) + " != EP" + std::to_string(ep) +
                      ": k3's split (src/model/parallel.h) needs --tp == --ep today");
  if (q.trunk_fp8)
    p.notes.push_back(
        "FP8 trunk (--trunk-fp8, docs/fp8-trunk.md): on the GPU with an fp32 scale per row and 128 columns and "
        "the MLA kv_b_proj in fp32; its rates are the bf16 trunk's byte rates (no FP8 calibration yet)");
  return p;
}

PlanResult make_plan(const ModelConfig& cfg, const ModelSizes& s, const Machine& m, const Rates& r,
                     const PlanRequest& q) {
  if (q.ctx < 1 || q.batch < 1 || q.prompt < 1) fail("--ctx, --batch and --prompt must be >= 1");
  if (q.ctx > s.max_positions)
    fail("--ctx " + std::to_string(q.ctx) + " exceeds the model's max_position_embeddings (" +
         std::to_string(s.max_positions) + ")");
  if (q.hot_experts && !(*q.hot_experts >= 0 && *q.hot_experts <= 1))
    fail("--hot-experts must be a fraction 0..1, got " + std::to_string(*q.hot_experts));
  if (q.hot_experts && q.placement != "hybrid")
    fail("--hot-experts plans the hybrid placement's GPU cache: use it with --placement hybrid");
  if (q.expert_hit && !(*q.expert_hit >= 0 && *q.expert_hit <= 1))
    fail("--expert-hit must be a fraction 0..1, got " + std::to_string(*q.expert_hit));
  const std::string& pl = q.placement;
  if (pl != "auto" && pl != "gpu" && pl != "hybrid" && pl != "cpu")
    fail("--placement must be auto, gpu, hybrid or cpu, got '" + pl + "'");
  const int W = m.world();
  if (W == 0 && (q.tp > 1 || q.ep > 1)) fail("--tp/--ep need GPUs (the machine has none: pass --gpus)");
  if (W == 0 && (pl == "gpu" || pl == "hybrid"))
    fail("--placement " + pl + " needs a GPU (the machine has none: pass --gpus, e.g. --gpus 1xH200)");
  if (q.tp > 0) {
    if (W % q.tp) fail("--tp " + std::to_string(q.tp) + " does not divide the " + std::to_string(W) + " GPUs");
    if (s.mla_heads % q.tp || s.kda_heads % q.tp)
      fail("--tp " + std::to_string(q.tp) + ": the " + std::to_string(s.mla_heads) + " MLA / " +
           std::to_string(s.kda_heads) + " KDA heads do not split " + std::to_string(q.tp) + " ways");
  }
  if (q.ep > 0) {
    if (W % q.ep) fail("--ep " + std::to_string(q.ep) + " does not divide the " + std::to_string(W) + " GPUs");
    if (s.experts % q.ep)
      fail("--ep " + std::to_string(q.ep) + ": the " + std::to_string(s.experts) + " experts do not split " +
           std::to_string(q.ep) + " ways");
  }
  std::vector<int> tps, eps;
  for (int d = 1; d <= W; ++d) {
    if (W % d) continue;
    if (s.mla_heads % d == 0 && s.kda_heads % d == 0) tps.push_back(d);
    if (s.experts % d == 0) eps.push_back(d);
  }
  if (q.tp > 0) tps = {q.tp};
  if (q.ep > 0) eps = {q.ep};
  std::vector<std::string> kinds;
  if (pl == "auto")
    kinds = W > 0 ? std::vector<std::string>{"gpu", "hybrid", "cpu"} : std::vector<std::string>{"cpu"};
  else
    kinds = {pl};
  PlanResult res;
  for (const std::string& k : kinds) {
    if (k == "cpu") {
      res.considered.push_back(evaluate(cfg, s, m, r, q, k, 1, 1));
      continue;
    }
    for (int tp : tps)
      for (int ep : eps) res.considered.push_back(evaluate(cfg, s, m, r, q, k, tp, ep));
  }
  const Plan* best = nullptr;
  for (const Plan& p : res.considered)
    if (p.fits && (!best || p.decodeB.tokens_per_s > best->decodeB.tokens_per_s)) best = &p;
  if (!best) {
    // What does not fit, for the most natural candidate of each kind (TP = EP = all GPUs).
    std::string why;
    for (const std::string& k : kinds) {
      const Plan* c = nullptr;
      for (const Plan& p : res.considered)
        if (p.kind == k && (!c || p.tp * p.ep > c->tp * c->ep)) c = &p;
      if (c) why += (why.empty() ? "" : "; ") + c->why_not;
    }
    fail("nothing fits: " + why);
  }
  res.best = *best;
  return res;
}

}  // namespace k3::plan
