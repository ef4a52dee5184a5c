// Rank 0's messages to the ranks in other processes, and the followers' loop (remote.h).
#include "model/remote.h"

#include <cstring>
#include <map>
#include <type_traits>

#include "core/comm.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/model.h"

namespace k3 {

namespace {

enum class Msg : uint8_t { NewPool = 1, DropPool, Op, Snapshot, Restore, DropSnapshot, Step, Close, UseGpu, Prefault };

template <class T>
void put(std::vector<uint8_t>& b, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &v, sizeof(T));
}

// Reads a message back; a message that ends early is an internal error (both sides are this code).
class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& b) : b_(b) {}
  bool done() const { return at_ == b_.size(); }
  template <class T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  void take(void* out, size_t n) {
    if (n > b_.size() - at_) fail("internal error: a control message from rank 0 ends early");
    if (n) std::memcpy(out, b_.data() + at_, n);
    at_ += n;
  }

 private:
  const std::vector<uint8_t>& b_;
  size_t at_ = 0;
};

}  // namespace

RemoteSnapshot::~RemoteSnapshot() {
  if (link) link->drop_snapshot(key);
}

RemoteLink::RemoteLink(Communicator& comm) : comm_(comm) {}

RemoteLink::~RemoteLink() { close(); }

uint32_t RemoteLink::new_pool(const StatePoolOptions& o) {
  std::lock_guard<std::mutex> lk(mu_);
  const uint32_t id = next_pool_++;
  put(pending_, Msg::NewPool);
  put(pending_, id);
  put(pending_, o.page_tokens);
  put(pending_, o.initial_slots);
  put(pending_, o.initial_pages);
  return id;
}

void RemoteLink::drop_pool(uint32_t pool) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  put(pending_, Msg::DropPool);
  put(pending_, pool);
}

void RemoteLink::pool_op(uint32_t pool, PoolOp op, int64_t a, int64_t b, uint64_t c) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  put(pending_, Msg::Op);
  put(pending_, pool);
  put(pending_, op);
  put(pending_, a);
  put(pending_, b);
  put(pending_, c);
}

std::shared_ptr<const RemoteSnapshot> RemoteLink::snapshot(uint32_t pool, int32_t slot) {
  auto s = std::make_shared<RemoteSnapshot>();
  {
    std::lock_guard<std::mutex> lk(mu_);
    s->key = next_snapshot_++;
    put(pending_, Msg::Snapshot);
    put(pending_, pool);
    put(pending_, slot);
    put(pending_, s->key);
  }
  s->link = shared_from_this();
  return s;
}

void RemoteLink::drop_snapshot(uint64_t key) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  put(pending_, Msg::DropSnapshot);
  put(pending_, key);
}

void RemoteLink::restore(uint32_t pool, int32_t slot, const RemoteSnapshot& s) {
  std::lock_guard<std::mutex> lk(mu_);
  put(pending_, Msg::Restore);
  put(pending_, pool);
  put(pending_, slot);
  put(pending_, s.key);
}

void RemoteLink::step(uint32_t pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, int64_t max_rows) {
  std::vector<uint8_t> msg = take_pending();
  put(msg, Msg::Step);
  put(msg, pool);
  put(msg, max_rows);
  put(msg, int32_t(par::max_threads()));  // rank 0's CPU threads now (k3 bench -t 1,2 changes them)
  put(msg, opt.kda_algo);
  put(msg, opt.kda_chunk);
  put(msg, opt.mla_algo);
  put(msg, opt.numerics);
  put(msg, uint32_t(seqs.size()));
  for (const SeqStep& s : seqs) {
    put(msg, s.slot);
    put(msg, s.n);
    put(msg, uint8_t(s.all_logits));
    const size_t at = msg.size();
    msg.resize(at + size_t(s.n) * sizeof(int32_t));
    std::memcpy(msg.data() + at, s.ids, size_t(s.n) * sizeof(int32_t));
  }
  send(msg);
}

void RemoteLink::prefault() {
  std::vector<uint8_t> msg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.empty() || closed_) return;
    msg.swap(pending_);
  }
  put(msg, Msg::Prefault);
  send(msg);
}

