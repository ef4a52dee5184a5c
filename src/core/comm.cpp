// The in-process communicator (comm.h): ranks are threads of one process. Each collective is two
// phases around a generation-counted barrier: every rank publishes its buffer's address, all meet,
// each rank reads the others' buffers and writes its own result into private scratch (it must not
// write its own buffer yet: the others may still be reading it), all meet again, then each copies
// its scratch into place. Sums run in rank order, so every rank computes the same bits.
#include "core/comm.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace k3 {

namespace {

struct Shared {
  explicit Shared(int n) : size(n), ptrs(size_t(n), nullptr) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::string why;
  std::vector<const float*> ptrs;  // each rank's published buffer for the current collective
  const std::vector<uint8_t>* bytes = nullptr;  // the root's message of broadcast_bytes

  // Waits until every rank has arrived (or the group was aborted: k3::Error).
  void wait_all() {
    std::unique_lock<std::mutex> lk(mu);
    if (aborted) fail("collective abandoned: " + why);
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lk, [&] { return generation != gen || aborted; });
    if (generation == gen) fail("collective abandoned: " + why);
  }
  void abort(const std::string& w) {
    std::lock_guard<std::mutex> lk(mu);
    if (!aborted) why = w;
    aborted = true;
    cv.notify_all();
  }
};

class LocalComm final : public Communicator {
 public:
  LocalComm(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  const char* name() const override { return "local"; }

  void all_reduce_sum(float* buf, int64_t n) override {
    check_n(n, "all_reduce_sum");
    publish(buf);
    scratch_.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      float acc = s_->ptrs[0][i];
      for (int r = 1; r < s_->size; ++r) acc += s_->ptrs[size_t(r)][i];
      scratch_[size_t(i)] = acc;
    }
    s_->wait_all();  // every rank has read every buffer
    if (n) std::memcpy(buf, scratch_.data(), size_t(n) * sizeof(float));
  }

  void all_gather(const float* send, int64_t n, float* out) override {
    check_n(n, "all_gather");
    publish(send);
    scratch_.resize(size_t(n) * size_t(s_->size));
    for (int r = 0; r < s_->size; ++r)
      if (n) std::memcpy(scratch_.data() + size_t(r) * size_t(n), s_->ptrs[size_t(r)], size_t(n) * sizeof(float));
    s_->wait_all();  // `out` may alias `send` of this rank
    if (n) std::memcpy(out, scratch_.data(), scratch_.size() * sizeof(float));
  }

  void all_gather_v(const float* send, int64_t n, float* out, const int64_t* counts) override {
    check_n(n, "all_gather_v");
    if (n != counts[rank_]) fail("all_gather_v: this rank sends " + std::to_string(n) + " floats, counts say " +
                                 std::to_string(counts[rank_]));
    publish(send);
    // Straight into out: no rank's send overlaps any rank's out (the contract), so nothing read is
    // written before every rank is done reading.
    int64_t at = 0;
    for (int r = 0; r < s_->size; ++r) {
      if (counts[r]) std::memcpy(out + at, s_->ptrs[size_t(r)], size_t(counts[r]) * sizeof(float));
      at += counts[r];
    }
    s_->wait_all();  // the others are done reading this rank's send
  }

  void reduce_scatter_sum(const float* send, int64_t n, float* out) override {
    check_n(n, "reduce_scatter_sum");
    publish(send);
    scratch_.resize(size_t(n));
    const int64_t off = int64_t(rank_) * n;
    for (int64_t i = 0; i < n; ++i) {
      float acc = s_->ptrs[0][off + i];
      for (int r = 1; r < s_->size; ++r) acc += s_->ptrs[size_t(r)][off + i];
      scratch_[size_t(i)] = acc;
    }
    s_->wait_all();
    if (n) std::memcpy(out, scratch_.data(), size_t(n) * sizeof(float));
  }

  void broadcast(float* buf, int64_t n, int root) override {
    check_n(n, "broadcast");
    if (root < 0 || root >= s_->size)
      fail("broadcast: root " + std::to_string(root) + " of a group of " + std::to_string(s_->size));
    publish(buf);
    // The root's buffer is read in place while every other rank copies it, then all meet again so
    // the root does not write it before they are done.
    if (rank_ != root && n) std::memcpy(buf, s_->ptrs[size_t(root)], size_t(n) * sizeof(float));
    s_->wait_all();
  }

  void barrier() override { s_->wait_all(); }

  void broadcast_bytes(std::vector<uint8_t>& buf, int root) override {
    if (root < 0 || root >= s_->size)
      fail("broadcast_bytes: root " + std::to_string(root) + " of a group of " + std::to_string(s_->size));
    if (rank_ == root) s_->bytes = &buf;  // written before the barrier's lock, read after it
    s_->wait_all();
    if (rank_ != root) buf = *s_->bytes;
    s_->wait_all();  // the root's buffer stays as it is until every rank has copied it
  }

  void abort(const std::string& why) override { s_->abort("rank " + std::to_string(rank_) + ": " + why); }

 private:
  void check_n(int64_t n, const char* what) const {
    if (n < 0) fail(std::string(what) + ": negative element count");
  }
  // Publishes this rank's buffer, then waits until every rank has published.
  void publish(const float* p) {
    s_->ptrs[size_t(rank_)] = p;  // written before the barrier's lock, read after it
    s_->wait_all();
  }

  std::shared_ptr<Shared> s_;
  int rank_;
  std::vector<float> scratch_;
};

std::atomic<Communicator*> g_process_group{nullptr};

}  // namespace

Communicator* process_group() { return g_process_group.load(); }
void set_process_group(Communicator* group) { g_process_group.store(group); }

std::vector<std::unique_ptr<Communicator>> make_local_group(int size) {
  if (size < 1 || size > 1024) fail("in-process communicator: " + std::to_string(size) + " ranks (1..1024)");
  auto s = std::make_shared<Shared>(size);
  std::vector<std::unique_ptr<Communicator>> g;
  for (int r = 0; r < size; ++r) g.push_back(std::make_unique<LocalComm>(s, r));
  return g;
}

void run_ranks(const std::vector<std::unique_ptr<Communicator>>& group, const std::function<void(Communicator&)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(group.size());
  for (const auto& c : group)
    threads.emplace_back([&, comm = c.get()] {
      try {
        fn(*comm);
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!first) first = std::current_exception();
        }
        comm->abort(e.what());
      } catch (...) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!first) first = std::current_exception();
        }
        comm->abort("unknown error");
      }
    });
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace k3
