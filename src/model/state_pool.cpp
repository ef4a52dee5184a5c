// Slots, pages, fork and snapshots of the state pool (see state_pool.h).
#include "model/state_pool.h"

#include <algorithm>

#include "core/error.h"
#include "model/remote.h"

namespace k3 {

namespace {
size_t fbytes(int64_t n) { return size_t(n) * 4; }
}  // namespace

StatePool::StatePool(Backend& be, const ModelDims& d, std::vector<bool> is_kda, const StatePoolOptions& o)
    : be_(be), d_(d), is_kda_(std::move(is_kda)), opt_(o) {
  if (opt_.page_tokens < 1) fail("state pool: page_tokens must be >= 1");
  opt_.initial_slots = std::max<int64_t>(1, opt_.initial_slots);
  opt_.initial_pages = std::max<int64_t>(1, opt_.initial_pages);
  int64_t nk = 0, nm = 0;
  for (bool k : is_kda_) ordinal_.push_back(k ? nk++ : nm++);
  kda_.assign(size_t(nk), KdaPool{});
  mla_.assign(size_t(nm), nullptr);
  grow_slots();
  grow_pages();
}

StatePool::~StatePool() {
  if (remote_) remote_->drop_pool(remote_id_);
  for (KdaPool& p : kda_) {
    be_.release(p.S);
    for (float* c : p.conv) be_.release(c);
  }
  for (float* p : mla_) be_.release(p);
}

void StatePool::grow_slots() {
  const int64_t old = int64_t(slots_.size()), cap = old ? 2 * old : opt_.initial_slots;
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  for (KdaPool& p : kda_) {
    const auto regrow = [&](float*& buf, int64_t per, const char* what) {
      if (per == 0) return;
      auto* nb = static_cast<float*>(be_.alloc(fbytes(cap * per), what));
      if (buf) be_.copy(nb, buf, fbytes(old * per));
      be_.release(buf);
      buf = nb;
    };
    regrow(p.S, sf, "KDA state pool");
    for (float*& c : p.conv) regrow(c, cf, "KDA conv state pool");
  }
  slots_.resize(size_t(cap));
  for (int64_t s = cap - 1; s >= old; --s) free_slots_.push_back(int32_t(s));
  ++epoch_;
}

void StatePool::grow_pages() {
  const int64_t old = int64_t(page_refs_.size()), cap = old ? 2 * old : opt_.initial_pages;
  const int64_t per = opt_.page_tokens * d_.mla.cache_floats_per_token();
  for (float*& p : mla_) {
    auto* nb = static_cast<float*>(be_.alloc(fbytes(cap * per), "MLA latent cache pages"));
    if (p) be_.copy(nb, p, fbytes(old * per));
    be_.release(p);
    p = nb;
  }
  page_refs_.resize(size_t(cap), 0);
  for (int64_t q = cap - 1; q >= old; --q) free_pages_.push_back(int32_t(q));
  ++epoch_;
}

bool StatePool::live(int32_t slot) const {
  return slot >= 0 && size_t(slot) < slots_.size() && slots_[size_t(slot)].live;
}

void StatePool::check_live(int32_t slot) const {
  if (!live(slot)) fail("state pool: slot " + std::to_string(slot) + " is not a live sequence");
}

void StatePool::zero_state(int32_t slot) {
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  for (KdaPool& p : kda_) {
    if (sf) be_.zero(p.S + slot * sf, fbytes(sf));
    for (float* c : p.conv)
      if (cf) be_.zero(c + slot * cf, fbytes(cf));
  }
}

void StatePool::copy_state(int32_t dst, int32_t src) {
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  for (KdaPool& p : kda_) {
    if (sf) be_.copy(p.S + dst * sf, p.S + src * sf, fbytes(sf));
    for (float* c : p.conv)
      if (cf) be_.copy(c + dst * cf, c + src * cf, fbytes(cf));
  }
}

int32_t StatePool::alloc_here() {
  if (free_slots_.empty()) grow_slots();
  const int32_t s = free_slots_.back();
  free_slots_.pop_back();
  // The block table keeps its capacity across free and reuse, and starts with room for
  // kReservedPages pages, so a decode step that opens a page allocates nothing.
  Slot& sl = slots_[size_t(s)];
  sl.live = true;
  sl.pos = 0;
  sl.pages.clear();
  sl.pages.reserve(kReservedPages);
  zero_state(s);
  return s;
}

void StatePool::unref(int32_t page) {
  if (--page_refs_[size_t(page)] == 0) free_pages_.push_back(page);
}

void StatePool::free_here(int32_t slot) {
  check_live(slot);
  Slot& s = slots_[size_t(slot)];
  for (int32_t p : s.pages) unref(p);
  s.live = false;
  s.pos = 0;
  s.pages.clear();  // keeps its capacity for the slot's next user
  free_slots_.push_back(slot);
}

void StatePool::reset_here(int32_t slot) {
  check_live(slot);
  Slot& s = slots_[size_t(slot)];
  for (int32_t p : s.pages) unref(p);
  s.pages.clear();
  s.pos = 0;
  zero_state(slot);
}

int32_t StatePool::fork(int32_t src) {
  check_live(src);
  const int32_t dst = alloc();  // may grow (slots_ reallocates: index again below)
  copy_into(dst, src);
  return dst;
}

void StatePool::copy_into_here(int32_t dst, int32_t src) {
  check_live(dst);
  check_live(src);
  if (dst == src) return;
  Slot& d = slots_[size_t(dst)];
  for (int32_t p : d.pages) unref(p);
  const Slot& s = slots_[size_t(src)];
  d.pos = s.pos;
  d.pages = s.pages;
  for (int32_t p : d.pages) ++page_refs_[size_t(p)];
  copy_state(dst, src);
}

int64_t StatePool::position(int32_t slot) const {
  check_live(slot);
  return slots_[size_t(slot)].pos;
}

int32_t StatePool::new_page() {
  if (free_pages_.empty()) grow_pages();
  const int32_t p = free_pages_.back();
  free_pages_.pop_back();
  page_refs_[size_t(p)] = 1;
  return p;
}

float* StatePool::page_ptr(int64_t mla_ordinal, int32_t page) const {
  return mla_[size_t(mla_ordinal)] + int64_t(page) * opt_.page_tokens * d_.mla.cache_floats_per_token();
}

void StatePool::reserve_append_here(int32_t slot, int64_t n) {
  check_live(slot);
  const int64_t P = opt_.page_tokens;
  {
    // Copy-on-write: the page the next token lands in may be shared with a fork (its tokens beyond
    // this slot's position belong to the other sequence, or to nobody after a rollback).
    Slot& s = slots_[size_t(slot)];
    const int64_t cur = s.pos / P;
    if (s.pos % P != 0 && cur < int64_t(s.pages.size()) && page_refs_[size_t(s.pages[size_t(cur)])] > 1) {
      const int32_t fresh = new_page();
      Slot& s2 = slots_[size_t(slot)];
      const int32_t old = s2.pages[size_t(cur)];
      for (size_t m = 0; m < mla_.size(); ++m)
        be_.copy(page_ptr(int64_t(m), fresh), page_ptr(int64_t(m), old), fbytes(P * d_.mla.cache_floats_per_token()));
      unref(old);
      s2.pages[size_t(cur)] = fresh;
    }
  }
  const int64_t need = (slots_[size_t(slot)].pos + n + P - 1) / P;
  while (int64_t(slots_[size_t(slot)].pages.size()) < need) {
    const int32_t p = new_page();
    slots_[size_t(slot)].pages.push_back(p);
  }
}

void StatePool::advance(int32_t slot, int64_t n) {
  advance_local(slot, n);
  for (auto& sh : shards_) sh->advance(slot, n);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::Advance, slot, n);
}

