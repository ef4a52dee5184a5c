// Strict config.json reader for ModelConfig (spec k3-architecture.md §1, §6.4).
// Owns: JSON parsing, key lookup with one-line named problems, range and consistency checks, the
// family flags, and the one-based layer-list validation, in one parser per section (trunk, FFN,
// MoE, expert selection, MLA, AttnRes, KDA, special tokens). Every problem is collected and thrown
// once (k3::ProblemList).
// Must not: fill in defaults for keys the engine uses (an absent family key is a flag, documented in
// model_config.h), refuse a well-formed family member (check_supported in model/kimi_k3.cpp does),
// or read anything except config.json (checkpoint headers belong to io/model).
#include "config/model_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace k3 {

namespace {

using json = nlohmann::json;

// Generous caps so later size arithmetic (params, cache bytes) cannot overflow on hostile input.
constexpr int64_t kMaxDim = int64_t{1} << 24;  // any width / head count / expert count
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr int64_t kMaxPositions = int64_t{1} << 40;

// Short rendering of a JSON value for "got ..." messages (kept to one line, bounded length).
std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// Formats a sorted list of one-based layer numbers compactly: "5, 7, 9-12".
std::string format_layer_set(const std::vector<int64_t>& sorted) {
  std::string out;
  size_t i = 0;
  while (i < sorted.size()) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(sorted[i]);
    if (j > i) out += "-" + std::to_string(sorted[j]);
    i = j + 1;
  }
  return out;
}

// Typed, prefixed access to one JSON object; every failure becomes a named problem.
class Fields {
 public:
  Fields(const json& obj, std::string prefix, ProblemList& problems)
      : obj_(obj), prefix_(std::move(prefix)), problems_(problems) {}

  std::string name(const std::string& key) const { return prefix_ + key; }
  bool has(const char* key) const { return obj_.contains(key); }
  const json* find(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }

  // Returns the value or nullptr (recording "missing key" when required).
  const json* lookup(const char* key, bool required) {
    const json* v = find(key);
    if (!v && required) problems_.add("missing key " + name(key));
    return v;
  }

  bool get_int(const char* key, int64_t& out, bool required = true) {
    const json* v = lookup(key, required);
    return v && to_int(*v, name(key), out);
  }
  bool get_num(const char* key, double& out, bool required = true) {
    const json* v = lookup(key, required);
    if (!v) return false;
    if (!v->is_number()) return wrong_type(name(key), "a number", *v);
    out = v->get<double>();
    if (!std::isfinite(out)) {
      problems_.add(name(key) + " must be finite");
      return false;
    }
    return true;
  }
  bool get_bool(const char* key, bool& out, bool required = true) {
    const json* v = lookup(key, required);
    if (!v) return false;
    if (!v->is_boolean()) return wrong_type(name(key), "a boolean", *v);
    out = v->get<bool>();
    return true;
  }
  bool get_str(const char* key, std::string& out, bool required = true) {
    const json* v = lookup(key, required);
    if (!v) return false;
    if (!v->is_string()) return wrong_type(name(key), "a string", *v);
    out = v->get<std::string>();
    return true;
  }
  bool get_int_list(const char* key, std::vector<int64_t>& out) {
    const json* v = lookup(key, true);
    if (!v) return false;
    if (!v->is_array()) return wrong_type(name(key), "an array of integers", *v);
    bool ok = true;
    out.clear();
    for (size_t i = 0; i < v->size(); ++i) {
      int64_t x = 0;
      if (to_int((*v)[i], name(key) + "[" + std::to_string(i) + "]", x)) {
        out.push_back(x);
      } else {
        ok = false;
      }
    }
    return ok;
  }
  const json* get_object(const char* key, bool required = true) {
    const json* v = lookup(key, required);
    if (!v) return nullptr;
    if (!v->is_object()) {
      wrong_type(name(key), "an object", *v);
      return nullptr;
    }
    return v;
  }

