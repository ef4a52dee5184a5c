// Dtype names and exact decoders (see dtype.h).
#include "core/dtype.h"

#include <bit>
#include <cmath>
#include <limits>

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

uint8_t f32_to_fp8_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7f;   // NaN
  if (mag >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and inf): saturate
  if (mag < 0x3c800000u) {
    // Below 2^-6, the smallest normal: multiples of 2^-9 (subnormal codes 0..7; 8 is 2^-6, the first
    // normal code, reached by rounding up). a * 2^9 is exact; nearbyint rounds ties to even.
    float a;
    std::memcpy(&a, &mag, 4);
    return sign | uint8_t(std::nearbyint(a * 512.0f));
  }
  // Normal: keep 3 of the 23 mantissa bits, round the other 20 to nearest even (a carry moves into
  // the exponent, as it must); a result above 448 (0x7e) saturates.
  const uint32_t exp = (mag >> 23) - 127 + 7, man = mag & 0x7fffffu;
  uint32_t r = (exp << 3) | (man >> 20);
  const uint32_t rem = man & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (r & 1))) ++r;
  return sign | uint8_t(r > 0x7e ? 0x7e : r);
}

namespace {
// The decode table, built at compile time from the bit fields (the function below is the
// independent definition; tests/unit/test_dtype.cpp checks that the two agree on all 256 codes).
constexpr float e4m3_value(int b) {
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7)
    return (b & 0x80) ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
  const float mag =
      exp == 0 ? float(man) / 512.0f : float(8 + man) / 8.0f * std::bit_cast<float>(uint32_t(exp - 7 + 127) << 23);
  return (b & 0x80) ? -mag : mag;
}
struct E4m3Table {
  float v[256];
};
constexpr E4m3Table make_e4m3_table() {
  E4m3Table t{};
  for (int b = 0; b < 256; ++b) t.v[b] = e4m3_value(b);
  return t;
}
constexpr E4m3Table kE4m3Table = make_e4m3_table();
}  // namespace

const float (&kE4M3)[256] = kE4m3Table.v;

float fp8_e4m3_to_f32(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf;
  const int man = b & 0x7;
  if (exp == 0xf && man == 0x7) return std::copysign(__builtin_nanf(""), sign);  // S.1111.111, sign kept
  if (exp == 0) return sign * std::ldexp(float(man), -9);                        // subnormal: man/8 * 2^-6
  return sign * std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
}

}  // namespace k3
