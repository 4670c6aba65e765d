#pragma once
// The engine actor: owns the core::Engine (model, KV cache, scheduler, sampler)
// and the compute device. It takes commands from its mailbox between steps,
// steps while there is work, and sends events back in one batch per step. It
// never touches a socket other than its mailbox and never waits on another actor.
#include <chrono>
#include <memory>

#include "core/engine/engine.hpp"
#include "daemon/actors/mail.hpp"
#include "daemon/actors/mailbox.hpp"
#include "daemon/config.hpp"
#include "daemon/obs/metrics.hpp"
#include "daemon/state.hpp"

namespace rolloutd::daemon {

class EngineActor {
 public:
  EngineActor(std::unique_ptr<core::Engine> engine, std::unique_ptr<MailboxEnd> mailbox,
              obs::Metrics& metrics, SnapshotCell<EngineSnapshot>& snapshot, Heartbeat& heartbeat,
              const DaemonConfig& config);
  // Thread body; returns after a StopCommand.
  void run();

 private:
  void handle(EngineCommand& cmd);
  void send(EngineOutput out);
  void publish();
  void account(const std::vector<core::EngineEvent>& events);
  // Weight sessions, weight reads, pause/continue (engine_weights.cpp).
  void handle_weights(WeightCommand& cmd);
  void reply(uint64_t client, protocol::WireMessage msg);
  void reply_error(uint64_t client, uint64_t envelope_id, const Status& s);
  // The model stopped being whole (failed session): end what was in flight, say why.
  void on_model_broken(const Status& why);
  void check_session_deadline();

  std::unique_ptr<core::Engine> engine_;
  std::unique_ptr<MailboxEnd> mailbox_;
  obs::Metrics& metrics_;
  SnapshotCell<EngineSnapshot>& snapshot_;
  Heartbeat& heartbeat_;
  const DaemonConfig& config_;
  std::vector<uint8_t> shm_staging_;  // reused across shm buckets
  bool stop_ = false;
  bool draining_ = false;
  bool drain_done_sent_ = false;
  bool faulted_ = false;
  std::string fault_reason_;
  std::chrono::steady_clock::time_point drain_deadline_;
  uint64_t steps_ = 0;
  uint64_t prompt_tokens_seen_ = 0;
};

}  // namespace rolloutd::daemon
