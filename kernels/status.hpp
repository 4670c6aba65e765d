#pragma once
// Status and Result<T>: how kernels/ and core/ report failure. Library code
// returns; only daemon/ decides whether a status is fatal for the process.
//
// One code space for every layer, each code with a stable wire name: the daemon
// puts the name into the protocol's error object and into the
// `rolloutd_errors_total{code=...}` metric, so a name is never reused or renamed.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rolloutd {

enum class ErrorCode : uint8_t {
  kOk = 0,
  // Input that can never be valid.
  kBadMessage,          // envelope is not decodable msgpack / not a map / trailing bytes
  kUnsupportedVersion,  // protocol version not spoken by this daemon
  kUnknownType,         // message type not known
  kMissingField,        // required field absent
  kWrongType,           // field present with the wrong msgpack type
  kOutOfRange,          // value outside its allowed range (token id, size, count)
  kTooLarge,            // message, frame or collection exceeds a configured limit
  kInvalidArgument,     // other semantic error in an argument
  // Input that conflicts with current state.
  kDuplicateRid,        // request id already in flight
  kUnknownRid,          // request id not in flight
  kNotReady,            // daemon cannot serve (no weights, failed session)
  kDraining,            // daemon is shutting down and accepts no new work
  kOverloaded,          // queue or buffer bound reached
  kFailedPrecondition,  // operation not allowed in the current state
  kNotFound,            // named thing does not exist
  // Environment and runtime.
  kResourceExhausted,   // memory / KV blocks / handles exhausted
  kDeadlineExceeded,    // a bounded wait expired
  kAborted,             // cancelled by request or shutdown
  kUnavailable,         // peer gone, socket closed
  kUnimplemented,       // valid request for a feature not built in
  kCudaError,           // CUDA runtime/driver reported an error
  kInternal,            // invariant violated (a bug)
  // Reported by clients, never sent by a daemon: the security handshake (CURVE) failed, so
  // no message could be exchanged (SPEC §1.2).
  kUnauthenticated,
};

// Stable wire name, e.g. "out_of_range".
std::string_view error_code_name(ErrorCode code);
// Inverse of error_code_name; nullopt for an unknown name.
std::optional<ErrorCode> error_code_from_name(std::string_view name);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(ErrorCode code, std::string message, std::string field = {})
      : code_(code), message_(std::move(message)), field_(std::move(field)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The offending input, as a path ("body.input_ids[3]", "model.layers.0.mlp.gate.weight").
  const std::string& field() const { return field_; }

  // Returns a copy whose field path is `prefix` + "." + field (or prefix alone).
  Status with_field_prefix(std::string_view prefix) const;
  // "out_of_range: message (field=...)"
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
  std::string field_;
};

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return v_.index() == 0; }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<1>(v_);
  }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace rolloutd

#define RD_STATUS_CONCAT_INNER(a, b) a##b
#define RD_STATUS_CONCAT(a, b) RD_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (a Status); returns it from the enclosing function if not ok.
#define RD_RETURN_IF_ERROR(expr)                         \
  do {                                                   \
    ::rolloutd::Status rd_status_tmp_ = (expr);          \
    if (!rd_status_tmp_.ok()) return rd_status_tmp_;     \
  } while (0)

// `lhs = value of expr` (a Result<T>) or return its status.
#define RD_ASSIGN_OR_RETURN(lhs, expr) \
  RD_ASSIGN_OR_RETURN_IMPL(RD_STATUS_CONCAT(rd_result_, __LINE__), lhs, expr)
#define RD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
