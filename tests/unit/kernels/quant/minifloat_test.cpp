// The element codecs of kernels/quant/minifloat.hpp and mxfp4.hpp against hand-checked values
// and exhaustive sweeps: E2M1, E4M3, E8M0, the MX and UE8M0 scale rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/quant/fp8_blockwise.hpp"
#include "kernels/quant/mxfp4.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::bits;

float f(uint32_t b) { return f32_from_bits(b); }

// ---- E2M1 ---------------------------------------------------------------------------------

TEST(E2M1, DecodesEveryCode) {
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint32_t c = 0; c < 16; ++c) EXPECT_EQ(e2m1_decode_bits(c, 0), bits(expect[c])) << c;
  EXPECT_EQ(e2m1_decode_bits(7, 3), bits(48.0f));
  EXPECT_EQ(e2m1_decode_bits(1, -127), bits(std::ldexp(1.0f, -128)));  // FP32 subnormal, exact
  EXPECT_EQ(e2m1_decode_bits(7, 127), bits(std::numeric_limits<float>::infinity()));  // 6 * 2^127
}

TEST(E2M1, RoundsToNearestEvenAndSaturates) {
  struct Case {
    float x;
    uint32_t code;
  };
  const Case cases[] = {
      {0.0f, 0},     {-0.0f, 8},    {0.24f, 0},  {0.25f, 0},  {0.2500001f, 1}, {-0.25f, 8},
      {0.5f, 1},     {0.75f, 2},    {0.74f, 1},  {1.0f, 2},   {1.25f, 2},       {1.2500001f, 3},
      {1.5f, 3},     {1.75f, 4},    {2.0f, 4},   {2.5f, 4},   {2.5000002f, 5},  {3.0f, 5},
      {3.5f, 6},     {4.0f, 6},     {5.0f, 6},   {5.0000005f, 7}, {6.0f, 7},    {7.9f, 7},
      {1e30f, 7},    {-1e30f, 15},  {-1.75f, 12}, {-5.5f, 15},
      {std::ldexp(1.0f, -140), 0},  {-std::ldexp(1.0f, -149), 8},  // float subnormals -> +-0
  };
  for (const Case& c : cases) EXPECT_EQ(e2m1_encode(bits(c.x), 0), c.code) << c.x;
}

TEST(E2M1, ScaleExponentDividesExactly) {
  // x / 2^e: 12 with e = 1 is 6; 0.375 with e = -2 is 1.5; 2^-127 with e = -127 is 1.
  EXPECT_EQ(e2m1_encode(bits(12.0f), 1), 7u);
  EXPECT_EQ(e2m1_encode(bits(0.375f), -2), 3u);
  EXPECT_EQ(e2m1_encode(bits(std::ldexp(1.0f, -127)), -127), 2u);
  // Subnormal inputs divided by the smallest scale land on E2M1's grid: 1.5 * 2^-127 -> 1.5,
  // 2^-128 -> 0.5, 1.5 * 2^-128 -> 0.75 (a tie: 1.0, the even code).
  EXPECT_EQ(e2m1_encode(bits(std::ldexp(1.5f, -127)), -127), 3u);
  EXPECT_EQ(e2m1_encode(bits(std::ldexp(1.0f, -128)), -127), 1u);
  EXPECT_EQ(e2m1_encode(bits(std::ldexp(1.5f, -128)), -127), 2u);
}

TEST(E2M1, PacksLowNibbleFirst) {
  const Fp4x2 p = fp4x2_pack(0x1, 0xA);  // element 0 = 0.5, element 1 = -1
  EXPECT_EQ(p.bits, 0xA1);
  EXPECT_EQ(fp4x2_even(p), 0x1u);
  EXPECT_EQ(fp4x2_odd(p), 0xAu);
}

// ---- E4M3 ---------------------------------------------------------------------------------

double e4m3_value(uint32_t c) {  // written from the format description, in double
  const int e = (c >> 3) & 15, m = c & 7;
  const double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (c & 0x80) ? -mag : mag;
}

