// Streamed routed experts: read plans, the LRU slot cache, pread / O_DIRECT reads (see expert_cache.h).
#include "runtime/expert_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>

#include "core/error.h"
#include "io/safetensors.h"
#include "runtime/memory.h"

namespace k3 {

namespace {

constexpr uint64_t kDirectAlign = 4096;  // O_DIRECT offset/length/address alignment (covers 512 B devices)
constexpr uint64_t kBufferAlign = 64;    // buffered reads: offsets keep their alignment modulo a cache line

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }

uint64_t data_bytes(const WeightMat& w) {
  const uint64_t n = uint64_t(w.rows) * uint64_t(w.cols);
  switch (w.fmt) {
    case WFormat::F32:
      return 4 * n;
    case WFormat::F16:
    case WFormat::BF16:
      return 2 * n;
    case WFormat::MXFP4:
      return n / 2;
    case WFormat::FP8:  // never a routed expert (--trunk-fp8 quantises the trunk only)
      return n;
  }
  return 0;
}
uint64_t scale_bytes(const WeightMat& w) {
  return w.fmt == WFormat::MXFP4 ? uint64_t(w.rows) * uint64_t(w.cols) / 32 : 0;
}

std::string errno_text(int e) { return std::strerror(e); }

}  // namespace

struct ExpertCache::Shard {
  std::string path;
  uint64_t mapped_size = 0;
  int fd = -1;
  ~Shard() {
    if (fd >= 0) ::close(fd);
  }
};

uint64_t ExpertCache::build_plans(const Model& m, bool direct_io, std::vector<Plan>& plans,
                                  std::vector<io::TensorLocation>& shards, uint64_t& expert_bytes, int64_t& count) {
  const int64_t E = m.dims().moe.experts;
  const uint64_t align = direct_io ? kDirectAlign : kBufferAlign;
  plans.assign(size_t(m.dims().layers * E), Plan{});
  expert_bytes = 0;
  count = 0;
  uint64_t slot = 0;
  struct Part {
    int idx;  // 0..5 as Plan::off
    io::TensorLocation loc;
  };
  for (int64_t L = 0; L < m.dims().layers; ++L) {
    const LayerWeights& lw = m.layers[size_t(L)];
    if (lw.dense_ffn) continue;
    for (int64_t e = 0; e < E; ++e) {
      Plan& p = plans[size_t(L * E + e)];
      p.tmpl = lw.moe.experts[size_t(e)];
      std::vector<Part> parts;
      const WeightMat* mats[3] = {&p.tmpl.gate, &p.tmpl.up, &p.tmpl.down};
      for (int k = 0; k < 3; ++k) {
        const WeightMat& w = *mats[k];
        const std::pair<const void*, uint64_t> pieces[2] = {{w.data, data_bytes(w)}, {w.scales, scale_bytes(w)}};
        for (int j = 0; j < 2; ++j) {
          if (pieces[j].second == 0) continue;
          auto loc = m.checkpoint().locate(static_cast<const uint8_t*>(pieces[j].first), pieces[j].second);
          if (!loc)
            fail("routed expert " + std::to_string(e) + " of layer " + std::to_string(L) +
                 ": its weights are not inside a mapped shard");
          if (loc->shard >= shards.size()) shards.resize(loc->shard + 1);
          shards[loc->shard] = *loc;  // path and mapped size of this shard
          parts.push_back({2 * k + j, *loc});
          expert_bytes += pieces[j].second;
        }
      }
      std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) {
        return a.loc.shard != b.loc.shard ? a.loc.shard < b.loc.shard : a.loc.offset < b.loc.offset;
      });
      // Byte ranges that touch (buffered) or whose aligned spans touch (O_DIRECT) are one read.
      uint64_t cursor = 0;
      for (size_t i = 0; i < parts.size();) {
        const io::TensorLocation& first = parts[i].loc;
        uint64_t end = first.offset + first.nbytes;
        size_t j = i + 1;
        for (; j < parts.size(); ++j) {
          const io::TensorLocation& nx = parts[j].loc;
          if (nx.shard != first.shard) break;
          const bool joins = direct_io ? round_down(nx.offset, align) <= round_up(end, align) : nx.offset <= end;
          if (!joins) break;
          end = std::max(end, nx.offset + nx.nbytes);
        }
        ReadOp op;
        op.fd = int32_t(first.shard);
        op.offset = direct_io ? round_down(first.offset, align) : first.offset;
        op.length = direct_io ? round_up(end, align) - op.offset : end - op.offset;
        op.needed = end - op.offset;
        // In the slot, bytes keep their file offset's alignment modulo `align` (as in the mapping,
        // whose base is page-aligned), so kernels see the same alignment either way.
        op.dst = direct_io ? cursor : round_up(cursor, align) + op.offset % align;
        for (size_t k = i; k < j; ++k) p.off[parts[k].idx] = op.dst + (parts[k].loc.offset - op.offset);
        cursor = op.dst + op.length;
        p.ops.push_back(op);
        i = j;
      }
      slot = std::max(slot, cursor);
      ++count;
    }
  }
  return round_up(std::max<uint64_t>(slot, 1), kDirectAlign);
}

