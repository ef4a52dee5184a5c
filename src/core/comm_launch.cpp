// mpi::launched_size (comm_mpi.h): the launcher's environment, read the same with or without MPI.
#include <climits>
#include <cstdlib>

#include "core/comm_mpi.h"

namespace k3::mpi {

namespace {
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end == '\0' && x > 0 && x < INT_MAX) ? int(x) : 0;
}
}  // namespace

int launched_size() {
  if (const int n = env_int("OMPI_COMM_WORLD_SIZE")) return n;
  if (const int n = env_int("PMI_SIZE")) return n;
  return 1;
}

}  // namespace k3::mpi
