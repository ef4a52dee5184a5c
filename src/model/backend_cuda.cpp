// The CUDA backend: every op on device memory through ops/cuda (one stream). Weights are uploaded
// once into one arena (routed experts stacked per layer in their stored format, MXFP4 stays 4-bit);
// a step's sequences (ids, rows, slots, positions, block tables) are copied to the device before
// its ops, so a decode step (one row per sequence, any number of sequences) recorded once as a
// CUDA graph replays for later steps of the same shape. Routed experts: per-slot GEMVs with the
// expert ids on the device for short chunks, one GEMM per selected expert for long ones.
// Must not: include CUDA headers (only the plain ops/cuda/*.h API) or fall back to the CPU.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "core/error.h"
#include "model/backends.h"
#include "model/model.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/ops.h"

namespace k3 {
namespace cu = k3::cuda;

namespace {


size_t data_bytes(const WeightMat& w) { return size_t(w.rows) * size_t(row_bytes(w)); }
size_t scale_bytes(const WeightMat& w) { return w.fmt == WFormat::MXFP4 ? size_t(w.rows * (w.cols / 32)) : 0; }

// Expert e (rows [e*R, (e+1)*R)) of a stacked expert matrix, as its own view.
WeightMat expert_view(const WeightMat& stacked, int64_t R, int64_t e) { return rows_of(stacked, e * R, R); }
// Expert e of stacks of experts shaped like `one`, as views.
GluWeights expert_of(const GluWeights& stacks, const GluWeights& one, int64_t e) {
  return {expert_view(stacks.gate, one.gate.rows, e), expert_view(stacks.up, one.up.rows, e),
          expert_view(stacks.down, one.down.rows, e)};
}

// Stacks of `cap` experts shaped like `one` in one device buffer: per matrix (gate, up, down) its
// data, then its MXFP4 scales, each 256-aligned. Offsets of each part, the whole size, and the stacks
// placed at a base.
struct ExpertStacks {
  size_t data[3] = {}, scales[3] = {}, bytes = 0;
  GluWeights one;
  int64_t cap = 0;
  ExpertStacks() = default;
  ExpertStacks(const GluWeights& f, int64_t n) : one(f), cap(n) {
    const WeightMat* m[3] = {&f.gate, &f.up, &f.down};
    for (int j = 0; j < 3; ++j) {
      data[j] = bytes;
      bytes += ((data_bytes(*m[j]) * size_t(cap)) + 255) & ~size_t(255);
      scales[j] = bytes;
      bytes += ((scale_bytes(*m[j]) * size_t(cap)) + 255) & ~size_t(255);
    }
  }
  GluWeights at(char* base) const {
    GluWeights s = one;
    WeightMat* st[3] = {&s.gate, &s.up, &s.down};
    for (int j = 0; j < 3; ++j) {
      st[j]->rows *= cap;
      st[j]->data = base + data[j];
      st[j]->scales = st[j]->fmt == WFormat::MXFP4 ? reinterpret_cast<const uint8_t*>(base + scales[j]) : nullptr;
    }
    return s;
  }
  std::vector<GluWeights> experts(const GluWeights& stacks) const {
    std::vector<GluWeights> v(static_cast<size_t>(cap));
    for (int64_t e = 0; e < cap; ++e) v[size_t(e)] = expert_of(stacks, one, e);
    return v;
  }
};

// Places weights into one device allocation. Run twice: a sizing pass (base == nullptr) and a
// copying pass, so the arena is exactly as large as what is put in it.
class Uploader {
 public:
  explicit Uploader(char* base) : base_(base) {}
  size_t used() const { return off_; }
  void vec(FVec& v) { v.p = static_cast<const float*>(put(v.p, v.size() * 4)); }
  // as_f32: an FP8 matrix goes up dequantised (gpu_weight_bytes: the MLA kv_b_proj).
  void mat(WeightMat& w, bool as_f32 = false) {
    if (w.fmt == WFormat::FP8) return fp8(w, as_f32);
    w.data = put(w.data, data_bytes(w));
    if (w.fmt == WFormat::MXFP4) w.scales = static_cast<const uint8_t*>(put(w.scales, scale_bytes(w)));
  }
  // Experts e = 0..E-1 of one matrix kind stacked along rows: [E * rows, cols], same format each.
  WeightMat stack(const std::vector<const WeightMat*>& ws) {
    const WeightMat& f = *ws.front();
    for (const WeightMat* w : ws)
      if (w->fmt != f.fmt || w->rows != f.rows || w->cols != f.cols)
        fail("GPU upload: routed experts of one layer differ in format or shape (" + std::string(wformat_name(w->fmt)) +
             " vs " + wformat_name(f.fmt) + ")");
    WeightMat d = f;
    d.rows = f.rows * int64_t(ws.size());
    char* data = static_cast<char*>(reserve(data_bytes(f) * ws.size()));
    for (size_t i = 0; i < ws.size(); ++i) copy(data + i * data_bytes(f), ws[i]->data, data_bytes(f));
    d.data = data;
    if (f.fmt == WFormat::MXFP4) {
      char* sc = static_cast<char*>(reserve(scale_bytes(f) * ws.size()));
      for (size_t i = 0; i < ws.size(); ++i) copy(sc + i * scale_bytes(f), ws[i]->scales, scale_bytes(f));
      d.scales = reinterpret_cast<const uint8_t*>(sc);
    }
    return d;
  }

 private:
  void* reserve(size_t n) {
    off_ = (off_ + 255) & ~size_t(255);
    char* p = base_ ? base_ + off_ : reinterpret_cast<char*>(off_ + 256);  // sizing pass: any non-null
    off_ += n;
    return p;
  }
  void copy(void* dst, const void* src, size_t n) {
    if (base_) cu::h2d(dst, src, n);
  }
  const void* put(const void* src, size_t n) {
    void* p = reserve(n);
    copy(p, src, n);
    return p;
  }
  // An FP8 (--trunk-fp8) matrix in its GPU form (weight.h): the codes, and each row's fp32 block
  // scales (a view of any first row then finds its own, as MXFP4 views do); or, as_f32, each weight
  // decoded exactly (code x block scale, one fp32 multiply: the values every FP8 kernel uses).
  void fp8(WeightMat& w, bool as_f32) {
    const int64_t R = w.rows, C = w.cols, nbc = fp8_block_cols(C);
    if (as_f32) {
      char* d = static_cast<char*>(reserve(size_t(R * C) * 4));
      if (base_) {  // 256 rows at a time through one host buffer
        constexpr int64_t kRows = 256;
        std::vector<float> rows(static_cast<size_t>(std::min<int64_t>(R, kRows) * C));
        for (int64_t r0 = 0; r0 < R; r0 += kRows) {
          const int64_t n = std::min<int64_t>(kRows, R - r0);
          for (int64_t r = 0; r < n; ++r) ops::dequant_row(w, r0 + r, rows.data() + r * C);
          cu::h2d(d + size_t(r0 * C) * 4, rows.data(), size_t(n * C) * 4);
          cu::sync();  // the buffer is rewritten next
        }
      }
      w = WeightMat{WFormat::F32, R, C, d, nullptr};
      return;
    }
    const void* codes = put(w.data, size_t(R * C));
    char* sc = static_cast<char*>(reserve(size_t(R * nbc) * 4));
    if (base_) {
      std::vector<float> rows(size_t(R * nbc));
      fp8_row_scale_table(w, rows.data());
      cu::h2d(sc, rows.data(), rows.size() * 4);
      cu::sync();
    }
    w.data = codes;
    w.scales = reinterpret_cast<const uint8_t*>(sc);
    w.block_scales = nullptr;
    w.row0 = 0;
  }
  char* base_;
  size_t off_ = 0;
};

// Every weight of `w` into the arena (the visitor's list), the routed experts of each MoE layer
// stacked (w1, w3, w2), experts[e] becoming views into the stacks.
void place_all(Uploader& u, ModelWeights& w, bool experts) {
  for_each_weight(
      w,
      [&](WeightMat& m, WeightRole role) {
        if (role != WeightRole::RoutedExpert) u.mat(m, is_mla_kv_b(w, m));
      },
      [&](FVec& v) { u.vec(v); });
  if (!experts) return;  // they stay host views, read only through an ExpertSource
  for (LayerWeights& l : w.layers) {
    if (l.dense_ffn || l.moe.experts.empty()) continue;
    MoeWeights& e = l.moe;
    // The experts this model holds: all, or one expert-parallel rank's [local_begin, local_end),
    // stacked from 0 (the rank's moe_routed maps the router's ids onto the stack).
    const int64_t b = e.local_begin, end = e.local_end < 0 ? int64_t(e.experts.size()) : e.local_end;
    std::vector<const WeightMat*> w1, w3, w2;
    for (int64_t x = b; x < end; ++x) {
      w1.push_back(&e.experts[size_t(x)].gate);
      w3.push_back(&e.experts[size_t(x)].up);
      w2.push_back(&e.experts[size_t(x)].down);
    }
    e.stacked = {u.stack(w1), u.stack(w3), u.stack(w2)};
    const GluWeights one = e.experts[size_t(b)];
    for (int64_t x = b; x < end; ++x) e.experts[size_t(x)] = expert_of(e.stacked, one, x - b);
  }
}

cu::Precision precision_of(StepNumerics n) {
  if (n == StepNumerics::Exact)
    fail("--numerics exact (fp64 sums) is CPU-only; on the GPU use --numerics fp32 (parity mode) or fast (bf16)");
  return n == StepNumerics::Fast ? cu::Precision::BF16 : cu::Precision::F32;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelDims& d, const GpuOptions& o) : d_(d), opt_(o) {
    stream_ = cu::stream_create();
    const int64_t R = o.tokens_per_call, K = std::max<int64_t>(d.moe.top_k, 1);
    // Routed experts: per-slot gate/up/out, grouping buffers (rows in/out) and row lists.
    moe_floats_ = R * K * (2 * d.moe.inter + 3 * d.moe.latent);
    if (d.moe.experts > 0) {
      moe_buf_ = cu::DevBuf(size_t(std::max<int64_t>(moe_floats_, 1)) * 4, "MoE expert scratch");
      // Row lists: [R*K] gather rows, [R*K] scatter rows, then the grouped GEMM's tiles (each expert's
      // rows in pieces of kExpertTileRows: at most R*K/kExpertTileRows + E tiles), or the decode
      // grouping's (routed_gemv: pieces of kGemvMaxT).
      max_tiles_ = std::max(R * K / cu::kExpertTileRows + d.moe.experts, cu::expert_grouped_tiles_max(R * K, d.moe.experts));
      const size_t list_bytes = size_t(2 * R * K) * 4 + size_t(max_tiles_) * sizeof(cu::ExpertTile);
      rows_dev_ = cu::DevBuf(list_bytes, "MoE row lists");
      rows_pinned_ = static_cast<int32_t*>(cu::host_alloc_pinned(list_bytes));
    }
    const MlaAttnDims ad{d.mla.heads, d.mla.nope, d.mla.rope, d.mla.v, d.mla.kv_lora, 0.0f};
    if (d.mla_layers > 0) {
      // The attention's split plan depends on the rows, and fewer rows may take more scratch.
      mla_work_ = cu::DevBuf(size_t(paged_mla_work_floats_max(R, ad, cu::sm_count())) * 4, "MLA workspace");
      if (mla_tc_supported(ad)) {  // the tensor-core prefill form (fast numerics)
        mla_tc_chunk_ = mla_tc_key_chunk(ad);
        mla_tc_work_ = cu::DevBuf(size_t(mla_tc_work_bytes(mla_tc_chunk_, R, ad)), "MLA tensor-core workspace");
        mla_skip_dev_ = cu::DevBuf(size_t(R) * 4, "MLA sequence flags");
      }
    }
    if (o.experts_on_cpu && d.moe.experts > 0) {
      cpu_ = make_cpu_backend();
      host_moe_ = static_cast<float*>(cu::host_alloc_pinned(size_t(R * (2 * d.moe.latent + 2 * K)) * 4));
      if (o.hot_experts != 0) {  // the host's slots of a step that also runs cached experts on the GPU
        host_terms_ = static_cast<float*>(cu::host_alloc_pinned(size_t(cu::kGemvMaxT * K * d.moe.latent) * 4));
        hot_ids_dev_ = cu::DevBuf(size_t(cu::kGemvMaxT * K) * 4, "hot-expert slot ids");
      }
    }
    if (d.kda_layers > 0 && d.kda.tc_supported()) {  // the bf16 chunked KDA of prefill steps
      kda_work_chunks_ = d.kda.tc_work_chunks(R);
      kda_work_ = cu::DevBuf(size_t(d.kda.tc_work_bytes(R)), "KDA tensor-core workspace");
    }
    // cuBLAS (bf16 products of long chunks, and of decode steps past a wide GEMV: one_product) set up
    // now, since a recorded decode step must not allocate.
    cu::cublas_prepare(stream_, R * d.widest_product_input());
    ids_dev_ = cu::DevBuf(size_t(R) * 4, "token ids");
    seq_dev_ = cu::DevBuf(size_t(3 * R + 1) * 4, "step sequences");  // cu_rows, slots, pos0
    argmax_dev_ = cu::DevBuf(size_t(R) * 4, "greedy picks");
    staging_ = static_cast<int32_t*>(cu::host_alloc_pinned(size_t(5 * R + 1) * 4));  // + the MLA flags
  }
  ~CudaBackend() override {
    cu::nccl_destroy(nccl_);
    cu::graph_destroy(graph_);
    cu::host_free_pinned(staging_);
    cu::host_free_pinned(table_pinned_);
    cu::host_free_pinned(rows_pinned_);
    cu::host_free_pinned(host_moe_);
    cu::host_free_pinned(host_terms_);
    if (copy_stream_) {
      try {
        cu::sync(copy_stream_);  // a streamed group's copy may still read its pinned twin
      } catch (...) {
      }
      for (StreamBuf& b : sbuf_) cu::host_free_pinned(b.pinned);
      cu::stream_destroy(copy_stream_);
    }
    cu::stream_destroy(stream_);
  }

