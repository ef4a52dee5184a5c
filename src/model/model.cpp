// Model binding (names, shapes and dtypes of spec §2, checked strictly) and the forward pass (§3.3).
#include "model/model.h"

#include <algorithm>
#include <bit>
#include <istream>
#include <ostream>
#include <cstring>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/gpu_internal.h"

namespace k3 {

ModelDims ModelDims::from_config(const ModelConfig& c) {
  ModelDims d;
  d.hidden = c.hidden_size;
  d.vocab = c.vocab_size;
  d.layers = c.num_hidden_layers;
  d.block_size = c.attn_res_block_size;
  d.eps = float(c.rms_norm_eps);
  d.situ = {float(c.situ_beta), float(c.situ_linear_beta)};
  d.kda = {c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size, float(c.gate_lower_bound),
           float(c.rms_norm_eps)};
  d.mla = {c.hidden_size,      c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
           c.qk_rope_head_dim, c.v_head_dim,          float(c.mla_lora_norm_eps), c.mla_use_output_gate};
  d.moe.hidden = c.hidden_size;
  d.moe.latent = c.routed_expert_hidden_size;
  d.moe.inter = c.moe_intermediate_size;
  d.moe.experts = c.num_experts;
  d.moe.top_k = c.num_experts_per_token;
  d.moe.renormalize = c.moe_renormalize;
  d.moe.latent_norm = c.latent_moe_use_norm;
  d.moe.routed_scale = float(c.routed_scaling_factor);
  d.moe.norm_eps = float(c.rms_norm_eps);
  d.moe.situ = d.situ;
  return d;
}

bool is_routed_expert_tensor(std::string_view name) {
  // Shared experts are "...block_sparse_moe.shared_experts...", so they never match.
  return name.find(".block_sparse_moe.experts.") != std::string_view::npos;
}

// ---------------------------------------------------------------- binding
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Looks tensors up by name, checks shape and dtype, records every problem and every name used.
class Binder {
 public:
  Binder(const io::Checkpoint& ck, ProblemList& problems) : ck_(ck), problems_(problems) {}

  const TensorView* get(const std::string& name, const std::vector<int64_t>& shape) {
    used_.insert(name);
    const TensorView* t = ck_.find(name);
    if (!t) {
      problems_.add("missing tensor " + name + " " + shape_str(shape));
      return nullptr;
    }
    if (t->shape != shape) {
      problems_.add("tensor " + name + " has shape " + t->shape_str() + ", expected " + shape_str(shape));
      return nullptr;
    }
    return t;
  }

  WeightMat mat(const std::string& name, int64_t rows, int64_t cols) {
    const TensorView* t = get(name, {rows, cols});
    if (!t) return {};
    WeightMat w;
    w.rows = rows;
    w.cols = cols;
    w.data = t->data;
    switch (t->dtype) {
      case DType::F32: w.fmt = WFormat::F32; break;
      case DType::BF16: w.fmt = WFormat::BF16; break;
      case DType::F16: w.fmt = WFormat::F16; break;
      default:
        problems_.add("tensor " + name + " has unsupported dtype " + dtype_name(t->dtype) + " (expected BF16, F16 or F32)");
        return {};
    }
    return w;
  }

  // A routed-expert matrix: MXFP4 iff `<prefix>.weight_packed` exists (spec §1.3), else plain.
  WeightMat expert(const std::string& prefix, int64_t rows, int64_t cols) {
    if (!ck_.find(prefix + ".weight_packed")) return mat(prefix + ".weight", rows, cols);
    if (cols % 32 != 0) {
      problems_.add("MXFP4 tensor " + prefix + " needs an input width divisible by 32, got " + std::to_string(cols));
      return {};
    }
    const TensorView* p = get(prefix + ".weight_packed", {rows, cols / 2});
    const TensorView* s = get(prefix + ".weight_scale", {rows, cols / 32});
    bool ok = p && s;
    for (const TensorView* t : {p, s})
      if (t && t->dtype != DType::U8 && t->dtype != DType::I8) {
        problems_.add("tensor " + t->name + " has dtype " + dtype_name(t->dtype) + ", expected U8 (MXFP4)");
        ok = false;
      }
    if (!ok) return {};
    return WeightMat{WFormat::MXFP4, rows, cols, p->data, s->data};
  }

