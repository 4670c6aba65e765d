#include "kernels/status.hpp"

#include <array>

namespace rolloutd {
namespace {
struct CodeName {
  ErrorCode code;
  std::string_view name;
};
constexpr std::array<CodeName, 24> kNames{{
    {ErrorCode::kOk, "ok"},
    {ErrorCode::kBadMessage, "bad_message"},
    {ErrorCode::kUnsupportedVersion, "unsupported_version"},
    {ErrorCode::kUnknownType, "unknown_type"},
    {ErrorCode::kMissingField, "missing_field"},
    {ErrorCode::kWrongType, "wrong_type"},
    {ErrorCode::kOutOfRange, "out_of_range"},
    {ErrorCode::kTooLarge, "too_large"},
    {ErrorCode::kInvalidArgument, "invalid_argument"},
    {ErrorCode::kDuplicateRid, "duplicate_rid"},
    {ErrorCode::kUnknownRid, "unknown_rid"},
    {ErrorCode::kNotReady, "not_ready"},
    {ErrorCode::kDraining, "draining"},
    {ErrorCode::kOverloaded, "overloaded"},
    {ErrorCode::kFailedPrecondition, "failed_precondition"},
    {ErrorCode::kNotFound, "not_found"},
    {ErrorCode::kResourceExhausted, "resource_exhausted"},
    {ErrorCode::kDeadlineExceeded, "deadline_exceeded"},
    {ErrorCode::kAborted, "aborted"},
    {ErrorCode::kUnavailable, "unavailable"},
    {ErrorCode::kUnimplemented, "unimplemented"},
    {ErrorCode::kCudaError, "cuda_error"},
    {ErrorCode::kInternal, "internal"},
    {ErrorCode::kUnauthenticated, "unauthenticated"},
}};
}  // namespace

std::string_view error_code_name(ErrorCode code) {
  for (const auto& e : kNames)
    if (e.code == code) return e.name;
  return "internal";
}

std::optional<ErrorCode> error_code_from_name(std::string_view name) {
  for (const auto& e : kNames)
    if (e.name == name) return e.code;
  return std::nullopt;
}

Status Status::with_field_prefix(std::string_view prefix) const {
  if (ok() || prefix.empty()) return *this;
  std::string f(prefix);
  if (!field_.empty()) {
    if (field_.front() != '[') f += '.';
    f += field_;
  }
  return Status(code_, message_, std::move(f));
}

std::string Status::to_string() const {
  std::string s(error_code_name(code_));
  if (!message_.empty()) s += ": " + message_;
  if (!field_.empty()) s += " (field=" + field_ + ")";
  return s;
}

}  // namespace rolloutd
