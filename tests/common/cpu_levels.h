// Tests parameterised over the CPU kernel levels (ops/cpu/isa.h): one test per level, the level set
// for the test's body and the detected one restored after. A level this CPU (or this build) lacks is
// a skipped test that names it, never a silent pass.
// Owns: nothing the engine uses; test-only.
#pragma once
#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "ops/cpu/isa.h"

namespace k3::ops {
// gtest prints a parameter with this (ctest names, "where GetParam() = avx2").
inline void PrintTo(CpuIsa l, std::ostream* os) { *os << cpu_isa_name(l); }
}  // namespace k3::ops

namespace k3test {

inline auto all_cpu_levels() {
  return ::testing::Values(k3::ops::CpuIsa::Scalar, k3::ops::CpuIsa::Avx2, k3::ops::CpuIsa::Avx512,
                           k3::ops::CpuIsa::Amx);
}

inline std::string cpu_level_name(const ::testing::TestParamInfo<k3::ops::CpuIsa>& i) {
  return k3::ops::cpu_isa_name(i.param);
}

// Sets `level` for the kernels, or skips the calling test (from SetUp) naming the level it lacks.
inline void enter_cpu_level(k3::ops::CpuIsa level) {
  if (int(level) > int(k3::ops::cpu_isa_detected()))
    GTEST_SKIP() << "this CPU lacks the " << k3::ops::cpu_isa_name(level)
                 << " level (best: " << k3::ops::cpu_isa_name(k3::ops::cpu_isa_detected()) << ")";
  k3::ops::set_cpu_isa(level);
}
inline void leave_cpu_level() { k3::ops::set_cpu_isa(k3::ops::cpu_isa_detected()); }

// The fixture of a test over the levels alone: TEST_P(Suite, Name), GetParam() = the level.
class CpuLevelTest : public ::testing::TestWithParam<k3::ops::CpuIsa> {
 protected:
  void SetUp() override { enter_cpu_level(GetParam()); }
  void TearDown() override { leave_cpu_level(); }
};

}  // namespace k3test