  const char* name() const override { return "cuda"; }
  BackendCaps caps() const override { return {false, false, true}; }

  void* alloc(size_t bytes, const char* what) override { return cu::dev_alloc(std::max<size_t>(bytes, 1), what); }
  void release(void* p) noexcept override {
    if (p) {
      try {
        cu::sync(stream_);  // queued work may still read it
      } catch (...) {
      }
      cu::dev_free(p);
    }
  }
  void upload(void* dst, const void* src, size_t n) override {
    cu::h2d(dst, src, n, stream_);
    cu::sync(stream_);  // src is pageable host memory the caller may reuse
  }
  void download(void* dst, const void* src, size_t n) override { cu::d2h(dst, src, n, stream_); }
  void copy(void* dst, const void* src, size_t n) override { cu::d2d(dst, src, n, stream_); }
  void zero(void* dst, size_t n) override { cu::dev_memset(dst, 0, n, stream_); }
  void sync() override { cu::sync(stream_); }
  int64_t mark() override { return marks_.record(stream_); }
  double seconds_between(int64_t a, int64_t b) override { return marks_.ms_between(a, b) * 1e-3; }
  void reset_marks() override { marks_.reset(); }
  bool set_graphs(bool on) override {
    opt_.graphs = on;
    return true;
  }

  void place(ModelWeights& w) override {
    Uploader sizing(nullptr);
    ModelWeights probe = w;
    const bool experts = opt_.experts_resident && !cpu_;  // else they stay host views
    place_all(sizing, probe, experts);
    arena_ = cu::DevBuf(sizing.used() + 256, "model weights");
    Uploader up(arena_.as<char>());
    place_all(up, w, experts);
    cu::sync();
    moe_layers_ = 0;
    for (const LayerWeights& l : w.layers) moe_layers_ += !l.dense_ffn && !l.moe.experts.empty();
  }
  HotExpertStats hot_expert_stats() const override {
    HotExpertStats st;
    for (const auto& [w, hc] : hot_) {
      if (!hc.filled) continue;
      ++st.layers;
      st.experts += int64_t(hc.counts.size());
      st.cached += hc.cached;
      st.slots += hc.slots;
      st.hits += hc.hits;
      st.bytes += hc.arena.bytes();
    }
    return st;
  }

  // ---- a step
  bool begin_step(const StepView& v, const int32_t* ids, StepNumerics n, bool replayable) override {
    p_ = precision_of(n);
    if (v.rows > opt_.tokens_per_call) fail("GPU: a step of more rows than the workspace holds");
    if (v.n_seqs > opt_.tokens_per_call) fail("GPU: a step of more sequences than the workspace holds");
    cu::sync(stream_);  // the staging buffers are rewritten below
    view_ = v;
    view_cu_.assign(v.cu_rows, v.cu_rows + v.n_seqs + 1);
    // Block tables with a device row stride that only grows (a recorded graph keeps reading it).
    const int64_t need_pages = std::max<int64_t>(v.max_pages, 1);
    // Rows for as many sequences as steps have had (doubling, at most tokens_per_call): a long single
    // sequence's table is its own pages, not tokens_per_call copies of them.
    if (need_pages > table_stride_ || v.n_seqs > table_seqs_) {
      if (need_pages > table_stride_) table_stride_ = std::max(table_stride_ * 2, need_pages);
      table_seqs_ = std::min(std::max({table_seqs_, 2 * table_seqs_, v.n_seqs}), opt_.tokens_per_call);
      table_cap_ = table_seqs_ * table_stride_;
      table_dev_ = cu::DevBuf(size_t(table_cap_) * 4, "block tables");
      cu::host_free_pinned(table_pinned_);
      table_pinned_ = static_cast<int32_t*>(cu::host_alloc_pinned(size_t(table_cap_) * 4));
      ++buffers_;
    }
    const int64_t N = v.n_seqs, R = v.rows;
    int32_t* st = staging_;
    std::memcpy(st, ids, size_t(R) * 4);
    std::memcpy(st + R, v.cu_rows, size_t(N + 1) * 4);
    std::memcpy(st + R + N + 1, v.slots, size_t(N) * 4);
    for (int64_t i = 0; i < N; ++i) st[R + 2 * N + 1 + i] = int32_t(v.pos0[i]);
    for (int64_t i = 0; i < N; ++i)
      std::memcpy(table_pinned_ + i * table_stride_, v.block_table + i * v.max_pages, size_t(v.max_pages) * 4);
    cu::h2d(ids_dev_.get(), st, size_t(R) * 4, stream_);
    cu::h2d(seq_dev_.get(), st + R, size_t(3 * N + 1) * 4, stream_);
    cu::h2d(table_dev_.get(), table_pinned_, size_t(N * table_stride_) * 4, stream_);
    int32_t* sd = seq_dev_.as<int32_t>();
    vb_ = cu::VarlenDev{N, R, sd, sd + N + 1, v.n_slots};
    pc_ = cu::PagedCacheDev{nullptr, v.page_tokens, table_dev_.as<int32_t>(), table_stride_, sd + 2 * N + 1, v.n_pages};
    capturing_ = false;
    plan_mla(v, st + R + 3 * N + 1);
    // The host's part of the step: its routed experts. In fp32 activations unless cpu_experts_q8:
    // the CPU's fast numerics quantise a lone row's activations to 8 bits (q8 MXFP4 GEMV), which the
    // GPU never does, and the placement must not change the tokens (issue 20: greedy ids equal to
    // all on the GPU; with q8 the trained K3-nano's teacher-forced argmax agreed at 36 of 40
    // positions, cuda-gates of 2026-12-05). The price: decoding E2M1 to fp32 is compute-bound on the
    // CPU, half the q8 rate on the H100 machine's 16 cores (docs/data/hybrid-h100-2026-12-05*.json).
    if (cpu_)
      cpu_->begin_step(v, ids, n == StepNumerics::Fast && !opt_.cpu_experts_q8 ? StepNumerics::F32 : n, false);
    // (Steps of a split model are not recorded: their NCCL calls are not captured into graphs here.)
    if (!opt_.graphs || !replayable || cpu_ || nccl_) return true;
    const GraphKey key{N, R, int(p_), v.pool, v.pool_epoch, table_stride_, buffers_};
    if (graph_ && key == key_) {
      cu::graph_launch(graph_, stream_);
      return false;
    }
    cu::graph_destroy(graph_);
    graph_ = nullptr;
    key_ = key;
    cu::capture_begin(stream_);
    capturing_ = true;
    return true;
  }
  void end_step() override {
    if (cpu_) cpu_->end_step();
    if (!capturing_) return;
    capturing_ = false;
    graph_ = cu::capture_end(stream_);
    cu::graph_launch(graph_, stream_);
  }
  void abort_step() noexcept override {
    if (cpu_) cpu_->abort_step();
    if (!capturing_) return;
    capturing_ = false;
    try {
      cu::graph_destroy(cu::capture_end(stream_));
    } catch (...) {
    }
  }