  bool to_int(const json& v, const std::string& what, int64_t& out) {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        problems_.add(what + " = " + show(v) + " is out of range");
        return false;
      }
      out = static_cast<int64_t>(u);
      return true;
    }
    if (v.is_number_integer()) {
      out = v.get<int64_t>();
      return true;
    }
    return wrong_type(what, "an integer", v);
  }

  bool wrong_type(const std::string& what, const char* expected, const json& v) {
    problems_.add(what + " must be " + expected + ", got " + show(v));
    return false;
  }

 private:
  const json& obj_;
  std::string prefix_;
  ProblemList& problems_;
};

// Range check helpers: only called for values that were read successfully.
void require_range(ProblemList& p, const std::string& what, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    p.add(what + " = " + std::to_string(v) + " is outside " + std::to_string(lo) + ".." + std::to_string(hi));
  }
}

std::string fmt_double(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// Checks the one-based layer lists (§1.2, trap §6.4.1): in 1..N, no duplicates, disjoint, covering.
void validate_layer_lists(ProblemList& p, const std::string& lin_prefix, const std::vector<int64_t>& full,
                          const std::vector<int64_t>& kda, int64_t n_layers, bool n_known) {
  struct Named {
    const char* key;
    const std::vector<int64_t>* list;
  };
  const Named lists[2] = {{"full_attn_layers", &full}, {"kda_layers", &kda}};
  std::map<int64_t, int> owner;  // one-based layer -> which list (0 full, 1 kda) first claimed it
  std::vector<int64_t> overlap;
  for (int li = 0; li < 2; ++li) {
    const auto& v = *lists[li].list;
    const std::string nm = lin_prefix + lists[li].key;
    std::vector<int64_t> seen_twice;
    std::map<int64_t, int> count;
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t x = v[i];
      if (n_known && (x < 1 || x > n_layers)) {
        p.add(nm + "[" + std::to_string(i) + "] = " + std::to_string(x) + " is outside 1.." + std::to_string(n_layers) +
              " (layer lists are one-based)");
        continue;
      }
      if (!n_known && x < 1) {
        p.add(nm + "[" + std::to_string(i) + "] = " + std::to_string(x) + " is below 1 (layer lists are one-based)");
        continue;
      }
      if (++count[x] == 2) seen_twice.push_back(x);
      auto it = owner.find(x);
      if (it == owner.end()) {
        owner[x] = li;
      } else if (it->second != li && count[x] == 1) {
        overlap.push_back(x);
      }
    }
    if (!seen_twice.empty()) {
      std::sort(seen_twice.begin(), seen_twice.end());
      p.add(nm + " lists layer" + (seen_twice.size() > 1 ? "s " : " ") + format_layer_set(seen_twice) +
            " more than once");
    }
  }
  if (!overlap.empty()) {
    std::sort(overlap.begin(), overlap.end());
    p.add("layer" + std::string(overlap.size() > 1 ? "s " : " ") + format_layer_set(overlap) +
          (overlap.size() > 1 ? " are" : " is") + " in both " + lin_prefix + "full_attn_layers and kda_layers");
  }
  if (n_known) {
    std::vector<int64_t> missing;
    for (int64_t l = 1; l <= n_layers; ++l) {
      if (!owner.count(l)) missing.push_back(l);
    }
    if (!missing.empty()) {
      p.add("layer" + std::string(missing.size() > 1 ? "s " : " ") + format_layer_set(missing) +
            (missing.size() > 1 ? " are" : " is") + " in neither " + lin_prefix +
            "full_attn_layers nor kda_layers (one-based)");
    }
  }
}

// Reads an optional special-token id; null counts as absent.
void read_token_id(Fields& f, const char* key, int64_t& out, bool& present) {
  present = false;
  const json* v = f.find(key);
  if (!v || v->is_null()) return;
  int64_t x = 0;
  if (f.to_int(*v, f.name(key), x)) {
    out = x;
    present = true;
  }
}

// The state the section parsers share: the wrapper and text-config fields, the config being
// filled and whether the layer count is known (range and coverage checks need it).
struct Sections {
  ModelConfig& c;
  ProblemList& p;
  Fields& top;  // the wrapper (the root object in both forms)
  Fields& t;    // the text config (text_config, or the root of the flat form)
  bool nested;  // t is text_config, not the root
  bool n_known = false;

