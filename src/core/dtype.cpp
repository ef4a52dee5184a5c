// Dtype names and exact decoders (see dtype.h).
#include "core/dtype.h"

#include <cmath>

namespace k3 {

const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

namespace {
struct DTypeInfo {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kInfo[] = {
    {DType::F64, "F64", 8},         {DType::F32, "F32", 4},         {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},         {DType::I8, "I8", 1},           {DType::U8, "U8", 1},   {DType::BOOL, "BOOL", 1},
};
}  // namespace

const char* dtype_name(DType t) {
  for (const auto& i : kInfo)
    if (i.t == t) return i.name;
  return "?";
}

size_t dtype_size(DType t) {
  for (const auto& i : kInfo)
    if (i.t == t) return i.size;
  return 0;
}

std::optional<DType> dtype_from_name(std::string_view n) {
  for (const auto& i : kInfo)
    if (n == i.name) return i.t;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(float(man), -24);  // subnormal (or zero)
  } else if (exp == 31) {
    mag = man ? __builtin_nanf("") : __builtin_inff();
  } else {
    uint32_t u = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&mag, &u, 4);
  }
  uint32_t u;
  std::memcpy(&u, &mag, 4);
  u |= sign;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;
  if (a < 6.103515625e-05f) {  // subnormal range: quantize to multiples of 2^-24
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));
  }
  uint32_t ua;
  std::memcpy(&ua, &a, 4);
  uint32_t mant = ua & 0x7fffff;
  int32_t e = int32_t(ua >> 23) - 127 + 15;
  uint32_t r = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;  // round to nearest even (may carry into exp)
  return sign | uint16_t(r);
}

float fp8_e4m3_to_f32(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf;
  const int man = b & 0x7;
  if (exp == 0xf && man == 0x7) return __builtin_nanf("");
  if (exp == 0) return sign * std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  return sign * std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
}

}  // namespace k3
