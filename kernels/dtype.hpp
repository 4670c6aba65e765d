#pragma once
// Element types, their sizes and their wire names. The wire names are PyTorch's
// (`torch.bfloat16` -> "bfloat16"), which is what trainers print and send; the
// safetensors spellings ("BF16", "F32", ...) are accepted on input as well.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace rolloutd {

enum class DType : uint8_t {
  kF32 = 0,
  kBF16,
  kF16,
  kF8E4M3,   // float8_e4m3fn
  kE8M0,     // float8_e8m0fnu: a power-of-two scale, 2^(s-127), 0xFF = NaN
  kFP4x2,    // float4_e2m1fn_x2: two E2M1 values per byte, element 2j in the low nibble
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kI64,
  kBool,
};

// Bytes per element (kFP4x2: per pair of elements, i.e. 1).
size_t dtype_size(DType t);
// "float32", "bfloat16", ...
std::string_view dtype_name(DType t);
// Accepts the PyTorch names (with or without a "torch." prefix) and the safetensors names.
std::optional<DType> dtype_from_name(std::string_view name);
// The element at `p` (little-endian) as a double, as get_weights_by_name reports it (SPEC 8):
// floating dtypes exactly (E8M0 s as 2^(s-127), NaN for 0xFF; E4M3's NaN codes as NaN),
// integers and bool as their value (int64 beyond 2^53 rounded), kFP4x2 as the stored byte.
double element_value(const uint8_t* p, DType t);

}  // namespace rolloutd
