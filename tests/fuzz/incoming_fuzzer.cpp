// Fuzz target: the client-side decoder, protocol::decode_incoming (replies, errors and the
// tokens / finished / failed / retracted events, routed-expert rows in payload frames).
// A client must survive whatever a daemon, or anything listening on its port, sends.
//
// Oracles beyond the sanitizers: an accepted message re-encodes (encode_reply,
// encode_error, encode_event) to bytes that decode again, and a second re-encoding is
// identical to the first, frames included. Decoded with the default and with tight limits.
#include <cstdint>
#include <type_traits>

#include "protocol/codec.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace rolloutd;
using namespace rolloutd::protocol;

namespace {

Limits tight_limits() {
  Limits l;
  l.max_envelope_bytes = 2048;
  l.max_frame_bytes = 256;
  l.max_frames = 2;
  l.max_rid_bytes = 8;
  l.max_string_bytes = 32;
  l.max_new_tokens = 8;
  l.max_bucket_entries = 3;
  return l;
}

template <class T>
constexpr bool kIsEvent = std::is_same_v<T, TokensEvent> || std::is_same_v<T, FinishedEvent> ||
                          std::is_same_v<T, FailedEvent> || std::is_same_v<T, RetractedEvent>;

WireMessage reencode(uint64_t id, const Incoming& msg) {
  return std::visit(
      [&](const auto& m) -> WireMessage {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ErrorInfo>) {
          return encode_error(id, m);
        } else if constexpr (kIsEvent<T>) {
          return encode_event(id, Event(m));
        } else {
          return encode_reply(id, m);
        }
      },
      msg);
}

std::vector<Frame> frames_of(const WireMessage& w) {
  std::vector<Frame> out;
  for (const auto& f : w.frames) out.emplace_back(reinterpret_cast<const uint8_t*>(f.data()), f.size());
  return out;
}

// Returns whether the message was accepted.
bool check_one(std::span<const uint8_t> envelope, std::span<const Frame> frames, const Limits& limits) {
  Result<DecodedIncoming> r = decode_incoming(envelope, frames, limits);
  if (!r.ok()) {
    FUZZ_CHECK(!error_code_name(r.status().code()).empty(), "error code without a wire name");
    return false;
  }
  const WireMessage once = reencode(r->env.id, r->msg);
  Limits relaxed = limits;
  relaxed.max_envelope_bytes = limits.max_envelope_bytes + 4096;
  const std::vector<Frame> once_frames = frames_of(once);
  Result<DecodedIncoming> again = decode_incoming(
      {reinterpret_cast<const uint8_t*>(once.envelope.data()), once.envelope.size()}, once_frames, relaxed);
  FUZZ_CHECK(again.ok(), "re-encoded '%s' is refused: %s", r->env.type.c_str(),
             again.status().to_string().c_str());
  FUZZ_CHECK(again->env.id == r->env.id && again->env.type == r->env.type, "envelope changed in the round trip");
  FUZZ_CHECK(again->msg.index() == r->msg.index(), "message kind changed in the round trip");
  const WireMessage twice = reencode(again->env.id, again->msg);
  FUZZ_CHECK(twice.envelope == once.envelope && twice.frames == once.frames,
             "'%s': encode(decode(encode(x))) != encode(x)", r->env.type.c_str());
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::SplitMessage m = fuzz::split_frames(data, size);
  static const Limits kDefault{};
  static const Limits kTight = tight_limits();
  static fuzz::Tally tally("incoming");
  tally.count(check_one(m.envelope, m.frames, kDefault));
  check_one(m.envelope, m.frames, kTight);
  return 0;
}
