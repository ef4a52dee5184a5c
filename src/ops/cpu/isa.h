// CPU instruction-set levels for the SIMD kernels and the one process-wide choice among them.
// Owns: detection (cpuid via the compiler builtins), the K3_CPU_ISA override, the name printed
// by `k3 info`/`k3 bench`, and the Numerics mode of weight GEMMs (exact fp32 vs bf16 activations).
// Must not: contain kernels. Kernels live in per-ISA translation units compiled with their own
// -m flags (gemm_avx512.cpp, ...) that are only ever called after this module said the CPU has them.
#pragma once
#include <cstdint>
#include <string>

namespace k3 {
struct WeightMat;
}
namespace k3::ops {

// Ordered: a higher level may use everything a lower one does.
//   Scalar  plain C++ (the compiler's baseline x86-64 / any architecture)
//   Avx2    AVX2 + FMA + F16C
//   Avx512  AVX-512 F/BW/VL/DQ + BF16 (vdpbf16ps) + VNNI (vpdpbusd) + FMA + F16C
//   Amx     Avx512 + AMX tiles with BF16 (tdpbf16ps; Intel Xeon 4th generation on), granted by the
//           kernel (Linux >= 5.16): the fast-numerics prefill GEMMs on the tiles, all else as Avx512
enum class CpuIsa : uint8_t { Scalar = 0, Avx2 = 1, Avx512 = 2, Amx = 3 };

const char* cpu_isa_name(CpuIsa isa);  // "scalar", "avx2", "avx512", "amx"
CpuIsa cpu_isa_detected();             // best level this CPU (and this build) supports
// The level the kernels use now: the detected one, capped by the environment variable
// K3_CPU_ISA=scalar|avx2|avx512|amx when set (k3::Error naming the value if it is unknown or the CPU
// lacks it). Resolved once, on first use.
CpuIsa cpu_isa();
// Forces a level (tests, `--cpu-isa`); k3::Error if this CPU cannot run it. Not thread-safe with
// kernels running concurrently: call between forward passes.
void set_cpu_isa(CpuIsa isa);
CpuIsa parse_cpu_isa(const std::string& name);  // k3::Error on anything else

// How the CPU ops compute.
//   Exact: the scalar kernels at every CPU level: fp32 products summed in fp64, the KDA state in
//          fp64 within a call. Reference grade (the whole-model gates run in this mode: within 1e-5
//          of the fp64 reference even on fixtures that amplify fp32 rounding), and slow.
//   F32:   the SIMD kernels of the active level in fp32 (fp32 FMA accumulation, fp32 KDA state).
//   Fast:  F32, plus rounded activations where it pays: GEMMs with T >= kFastMinRows (prefill)
//          round them to bf16 (8 significant bits, <= 2^-9 relative each) and, on avx512, use
//          vdpbf16ps with fp32 accumulation, as llama.cpp does for bf16 weights; MXFP4 GEMVs
//          (decode: decoding nibbles to fp32 costs more than the memory read) quantise them per
//          32-block to int8 (step max|x|/127, like llama.cpp's q8_0) and, on avx512, use vpdpbusd
//          with exact integer sums. BF16/F16/F32 GEMVs are memory-bound and stay F32. Weights are
//          never rounded. The CLI default.
enum class Numerics : uint8_t { Exact = 0, F32 = 1, Fast = 2 };
constexpr int64_t kFastMinRows = 4;
const char* numerics_name(Numerics n);
Numerics parse_numerics(const std::string& name);  // "exact" | "fp32" | "fast", k3::Error otherwise

// The execution context of one CPU op call, passed explicitly as every op's first argument (there
// is no thread-local or global numerics mode: a worker thread computes what its caller asked for,
// and two callers on one thread cannot leak a mode into each other).
struct Exec {
  Numerics numerics = Numerics::Exact;
  // The kernel level of the call: Scalar under Numerics::Exact, else cpu_isa().
  CpuIsa level() const;
  bool fast() const { return numerics == Numerics::Fast; }
};
inline constexpr Exec kExact{Numerics::Exact};
inline constexpr Exec kF32{Numerics::F32};
inline constexpr Exec kFast{Numerics::Fast};

// Whether ops::matmul(ex, W, X, T, ..) rounds X (bf16 rows, or 8-bit blocks at T = 1) (rule above).
bool fast_applies(Exec ex, const WeightMat& W, int64_t T);

}  // namespace k3::ops
