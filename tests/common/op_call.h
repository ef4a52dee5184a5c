// Calls one op of either implementation with the same arguments: k3::ref::name(args...) for the
// fp64 twin, k3::ops::name(ex, args...) for the CPU ops in the execution context ex (the ops take
// it first; the twins take none). For tests that run every check on several implementations.
#pragma once
#include "ops/ops.h"

namespace k3test {
struct OpImpl {
  const char* name;
  bool is_ref;
  k3::ops::Exec ex;  // for the ops (unused by the twins)
};
// The twin, the ops' scalar level (exact numerics) and their SIMD level in fp32.
inline constexpr OpImpl kOpImpls[] = {
    {"k3::ops exact", false, k3::ops::kExact}, {"k3::ops fp32", false, k3::ops::kF32}, {"k3::ref", true, {}}};
}  // namespace k3test

// A callable that runs op `name` of the implementation `im` (an OpImpl) on its arguments.
#define K3_OP(im, name)             \
  [&im](auto&&... a) {              \
    if ((im).is_ref)                \
      k3::ref::name(a...);          \
    else                            \
      k3::ops::name((im).ex, a...); \
  }
