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
WireMessage encode_reply(uint64_t id, const BeginWeightUpdateReply& r);
WireMessage encode_reply(uint64_t id, const UpdateWeightsReply& r);
WireMessage encode_reply(uint64_t id, const EndWeightUpdateReply& r);
WireMessage encode_reply(uint64_t id, const AbortWeightUpdateReply& r);
WireMessage encode_reply(uint64_t id, const GetWeightsByNameReply& r);
WireMessage encode_reply(uint64_t id, const WeightsChecksumReply& r);
WireMessage encode_reply(uint64_t id, const PauseGenerationReply& r);
WireMessage encode_reply(uint64_t id, const ContinueGenerationReply& r);
WireMessage encode_reply(uint64_t id, const InitWeightGroupReply& r);
WireMessage encode_reply(uint64_t id, const DestroyWeightGroupReply& r);
WireMessage encode_reply(uint64_t id, const ReleaseMemoryReply& r);
WireMessage encode_reply(uint64_t id, const ResumeMemoryReply& r);
WireMessage encode_error(uint64_t id, const ErrorInfo& e);
// Events echo the id of the generate request that created them.
WireMessage encode_event(uint64_t id, const Event& e);

// The bucket bytes of an update_weights request with an inline source: the payload
// frame it names, from the frames the request was decoded with (decode_request
// checked that it exists and holds every entry). Empty for other sources.
Frame inline_bucket(const UpdateWeightsRequest& r, std::span<const Frame> frames);

// ---- client side ----
// Payload frames are the caller's: an update_weights with an inline source gets an
// envelope only, and the caller sends the bucket as payload frame source.frame.
WireMessage encode_request(uint64_t id, const Request& r);

using Incoming = std::variant<HelloReply, StatusReply, GenerateReply, AbortReply, ShutdownReply,
                              ErrorInfo, TokensEvent, FinishedEvent, FailedEvent,
                              BeginWeightUpdateReply, UpdateWeightsReply, EndWeightUpdateReply,
                              AbortWeightUpdateReply, GetWeightsByNameReply, WeightsChecksumReply,
                              PauseGenerationReply, ContinueGenerationReply, RetractedEvent,
                              InitWeightGroupReply, DestroyWeightGroupReply, ReleaseMemoryReply,
                              ResumeMemoryReply>;
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
// ^[A-Za-z0-9._-]{1,64}$: an NCCL weight group's name (SPEC §11.7).
bool is_valid_weight_group_name(std::string_view name);
// "2.28.9" for NCCL_VERSION_CODE 22809 (and the pre-2.9 encoding, 2708 -> "2.7.8"); for messages.
std::string nccl_version_string(uint32_t code);

// ---- checksums (SPEC §11.5) ----
// zlib's CRC-32 (Python's zlib.crc32): crc32(b, crc32(a)) == crc32(a + b).
uint32_t crc32(std::span<const uint8_t> bytes, uint32_t crc = 0);
// CRC-32 of the concatenation, over the parameters sorted by name (byte-wise), of
// name + '\0' + the parameter's checksum as 4 little-endian bytes. Names must be unique.
uint32_t model_checksum(std::vector<std::pair<std::string, uint32_t>> checksums);

}  // namespace rolloutd::protocol