  // A required positive integer up to `hi`.
  void pos(const char* key, int64_t& out, int64_t hi = kMaxDim) {
    if (t.get_int(key, out)) require_range(p, t.name(key), out, 1, hi);
  }
  // A required number that must be > 0.
  void positive_num(const char* key, double& out, bool required = true) {
    if (t.get_num(key, out, required) && !(out > 0)) p.add(t.name(key) + " = " + fmt_double(out) + " must be > 0");
  }
};

// Detects the form (nested kimi_k3 or flat kimi_linear) and returns the text-config object.
const json& find_text_config(const json& root, Fields& top, ModelConfig& c, ProblemList& p, const std::string& label,
                             std::string& prefix) {
  if (!top.get_str("model_type", c.model_type)) p.throw_if_any(label);
  if (c.model_type == "kimi_linear") return root;
  if (c.model_type != "kimi_k3") {
    throw Error(label + ": unsupported model_type \"" + c.model_type +
                "\" (expected \"kimi_k3\" with a text_config, or a flat \"kimi_linear\" config)");
  }
  const json* text = top.get_object("text_config");
  if (!text) p.throw_if_any(label);
  prefix = "text_config.";
  Fields tf(*text, prefix, p);
  std::string inner_type;
  if (tf.get_str("model_type", inner_type) && inner_type != "kimi_linear") {
    p.add("unsupported text_config.model_type \"" + inner_type + "\" (expected \"kimi_linear\")");
  }
  return *text;
}

// tie_word_embeddings may sit in the wrapper, the text config, or both; any `true` ties.
void parse_tie_word_embeddings(Sections& s) {
  bool tie_text = false, tie_top = false;
  const bool in_text = s.t.has("tie_word_embeddings");
  const bool in_top = s.nested && s.top.has("tie_word_embeddings");
  if (!in_text && !in_top) {
    s.p.add("missing key " + s.t.name("tie_word_embeddings"));
    return;
  }
  if (in_text) s.t.get_bool("tie_word_embeddings", tie_text);
  if (in_top) s.top.get_bool("tie_word_embeddings", tie_top);
  s.c.tie_word_embeddings = tie_text || tie_top;
}

void parse_trunk(Sections& s) {
  ModelConfig& c = s.c;
  s.pos("hidden_size", c.hidden_size);
  if (s.t.get_int("num_hidden_layers", c.num_hidden_layers)) {
    require_range(s.p, s.t.name("num_hidden_layers"), c.num_hidden_layers, 1, kMaxLayers);
    s.n_known = c.num_hidden_layers >= 1 && c.num_hidden_layers <= kMaxLayers;
  }
  s.pos("vocab_size", c.vocab_size);
  if (s.t.get_num("rms_norm_eps", c.rms_norm_eps) && !(c.rms_norm_eps > 0 && c.rms_norm_eps < 1)) {
    s.p.add(s.t.name("rms_norm_eps") + " = " + fmt_double(c.rms_norm_eps) + " must be in (0, 1)");
  }
  parse_tie_word_embeddings(s);
  // Kimi Linear states its context as model_max_length only; max_position_embeddings wins when both are given.
  const bool alt = !s.t.has("max_position_embeddings") && s.t.has("model_max_length");
  s.pos(alt ? "model_max_length" : "max_position_embeddings", c.max_position_embeddings, kMaxPositions);
}