  // A small vector decoded to fp32 (norm gains, conv taps, biases). `shape` is the stored shape.
  std::vector<float> vec(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView* t = get(name, shape);
    if (!t) return {};
    return decode(*t);
  }

  // A_log ships padded to head_dim (spec §2.5): accept [heads] or [n >= heads]; use the first `heads`.
  std::vector<float> head_vec(const std::string& name, int64_t heads, int64_t padded) {
    used_.insert(name);
    const TensorView* t = ck_.find(name);
    if (!t) {
      problems_.add("missing tensor " + name + " [" + std::to_string(padded) + "]");
      return {};
    }
    if (t->shape.size() != 1 || (t->shape[0] != heads && t->shape[0] != padded)) {
      problems_.add("tensor " + name + " has shape " + t->shape_str() + ", expected [" + std::to_string(heads) +
                    "] or [" + std::to_string(padded) + "]");
      return {};
    }
    auto v = decode(*t);
    v.resize(static_cast<size_t>(heads));
    return v;
  }

  void check_unused() {
    for (const auto& n : ck_.names()) {
      if (used_.count(n)) continue;
      if (n.rfind("vision_tower.", 0) == 0 || n.rfind("mm_projector.", 0) == 0) continue;  // not the text model
      problems_.add("unexpected tensor " + n);
    }
  }

 private:
  std::vector<float> decode(const TensorView& t) {
    std::vector<float> out(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) {
      switch (t.dtype) {
        case DType::F32: std::memcpy(&out[size_t(i)], t.data + 4 * i, 4); break;
        case DType::BF16: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[size_t(i)] = bf16_to_f32(h);
          break;
        }
        case DType::F16: {
          uint16_t h;
          std::memcpy(&h, t.data + 2 * i, 2);
          out[size_t(i)] = f16_to_f32(h);
          break;
        }
        default:
          problems_.add("tensor " + t.name + " has unsupported dtype " + dtype_name(t.dtype) + " (expected F32, BF16 or F16)");
          return {};
      }
    }
    return out;
  }

  const io::Checkpoint& ck_;
  ProblemList& problems_;
  std::set<std::string> used_;
};

AttnResSite bind_site(Binder& b, const std::string& norm, const std::string& proj, int64_t H) {
  auto wn = b.vec(norm, {H});
  auto wp = b.vec(proj, {1, H});
  AttnResSite s;
  if (wn.size() == size_t(H) && wp.size() == size_t(H)) {
    s.fold.resize(size_t(H));
    for (int64_t i = 0; i < H; ++i) s.fold[size_t(i)] = wn[size_t(i)] * wp[size_t(i)];  // exact fold (§3.3)
  }
  return s;
}