void StatePool::advance_local(int32_t slot, int64_t n) {
  check_live(slot);
  slots_[size_t(slot)].pos += n;
}

const std::vector<int32_t>& StatePool::pages(int32_t slot) const {
  check_live(slot);
  return slots_[size_t(slot)].pages;
}

KdaPool StatePool::kda(int64_t layer) const {
  if (!is_kda_[size_t(layer)]) fail("state pool: layer " + std::to_string(layer) + " is not a KDA layer");
  return kda_[size_t(ordinal_[size_t(layer)])];
}

MlaPages StatePool::mla(int64_t layer) const {
  if (is_kda_[size_t(layer)]) fail("state pool: layer " + std::to_string(layer) + " is not an MLA layer");
  return MlaPages{mla_[size_t(ordinal_[size_t(layer)])]};
}

StatePool::Snapshot StatePool::snapshot(int32_t slot) const {
  check_live(slot);
  Snapshot sn;
  sn.pos = slots_[size_t(slot)].pos;
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  sn.kda.resize(kda_.size() * size_t(sf + 3 * cf));
  float* o = sn.kda.data();
  for (const KdaPool& p : kda_) {
    if (sf) be_.download(o, p.S + slot * sf, fbytes(sf));
    o += sf;
    for (float* c : p.conv) {
      if (cf) be_.download(o, c + slot * cf, fbytes(cf));
      o += cf;
    }
  }
  for (const auto& sh : shards_) sn.shard_kda.push_back(sh->snapshot(slot).kda);
  if (remote_) sn.remote = remote_->snapshot(remote_id_, slot);
  return sn;
}