TEST(E4M3, DecodesEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const uint32_t got = e4m3_decode_bits(E4M3{static_cast<uint8_t>(c)}, 0);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_EQ(got, kF32CanonicalNan) << c;
      continue;
    }
    EXPECT_EQ(got, bits(static_cast<float>(e4m3_value(c)))) << c;
  }
  EXPECT_EQ(e4m3_decode_bits(E4M3{0x7e}, 0), bits(448.0f));
  EXPECT_EQ(e4m3_decode_bits(E4M3{0x01}, 0), bits(std::ldexp(1.0f, -9)));
  EXPECT_EQ(e4m3_decode_bits(E4M3{0x08}, 0), bits(std::ldexp(1.0f, -6)));
  EXPECT_EQ(e4m3_decode_bits(E4M3{0x80}, 0), bits(-0.0f));
  // Scaled into FP32 subnormals, still exact: 2^-9 * 2^-127 = 2^-136.
  EXPECT_EQ(e4m3_decode_bits(E4M3{0x01}, -127), bits(std::ldexp(1.0f, -136)));
}

TEST(E4M3, EveryFiniteCodeRoundTripsAndMidpointsTieToEven) {
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = f(e4m3_decode_bits(E4M3{static_cast<uint8_t>(c)}, 0));
    EXPECT_EQ(e4m3_encode(bits(v), 0).bits, c) << c;
    if ((c & 0x7f) == 0x7e) continue;
    const double next = e4m3_value(c + 1);
    const float mid = static_cast<float>((e4m3_value(c) + next) / 2);  // exact in FP32
    const uint32_t even = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(e4m3_encode(bits(mid), 0).bits, even) << "midpoint above code " << c;
    const float past = std::nextafter(mid, std::copysign(INFINITY, mid));
    EXPECT_EQ(e4m3_encode(bits(past), 0).bits, c + 1) << "just past the midpoint above code " << c;
  }
}

TEST(E4M3, SaturatesAndKeepsSigns) {
  EXPECT_EQ(e4m3_encode(bits(448.0f), 0).bits, 0x7e);
  EXPECT_EQ(e4m3_encode(bits(463.9f), 0).bits, 0x7e);
  EXPECT_EQ(e4m3_encode(bits(464.0f), 0).bits, 0x7e);  // tie with 480 (not representable)
  EXPECT_EQ(e4m3_encode(bits(1e38f), 0).bits, 0x7e);
  EXPECT_EQ(e4m3_encode(bits(-1e38f), 0).bits, 0xfe);
  EXPECT_EQ(e4m3_encode(bits(-0.0f), 0).bits, 0x80);
  EXPECT_EQ(e4m3_encode(bits(-std::ldexp(1.0f, -11)), 0).bits, 0x80);  // rounds to -0
  EXPECT_EQ(e4m3_encode(bits(std::ldexp(1.0f, -10)), 0).bits, 0x00);   // tie 0 / 2^-9 -> 0
  EXPECT_EQ(e4m3_encode(bits(std::ldexp(3.0f, -10)), 0).bits, 0x02);   // tie 1 / 2 -> 2
  EXPECT_EQ(e4m3_encode(bits(15.5f), 0).bits, 0x58);                   // 15 | 16 -> 16 (even)
  EXPECT_EQ(e4m3_encode(bits(std::ldexp(1.0f, -6) * 0.9375f), 0).bits, 0x08);  // up into normals
}

// ---- E8M0 and the scale rules ---------------------------------------------------------------

TEST(E8M0, DecodesTheRange) {
  EXPECT_EQ(e8m0_decode_bits(E8M0{0}), 0x00400000u);  // 2^-127, an FP32 subnormal
  EXPECT_EQ(e8m0_decode_bits(E8M0{1}), bits(std::ldexp(1.0f, -126)));
  EXPECT_EQ(e8m0_decode_bits(E8M0{127}), bits(1.0f));
  EXPECT_EQ(e8m0_decode_bits(E8M0{254}), bits(std::ldexp(1.0f, 127)));
  EXPECT_EQ(e8m0_decode_bits(E8M0{255}), kF32CanonicalNan);
  EXPECT_EQ(e8m0_from_exponent(-200).bits, 0);
  EXPECT_EQ(e8m0_from_exponent(200).bits, 254);
}