// hidden_act selects the GLU activation; SiTU needs its two caps.
void parse_ffn(Sections& s) {
  ModelConfig& c = s.c;
  const bool act_ok = s.t.get_str("hidden_act", c.hidden_act);
  c.activation = c.hidden_act == "situ"   ? FfnActivation::SiTU
                 : c.hidden_act == "silu" ? FfnActivation::SiLU
                                          : FfnActivation::Other;
  const bool situ_keys = !act_ok || c.activation == FfnActivation::SiTU;  // unknown member: K3's keys
  s.positive_num("activation_situ_beta", c.situ_beta, situ_keys);
  s.positive_num("activation_situ_linear_beta", c.situ_linear_beta, situ_keys);
  s.pos("intermediate_size", c.intermediate_size);
  if (s.t.get_int("first_k_dense_replace", c.first_k_dense_replace)) {
    if (c.first_k_dense_replace < 0) {
      s.p.add(s.t.name("first_k_dense_replace") + " = " + std::to_string(c.first_k_dense_replace) + " must be >= 0");
    } else if (s.n_known && c.first_k_dense_replace > c.num_hidden_layers) {
      s.p.add(s.t.name("first_k_dense_replace") + " = " + std::to_string(c.first_k_dense_replace) +
              " exceeds num_hidden_layers " + std::to_string(c.num_hidden_layers));
    }
  }
  if (s.t.get_int("moe_layer_freq", c.moe_layer_freq)) {
    require_range(s.p, s.t.name("moe_layer_freq"), c.moe_layer_freq, 1, kMaxLayers);
  }
}

// Experts, the latent projection (present: Stable LatentMoE; absent: experts in the hidden space)
// and the router's activation.
void parse_moe(Sections& s) {
  ModelConfig& c = s.c;
  const bool experts_ok = s.t.get_int("num_experts", c.num_experts);
  if (experts_ok) require_range(s.p, s.t.name("num_experts"), c.num_experts, 1, kMaxDim);
  if (s.t.get_int("num_experts_per_token", c.num_experts_per_token)) {
    if (c.num_experts_per_token < 1) {
      s.p.add(s.t.name("num_experts_per_token") + " = " + std::to_string(c.num_experts_per_token) + " must be >= 1");
    } else if (experts_ok && c.num_experts >= 1 && c.num_experts_per_token > c.num_experts) {
      s.p.add(s.t.name("num_experts_per_token") + " = " + std::to_string(c.num_experts_per_token) +
              " exceeds num_experts " + std::to_string(c.num_experts));
    }
  }
  if (s.t.get_int("num_shared_experts", c.num_shared_experts)) {
    require_range(s.p, s.t.name("num_shared_experts"), c.num_shared_experts, 0, 1024);
  }
  s.pos("moe_intermediate_size", c.moe_intermediate_size);
  c.moe_kind = s.t.has("routed_expert_hidden_size") ? MoeKind::Latent : MoeKind::Hidden;
  if (c.moe_kind == MoeKind::Latent) s.pos("routed_expert_hidden_size", c.routed_expert_hidden_size);
  c.latent_moe_use_norm = false;  // stays false for Hidden experts without the key
  s.t.get_bool("latent_moe_use_norm", c.latent_moe_use_norm, c.moe_kind == MoeKind::Latent);
  s.t.get_bool("moe_renormalize", c.moe_renormalize);
  if (s.t.get_str("moe_router_activation_func", c.router_activation_name)) {
    const std::string& fn = c.router_activation_name;
    c.router_activation = fn == "sigmoid"   ? RouterActivation::Sigmoid
                          : fn == "softmax" ? RouterActivation::Softmax
                                            : RouterActivation::Other;
  }
  s.positive_num("routed_scaling_factor", c.routed_scaling_factor);
}

// Optional selection keys: absent means the plain bias-corrected top-k over one group.
void parse_expert_selection(Sections& s) {
  ModelConfig& c = s.c;
  s.t.get_str("topk_method", c.topk_method, false);
  s.t.get_bool("use_grouped_topk", c.use_grouped_topk, false);
  const bool experts_known = c.num_experts >= 1 && c.num_experts <= kMaxDim;
  if (s.t.get_int("num_expert_group", c.num_expert_group, false)) {
    const std::string nm = s.t.name("num_expert_group");
    if (c.num_expert_group < 1) {
      s.p.add(nm + " = " + std::to_string(c.num_expert_group) + " must be >= 1");
    } else if (experts_known && c.num_experts % c.num_expert_group != 0) {
      s.p.add(nm + " = " + std::to_string(c.num_expert_group) + " does not divide num_experts " +
              std::to_string(c.num_experts));
    }
  }
  if (s.t.get_int("topk_group", c.topk_group, false)) {
    const std::string nm = s.t.name("topk_group");
    if (c.topk_group < 1) {
      s.p.add(nm + " = " + std::to_string(c.topk_group) + " must be >= 1");
    } else if (c.num_expert_group >= 1 && c.topk_group > c.num_expert_group) {
      s.p.add(nm + " = " + std::to_string(c.topk_group) + " exceeds num_expert_group " +
              std::to_string(c.num_expert_group));
    }
  }
}

