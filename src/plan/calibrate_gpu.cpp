// The GPU part of `k3 plan --calibrate` (see calibrate.h): the engine's CUDA kernels at K3's shapes
// (BF16 GEMV and 16-row GEMV, the MXFP4 experts of a decode token, prefill products, copy bandwidth,
// pinned PCIe copies, the hybrid's per-MoE-layer handoff), timed with device events or the host
// clock; without K3_CUDA or a GPU it refuses in one line.
// Must not: run in the planner.
#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "plan/calibrate.h"
#include "plan/machine.h"
#include "plan/units.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/runtime.h"
#endif

namespace k3::plan {

std::string gpu_unavailable_reason() {
#ifdef K3_HAVE_CUDA
  if (cuda::device_count() == 0) return "no usable CUDA GPU here (" + cuda::unavailable_reason() + ")";
  return "";
#else
  return "this k3 was built without the CUDA backend (K3_CUDA=OFF)";
#endif
}

#ifndef K3_HAVE_CUDA
GpuCalibration measure_gpu(const CalibrateOptions&, std::map<std::string, std::string>&) {
  fail("GPU calibration: " + gpu_unavailable_reason());
}
#else

namespace {

constexpr int64_t kInter = 3072, kLatent = 3584, kTopK = 16;
constexpr int64_t kRows = 12288, kCols = 7168;

// Uploads `bytes` of random data (scales: 118..121, finite) to a new device buffer.
cuda::DevBuf random_device(size_t bytes, bool e8m0, std::mt19937_64& rng, const char* what) {
  cuda::DevBuf d(bytes, what);
  std::vector<uint8_t> h(std::min<size_t>(bytes, size_t(64) << 20));
  for (size_t i = 0; i < h.size(); ++i) h[i] = e8m0 ? uint8_t(118 + rng() % 4) : uint8_t(rng());
  if (!e8m0)  // BF16 weights read as bf16 need finite values: clear the top exponent bit of every odd byte
    for (size_t i = 1; i < h.size(); i += 2) h[i] = uint8_t((h[i] & 0x80) | (0x3c + (h[i] & 0x3)));
  for (size_t off = 0; off < bytes; off += h.size())
    cuda::h2d(d.as<uint8_t>() + off, h.data(), std::min(h.size(), bytes - off));
  cuda::sync();
  return d;
}

}  // namespace

GpuCalibration measure_gpu(const CalibrateOptions& o, std::map<std::string, std::string>& src) {
  if (const std::string why = gpu_unavailable_reason(); !why.empty()) fail("GPU calibration: " + why);
  const auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  const cuda::DeviceInfo info = cuda::device_info();
  GpuCalibration g;
  g.name = info.name;
  g.table_name = gpu_table_key(info.name);
  g.hbm_bytes = info.total_bytes;
  say("GPU: " + g.name + " (" + human_dec_bytes(double(g.hbm_bytes)) + ")");
  cuda::load_cublas();
  std::mt19937_64 rng(20261205);
  cuda::Stream s = cuda::stream_create();
  cuda::EventTimer timer;

  g.hbm_copy_Bps = cuda::measure_copy_gbs(size_t(1) << 30) * 1e9;
  src["gpu.hbm_copy_Bps"] = "measured: cuda::measure_copy_gbs (1 GiB device-to-device, read + written, best of 7)";
  say("  HBM copy " + human_rate(g.hbm_copy_Bps));

  // ---- BF16 decode GEMV and the 16-row batched GEMV, cycling distinct matrices (>> L2).
  {
    const size_t mat = size_t(kRows * kCols * 2);
    const int n = 8;
    std::vector<cuda::DevBuf> bufs;
    std::vector<WeightMat> W;
    for (int i = 0; i < n; ++i) {
      bufs.push_back(random_device(mat, false, rng, "calibration BF16 weights"));
      W.push_back(WeightMat{WFormat::BF16, kRows, kCols, bufs.back().get(), nullptr});
    }
    cuda::DevBuf x = random_device(size_t(16 * kCols * 4), true, rng, "calibration activations");
    cuda::DevBuf y(size_t(4096) * kRows * 4, "calibration outputs");
    const int reps = 64;
    for (int i = 0; i < 4; ++i)
      cuda::matmul(W[size_t(i % n)], x.as<float>(), 1, y.as<float>(), cuda::Precision::BF16, s);
    timer.start(s);
    for (int i = 0; i < reps; ++i)
      cuda::matmul(W[size_t(i % n)], x.as<float>(), 1, y.as<float>(), cuda::Precision::BF16, s);
    timer.stop(s);
    g.trunk_gemv_Bps = double(mat) * reps / (timer.ms() * 1e-3);
    src["gpu.trunk_gemv_Bps"] = "measured: cuda::matmul one row on [12288, 7168] BF16, 64 calls over 8 matrices";
    say("  BF16 GEMV " + human_rate(g.trunk_gemv_Bps));
    const WeightMat& W0 = W[0];
    if (!cuda::gemv_wide_ok(W0)) fail("GPU calibration: the 16-row GEMV does not take a [12288, 7168] BF16 matrix");
    timer.start(s);
    for (int i = 0; i < reps; ++i) cuda::gemv_rows(W[size_t(i % n)], x.as<float>(), cuda::kGemvWideT, y.as<float>(), s);
    timer.stop(s);
    g.decode_flops = 2.0 * double(kRows) * double(kCols) * double(cuda::kGemvWideT) * reps / (timer.ms() * 1e-3);
    src["gpu.decode_flops"] = "measured: cuda::gemv_rows of 16 rows on [12288, 7168] BF16 (the batched decode GEMV)";
    say("  16-row decode GEMV " + human_flops(g.decode_flops));
    // Prefill: 4096 rows through the same matrices (bf16 tensor cores).
    cuda::DevBuf xp = random_device(size_t(4096) * kCols * 4, true, rng, "calibration prefill rows");
    cuda::matmul(W0, xp.as<float>(), 4096, y.as<float>(), cuda::Precision::BF16, s);
    timer.start(s);
    for (int i = 0; i < 8; ++i)
      cuda::matmul(W[size_t(i % n)], xp.as<float>(), 4096, y.as<float>(), cuda::Precision::BF16, s);
    timer.stop(s);
    g.gemm_flops = 2.0 * double(kRows) * double(kCols) * 4096.0 * 8 / (timer.ms() * 1e-3);
    src["gpu.gemm_flops"] =
        "measured: cuda::matmul of 4096 rows on [12288, 7168] BF16 (weight products only: "
        "attention is not in this rate)";
    say("  BF16 prefill GEMM " + human_flops(g.gemm_flops));
  }

  // ---- MXFP4 experts of one decode token (stacked pool as the CUDA backend holds them).
  {
    const int64_t pool = 64;
    const size_t gate_b = size_t(pool * kInter * kLatent / 2), gate_s = size_t(pool * kInter * kLatent / 32);
    cuda::DevBuf gd = random_device(gate_b, false, rng, "calibration expert gate"),
                 gs = random_device(gate_s, true, rng, "calibration expert gate scales"),
                 ud = random_device(gate_b, false, rng, "calibration expert up"),
                 us = random_device(gate_s, true, rng, "calibration expert up scales"),
                 dd = random_device(gate_b, false, rng, "calibration expert down"),
                 ds = random_device(gate_s, true, rng, "calibration expert down scales");
    const WeightMat gate{WFormat::MXFP4, pool * kInter, kLatent, gd.get(), gs.as<uint8_t>()};
    const WeightMat up{WFormat::MXFP4, pool * kInter, kLatent, ud.get(), us.as<uint8_t>()};
    const WeightMat down{WFormat::MXFP4, pool * kLatent, kInter, dd.get(), ds.as<uint8_t>()};
    const int reps = 32;
    std::vector<int32_t> ids(size_t(reps * kTopK));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i % size_t(pool));
    cuda::DevBuf idd(ids.size() * 4, "calibration expert ids");
    cuda::h2d(idd.get(), ids.data(), ids.size() * 4);
    cuda::DevBuf z = random_device(size_t(kLatent * 4 * 64), true, rng, "calibration latent");
    cuda::DevBuf h(size_t(kTopK * kInter * 4 * 64), "calibration expert hidden"),
        yo(size_t(kTopK * kLatent * 4 * 64), "calibration expert out");
    const auto token = [&](int r) {
      const int32_t* id = idd.as<int32_t>() + r * kTopK;
      cuda::expert_glu(gate, up, kInter, id, kTopK, z.as<float>(), kTopK, 4.0f, 25.0f, h.as<float>(), s);
      cuda::expert_matmul(down, kLatent, id, kTopK, h.as<float>(), 1, yo.as<float>(), cuda::Precision::BF16, s);
    };
    token(0);
    timer.start(s);
    for (int r = 0; r < reps; ++r) token(r);
    timer.stop(s);
    const double per_expert = 3.0 * double(kInter * kLatent) * (0.5 + 1.0 / 32);
    g.expert_gemv_Bps = per_expert * kTopK * reps / (timer.ms() * 1e-3);
    src["gpu.expert_gemv_Bps"] =
        "measured: cuda::expert_glu + expert_matmul of 16 MXFP4 experts per token, 32 "
        "tokens over a stacked pool of 64";
    say("  MXFP4 expert GEMV " + human_rate(g.expert_gemv_Bps));
    // Prefill: 64 rows on one expert's gate/up/down (MXFP4 decoded in the kernel).
    const WeightMat g1{WFormat::MXFP4, kInter, kLatent, gd.get(), gs.as<uint8_t>()};
    const WeightMat d1{WFormat::MXFP4, kLatent, kInter, dd.get(), ds.as<uint8_t>()};
    const int ereps = 48;
    timer.start(s);
    for (int r = 0; r < ereps; ++r) {
      cuda::matmul(g1, z.as<float>(), 64, h.as<float>(), cuda::Precision::BF16, s);
      cuda::matmul(g1, z.as<float>(), 64, h.as<float>(), cuda::Precision::BF16, s);
      cuda::matmul(d1, h.as<float>(), 64, yo.as<float>(), cuda::Precision::BF16, s);
    }
    timer.stop(s);
    g.expert_gemm_flops = 2.0 * 3.0 * double(kInter * kLatent) * 64.0 * ereps / (timer.ms() * 1e-3);
    src["gpu.expert_gemm_flops"] = "measured: cuda::matmul of 64 rows on one MXFP4 expert (gate, up, down)";
    say("  MXFP4 expert GEMM (64 rows) " + human_flops(g.expert_gemm_flops));
  }

