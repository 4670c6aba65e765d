#include "kernels/dtype.hpp"

#include <array>

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

}  // namespace rolloutd