// MLA: q_lora_rank null is a member without the query LoRA; the output gate is absent unless stated.
void parse_mla(Sections& s) {
  ModelConfig& c = s.c;
  s.pos("num_attention_heads", c.num_attention_heads);
  const json* q = s.t.find("q_lora_rank");
  c.mla_q_lora = !(q && q->is_null());
  if (c.mla_q_lora) s.pos("q_lora_rank", c.q_lora_rank);
  s.pos("kv_lora_rank", c.kv_lora_rank);
  s.pos("qk_nope_head_dim", c.qk_nope_head_dim);
  // The "rope" slot is present but never rotated in K3 (§3.6); zero width would be a coherent variant.
  if (s.t.get_int("qk_rope_head_dim", c.qk_rope_head_dim)) {
    require_range(s.p, s.t.name("qk_rope_head_dim"), c.qk_rope_head_dim, 0, kMaxDim);
  }
  s.pos("v_head_dim", c.v_head_dim);
  s.t.get_bool("mla_use_nope", c.mla_use_nope);
  c.mla_use_output_gate = false;
  s.t.get_bool("mla_use_output_gate", c.mla_use_output_gate, false);
}

// Block AttnRes when attn_res_block_size is given, else the plain residual sum.
void parse_attn_res(Sections& s) {
  ModelConfig& c = s.c;
  c.residual = s.t.has("attn_res_block_size") ? ResidualKind::BlockAttnRes : ResidualKind::PlainSum;
  if (c.residual == ResidualKind::BlockAttnRes) s.pos("attn_res_block_size", c.attn_res_block_size, kMaxLayers);
}

void parse_kda(Sections& s, const std::string& prefix) {
  ModelConfig& c = s.c;
  const json* lin = s.t.get_object("linear_attn_config");
  if (!lin) return;
  const std::string lp = prefix + "linear_attn_config.";
  Fields l(*lin, lp, s.p);
  ProblemList& p = s.p;
  const bool full_ok = l.get_int_list("full_attn_layers", c.full_attn_layers);
  const bool kda_ok = l.get_int_list("kda_layers", c.kda_layers);
  if (full_ok && kda_ok) validate_layer_lists(p, lp, c.full_attn_layers, c.kda_layers, c.num_hidden_layers, s.n_known);
  if (l.get_int("num_heads", c.kda_num_heads)) require_range(p, l.name("num_heads"), c.kda_num_heads, 1, kMaxDim);
  if (l.get_int("head_dim", c.kda_head_dim)) require_range(p, l.name("head_dim"), c.kda_head_dim, 1, kMaxDim);
  if (l.get_int("short_conv_kernel_size", c.short_conv_kernel_size)) {
    require_range(p, l.name("short_conv_kernel_size"), c.short_conv_kernel_size, 1, 1024);
  }
  // Optional family keys: absent = the unbounded decay gate and the low-rank output gate.
  c.kda_gate_bounded = l.has("gate_lower_bound");
  if (l.get_num("gate_lower_bound", c.gate_lower_bound, false) && !(c.gate_lower_bound < 0)) {
    p.add(l.name("gate_lower_bound") + " = " + fmt_double(c.gate_lower_bound) + " must be < 0");
  }
  c.use_full_rank_gate = false;
  l.get_bool("use_full_rank_gate", c.use_full_rank_gate, false);
}

