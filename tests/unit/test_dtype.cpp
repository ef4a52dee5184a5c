// Exact decoders of core/dtype.h against values computed by hand from the format definitions.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

using namespace k3;

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::F8_E5M2, DType::I64,
                  DType::I32, DType::I16, DType::I8, DType::U8, DType::BOOL}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, t);
    EXPECT_GT(dtype_size(t), 0u);
  }
  EXPECT_FALSE(dtype_from_name("FP4").has_value());
}

TEST(DType, Bf16) {
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between bf16 1.0 and 1+2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);  // 1 + 3*2^-8 ties up to even
}

TEST(DType, F16) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h) << h;
}

TEST(DType, Fp8E4M3) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);    // exp 7, man 0
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);  // max finite
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
}

// f32_to_fp8_e4m3 against the definition: every code decodes and encodes back to itself (all 256:
// the NaN codes to NaN codes of their sign), the decode table is the decoder, the midpoint between two
// neighbouring codes rounds to the even one (and a hair off it to the nearer one), everything at or
// above 448 saturates, and the nearest code by exhaustive search is what comes out for random values.
TEST(DType, Fp8E4M3AllCodesRoundTrip) {
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_e4m3_to_f32(uint8_t(b));
    const bool nan = (b & 0x7f) == 0x7f;
    EXPECT_EQ(std::isnan(v), nan) << b;
    EXPECT_EQ(std::isnan(kE4M3[b]), nan) << b;
    if (!nan) {
      EXPECT_EQ(kE4M3[b], v) << b;
      EXPECT_EQ(std::signbit(kE4M3[b]), bool(b & 0x80)) << b;
    }
    EXPECT_EQ(f32_to_fp8_e4m3(v), uint8_t(b)) << b;  // -0 -> 0x80, NaN -> S.1111.111 of its sign
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
}

TEST(DType, Fp8E4M3RoundsTiesToEven) {
  int ties = 0;
  for (int b = 0; b < 0x7e; ++b) {  // consecutive positive finite codes b, b + 1
    const float lo = fp8_e4m3_to_f32(uint8_t(b)), hi = fp8_e4m3_to_f32(uint8_t(b + 1));
    const float mid = (lo + hi) / 2;  // exact in fp32
    const uint8_t even = uint8_t(b % 2 == 0 ? b : b + 1);
    EXPECT_EQ(f32_to_fp8_e4m3(mid), even) << "tie between codes " << b << " and " << b + 1;
    EXPECT_EQ(f32_to_fp8_e4m3(-mid), uint8_t(0x80 | even)) << b;
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 0.0f)), uint8_t(b)) << b;
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 1e9f)), uint8_t(b + 1)) << b;
    ++ties;
  }
  EXPECT_EQ(ties, 126);
  // Examples by hand: 1 + 1/16 is half way between 1 (0x38) and 1.125 (0x39): even is 0x38; 1 + 3/16 ties up to 0x3a.
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);
  // Below the smallest subnormal's half: zero; half of it ties to even (zero); just above: 2^-9.
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_fp8_e4m3(1e-40f), 0x00);  // an fp32 subnormal
}

TEST(DType, Fp8E4M3SaturatesAndKeepsNaN) {
  for (float f : {448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 1e6f, 3.4e38f, __builtin_inff()}) {
    EXPECT_EQ(f32_to_fp8_e4m3(f), 0x7e) << f;
    EXPECT_EQ(f32_to_fp8_e4m3(-f), 0xfe) << f;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(432.0f), 0x7e);  // half way between 416 (0x7d) and 448: ties to the even code, 448
  EXPECT_EQ(f32_to_fp8_e4m3(__builtin_nanf("")), 0x7f);
  EXPECT_EQ(f32_to_fp8_e4m3(-__builtin_nanf("")), 0xff);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
}

TEST(DType, Fp8E4M3IsTheNearestCode) {
  // Nearest finite code by search over all 127 magnitudes (ties: the even code), for values spread
  // over the whole range (2^-12 .. 2^9) and both signs.
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    const float mag = std::ldexp(1.0f + float(state >> 8) / 16777216.0f, int(state % 22) - 12);
    const float f = (state & 0x80) ? -mag : mag;
    int best = 0;
    double best_d = 1e300;
    for (int b = 0; b <= 0x7e; ++b) {
      const double d = std::fabs(double(fp8_e4m3_to_f32(uint8_t(b))) - double(std::fabs(f)));
      if (d < best_d || (d == best_d && b % 2 == 0)) best = b, best_d = d;
    }
    ASSERT_EQ(f32_to_fp8_e4m3(f), uint8_t(best | (f < 0 ? 0x80 : 0))) << f;
  }
}

TEST(DType, Mxfp4Parts) {
  EXPECT_EQ(kE2M1[7], 6.0f);
  EXPECT_EQ(kE2M1[9], -0.5f);
  EXPECT_TRUE(std::signbit(kE2M1[8]));
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(121), 1.0f / 64);
  EXPECT_EQ(e8m0_to_f32(128), 2.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(Error, ProblemListNamesEveryProblem) {
  ProblemList p;
  p.throw_if_any("nothing");
  p.add("missing tensor a");
  p.add("extra tensor b");
  try {
    p.throw_if_any("checkpoint x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "checkpoint x: 2 problems: missing tensor a; extra tensor b");
    EXPECT_EQ(e.exit_code(), 2);
  }
}

TEST(Error, ProblemListCapsALongList) {
  // Hundreds of problems (a config far from its checkpoint) stay one readable line: the first 8,
  // then how many more.
  ProblemList p;
  for (int i = 0; i < 300; ++i) p.add("missing tensor t" + std::to_string(i));
  try {
    p.throw_if_any("ck");
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("ck: 300 problems: missing tensor t0; missing tensor t1; ", 0), 0u) << msg;
    EXPECT_NE(msg.find("missing tensor t7; and 292 more"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("t8"), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 300u) << msg;
  }
  ProblemList eight;
  for (int i = 0; i < 8; ++i) eight.add("p" + std::to_string(i));
  try {
    eight.throw_if_any("x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "x: 8 problems: p0; p1; p2; p3; p4; p5; p6; p7");
  }
}
