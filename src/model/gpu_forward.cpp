// The K3 forward pass on an NVIDIA GPU (K3_CUDA builds): one device copy of the weights (routed
// experts stacked per layer and kept in their stored format, MXFP4 stays 4-bit), per-session
// device state (KDA recurrent + conv state, MLA latent cache), and single-token decode steps
// captured once in a CUDA graph and replayed. The order of operations mirrors layers.cpp and
// Model::forward step for step (spec §3.3-3.8); the kernels are ops/cuda (each tested vs its twin).
// Must not: include CUDA headers (only the plain ops/cuda/*.h API) or fall back to the CPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "model/gpu_internal.h"
#include "ops/cuda/cuda_ops.h"

namespace k3 {
namespace cu = k3::cuda;

namespace {

std::string gib(size_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", double(b) / (1024.0 * 1024 * 1024));
  return s;
}

size_t data_bytes(const WeightMat& w) {
  switch (w.fmt) {
    case WFormat::F32: return size_t(w.rows * w.cols) * 4;
    case WFormat::F16:
    case WFormat::BF16: return size_t(w.rows * w.cols) * 2;
    case WFormat::MXFP4: return size_t(w.rows * w.cols / 2);
  }
  return 0;
}
size_t scale_bytes(const WeightMat& w) { return w.fmt == WFormat::MXFP4 ? size_t(w.rows * (w.cols / 32)) : 0; }

// Expert e (rows [e*R, (e+1)*R)) of a stacked expert matrix, as its own view.
WeightMat expert_view(const WeightMat& stacked, int64_t R, int64_t e) {
  WeightMat w = stacked;
  w.rows = R;
  const WeightMat one{stacked.fmt, R, stacked.cols, nullptr, nullptr};
  w.data = static_cast<const char*>(stacked.data) + size_t(e) * data_bytes(one);
  if (stacked.fmt == WFormat::MXFP4) w.scales = stacked.scales + size_t(e) * scale_bytes(one);
  return w;
}

// Places weights into one device allocation. Run twice: a sizing pass (base == nullptr) and a
// copying pass, so the arena is exactly as large as what is put in it.
class Uploader {
 public:
  explicit Uploader(char* base) : base_(base) {}
  size_t used() const { return off_; }