uint64_t ExpertCache::slot_bytes_for(const Model& m, bool direct_io) {
  std::vector<Plan> plans;
  std::vector<io::TensorLocation> shards;
  uint64_t bytes = 0;
  int64_t count = 0;
  return build_plans(m, direct_io, plans, shards, bytes, count);
}

ExpertCache::ExpertCache(const Model& m, const ExpertCacheOptions& opt) : model_(m), direct_(opt.direct_io) {
  experts_ = m.dims().moe.experts;
  std::vector<io::TensorLocation> shards;
  slot_bytes_ = build_plans(m, direct_, plans_, shards, expert_bytes_, expert_count_);
  min_experts_ = expert_count_ ? std::min(m.dims().moe.top_k, experts_) : 0;
  const uint64_t fit = opt.capacity_bytes / slot_bytes_;
  if (expert_count_ > 0 && fit < uint64_t(min_experts_))
    fail("expert cache of " + human_bytes(opt.capacity_bytes) + " cannot hold the " + std::to_string(min_experts_) +
         " experts one MoE call needs at minimum (" + human_bytes(slot_bytes_) + " each, " +
         human_bytes(uint64_t(min_experts_) * slot_bytes_) + " in all)");
  max_slots_ = int64_t(std::min<uint64_t>(fit, uint64_t(expert_count_)));
  slot_of_.assign(plans_.size(), -1);
  slots_.reserve(size_t(max_slots_));  // out[] points into slots_: it must never reallocate

  // Our own descriptors (not the mapping), checked against the size each shard had when mapped.
  fds_.resize(shards.size());
  for (const Plan& p : plans_)
    for (const ReadOp& op : p.ops) {
      auto& sh = fds_[size_t(op.fd)];
      if (sh) continue;
      sh = std::make_unique<Shard>();
      sh->path = shards[size_t(op.fd)].path;
      const int flags = O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
      sh->fd = ::open(sh->path.c_str(), flags);
      if (sh->fd < 0) {
        const int e = errno;
        if (direct_ && e == EINVAL)
          fail(sh->path + ": cannot open with O_DIRECT (--direct-io): the filesystem does not support direct I/O");
        fail(sh->path + ": cannot open for expert reads: " + errno_text(e));
      }
      struct stat st {};
      if (::fstat(sh->fd, &st) != 0) fail(sh->path + ": cannot stat: " + errno_text(errno));
      sh->mapped_size = shards[size_t(op.fd)].file_size;
      if (uint64_t(st.st_size) != sh->mapped_size)
        fail(sh->path + ": the file changed size since it was loaded (" + std::to_string(sh->mapped_size) + " -> " +
             std::to_string(uint64_t(st.st_size)) + " bytes)");
    }
}

ExpertCache::~ExpertCache() {
  for (Slot& s : slots_) std::free(s.buf);
}

void ExpertCache::fetch(int64_t layer, const int32_t* ids, int64_t n, const GluWeights** out) {
  if (layer < 0 || layer >= model_.dims().layers || model_.layers[size_t(layer)].dense_ffn)
    fail("expert cache: layer " + std::to_string(layer) + " has no routed experts");
  if (n > max_slots_)
    fail("expert cache: a fetch of " + std::to_string(n) + " experts exceeds the " + std::to_string(max_slots_) +
         " the cache holds");
  ++stats_.fetches;
  ++clock_;
  // Hits first, so that none of this batch's cached experts is evicted for another of its misses.
  std::vector<int64_t> missing;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= experts_)
      fail("expert cache: expert id " + std::to_string(ids[i]) + " is outside [0, " + std::to_string(experts_) + ")");
    const int64_t key = layer * experts_ + ids[i];
    const int32_t s = slot_of_[size_t(key)];
    if (s >= 0) {
      if (slots_[size_t(s)].last_use == clock_)
        fail("expert cache: expert " + std::to_string(ids[i]) + " asked for twice in one fetch");
      slots_[size_t(s)].last_use = clock_;
      out[i] = &slots_[size_t(s)].w;
      ++stats_.hits;
    } else {
      missing.push_back(i);
    }
  }
  for (int64_t i : missing) {
    const int64_t key = layer * experts_ + ids[i];
    if (slot_of_[size_t(key)] >= 0)
      fail("expert cache: expert " + std::to_string(ids[i]) + " asked for twice in one fetch");
    size_t victim;
    if (int64_t(slots_.size()) < max_slots_) {
      void* p = std::aligned_alloc(kDirectAlign, slot_bytes_);
      if (!p) throw std::bad_alloc();
      slots_.push_back(Slot{static_cast<uint8_t*>(p), -1, 0, {}});
      victim = slots_.size() - 1;
    } else {
      // Least recently used slot outside this batch (n <= max_slots_ guarantees one).
      victim = slots_.size();
      for (size_t s = 0; s < slots_.size(); ++s)
        if (slots_[s].last_use != clock_ && (victim == slots_.size() || slots_[s].last_use < slots_[victim].last_use))
          victim = s;
      Slot& v = slots_[victim];
      if (v.key >= 0) {
        slot_of_[size_t(v.key)] = -1;
        v.key = -1;
        ++stats_.evictions;
      }
    }
    Slot& s = slots_[victim];
    load(s, key);
    s.last_use = clock_;
    slot_of_[size_t(key)] = int32_t(victim);
    out[i] = &s.w;
    ++stats_.misses;
  }
}

