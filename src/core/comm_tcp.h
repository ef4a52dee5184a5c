// Ranks as processes started by hand (`k3 <sub> ... --rank R --world W --master HOST:PORT`, one
// process per GPU; issue 23's rendezvous without mpirun): rank 0 listens on HOST:PORT, the others
// connect to it. The group carries rank 0's control messages (Communicator::broadcast_bytes from
// root 0, model/remote.h) and barriers only: its float collectives refuse in one line, because the
// data of GPU ranks goes through NCCL on the devices (the CUDA backend's join_group gets NCCL's
// unique id through this group). CPU ranks as processes need MPI (core/comm_mpi.h).
// Failure: a peer that goes away ends every later call with a one-line k3::Error; abort() closes
// this rank's connections, so the others' waits end too. Connecting waits up to timeout_s.
#pragma once
#include <memory>
#include <string>

#include "core/comm.h"

namespace k3::tcp {

// Rank 0's socket, bound and listening (port 0: any free port, then port() says which).
class Listener {
 public:
  explicit Listener(const std::string& host_port);  // "HOST:PORT"; one-line k3::Error when it cannot listen
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const { return port_; }
  // Waits for ranks 1 .. world-1 to connect (each says its rank and the world it was started with).
  std::unique_ptr<Communicator> accept(int world, double timeout_s = 120);

 private:
  int fd_ = -1, port_ = 0;
  std::string where_;
};

// Rank `rank` (>= 1) of `world` connects to rank 0 at "HOST:PORT", retrying until timeout_s.
std::unique_ptr<Communicator> connect(int rank, int world, const std::string& host_port, double timeout_s = 120);

// rank 0: Listener(master).accept(world); others: connect(rank, world, master).
std::unique_ptr<Communicator> rendezvous(int rank, int world, const std::string& master);

}  // namespace k3::tcp