// Special tokens: wrapper level wins; a text_config copy must agree.
void parse_special_tokens(Sections& s) {
  ModelConfig& c = s.c;
  struct Tok {
    const char* key;
    int64_t* out;
  };
  const Tok toks[3] = {
      {"bos_token_id", &c.bos_token_id}, {"eos_token_id", &c.eos_token_id}, {"pad_token_id", &c.pad_token_id}};
  for (const Tok& tk : toks) {
    int64_t v_top = -1, v_text = -1;
    bool p_top = false, p_text = false;
    read_token_id(s.top, tk.key, v_top, p_top);
    if (s.nested) read_token_id(s.t, tk.key, v_text, p_text);
    if (p_top && p_text && v_top != v_text) {
      s.p.add(std::string(tk.key) + " " + std::to_string(v_top) + " disagrees with " + s.t.name(tk.key) + " " +
              std::to_string(v_text));
      continue;
    }
    if (!p_top && !p_text) continue;
    const int64_t v = p_top ? v_top : v_text;
    const std::string nm = p_top ? std::string(tk.key) : s.t.name(tk.key);
    if (v < 0 || (c.vocab_size > 0 && v >= c.vocab_size)) {
      s.p.add(nm + " = " + std::to_string(v) + " is outside 0.." + std::to_string(c.vocab_size - 1));
      continue;
    }
    *tk.out = v;
  }
}

}  // namespace

bool ModelConfig::is_kda(int64_t layer) const {
  return std::find(kda_layers.begin(), kda_layers.end(), layer + 1) != kda_layers.end();
}

std::string ModelConfig::family_summary() const {
  std::string s = activation == FfnActivation::SiTU
                      ? "SiTU-GLU (beta " + fmt_double(situ_beta) + " / " + fmt_double(situ_linear_beta) + ")"
                      : "\"" + hidden_act + "\"-GLU";
  s += residual == ResidualKind::BlockAttnRes
           ? ", Block AttnRes (blocks of " + std::to_string(attn_res_block_size) + ")"
           : ", plain residual sum";
  s += moe_kind == MoeKind::Latent
           ? ", latent MoE (" + std::to_string(routed_expert_hidden_size) + (latent_moe_use_norm ? ", normed)" : ")")
           : ", MoE in the hidden space";
  s += ", router " + router_activation_name + (topk_method.empty() ? "" : " " + topk_method);
  if (num_expert_group != 1)
    s += ", top-" + std::to_string(topk_group) + " of " + std::to_string(num_expert_group) + " groups";
  s += std::string(mla_use_nope ? ", MLA NoPE" : ", MLA RoPE") + (mla_q_lora ? "" : " without q LoRA") +
       (mla_use_output_gate ? ", gated" : "");
  s += std::string(", KDA ") + (kda_gate_bounded ? "bounded" : "unbounded") + " decay, " +
       (use_full_rank_gate ? "full-rank" : "low-rank") + " output gate";
  if (tie_word_embeddings) s += ", tied embeddings";
  return s;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& label) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw Error(label + ": invalid JSON: " + what);
  }
  if (!root.is_object()) throw Error(label + ": config must be a JSON object, got " + std::string(root.type_name()));

  ProblemList p;
  ModelConfig c;
  c.source = label;
  Fields top(root, "", p);
  std::string prefix;
  const json& text = find_text_config(root, top, c, p, label, prefix);
  Fields t(text, prefix, p);
  Sections s{c, p, top, t, &text != &root};
  parse_trunk(s);
  parse_ffn(s);
  parse_moe(s);
  parse_expert_selection(s);
  parse_mla(s);
  parse_attn_res(s);
  parse_kda(s, prefix);
  parse_special_tokens(s);
  p.throw_if_any(label);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) file /= "config.json";
  const std::string label = file.string();
  if (!fs::exists(file, ec)) throw Error(label + ": config file not found");
  if (fs::is_directory(file, ec)) throw Error(label + ": is a directory, expected config.json");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(label + ": cannot open config file for reading");
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) throw Error(label + ": read error");
  return parse_model_config(buf.str(), label);
}

}  // namespace k3
