// comm_mpi.h without MPI (K3_MPI=OFF): a launch by an MPI launcher is refused in one line.
#include <string>

#include "core/comm_mpi.h"
#include "core/error.h"

namespace k3::mpi {

bool built() { return false; }

std::unique_ptr<Communicator> launch(int*, char***) {
  if (launched_size() <= 1) return nullptr;
  fail("k3 was started as " + std::to_string(launched_size()) +
       " processes by an MPI launcher, but this build has no MPI (rebuild with libopenmpi-dev installed, "
       "-DK3_MPI=ON)");
}

void finish(int) {}

}  // namespace k3::mpi