  // ---- row ops
  void embed(const WeightMat& E, const int32_t*, int64_t R, float* out) override {
    cu::embed_rows(E, ids_dev_.as<int32_t>(), R, out, stream_);
  }
  void matmul(const WeightMat& W, const float* x, int64_t R, float* y, const int32_t* groups,
              int64_t n_groups) override {
    by_runs(R, groups, n_groups, cu::gemv_wide_ok(W), [&](int64_t r0, int64_t n, cu::Precision p, bool rows) {
      product(W, x + r0 * W.cols, n, y + r0 * W.rows, p, rows);
    });
  }
  void matmul_shared_input(const WeightMat* const* W, int64_t n, const float* x, int64_t R, float* const* y,
                           const bool* fp32) override {
    std::vector<const float*> xs(size_t(n), x);
    products(W, xs.data(), n, R, y, fp32);
  }
  void matmul_many(const WeightMat* const* W, const float* const* x, int64_t n, int64_t R, float* const* y) override {
    products(W, x, n, R, y, nullptr);
  }
  void rmsnorm(const float* x, int64_t R, int64_t n, const float* w, float eps, float* out) override {
    cu::rmsnorm(x, R, n, w, eps, out, stream_);
  }
  void rmsnorm_gate(const float* x, int64_t R, int64_t n, const float* w, float eps, const float* gate,
                    float* out) override {
    cu::rmsnorm_gate(x, R, n, w, eps, gate, out, stream_);
  }
  void l2norm_scale(float* x, int64_t rows, int64_t n, float eps, float scale) override {
    cu::l2norm_scale(x, rows, n, eps, scale, stream_);
  }
  void situ_glu(const float* g, const float* u, int64_t n, float b1, float b2, float* out) override {
    cu::situ_glu(g, u, n, b1, b2, out, stream_);
  }
  void moe_tail(const MoeTail& p, int64_t R) override {
    cu::moe_tail(p.agg, p.norm_w ? R : 0, p.latent, p.norm_w, p.eps, p.g, p.u, p.n_situ, p.b1, p.b2, stream_);
  }
  void kda_gate(const float* f, int64_t R, int64_t H, int64_t D, const float* A_log, const float* dt_bias, float lb,
                float* g) override {
    cu::kda_gate(f, R, H, D, A_log, dt_bias, lb, g, stream_);
  }
  void sigmoid(float* x, int64_t n) override { cu::sigmoid_inplace(x, n, stream_); }
  void sigmoid_mul(float* x, const float* gate, int64_t n) override { cu::sigmoid_gate_mul(x, gate, n, stream_); }
  void add(float* y, const float* x, int64_t n) override { cu::add_inplace(y, x, n, stream_); }
  void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst) override {
    bool identity = true;
    for (int64_t i = 0; i < n && identity; ++i) identity = rows[i] == i;
    if (identity) return cu::d2d(dst, src, size_t(n * width) * 4, stream_);
    if (capturing_) fail("internal error: a recorded GPU step gathers rows");
    const int64_t K = std::max<int64_t>(d_.moe.top_k, 1);
    if (n > 2 * opt_.tokens_per_call * K || !rows_pinned_) fail("internal error: GPU row gather too large");
    std::memcpy(rows_pinned_, rows, size_t(n) * 4);
    cu::h2d(rows_dev_.get(), rows_pinned_, size_t(n) * 4, stream_);
    cu::gather_rows(src, rows_dev_.as<int32_t>(), n, width, dst, stream_);
    cu::sync(stream_);  // the pinned list is reused
  }
  void attnres_mix(const float* const* src, int64_t n_src, int64_t R, int64_t H, const float* fold, float eps,
                   float* out) override {
    cu::attnres_mix(src, n_src, R, H, fold, eps, out, stream_);
  }
  void residual_norm(const ResidualNorm& p, int64_t R, int64_t H) override {
    cu::residual_norm(p.blocks, p.n_blocks, p.partial, p.y, p.y2, p.y_replaces, p.fold, p.mix_eps, p.norm_w, p.norm_eps, R, H,
                      p.xn, stream_);
  }