GluWeights bind_glu(Binder& b, const std::string& p, int64_t inter, int64_t in) {
  return {b.mat(p + "gate_proj.weight", inter, in), b.mat(p + "up_proj.weight", inter, in),
          b.mat(p + "down_proj.weight", in, inter)};
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& dir) {
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = load_model_config(dir);
  m->dims_ = ModelDims::from_config(m->cfg_);
  m->ckpt_ = io::Checkpoint::open(dir);
  const ModelConfig& c = m->cfg_;
  const ModelDims& d = m->dims_;
  const int64_t H = d.hidden;
  if (d.kda.conv_k < 1 || d.kda.conv_k > 16) fail(c.source + ": short_conv_kernel_size must be in 1..16");

  ProblemList problems;
  Binder b(*m->ckpt_, problems);
  const std::string P = "language_model.model.";
  m->embed = b.mat(P + "embed_tokens.weight", d.vocab, H);
  m->final_norm = b.vec(P + "norm.weight", {H});
  m->output_res = bind_site(b, P + "output_attn_res_norm.weight", P + "output_attn_res_proj.weight", H);
  m->lm_head = b.mat("language_model.lm_head.weight", d.vocab, H);

  m->layers.resize(size_t(d.layers));
  for (int64_t L = 0; L < d.layers; ++L) {
    LayerWeights& w = m->layers[size_t(L)];
    const std::string lp = P + "layers." + std::to_string(L) + ".";
    w.input_norm = b.vec(lp + "input_layernorm.weight", {H});
    w.post_norm = b.vec(lp + "post_attention_layernorm.weight", {H});
    w.attn_res = bind_site(b, lp + "self_attention_res_norm.weight", lp + "self_attention_res_proj.weight", H);
    w.mlp_res = bind_site(b, lp + "mlp_res_norm.weight", lp + "mlp_res_proj.weight", H);
    const std::string ap = lp + "self_attn.";
    w.is_kda = c.is_kda(L);
    if (w.is_kda) {
      const int64_t C = d.kda.dim(), Dh = d.kda.head_dim, K = d.kda.conv_k;
      KdaWeights& k = w.kda;
      k.q_proj = b.mat(ap + "q_proj.weight", C, H);
      k.k_proj = b.mat(ap + "k_proj.weight", C, H);
      k.v_proj = b.mat(ap + "v_proj.weight", C, H);
      k.q_conv = b.vec(ap + "q_conv1d.weight", {C, 1, K});
      k.k_conv = b.vec(ap + "k_conv1d.weight", {C, 1, K});
      k.v_conv = b.vec(ap + "v_conv1d.weight", {C, 1, K});
      k.f_a_proj = b.mat(ap + "f_a_proj.weight", Dh, H);
      k.f_b_proj = b.mat(ap + "f_b_proj.weight", C, Dh);
      k.A_log = b.head_vec(ap + "A_log", d.kda.heads, std::max(d.kda.heads, Dh));
      k.dt_bias = b.vec(ap + "dt_bias", {C});
      k.b_proj = b.mat(ap + "b_proj.weight", d.kda.heads, H);
      k.g_proj = b.mat(ap + "g_proj.weight", C, H);
      k.o_norm = b.vec(ap + "o_norm.weight", {Dh});
      k.o_proj = b.mat(ap + "o_proj.weight", H, C);
    } else {
      const MlaDims& a = d.mla;
      MlaWeights& ml = w.mla;
      ml.q_a_proj = b.mat(ap + "q_a_proj.weight", a.q_lora, H);
      ml.q_a_norm = b.vec(ap + "q_a_layernorm.weight", {a.q_lora});
      ml.q_b_proj = b.mat(ap + "q_b_proj.weight", a.heads * (a.nope + a.rope), a.q_lora);
      ml.kv_a_proj = b.mat(ap + "kv_a_proj_with_mqa.weight", a.kv_lora + a.rope, H);
      ml.kv_a_norm = b.vec(ap + "kv_a_layernorm.weight", {a.kv_lora});
      ml.kv_b_proj = b.mat(ap + "kv_b_proj.weight", a.heads * (a.nope + a.v), a.kv_lora);
      if (a.output_gate) ml.g_proj = b.mat(ap + "g_proj.weight", a.heads * a.v, H);
      ml.o_proj = b.mat(ap + "o_proj.weight", H, a.heads * a.v);
    }
    w.dense_ffn = c.is_dense_ffn(L);
    if (w.dense_ffn) {
      w.dense = bind_glu(b, lp + "mlp.", c.intermediate_size, H);
    } else {
      const MoeDims& e = d.moe;
      const std::string mp = lp + "block_sparse_moe.";
      MoeWeights& mo = w.moe;
      mo.layer = L;
      mo.gate = b.mat(mp + "gate.weight", e.experts, H);
      mo.bias = b.vec(mp + "gate.e_score_correction_bias", {e.experts});
      mo.down_lat = b.mat(mp + "routed_expert_down_proj.weight", e.latent, H);
      if (e.latent_norm) mo.lat_norm = b.vec(mp + "routed_expert_norm.weight", {e.latent});
      mo.up_lat = b.mat(mp + "routed_expert_up_proj.weight", H, e.latent);
      mo.experts.resize(size_t(e.experts));
      for (int64_t x = 0; x < e.experts; ++x) {
        const std::string ep = mp + "experts." + std::to_string(x) + ".";
        mo.experts[size_t(x)] = {b.expert(ep + "w1", e.inter, e.latent), b.expert(ep + "w3", e.inter, e.latent),
                                 b.expert(ep + "w2", e.latent, e.inter)};
      }
      if (c.num_shared_experts > 0) mo.shared = bind_glu(b, mp + "shared_experts.", c.shared_intermediate(), H);
    }
  }
  b.check_unused();
  problems.throw_if_any(dir + ": checkpoint does not match config");
  return m;
}

