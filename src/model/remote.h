// A split model whose ranks live in other processes (model/parallel.h; issue 23's one process per
// rank, started by `mpirun`): rank 0 drives, every other rank follows. Rank 0 holds its own rank
// model and a RemoteLink; the others run follow() until rank 0 closes the group.
//
// What crosses between processes: control messages only (rank 0 -> all, Communicator::
// broadcast_bytes): the state-pool operations rank 0 made since the last message (pool creation,
// alloc/free/fork/reset/set_position/fill_random/snapshot/restore, ...) in the order it made them,
// then the step itself (pool, sequences: slot, ids, all_logits; the forward options; rows per
// piece; rank 0's CPU thread count). A follower replays the operations on its own pools (so slot and page ids agree on every
// rank, as the in-process shards of StatePool do) and runs the same step on its rank model, whose
// collectives meet rank 0's. Activations never go through this channel.
// Snapshots (Session::mark, the server's prefix cache): each rank keeps its own part, under a key
// rank 0 hands out; the handle rank 0 holds drops the followers' copies when its last copy goes.
// Failure: an error inside a step on any rank aborts the group (Communicator::abort: the in-process
// group throws on every rank; MPI ends the launch); the split model then refuses further steps.
// Validation errors (bad slot, bad id) are raised on rank 0 before anything is sent.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace k3 {

class Communicator;
class Model;
namespace io {
class Checkpoint;
}
struct ForwardOptions;
struct GpuOptions;
struct SeqStep;
struct StatePoolOptions;

// Thrown by Model::split on a follower (a rank > 0 of an MPI launch) once rank 0 has closed the group:
// that process's part of the command is done (the CLI exits 0). Deliberately not a std::exception,
// so no error handler takes it for a failure.
struct FollowerDone {};

// The state-pool operations a follower replays (StatePool records them on rank 0).
enum class PoolOp : uint8_t {
  Alloc = 1,      // a: the slot rank 0 got (the follower checks it gets the same)
  Free,           // a: slot
  Reset,          // a: slot
  CopyInto,       // a: dst, b: src
  ReserveAppend,  // a: slot, b: tokens
  Advance,        // a: slot, b: tokens
  SetPosition,    // a: slot, b: position
  FillRandom,     // a: slot, b: position, c: seed
};

class RemoteLink;

// A snapshot's part on the followers (StatePool::Snapshot::remote); dropped there with its last copy.
struct RemoteSnapshot {
  std::shared_ptr<RemoteLink> link;
  uint64_t key = 0;
  ~RemoteSnapshot();
};

// Rank 0's side. Thread-safe for recording (pools and snapshot handles may be dropped from any
// thread); step() and close() are called by the thread that drives the model.
class RemoteLink : public std::enable_shared_from_this<RemoteLink> {
 public:
  explicit RemoteLink(Communicator& comm);
  ~RemoteLink();
  RemoteLink(const RemoteLink&) = delete;
  RemoteLink& operator=(const RemoteLink&) = delete;

  uint32_t new_pool(const StatePoolOptions& o);  // the followers create the same pool under this id
  void drop_pool(uint32_t pool);
  void pool_op(uint32_t pool, PoolOp op, int64_t a, int64_t b = 0, uint64_t c = 0);
  std::shared_ptr<const RemoteSnapshot> snapshot(uint32_t pool, int32_t slot);
  void drop_snapshot(uint64_t key);
  void restore(uint32_t pool, int32_t slot, const RemoteSnapshot& s);
  // Sends what is queued and "read in your weights" (the followers read their parts while rank 0
  // reads its own).
  void prefault();
  // Sends what is queued, then the GPU move (the followers' use_gpu_rank with these options; their
  // pools and snapshots, on the CPU backend that goes, are dropped first).
  void use_gpu(const GpuOptions& o);
  // Sends what is queued, then the step (k3::Error, sending nothing, when the group has failed or closed).
  void step(uint32_t pool, std::span<const SeqStep> seqs, const ForwardOptions& opt, int64_t max_rows);
  // A step failed on this rank after it was sent: the other ranks are told (their collectives end)
  // and the link refuses every later step with `why`.
  void fail_group(const std::string& why);
  // Sends what is queued and the end: the followers' follow() returns. Idempotent; never throws.
  void close() noexcept;

 private:
  // What is queued, to go first in the next message (k3::Error when the group failed or closed).
  std::vector<uint8_t> take_pending();
  void send(std::vector<uint8_t>& msg);
  std::mutex mu_;
  Communicator& comm_;
  std::vector<uint8_t> pending_;  // recorded operations not sent yet
  uint32_t next_pool_ = 1;
  uint64_t next_snapshot_ = 1;
  bool closed_ = false;
  std::string failed_;  // why the group failed (empty: it did not)
};

// The first message of a group: rank 0 sends its plan and model fingerprint (Model::fingerprint:
// architecture, checkpoint size, FP8 trunk); a follower whose own differ fails with one line naming
// both and aborts the group (processes started with different models or flags never compute together).
void hello_send(Communicator& comm, int tp, int ep, uint64_t fingerprint);
void hello_check(Communicator& comm, int tp, int ep, uint64_t fingerprint);

// A follower's loop: replays rank 0's messages on `rank` (this process's rank model of the split,
// whose communicator is `comm`) until rank 0 closes the group. A failure aborts the group and is
// rethrown.
// ckpt: the mapping the rank's weights are views of (read in when rank 0 says so).
void follow(Model& rank, Communicator& comm, const io::Checkpoint& ckpt);

}  // namespace k3