  // ---- per-sequence ops
  void short_conv_silu(const float* x, const StepView&, int64_t C, const float* w, int64_t K, float* state,
                       float* out) override {
    cu::short_conv_silu_varlen(x, vb_, C, w, K, state, out, stream_);
  }
  // Decode rows (one per sequence): the seven ops in one kernel with the same bits; else separately.
  void kda_prepare(const KdaPrepare& p, const StepView& s, int64_t R) override {
    cu::KdaPrepDev a;
    const float* in[3] = {p.qh, p.kh, p.vh};
    float* out[3] = {p.q, p.k, p.v};
    for (int m = 0; m < 3; ++m) {
      a.in[m] = in[m];
      a.out[m] = out[m];
      a.w[m] = p.conv_w[m];
      a.state[m] = p.conv_state[m];
    }
    a.C = p.C, a.H = p.H, a.D = p.D, a.K = int(p.K);
    a.q_scale = p.q_scale, a.eps = p.eps;
    a.f = p.f, a.A_log = p.A_log, a.dt_bias = p.dt_bias, a.lb = p.lower_bound, a.g = p.g, a.beta = p.beta;
    if (R == view_.rows && R == view_.n_seqs && view_.max_rows_per_seq == 1 && cu::kda_prepare_decode_ok(a))
      return cu::kda_prepare_decode(a, vb_, stream_);
    Backend::kda_prepare(p, s, R);
  }
  void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const StepView& s,
           int64_t H, int64_t Dk, int64_t Dv, KdaAlgo algo, int64_t chunk, float* S_pool, float* o) override {
    // Chunked prefill in fast numerics: bf16 tensor cores. Its grid comes from the host's cu_rows,
    // so never inside a recorded graph (only decode steps are recorded: they take the recurrent kernel).
    if (algo != KdaAlgo::Chunked || s.max_rows_per_seq <= 1)
      cu::kda_recurrent_varlen(q, k, v, g, beta, vb_, H, Dk, Dv, S_pool, o, stream_);
    else if (p_ == cu::Precision::BF16 && kda_work_chunks_ > 0 && cu::kda_tc_supported(Dk, Dv) && !capturing_)
      cu::kda_chunked_tc_varlen(q, k, v, g, beta, vb_, view_cu_.data(), H, Dk, Dv, S_pool, o, kda_work_.get(),
                                kda_work_chunks_, stream_);
    else
      cu::kda_chunked_varlen(q, k, v, g, beta, vb_, H, Dk, Dv, chunk, S_pool, o, stream_);
  }
  void mla_append(const float* ckv, const StepView&, int64_t L, int64_t rope, const float* norm_w, float eps,
                  const MlaPages& pages) override {
    cu::PagedCacheDev c = pc_;
    c.pages = pages.pages;
    cu::mla_cache_append_paged(ckv, vb_, c, L, rope, norm_w, eps, stream_);
  }
  // Prefill pieces of kMlaTcMinRows rows or more in fast numerics: the tensor-core expanded form
  // (mla_tc.cu); decode rows and fp32 numerics: the absorbed kernel (fp32), which skips the others.
  void mla_attend(const float* q, const StepView&, const MlaPages& pages, const WeightMat& kv_b, const MlaAttnDims& d,
                  MlaAlgo algo, float* out) override {
    cu::PagedCacheDev c = pc_;
    c.pages = pages.pages;
    const bool tc = mla_tc_seqs_ > 0 && algo != MlaAlgo::Absorbed && !capturing_ && cu::mla_tc_weight_ok(kv_b) &&
                    mla_tc_supported(d);
    if (!tc || mla_tc_seqs_ < view_.n_seqs)
      cu::mla_attend_absorbed_paged(q, vb_, c, kv_b, d, mla_work_.as<float>(), out, p_, stream_,
                                    tc ? mla_skip_dev_.as<int32_t>() : nullptr);
    if (tc)
      cu::mla_attend_tc_paged(q, vb_, c, view_cu_.data(), view_pos0_.data(), mla_tc_use_.data(), kv_b, d,
                              mla_tc_chunk_, mla_tc_work_.get(), out, stream_);
  }
  // Which sequences of the step take the tensor-core MLA (their flags go to the device for the
  // absorbed kernel to skip); `flags` is pinned staging of n_seqs ints.
  void plan_mla(const StepView& v, int32_t* flags) {
    const int64_t N = v.n_seqs;
    view_pos0_.assign(v.pos0, v.pos0 + N);
    mla_tc_use_.assign(size_t(N), 0);
    mla_tc_seqs_ = 0;
    if (!mla_tc_work_ || p_ != cu::Precision::BF16) return;
    for (int64_t i = 0; i < N; ++i) {
      const bool use = v.cu_rows[i + 1] - v.cu_rows[i] >= kMlaTcMinRows;
      mla_tc_use_[size_t(i)] = use;
      flags[i] = use;
      mla_tc_seqs_ += use;
    }
    if (mla_tc_seqs_ > 0 && mla_tc_seqs_ < N) cu::h2d(mla_skip_dev_.get(), flags, size_t(N) * 4, stream_);
  }

  // ---- MoE
  void router_topk(const float* logits, const float* bias, int64_t R, int64_t E, int64_t k, bool renorm, float scale,
                   int32_t* idx, float* w) override {
    cu::router_topk(logits, bias, R, E, k, renorm, scale, idx, w, stream_);
  }
  // ---- collectives of a model split over processes, one GPU each (NCCL, on this stream)
  void join_group(Communicator& comm) override {
    if (nccl_) fail("internal error: a GPU rank joined its group twice");
    std::vector<uint8_t> id;
    if (comm.rank() == 0) id = cu::nccl_unique_id();
    comm.broadcast_bytes(id, 0);
    nccl_ = cu::nccl_init(id, comm.size(), comm.rank());
    nccl_ranks_ = comm.size();
    nccl_rank_ = comm.rank();
  }
  void all_gather(Communicator&, const float* send, int64_t n, float* out) override {
    if (!nccl_) refuse_split();
    cu::nccl_all_gather(nccl_, send, n, out, stream_);
  }
  void broadcast(Communicator&, float* buf, int64_t n, int root) override {
    if (!nccl_) refuse_split();
    cu::nccl_broadcast(nccl_, buf, n, root, stream_);
  }
  void all_gather_v(Communicator&, const float* send, int64_t, float* out, const int64_t* counts) override {
    if (!nccl_) refuse_split();
    cu::nccl_all_gather_v(nccl_, send, out, counts, nccl_ranks_, nccl_rank_, stream_);
  }
  // The gathered terms of an expert-parallel split summed in top-k slot order: the one-GPU path's
  // combine (routed_gemv), so a decode step's sum is the same bits as on one GPU.
  void moe_combine(const float* terms, const int32_t*, const float* wt, int64_t R, int64_t K, int64_t latent,
                   float* agg) override {
    cu::moe_combine(terms, wt, R, K, latent, agg, stream_);
  }
  [[noreturn]] static void refuse_split() {
    fail(
        "a model split over ranks (--tp/--ep) runs on GPUs as one process per GPU (mpirun -np N k3 ... "
        "--device cuda --tp N), tensor parallel only; expert parallel on GPUs is not built yet");
  }
  void moe_routed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                  const float* wt, int64_t R, int64_t K, float* agg, ExpertSource* source, float* terms) override {
    if (terms) return routed_terms(w, latent, situ, z, idx, R, K, terms);
    if (w.local_end >= 0) refuse_split();
    if (cpu_) return routed_on_cpu(w, latent, situ, z, idx, wt, R, K, agg, source);
    if (source) return routed_from_source(w, latent, situ, z, idx, wt, R, K, agg, *source);
    if (w.stacked.gate.empty())
      fail("the routed experts were not uploaded to the GPU (--ram-budget): pass their expert source");
    routed(w, latent, situ, z, idx, wt, R, K, agg);
  }

  void routed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
              const float* wt, int64_t R, int64_t K, float* agg) {
    // Sequences of up to kGemvMaxT rows: every (row, slot) pair runs its expert's GLU as a GEMV
    // with the expert ids on the device (what a recorded decode step replays). A longer chunk
    // groups its slots by expert on the host, one GEMM per selected expert, as it does alone.
    for (const Run& run : runs(R, nullptr, 0)) {
      if (!run.big) {
        routed_gemv(w, latent, situ, z + run.r0 * latent, idx + run.r0 * K, wt + run.r0 * K, run.n, K,
                    agg + run.r0 * latent);
        continue;
      }
      // A long chunk is one sequence (runs() never merges them).
      routed_grouped(w, latent, situ, z + run.r0 * latent, idx + run.r0 * K, wt + run.r0 * K, run.n, K,
                     agg + run.r0 * latent);
    }
  }

  // GpuOptions::experts_on_cpu: the rows' latent inputs and routing go to the host, the CPU backend
  // sums their routed experts from the host views (or the source) exactly as a CPU-only run does,
  // and the sum comes back. The stream waits meanwhile (the next op needs the sum).
  void routed_on_cpu(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                     const float* wt, int64_t R, int64_t K, float* agg, ExpertSource* source) {
    if (capturing_) fail("internal error: a recorded GPU step computes experts on the host");
    float *zh = host_moe_, *aggh = host_moe_ + R * latent, *wth = aggh + R * latent;
    auto* idxh = reinterpret_cast<int32_t*>(wth + R * K);
    cu::d2h(idxh, idx, size_t(R * K) * 4, stream_);
    cu::d2h(wth, wt, size_t(R * K) * 4, stream_);
    cu::d2h(zh, z, size_t(R * latent) * 4, stream_);
    if (HotCache* hc = hot_cache(w, R, K, idxh, source))
      return routed_hot(w, *hc, latent, situ, z, zh, idxh, wt, wth, R, K, agg);
    const bool prefill = !source && R > cu::kGemvMaxT && view_.n_seqs == 1;
    const int64_t M = prefill ? distinct_experts(w, idxh, R * K) : 0;
    if (prefill && stream_this_prefill(M, R * K)) {
      stream_buffers(w.experts.front(), int64_t(w.experts.size()));  // (allocated once, outside the timing)
      const auto t0 = std::chrono::steady_clock::now();
      routed_streamed(w, latent, situ, z, idxh, wt, R, K, agg);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (prefill_rates_.gpu_s_per_expert == 0) prefill_rates_.gpu_s_per_expert = s / double(M);
      ++prefill_rates_.streamed;
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    cpu_->moe_routed(w, latent, situ, zh, idxh, wth, R, K, aggh, source);
    if (prefill) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (prefill_rates_.cpu_s_per_pair == 0) prefill_rates_.cpu_s_per_pair = s / double(R * K);
      ++prefill_rates_.on_cpu;
    }
    cu::h2d(agg, aggh, size_t(R * latent) * 4, stream_);  // aggh is next written after the next d2h's sync
  }

  // ---- streamed prefill experts (GpuOptions::prefill_experts, with experts_on_cpu)
  // A one-sequence step of more rows than the decode GEMVs take may compute its routed experts on
  // the GPU instead: the experts it selects are copied from host memory into two staging buffers in
  // turn (a group of experts each) while the GPU computes the previous group, with the kernels and
  // tiles of the all-on-GPU prefill (so the same bits as all on the GPU). Auto: the first such layer
  // streams, the next runs on the CPU, each timed; from then on each layer takes the one the two
  // measured rates say is faster for its distinct experts (streaming: per expert) and its rows
  // (the CPU: per row and expert).
  struct PrefillRates {
    double gpu_s_per_expert = 0, cpu_s_per_pair = 0;  // 0: not measured yet
    int64_t streamed = 0, on_cpu = 0;                 // layers of prefill steps each way
  } prefill_rates_;
  bool stream_this_prefill(int64_t M, int64_t pairs) const {
    using PE = GpuOptions::PrefillExperts;
    if (opt_.prefill_experts != PE::Auto) return opt_.prefill_experts == PE::Gpu;
    const PrefillRates& r = prefill_rates_;
    if (r.gpu_s_per_expert == 0) return true;
    if (r.cpu_s_per_pair == 0) return false;
    return r.gpu_s_per_expert * double(M) < r.cpu_s_per_pair * double(pairs);
  }
  static int64_t distinct_experts(const MoeWeights& w, const int32_t* idxh, int64_t n) {
    std::vector<uint8_t> seen(w.experts.size(), 0);
    int64_t M = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = idxh[i];
      if (e < 0 || e >= int64_t(seen.size())) fail("GPU MoE: router selected expert " + std::to_string(e));
      M += !seen[size_t(e)];
      seen[size_t(e)] = 1;
    }
    return M;
  }

  struct StreamBuf {
    cu::DevBuf dev;
    char* pinned = nullptr;
    GluWeights stack;                 // [cap experts] stacks in dev
    std::vector<GluWeights> experts;  // views of the stacks
    cu::Event uploaded, consumed;     // the group's copy done (copy stream) / its kernels done (main stream)
  };
  StreamBuf sbuf_[2];
  cu::Stream copy_stream_ = nullptr;
  int64_t sbuf_cap_ = 0;  // experts per staging buffer
  ExpertStacks slayout_;  // the staging buffers' layout (sbuf_cap_ experts)

  // Sizes the two staging buffers for experts shaped like f: as many experts as
  // stream_staging_bytes holds, at most the layer's E, at least one.
  void stream_buffers(const GluWeights& f, int64_t E) {
    if (sbuf_cap_ > 0) return;
    const size_t per = data_bytes(f.gate) + scale_bytes(f.gate) + data_bytes(f.up) + scale_bytes(f.up) +
                       data_bytes(f.down) + scale_bytes(f.down);
    sbuf_cap_ = int64_t(stream_staging_plan(opt_, E, per) / (2 * per));  // (the memory plan's count)
    if (sbuf_cap_ < 1) fail("internal error: no streamed-expert staging for this step");
    slayout_ = ExpertStacks(f, sbuf_cap_);
    copy_stream_ = cu::stream_create();
    for (StreamBuf& b : sbuf_) {
      b.dev = cu::DevBuf(slayout_.bytes, "streamed prefill experts");
      b.pinned = static_cast<char*>(cu::host_alloc_pinned(slayout_.bytes));
      b.stack = slayout_.at(b.dev.as<char>());
      b.experts = slayout_.experts(b.stack);
    }
  }

  // Copies experts ids[0..n) of w into staging buffer b (through its pinned twin, on the copy
  // stream, after the buffer's previous group's kernels), and records b.uploaded.
  void stream_fill(StreamBuf& b, const MoeWeights& w, const int32_t* ids, int64_t n) {
    b.uploaded.sync();  // the pinned twin's previous copy is done
    const GluWeights& f = slayout_.one;
    const WeightMat* shape[3] = {&f.gate, &f.up, &f.down};
    for (int64_t i = 0; i < n; ++i) {
      const GluWeights& g = w.experts[size_t(ids[i])];
      const WeightMat* from[3] = {&g.gate, &g.up, &g.down};
      for (int j = 0; j < 3; ++j) {
        if (from[j]->fmt != shape[j]->fmt || from[j]->rows != shape[j]->rows || from[j]->cols != shape[j]->cols)
          fail("GPU MoE: routed experts of one layer differ in format or shape");
        const size_t db = data_bytes(*shape[j]), sb = scale_bytes(*shape[j]);
        std::memcpy(b.pinned + slayout_.data[j] + size_t(i) * db, from[j]->data, db);
        if (sb) std::memcpy(b.pinned + slayout_.scales[j] + size_t(i) * sb, from[j]->scales, sb);
      }
    }
    b.consumed.make_wait(copy_stream_);
    for (int j = 0; j < 3; ++j) {
      const size_t db = data_bytes(*shape[j]) * size_t(n), sb = scale_bytes(*shape[j]) * size_t(n);
      cu::h2d(b.dev.as<char>() + slayout_.data[j], b.pinned + slayout_.data[j], db, copy_stream_);
      if (sb) cu::h2d(b.dev.as<char>() + slayout_.scales[j], b.pinned + slayout_.scales[j], sb, copy_stream_);
    }
    b.uploaded.record(copy_stream_);
  }

  // The routed sum of a prefill step with the experts streamed from host memory (see above): rows
  // grouped by expert as routed_grouped does, then per group of staged experts their gate and up,
  // SiTU and down over the group's rows (contiguous: the slots are sorted by expert), the next
  // group's copy in flight meanwhile; then the scatter and the weighted sum.
  void routed_streamed(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z,
                       const int32_t* sel, const float* wt, int64_t T, int64_t K, float* agg) {
    const int64_t E = int64_t(w.experts.size()), I = w.experts.front().gate.rows;
    stream_buffers(w.experts.front(), E);
    const std::vector<int64_t> count = slots_by_expert(sel, T, K, E);
    int32_t* rows = rows_pinned_;
    std::vector<int32_t> order;  // the selected experts, ascending
    for (int64_t e = 0; e < E; ++e)
      if (count[size_t(e) + 1] > count[size_t(e)]) order.push_back(int32_t(e));
    const int64_t M = int64_t(order.size()), groups = (M + sbuf_cap_ - 1) / sbuf_cap_;
    const StreamBuf& b0 = sbuf_[0];
    const bool tc = p_ == cu::Precision::BF16 && cu::expert_gemm_grouped_ok(b0.stack.gate, I) &&
                    cu::expert_gemm_grouped_ok(b0.stack.up, I) && cu::expert_gemm_grouped_ok(b0.stack.down, latent);
    // Tiles of every group (expert = its place in the group's buffer), uploaded with the row lists.
    auto* tiles = reinterpret_cast<cu::ExpertTile*>(rows + 2 * T * K);
    std::vector<int64_t> tile0(size_t(groups) + 1, 0);
    int64_t n_tiles = 0;
    for (int64_t g = 0; g < groups; ++g) {
      tile0[size_t(g)] = n_tiles;
      for (int64_t i = g * sbuf_cap_; i < std::min(M, (g + 1) * sbuf_cap_); ++i) {
        const int32_t e = order[size_t(i)];
        add_tiles(tiles, n_tiles, i - g * sbuf_cap_, count[size_t(e)], count[size_t(e) + 1]);
      }
    }
    tile0[size_t(groups)] = n_tiles;
    if (n_tiles > max_tiles_) fail("internal error: more expert tiles than the row lists hold");
    int32_t* rows_dev = rows_dev_.as<int32_t>();
    cu::h2d(rows_dev, rows, size_t(2 * T * K) * 4 + size_t(n_tiles) * sizeof(cu::ExpertTile), stream_);
    const auto* tiles_dev = reinterpret_cast<const cu::ExpertTile*>(rows_dev + 2 * T * K);
    float *hg = moe_buf_.as<float>(), *hu = hg + T * K * I, *ye = hu + T * K * I, *xg = ye + T * K * latent,
          *yg = xg + T * K * latent;
    cu::gather_rows(z, rows_dev, T * K, latent, xg, stream_);
    stream_fill(sbuf_[0], w, order.data(), std::min(M, sbuf_cap_));
    for (int64_t g = 0; g < groups; ++g) {
      StreamBuf& b = sbuf_[g % 2];
      const int64_t i0 = g * sbuf_cap_, n = std::min(M, i0 + sbuf_cap_) - i0;
      const int64_t o0 = count[size_t(order[size_t(i0)])], o1 = count[size_t(order[size_t(i0 + n - 1)]) + 1];
      b.uploaded.make_wait(stream_);
      if (tc) {
        const WeightMat* gu[2] = {&b.stack.gate, &b.stack.up};
        float* gu_out[2] = {hg, hu};
        const int64_t nt = tile0[size_t(g) + 1] - tile0[size_t(g)];
        cu::expert_gemm_grouped(gu, gu_out, 2, I, tiles_dev + tile0[size_t(g)], nt, xg, stream_);
        cu::situ_glu(hg + o0 * I, hu + o0 * I, (o1 - o0) * I, situ.beta, situ.linear_beta, hg + o0 * I, stream_);
        const WeightMat* dn[1] = {&b.stack.down};
        float* dn_out[1] = {yg};
        cu::expert_gemm_grouped(dn, dn_out, 1, latent, tiles_dev + tile0[size_t(g)], nt, hg, stream_);
      } else {
        per_expert_glu(n, latent, I, situ, o0, o1, xg, hg, hu, yg, [&](int64_t i) {
          const int32_t e = order[size_t(i0 + i)];
          return ExpertRows{&b.experts[size_t(i)], count[size_t(e)], count[size_t(e) + 1] - count[size_t(e)]};
        });
      }
      b.consumed.record(stream_);
      if (g + 1 < groups)  // the next group's copy, while this one computes
        stream_fill(sbuf_[(g + 1) % 2], w, order.data() + (g + 1) * sbuf_cap_, std::min(M, (g + 2) * sbuf_cap_) - (g + 1) * sbuf_cap_);
    }
    cu::scatter_rows(yg, rows_dev + T * K, T * K, latent, ye, stream_);
    cu::moe_combine(ye, wt, T, K, latent, agg, stream_);
    cu::sync(stream_);  // the pinned row lists are rewritten by the next layer
  }

  // ---- the GPU's cache of hot experts (GpuOptions::hot_experts, with experts_on_cpu)
  struct HotCache {
    std::vector<int64_t> counts;  // [E] routed slots per expert during the warm-up
    int64_t tokens = 0;           // tokens counted
    bool filled = false;
    cu::DevBuf arena;             // the cached experts' stacks
    GluWeights stack;
    int64_t cached = 0;
    std::vector<int32_t> slot_of;  // [E] position in the stacks, or -1
    std::vector<uint8_t> on_gpu;   // [E]
    MoeWeights cpu_view;           // the layer's weights with on_gpu as MoeWeights::elsewhere
    int64_t slots = 0, hits = 0;   // since the fill
  };
  // Counts the routing until the layer's warm-up is over, then fills its cache (the most often routed
  // experts, ties to the lower id). The cache to use for this step, or null: none, not filled yet,
  // nothing cached, an expert source (the experts are not host views), or a step of more rows than
  // the decode GEMVs take (prefill: its rows all go to the CPU, grouped by expert there).
  HotCache* hot_cache(const MoeWeights& w, int64_t R, int64_t K, const int32_t* idxh, ExpertSource* source) {
    if (opt_.hot_experts == 0 || source != nullptr) return nullptr;
    HotCache& hc = hot_[&w];
    const int64_t E = int64_t(w.experts.size());
    if (!hc.filled) {
      hc.counts.resize(size_t(E), 0);
      for (int64_t i = 0; i < R * K; ++i) {
        const int32_t e = idxh[i];
        if (e < 0 || e >= E) fail("GPU MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(E));
        ++hc.counts[size_t(e)];
      }
      hc.tokens += R;
      if (hc.tokens < opt_.hot_warmup_tokens) return nullptr;
      fill_hot(w, hc);
    }
    return hc.cached > 0 && R <= cu::kGemvMaxT ? &hc : nullptr;
  }

  void fill_hot(const MoeWeights& w, HotCache& hc) {
    const int64_t E = int64_t(w.experts.size());
    const GluWeights& f = w.experts.front();
    const size_t per = data_bytes(f.gate) + scale_bytes(f.gate) + data_bytes(f.up) + scale_bytes(f.up) +
                       data_bytes(f.down) + scale_bytes(f.down) + 3 * 256;
    int64_t C = 0;
    if (opt_.hot_experts > 0) {
      C = std::clamp<int64_t>(int64_t(std::llround(opt_.hot_experts * double(E))), 0, E);
    } else {  // auto: the free memory but 1 GiB, shared evenly by the layers not filled yet
      int64_t unfilled = 0;
      for (const auto& [lw, c] : hot_) unfilled += !c.filled;
      unfilled = std::max<int64_t>(unfilled, moe_layers_ - filled_layers());
      const size_t free_b = cu::device_info().free_bytes, reserve = size_t(1) << 30;
      const size_t budget = free_b > reserve ? (free_b - reserve) / size_t(std::max<int64_t>(unfilled, 1)) : 0;
      C = std::min<int64_t>(E, int64_t(budget / per));
    }
    hc.slot_of.assign(size_t(E), -1);
    hc.on_gpu.assign(size_t(E), 0);
    hc.filled = true;
    hc.cached = C;
    if (C == 0) return;
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return hc.counts[size_t(a)] > hc.counts[size_t(b)]; });
    order.resize(size_t(C));
    std::sort(order.begin(), order.end());  // the stacks in ascending expert id
    std::vector<const WeightMat*> g, u, d;
    for (size_t i = 0; i < order.size(); ++i) {
      const GluWeights& ew = w.experts[size_t(order[i])];
      g.push_back(&ew.gate), u.push_back(&ew.up), d.push_back(&ew.down);
      hc.slot_of[size_t(order[i])] = int32_t(i);
      hc.on_gpu[size_t(order[i])] = 1;
    }
    Uploader sizing(nullptr);
    sizing.stack(g), sizing.stack(u), sizing.stack(d);
    cu::sync(stream_);
    hc.arena = cu::DevBuf(sizing.used() + 256, "hot-expert cache");
    Uploader up(hc.arena.as<char>());
    hc.stack = {up.stack(g), up.stack(u), up.stack(d)};
    cu::sync();
    hc.cpu_view = w;
    hc.cpu_view.elsewhere = hc.on_gpu.data();
  }
  int64_t filled_layers() const {
    int64_t n = 0;
    for (const auto& [lw, c] : hot_) n += c.filled;
    return n;
  }

  // A decode step with a filled cache: the cached experts' slots run on the GPU (GEMV kernels, ids
  // mapped onto the cache's stacks, the others -1 and skipped) while the CPU computes the other slots
  // into host terms; those come over, the GPU's rows replace the cached slots', and the GPU sums each
  // row's terms in top-k slot order (moe_combine).
  void routed_hot(const MoeWeights& w, HotCache& hc, int64_t latent, const SituParams& situ, const float* z,
                  const float* zh, const int32_t* idxh, const float* wt, const float* wth, int64_t R, int64_t K,
                  float* agg) {
    const int64_t n = R * K, I = w.experts.front().gate.rows;
    hot_ids_host_.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      hot_ids_host_[size_t(i)] = hc.slot_of[size_t(idxh[i])];
      hc.hits += hot_ids_host_[size_t(i)] >= 0;
    }
    hc.slots += n;
    const int32_t* ids = hot_ids_dev_.as<int32_t>();
    cu::h2d(hot_ids_dev_.get(), hot_ids_host_.data(), size_t(n) * 4, stream_);
    float *tg = moe_buf_.as<float>() + 2 * n * I, *td = tg + n * latent;
    expert_slots(hc.stack, I, latent, situ, ids, n, z, K, tg);
    // Meanwhile, on the host: every slot of an expert that is not cached.
    cpu_->moe_routed(hc.cpu_view, latent, situ, zh, idxh, wth, R, K, host_terms_, nullptr, host_terms_);
    cu::h2d(td, host_terms_, size_t(n * latent) * 4, stream_);
    cu::copy_rows_where(tg, ids, n, latent, td, stream_);
    cu::moe_combine(td, wt, R, K, latent, agg, stream_);
    cu::sync(stream_);  // host_terms_ and hot_ids_host_ are rewritten by the next layer
  }

  // Experts from a source (streamed from disk into host memory): the experts the step's rows
  // select are fetched (each once, ascending), uploaded into a staging stack and the ids remapped
  // onto it; then the resident path runs on the staged copies: same kernels on the same bytes,
  // so the same results as all-resident.
  void routed_from_source(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z,
                          const int32_t* idx, const float* wt, int64_t R, int64_t K, float* agg, ExpertSource& src) {
    if (capturing_) fail("internal error: a recorded GPU step fetches experts");
    const int64_t E = int64_t(w.experts.size());
    std::vector<int32_t> sel(size_t(R * K));
    cu::d2h(sel.data(), idx, sel.size() * 4, stream_);
    std::vector<int32_t> slot_of(size_t(E), -1), order;
    for (int32_t e : sel) {
      if (e < 0 || e >= E) fail("GPU MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(E));
      slot_of[size_t(e)] = 0;
    }
    for (int64_t e = 0; e < E; ++e)
      if (slot_of[size_t(e)] == 0) {
        slot_of[size_t(e)] = int32_t(order.size());
        order.push_back(int32_t(e));
      }
    const int64_t M = int64_t(order.size());
    const GluWeights& f = w.experts.front();  // formats and shapes (the host views)
    stage(f, M);
    const int64_t batch = std::max<int64_t>(1, src.max_batch());
    std::vector<const GluWeights*> got(size_t(std::min(batch, M)));
    for (int64_t b = 0; b < M; b += batch) {
      const int64_t n = std::min(batch, M - b);
      src.fetch(w.layer, order.data() + b, n, got.data());
      for (int64_t i = 0; i < n; ++i) {
        const GluWeights& g = *got[size_t(i)];
        const WeightMat* from[3] = {&g.gate, &g.up, &g.down};
        WeightMat* to[3] = {&staged_.experts[size_t(b + i)].gate, &staged_.experts[size_t(b + i)].up,
                            &staged_.experts[size_t(b + i)].down};
        for (int j = 0; j < 3; ++j) {
          if (from[j]->fmt != to[j]->fmt || from[j]->rows != to[j]->rows || from[j]->cols != to[j]->cols)
            fail("GPU MoE: a fetched expert differs in format or shape from the layer's experts");
          cu::h2d(const_cast<void*>(to[j]->data), from[j]->data, data_bytes(*from[j]), stream_);
          if (from[j]->fmt == WFormat::MXFP4)
            cu::h2d(const_cast<uint8_t*>(to[j]->scales), from[j]->scales, scale_bytes(*from[j]), stream_);
        }
      }
      cu::sync(stream_);  // the fetched host copies are valid until the next fetch only
    }
    for (int32_t& e : sel) e = slot_of[size_t(e)];
    cu::h2d(remap_.get(), sel.data(), sel.size() * 4, stream_);
    staged_.stacked = {rows_of(stage_.gate, 0, M * f.gate.rows), rows_of(stage_.up, 0, M * f.up.rows),
                       rows_of(stage_.down, 0, M * f.down.rows)};
    MoeWeights view = staged_;
    view.experts.resize(size_t(M));
    routed(view, latent, situ, z, remap_.as<int32_t>(), wt, R, K, agg);
    cu::sync(stream_);
  }

  // A staging stack for M experts shaped like `f` (grown when needed).
  void stage(const GluWeights& f, int64_t M) {
    const int64_t K = std::max<int64_t>(d_.moe.top_k, 1),
                  cap = std::min<int64_t>(opt_.tokens_per_call * K, d_.moe.experts);
    if (!stage_buf_ || stage_shape_.gate.fmt != f.gate.fmt || stage_shape_.gate.rows != f.gate.rows ||
        stage_shape_.down.fmt != f.down.fmt) {
      const ExpertStacks layout(f, cap);
      stage_buf_ = cu::DevBuf(layout.bytes, "streamed-expert staging");
      remap_ = cu::DevBuf(size_t(opt_.tokens_per_call * K) * 4, "streamed-expert ids");
      stage_ = layout.at(stage_buf_.as<char>());
      stage_shape_ = f;
      staged_.experts = layout.experts(stage_);
    }
    if (M > int64_t(staged_.experts.size())) fail("internal error: more streamed experts than the staging holds");
  }

  void argmax_rows(const float* logits, int64_t R, int64_t V, int32_t* out) override {
    if (R > opt_.tokens_per_call) fail("internal error: argmax of more rows than a step has");
    cu::argmax_rows(logits, R, V, argmax_dev_.as<int32_t>(), stream_);
    cu::d2h(out, argmax_dev_.get(), size_t(R) * 4, stream_);
  }

 private:
  // A step's rows by sequence: runs of consecutive sequences of one class. Short chunks (<= kGemvMaxT
  // rows) compute with fp32 activations alone (GEMV kernels), so together they do too (GEMVs of at
  // most kGemvMaxT rows); longer chunks use the step's precision (bf16 tensor cores, or the fp32
  // GEMM in parity mode).
  struct Run {
    int64_t r0, n;
    bool big;
  };
  const std::vector<Run>& runs(int64_t R, const int32_t* groups, int64_t ng) {
    runs_.clear();
    const int32_t one[2] = {0, int32_t(R)};
    if (!groups) {
      const bool step = R == view_.rows && !view_cu_.empty();
      groups = step ? view_cu_.data() : one;
      ng = step ? int64_t(view_cu_.size()) - 1 : 1;
    }
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t r0 = groups[g], n = groups[g + 1] - r0;
      if (n <= 0) continue;
      const bool big = n > cu::kGemvMaxT;
      if (!runs_.empty() && !big && !runs_.back().big && runs_.back().r0 + runs_.back().n == r0)
        runs_.back().n += n;
      else
        runs_.push_back({r0, n, big});
    }
    return runs_;
  }
  // rows: decode rows of short sequences (GEMV kernels, fp32 activations), else a chunk's GEMM.
  void product(const WeightMat& W, const float* x, int64_t n, float* y, cu::Precision p, bool rows) {
    if (rows)
      cu::gemv_rows(W, x, n, y, stream_);
    else
      cu::matmul(W, x, n, y, p, stream_);
  }
  // A run whose dense products take the step's precision as one product (a long chunk; or, in bf16,
  // more decode rows than one wide GEMV holds: the tensor cores read the weights once for all of
  // them, where GEMV pieces would read them once per piece and run compute-bound; those rows then
  // have bf16 activations in the products, as a prefill chunk's rows do). --numerics fp32 keeps
  // fp32 activations on decode rows at any batch.
  bool one_product(const Run& r) const { return r.big || (p_ == cu::Precision::BF16 && r.n > cu::kGemvWideT); }
  template <class Fn>
  void by_runs(int64_t R, const int32_t* groups, int64_t ng, bool wide, Fn&& fn) {
    for (const Run& r : runs(R, groups, ng)) {
      if (one_product(r)) {
        fn(r.r0, r.n, p_, false);
        continue;
      }
      for (const auto& [a, k] : decode_pieces(r, wide)) fn(a, k, p_, true);
    }
  }
  // Short sequences together (decode rows): GEMVs of at most kGemvMaxT rows in equal pieces, fp32
  // activations as each row has alone. The weights are read once per piece; the fp32 SIMT GEMM
  // that more rows would take is latency-bound at these shapes (a 32-sequence decode step took
  // 78 ms on the H200 against 1.6 ms for one sequence). Where the weights allow (not MXFP4),
  // pieces of kGemvWideT rows first: half the reads.
  static std::vector<std::pair<int64_t, int64_t>> decode_pieces(const Run& r, bool wide) {
    std::vector<std::pair<int64_t, int64_t>> out;
    int64_t at = r.r0, left = r.n;
    if (wide)
      for (; left >= cu::kGemvWideT; at += cu::kGemvWideT, left -= cu::kGemvWideT) out.emplace_back(at, cu::kGemvWideT);
    const int64_t pieces = (left + cu::kGemvMaxT - 1) / cu::kGemvMaxT;
    for (int64_t i = 0; i < pieces; ++i) {
      const int64_t a = at + left * i / pieces, b = at + left * (i + 1) / pieces;
      out.emplace_back(a, b - a);
    }
    return out;
  }
  // y[i] = W[i] · x[i] for n weights: long chunks one product each; decode rows by piece, the
  // pieces of all weights with the same piece shape in one batched GEMV launch per format (a
  // sublayer's projections of one input become one launch; same bits as one GEMV each).
  void products(const WeightMat* const* W, const float* const* x, int64_t n, int64_t R, float* const* y,
                const bool* fp32) {
    for (const Run& r : runs(R, nullptr, 0)) {
      if (one_product(r)) {
        for (int64_t i = 0; i < n; ++i)
          product(*W[i], x[i] + r.r0 * W[i]->cols, r.n, y[i] + r.r0 * W[i]->rows,
                  fp32 && fp32[i] ? cu::Precision::F32 : p_, false);
        continue;
      }
      for (const bool wide : {true, false}) {
        jobs_.clear();
        for (int64_t i = 0; i < n; ++i)
          if (cu::gemv_wide_ok(*W[i]) == wide) jobs_.push_back({W[i], nullptr, nullptr});
        if (jobs_.empty()) continue;
        for (const auto& [a, k] : decode_pieces(r, wide)) {
          size_t j = 0;
          for (int64_t i = 0; i < n; ++i)
            if (cu::gemv_wide_ok(*W[i]) == wide) jobs_[j++] = {W[i], x[i] + a * W[i]->cols, y[i] + a * W[i]->rows};
          cu::gemv_batch(jobs_.data(), int64_t(jobs_.size()), k, stream_);
        }
      }
    }
  }

  // agg[n] = Σ_j wt · GLU_{idx}(z) by per-slot GEMVs (device ids).
  void routed_gemv(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                   const float* wt, int64_t n, int64_t K, float* agg) {
    const int64_t I = w.experts.front().gate.rows, N = n * K;
    float* ye = moe_buf_.as<float>() + 2 * N * I;
    const GluWeights& st = w.stacked;
    // Many sequences' slots (enough that experts repeat: 4 N >= the model's E; the model's, not the
    // view's, so a staged view of a layer's experts takes the path the resident layer takes):
    // grouped by expert on the device, each chosen expert's weights read once per step.
    if (n >= 2 && 4 * N >= d_.moe.experts && cu::expert_grouped_ok(st.gate, st.up, st.down, I, N, z, moe_buf_.as<float>())) {
      auto* sorted = rows_dev_.as<int32_t>();  // [N] sorted slots, the tile count, then from 2N the tiles
      cu::expert_ffn_grouped(st.gate, st.up, st.down, I, idx, N, z, K, situ.beta, situ.linear_beta,
                             moe_buf_.as<float>(), ye, sorted, reinterpret_cast<cu::ExpertTile*>(sorted + 2 * N),
                             sorted + N, stream_);
    } else {
      expert_slots(st, I, latent, situ, idx, N, z, K, ye);
    }
    cu::moe_combine(ye, wt, n, K, latent, agg, stream_);
  }

  // Each slot's expert output, unweighted, through the decode kernels: slot i is row i / K of z and
  // expert ids[i] of `stack` (-1: skipped, y's row left as it is); the GLU (gate, up and SiTU in one
  // kernel when the two stacks share a shape), then down into y [n, latent]. Scratch: the first
  // 2 n I floats of moe_buf_ (y must lie past them).
  void expert_slots(const GluWeights& stack, int64_t I, int64_t latent, const SituParams& situ, const int32_t* ids,
                    int64_t n, const float* z, int64_t K, float* y) {
    float *hg = moe_buf_.as<float>(), *hu = hg + n * I;
    const WeightMat &G = stack.gate, &U = stack.up;
    if (G.fmt == U.fmt && G.rows == U.rows && G.cols == U.cols) {
      cu::expert_glu(G, U, I, ids, n, z, K, situ.beta, situ.linear_beta, hg, stream_);
    } else {
      cu::expert_matmul(G, I, ids, n, z, K, hg, cu::Precision::F32, stream_);
      cu::expert_matmul(U, I, ids, n, z, K, hu, cu::Precision::F32, stream_);
      cu::situ_glu(hg, hu, n * I, situ.beta, situ.linear_beta, hg, stream_);
    }
    cu::expert_matmul(stack.down, latent, ids, n, hg, 1, y, cu::Precision::F32, stream_);
  }

  // A rank of an expert-parallel split (model/layers.cpp): each slot's output of this rank's experts,
  // unweighted, into terms[slot]; the router's ids are mapped onto this rank's stack on the host, the
  // others' to -1, which the expert kernels skip (those slots are NaN here and come from their
  // ranks). Every row through the GEMV kernels, as decode rows run (a prefill chunk's grouped GEMM is
  // not used here: its rows then differ from one GPU's at rounding level).
  void routed_terms(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                    int64_t R, int64_t K, float* terms) {
    if (cpu_ || capturing_) fail("internal error: an expert-parallel step on the host's experts or in a graph");
    if (w.stacked.gate.empty()) fail("the routed experts were not uploaded to the GPU: expert parallel needs them");
    const int64_t n = R * K, b = w.local_begin, e = w.local_end < 0 ? int64_t(w.experts.size()) : w.local_end;
    ep_ids_host_.resize(size_t(n));
    cu::d2h(ep_ids_host_.data(), idx, size_t(n) * 4, stream_);
    for (int32_t& id : ep_ids_host_) id = (id >= b && id < e) ? int32_t(id - b) : -1;
    if (!ep_ids_) ep_ids_ = cu::DevBuf(size_t(opt_.tokens_per_call * K) * 4, "expert-parallel ids");
    cu::h2d(ep_ids_.get(), ep_ids_host_.data(), size_t(n) * 4, stream_);
    const int32_t* ids = ep_ids_.as<int32_t>();
    expert_slots(w.stacked, w.stacked.gate.rows / (e - b), latent, situ, ids, n, z, K, terms);
  }

  // The same for one sequence's chunk, grouped by expert on the host: each selected expert is one
  // GEMM over its rows (tensor cores in bf16). Every slot's output lands in its own row, so the
  // combine (and its summation order) is the GEMV path's.
  // A step's T x K routing slots sorted by expert (a counting sort; ids checked against E): the
  // pinned row lists get [T*K] token rows (gather) then [T*K] slot rows (scatter), and the result
  // is each expert's first sorted slot (E + 1 entries, the last T*K).
  std::vector<int64_t> slots_by_expert(const int32_t* sel, int64_t T, int64_t K, int64_t E) {
    std::vector<int64_t> count(size_t(E) + 1, 0);
    for (int64_t i = 0; i < T * K; ++i) {
      const int32_t e = sel[i];
      if (e < 0 || e >= E) fail("GPU MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(E));
      ++count[size_t(e) + 1];
    }
    for (size_t e = 1; e < count.size(); ++e) count[e] += count[e - 1];
    int32_t* rows = rows_pinned_;
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t slot = 0; slot < T * K; ++slot) {
      const int64_t at = fill[size_t(sel[slot])]++;
      rows[at] = int32_t(slot / K);
      rows[T * K + at] = int32_t(slot);
    }
    return count;
  }
  // The grouped GEMM's tiles of one expert's sorted slots [o0, o1): pieces of kExpertTileRows,
  // `expert` being its index in the stack the kernel reads.
  static void add_tiles(cu::ExpertTile* tiles, int64_t& n, int64_t expert, int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o += cu::kExpertTileRows)
      tiles[n++] = {int32_t(expert), int32_t(o), int32_t(std::min<int64_t>(cu::kExpertTileRows, o1 - o))};
  }

  void routed_grouped(const MoeWeights& w, int64_t latent, const SituParams& situ, const float* z, const int32_t* idx,
                      const float* wt, int64_t T, int64_t K, float* agg) {
    if (capturing_) fail("internal error: a recorded GPU step groups experts on the host");
    const int64_t E = int64_t(w.experts.size()), I = w.experts.front().gate.rows;
    std::vector<int32_t> sel(size_t(T * K));
    cu::d2h(sel.data(), idx, sel.size() * 4, stream_);
    const std::vector<int64_t> count = slots_by_expert(sel.data(), T, K, E);
    int32_t* rows = rows_pinned_;
    int32_t* rows_dev = rows_dev_.as<int32_t>();
    float *hg = moe_buf_.as<float>(), *hu = hg + T * K * I, *ye = hu + T * K * I, *xg = ye + T * K * latent,
          *yg = xg + T * K * latent;
    const GluWeights& st = w.stacked;
    if (p_ == cu::Precision::BF16 && cu::expert_gemm_grouped_ok(st.gate, I) && cu::expert_gemm_grouped_ok(st.up, I) &&
        cu::expert_gemm_grouped_ok(st.down, latent) && st.gate.rows == E * I && st.down.rows == E * latent) {
      // One launch for every expert's gate and up, one for the downs (tiles of up to 64 rows each).
      auto* tiles = reinterpret_cast<cu::ExpertTile*>(rows + 2 * T * K);
      int64_t n_tiles = 0;
      for (int64_t e = 0; e < E; ++e) add_tiles(tiles, n_tiles, e, count[size_t(e)], count[size_t(e) + 1]);
      if (n_tiles > max_tiles_) fail("internal error: more expert tiles than the row lists hold");
      cu::h2d(rows_dev, rows, size_t(2 * T * K) * 4 + size_t(n_tiles) * sizeof(cu::ExpertTile), stream_);
      const auto* tiles_dev = reinterpret_cast<const cu::ExpertTile*>(rows_dev + 2 * T * K);
      cu::gather_rows(z, rows_dev, T * K, latent, xg, stream_);
      const WeightMat* gu[2] = {&st.gate, &st.up};
      float* gu_out[2] = {hg, hu};
      cu::expert_gemm_grouped(gu, gu_out, 2, I, tiles_dev, n_tiles, xg, stream_);
      cu::situ_glu(hg, hu, T * K * I, situ.beta, situ.linear_beta, hg, stream_);
      const WeightMat* dn[1] = {&st.down};
      float* dn_out[1] = {yg};
      cu::expert_gemm_grouped(dn, dn_out, 1, latent, tiles_dev, n_tiles, hg, stream_);
    } else {
      cu::h2d(rows_dev, rows, size_t(2 * T * K) * 4, stream_);
      cu::gather_rows(z, rows_dev, T * K, latent, xg, stream_);
      per_expert_glu(E, latent, I, situ, 0, count.back(), xg, hg, hu, yg, [&](int64_t e) {
        return ExpertRows{&w.experts[size_t(e)], count[size_t(e)], count[size_t(e) + 1] - count[size_t(e)]};
      });
    }
    cu::scatter_rows(yg, rows_dev + T * K, T * K, latent, ye, stream_);
    cu::moe_combine(ye, wt, T, K, latent, agg, stream_);
    cu::sync(stream_);  // the pinned row lists are rewritten by the next layer
  }

  // The grouped experts one matmul per expert and matrix (fp32 parity mode, BF16 or unaligned
  // stacks), for routed_grouped and routed_streamed: expert i of n (at(i): its weights and its rows
  // [o, o + k) of the slots sorted by expert, which lie within [o0, o1)) gate and up, then SiTU over
  // the rows [o0, o1), then the downs.
  struct ExpertRows {
    const GluWeights* w;
    int64_t o, k;
  };
  template <class At>
  void per_expert_glu(int64_t n, int64_t latent, int64_t I, const SituParams& situ, int64_t o0, int64_t o1,
                      const float* xg, float* hg, float* hu, float* yg, At at) {
    for (int64_t i = 0; i < n; ++i) {
      const ExpertRows x = at(i);
      if (x.k == 0) continue;
      cu::matmul(x.w->gate, xg + x.o * latent, x.k, hg + x.o * I, p_, stream_);
      cu::matmul(x.w->up, xg + x.o * latent, x.k, hu + x.o * I, p_, stream_);
    }
    cu::situ_glu(hg + o0 * I, hu + o0 * I, (o1 - o0) * I, situ.beta, situ.linear_beta, hg + o0 * I, stream_);
    for (int64_t i = 0; i < n; ++i) {
      const ExpertRows x = at(i);
      if (x.k) cu::matmul(x.w->down, hg + x.o * I, x.k, yg + x.o * latent, p_, stream_);
    }
  }

  struct GraphKey {
    int64_t n_seqs = -1, rows = -1;
    int precision = -1;
    const void* pool = nullptr;
    uint64_t epoch = 0;
    int64_t table_stride = 0;
    uint64_t buffers = 0;
    bool operator==(const GraphKey&) const = default;
  };

  ModelDims d_;
  GpuOptions opt_;
  cu::Stream stream_ = nullptr;
  // A rank of a model split over processes: its group's NCCL communicator (join_group), else null.
  cu::NcclComm* nccl_ = nullptr;
  int nccl_ranks_ = 1, nccl_rank_ = 0;
  cu::DevBuf arena_, moe_buf_, rows_dev_, mla_work_, ids_dev_, seq_dev_, argmax_dev_, table_dev_;
  cu::DevBuf ep_ids_;                  // routed_terms: the step's ids on this rank's expert stack
  std::vector<int32_t> ep_ids_host_;
  cu::DevBuf kda_work_;  // kda_chunked_tc_varlen's records
  cu::DevBuf mla_tc_work_, mla_skip_dev_;  // mla_attend_tc_paged's workspace; the absorbed kernel's skip flags
  int64_t mla_tc_chunk_ = 0, mla_tc_seqs_ = 0;
  std::vector<uint8_t> mla_tc_use_;
  std::vector<int64_t> view_pos0_;
  int64_t kda_work_chunks_ = 0;
  int64_t moe_floats_ = 0, table_stride_ = 0, table_seqs_ = 0, table_cap_ = 0, max_tiles_ = 0;
  uint64_t buffers_ = 0;
  int32_t *staging_ = nullptr, *table_pinned_ = nullptr, *rows_pinned_ = nullptr;
  cu::Precision p_ = cu::Precision::BF16;
  StepView view_;
  std::vector<int32_t> view_cu_;
  cu::VarlenDev vb_;
  cu::PagedCacheDev pc_;
  std::vector<Run> runs_;
  std::vector<cu::GemvJob> jobs_;
  cu::DevBuf stage_buf_, remap_;  // streamed experts: staging stacks and remapped ids
  GluWeights stage_, stage_shape_;
  MoeWeights staged_;
  cu::GraphExec graph_ = nullptr;
  GraphKey key_;
  cu::EventMarks marks_;
  bool capturing_ = false;
  std::unique_ptr<Backend> cpu_;  // experts_on_cpu: the CPU backend that computes the routed experts
  float* host_moe_ = nullptr;     // its pinned buffers: z, agg [R, latent], weights [R, K], ids [R, K]
  float* host_terms_ = nullptr;   // hot experts: the host's slot outputs [kGemvMaxT * K, latent]
  cu::DevBuf hot_ids_dev_;        // hot experts: each slot's position in the cache's stacks, or -1
  std::vector<int32_t> hot_ids_host_;
  std::map<const MoeWeights*, HotCache> hot_;
  int64_t moe_layers_ = 0;
};

}  // namespace

