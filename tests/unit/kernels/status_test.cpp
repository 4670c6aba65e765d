// kernels/status.cpp and kernels/dtype.cpp: wire names are stable and round-trip, field
// paths compose.
#include "kernels/status.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "kernels/dtype.hpp"

namespace rolloutd {
namespace {

constexpr ErrorCode kLastCode = ErrorCode::kUnauthenticated;

TEST(ErrorCodeName, EveryCodeRoundTripsThroughItsUniqueName) {
  std::set<std::string> seen;
  for (int i = 0; i <= static_cast<int>(kLastCode); ++i) {
    const auto code = static_cast<ErrorCode>(i);
    const std::string_view name = error_code_name(code);
    ASSERT_FALSE(name.empty()) << i;
    EXPECT_TRUE(seen.insert(std::string(name)).second) << "duplicate name " << name;
    const auto back = error_code_from_name(name);
    ASSERT_TRUE(back.has_value()) << name;
    EXPECT_EQ(*back, code) << name;
  }
}

TEST(ErrorCodeName, NamesOnTheWireAreTheDocumentedOnes) {
  EXPECT_EQ(error_code_name(ErrorCode::kOk), "ok");
  EXPECT_EQ(error_code_name(ErrorCode::kOutOfRange), "out_of_range");
  EXPECT_EQ(error_code_name(ErrorCode::kInvalidArgument), "invalid_argument");
  EXPECT_EQ(error_code_name(ErrorCode::kCudaError), "cuda_error");
  EXPECT_EQ(error_code_name(ErrorCode::kUnauthenticated), "unauthenticated");
}

TEST(ErrorCodeName, UnknownNameIsNullopt) {
  EXPECT_FALSE(error_code_from_name("").has_value());
  EXPECT_FALSE(error_code_from_name("OUT_OF_RANGE").has_value());
  EXPECT_FALSE(error_code_from_name("no_such_code").has_value());
}

TEST(Status, DefaultIsOk) {
  const Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kOk);
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CarriesCodeMessageAndField) {
  const Status s(ErrorCode::kOutOfRange, "token id 9 outside [0, 4)", "ids");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(s.message(), "token id 9 outside [0, 4)");
  EXPECT_EQ(s.field(), "ids");
  EXPECT_EQ(s.to_string(), "out_of_range: token id 9 outside [0, 4) (field=ids)");
  EXPECT_EQ(Status(ErrorCode::kInternal, "bug").to_string(), "internal: bug");
}

TEST(Status, WithFieldPrefixJoinsPaths) {
  const Status s(ErrorCode::kWrongType, "expected int", "input_ids");
  EXPECT_EQ(s.with_field_prefix("body").field(), "body.input_ids");
  EXPECT_EQ(s.with_field_prefix("body").with_field_prefix("msg").field(), "msg.body.input_ids");
  // An index is appended without a dot.
  const Status idx(ErrorCode::kOutOfRange, "bad", "[3]");
  EXPECT_EQ(idx.with_field_prefix("body.input_ids").field(), "body.input_ids[3]");
  // No field yet: the prefix becomes the field.
  const Status bare(ErrorCode::kMissingField, "missing");
  EXPECT_EQ(bare.with_field_prefix("body.rid").field(), "body.rid");
  // The rest of the status is kept.
  const Status p = s.with_field_prefix("body");
  EXPECT_EQ(p.code(), ErrorCode::kWrongType);
  EXPECT_EQ(p.message(), "expected int");
}

TEST(Status, WithFieldPrefixLeavesOkAndEmptyPrefixAlone) {
  EXPECT_TRUE(Status::Ok().with_field_prefix("body").ok());
  EXPECT_EQ(Status::Ok().with_field_prefix("body").field(), "");
  const Status s(ErrorCode::kOutOfRange, "m", "ids");
  EXPECT_EQ(s.with_field_prefix("").field(), "ids");
}

Status fails_at_second() {
  RD_RETURN_IF_ERROR(Status::Ok());
  RD_RETURN_IF_ERROR(Status(ErrorCode::kNotFound, "second"));
  return Status(ErrorCode::kInternal, "not reached");
}

Result<int> half_of(int v) {
  if (v % 2) return Status(ErrorCode::kInvalidArgument, "odd", "v");
  return v / 2;
}

Status quarter(int v, int* out) {
  RD_ASSIGN_OR_RETURN(const int h, half_of(v));
  RD_ASSIGN_OR_RETURN(*out, half_of(h));
  return Status::Ok();
}

TEST(Status, MacrosReturnTheFirstError) {
  const Status s = fails_at_second();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_EQ(s.message(), "second");
  int q = 0;
  EXPECT_TRUE(quarter(8, &q).ok());
  EXPECT_EQ(q, 2);
  EXPECT_EQ(quarter(6, &q).field(), "v");
}

TEST(Result, HoldsValueOrStatus) {
  Result<std::string> ok = std::string("x");
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok.status().ok());
  EXPECT_EQ(*ok, "x");
  EXPECT_EQ(ok->size(), 1u);
  Result<std::string> bad = Status(ErrorCode::kNotFound, "gone");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kNotFound);
}

