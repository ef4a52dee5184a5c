// Element types of checkpoint tensors and their exact decoders to fp32.
// Owns: safetensors dtype names, element sizes, bf16/f16/fp8-e4m3/e2m1/e8m0 decoding.
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

float f16_to_f32(uint16_t h);      // IEEE binary16, subnormals and inf/NaN exact
uint16_t f32_to_f16(float f);      // round-to-nearest-even
float fp8_e4m3_to_f32(uint8_t b);  // OCP E4M3FN: bias 7, no inf, S.1111.111 = NaN

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