namespace {
// A usable Hopper GPU with cuBLAS loaded, or a one-line error.
cu::DeviceInfo check_gpu() {
  if (cu::device_count() == 0) fail("--device cuda: no usable CUDA GPU (" + cu::unavailable_reason() + ")");
  const cu::DeviceInfo dev = cu::device_info();
  if (dev.sm_major < 9)
    fail("--device cuda: " + dev.name + " is compute capability " + std::to_string(dev.sm_major) + "." +
         std::to_string(dev.sm_minor) + "; this build has kernels for sm_90a (Hopper) only");
  cu::load_cublas();  // not linked: opened here, the first time a model goes to the GPU
  return dev;
}
}  // namespace

std::unique_ptr<Backend> make_cuda_backend_for_dims(const ModelDims& d, const GpuOptions& o) {
  check_gpu();
  return std::make_unique<CudaBackend>(d, o);
}

std::unique_ptr<Backend> make_cuda_backend(const Model& m, const GpuOptions& o) {
  const cu::DeviceInfo dev = check_gpu();
  GpuOptions od = o;
  od.sm_count = dev.multiprocessors;  // (the backend sizes the MLA workspace with the device's count)
  const GpuMemoryPlan plan = gpu_memory_plan(m, od, o.initial_context);
  // Leave headroom for the CUDA context, cuBLAS workspace, expert scratch and allocator rounding.
  const size_t headroom = size_t(512) << 20;
  if (plan.total() + headroom > dev.free_bytes)
    fail("--device cuda: the model needs " + gib_text(plan.total()) + " of GPU memory (weights " + gib_text(plan.weights) +
         ", workspace " + gib_text(plan.workspace) + ", state for " + std::to_string(o.initial_context) + " tokens " +
         gib_text(plan.state_fixed + plan.state_per_token * size_t(o.initial_context)) + ") but " + dev.name + " has " +
         gib_text(dev.free_bytes) + " free" + (o.experts_on_cpu ? "" : " (--cpu-experts or --gpu-mem keep the routed experts in host RAM)"));
  if (o.gpu_mem > 0 && plan.total() > o.gpu_mem)
    fail("--device cuda: the model needs " + gib_text(plan.total()) + " of GPU memory, over --gpu-mem " + gib_text(o.gpu_mem));
  return std::make_unique<CudaBackend>(m.dims(), o);
}

}  // namespace k3