  const float* vec(const std::vector<float>& v) {
    if (v.empty()) return nullptr;
    return static_cast<const float*>(put(v.data(), v.size() * 4));
  }
  WeightMat mat(const WeightMat& w) {
    if (w.empty()) return {};
    WeightMat d = w;
    d.data = put(w.data, data_bytes(w));
    if (w.fmt == WFormat::MXFP4) d.scales = static_cast<const uint8_t*>(put(w.scales, scale_bytes(w)));
    return d;
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
  char* base_;
  size_t off_ = 0;
};

struct GKda {
  WeightMat q, k, v, fa, fb, b, g, o;
  const float *q_conv = nullptr, *k_conv = nullptr, *v_conv = nullptr, *A_log = nullptr, *dt_bias = nullptr,
              *o_norm = nullptr;
};
struct GMla {
  WeightMat q_a, q_b, kv_a, kv_b, g, o;
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
};
struct GGlu {
  WeightMat gate, up, down;
};
struct GMoe {
  WeightMat router, down_lat, up_lat;
  const float *bias = nullptr, *lat_norm = nullptr;
  WeightMat w1, w3, w2;  // stacked experts: [E*inter, latent], [E*inter, latent], [E*latent, inter]
  GGlu shared;
};
struct GLayer {
  const float *input_norm = nullptr, *post_norm = nullptr, *attn_fold = nullptr, *mlp_fold = nullptr;
  bool is_kda = true, dense = false;
  GKda kda;
  GMla mla;
  GGlu ffn;
  GMoe moe;
};

GGlu up_glu(Uploader& u, const GluWeights& g) { return {u.mat(g.gate), u.mat(g.up), u.mat(g.down)}; }

// Uploads (or sizes, with a null base) every weight of `m` in forward order.
void place_weights(Uploader& u, const Model& m, std::vector<GLayer>& out, WeightMat& embed, WeightMat& lm_head,
                   const float*& final_norm, const float*& out_fold) {
  embed = u.mat(m.embed);
  out.assign(m.layers.size(), GLayer{});
  for (size_t L = 0; L < m.layers.size(); ++L) {
    const LayerWeights& w = m.layers[L];
    GLayer& g = out[L];
    g.input_norm = u.vec(w.input_norm);
    g.post_norm = u.vec(w.post_norm);
    g.attn_fold = u.vec(w.attn_res.fold);
    g.mlp_fold = u.vec(w.mlp_res.fold);
    g.is_kda = w.is_kda;
    g.dense = w.dense_ffn;
    if (w.is_kda) {
      const KdaWeights& k = w.kda;
      g.kda = {u.mat(k.q_proj), u.mat(k.k_proj), u.mat(k.v_proj), u.mat(k.f_a_proj), u.mat(k.f_b_proj),
               u.mat(k.b_proj), u.mat(k.g_proj), u.mat(k.o_proj), u.vec(k.q_conv), u.vec(k.k_conv),
               u.vec(k.v_conv), u.vec(k.A_log), u.vec(k.dt_bias), u.vec(k.o_norm)};
    } else {
      const MlaWeights& a = w.mla;
      g.mla = {u.mat(a.q_a_proj), u.mat(a.q_b_proj), u.mat(a.kv_a_proj), u.mat(a.kv_b_proj), u.mat(a.g_proj),
               u.mat(a.o_proj), u.vec(a.q_a_norm), u.vec(a.kv_a_norm)};
    }
    if (w.dense_ffn) {
      g.ffn = up_glu(u, w.dense);
    } else {
      const MoeWeights& e = w.moe;
      g.moe.router = u.mat(e.gate);
      g.moe.bias = u.vec(e.bias);
      g.moe.down_lat = u.mat(e.down_lat);
      g.moe.lat_norm = u.vec(e.lat_norm);
      g.moe.up_lat = u.mat(e.up_lat);
      std::vector<const WeightMat*> w1, w3, w2;
      for (const GluWeights& x : e.experts) {
        w1.push_back(&x.gate);
        w3.push_back(&x.up);
        w2.push_back(&x.down);
      }
      g.moe.w1 = u.stack(w1);
      g.moe.w3 = u.stack(w3);
      g.moe.w2 = u.stack(w2);
      if (!e.shared.gate.empty()) g.moe.shared = up_glu(u, e.shared);
    }
  }
  final_norm = u.vec(m.final_norm);
  out_fold = u.vec(m.output_res.fold);
  lm_head = u.mat(m.lm_head);
}

}  // namespace

// ---------------------------------------------------------------- model on the device
struct GpuModel {
  GpuOptions opt;
  cu::DevBuf arena;
  std::vector<GLayer> layers;
  WeightMat embed, lm_head;
  const float *final_norm = nullptr, *out_fold = nullptr;
  cu::Stream stream = nullptr;
  int64_t Tcap = 0;
  // Activation workspace for up to Tcap tokens (gpu_work_sizes lists it).
  cu::DevBuf work;
  float *a = nullptr, *xn = nullptr, *y = nullptr, *h = nullptr, *sh = nullptr;
  std::vector<float*> slots;  // depth snapshots + partial sum, [Tcap, hidden] each
  float *kda = nullptr, *mla = nullptr, *moe = nullptr, *dense = nullptr, *logits = nullptr;
  int32_t* ids = nullptr;
  cu::DevBuf mla_work;
  int32_t* ids_pinned = nullptr;  // host staging of the token id a graph replay reads
  cu::DevBuf argmax_buf;          // the device-side greedy pick (ForwardOptions::argmax_out)
  int32_t* argmax = nullptr;
  // MoE prefill grouped by expert: gathered inputs + outputs [2, Tcap*top_k, latent], and the row
  // lists [2, Tcap*top_k] (device + pinned host staging).
  cu::DevBuf moe_group_buf, moe_rows_buf;
  float* moe_grouped = nullptr;
  int32_t *moe_rows = nullptr, *moe_rows_pinned = nullptr;

