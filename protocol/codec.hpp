#pragma once
// msgpack codecs for the v1 messages (protocol/SPEC.md). Decoders validate every
// field (type, range, length, total size) before allocating and return a typed
// Status naming the offending field ("body.input_ids[3]"); encoders write map
// keys in the order SPEC.md lists them, so encode(decode(golden)) == golden.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kernels/status.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::protocol {

using Frame = std::span<const uint8_t>;

// One message as it travels: the envelope frame, then payload frames.
struct WireMessage {
  std::string envelope;
  std::vector<std::string> frames;
};

// ---- daemon side ----
struct RequestDecodeResult {
  Envelope env;                   // env.id is filled whenever it could be read (for the error reply)
  std::optional<Request> request; // set iff status.ok()
  Status status;
};
RequestDecodeResult decode_request(Frame envelope, std::span<const Frame> frames,
                                   const Limits& limits);

// Reply envelope types are "<request type>.ok" ("hello.ok", ...); errors are "error".
WireMessage encode_reply(uint64_t id, const HelloReply& r);
WireMessage encode_reply(uint64_t id, const StatusReply& r);
WireMessage encode_reply(uint64_t id, const GenerateReply& r);
WireMessage encode_reply(uint64_t id, const AbortReply& r);
WireMessage encode_reply(uint64_t id, const ShutdownReply& r);
WireMessage encode_error(uint64_t id, const ErrorInfo& e);
// Events echo the id of the generate request that created them.
WireMessage encode_event(uint64_t id, const Event& e);

// ---- client side ----
WireMessage encode_request(uint64_t id, const Request& r);

using Incoming = std::variant<HelloReply, StatusReply, GenerateReply, AbortReply, ShutdownReply,
                              ErrorInfo, TokensEvent, FinishedEvent, FailedEvent>;
struct DecodedIncoming {
  Envelope env;
  Incoming msg;
};
Result<DecodedIncoming> decode_incoming(Frame envelope, std::span<const Frame> frames,
                                        const Limits& limits);

// The wire name of a request ("hello", "generate", ...).
std::string_view request_type_name(const Request& r);
// Number of bytes per element of a routed-experts dtype name; 0 if unknown.
size_t routed_experts_dtype_size(std::string_view dtype);

}  // namespace rolloutd::protocol