void RemoteLink::use_gpu(const GpuOptions& o) {
  std::vector<uint8_t> msg = take_pending();
  put(msg, Msg::UseGpu);
  put(msg, uint8_t(o.graphs));
  put(msg, o.tokens_per_call);
  put(msg, o.initial_context);
  put(msg, uint8_t(o.experts_resident));
  put(msg, uint8_t(o.experts_on_cpu));
  put(msg, o.hot_experts);
  put(msg, o.hot_warmup_tokens);
  send(msg);
}

std::vector<uint8_t> RemoteLink::take_pending() {
  std::vector<uint8_t> msg;
  std::lock_guard<std::mutex> lk(mu_);
  if (!failed_.empty())
    fail("the ranks of this split model stopped after an earlier failure (" + failed_ + "); load the model again");
  if (closed_) fail("internal error: a message to the ranks of a split model that were closed");
  msg.swap(pending_);
  return msg;
}

void RemoteLink::send(std::vector<uint8_t>& msg) {
  try {
    comm_.broadcast_bytes(msg, 0);
  } catch (const std::exception& e) {
    fail_group(e.what());
    throw;
  }
}

void RemoteLink::fail_group(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.empty()) return;
    failed_ = why.empty() ? "unknown error" : why;
    closed_ = true;
    pending_.clear();
  }
  comm_.abort(why);
}

void RemoteLink::close() noexcept {
  std::vector<uint8_t> msg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    msg.swap(pending_);
  }
  put(msg, Msg::Close);
  try {
    comm_.broadcast_bytes(msg, 0);
  } catch (...) {
    // The group failed already: the followers have ended (in-process) or the launch is ending (MPI).
  }
}

namespace {
constexpr uint32_t kHelloMagic = 0x6b33676bu;  // "kg3k"
}

void hello_send(Communicator& comm, int tp, int ep, uint64_t fingerprint) {
  std::vector<uint8_t> msg;
  put(msg, kHelloMagic);
  put(msg, int32_t(tp));
  put(msg, int32_t(ep));
  put(msg, fingerprint);
  comm.broadcast_bytes(msg, 0);
}

void hello_check(Communicator& comm, int tp, int ep, uint64_t fingerprint) {
  std::vector<uint8_t> msg;
  comm.broadcast_bytes(msg, 0);
  try {
    Reader rd(msg);
    if (rd.get<uint32_t>() != kHelloMagic) fail("rank 0 is not a k3 of this version (its first message differs)");
    const auto tp0 = rd.get<int32_t>(), ep0 = rd.get<int32_t>();
    const auto fp0 = rd.get<uint64_t>();
    if (tp0 != tp || ep0 != ep)
      fail("rank " + std::to_string(comm.rank()) + " was started with --tp " + std::to_string(tp) + " --ep " +
           std::to_string(ep) + ", rank 0 with --tp " + std::to_string(tp0) + " --ep " + std::to_string(ep0));
    if (fp0 != fingerprint)
      fail("rank " + std::to_string(comm.rank()) +
           " loaded a different model than rank 0 (fingerprints differ: same checkpoint and --trunk-fp8 on every rank)");
  } catch (const std::exception& e) {
    comm.abort(e.what());
    throw;
  }
}