void ExpertCache::load(Slot& s, int64_t key) {
  const Plan& p = plans_[size_t(key)];
  s.key = -1;  // a failed read leaves the slot empty, never half-filled under a key
  for (const ReadOp& op : p.ops) {
    const Shard& sh = *fds_[size_t(op.fd)];
    uint64_t done = 0;
    while (done < op.needed) {
      const ssize_t r = ::pread(sh.fd, s.buf + op.dst + done, size_t(op.length - done), off_t(op.offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        fail(sh.path + ": read error at offset " + std::to_string(op.offset + done) + " (" +
             std::to_string(op.length - done) + " bytes of routed-expert weights): " + errno_text(errno));
      if (r == 0) short_read(op, done);
      done += uint64_t(r);
    }
    stats_.bytes_read += op.length;
    ++stats_.reads;
  }
  GluWeights w = p.tmpl;
  WeightMat* mats[3] = {&w.gate, &w.up, &w.down};
  for (int k = 0; k < 3; ++k) {
    mats[k]->data = s.buf + p.off[2 * k];
    mats[k]->scales = mats[k]->scales ? s.buf + p.off[2 * k + 1] : nullptr;
  }
  s.w = w;
  s.key = key;
}

void ExpertCache::short_read(const ReadOp& op, uint64_t got) const {
  const Shard& sh = *fds_[size_t(op.fd)];
  struct stat st {};
  const bool stat_ok = ::fstat(sh.fd, &st) == 0;
  std::string why = "the file is shorter than its header says";
  if (stat_ok && uint64_t(st.st_size) != sh.mapped_size)
    why = "the file changed size since it was loaded (" + std::to_string(sh.mapped_size) + " -> " +
          std::to_string(uint64_t(st.st_size)) + " bytes)";
  fail(sh.path + ": short read of routed-expert weights at offset " + std::to_string(op.offset) + " (got " +
       std::to_string(got) + " of " + std::to_string(op.needed) + " bytes): " + why);
}

// ---------------------------------------------------------------- budget accounting
ExpertTensorTotals expert_tensor_totals(const io::Checkpoint& ck) {
  ExpertTensorTotals t;
  std::map<std::string, uint64_t> per_expert;  // "...experts.N." -> bytes
  uint64_t total = 0;
  for (const std::string& name : ck.names()) {
    const TensorView* v = ck.find(name);
    total += v->nbytes;
    if (!is_routed_expert_tensor(name)) continue;
    const std::string marker = ".block_sparse_moe.experts.";
    const size_t at = name.find(marker) + marker.size();
    const size_t dot = name.find('.', at);
    per_expert[name.substr(0, dot == std::string::npos ? name.size() : dot + 1)] += v->nbytes;
    t.expert_bytes += v->nbytes;
  }
  t.trunk_bytes = total - t.expert_bytes;
  t.experts = int64_t(per_expert.size());
  for (const auto& [k, b] : per_expert) t.max_expert_bytes = std::max(t.max_expert_bytes, b);
  return t;
}

uint64_t ram_budget_cache_bytes(uint64_t budget, const ExpertTensorTotals& t, int64_t top_k, uint64_t slot_bytes) {
  const uint64_t k = t.experts > 0 ? uint64_t(std::max<int64_t>(top_k, 1)) : 0;
  const uint64_t need = t.trunk_bytes + k * slot_bytes;
  if (budget < need)
    fail("--ram-budget " + human_bytes(budget) + " is too small: the resident trunk takes " +
         human_bytes(t.trunk_bytes) + " and one MoE call needs " + std::to_string(k) + " experts of " +
         human_bytes(slot_bytes) + "; the smallest budget is " + human_bytes(need) + " (" + std::to_string(need) +
         " bytes)");
  return budget - t.trunk_bytes;
}

std::unique_ptr<ExpertCache> make_budget_expert_cache(const Model& m, uint64_t budget, bool direct_io) {
  const ExpertTensorTotals t = expert_tensor_totals(m.checkpoint());
  const uint64_t slot = ExpertCache::slot_bytes_for(m, direct_io);
  const int64_t top_k = std::min(m.dims().moe.top_k, m.dims().moe.experts);
  const uint64_t cap = ram_budget_cache_bytes(budget, t, top_k, slot);
  return std::make_unique<ExpertCache>(m, ExpertCacheOptions{cap, direct_io});
}

}  // namespace k3
