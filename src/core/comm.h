// Collectives among the ranks of one split model (tensor and expert parallel, issue 23): the
// interface the forward will call, and the in-process implementation (ranks as threads of one
// process over shared memory) that lets every split run on the CPU backend in CI. An NCCL
// implementation serves GPUs behind the same interface.
// Contract: every rank of a group calls the same collectives in the same order with the same sizes;
// a call returns when its result is in place on this rank. Results are the same bits on every rank
// and do not depend on thread timing (sums in rank order 0..size-1).
// Failure: a rank that cannot go on calls abort() (run_ranks does it for a rank that throws); every
// other rank's pending or next collective then throws k3::Error instead of waiting forever.
// Must not: allocate per call in steady state beyond the first call of a size (decode runs these
// every layer), or depend on which thread calls.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace k3 {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;  // "local" (in-process threads), "nccl"
  // buf[i] <- sum over ranks r of buf_r[i], added in rank order 0..size-1.
  virtual void all_reduce_sum(float* buf, int64_t n) = 0;
  // out[r*n .. (r+1)*n) <- send_r[0 .. n): every rank's n floats, in rank order.
  virtual void all_gather(const float* send, int64_t n, float* out) = 0;
  // out <- rank 0's counts[0] floats, then rank 1's counts[1], ...: parts of different sizes (counts
  // the same on every rank, n == counts[rank]; send must not overlap out).
  virtual void all_gather_v(const float* send, int64_t n, float* out, const int64_t* counts) = 0;
  // out[0 .. n) <- sum over ranks of send_r[rank*n .. (rank+1)*n), rank order: this rank's slice of
  // the element-wise sum of every rank's size*n floats.
  virtual void reduce_scatter_sum(const float* send, int64_t n, float* out) = 0;
  // buf[0 .. n) <- rank root's buf[0 .. n) on every rank (0 <= root < size, else k3::Error).
  virtual void broadcast(float* buf, int64_t n, int root) = 0;
  virtual void barrier() = 0;
  // Control messages between processes (a split model's rank 0 tells the other ranks what to do,
  // model/remote.h): root's buf arrives in every rank's buf (resized to it). A rank waiting here
  // for the next message idles (no busy spinning for longer than a moment).
  virtual void broadcast_bytes(std::vector<uint8_t>& buf, int root) = 0;
  // This rank gives up: the others' collectives throw (with `why`) instead of waiting for it.
  virtual void abort(const std::string& why) = 0;
};

// `size` ranks in this process: group[r] is rank r's communicator, to be driven by one thread each
// (1 <= size <= 1024; k3::Error otherwise).
std::vector<std::unique_ptr<Communicator>> make_local_group(int size);

// Runs fn(comm) for every rank of `group` on a thread of its own and joins them. A rank that throws
// aborts the group (so no other rank waits for it forever); the first error is rethrown here after
// every thread has ended.
void run_ranks(const std::vector<std::unique_ptr<Communicator>>& group, const std::function<void(Communicator&)>& fn);

// The processes of this launch (`mpirun -np N k3 ...`, core/comm_mpi.h), one rank each: null when
// k3 runs as one process. main() sets it before any subcommand runs; a model split with
// --tp/--ep then puts one rank in each process (Model::split).
Communicator* process_group();
void set_process_group(Communicator* group);  // not owned

}  // namespace k3