void follow(Model& rank, Communicator& comm, const io::Checkpoint& ckpt) {
  std::map<uint32_t, std::unique_ptr<StatePool>> pools;
  std::map<uint64_t, StatePool::Snapshot> snaps;
  std::vector<uint8_t> msg;
  std::vector<SeqStep> seqs;
  std::vector<std::vector<int32_t>> ids;
  const auto pool_of = [&](uint32_t id) -> StatePool& {
    auto it = pools.find(id);
    if (it == pools.end()) fail("internal error: rank 0 named state pool " + std::to_string(id) + ", which this rank lacks");
    return *it->second;
  };
  try {
    for (;;) {
      comm.broadcast_bytes(msg, 0);
      Reader rd(msg);
      while (!rd.done()) {
        switch (rd.get<Msg>()) {
          case Msg::NewPool: {
            const auto id = rd.get<uint32_t>();
            StatePoolOptions o;
            o.page_tokens = rd.get<int64_t>();
            o.initial_slots = rd.get<int64_t>();
            o.initial_pages = rd.get<int64_t>();
            pools[id] = rank.new_pool(o);
            break;
          }
          case Msg::DropPool:
            pools.erase(rd.get<uint32_t>());
            break;
          case Msg::Op: {
            StatePool& p = pool_of(rd.get<uint32_t>());
            const auto op = rd.get<PoolOp>();
            const auto a = rd.get<int64_t>(), b = rd.get<int64_t>();
            const auto c = rd.get<uint64_t>();
            const auto slot = int32_t(a);
            switch (op) {
              case PoolOp::Alloc:
                if (p.alloc() != slot) fail("internal error: the state pools of the ranks are out of step");
                break;
              case PoolOp::Free: p.free(slot); break;
              case PoolOp::Reset: p.reset(slot); break;
              case PoolOp::CopyInto: p.copy_into(slot, int32_t(b)); break;
              case PoolOp::ReserveAppend: p.reserve_append(slot, b); break;
              case PoolOp::Advance: p.advance(slot, b); break;
              case PoolOp::SetPosition: p.set_position(slot, b); break;
              case PoolOp::FillRandom: p.fill_random(slot, b, c); break;
              default: fail("internal error: unknown state-pool operation from rank 0");
            }
            break;
          }
          case Msg::Snapshot: {
            StatePool& p = pool_of(rd.get<uint32_t>());
            const auto slot = rd.get<int32_t>();
            snaps[rd.get<uint64_t>()] = p.snapshot(slot);
            break;
          }
          case Msg::Restore: {
            StatePool& p = pool_of(rd.get<uint32_t>());
            const auto slot = rd.get<int32_t>();
            auto it = snaps.find(rd.get<uint64_t>());
            if (it == snaps.end()) fail("internal error: rank 0 restored a snapshot this rank does not hold");
            p.restore(slot, it->second);
            break;
          }
          case Msg::DropSnapshot:
            snaps.erase(rd.get<uint64_t>());
            break;
          case Msg::Step: {
            StatePool& p = pool_of(rd.get<uint32_t>());
            const auto max_rows = rd.get<int64_t>();
            const auto threads = rd.get<int32_t>();
            ForwardOptions opt;
            opt.kda_algo = rd.get<KdaAlgo>();
            opt.kda_chunk = rd.get<int64_t>();
            opt.mla_algo = rd.get<MlaAlgo>();
            opt.numerics = rd.get<ops::Numerics>();
            const auto n = rd.get<uint32_t>();
            seqs.resize(n);
            if (ids.size() < n) ids.resize(n);
            for (uint32_t i = 0; i < n; ++i) {
              SeqStep& s = seqs[i];
              s.slot = rd.get<int32_t>();
              s.n = rd.get<int64_t>();
              s.all_logits = rd.get<uint8_t>() != 0;
              if (s.n < 0 || s.n > int64_t(1) << 40) fail("internal error: a step of rank 0 with a bad length");
              ids[i].resize(size_t(s.n));
              rd.take(ids[i].data(), size_t(s.n) * sizeof(int32_t));
              s.ids = ids[i].data();
            }
            if (rank.max_step_rows() != max_rows) rank.set_max_step_rows(max_rows);
            if (par::max_threads() != threads) par::set_max_threads(threads);
            rank.step(p, seqs, opt, nullptr, nullptr);
            break;
          }
          case Msg::UseGpu: {
            GpuOptions o;
            o.graphs = rd.get<uint8_t>() != 0;
            o.tokens_per_call = rd.get<int64_t>();
            o.initial_context = rd.get<int64_t>();
            o.experts_resident = rd.get<uint8_t>() != 0;
            o.experts_on_cpu = rd.get<uint8_t>() != 0;
            o.hot_experts = rd.get<double>();
            o.hot_warmup_tokens = rd.get<int64_t>();
            snaps.clear();  // their memory is the CPU backend's, which goes
            pools.clear();
            rank.use_gpu_rank(o);
            break;
          }
          case Msg::Prefault:
            prefault_weight_views(ckpt, rank.weights(), {});
            break;
          case Msg::Close:
            if (!rd.done()) fail("internal error: rank 0's last message goes on after its end");
            return;
          default:
            fail("internal error: an unknown control message from rank 0");
        }
      }
    }
  } catch (const std::exception& e) {
    comm.abort(e.what());
    throw;
  }
}

}  // namespace k3