void StatePool::restore(int32_t slot, const Snapshot& sn) {
  check_live(slot);
  if (sn.shard_kda.size() != shards_.size() || (remote_ && (!sn.remote || sn.remote->link.get() != remote_.get())))
    fail("session rollback: the mark is not an earlier point of this session");
  // Every rank's part is checked before any is changed.
  for (int64_t r = 0; r < ranks(); ++r) {
    const StatePool& p = rank(r);
    const std::vector<float>& kda = r == 0 ? sn.kda : sn.shard_kda[size_t(r - 1)];
    if (sn.pos > p.slots_[size_t(slot)].pos ||
        kda.size() != p.kda_.size() * size_t(p.d_.kda.state_floats() + 3 * p.d_.kda.conv_floats()))
      fail("session rollback: the mark is not an earlier point of this session");
  }
  restore_here(slot, sn.pos, sn.kda);
  for (size_t i = 0; i < shards_.size(); ++i) shards_[i]->restore_here(slot, sn.pos, sn.shard_kda[i]);
  if (remote_) remote_->restore(remote_id_, slot, *sn.remote);
}

void StatePool::restore_here(int32_t slot, int64_t pos, const std::vector<float>& kda) {
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  Slot& s = slots_[size_t(slot)];
  const float* i = kda.data();
  for (KdaPool& p : kda_) {
    if (sf) be_.upload(p.S + slot * sf, i, fbytes(sf));
    i += sf;
    for (float* c : p.conv) {
      if (cf) be_.upload(c + slot * cf, i, fbytes(cf));
      i += cf;
    }
  }
  const int64_t keep = (pos + opt_.page_tokens - 1) / opt_.page_tokens;
  while (int64_t(s.pages.size()) > keep) {
    unref(s.pages.back());
    s.pages.pop_back();
  }
  s.pos = pos;
}

void StatePool::read_kda(int32_t slot, int64_t layer, std::vector<float>& S, std::vector<float> conv[3]) const {
  refuse_split("read_kda");
  const KdaPool p = kda(layer);
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  S.resize(size_t(sf));
  if (sf) be_.download(S.data(), p.S + slot * sf, fbytes(sf));
  for (int j = 0; j < 3; ++j) {
    conv[j].resize(size_t(cf));
    if (cf) be_.download(conv[j].data(), p.conv[j] + slot * cf, fbytes(cf));
  }
}

void StatePool::write_kda(int32_t slot, int64_t layer, const std::vector<float>& S, const std::vector<float> conv[3]) {
  refuse_split("write_kda");
  const KdaPool p = kda(layer);
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  if (int64_t(S.size()) != sf) fail("state pool: KDA state has the wrong size");
  if (sf) be_.upload(p.S + slot * sf, S.data(), fbytes(sf));
  for (int j = 0; j < 3; ++j) {
    if (int64_t(conv[j].size()) != cf) fail("state pool: KDA conv state has the wrong size");
    if (cf) be_.upload(p.conv[j] + slot * cf, conv[j].data(), fbytes(cf));
  }
}

