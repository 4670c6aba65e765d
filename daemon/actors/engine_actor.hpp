#pragma once
// The engine actor: owns the core::Engine (model, KV cache, scheduler, sampler)
// and the compute device. It takes commands from its mailbox between steps,
// steps while there is work, and sends events back in one batch per step. It
// never touches a socket other than its mailbox and never waits on another actor.
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <memory>

#include "core/engine/engine.hpp"
#include "daemon/actors/mail.hpp"
#include "daemon/actors/mailbox.hpp"
#include "daemon/config.hpp"
#include "daemon/obs/metrics.hpp"
#include "daemon/state.hpp"
#include "daemon/weights/cuda_ipc.hpp"
#include "daemon/weights/nccl_group.hpp"

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
  // Device transports (engine_weights.cpp): joins and NCCL buckets complete asynchronously;
  // weight commands that arrive meanwhile wait in order behind them.
  // A weights_checksum in progress counts too: weight commands after it wait for its reply, so
  // the sums it reports are of one set of weights.
  bool has_pending_device_work() const {
    return pending_join_.has_value() || !pending_buckets_.empty() || !pending_ipc_.empty() ||
           pending_checksum_.has_value();
  }
  // An NCCL bucket that may start while the previous bucket of its group is still being
  // received (double-buffered staging): nothing else waits before it.
  bool can_pipeline(const WeightCommand& cmd) const;
  // Fails every bucket in flight (the group is gone): the session fails closed.
  void fail_pending_buckets(const Status& why);
  void poll_device_work();
  // weights_checksum: validated and started at once, then read back and CRC'd a slice
  // (config_.checksum_slice_ms, at least one parameter) per loop turn, replied when done.
  void start_checksum(uint64_t client, uint64_t envelope_id, const protocol::WeightsChecksumRequest& r);
  void advance_checksum();
  void start_nccl_bucket(WeightCommand& cmd);
  // CUDA IPC buckets whose copies are queued: replied in order as their fences complete.
  void poll_pending_ipc();
  // Waits for every queued IPC copy and answers its bucket: ok, or `why` when given.
  void settle_pending_ipc(const Status* why);
  // A device fault under CUDA IPC copies: answer every bucket in flight (and, when client or
  // envelope_id is non-zero, that request) with `why`, fail the session, report the fault.
  void fail_pending_ipc(const Status& why, uint64_t client, uint64_t envelope_id);
  // A kCudaError poisons the context: refuse generation, end requests in flight, tell the
  // control actor (EngineFault) so the daemon exits for a restart. Other codes: nothing.
  void on_device_fault(const Status& why);
  static constexpr size_t kMaxIpcInFlight = 16;                     // buckets queued per session
  static constexpr std::chrono::seconds kIpcCopyTimeout{60};        // per bucket's copies
  void finish_session_resources();
  // Memory release/resume (engine_memory.cpp): only while idle; the reply comes after the
  // memory is unmapped (or mapped and its static state written back).
  void handle_memory(WeightCommand& cmd);
  // Frees the NCCL receive buffers (they hold nothing between buckets); returns their bytes.
  size_t free_nccl_staging();
  // Recomputes what publish() cannot afford every loop: static-state digests (a device read).
  void refresh_memory_digests();
  void fill_memory_snapshot(EngineSnapshot& s);
  // Applies a bucket already in host or device memory and replies; `received` (the command's
  // receipt) starts the reply's duration_s and the session's idle deadline.
  void apply_and_reply(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                       std::span<const uint8_t> bucket, bool on_device, std::chrono::steady_clock::time_point received);
  // The same with the request's entries already taken from it (take_entries).
  void apply_and_reply(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                       std::vector<core::BucketEntry> entries, std::span<const uint8_t> bucket, bool on_device,
                       std::chrono::steady_clock::time_point received);
  // A CUDA IPC bucket: validated and its copies queued now, answered by poll_pending_ipc().
  void apply_ipc_bucket(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                        std::span<const uint8_t> bucket, std::chrono::steady_clock::time_point received);

  std::unique_ptr<core::Engine> engine_;
  std::unique_ptr<MailboxEnd> mailbox_;
  obs::Metrics& metrics_;
  SnapshotCell<EngineSnapshot>& snapshot_;
  Heartbeat& heartbeat_;
  const DaemonConfig& config_;
  std::vector<uint8_t> shm_staging_;  // reused across shm buckets
  std::map<std::string, std::unique_ptr<NcclGroup>> groups_;
  struct PendingJoin {
    uint64_t client = 0, envelope_id = 0;
    std::string group;
    uint32_t rank = 0, world_size = 0;
    std::chrono::steady_clock::time_point started;
  };
  struct PendingBucket {
    uint64_t client = 0, envelope_id = 0;
    protocol::UpdateWeightsRequest request;
    int slot = 0;  // which staging buffer receives it
    std::chrono::steady_clock::time_point received{};  // when the engine took the command
  };
  std::optional<PendingJoin> pending_join_;
  std::deque<PendingBucket> pending_buckets_;  // oldest first, all of one group, at most 2
  std::deque<WeightCommand> deferred_;
  struct PendingChecksum {
    uint64_t client = 0, envelope_id = 0;
    std::vector<size_t> which;  // registry indices, in request order
    size_t next = 0;            // which[next] is read next
    uint64_t bytes = 0;
    protocol::WeightsChecksumReply out;
    std::vector<std::pair<std::string, uint32_t>> sums;
    std::chrono::steady_clock::time_point started;
    uint32_t turns = 0;
    uint64_t steps_before = 0;  // steps_ when it started: the log says how many ran meanwhile
  };
  std::optional<PendingChecksum> pending_checksum_;
  std::vector<uint8_t> checksum_bytes_;  // one parameter's checkpoint bytes, reused
  struct PendingIpc {
    uint64_t client = 0, envelope_id = 0, session = 0;
    core::BucketResult result;
    DeviceFence copied;  // after the bucket's copies on the model's stream
    std::chrono::steady_clock::time_point received;
  };
  void reply_ipc_ok(const PendingIpc& b);
  // Oldest first. The producer's memory is read until a bucket's fence completes; its reply
  // (the producer's licence to reuse that memory) is sent only then.
  std::deque<PendingIpc> pending_ipc_;
  struct Staging {
    void* ptr = nullptr;  // NCCL receive buffer (device), grown on demand, kept across sessions
    uint64_t bytes = 0;
  };
  Staging staging_[NcclGroup::kMaxInFlight];
  std::unique_ptr<CudaIpcImporter> ipc_;
  bool stop_ = false;
  bool draining_ = false;
  bool drain_done_sent_ = false;
  bool faulted_ = false;
  std::string fault_reason_;
  std::chrono::steady_clock::time_point drain_deadline_;
  uint32_t static_state_crc_[4] = {0, 0, 0, 0};  // by core::MemoryTag
  uint64_t parameters_address_digest_ = 0;
  uint64_t steps_ = 0;
  uint64_t prompt_tokens_seen_ = 0;
  uint64_t preemptions_seen_ = 0;
  uint64_t prefix_queried_seen_ = 0, prefix_hit_seen_ = 0;
  uint64_t recomputed_seen_ = 0;
  uint64_t graph_steps_seen_ = 0, eager_steps_seen_ = 0;
};

}  // namespace rolloutd::daemon