  ~GpuModel() {
    cu::host_free_pinned(moe_rows_pinned);
    cu::host_free_pinned(ids_pinned);
    cu::stream_destroy(stream);
  }
};

void GpuModelDeleter::operator()(GpuModel* p) const { delete p; }

void Model::set_gpu_graphs(bool on) const {
  if (!gpu_) fail("set_gpu_graphs: the model is not on the GPU");
  gpu_->opt.graphs = on;
}

void Model::use_gpu(const GpuOptions& o) {
  if (o.tokens_per_call < 1) fail("GPU: tokens per call must be >= 1");
  if (cu::device_count() == 0) fail("--device cuda: no usable CUDA GPU (" + cu::unavailable_reason() + ")");
  const cu::DeviceInfo dev = cu::device_info();
  if (dev.sm_major < 9)
    fail("--device cuda: " + dev.name + " is compute capability " + std::to_string(dev.sm_major) + "." +
         std::to_string(dev.sm_minor) + "; this build has kernels for sm_90a (Hopper) only");
  const GpuMemoryPlan plan = gpu_memory_plan(*this, o, o.initial_context);
  // Leave headroom for the CUDA context, cuBLAS workspace and allocator rounding.
  const size_t headroom = size_t(512) << 20;
  if (plan.total() + headroom > dev.free_bytes)
    fail("--device cuda: the model needs " + gib(plan.total()) + " of GPU memory (weights " + gib(plan.weights) +
         ", workspace " + gib(plan.workspace) + ", state for " + std::to_string(o.initial_context) + " tokens " +
         gib(plan.state_fixed + plan.state_per_token * size_t(o.initial_context)) + ") but " + dev.name + " has " +
         gib(dev.free_bytes) + " free");
  std::unique_ptr<GpuModel, GpuModelDeleter> g(new GpuModel());
  g->opt = o;
  g->stream = cu::stream_create();
  {
    Uploader sizing(nullptr);
    place_weights(sizing, *this, g->layers, g->embed, g->lm_head, g->final_norm, g->out_fold);
    g->arena = cu::DevBuf(sizing.used() + 256, "model weights");
    Uploader up(g->arena.as<char>());
    place_weights(up, *this, g->layers, g->embed, g->lm_head, g->final_norm, g->out_fold);
    cu::sync();
  }
  const ModelDims& d = dims_;
  const int64_t T = o.tokens_per_call, H = d.hidden;
  g->Tcap = T;
  const GpuWorkSizes ws = gpu_work_sizes(d, T, cfg_.intermediate_size, cfg_.shared_intermediate());
  g->work = cu::DevBuf(ws.bytes(H), "activation workspace");
  float* p = g->work.as<float>();
  const auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  g->a = take(T * H);
  g->xn = take(T * H);
  g->y = take(T * H);
  g->h = take(T * H);
  g->sh = take(T * H);
  for (int64_t i = 0; i < ws.depth_slots; ++i) g->slots.push_back(take(T * H));
  g->kda = take(ws.kda);
  g->mla = take(ws.mla);
  g->moe = take(ws.moe);
  g->dense = take(ws.dense);
  g->logits = take(ws.logits);
  g->ids = reinterpret_cast<int32_t*>(take(ws.ids));
  if (size_t(p - g->work.as<float>()) * 4 > g->work.bytes()) fail("GPU: internal error: activation workspace overrun");
  const MlaAttnDims ad{d.mla.heads, d.mla.nope, d.mla.rope, d.mla.v, d.mla.kv_lora, 0.0f};
  // Decode splits the keys across blocks and needs more scratch per token than prefill: size for
  // the largest of the shapes a forward can take.
  int64_t mla_floats = 1;
  for (int64_t t : {int64_t(1), std::min<int64_t>(T, 32), T}) mla_floats = std::max(mla_floats, cu::mla_absorbed_work_floats(t, ad));
  g->mla_work = cu::DevBuf(size_t(mla_floats) * 4, "MLA workspace");
  g->ids_pinned = static_cast<int32_t*>(cu::host_alloc_pinned(sizeof(int32_t)));
  g->argmax_buf = cu::DevBuf(sizeof(int32_t), "greedy pick");
  g->argmax = g->argmax_buf.as<int32_t>();
  if (d.moe.experts > 0 && d.moe.top_k > 0) {
    const size_t slots = size_t(T * d.moe.top_k);
    g->moe_group_buf = cu::DevBuf(2 * slots * size_t(d.moe.latent) * 4, "MoE prefill grouping");
    g->moe_grouped = g->moe_group_buf.as<float>();
    g->moe_rows_buf = cu::DevBuf(2 * slots * 4, "MoE prefill row lists");
    g->moe_rows = g->moe_rows_buf.as<int32_t>();
    g->moe_rows_pinned = static_cast<int32_t*>(cu::host_alloc_pinned(2 * slots * 4));
  }
  gpu_ = std::move(g);
}

// ---------------------------------------------------------------- session state on the device
struct GpuSessionState {
  const Model* m = nullptr;
  std::vector<cu::DevBuf> S, conv_q, conv_k, conv_v;  // per layer (empty for MLA layers)
  std::vector<cu::DevBuf> c, kr;                      // per layer (empty for KDA layers), capacity cap
  int64_t cap = 0, len = 0;
  cu::DevBuf d_len;  // int32 copy of len that the kernels (and graph replays) read
  cu::GraphExec graph = nullptr;
  int graph_key = -1;

  ~GpuSessionState() { cu::graph_destroy(graph); }

  void drop_graph() {
    cu::graph_destroy(graph);
    graph = nullptr;
    graph_key = -1;
  }

