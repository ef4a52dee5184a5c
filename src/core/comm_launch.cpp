// mpi::launched_size (comm_mpi.h): the launcher's environment, read the same with or without MPI.
#include <climits>
#include <cstdlib>
#include <sstream>
#include <string>

#include "core/comm_mpi.h"

namespace k3::mpi {

namespace {
// The variable as a number >= 0; -1 when it is unset or not one.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end == '\0' && x >= 0 && x < INT_MAX) ? int(x) : -1;
}
}  // namespace

std::string bind_local_gpu(int fallback) {
  int local = -1;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if ((local = env_int(name)) >= 0) break;
  if (local < 0) local = fallback;
  if (local < 0) return "";
  std::string pick = std::to_string(local);
  if (const char* vis = std::getenv("CUDA_VISIBLE_DEVICES"); vis && *vis) {
    // The local-th entry of the list the user gave (left as it is when the list is shorter).
    std::istringstream list(vis);
    std::string item;
    pick.clear();
    for (int i = 0; std::getline(list, item, ','); ++i)
      if (i == local) {
        pick = item;
        break;
      }
    if (pick.empty()) return "";
  }
  ::setenv("CUDA_VISIBLE_DEVICES", pick.c_str(), 1);
  return pick;
}

int launched_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const int n = env_int(name); n > 0) return n;
  return 1;
}

}  // namespace k3::mpi