Model::~Model() = default;

// ---------------------------------------------------------------- forward
void decoder_layer(const ModelDims& d, int64_t L, const LayerWeights& w, LayerState& st, DepthState& depth, int64_t T,
                   const ForwardOptions& opt) {
  const int64_t H = d.hidden, n = T * H;
  std::vector<float> a(static_cast<size_t>(n)), xn(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  // 1. attention-site mix (pass-through while no block has been snapshotted: layer 0)
  if (depth.blocks.empty())
    a = depth.partial;
  else
    attnres_site(w.attn_res, depth, T, H, d.eps, a.data());
  // 2. snapshot the partial sum at block starts, then start a new block
  if (L % d.block_size == 0) {
    depth.blocks.push_back(std::move(depth.partial));
    depth.partial.clear();
  }
  // 3-4. attention sublayer, added into the partial sum
  ops::rmsnorm(a.data(), T, H, w.input_norm.data(), d.eps, xn.data());
  if (w.is_kda) {
    const KdaAlgo algo = T > 1 ? opt.kda_algo : KdaAlgo::Recurrent;
    kda_forward(d.kda, w.kda, st.kda, xn.data(), T, algo, opt.kda_chunk, y.data());
  } else {
    mla_forward(d.mla, w.mla, st.mla, xn.data(), T, opt.mla_algo, y.data());
  }
  if (depth.partial.empty())
    depth.partial = y;
  else
    for (int64_t i = 0; i < n; ++i) depth.partial[size_t(i)] += y[size_t(i)];
  // 5-7. FFN-site mix (always), FFN, added into the partial sum
  attnres_site(w.mlp_res, depth, T, H, d.eps, a.data());
  ops::rmsnorm(a.data(), T, H, w.post_norm.data(), d.eps, xn.data());
  if (w.dense_ffn)
    glu_forward(w.dense, d.situ, xn.data(), T, y.data());
  else
    moe_forward(d.moe, w.moe, xn.data(), T, y.data(), opt.experts);
  for (int64_t i = 0; i < n; ++i) depth.partial[size_t(i)] += y[size_t(i)];
}

void Model::forward(Session& s, const int32_t* ids, int64_t T, bool all_logits, float* logits,
                    const ForwardOptions& opt) const {
  if (s.model_ != this) fail("session belongs to another model");
  if (T <= 0) fail("forward needs at least one token");
  const ops::NumericsScope numerics(opt.numerics);
  const int64_t H = dims_.hidden, V = dims_.vocab;
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= V)
      fail("token id " + std::to_string(ids[t]) + " at position " + std::to_string(t) + " is outside the vocabulary [0, " +
           std::to_string(V) + ")");
  if (opt.argmax_out && all_logits) fail("forward: argmax_out needs all_logits == false");
  if (gpu_) {
    if (!s.gpu_.p) fail("this session was created before the model moved to the GPU; create a new session");
    gpu_forward(*this, s.gpu_.p, ids, T, all_logits, logits, opt);
    s.pos_ += T;
    return;
  }
  if (!logits) fail("forward: logits output is null");
  // Embedding (no scaling); it is the first partial sum and becomes block snapshot 0 at layer 0.
  DepthState depth;
  depth.partial.resize(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) ops::dequant_row(embed, ids[t], depth.partial.data() + t * H);
  for (int64_t L = 0; L < dims_.layers; ++L)
    decoder_layer(dims_, L, layers[size_t(L)], s.layers_[size_t(L)], depth, T, opt);
  // Output aggregator over B ∪ {P}, final norm, untied lm_head.
  const int64_t first = all_logits ? 0 : T - 1, nt = T - first;
  std::vector<float> h(static_cast<size_t>(T * H));
  attnres_site(output_res, depth, T, H, dims_.eps, h.data());
  ops::rmsnorm(h.data() + first * H, nt, H, final_norm.data(), dims_.eps, h.data() + first * H);
  ops::matmul(lm_head, h.data() + first * H, nt, logits);
  if (opt.argmax_out) *opt.argmax_out = int32_t(std::max_element(logits, logits + V) - logits);  // first max
  s.pos_ += T;
}