  void alloc(const Model& model, int64_t capacity) {
    m = &model;
    const ModelDims& d = model.dims();
    const size_t nL = size_t(d.layers);
    S.resize(nL);
    conv_q.resize(nL);
    conv_k.resize(nL);
    conv_v.resize(nL);
    c.resize(nL);
    kr.resize(nL);
    const size_t sb = size_t(d.kda.heads * d.kda.head_dim * d.kda.head_dim) * 4;
    const size_t cb = size_t(d.kda.dim() * (d.kda.conv_k - 1)) * 4;
    for (size_t L = 0; L < nL; ++L)
      if (model.layers[L].is_kda) {
        S[L] = cu::DevBuf(sb, "KDA state");
        if (cb) {
          conv_q[L] = cu::DevBuf(cb, "KDA conv state");
          conv_k[L] = cu::DevBuf(cb, "KDA conv state");
          conv_v[L] = cu::DevBuf(cb, "KDA conv state");
        }
      }
    d_len = cu::DevBuf(sizeof(int32_t), "cache length");
    grow(capacity);
  }

  // Reallocates the MLA caches to hold `capacity` tokens, keeping the first len.
  void grow(int64_t capacity) {
    const ModelDims& d = m->dims();
    for (size_t L = 0; L < c.size(); ++L) {
      if (m->layers[L].is_kda) continue;
      cu::DevBuf nc(size_t(capacity * d.mla.kv_lora) * 4, "MLA latent cache");
      cu::DevBuf nk(size_t(capacity * std::max<int64_t>(1, d.mla.rope)) * 4, "MLA rope-key cache");
      if (len) {
        cu::d2d(nc.get(), c[L].get(), size_t(len * d.mla.kv_lora) * 4);
        cu::d2d(nk.get(), kr[L].get(), size_t(len * d.mla.rope) * 4);
      }
      c[L] = std::move(nc);
      kr[L] = std::move(nk);
    }
    cap = capacity;
    cu::sync();
    drop_graph();  // captured addresses changed
  }

  void set_len(int64_t n) {
    if (n > INT32_MAX) fail("GPU: context beyond 2^31 tokens");
    len = n;
    const int32_t v = int32_t(n);
    cu::h2d(d_len.get(), &v, sizeof v);
    cu::sync();
  }