void StatePool::read_mla(int32_t slot, int64_t layer, std::vector<float>& c, std::vector<float>& kr) const {
  refuse_split("read_mla");
  check_live(slot);
  const int64_t L = d_.mla.kv_lora, rp = d_.mla.rope, W = L + rp, P = opt_.page_tokens;
  const Slot& s = slots_[size_t(slot)];
  mla(layer);  // an MLA layer, or a one-line error
  const int64_t m = ordinal_[size_t(layer)];
  std::vector<float> page(size_t(P * W));
  c.resize(size_t(s.pos * L));
  kr.resize(size_t(s.pos * rp));
  for (int64_t t0 = 0; t0 < s.pos; t0 += P) {
    be_.download(page.data(), page_ptr(m, s.pages[size_t(t0 / P)]), fbytes(P * W));
    for (int64_t t = t0; t < std::min(s.pos, t0 + P); ++t) {
      std::copy_n(page.data() + (t - t0) * W, L, c.data() + t * L);
      std::copy_n(page.data() + (t - t0) * W + L, rp, kr.data() + t * rp);
    }
  }
}

void StatePool::write_mla(int32_t slot, int64_t layer, const std::vector<float>& c, const std::vector<float>& kr) {
  refuse_split("write_mla");
  check_live(slot);
  const int64_t L = d_.mla.kv_lora, rp = d_.mla.rope, W = L + rp, P = opt_.page_tokens;
  const Slot& s = slots_[size_t(slot)];
  if (int64_t(c.size()) != s.pos * L || int64_t(kr.size()) != s.pos * rp)
    fail("state pool: MLA cache contents do not match the slot's position");
  mla(layer);  // an MLA layer, or a one-line error
  const int64_t m = ordinal_[size_t(layer)];
  std::vector<float> page(size_t(P * W), 0.0f);
  for (int64_t t0 = 0; t0 < s.pos; t0 += P) {
    for (int64_t t = t0; t < std::min(s.pos, t0 + P); ++t) {
      std::copy_n(c.data() + t * L, L, page.data() + (t - t0) * W);
      std::copy_n(kr.data() + t * rp, rp, page.data() + (t - t0) * W + L);
    }
    be_.upload(page_ptr(m, s.pages[size_t(t0 / P)]), page.data(), fbytes(P * W));
  }
}

void StatePool::set_position(int32_t slot, int64_t pos) {
  check_live(slot);
  set_position_here(slot, pos);
  for (auto& sh : shards_) sh->set_position(slot, pos);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::SetPosition, slot, pos);
}

void StatePool::set_position_here(int32_t slot, int64_t pos) {
  reset_here(slot);
  reserve_append_here(slot, pos);
  slots_[size_t(slot)].pos = pos;
}

namespace {
// Uniform in [-a, a) from (seed, stream, index) alone (splitmix64 of the three).
float hashed_uniform(uint64_t seed, uint64_t stream, uint64_t i, float a) {
  uint64_t x = seed ^ (stream * 0x9e3779b97f4a7c15ull) ^ (i * 0xd1b54a32d192ed03ull);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (float(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
}
}  // namespace

void StatePool::fill_random(int32_t slot, int64_t pos, uint64_t seed) {
  if (pos < 0) fail("state pool: a negative position");
  check_live(slot);
  fill_random_here(slot, pos, seed);
  for (auto& sh : shards_) sh->fill_random(slot, pos, seed);  // each rank its own heads' values
  if (remote_) remote_->pool_op(remote_id_, PoolOp::FillRandom, slot, pos, seed);
}

void StatePool::fill_random_here(int32_t slot, int64_t pos, uint64_t seed) {
  set_position_here(slot, pos);
  const float unit_rms = 1.7320508f;  // uniform in [-sqrt 3, sqrt 3): mean square 1
  const int64_t L = d_.mla.kv_lora, rp = d_.mla.rope, W = L + rp, P = opt_.page_tokens;
  const int64_t sf = d_.kda.state_floats(), cf = d_.kda.conv_floats();
  std::vector<float> buf;
  for (size_t layer = 0; layer < is_kda_.size(); ++layer) {
    const uint64_t stream = uint64_t(layer) * 4;
    if (is_kda_[layer]) {
      const KdaPool p = kda(int64_t(layer));
      buf.resize(size_t(std::max(sf, cf)));
      for (int64_t i = 0; i < sf; ++i) buf[size_t(i)] = hashed_uniform(seed, stream, uint64_t(i), 0.01f);
      if (sf) be_.upload(p.S + slot * sf, buf.data(), fbytes(sf));
      for (int j = 0; j < 3; ++j) {
        for (int64_t i = 0; i < cf; ++i)
          buf[size_t(i)] = hashed_uniform(seed, stream + 1 + uint64_t(j), uint64_t(i), 1.0f);
        if (cf) be_.upload(p.conv[j] + slot * cf, buf.data(), fbytes(cf));
      }
      continue;
    }
    const int64_t m = ordinal_[layer];
    const Slot& s = slots_[size_t(slot)];
    buf.assign(size_t(P * W), 0.0f);
    for (int64_t t0 = 0; t0 < pos; t0 += P) {
      const int64_t n = std::min(P, pos - t0);
      for (int64_t i = 0; i < n * W; ++i) buf[size_t(i)] = hashed_uniform(seed, stream, uint64_t(t0 * W + i), unit_rms);
      be_.upload(page_ptr(m, s.pages[size_t(t0 / P)]), buf.data(), fbytes(P * W));
    }
  }
}

int64_t StatePool::live_slots() const {
  return int64_t(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.live; }));
}