constexpr DType kAllDTypes[] = {DType::kF32,  DType::kBF16, DType::kF16, DType::kF8E4M3,
                                DType::kE8M0, DType::kFP4x2, DType::kU8, DType::kI8,
                                DType::kU16,  DType::kI16,  DType::kU32, DType::kI32,
                                DType::kI64,  DType::kBool};

TEST(DTypeName, EveryDTypeRoundTripsThroughItsTorchName) {
  std::set<std::string> seen;
  for (const DType t : kAllDTypes) {
    const std::string_view name = dtype_name(t);
    EXPECT_TRUE(seen.insert(std::string(name)).second) << name;
    EXPECT_EQ(dtype_from_name(name), t) << name;
    EXPECT_EQ(dtype_from_name("torch." + std::string(name)), t) << name;
  }
}

TEST(DTypeName, AcceptsSafetensorsSpellingsAndAliases) {
  EXPECT_EQ(dtype_from_name("F32"), DType::kF32);
  EXPECT_EQ(dtype_from_name("BF16"), DType::kBF16);
  EXPECT_EQ(dtype_from_name("F8_E4M3"), DType::kF8E4M3);
  EXPECT_EQ(dtype_from_name("F8_E8M0"), DType::kE8M0);
  EXPECT_EQ(dtype_from_name("I32"), DType::kI32);
  EXPECT_EQ(dtype_from_name("BOOL"), DType::kBool);
  EXPECT_EQ(dtype_from_name("float"), DType::kF32);
  EXPECT_EQ(dtype_from_name("torch.half"), DType::kF16);
  EXPECT_EQ(dtype_name(DType::kBF16), "bfloat16");
  EXPECT_EQ(dtype_name(DType::kFP4x2), "float4_e2m1fn_x2");
}

TEST(DTypeName, RejectsUnknownNames) {
  EXPECT_FALSE(dtype_from_name("").has_value());
  EXPECT_FALSE(dtype_from_name("float64").has_value());
  EXPECT_FALSE(dtype_from_name("f32").has_value());
  EXPECT_FALSE(dtype_from_name("torch.").has_value());
}

TEST(DTypeSize, MatchesTheFormats) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kE8M0), 1u);
  EXPECT_EQ(dtype_size(DType::kFP4x2), 1u);  // one byte holds a pair
  EXPECT_EQ(dtype_size(DType::kU16), 2u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
}

TEST(DTypeValue, EveryDTypeDecodesAsItsFormatSays) {
  // Codes and values from the formats' definitions (IEEE 754 binary16, OCP FP8 E4M3 and MX E8M0),
  // not from this library's encoders.
  auto v = [](DType t, std::initializer_list<uint8_t> le) {
    const std::vector<uint8_t> b(le);
    return element_value(b.data(), t);
  };
  EXPECT_EQ(v(DType::kF32, {0x00, 0x00, 0xc0, 0x3f}), 1.5);
  EXPECT_EQ(v(DType::kBF16, {0xc0, 0xbf}), -1.5);
  EXPECT_EQ(v(DType::kF16, {0x00, 0x3c}), 1.0);
  EXPECT_EQ(v(DType::kF16, {0x00, 0xc0}), -2.0);
  EXPECT_EQ(v(DType::kF16, {0x01, 0x00}), std::ldexp(1.0, -24));  // smallest subnormal
  EXPECT_EQ(v(DType::kF16, {0xff, 0x7b}), 65504.0);
  EXPECT_TRUE(std::isinf(v(DType::kF16, {0x00, 0x7c})));
  EXPECT_TRUE(std::isnan(v(DType::kF16, {0x01, 0x7c})));
  EXPECT_EQ(v(DType::kF8E4M3, {0x38}), 1.0);
  EXPECT_EQ(v(DType::kF8E4M3, {0x7e}), 448.0);
  EXPECT_EQ(v(DType::kF8E4M3, {0xfe}), -448.0);
  EXPECT_EQ(v(DType::kF8E4M3, {0x01}), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(v(DType::kF8E4M3, {0x7f})));
  EXPECT_EQ(v(DType::kE8M0, {0x7f}), 1.0);
  EXPECT_EQ(v(DType::kE8M0, {0x77}), std::ldexp(1.0, -8));
  EXPECT_EQ(v(DType::kE8M0, {0x00}), std::ldexp(1.0, -127));
  EXPECT_TRUE(std::isnan(v(DType::kE8M0, {0xff})));
  EXPECT_EQ(v(DType::kFP4x2, {0x2c}), 0x2c);  // the stored byte
  EXPECT_EQ(v(DType::kU8, {0xff}), 255);
  EXPECT_EQ(v(DType::kI8, {0xff}), -1);
  EXPECT_EQ(v(DType::kU16, {0xff, 0xff}), 65535);
  EXPECT_EQ(v(DType::kI16, {0x00, 0x80}), -32768);
  EXPECT_EQ(v(DType::kU32, {0xff, 0xff, 0xff, 0xff}), 4294967295.0);
  EXPECT_EQ(v(DType::kI32, {0xfe, 0xff, 0xff, 0xff}), -2);
  EXPECT_EQ(v(DType::kI64, {0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00}), 4294967296.0);
  EXPECT_EQ(v(DType::kBool, {0x01}), 1.0);
  EXPECT_EQ(v(DType::kBool, {0x00}), 0.0);
}

}  // namespace
}  // namespace rolloutd
