// Fuzz target: the daemon-side decoder, protocol::decode_request, over an envelope and its
// payload frames (every request type; update_weights with inline buckets reads frames).
//
// Oracles beyond the sanitizers:
//  - a refused message has a non-ok status and no request; an accepted one has a request
//    whose type name is the envelope's type;
//  - re-encoding an accepted request and decoding it again succeeds, and a second
//    re-encoding is byte-identical to the first (encode . decode is a fixed point on the
//    canonical form, SPEC §3), so the encoder never writes what the decoder refuses.
// Every input is decoded twice: with the default limits (SPEC §9) and with tight limits,
// so the refusal paths of every bound are reachable with small inputs.
#include <cstdint>

#include "protocol/codec.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace rolloutd;
using namespace rolloutd::protocol;

namespace {

Limits tight_limits() {
  Limits l;
  l.max_envelope_bytes = 1024;
  l.max_frame_bytes = 256;
  l.max_frames = 2;
  l.max_rid_bytes = 8;
  l.max_string_bytes = 32;
  l.max_input_tokens = 8;
  l.max_new_tokens = 16;
  l.max_stop_token_ids = 2;
  l.max_versions = 2;
  l.max_bucket_entries = 3;
  return l;
}

// Returns whether the message was accepted.
bool check_one(std::span<const uint8_t> envelope, std::span<const Frame> frames, const Limits& limits) {
  RequestDecodeResult r = decode_request(envelope, frames, limits);
  if (!r.status.ok()) {
    FUZZ_CHECK(!r.request.has_value(), "refused with %s but a request was returned",
               r.status.to_string().c_str());
    FUZZ_CHECK(!error_code_name(r.status.code()).empty(), "error code without a wire name");
    return false;
  }
  FUZZ_CHECK(r.request.has_value(), "ok status without a request");
  FUZZ_CHECK(request_type_name(*r.request) == r.env.type, "decoded '%s' as '%s'", r.env.type.c_str(),
             std::string(request_type_name(*r.request)).c_str());

  // Round trip. The canonical form may be longer than the input (defaults are written,
  // floats widen to float64), so the second decode gets room for that; every other limit
  // holds for values the first decode accepted.
  const WireMessage once = encode_request(r.env.id, *r.request);
  Limits relaxed = limits;
  relaxed.max_envelope_bytes = limits.max_envelope_bytes + 4096;
  const auto* bytes = reinterpret_cast<const uint8_t*>(once.envelope.data());
  RequestDecodeResult again = decode_request({bytes, once.envelope.size()}, frames, relaxed);
  FUZZ_CHECK(again.status.ok(), "re-encoded '%s' is refused: %s", r.env.type.c_str(),
             again.status.to_string().c_str());
  FUZZ_CHECK(again.env.id == r.env.id, "id changed in the round trip");
  const WireMessage twice = encode_request(again.env.id, *again.request);
  FUZZ_CHECK(twice.envelope == once.envelope, "'%s': encode(decode(encode(x))) != encode(x)",
             r.env.type.c_str());
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::SplitMessage m = fuzz::split_frames(data, size);
  static const Limits kDefault{};
  static const Limits kTight = tight_limits();
  static fuzz::Tally tally("request");
  tally.count(check_one(m.envelope, m.frames, kDefault));
  check_one(m.envelope, m.frames, kTight);
  return 0;
}
