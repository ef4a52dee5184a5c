// One true-width Kimi K3 decoder layer of each kind (KDA + LatentMoE, gated MLA + LatentMoE), with
// the real K3 config (tests/fixtures/k3-config-only), random weights in the shipped formats (BF16
// trunk, MXFP4 experts), timed for decode (1 token at a context depth) and prefill (a chunk of
// tokens), then extrapolated to the 93-layer model (69 KDA + 24 MLA layers + lm_head) and set
// beside kimi-k3-in-c's published s/token (performance-anchors.md §6.3).
// --device cuda: the same layers on the GPU (issue 19, goal 6): weights uploaded in their formats,
// decode steps of 1 and --batch sequences replayed from a CUDA graph, prefill of --prefill tokens,
// each timed with device events; roofline = the device copy bandwidth measured in the same run.
// Memory: the 896 routed experts of a layer are views onto a pool of --expert-pool distinct experts
// (default 64 = 1.1 GB, far beyond any cache) so one machine can hold the layer; a decode step
// touches top-16 of them exactly as with 896 distinct ones. Prints one JSON object.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "config/arch_stats.h"
#include "config/model_config.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/layer_runner.h"
#include "model/model.h"
#include "model/traffic.h"
#include "ops/cpu/isa.h"
#include "ops/cpu/roofline.h"
#include "ops/synthetic_weights.h"
#ifdef K3_HAVE_CUDA
#include "ops/cuda/runtime.h"
#endif

