// NCCL, loaded on first use (runtime.h's nccl_* functions): the k3 binary does not link libnccl, so a
// process that never splits a model over GPUs never needs it installed. The few entry points used are
// called through pointers taken from the library opened with dlopen (K3_NCCL_SONAME, found on the
// loader's path or else in the CUDA toolkit's library directory it was built against).
// Owns: the dlopen handle and the function pointers, NCCL error codes -> one-line k3::Error.
// Must not: call CUDA kernels (collectives are NCCL's own).
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "ops/cuda/runtime.h"

#if __has_include(<nccl.h>)
#include <nccl.h>

#include <mutex>

#include "ops/cuda/lazy_lib.h"

#ifndef K3_NCCL_SONAME
#define K3_NCCL_SONAME "libnccl.so.2"
#endif

namespace {

struct Nccl {
  decltype(&ncclGetUniqueId) unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  bool ok = false;
  std::string error;
};

#ifdef K3_NCCL_BUILD_DIR
constexpr const char* kFallbackDir = K3_NCCL_BUILD_DIR;
#else
constexpr const char* kFallbackDir = nullptr;
#endif

const Nccl& nccl() {
  static Nccl n;
  static std::once_flag once;
  std::call_once(once, [] {
    // K3_NCCL_LIBRARY names the library file (e.g. the one PyPI's nvidia-nccl-cu13 installs), else the
    // loader's path, else the CUDA toolkit's directory.
    const char* own = std::getenv("K3_NCCL_LIBRARY");
    void* lib = own && *own ? k3::cuda::lazy::open(own, nullptr, &n.error)
                            : k3::cuda::lazy::open(K3_NCCL_SONAME, kFallbackDir, &n.error);
    if (!lib) return;
    const auto sym = [&](const char* name, auto& fn) {
      return k3::cuda::lazy::sym(lib, K3_NCCL_SONAME, name, fn, &n.error);
    };
    n.ok = sym("ncclGetUniqueId", n.unique_id) && sym("ncclCommInitRank", n.init_rank) &&
           sym("ncclCommDestroy", n.destroy) && sym("ncclAllGather", n.all_gather) &&
           sym("ncclBroadcast", n.broadcast) && sym("ncclGroupStart", n.group_start) &&
           sym("ncclGroupEnd", n.group_end) && sym("ncclGetErrorString", n.error_string);
  });
  return n;
}

const Nccl& loaded() {
  const Nccl& n = nccl();
  if (!n.ok)
    k3::fail("--device cuda with --tp/--ep: cannot load NCCL (" + n.error +
             "); install NCCL (e.g. PyPI nvidia-nccl-cu13) and put its directory on LD_LIBRARY_PATH, or name the file "
             "in K3_NCCL_LIBRARY");
  return n;
}

void check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  const Nccl& n = nccl();
  k3::fail(std::string("NCCL: ") + what + ": " + (n.error_string ? n.error_string(r) : "error " + std::to_string(int(r))));
}

size_t count_of(int64_t n, const char* what) {
  if (n < 0) k3::fail(std::string("NCCL: ") + what + ": a negative element count");
  return size_t(n);
}

cudaStream_t stream(k3::cuda::Stream s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

namespace k3::cuda {

struct NcclComm {
  ncclComm_t comm = nullptr;
};

std::vector<uint8_t> nccl_unique_id() {
  const Nccl& n = loaded();
  ncclUniqueId id;
  check(n.unique_id(&id), "ncclGetUniqueId");
  std::vector<uint8_t> out(sizeof id);
  std::memcpy(out.data(), &id, sizeof id);
  return out;
}

NcclComm* nccl_init(const std::vector<uint8_t>& id, int ranks, int rank) {
  const Nccl& n = loaded();
  ncclUniqueId u;
  if (id.size() != sizeof u) fail("NCCL: the unique id from rank 0 has " + std::to_string(id.size()) + " bytes");
  std::memcpy(&u, id.data(), sizeof u);
  auto* c = new NcclComm;
  const ncclResult_t r = n.init_rank(&c->comm, ranks, u, rank);
  if (r != ncclSuccess) {
    delete c;
    check(r, "ncclCommInitRank");
  }
  return c;
}

void nccl_destroy(NcclComm* c) noexcept {
  if (!c) return;
  if (c->comm && nccl().ok) nccl().destroy(c->comm);
  delete c;
}

void nccl_all_gather(NcclComm* c, const float* send, int64_t n, float* out, Stream s) {
  check(loaded().all_gather(send, out, count_of(n, "all_gather"), ncclFloat32, c->comm, stream(s)), "ncclAllGather");
}

void nccl_broadcast(NcclComm* c, float* buf, int64_t n, int root, Stream s) {
  check(loaded().broadcast(buf, buf, count_of(n, "broadcast"), ncclFloat32, root, c->comm, stream(s)), "ncclBroadcast");
}

void nccl_all_gather_v(NcclComm* c, const float* send, float* out, const int64_t* counts, int ranks, int rank,
                       Stream s) {
  const Nccl& n = loaded();
  check(n.group_start(), "ncclGroupStart");
  int64_t at = 0;
  for (int r = 0; r < ranks; ++r) {
    // Rank r's part, broadcast from r: its send buffer there, its place in out everywhere.
    const float* from = r == rank ? send : out + at;
    check(n.broadcast(from, out + at, count_of(counts[r], "all_gather_v"), ncclFloat32, r, c->comm, stream(s)),
          "ncclBroadcast");
    at += counts[r];
  }
  check(n.group_end(), "ncclGroupEnd");
}

}  // namespace k3::cuda

#else  // no nccl.h where this was built: the same functions, each a one-line refusal

namespace k3::cuda {
namespace {
[[noreturn]] void no_nccl() {
  fail("--device cuda with --tp/--ep: this k3 was built without NCCL's header (nccl.h); rebuild where the CUDA "
       "toolkit has NCCL");
}
}  // namespace
struct NcclComm {};
std::vector<uint8_t> nccl_unique_id() { no_nccl(); }
NcclComm* nccl_init(const std::vector<uint8_t>&, int, int) { no_nccl(); }
void nccl_destroy(NcclComm* c) noexcept { delete c; }
void nccl_all_gather(NcclComm*, const float*, int64_t, float*, Stream) { no_nccl(); }
void nccl_broadcast(NcclComm*, float*, int64_t, int, Stream) { no_nccl(); }
void nccl_all_gather_v(NcclComm*, const float*, float*, const int64_t*, int, int, Stream) { no_nccl(); }
}  // namespace k3::cuda

#endif