int64_t StatePool::live_pages() const {
  return int64_t(std::count_if(page_refs_.begin(), page_refs_.end(), [](int32_t r) { return r > 0; }));
}

uint64_t StatePool::bytes() const {
  const uint64_t per_slot = uint64_t(kda_.size()) * 4 * uint64_t(d_.kda.state_floats() + 3 * d_.kda.conv_floats());
  const uint64_t per_page = uint64_t(mla_.size()) * 4 * uint64_t(opt_.page_tokens * d_.mla.cache_floats_per_token());
  uint64_t b = per_slot * slots_.size() + per_page * page_refs_.size();
  for (const auto& sh : shards_) b += sh->bytes();
  return b;
}

// ---------------------------------------------------------------- shards (a split model's ranks)
void StatePool::add_shard(std::unique_ptr<StatePool> shard) {
  if (!shard || shard.get() == this || !shard->shards_.empty()) fail("state pool: not a shard");
  if (shard->is_kda_ != is_kda_ || shard->opt_.page_tokens != opt_.page_tokens || shard->live_slots() != 0 ||
      live_slots() != 0)
    fail("state pool: a shard must be an empty pool of the same layers and page size, added before any slot");
  // Same capacities, so both grow at the same operations (their epochs stay equal).
  while (shard->slot_capacity() < slot_capacity()) shard->grow_slots();
  while (shard->page_capacity() < page_capacity()) shard->grow_pages();
  shard->free_slots_ = free_slots_;
  shard->free_pages_ = free_pages_;
  shards_.push_back(std::move(shard));
}

StatePool& StatePool::rank(int64_t r) {
  if (r < 0 || r >= ranks()) fail("state pool: no rank " + std::to_string(r) + " (" + std::to_string(ranks()) + ")");
  return r == 0 ? *this : *shards_[size_t(r - 1)];
}

void StatePool::attach_remote(std::shared_ptr<RemoteLink> link, uint32_t id) {
  if (!link || remote_ || !shards_.empty() || live_slots() != 0)
    fail("state pool: a remote link goes on an empty pool without shards, once");
  remote_ = std::move(link);
  remote_id_ = id;
}

void StatePool::refuse_split(const char* what) const {
  if (!shards_.empty() || remote_)
    fail(std::string("state pool: ") + what +
         " reads one rank's heads of a split model (--tp/--ep); session files of split models are not supported");
}

// The public operations: this pool, then every shard, in the same order.
int32_t StatePool::alloc() {
  const int32_t s = alloc_here();
  for (auto& sh : shards_)
    if (sh->alloc() != s) fail("internal error: the state pools of a split model are out of step");
  if (remote_) remote_->pool_op(remote_id_, PoolOp::Alloc, s);
  return s;
}

void StatePool::free(int32_t slot) {
  free_here(slot);
  for (auto& sh : shards_) sh->free(slot);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::Free, slot);
}

void StatePool::reset(int32_t slot) {
  reset_here(slot);
  for (auto& sh : shards_) sh->reset(slot);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::Reset, slot);
}

void StatePool::copy_into(int32_t dst, int32_t src) {
  copy_into_here(dst, src);
  for (auto& sh : shards_) sh->copy_into(dst, src);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::CopyInto, dst, src);
}

void StatePool::reserve_append(int32_t slot, int64_t n) {
  reserve_append_here(slot, n);
  for (auto& sh : shards_) sh->reserve_append(slot, n);
  if (remote_) remote_->pool_op(remote_id_, PoolOp::ReserveAppend, slot, n);
}

}  // namespace k3