namespace {

using Json = nlohmann::ordered_json;

// Every weight buffer of the bench (ops/synthetic_weights.h).
struct Arena : k3::SyntheticWeights {
  Arena() : k3::SyntheticWeights(20261201) {}
};

void bind_moe(Arena& A, const k3::ModelDims& d, const k3::ModelConfig& c, const std::vector<k3::GluWeights>& pool,
              k3::MoeWeights& m) {
  const int64_t H = d.hidden;
  m.gate = A.bf16(d.moe.experts, H);
  m.bias = A.vec(d.moe.experts, 0.0f, 0.05f);
  m.down_lat = A.bf16(d.moe.latent, H);
  m.lat_norm = A.vec(d.moe.latent, 1.0f, 0.1f);
  m.up_lat = A.bf16(H, d.moe.latent);
  m.experts.resize(size_t(d.moe.experts));
  for (int64_t e = 0; e < d.moe.experts; ++e) m.experts[size_t(e)] = pool[size_t(e) % pool.size()];
  const int64_t si = c.shared_intermediate();
  if (si > 0) m.shared = {A.bf16(si, H), A.bf16(si, H), A.bf16(H, si)};
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_dir = "tests/fixtures/k3-config-only";
  int64_t pool_n = 64, depth = 4096, prefill = 64, reps = 5;
  std::string numerics = "fast", device = "cpu";
  std::vector<int64_t> batches{1};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "k3_layer_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config")
      config_dir = next();
    else if (a == "--expert-pool")
      pool_n = std::stoll(next());
    else if (a == "--depth")
      depth = std::stoll(next());
    else if (a == "--prefill")
      prefill = std::stoll(next());
    else if (a == "-r")
      reps = std::stoll(next());
    else if (a == "--numerics")
      numerics = next();
    else if (a == "--device")
      device = next();
    else if (a == "--batch") {
      batches.clear();
      const std::string v = next();
      for (size_t at = 0; at <= v.size();) {
        const size_t comma = std::min(v.find(',', at), v.size());
        batches.push_back(std::stoll(v.substr(at, comma - at)));
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: k3_layer_bench [--config DIR] [--expert-pool N] [--depth N] [--prefill N] [-r N] "
                   "[--numerics fast|exact|fp32] [--device cpu|cuda] [--batch 1,32]\n");
      return 2;
    }
  }
  if (device != "cpu" && device != "cuda") {
    std::fprintf(stderr, "k3_layer_bench: --device must be cpu or cuda, not '%s'\n", device.c_str());
    return 2;
  }
  for (const int64_t b : batches)
    if (b < 1 || b > 4096) {
      std::fprintf(stderr, "k3_layer_bench: --batch values must be in 1..4096\n");
      return 2;
    }
  const bool gpu = device == "cuda";
  try {
    const k3::ModelConfig cfg = k3::load_model_config(config_dir);
    const k3::ModelDims d = k3::ModelDims::from_config(cfg);
    const int64_t H = d.hidden;
    std::fprintf(stderr, "k3_layer_bench: %s: hidden %lld, %lld experts top-%lld, latent %lld; building weights...\n",
                 config_dir.c_str(), (long long)H, (long long)d.moe.experts, (long long)d.moe.top_k,
                 (long long)d.moe.latent);
    Arena A;
    std::vector<k3::GluWeights> pool;
    for (int64_t e = 0; e < pool_n; ++e)
      pool.push_back(
          {A.mxfp4(d.moe.inter, d.moe.latent), A.mxfp4(d.moe.inter, d.moe.latent), A.mxfp4(d.moe.latent, d.moe.inter)});

    auto norms = [&](k3::LayerWeights& w) {
      w.input_norm = A.vec(H, 1.0f, 0.1f);
      w.post_norm = A.vec(H, 1.0f, 0.1f);
      w.attn_res.fold = A.vec(H, 0.0f, 0.05f);
      w.mlp_res.fold = A.vec(H, 0.0f, 0.05f);
    };
    k3::LayerWeights kda;
    norms(kda);
    kda.is_kda = true;
    {
      const int64_t C = d.kda.dim(), Dh = d.kda.head_dim, K = d.kda.conv_k;
      k3::KdaWeights& k = kda.kda;
      k.q_proj = A.bf16(C, H);
      k.k_proj = A.bf16(C, H);
      k.v_proj = A.bf16(C, H);
      k.f_a_proj = A.bf16(Dh, H);
      k.f_b_proj = A.bf16(C, Dh);
      k.b_proj = A.bf16(d.kda.heads, H);
      k.g_proj = A.bf16(C, H);
      k.o_proj = A.bf16(H, C);
      k.q_conv = A.vec(C * K, 0.0f, 0.5f);
      k.k_conv = A.vec(C * K, 0.0f, 0.5f);
      k.v_conv = A.vec(C * K, 0.0f, 0.5f);
      k.A_log = A.vec(d.kda.heads, 0.0f, 1.0f);
      k.dt_bias = A.vec(C, 0.0f, 0.5f);
      k.o_norm = A.vec(Dh, 1.0f, 0.1f);
    }
    bind_moe(A, d, cfg, pool, kda.moe);
    k3::LayerWeights mla;
    norms(mla);
    mla.is_kda = false;
    {
      const k3::MlaDims& a = d.mla;
      k3::MlaWeights& m = mla.mla;
      m.q_a_proj = A.bf16(a.q_lora, H);
      m.q_a_norm = A.vec(a.q_lora, 1.0f, 0.1f);
      m.q_b_proj = A.bf16(a.heads * (a.nope + a.rope), a.q_lora);
      m.kv_a_proj = A.bf16(a.kv_lora + a.rope, H);
      m.kv_a_norm = A.vec(a.kv_lora, 1.0f, 0.1f);
      m.kv_b_proj = A.bf16(a.heads * (a.nope + a.v), a.kv_lora);
      if (a.output_gate) m.g_proj = A.bf16(a.heads * a.v, H);
      m.o_proj = A.bf16(H, a.heads * a.v);
    }
    bind_moe(A, d, cfg, pool, mla.moe);
    const k3::WeightMat lm_head = A.bf16(d.vocab, H);
    const int64_t blocks = (d.layers + d.block_size - 1) / d.block_size;  // late layers mix this many snapshots

    k3::ForwardOptions opt;
    opt.numerics = k3::ops::parse_numerics(numerics);
    const auto num = opt.numerics == k3::ops::Numerics::Exact ? k3::StepNumerics::Exact
                     : opt.numerics == k3::ops::Numerics::F32 ? k3::StepNumerics::F32
                                                              : k3::StepNumerics::Fast;
    const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
    const int64_t max_rows = std::max(prefill, max_batch);

    // GPU: one backend for every runner, the two layers and the lm_head uploaded once (the 896
    // experts of a layer stacked from the pool's views: every expert's bytes exist on the device).
    std::unique_ptr<k3::Backend> gpu_be;
    k3::ModelWeights placed;
    const k3::LayerWeights *kda_w = &kda, *mla_w = &mla;
    const k3::WeightMat* head_w = &lm_head;
    if (gpu) {
      k3::GpuOptions o;
      o.tokens_per_call = max_rows;
      o.initial_context = depth + prefill + 64;
      gpu_be = k3::make_cuda_backend_for_dims(d, o);
      placed.layers = {kda, mla};
      placed.lm_head = lm_head;
      std::fprintf(stderr, "k3_layer_bench: uploading the layers to the GPU...\n");
      gpu_be->place(placed);
      kda_w = &placed.layers[0];
      mla_w = &placed.layers[1];
      head_w = &placed.lm_head;
    }
    // Activation buffers where the backend reads them (host vectors on the CPU, device memory on the GPU).
    std::vector<void*> dev_bufs;
    std::deque<std::vector<float>> host_bufs;
    auto buffer = [&](std::vector<float> init) -> float* {
      if (!gpu) {
        host_bufs.push_back(std::move(init));
        return host_bufs.back().data();
      }
      void* p = gpu_be->alloc(init.size() * 4, "layer bench activations");
      gpu_be->upload(p, init.data(), init.size() * 4);
      dev_bufs.push_back(p);
      return static_cast<float*>(p);
    };
    const int64_t work_floats = std::max(k3::kda_work_floats(d.kda, max_rows), k3::mla_work_floats(d.mla, max_rows)) +
                                k3::moe_work_floats(d.moe, d.shared_inter, max_rows) +
                                k3::glu_work_floats(d.shared_inter, max_rows) + (int64_t(1) << 16);

    // The bandwidth roof: the CPU read probe before and after the timings (a shared machine's
    // bandwidth moves within seconds; the ratio divides by the larger), or the GPU's copy bandwidth.
    std::unique_ptr<k3::ops::ReadProbe> probe;
    k3::ops::Roofline roof;
    if (gpu) {
#ifdef K3_HAVE_CUDA
      roof.read_gbs = k3::cuda::measure_copy_gbs(size_t(1) << 31);
      roof.peak_gflops = 1e3 * k3::cuda::measure_bf16_gemm_tflops(8192);
      roof.peak_kind = "cuBLAS bf16 GEMM 8192^3";
#endif
    } else {
      probe = std::make_unique<k3::ops::ReadProbe>(k3::par::max_threads(), uint64_t(1) << 30);
      roof = k3::ops::measure_roofline(*probe, 5);
    }
    const double read_before = roof.read_gbs;

    // One step of B sequences x T tokens through layer L (decode: T = 1 at `depth` context, MLA
    // cache filled with random latents, KDA state random), median seconds of `reps` after a warm-up.
    // On the GPU the time is device time between events around the step; decode steps replay a
    // CUDA graph recorded in the warm-up.
    auto time_layer = [&](const k3::LayerWeights& w, int64_t L, int64_t T, int64_t B) {
      std::vector<bool> kinds(size_t(L + 1), true);
      kinds[size_t(L)] = w.is_kda;
      k3::LayerRunner run(d, kinds, work_floats, gpu_be.get());
      if (w.is_kda) {
        std::vector<float> S(size_t(d.kda.state_floats())), conv[3];
        for (auto& x : S) x = float(A.rng() % 2001) * 1e-4f - 0.1f;
        for (auto& c : conv) c.assign(size_t(d.kda.conv_floats()), 0.0f);
        run.pool.write_kda(run.slot, L, S, conv);
      } else {
        run.pool.set_position(run.slot, depth);
        run.pool.write_mla(run.slot, L, A.floats(depth * d.mla.kv_lora, 0.0f, 1.0f),
                           A.floats(depth * d.mla.rope, 0.0f, 1.0f));
      }
      const int64_t rows = B * T;
      // Depth state: `blocks` snapshots and the partial sum, plus a spare for a snapshot.
      std::vector<float*> spare;
      for (int64_t b = 0; b <= blocks + 1; ++b) spare.push_back(buffer(A.floats(rows * H, 0.0f, 1.0f)));
      float *a = buffer(std::vector<float>(size_t(rows * H))), *xn = buffer(std::vector<float>(size_t(rows * H))),
            *y = buffer(std::vector<float>(size_t(rows * H))), *y2 = buffer(std::vector<float>(size_t(rows * H)));
      std::vector<double> times;
      for (int64_t r = 0; r <= reps; ++r) {
        std::vector<int32_t> seqs;
        for (int64_t b = 0; b < B; ++b) seqs.push_back(run.pool.fork(run.slot));
        k3::DepthState ds;
        for (int64_t b = 0; b < blocks; ++b) ds.blocks.push_back(spare[size_t(b)]);
        ds.partial = spare[size_t(blocks)];
        ds.partial_empty = false;
        // As in the forward: the layer's first site adds the previous layer's FFN output (the MoE's
        // routed part and its shared experts), and the layer's MoE leaves its own two parts pending.
        ds.pending = y;
        ds.pending2 = y2;
        ds.ffn_extra = y2;
        const int64_t m0 = run.be->mark();
        const double t0 = now_s();
        run.step_many(
            seqs, T,
            [&](const k3::StepCtx& c) { k3::decoder_layer(c, d, L, w, run.pool, ds, spare.data(), a, xn, y, opt); },
            num, /*replayable=*/gpu);
        double dt = now_s() - t0;
        if (m0 >= 0) {
          dt = run.be->seconds_between(m0, run.be->mark());
          run.be->reset_marks();
        }
        if (r > 0) times.push_back(dt);  // the first run warms caches/pages up (and records the graph)
        for (const int32_t q : seqs) run.pool.free(q);
      }
      return median(times);
    };
    // lm_head over B rows (decode: the logits of every sequence).
    auto time_head = [&](int64_t B) {
      k3::LayerRunner run(d, {true}, work_floats, gpu_be.get());
      float *x = buffer(std::vector<float>(size_t(B * H), 0.01f)),
            *logits = buffer(std::vector<float>(size_t(B * d.vocab)));
      std::vector<double> lt;
      for (int64_t r = 0; r <= reps; ++r) {
        std::vector<int32_t> seqs;
        for (int64_t b = 0; b < B; ++b) seqs.push_back(run.pool.fork(run.slot));
        const int64_t m0 = run.be->mark();
        const double t0 = now_s();
        run.step_many(
            seqs, 1, [&](const k3::StepCtx& c) { c.be.matmul(*head_w, x, B, logits); }, num, /*replayable=*/gpu);
        double dt = now_s() - t0;
        if (m0 >= 0) {
          dt = run.be->seconds_between(m0, run.be->mark());
          run.be->reset_marks();
        }
        if (r > 0) lt.push_back(dt);
        for (const int32_t q : seqs) run.pool.free(q);
      }
      return median(lt);
    };
    std::fprintf(stderr, "k3_layer_bench: timing on %s (%s)...\n", device.c_str(),
                 gpu ? "CUDA graphs for decode"
                     : (std::to_string(k3::par::max_threads()) + " threads, " +
                        k3::ops::cpu_isa_name(k3::ops::cpu_isa()) + " kernels")
                           .c_str());
    struct DecodeRow {
      int64_t batch;
      double kda_s, mla_s, head_s;
    };
    std::vector<DecodeRow> decode_rows;
    for (const int64_t B : batches)
      decode_rows.push_back({B, time_layer(*kda_w, 1, 1, B), time_layer(*mla_w, 3, 1, B), time_head(B)});
    const double kda_dec = decode_rows.front().kda_s, mla_dec = decode_rows.front().mla_s,
                 head = decode_rows.front().head_s;
    const double kda_pre = time_layer(*kda_w, 1, prefill, 1) / double(prefill);
    const double mla_pre = time_layer(*mla_w, 3, prefill, 1) / double(prefill);
    const double read_after = probe ? probe->measure(5) : read_before, read_gbs = std::max(read_before, read_after);
    const int64_t n_kda = int64_t(k3::kda_layers_zero_based(cfg).size()), n_mla = d.layers - n_kda;
    const double decode_s = double(n_kda) * kda_dec + double(n_mla) * mla_dec + head;
    const double prefill_s = double(n_kda) * kda_pre + double(n_mla) * mla_pre;
    for (void* p : dev_bufs) gpu_be->release(p);

    // Bytes a decode step of each layer reads, for the bandwidth ratio.
    auto layer_bytes = [&](const k3::LayerWeights& w) {
      uint64_t b = 0;
      if (w.is_kda) {
        for (const auto* m : {&w.kda.q_proj, &w.kda.k_proj, &w.kda.v_proj, &w.kda.f_a_proj, &w.kda.f_b_proj,
                              &w.kda.b_proj, &w.kda.g_proj, &w.kda.o_proj})
          b += k3::weight_bytes(*m);
        b += 2 * 4 * uint64_t(d.kda.heads * d.kda.head_dim * d.kda.head_dim);
      } else {
        for (const auto* m :
             {&w.mla.q_a_proj, &w.mla.q_b_proj, &w.mla.kv_a_proj, &w.mla.kv_b_proj, &w.mla.g_proj, &w.mla.o_proj})
          b += k3::weight_bytes(*m);
        b += uint64_t(depth * (d.mla.kv_lora + d.mla.rope) * 4);
      }
      for (const auto* m :
           {&w.moe.gate, &w.moe.down_lat, &w.moe.up_lat, &w.moe.shared.gate, &w.moe.shared.up, &w.moe.shared.down})
        b += k3::weight_bytes(*m);
      b += uint64_t(d.moe.top_k) * (k3::weight_bytes(pool[0].gate) * 3);
      return b;
    };
    const uint64_t kda_b = layer_bytes(kda), mla_b = layer_bytes(mla);
    const uint64_t total_b = uint64_t(n_kda) * kda_b + uint64_t(n_mla) * mla_b + k3::weight_bytes(lm_head);

    Json j;
    j["config"] = config_dir;
    j["device"] = device;
    if (gpu) {
#ifdef K3_HAVE_CUDA
      const k3::cuda::DeviceInfo dev = k3::cuda::device_info();
      j["gpu"] = dev.name;
#endif
    } else {
      j["threads"] = k3::par::max_threads();
      j["cpu_isa"] = k3::ops::cpu_isa_name(k3::ops::cpu_isa());
    }
    j["numerics"] = numerics;
    j["expert_pool"] = pool_n;
    j["decode_depth"] = depth;
    j["prefill_tokens"] = prefill;
    j["roofline"] = {{"read_gbs", read_gbs},
                     {"read_gbs_before", read_before},
                     {"read_gbs_after", read_after},
                     {"peak_gflops", roof.peak_gflops},
                     {"peak_kind", roof.peak_kind}};
    j["kda_layer"] = {{"decode_ms", kda_dec * 1e3},
                      {"decode_bytes", kda_b},
                      {"decode_gbs", double(kda_b) / kda_dec / 1e9},
                      {"prefill_ms_per_token", kda_pre * 1e3}};
    j["mla_layer"] = {{"decode_ms", mla_dec * 1e3},
                      {"decode_bytes", mla_b},
                      {"decode_gbs", double(mla_b) / mla_dec / 1e9},
                      {"prefill_ms_per_token", mla_pre * 1e3}};
    j["lm_head_ms"] = head * 1e3;
    // Per decode batch: one step of B sequences, extrapolated to the whole model (aggregate t/s).
    Json by_batch = Json::array();
    for (const DecodeRow& r : decode_rows) {
      const double step = double(n_kda) * r.kda_s + double(n_mla) * r.mla_s + r.head_s;
      by_batch.push_back({{"batch", r.batch},
                          {"kda_layer_ms", r.kda_s * 1e3},
                          {"mla_layer_ms", r.mla_s * 1e3},
                          {"lm_head_ms", r.head_s * 1e3},
                          {"step_s", step},
                          {"aggregate_tokens_per_s", double(r.batch) / step}});
    }
    j["decode_by_batch"] = by_batch;
    j["layers"] = {{"kda", n_kda}, {"mla", n_mla}};
    j["extrapolated"] = {{"decode_s_per_token", decode_s},
                         {"decode_bytes_per_token", total_b},
                         {"decode_fraction_of_read_bw", double(total_b) / decode_s / (read_gbs * 1e9)},
                         {"prefill_s_per_token", prefill_s},
                         {"note", gpu ? "the GPU share of a full K3 step: every layer's weights resident on "
                                        "the device (the whole model needs about 1.5 TB, several GPUs or host "
                                        "RAM for the experts)"
                                      : "all weights resident in RAM (the 1.45 TB of experts would have to come "
                                        "from disk on a real machine of this size: add expert bytes / disk "
                                        "bandwidth)"}};
    j["peer_kimi_k3_in_c"] = {{"source",
                               "FareedKhan-dev/kimi-k3-in-c docs/data/speed-2026-08.md via "
                               "performance-anchors.md 6.3"},
                              {"machine", "EPYC 7763, 124 vCPU, AVX2, NVMe 3.2-4.6 GB/s"},
                              {"s_per_token_128GB_plus", 5.59},
                              {"s_per_token_8GB", 26.5},
                              {"trunk_compute_s_per_token", 2.48}};
    std::printf("%s\n", j.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3_layer_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
