// The Kimi K3 family's binding: which family members this engine runs (check_supported: the one place
// that refuses a config's features), config -> dims, and the checkpoint's tensors (names, shapes and
// dtypes of spec §2, checked strictly) -> the model's weight views. A second family gets a file like this.
// Must not: compute (the forward is model/forward.cpp) or keep file handles beyond the mapping.
#include <algorithm>
#include <cstring>
#include <memory>
#include <set>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace k3 {

ModelDims ModelDims::from_config(const ModelConfig& c) {
  ModelDims d;
  d.hidden = c.hidden_size;
  d.vocab = c.vocab_size;
  d.layers = c.num_hidden_layers;
  d.block_size = c.residual == ResidualKind::BlockAttnRes ? c.attn_res_block_size : 0;
  d.eps = float(c.rms_norm_eps);
  // SiLU is the SiTU-GLU without caps (ops.h situ_glu).
  d.situ = c.activation == FfnActivation::SiLU ? SituParams{0.0f, 0.0f}
                                               : SituParams{float(c.situ_beta), float(c.situ_linear_beta)};
  // The unbounded decay gate is lower_bound 0 (ops.h kda_gate).
  d.kda = {c.hidden_size,
           c.kda_num_heads,
           c.kda_head_dim,
           c.short_conv_kernel_size,
           c.kda_gate_bounded ? float(c.gate_lower_bound) : 0.0f,
           float(c.rms_norm_eps),
           !c.use_full_rank_gate};
  d.mla = {c.hidden_size,  c.num_attention_heads,      c.mla_q_lora ? c.q_lora_rank : 0,
           c.kv_lora_rank, c.qk_nope_head_dim,         c.qk_rope_head_dim,
           c.v_head_dim,   float(c.mla_lora_norm_eps), c.mla_use_output_gate};
  d.moe.hidden = c.hidden_size;
  d.moe.latent_proj = c.moe_kind == MoeKind::Latent;
  d.moe.latent = d.moe.latent_proj ? c.routed_expert_hidden_size : c.hidden_size;
  d.moe.inter = c.moe_intermediate_size;
  d.moe.experts = c.num_experts;
  d.moe.top_k = c.num_experts_per_token;
  d.moe.renormalize = c.moe_renormalize;
  d.moe.latent_norm = d.moe.latent_proj && c.latent_moe_use_norm;
  d.moe.routed_scale = float(c.routed_scaling_factor);
  d.moe.norm_eps = float(c.rms_norm_eps);
  d.moe.situ = d.situ;
  for (int64_t L = 0; L < d.layers; ++L) (c.is_kda(L) ? d.kda_layers : d.mla_layers) += 1;
  d.dense_inter = c.first_k_dense_replace > 0 ? c.intermediate_size : 0;
  d.shared_inter = c.num_shared_experts > 0 ? c.shared_intermediate() : 0;
  return d;
}

// ---------------------------------------------------------------- family support
namespace {

struct Refusal {
  std::string flag;  // "hidden_act \"silu\"": the key and its value
  std::string text;  // the whole sentence
};

std::vector<Refusal> refusals(const ModelConfig& c) {
  std::vector<Refusal> out;
  const auto refuse = [&](bool cond, const std::string& flag, const std::string& meaning, const std::string& impl) {
    if (!cond) return;
    out.push_back({flag, flag + (meaning.empty() ? "" : " (" + meaning + ")") +
                             " is not implemented by this engine (it implements " + impl + ")"});
  };
  const auto q = [](const std::string& v) { return "\"" + v + "\""; };
  refuse(c.tie_word_embeddings, "tie_word_embeddings true", "", "the separate lm_head K3 and Kimi Linear ship");
  refuse(c.activation == FfnActivation::Other, "hidden_act " + q(c.hidden_act), "",
         "the SiTU-GLU of K3, \"situ\", and the SiLU-GLU of Kimi Linear, \"silu\"");
  refuse(c.moe_layer_freq != 1, "moe_layer_freq " + std::to_string(c.moe_layer_freq), "",
         "1: every layer from first_k_dense_replace on is MoE");
  refuse(c.router_activation != RouterActivation::Sigmoid, "moe_router_activation_func " + q(c.router_activation_name),
         "", "\"sigmoid\"");
  refuse(!c.topk_method.empty() && c.topk_method != "noaux_tc", "topk_method " + q(c.topk_method), "",
         "\"noaux_tc\", the bias-corrected top-k");
  refuse(c.num_expert_group != 1, "num_expert_group " + std::to_string(c.num_expert_group), "grouped top-k",
         "one group");
  refuse(!c.mla_use_nope, "mla_use_nope false", "RoPE in MLA", "the NoPE MLA of K3");
  refuse(c.short_conv_kernel_size < 1 || c.short_conv_kernel_size > 16,
         "linear_attn_config.short_conv_kernel_size " + std::to_string(c.short_conv_kernel_size), "", "1..16");
  return out;
}

}  // namespace

