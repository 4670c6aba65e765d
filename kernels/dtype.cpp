#include "kernels/dtype.hpp"

#include <array>
#include <cmath>
#include <cstring>

#include "kernels/bf16.hpp"
#include "kernels/quant/minifloat.hpp"

namespace rolloutd {
namespace {
struct Info {
  DType t;
  size_t size;
  std::string_view name;       // PyTorch spelling
  std::string_view st_name;    // safetensors spelling
};
constexpr std::array<Info, 14> kInfo{{
    {DType::kF32, 4, "float32", "F32"},
    {DType::kBF16, 2, "bfloat16", "BF16"},
    {DType::kF16, 2, "float16", "F16"},
    {DType::kF8E4M3, 1, "float8_e4m3fn", "F8_E4M3"},
    {DType::kE8M0, 1, "float8_e8m0fnu", "F8_E8M0"},
    {DType::kFP4x2, 1, "float4_e2m1fn_x2", "F4"},
    {DType::kU8, 1, "uint8", "U8"},
    {DType::kI8, 1, "int8", "I8"},
    {DType::kU16, 2, "uint16", "U16"},
    {DType::kI16, 2, "int16", "I16"},
    {DType::kU32, 4, "uint32", "U32"},
    {DType::kI32, 4, "int32", "I32"},
    {DType::kI64, 8, "int64", "I64"},
    {DType::kBool, 1, "bool", "BOOL"},
}};
}  // namespace

size_t dtype_size(DType t) { return kInfo[static_cast<size_t>(t)].size; }
std::string_view dtype_name(DType t) { return kInfo[static_cast<size_t>(t)].name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  if (name.substr(0, 6) == "torch.") name.remove_prefix(6);
  for (const auto& i : kInfo)
    if (i.name == name || i.st_name == name) return i.t;
  if (name == "float") return DType::kF32;
  if (name == "half") return DType::kF16;
  return std::nullopt;
}

namespace {
template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
}  // namespace

double element_value(const uint8_t* p, DType t) {
  switch (t) {
    case DType::kF32: return load<float>(p);
    case DType::kBF16: return bf16_bits_to_f32(load<uint16_t>(p));
    case DType::kF16: {  // IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits
      const uint16_t h = load<uint16_t>(p);
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0 ? std::ldexp(m, -24)
                         : e == 31 ? (m ? std::nan("") : HUGE_VAL)
                                   : std::ldexp(1024 + m, e - 25);
      return (h & 0x8000) ? -mag : mag;
    }
    case DType::kF8E4M3: return quant::f32_from_bits(quant::e4m3_decode_bits(quant::E4M3{*p}, 0));
    case DType::kE8M0: return quant::f32_from_bits(quant::e8m0_decode_bits(quant::E8M0{*p}));
    case DType::kFP4x2:
    case DType::kU8: return *p;
    case DType::kI8: return load<int8_t>(p);
    case DType::kU16: return load<uint16_t>(p);
    case DType::kI16: return load<int16_t>(p);
    case DType::kU32: return load<uint32_t>(p);
    case DType::kI32: return load<int32_t>(p);
    case DType::kI64: return static_cast<double>(load<int64_t>(p));
    case DType::kBool: return *p != 0 ? 1.0 : 0.0;
  }
  return std::nan("");
}

}  // namespace rolloutd
