// CPU level detection and selection (see isa.h).
#include "ops/cpu/isa.h"

#include <atomic>
#include <cstdlib>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "core/error.h"

namespace k3::ops {

namespace {
std::atomic<int> g_isa{-1};

bool has_avx2() {
#if defined(__x86_64__) && defined(K3_HAVE_X86_KERNELS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool has_avx512() {
#if defined(__x86_64__) && defined(K3_HAVE_X86_KERNELS)
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AMX tiles with BF16 (CPUID.(7,0):EDX bits 22 and 24), and the kernel's grant of the tile data
// state to this process (arch_prctl ARCH_REQ_XCOMP_PERM: Linux >= 5.16; without it the first tile
// instruction faults). Asked once; the grant is for every thread of the process.
bool has_amx() {
#if defined(__x86_64__) && defined(K3_HAVE_X86_KERNELS) && defined(__linux__)
  static const bool ok = [] {
    if (!has_avx512()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}
}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Scalar:
      return "scalar";
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
    case CpuIsa::Amx:
      return "amx";
  }
  return "?";
}

CpuIsa cpu_isa_detected() {
  if (has_amx()) return CpuIsa::Amx;
  if (has_avx512()) return CpuIsa::Avx512;
  if (has_avx2()) return CpuIsa::Avx2;
  return CpuIsa::Scalar;
}

CpuIsa parse_cpu_isa(const std::string& name) {
  if (name == "scalar") return CpuIsa::Scalar;
  if (name == "avx2") return CpuIsa::Avx2;
  if (name == "avx512") return CpuIsa::Avx512;
  if (name == "amx") return CpuIsa::Amx;
  fail("unknown CPU level '" + name + "' (expected scalar, avx2, avx512 or amx)");
}

void set_cpu_isa(CpuIsa isa) {
  const CpuIsa best = cpu_isa_detected();
  if (int(isa) > int(best))
    fail(std::string("this CPU cannot run the ") + cpu_isa_name(isa) + " kernels (best level: " + cpu_isa_name(best) +
         ")");
  g_isa.store(int(isa));
}

CpuIsa cpu_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v >= 0) return CpuIsa(v);
  CpuIsa isa = cpu_isa_detected();
  if (const char* env = std::getenv("K3_CPU_ISA"); env && *env) {
    const CpuIsa want = parse_cpu_isa(env);
    if (int(want) > int(isa))
      fail(std::string("K3_CPU_ISA=") + env + ": this CPU cannot run it (best level: " + cpu_isa_name(isa) + ")");
    isa = want;
  }
  g_isa.store(int(isa));
  return isa;
}

const char* numerics_name(Numerics n) {
  switch (n) {
    case Numerics::Exact:
      return "exact";
    case Numerics::F32:
      return "fp32";
    case Numerics::Fast:
      return "fast";
  }
  return "?";
}

CpuIsa Exec::level() const { return numerics == Numerics::Exact ? CpuIsa::Scalar : cpu_isa(); }

Numerics parse_numerics(const std::string& name) {
  if (name == "exact") return Numerics::Exact;
  if (name == "fp32") return Numerics::F32;
  if (name == "fast") return Numerics::Fast;
  fail("unknown numerics '" + name + "' (expected exact, fp32 or fast)");
}

}  // namespace k3::ops