std::vector<std::string> unsupported_features(const ModelConfig& c) {
  std::vector<std::string> v;
  for (const Refusal& r : refusals(c)) v.push_back(r.text);
  return v;
}

void check_supported(const ModelConfig& c) {
  const std::vector<Refusal> r = refusals(c);
  if (r.empty()) return;
  std::string msg = c.source + ": " + r[0].text;
  if (r.size() > 1) {
    msg += "; " + std::to_string(r.size() - 1) + " more:";
    for (size_t i = 1; i < r.size(); ++i) msg += (i > 1 ? ", " : " ") + r[i].flag;
  }
  fail(msg);
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
  Binder(const io::Checkpoint& ck, ProblemList& problems, std::vector<std::unique_ptr<float[]>>& store)
      : ck_(ck), problems_(problems), store_(store) {}

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
      case DType::F32:
        w.fmt = WFormat::F32;
        break;
      case DType::BF16:
        w.fmt = WFormat::BF16;
        break;
      case DType::F16:
        w.fmt = WFormat::F16;
        break;
      default:
        problems_.add("tensor " + name + " has unsupported dtype " + dtype_name(t->dtype) +
                      " (expected BF16, F16 or F32)");
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
  FVec vec(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView* t = get(name, shape);
    if (!t) return {};
    return keep(decode(*t));
  }

  // Keeps a decoded vector alive in the model and returns its view.
  FVec keep(const std::vector<float>& v) {
    store_.push_back(std::make_unique<float[]>(std::max<size_t>(v.size(), 1)));
    std::copy(v.begin(), v.end(), store_.back().get());
    return FVec{store_.back().get(), int64_t(v.size())};
  }

  // A_log ships padded to head_dim in K3 (spec §2.5): accept [heads] or [padded]; use the first
  // `heads`. Kimi Linear ships it as [1, 1, heads, 1] (one value per head), also accepted.
  FVec head_vec(const std::string& name, int64_t heads, int64_t padded) {
    used_.insert(name);
    const TensorView* t = ck_.find(name);
    if (!t) {
      problems_.add("missing tensor " + name + " [" + std::to_string(padded) + "]");
      return {};
    }
    const bool flat = t->shape.size() == 1 && (t->shape[0] == heads || t->shape[0] == padded);
    const bool per_head4 = t->shape == std::vector<int64_t>{1, 1, heads, 1};
    if (!flat && !per_head4) {
      problems_.add("tensor " + name + " has shape " + t->shape_str() + ", expected [" + std::to_string(heads) +
                    "], [" + std::to_string(padded) + "] or [1, 1, " + std::to_string(heads) + ", 1]");
      return {};
    }
    auto v = decode(*t);
    v.resize(static_cast<size_t>(heads));
    return keep(v);
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
        case DType::F32:
          std::memcpy(&out[size_t(i)], t.data + 4 * i, 4);
          break;
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
          problems_.add("tensor " + t.name + " has unsupported dtype " + dtype_name(t.dtype) +
                        " (expected F32, BF16 or F16)");
          return {};
      }
    }
    return out;
  }

  const io::Checkpoint& ck_;
  ProblemList& problems_;
  std::vector<std::unique_ptr<float[]>>& store_;
  std::set<std::string> used_;
};

AttnResSite bind_site(Binder& b, const std::string& norm, const std::string& proj, int64_t H) {
  auto wn = b.vec(norm, {H});
  auto wp = b.vec(proj, {1, H});
  AttnResSite s;
  if (wn.size() == size_t(H) && wp.size() == size_t(H)) {
    std::vector<float> fold(static_cast<size_t>(H));
    for (int64_t i = 0; i < H; ++i) fold[size_t(i)] = wn[size_t(i)] * wp[size_t(i)];  // exact fold (§3.3)
    s.fold = b.keep(fold);
  }
  return s;
}

GluWeights bind_glu(Binder& b, const std::string& p, int64_t inter, int64_t in) {
  return {b.mat(p + "gate_proj.weight", inter, in), b.mat(p + "up_proj.weight", inter, in),
          b.mat(p + "down_proj.weight", in, inter)};
}

}  // namespace

