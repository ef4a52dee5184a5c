// Memory plan, /proc/meminfo, peak RSS and size parsing (see memory.h).
#include "runtime/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "ops/ops.h"

namespace k3 {

MemoryPlan plan_memory(const ModelConfig& c, uint64_t weight_bytes, int64_t ctx, int64_t ubatch) {
  MemoryPlan p;
  p.weights = weight_bytes;
  int64_t n_kda = 0, n_mla = 0;
  for (int64_t L = 0; L < c.num_hidden_layers; ++L) (c.is_kda(L) ? n_kda : n_mla)++;
  const uint64_t D = uint64_t(c.kda_dim());
  p.kda_state =
      uint64_t(n_kda) * 4 *
      (uint64_t(c.kda_num_heads) * c.kda_head_dim * c.kda_head_dim + 3 * D * uint64_t(c.short_conv_kernel_size - 1));
  p.mla_cache =
      uint64_t(n_mla) * 4 * uint64_t(std::max<int64_t>(ctx, 0)) * uint64_t(c.kv_lora_rank + c.qk_rope_head_dim);
  // Working set of one ubatch: the depth state (block snapshots + partial sum), a handful of
  // hidden-sized temporaries, the widest projection (KDA q/k/v + gates, MLA heads, the MoE
  // expert rows of one token) and the MLA attention's workspace; plus last-token logits.
  const uint64_t H = uint64_t(c.hidden_size), T = uint64_t(std::max<int64_t>(ubatch, 1));
  const uint64_t blocks = uint64_t(c.num_hidden_layers / std::max<int64_t>(c.attn_res_block_size, 1) + 2);
  const uint64_t mla_w = uint64_t(c.num_attention_heads) * uint64_t(c.mla_qk_head_dim() + c.v_head_dim) * 2;
  const uint64_t moe_w =
      uint64_t(c.num_experts_per_token + c.num_shared_experts) * uint64_t(c.moe_intermediate_size) * 2 +
      uint64_t(c.num_experts);
  const uint64_t widest = std::max({6 * D, mla_w, moe_w, uint64_t(c.intermediate_size) * 2});
  // MLA attention runs an online softmax over key blocks, so nothing of size ubatch x context: the
  // larger of the tiled prefill's key tile (latent rows and their transpose, k_r, per-head keys and
  // values) with its running max/sum per query and head, and the absorbed form's latent queries and
  // contexts (blocks of <= 4M floats each); plus a score row per thread over the context (exact
  // numerics' scalar kernels). (--mla expanded under exact numerics is a reference path that
  // expands the whole cache per call: not planned.)
  uint64_t mla_ws = 0;
  if (n_mla > 0) {
    const uint64_t Hm = uint64_t(c.num_attention_heads), L = uint64_t(c.kv_lora_rank),
                   R = uint64_t(c.qk_rope_head_dim);
    const MlaAttnDims md{c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank,
                         1.0f};
    const uint64_t KT = uint64_t(ops::mla_tiled_key_tile(md));
    const uint64_t tiled = KT * (2 * L + R) + Hm * KT * uint64_t(c.qk_nope_head_dim + c.v_head_dim) + 2 * Hm * T;
    const uint64_t absorbed = 2 * std::min<uint64_t>(T * Hm * L, uint64_t(1) << 22);
    mla_ws = std::max(tiled, absorbed) + uint64_t(par::hardware_threads()) * uint64_t(std::max<int64_t>(ctx, 1));
  }
  // The step's activations: the forward's own planned workspace (model/forward.cpp) for ubatch rows
  // where the config binds (the estimate above otherwise, e.g. for a family member it cannot run).
  uint64_t acts = 0;
  try {
    acts = uint64_t(forward_work_floats(ModelDims::from_config(c), int64_t(T)));
  } catch (const Error&) {
    acts = T * (H * (blocks + 8) + widest) + uint64_t(c.vocab_size);
  }
  p.scratch = 4 * (acts + mla_ws);
  return p;
}

std::optional<uint64_t> mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return std::nullopt;
}

uint64_t peak_rss_bytes() {
  struct rusage ru {};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return uint64_t(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

uint64_t current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * uint64_t(sysconf(_SC_PAGESIZE));
}

uint64_t parse_size(const std::string& text, const std::string& what) {
  const auto bad = [&] { fail(what + " must be a size like 512M, 24G or 1.5GiB, got '" + text + "'"); };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) bad();
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(text.substr(0, i), &used);
    if (used != i) bad();
  } catch (const std::logic_error&) {
    bad();
  }
  std::string u = text.substr(i);
  for (auto& ch : u) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  double mul = 1;
  if (u.empty() || u == "B")
    mul = 1;
  else if (u == "K" || u == "KB" || u == "KIB")
    mul = 1024.0;
  else if (u == "M" || u == "MB" || u == "MIB")
    mul = 1024.0 * 1024;
  else if (u == "G" || u == "GB" || u == "GIB")
    mul = 1024.0 * 1024 * 1024;
  else if (u == "T" || u == "TB" || u == "TIB")
    mul = 1024.0 * 1024 * 1024 * 1024;
  else
    bad();
  const double bytes = v * mul;
  if (!std::isfinite(bytes) || bytes < 1 || bytes > 1.8e19) bad();
  return uint64_t(bytes);
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace k3
