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