std::unique_ptr<Model> bind_kimi_k3(const std::string& dir) {
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = load_model_config(dir);
  check_supported(m->cfg_);
  m->dims_ = ModelDims::from_config(m->cfg_);
  m->ckpt_ = io::Checkpoint::open(dir);
  const ModelConfig& c = m->cfg_;
  const ModelDims& d = m->dims_;
  const int64_t H = d.hidden;

  ProblemList problems;
  Binder b(*m->ckpt_, problems, m->vec_store_);
  // K3's multimodal wrapper prefixes the text model with "language_model."; a flat kimi_linear
  // checkpoint (Kimi Linear 48B-A3B) has none.
  const std::string W = m->ckpt_->find("language_model.model.embed_tokens.weight") ? "language_model." : "";
  const std::string P = W + "model.";
  const bool attn_res = d.block_size > 0;
  m->host_.embed = b.mat(P + "embed_tokens.weight", d.vocab, H);
  m->host_.final_norm = b.vec(P + "norm.weight", {H});
  if (attn_res)
    m->host_.output_res = bind_site(b, P + "output_attn_res_norm.weight", P + "output_attn_res_proj.weight", H);
  m->host_.lm_head = b.mat(W + "lm_head.weight", d.vocab, H);

  m->host_.layers.resize(size_t(d.layers));
  for (int64_t L = 0; L < d.layers; ++L) {
    LayerWeights& w = m->host_.layers[size_t(L)];
    const std::string lp = P + "layers." + std::to_string(L) + ".";
    w.input_norm = b.vec(lp + "input_layernorm.weight", {H});
    w.post_norm = b.vec(lp + "post_attention_layernorm.weight", {H});
    if (attn_res) {
      w.attn_res = bind_site(b, lp + "self_attention_res_norm.weight", lp + "self_attention_res_proj.weight", H);
      w.mlp_res = bind_site(b, lp + "mlp_res_norm.weight", lp + "mlp_res_proj.weight", H);
    }
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
      if (d.kda.low_rank_gate) {
        k.g_a_proj = b.mat(ap + "g_a_proj.weight", Dh, H);
        k.g_b_proj = b.mat(ap + "g_b_proj.weight", C, Dh);
      } else {
        k.g_proj = b.mat(ap + "g_proj.weight", C, H);
      }
      k.o_norm = b.vec(ap + "o_norm.weight", {Dh});
      k.o_proj = b.mat(ap + "o_proj.weight", H, C);
    } else {
      const MlaDims& a = d.mla;
      MlaWeights& ml = w.mla;
      if (a.q_lora > 0) {
        ml.q_a_proj = b.mat(ap + "q_a_proj.weight", a.q_lora, H);
        ml.q_a_norm = b.vec(ap + "q_a_layernorm.weight", {a.q_lora});
        ml.q_b_proj = b.mat(ap + "q_b_proj.weight", a.heads * (a.nope + a.rope), a.q_lora);
      } else {
        ml.q_proj = b.mat(ap + "q_proj.weight", a.heads * (a.nope + a.rope), H);
      }
      ml.kv_a_proj = b.mat(ap + "kv_a_proj_with_mqa.weight", a.kv_lora + a.rope, H);
      ml.kv_a_norm = b.vec(ap + "kv_a_layernorm.weight", {a.kv_lora});
      ml.kv_b_proj = b.mat(ap + "kv_b_proj.weight", a.heads * (a.nope + a.v), a.kv_lora);
      if (a.output_gate) ml.g_proj = b.mat(ap + "g_proj.weight", a.heads * a.v, H);
      ml.o_proj = b.mat(ap + "o_proj.weight", H, a.heads * a.v);
    }
    w.dense_ffn = c.is_dense_ffn(L);
    if (w.dense_ffn) {
      // transformers' save_pretrained (5.25) writes a kimi_linear dense MLP under block_sparse_moe.
      // (docs/kimi-linear.md §2.1); Moonshot's release and K3 under mlp.
      const bool tf_saved =
          !m->ckpt_->find(lp + "mlp.gate_proj.weight") && m->ckpt_->find(lp + "block_sparse_moe.gate_proj.weight");
      w.dense = bind_glu(b, lp + (tf_saved ? "block_sparse_moe." : "mlp."), c.intermediate_size, H);
    } else {
      const MoeDims& e = d.moe;
      const std::string mp = lp + "block_sparse_moe.";
      MoeWeights& mo = w.moe;
      mo.layer = L;
      mo.gate = b.mat(mp + "gate.weight", e.experts, H);
      mo.bias = b.vec(mp + "gate.e_score_correction_bias", {e.experts});
      if (e.latent_proj) {
        mo.down_lat = b.mat(mp + "routed_expert_down_proj.weight", e.latent, H);
        if (e.latent_norm) mo.lat_norm = b.vec(mp + "routed_expert_norm.weight", {e.latent});
        mo.up_lat = b.mat(mp + "routed_expert_up_proj.weight", H, e.latent);
      }
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
  m->placed_ = m->host_;  // the CPU reads the mapping as it is
  return m;
}

std::unique_ptr<Model> Model::load(const std::string& dir) { return bind_kimi_k3(dir); }

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
  // An FP8 trunk (--trunk-fp8) computes with other weights: its sessions are not the checkpoint's.
  // (Mixed in only then, so the sessions of every other model keep their fingerprints.)
  if (trunk_fp8_) mix(0x0F8);
  return h;
}

}  // namespace k3
