#pragma once
// What the control and engine actors say to each other through their mailbox.
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/engine/engine.hpp"
#include "kernels/status.hpp"
#include "protocol/codec.hpp"
#include "protocol/messages.hpp"

#include <zmq.hpp>

namespace rolloutd::daemon {

// control -> engine
struct SubmitCommand {
  core::RequestSpec spec;       // spec.tag = client id
};
struct AbortCommand {
  std::optional<std::string> rid;  // nullopt: all requests
  std::string reason;              // abort_reason on the finished events
  uint64_t client = 0;             // who asked (for the reply)
  uint64_t envelope_id = 0;
};
struct AbortClientCommand {        // a client is gone or over its outbox bound
  uint64_t client = 0;
  std::string reason;
};
struct DrainCommand {              // finish in-flight work for at most deadline_s, then abort the rest
  double deadline_s = 30.0;
};
struct StopCommand {};             // leave the loop (after drain)
// Weight sessions, weight reads and pause/continue: the engine thread owns the parameters,
// so these run there, between steps. `payload` holds the message's payload frames (an
// inline bucket), moved out of the socket's message without a copy.
struct WeightCommand {
  uint64_t client = 0;
  uint64_t envelope_id = 0;
  protocol::Request request;
  std::vector<zmq::message_t> payload;
};
using EngineCommand =
    std::variant<SubmitCommand, AbortCommand, AbortClientCommand, DrainCommand, StopCommand, WeightCommand>;

// engine -> control
struct SubmitResult {
  std::string rid;
  uint64_t client = 0;
  Status status;                   // ok: accepted, events follow
};
struct AbortResult {
  uint64_t client = 0;
  uint64_t envelope_id = 0;
  uint32_t num_aborted = 0;
  Status status;
};
struct EventBatch {
  std::vector<core::EngineEvent> events;
};
struct DrainDone {};
struct EngineFault {               // the engine cannot continue; the process must exit non-zero
  Status status;
};
struct EncodedReply {              // a reply the engine encoded itself (weight commands)
  uint64_t client = 0;
  protocol::WireMessage message;
  std::string error_code;          // non-empty for an error reply (counted by control)
};
using EngineOutput = std::variant<SubmitResult, AbortResult, EventBatch, DrainDone, EngineFault, EncodedReply>;

// Mail carries exactly one of the variants.
struct EngineCommandMail {
  EngineCommand cmd;
};
struct EngineOutputMail {
  EngineOutput out;
};

}  // namespace rolloutd::daemon