  // ---- PCIe: 1 GiB from pinned host memory and back.
  {
    const size_t n = size_t(1) << 30;
    void* host = cuda::host_alloc_pinned(n);
    cuda::DevBuf dev(n, "calibration PCIe buffer");
    cuda::h2d(dev.get(), host, n, s);
    cuda::sync(s);
    timer.start(s);
    for (int i = 0; i < 4; ++i) cuda::h2d(dev.get(), host, n, s);
    timer.stop(s);
    g.pcie_h2d_Bps = 4.0 * double(n) / (timer.ms() * 1e-3);
    timer.start(s);
    for (int i = 0; i < 4; ++i) cuda::d2h(host, dev.get(), n, s);
    timer.stop(s);
    g.pcie_d2h_Bps = 4.0 * double(n) / (timer.ms() * 1e-3);
    cuda::host_free_pinned(host);
    src["gpu.pcie_h2d_Bps"] = "measured: 4 x 1 GiB pinned host -> device copies";
    src["gpu.pcie_d2h_Bps"] = "measured: 4 x 1 GiB device -> pinned host copies";
    say("  PCIe h2d " + human_rate(g.pcie_h2d_Bps) + ", d2h " + human_rate(g.pcie_d2h_Bps));
  }

  // ---- The hybrid's handoff per MoE layer, as backend_cuda.cpp's routed_on_cpu does it for one
  // decode row of K3 (top-16, latent 3584): the routing (ids, weights) and the activations to pinned
  // host memory, each copy waited for; the CPU's thread pool started for two regions (the experts'
  // gate/up and down; no work in them here); the sum back and the stream waited for.
  {
    constexpr int64_t kK = 16, kLat = 3584;
    const size_t small = size_t(kK) * 4, row = size_t(kLat) * 4;
    auto* host = static_cast<char*>(cuda::host_alloc_pinned(2 * small + 2 * row));
    cuda::DevBuf dev(2 * small + 2 * row, "calibration handoff buffer");
    std::vector<double> times;
    for (int i = 0; i < 201; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      cuda::d2h(host, dev.get(), small, s);
      cuda::d2h(host + small, static_cast<char*>(dev.get()) + small, small, s);
      cuda::d2h(host + 2 * small, static_cast<char*>(dev.get()) + 2 * small, row, s);
      for (int r = 0; r < 2; ++r) par::parallel_for_each(par::max_threads(), [](int64_t) {});
      cuda::h2d(static_cast<char*>(dev.get()) + 2 * small + row, host + 2 * small + row, row, s);
      cuda::sync(s);
      if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    g.handoff_s = times[times.size() / 2];
    cuda::host_free_pinned(host);
    src["gpu.handoff_s"] = "measured: median of 200 handoffs of one decode row (3 copies to the host, each waited "
                           "for; 2 thread-pool regions of " +
                           std::to_string(par::max_threads()) + " threads; 1 copy back and a stream sync)";
    say("  GPU <-> CPU handoff per MoE layer " + std::to_string(g.handoff_s * 1e6).substr(0, 5) + " us");
  }
  cuda::stream_destroy(s);
  return g;
}
#endif

}  // namespace k3::plan
