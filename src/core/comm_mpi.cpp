// The MPI communicator and k3's MPI start-up (comm_mpi.h).
#include "core/comm_mpi.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace k3::mpi {

namespace {

bool g_initialized = false;

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail(std::string("MPI ") + what + " failed: " + msg);
}

int count_of(int64_t n, const char* what) {
  if (n < 0) fail(std::string(what) + ": negative element count");
  if (n > INT_MAX) fail(std::string(what) + ": " + std::to_string(n) + " elements are more than one MPI call takes");
  return int(n);
}

class MpiComm final : public Communicator {
 public:
  MpiComm() {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override {
    if (g_initialized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  // Sums in rank order: every rank's buffer gathered, then added 0..size-1 (MPI_Allreduce's order of
  // additions is the library's choice).
  void all_reduce_sum(float* buf, int64_t n) override {
    gathered(buf, n, "all_reduce_sum");
    for (int64_t i = 0; i < n; ++i) {
      float acc = scratch_[size_t(i)];
      for (int r = 1; r < size_; ++r) acc += scratch_[size_t(r) * size_t(n) + size_t(i)];
      buf[i] = acc;
    }
  }

  void all_gather(const float* send, int64_t n, float* out) override {
    const int c = count_of(n * size_, "all_gather") / size_;
    // In place: this rank's part first moved to its place in out (send may alias out anywhere).
    if (c) std::memmove(out + int64_t(rank_) * n, send, size_t(n) * sizeof(float));
    check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, c, MPI_FLOAT, comm_), "Allgather");
  }

  void all_gather_v(const float* send, int64_t n, float* out, const int64_t* counts) override {
    if (n != counts[rank_]) fail("all_gather_v: this rank sends " + std::to_string(n) + " floats, counts say " +
                                 std::to_string(counts[rank_]));
    counts_.resize(size_t(size_));
    displs_.resize(size_t(size_));
    int64_t at = 0;
    for (int r = 0; r < size_; ++r) {
      counts_[size_t(r)] = count_of(counts[r], "all_gather_v");
      displs_[size_t(r)] = count_of(at, "all_gather_v");
      at += counts[r];
    }
    check(MPI_Allgatherv(send, count_of(n, "all_gather_v"), MPI_FLOAT, out, counts_.data(), displs_.data(),
                         MPI_FLOAT, comm_),
          "Allgatherv");
  }

  void reduce_scatter_sum(const float* send, int64_t n, float* out) override {
    gathered(send, n * size_, "reduce_scatter_sum");
    const int64_t all = n * size_, off = int64_t(rank_) * n;
    for (int64_t i = 0; i < n; ++i) {
      float acc = scratch_[size_t(off + i)];
      for (int r = 1; r < size_; ++r) acc += scratch_[size_t(r * all + off + i)];
      out[i] = acc;
    }
  }

  void broadcast(float* buf, int64_t n, int root) override {
    check_root(root, "broadcast");
    check(MPI_Bcast(buf, count_of(n, "broadcast"), MPI_FLOAT, root, comm_), "Bcast");
  }

  void barrier() override { check(MPI_Barrier(comm_), "Barrier"); }

  void broadcast_bytes(std::vector<uint8_t>& buf, int root) override {
    check_root(root, "broadcast_bytes");
    // The size first, without blocking: a rank waiting for rank 0's next message (a follower between
    // steps) would otherwise spin a core inside MPI for as long as rank 0 takes.
    uint64_t len = rank_ == root ? uint64_t(buf.size()) : 0;
    MPI_Request req;
    check(MPI_Ibcast(&len, 1, MPI_UINT64_T, root, comm_, &req), "Ibcast");
    int done = 0;
    auto idle = std::chrono::microseconds(0);
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "Test");
      if (done) break;
      // Spin for 200 us, then sleep in steps growing to 1 ms.
      if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(200)) {
        idle = std::min(std::chrono::microseconds(1000), idle + std::chrono::microseconds(20));
        std::this_thread::sleep_for(idle);
      }
    }
    if (len > uint64_t(INT_MAX)) fail("broadcast_bytes: a message of " + std::to_string(len) + " bytes");
    if (rank_ != root) buf.resize(size_t(len));
    if (len) check(MPI_Bcast(buf.data(), int(len), MPI_BYTE, root, comm_), "Bcast");
  }

  void abort(const std::string& why) override {
    std::fprintf(stderr, "k3: rank %d of %d gives up: %s\n", rank_, size_, why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // ends every process of the launch
  }

 private:
  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_)
      fail(std::string(what) + ": root " + std::to_string(root) + " of a group of " + std::to_string(size_));
  }
  // scratch_ <- every rank's n floats, in rank order.
  void gathered(const float* send, int64_t n, const char* what) {
    const int c = count_of(n * size_, what) / size_;
    scratch_.resize(size_t(n) * size_t(size_));
    check(MPI_Allgather(send, c, MPI_FLOAT, scratch_.data(), c, MPI_FLOAT, comm_), "Allgather");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<float> scratch_;
  std::vector<int> counts_, displs_;
};

}  // namespace

bool built() { return true; }

std::unique_ptr<Communicator> launch(int* argc, char*** argv) {
  if (launched_size() <= 1) return nullptr;
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "Init_thread");
  g_initialized = true;
  if (provided < MPI_THREAD_SERIALIZED) {
    finish(1);
    fail("this MPI library does not allow calls from more than one thread (MPI_THREAD_SERIALIZED)");
  }
  return std::make_unique<MpiComm>();
}

void finish(int exit_code) {
  if (!g_initialized) return;
  if (exit_code != 0) MPI_Abort(MPI_COMM_WORLD, exit_code);
  g_initialized = false;
  MPI_Finalize();
}

}  // namespace k3::mpi