// ---------------------------------------------------------------- session
Session::Session(const Model& m) : model_(&m) {
  if (m.on_gpu()) gpu_.p = gpu_session_new(m);
  reset();
}

void Session::reset() {
  const ModelDims& d = model_->dims();
  layers_.assign(size_t(d.layers), LayerState{});
  pos_ = 0;
  if (gpu_.p) return gpu_session_reset(gpu_.p);  // the live state is on the device: no host copy
  for (int64_t L = 0; L < d.layers; ++L)
    if (model_->layers[size_t(L)].is_kda) layers_[size_t(L)].kda.reset(d.kda);
}

uint64_t Model::fingerprint() const {
  // FNV-1a over the dimensions that shape a session, the layer kinds and the checkpoint size.
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ uint64_t((uint64_t(v) >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  const ModelDims& d = dims_;
  for (int64_t v : {d.hidden, d.vocab, d.layers, d.block_size, d.kda.heads, d.kda.head_dim, d.kda.conv_k, d.mla.heads,
                    d.mla.q_lora, d.mla.kv_lora, d.mla.nope, d.mla.rope, d.mla.v})
    mix(v);
  for (const auto& l : layers) mix(l.is_kda ? 1 : 2);
  mix(int64_t(ckpt_->total_tensor_bytes()));
  return h;
}

Session::Mark Session::mark() const {
  if (gpu_.p) gpu_pull(false);
  Mark m;
  m.pos = pos_;
  m.kda.resize(layers_.size());
  m.mla_len.resize(layers_.size());
  for (size_t L = 0; L < layers_.size(); ++L) {
    if (model_->layers[L].is_kda) m.kda[L] = layers_[L].kda;
    m.mla_len[L] = layers_[L].mla.len;
  }
  return m;
}

void Session::rollback(const Mark& m) {
  if (gpu_.p) gpu_pull(false);  // the MLA lengths now
  if (m.kda.size() != layers_.size() || m.pos > pos_) fail("session rollback: the mark is not an earlier point of this session");
  const int64_t kv = model_->dims().mla.kv_lora, rope = model_->dims().mla.rope;
  for (size_t L = 0; L < layers_.size(); ++L)
    if (m.mla_len[L] > layers_[L].mla.len) fail("session rollback: the MLA cache is shorter than the mark");
  for (size_t L = 0; L < layers_.size(); ++L) {
    if (model_->layers[L].is_kda) layers_[L].kda = m.kda[L];
    MlaCache& c = layers_[L].mla;
    c.len = m.mla_len[L];
    if (!gpu_.p) {
      c.c.resize(size_t(c.len * kv));
      c.kr.resize(size_t(c.len * rope));
    }
  }
  pos_ = m.pos;
  if (gpu_.p) gpu_push(false);
}

namespace {
constexpr char kSessionMagic[8] = {'K', '3', 'S', 'E', 'S', 'S', '0', '1'};

void put_u64(std::ostream& o, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  o.write(reinterpret_cast<const char*>(b), 8);
}
uint64_t get_u64(std::istream& in) {
  unsigned char b[8];
  if (!in.read(reinterpret_cast<char*>(b), 8)) fail("session file is truncated");
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(b[i]) << (8 * i);
  return v;
}
void put_floats(std::ostream& o, const std::vector<float>& v) {
  static_assert(sizeof(float) == 4 && std::endian::native == std::endian::little, "session files are little-endian");
  put_u64(o, v.size());
  o.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 4));  // little-endian hosts only
}
void get_floats(std::istream& in, std::vector<float>& v, size_t expect, const char* what) {
  const uint64_t n = get_u64(in);
  if (n != expect) fail(std::string("session file: ") + what + " has " + std::to_string(n) + " values, expected " + std::to_string(expect));
  v.resize(size_t(n));
  if (n && !in.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4))) fail("session file is truncated");
}
}  // namespace

