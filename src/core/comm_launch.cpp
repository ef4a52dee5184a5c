// mpi::launched_size (comm_mpi.h): the launcher's environment, read the same with or without MPI.
#include <climits>
#include <cstdlib>
#include <string>

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

std::string bind_local_gpu(int fallback) {
  int local = -1;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      char* end = nullptr;
      const long x = std::strtol(v, &end, 10);
      if (*end == '\0' && x >= 0 && x < INT_MAX) {
        local = int(x);
        break;
      }
    }
  }
  if (local < 0) local = fallback;
  if (local < 0) return "";
  std::string pick = std::to_string(local);
  if (const char* vis = std::getenv("CUDA_VISIBLE_DEVICES"); vis && *vis) {
    // The local-th entry of the list the user gave (left as it is when the list is shorter).
    std::string list = vis, item;
    int i = 0;
    size_t at = 0;
    pick.clear();
    for (;;) {
      const size_t comma = list.find(',', at);
      item = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      if (i++ == local) {
        pick = item;
        break;
      }
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    if (pick.empty()) return "";
  }
  ::setenv("CUDA_VISIBLE_DEVICES", pick.c_str(), 1);
  return pick;
}

int launched_size() {
  if (const int n = env_int("OMPI_COMM_WORLD_SIZE")) return n;
  if (const int n = env_int("PMI_SIZE")) return n;
  return 1;
}

}  // namespace k3::mpi