  void zero() {
    for (auto* v : {&S, &conv_q, &conv_k, &conv_v})
      for (auto& b : *v) cu::dev_memset(b.get(), 0, b.bytes());
    set_len(0);
  }
};

namespace {
// dst (same model and cache capacity) becomes a copy of src, in place: buffer addresses, and so a
// captured decode graph, stay valid (k3 bench copies a snapshot into one session per repetition).
void copy_state_into(GpuSessionState& dst, const GpuSessionState& src) {
  const auto copy = [](cu::DevBuf& to, const cu::DevBuf& from) {
    if (from.get()) cu::d2d(to.get(), from.get(), from.bytes());
  };
  for (size_t L = 0; L < src.S.size(); ++L) {
    copy(dst.S[L], src.S[L]);
    copy(dst.conv_q[L], src.conv_q[L]);
    copy(dst.conv_k[L], src.conv_k[L]);
    copy(dst.conv_v[L], src.conv_v[L]);
    copy(dst.c[L], src.c[L]);
    copy(dst.kr[L], src.kr[L]);
  }
  dst.set_len(src.len);  // syncs
}
}  // namespace

GpuStateHandle::GpuStateHandle(const GpuStateHandle& o) {
  if (!o.p) return;
  auto* n = new GpuSessionState();
  try {
    n->alloc(*o.p->m, o.p->cap);
    copy_state_into(*n, *o.p);
  } catch (...) {
    delete n;
    throw;
  }
  p = n;
}
GpuStateHandle& GpuStateHandle::operator=(const GpuStateHandle& o) {
  if (this == &o) return *this;
  if (p && o.p && p->m == o.p->m && p->cap == o.p->cap) {
    copy_state_into(*p, *o.p);
  } else {
    GpuStateHandle t(o);
    std::swap(p, t.p);
  }
  return *this;
}
GpuStateHandle& GpuStateHandle::operator=(GpuStateHandle&& o) noexcept {
  std::swap(p, o.p);
  return *this;
}
GpuStateHandle::~GpuStateHandle() { delete p; }

GpuSessionState* gpu_session_new(const Model& m) {
  auto* s = new GpuSessionState();
  try {
    s->alloc(m, std::max<int64_t>(16, m.gpu()->opt.initial_context));
    s->zero();
  } catch (...) {
    delete s;
    throw;
  }
  return s;
}

void gpu_session_reset(GpuSessionState* s) { s->zero(); }

void Session::gpu_pull(bool with_mla) const {
  const GpuSessionState& g = *gpu_.p;
  const ModelDims& d = model_->dims();
  for (size_t L = 0; L < layers_.size(); ++L) {
    LayerState& l = layers_[L];
    if (model_->layers[L].is_kda) {
      l.kda.reset(d.kda);
      cu::d2h(l.kda.S.data(), g.S[L].get(), l.kda.S.size() * 4);
      if (g.conv_q[L].get()) {
        cu::d2h(l.kda.conv_q.data(), g.conv_q[L].get(), l.kda.conv_q.size() * 4);
        cu::d2h(l.kda.conv_k.data(), g.conv_k[L].get(), l.kda.conv_k.size() * 4);
        cu::d2h(l.kda.conv_v.data(), g.conv_v[L].get(), l.kda.conv_v.size() * 4);
      }
    }
    l.mla.len = model_->layers[L].is_kda ? 0 : g.len;
    if (with_mla && !model_->layers[L].is_kda) {
      l.mla.c.resize(size_t(g.len * d.mla.kv_lora));
      l.mla.kr.resize(size_t(g.len * d.mla.rope));
      cu::d2h(l.mla.c.data(), g.c[L].get(), l.mla.c.size() * 4);
      cu::d2h(l.mla.kr.data(), g.kr[L].get(), l.mla.kr.size() * 4);
    }
  }
}

void Session::gpu_push(bool with_mla) {
  GpuSessionState& g = *gpu_.p;
  const ModelDims& d = model_->dims();
  int64_t len = 0;
  for (size_t L = 0; L < layers_.size(); ++L)
    if (!model_->layers[L].is_kda) len = std::max(len, layers_[L].mla.len);
  if (len > g.cap) g.grow(std::max(len, 2 * g.cap));
  for (size_t L = 0; L < layers_.size(); ++L) {
    const LayerState& l = layers_[L];
    if (model_->layers[L].is_kda) {
      cu::h2d(g.S[L].get(), l.kda.S.data(), l.kda.S.size() * 4);
      if (g.conv_q[L].get()) {
        cu::h2d(g.conv_q[L].get(), l.kda.conv_q.data(), l.kda.conv_q.size() * 4);
        cu::h2d(g.conv_k[L].get(), l.kda.conv_k.data(), l.kda.conv_k.size() * 4);
        cu::h2d(g.conv_v[L].get(), l.kda.conv_v.data(), l.kda.conv_v.size() * 4);
      }
    } else if (with_mla) {
      cu::h2d(g.c[L].get(), l.mla.c.data(), size_t(l.mla.len * d.mla.kv_lora) * 4);
      cu::h2d(g.kr[L].get(), l.mla.kr.data(), size_t(l.mla.len * d.mla.rope) * 4);
    }
  }
  g.set_len(len);  // syncs
}

// ---------------------------------------------------------------- the forward pass
namespace {

struct Ctx {
  const Model& m;
  GpuModel& g;
  GpuSessionState& st;
  int64_t T;
  cu::Precision p;
  const ForwardOptions& opt;
  cu::Stream s;
};

void glu(const Ctx& c, const GGlu& w, const float* x, float* gbuf, float* ubuf, float* out) {
  const ModelDims& d = c.m.dims();
  cu::matmul(w.gate, x, c.T, gbuf, c.p, c.s);
  cu::matmul(w.up, x, c.T, ubuf, c.p, c.s);
  cu::situ_glu(gbuf, ubuf, c.T * w.gate.rows, d.situ.beta, d.situ.linear_beta, gbuf, c.s);
  cu::matmul(w.down, gbuf, c.T, out, c.p, c.s);
}

void kda(const Ctx& c, size_t L, const float* x, float* out) {
  const KdaDims& d = c.m.dims().kda;
  const GKda& w = c.g.layers[L].kda;
  const int64_t T = c.T, C = d.dim(), H = d.heads, D = d.head_dim;
  float* p = c.g.kda;
  const auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  float *qh = take(T * C), *kh = take(T * C), *vh = take(T * C), *q = take(T * C), *k = take(T * C), *v = take(T * C),
        *f = take(T * C), *g = take(T * C), *r = take(T * C), *o = take(T * C), *fa = take(T * D), *b = take(T * H);
  cu::matmul(w.q, x, T, qh, c.p, c.s);
  cu::matmul(w.k, x, T, kh, c.p, c.s);
  cu::matmul(w.v, x, T, vh, c.p, c.s);
  cu::matmul(w.fa, x, T, fa, c.p, c.s);
  cu::matmul(w.fb, fa, T, f, c.p, c.s);
  cu::matmul(w.b, x, T, b, c.p, c.s);
  cu::matmul(w.g, x, T, r, c.p, c.s);
  cu::short_conv_silu(qh, T, C, w.q_conv, d.conv_k, c.st.conv_q[L].as<float>(), q, c.s);
  cu::short_conv_silu(kh, T, C, w.k_conv, d.conv_k, c.st.conv_k[L].as<float>(), k, c.s);
  cu::short_conv_silu(vh, T, C, w.v_conv, d.conv_k, c.st.conv_v[L].as<float>(), v, c.s);
  cu::l2norm_scale(q, T * H, D, 1e-6f, float(1.0 / std::sqrt(double(D))), c.s);
  cu::l2norm_scale(k, T * H, D, 1e-6f, 1.0f, c.s);
  cu::kda_gate(f, T, H, D, w.A_log, w.dt_bias, d.lower_bound, g, c.s);
  cu::sigmoid_inplace(b, T * H, c.s);
  float* S = c.st.S[L].as<float>();
  if (T > 1 && c.opt.kda_algo == KdaAlgo::Chunked)
    cu::kda_chunked(q, k, v, g, b, T, H, D, D, c.opt.kda_chunk, S, o, c.s);
  else
    cu::kda_recurrent(q, k, v, g, b, T, H, D, D, S, o, c.s);
  cu::rmsnorm(o, T * H, D, w.o_norm, d.norm_eps, o, c.s);
  cu::sigmoid_gate_mul(o, r, T * C, c.s);
  cu::matmul(w.o, o, T, out, c.p, c.s);
}

void mla(const Ctx& c, size_t L, const float* x, float* out) {
  const MlaDims& d = c.m.dims().mla;
  const GMla& w = c.g.layers[L].mla;
  const int64_t T = c.T, dq = d.nope + d.rope, HV = d.heads * d.v, kva = d.kv_lora + d.rope;
  float* p = c.g.mla;
  const auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  float *qa = take(T * d.q_lora), *q = take(T * d.heads * dq), *ckv = take(T * kva), *a = take(T * HV),
        *gt = take(T * HV);
  cu::matmul(w.q_a, x, T, qa, c.p, c.s);
  cu::rmsnorm(qa, T, d.q_lora, w.q_a_norm, d.lora_eps, qa, c.s);
  cu::matmul(w.q_b, qa, T, q, c.p, c.s);
  cu::matmul(w.kv_a, x, T, ckv, c.p, c.s);
  const int32_t* len = c.st.d_len.as<int32_t>();
  cu::mla_cache_append(ckv, T, d.kv_lora, d.rope, w.kv_a_norm, d.lora_eps, len, c.st.c[L].as<float>(),
                       c.st.kr[L].as<float>(), c.s);
  const MlaAttnDims ad{d.heads, d.nope, d.rope, d.v, d.kv_lora, float(1.0 / std::sqrt(double(dq)))};
  cu::mla_attend_absorbed(q, T, c.st.c[L].as<float>(), c.st.kr[L].as<float>(), len, w.kv_b, ad,
                          c.g.mla_work.as<float>(), a, c.p, c.s);
  if (d.output_gate) {
    cu::matmul(w.g, x, T, gt, c.p, c.s);
    cu::sigmoid_gate_mul(a, gt, T * HV, c.s);
  }
  cu::matmul(w.o, a, T, out, c.p, c.s);
}

void moe(const Ctx& c, size_t L, const float* x, float* out) {
  const MoeDims& d = c.m.dims().moe;
  const GMoe& w = c.g.layers[L].moe;
  const int64_t T = c.T, K = d.top_k, SI = c.m.config().shared_intermediate();
  float* p = c.g.moe;
  const auto take = [&](int64_t n) {
    float* r = p;
    p += n;
    return r;
  };
  float *logits = take(T * d.experts), *wt = take(T * K), *z = take(T * d.latent), *agg = take(T * d.latent),
        *hg = take(T * K * d.inter), *hu = take(T * K * d.inter), *ye = take(T * K * d.latent), *sg = take(T * SI),
        *su = take(T * SI);
  auto* idx = reinterpret_cast<int32_t*>(take(T * K));
  // Router in fp32 always: a rounded input can flip a near-tie in the top-k (as on the CPU).
  cu::matmul(w.router, x, T, logits, cu::Precision::F32, c.s);
  cu::router_topk(logits, w.bias, T, d.experts, K, d.renormalize, d.routed_scale, idx, wt, c.s);
  cu::matmul(w.down_lat, x, T, z, c.p, c.s);
  if (T <= cu::kGemvMaxT) {
    // Decode: every (token, slot) pair runs its expert's GLU as a GEMV; the ids stay on the
    // device, so a captured graph replays whatever the router selects.
    cu::expert_matmul(w.w1, d.inter, idx, T * K, z, K, hg, c.p, c.s);
    cu::expert_matmul(w.w3, d.inter, idx, T * K, z, K, hu, c.p, c.s);
    cu::situ_glu(hg, hu, T * K * d.inter, d.situ.beta, d.situ.linear_beta, hg, c.s);
    cu::expert_matmul(w.w2, d.latent, idx, T * K, hg, 1, ye, c.p, c.s);
  } else {
    // Prefill: group the slots by expert on the host (the selection comes back once per layer),
    // then each selected expert is one GEMM over its tokens (tensor cores in bf16) instead of a
    // GEMV per slot. Every slot's output lands in its own row of ye, so the combine below (and
    // its summation order) is the same as on the decode path.
    std::vector<int32_t> sel(size_t(T * K));
    cu::d2h(sel.data(), idx, sel.size() * 4, c.s);
    std::vector<int64_t> count(size_t(d.experts) + 1, 0);
    for (int32_t e : sel) {
      if (e < 0 || e >= d.experts) fail("GPU MoE: router selected expert " + std::to_string(e) + " of " + std::to_string(d.experts));
      ++count[size_t(e) + 1];
    }
    for (size_t e = 1; e < count.size(); ++e) count[e] += count[e - 1];  // first slot of expert e
    int32_t* rows = c.g.moe_rows_pinned;  // [T*K] token rows (gather), then [T*K] slot rows (scatter)
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t slot = 0; slot < T * K; ++slot) {
      const int64_t at = fill[size_t(sel[size_t(slot)])]++;
      rows[at] = int32_t(slot / K);
      rows[T * K + at] = int32_t(slot);
    }
    int32_t* rows_dev = c.g.moe_rows;
    cu::h2d(rows_dev, rows, size_t(2 * T * K) * 4, c.s);
    float *xg = c.g.moe_grouped, *yg = xg + T * K * d.latent;
    cu::gather_rows(z, rows_dev, T * K, d.latent, xg, c.s);
    for (int64_t e = 0; e < d.experts; ++e) {
      const int64_t o = count[size_t(e)], n = count[size_t(e) + 1] - o;
      if (n == 0) continue;
      cu::matmul(expert_view(w.w1, d.inter, e), xg + o * d.latent, n, hg + o * d.inter, c.p, c.s);
      cu::matmul(expert_view(w.w3, d.inter, e), xg + o * d.latent, n, hu + o * d.inter, c.p, c.s);
    }
    cu::situ_glu(hg, hu, T * K * d.inter, d.situ.beta, d.situ.linear_beta, hg, c.s);
    for (int64_t e = 0; e < d.experts; ++e) {
      const int64_t o = count[size_t(e)], n = count[size_t(e) + 1] - o;
      if (n) cu::matmul(expert_view(w.w2, d.latent, e), hg + o * d.inter, n, yg + o * d.latent, c.p, c.s);
    }
    cu::scatter_rows(yg, rows_dev + T * K, T * K, d.latent, ye, c.s);
    cu::sync(c.s);  // the pinned row lists are rewritten by the next layer
  }
  cu::moe_combine(ye, wt, T, K, d.latent, agg, c.s);
  if (d.latent_norm) cu::rmsnorm(agg, T, d.latent, w.lat_norm, d.norm_eps, agg, c.s);
  cu::matmul(w.up_lat, agg, T, out, c.p, c.s);
  if (!w.shared.gate.empty()) {
    glu(c, w.shared, x, sg, su, c.g.sh);
    cu::add_inplace(out, c.g.sh, T * c.m.dims().hidden, c.s);
  }
}

// Block AttnRes depth state: snapshot slots and the running partial sum, as device buffers.
struct Depth {
  std::vector<const float*> blocks;
  float* partial = nullptr;
  bool partial_empty = false;
  size_t next_slot = 0;
  std::vector<const float*> sources() const {
    std::vector<const float*> v = blocks;
    if (!partial_empty) v.push_back(partial);
    return v;
  }
};

void site(const Ctx& c, const float* fold, const Depth& dep, float* out) {
  const auto src = dep.sources();
  cu::attnres_mix(src.data(), int64_t(src.size()), c.T, c.m.dims().hidden, fold, c.m.dims().eps, out, c.s);
}

// Everything from the token ids in g.ids to the logits in g.logits (rows [first, T)), and the
// cache length advanced by T: one launch sequence, capturable as a graph when T == 1.
void run_forward(const Ctx& c, int64_t first) {
  const ModelDims& d = c.m.dims();
  const int64_t T = c.T, H = d.hidden, n = T * H;
  GpuModel& g = c.g;
  Depth dep;
  dep.partial = g.slots[dep.next_slot++];
  cu::embed_rows(g.embed, g.ids, T, dep.partial, c.s);
  for (int64_t L = 0; L < d.layers; ++L) {
    const GLayer& w = g.layers[size_t(L)];
    // 1. attention-site mix (pass-through before the first snapshot)
    if (dep.blocks.empty())
      cu::d2d(g.a, dep.partial, size_t(n) * 4, c.s);
    else
      site(c, w.attn_fold, dep, g.a);
    // 2. snapshot at block starts
    if (L % d.block_size == 0) {
      dep.blocks.push_back(dep.partial);
      dep.partial = g.slots[dep.next_slot++];
      dep.partial_empty = true;
    }
    // 3-4. attention sublayer into the partial sum
    cu::rmsnorm(g.a, T, H, w.input_norm, d.eps, g.xn, c.s);
    if (w.is_kda)
      kda(c, size_t(L), g.xn, g.y);
    else
      mla(c, size_t(L), g.xn, g.y);
    if (dep.partial_empty)
      cu::d2d(dep.partial, g.y, size_t(n) * 4, c.s);
    else
      cu::add_inplace(dep.partial, g.y, n, c.s);
    dep.partial_empty = false;
    // 5-7. FFN-site mix, FFN, into the partial sum
    site(c, w.mlp_fold, dep, g.a);
    cu::rmsnorm(g.a, T, H, w.post_norm, d.eps, g.xn, c.s);
    if (w.dense) {
      float* db = g.dense;
      glu(c, w.ffn, g.xn, db, db + T * w.ffn.gate.rows, g.y);
    } else {
      moe(c, size_t(L), g.xn, g.y);
    }
    cu::add_inplace(dep.partial, g.y, n, c.s);
  }
  site(c, g.out_fold, dep, g.h);
  const int64_t nt = T - first;
  cu::rmsnorm(g.h + first * H, nt, H, g.final_norm, d.eps, g.h + first * H, c.s);
  cu::matmul(g.lm_head, g.h + first * H, nt, g.logits, c.p, c.s);
  cu::advance_len(c.st.d_len.as<int32_t>(), T, c.s);
}

cu::Precision precision_of(ops::Numerics n) {
  switch (n) {
    case ops::Numerics::Fast: return cu::Precision::BF16;
    case ops::Numerics::F32: return cu::Precision::F32;
    case ops::Numerics::Exact: break;
  }
  fail("--numerics exact (fp64 sums) is CPU-only; on the GPU use --numerics fp32 (parity mode) or fast (bf16)");
}

}  // namespace

void gpu_forward(const Model& m, GpuSessionState* st, const int32_t* ids, int64_t T, bool all_logits, float* logits,
                 const ForwardOptions& opt) {
  GpuModel& g = *m.gpu();
  if (opt.experts) fail("--ram-budget streams experts on the CPU only; on the GPU every expert stays in GPU memory");
  if (opt.mla_algo == MlaAlgo::Expanded) fail("--mla expanded is CPU-only; the GPU runs MLA in the absorbed form");
  const cu::Precision p = precision_of(opt.numerics);
  const int64_t V = m.dims().vocab;
  if (st->len + T > st->cap) st->grow(std::max(st->len + T, 2 * st->cap));
  for (int64_t done = 0; done < T;) {
    const int64_t n = std::min(g.Tcap, T - done);
    const bool last = done + n == T;
    const int64_t first = all_logits ? 0 : n - 1;
    const Ctx c{m, g, *st, n, p, opt, g.stream};
    if (n == 1 && g.opt.graphs) {
      // Decode step: replay the captured graph (recapture after a cache reallocation or a
      // change of precision). The token id travels through pinned memory the graph does not own.
      const int key = int(p);
      if (!st->graph || st->graph_key != key) {
        st->drop_graph();
        cu::capture_begin(g.stream);
        try {
          run_forward(c, first);
        } catch (...) {
          try {
            cu::graph_destroy(cu::capture_end(g.stream));
          } catch (...) {
          }
          throw;
        }
        st->graph = cu::capture_end(g.stream);
        st->graph_key = key;
      }
      *g.ids_pinned = ids[done];
      cu::h2d(g.ids, g.ids_pinned, sizeof(int32_t), g.stream);
      cu::graph_launch(st->graph, g.stream);
    } else {
      cu::h2d(g.ids, ids + done, size_t(n) * 4, g.stream);
      run_forward(c, first);
    }
    st->len += n;
    if (all_logits) {
      cu::d2h(logits + done * V, g.logits, size_t(n * V) * 4, g.stream);
    } else if (last && opt.argmax_out) {
      // Greedy on the device: 4 bytes come back instead of the vocabulary's logits.
      cu::argmax_rows(g.logits, 1, V, g.argmax, g.stream);
      cu::d2h(opt.argmax_out, g.argmax, sizeof(int32_t), g.stream);
      if (logits) cu::d2h(logits, g.logits, size_t(V) * 4, g.stream);
    } else if (last) {
      if (!logits) fail("forward: logits output is null");
      cu::d2h(logits, g.logits, size_t(V) * 4, g.stream);
    } else {
      cu::sync(g.stream);
    }
    done += n;
  }
}

}  // namespace k3