void Session::save(std::ostream& out) const {
  if (gpu_.p) gpu_pull(true);
  out.write(kSessionMagic, 8);
  put_u64(out, model_->fingerprint());
  put_u64(out, uint64_t(pos_));
  put_u64(out, layers_.size());
  for (const auto& l : layers_) {
    put_floats(out, l.kda.S);
    put_floats(out, l.kda.conv_q);
    put_floats(out, l.kda.conv_k);
    put_floats(out, l.kda.conv_v);
    put_u64(out, uint64_t(l.mla.len));
    put_floats(out, l.mla.c);
    put_floats(out, l.mla.kr);
  }
  if (!out) fail("session file: write failed");
}

void Session::load(std::istream& in) {
  char magic[8];
  if (!in.read(magic, 8) || std::memcmp(magic, kSessionMagic, 8) != 0) fail("not a k3 session file (bad magic)");
  if (get_u64(in) != model_->fingerprint()) fail("session file was saved with a different model");
  const uint64_t pos = get_u64(in);
  if (get_u64(in) != layers_.size()) fail("session file: layer count differs from the model");
  // Fill a staging copy so a bad file leaves this session untouched.
  std::vector<LayerState> staged(layers_.size());
  const ModelDims& d = model_->dims();
  const size_t state = size_t(d.kda.heads * d.kda.head_dim * d.kda.head_dim);
  const size_t conv = size_t(d.kda.dim() * (d.kda.conv_k - 1));
  for (size_t L = 0; L < layers_.size(); ++L) {
    LayerState& l = staged[L];
    const bool kda = model_->layers[L].is_kda;
    get_floats(in, l.kda.S, kda ? state : 0, "KDA state");
    get_floats(in, l.kda.conv_q, kda ? conv : 0, "KDA conv state");
    get_floats(in, l.kda.conv_k, kda ? conv : 0, "KDA conv state");
    get_floats(in, l.kda.conv_v, kda ? conv : 0, "KDA conv state");
    const uint64_t len = get_u64(in);
    if (len > pos) fail("session file: MLA cache longer than the position");
    l.mla.len = int64_t(len);
    get_floats(in, l.mla.c, size_t(len) * size_t(d.mla.kv_lora), "MLA latent cache");
    get_floats(in, l.mla.kr, size_t(len) * size_t(d.mla.rope), "MLA rope-key cache");
  }
  layers_ = std::move(staged);
  pos_ = int64_t(pos);
  if (gpu_.p) gpu_push(true);
}

size_t Session::state_bytes() const {
  if (gpu_.p) {
    const GpuMemoryPlan p = gpu_memory_plan(*model_, GpuOptions{}, pos_);
    return p.state_fixed + p.state_per_token * size_t(pos_);
  }
  size_t n = 0;
  for (const auto& l : layers_)
    n += 4 * (l.kda.S.size() + l.kda.conv_q.size() + l.kda.conv_k.size() + l.kda.conv_v.size() + l.mla.c.size() +
              l.mla.kr.size());
  return n;
}

}  // namespace k3
