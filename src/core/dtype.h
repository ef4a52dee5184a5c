// Element types of checkpoint tensors, their exact decoders to fp32 and the encoders from it.
// Owns: safetensors dtype names, element sizes, bf16/f16/fp8-e4m3/e2m1/e8m0 decoding, and the
// rounding fp32 -> bf16/f16/fp8-e4m3.
// Must not: know about model structure or quantization policy (that is ops + model binding).
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace k3 {

enum class DType : uint8_t { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

const char* dtype_name(DType t);  // safetensors spelling, e.g. "BF16"
size_t dtype_size(DType t);       // bytes per element
std::optional<DType> dtype_from_name(std::string_view safetensors_name);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even fp32 -> bf16 (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);  // IEEE binary16, subnormals and inf/NaN exact
uint16_t f32_to_f16(float f);  // round-to-nearest-even
// FP8 E4M3 as the OCP 8-bit floating point specification (OFP8, rev. 1.0, 2023: "E4M3") defines it:
// 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, S.1111.111 = NaN (the only NaNs),
// largest finite 448 (S.1111.110), smallest subnormal 2^-9 (exponent 0: mantissa/8 * 2^-6).
float fp8_e4m3_to_f32(uint8_t b);
// Round to nearest, ties to even (as the spec's roundTiesToEven), saturating: every |f| >= 448 and
// +-inf become +-448 (the spec's saturating conversion); NaN becomes S.1111.111 with f's sign.
uint8_t f32_to_fp8_e4m3(float f);
// fp8_e4m3_to_f32 of every code (the scalar kernels' decode table).
extern const float (&kE4M3)[256];

// MXFP4 element (E2M1, bit 3 = sign) and group scale (E8M0, 2^(s-127), 255 = NaN per OCP MX).
extern const float kE2M1[16];
inline float e8m0_to_f32(uint8_t s) {
  if (s == 255) return __builtin_nanf("");
  uint32_t u = s == 0 ? 0x00400000u /* 2^-127 is subnormal */ : uint32_t(s) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace k3
