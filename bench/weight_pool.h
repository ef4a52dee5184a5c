// Random weights in the stored formats for the kernel benchmarks (k3_gemv_bench, k3_gemm_bench):
// BF16 values of magnitude 2^-9..2^-6 and MXFP4 nibbles with E8M0 scales 2^-9..2^-6, each buffer
// at the offset mmap'd safetensors data most often has. And the benches' --level flag.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ops/cpu/isa.h"
#include "ops/weight.h"

namespace k3bench {

// --level NAME (empty: the detected level): sets the CPU level, or prints one line naming `prog`
// and returns false (an unknown name, or a level this CPU lacks).
inline bool select_level(const char* prog, const std::string& level) {
  if (level.empty()) return true;
  k3::ops::CpuIsa want{};
  try {
    want = k3::ops::parse_cpu_isa(level);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", prog, e.what());
    return false;
  }
  if (int(want) > int(k3::ops::cpu_isa_detected())) {
    std::fprintf(stderr, "%s: level %s is not available on this CPU\n", prog, level.c_str());
    return false;
  }
  k3::ops::set_cpu_isa(want);
  return true;
}

struct Pool {
  std::vector<std::unique_ptr<uint8_t[]>> bufs;
  std::mt19937_64 rng{7};
  // Buffers start 48 bytes past a 64-byte boundary: safetensors data sits at any 8-byte offset,
  // and 48 is the most common one in the generated checkpoints.
  uint8_t* alloc(size_t n) {
    bufs.emplace_back(new uint8_t[n + 128]);
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bufs.back().get()) + 63) / 64 * 64 + 48);
  }
  k3::WeightMat bf16(int64_t rows, int64_t cols) {
    const size_t n = size_t(rows * cols);
    auto* p = reinterpret_cast<uint16_t*>(alloc(2 * n));
    for (size_t i = 0; i < n; ++i) p[i] = uint16_t((rng() & 0x807f) | ((118 + rng() % 4) << 7));
    return {k3::WFormat::BF16, rows, cols, p, nullptr};
  }
  k3::WeightMat mxfp4(int64_t rows, int64_t cols) {
    const size_t n = size_t(rows * cols);
    uint8_t* p = alloc(n / 2);
    uint8_t* s = alloc(n / 32);
    for (size_t i = 0; i < n / 2; ++i) p[i] = uint8_t(rng());
    for (size_t i = 0; i < n / 32; ++i) s[i] = uint8_t(118 + rng() % 4);
    return {k3::WFormat::MXFP4, rows, cols, p, s};
  }
};

}  // namespace k3bench