TEST(MxScale, FollowsOcpRule) {
  // E2M1 (emax 2): amax 6 -> 2^0; 4 -> 2^0; 8 -> 2^1; 7.99 -> 2^0 (then clips); 0.75 -> 2^-3.
  EXPECT_EQ(mx_scale_from_amax(bits(6.0f), 2).bits, 127);
  EXPECT_EQ(mx_scale_from_amax(bits(4.0f), 2).bits, 127);
  EXPECT_EQ(mx_scale_from_amax(bits(8.0f), 2).bits, 128);
  EXPECT_EQ(mx_scale_from_amax(bits(7.99f), 2).bits, 127);
  EXPECT_EQ(mx_scale_from_amax(bits(0.75f), 2).bits, 124);
  // E4M3 (emax 8): 448 -> 2^0; 512 -> 2^1; 1 -> 2^-8.
  EXPECT_EQ(mx_scale_from_amax(bits(448.0f), 8).bits, 127);
  EXPECT_EQ(mx_scale_from_amax(bits(512.0f), 8).bits, 128);
  EXPECT_EQ(mx_scale_from_amax(bits(1.0f), 8).bits, 119);
  // Zero, subnormal and huge amax; NaN and Inf.
  EXPECT_EQ(mx_scale_from_amax(0, 2).bits, 0);
  EXPECT_EQ(mx_scale_from_amax(bits(std::ldexp(1.0f, -140)), 2).bits, 0);  // clamped to 2^-127
  EXPECT_EQ(mx_scale_from_amax(bits(std::ldexp(1.0f, -124)), 2).bits, 1);  // 2^-126
  EXPECT_EQ(mx_scale_from_amax(bits(std::numeric_limits<float>::max()), 2).bits, 252);  // 2^125
  EXPECT_EQ(mx_scale_from_amax(bits(std::numeric_limits<float>::infinity()), 2).bits, 255);
  EXPECT_EQ(mx_scale_from_amax(0x7fc00000u, 8).bits, 255);
}

E8M0 ue8m0(float amax) { return ue8m0_scale_from_quotient(bits(amax), amax / 448.0f); }

TEST(Ue8m0Scale, IsThePowerOfTwoAtOrAboveAmaxOver448) {
  EXPECT_EQ(ue8m0(448.0f).bits, 127);   // exactly 1
  EXPECT_EQ(ue8m0(449.0f).bits, 128);   // just above: 2
  EXPECT_EQ(ue8m0(896.0f).bits, 128);   // exactly 2
  EXPECT_EQ(ue8m0(224.0f).bits, 126);   // exactly 1/2
  EXPECT_EQ(ue8m0(1.0f).bits, 127 - 8); // 1/448 -> 2^-8
  EXPECT_EQ(ue8m0(0.0f).bits, 0);       // zero block: 2^-127
  EXPECT_EQ(ue8m0(1e-38f).bits, 0);     // 1e-38 / 448 = 2.2e-41 <= 2^-127: clamped
  EXPECT_EQ(ue8m0(std::numeric_limits<float>::max()).bits, 127 + 120);
  EXPECT_EQ(ue8m0(std::numeric_limits<float>::infinity()).bits, 255);
}

TEST(Ue8m0Scale, SubnormalQuotients) {
  // s = 2^-127 exactly (a subnormal) -> 2^-127; s just above -> 2^-126.
  const float s_exact = std::ldexp(1.0f, -127);
  EXPECT_EQ(ue8m0_scale_from_quotient(bits(1.0f), s_exact).bits, 0);
  EXPECT_EQ(ue8m0_scale_from_quotient(bits(1.0f), std::nextafter(s_exact, 1.0f)).bits, 1);
  EXPECT_EQ(ue8m0_scale_from_quotient(bits(1.0f), std::ldexp(1.0f, -149)).bits, 0);
}

TEST(Compose, ExactSubnormalsAndOverflow) {
  EXPECT_EQ(compose_f32(1, -149), 1u);
  EXPECT_EQ(compose_f32(3, -149), 3u);
  EXPECT_EQ(compose_f32(15, -136), bits(15.0f * std::ldexp(1.0f, -136)));
  EXPECT_EQ(compose_f32(3, 127), bits(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(compose_f32(1, 127), bits(std::ldexp(1.0f, 127)));
  EXPECT_EQ(exp2_bits(-127), 0x00400000u);
  EXPECT_EQ(floor_log2_f32(1u), -149);
  EXPECT_EQ(floor_log2_f32(bits(6.0f)), 2);
}

}  // namespace
}  // namespace rolloutd::quant
