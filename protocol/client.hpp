#pragma once
// The C++ client of one daemon: a ZeroMQ DEALER on the daemon's control socket.
// Replies and events share the connection; events that arrive while a call
// waits for its reply are queued and handed out by next_event(). Every call has
// a deadline. The pybind11 module (protocol/python/native.cpp) exposes the raw
// transport to the Python package, which speaks msgpack itself.
//
// Not thread-safe: one thread per Client (as ZeroMQ sockets require).
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/status.hpp"
#include "protocol/codec.hpp"
#include "protocol/curve.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::protocol {

// A fresh request id: 128 random bits as 32 hex digits, like the Python client's uuid4().hex.
std::string random_rid();

struct ClientOptions {
  std::string endpoint;             // "tcp://127.0.0.1:7600"
  int request_timeout_ms = 30000;   // deadline for each reply
  int send_hwm = 1000;
  int recv_hwm = 100000;
  Limits limits;                    // applied to what the daemon sends
  // CURVE (SPEC §1.2): the daemon's public key and this client's key pair, for a daemon
  // started with keys. Empty: a plain connection, which such a daemon refuses. A refused
  // handshake fails calls with kUnauthenticated instead of waiting for their deadline.
  CurveClientKeys curve;
};

// Everything one generate produced, collected by Client::generate().
struct GenerateResult {
  std::string rid;
  std::vector<int32_t> token_ids;
  std::vector<double> logprobs;
  std::vector<uint64_t> weight_versions;
  // With top_logprobs_num n > 0: token j's n most likely tokens at [j*n, (j+1)*n) (TokensEvent).
  uint32_t top_logprobs_num = 0;
  std::vector<int32_t> top_token_ids;
  std::vector<double> top_logprobs;
  // Concatenated routed-expert rows [num_tokens, num_layers, top_k] (raw little-endian).
  std::optional<RoutedExperts> routed_experts;
  std::optional<FinishedEvent> finished;  // exactly one of finished / failed
  std::optional<FailedEvent> failed;
  // Times the daemon retracted the request (pause_generation{retract}); each one
  // discarded what had been collected, so the fields above hold the last attempt only.
  uint32_t num_retractions = 0;
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // ---- typed calls (each waits for its reply, bounded by request_timeout_ms) ----
  Result<HelloReply> hello(const std::string& client_name = "rolloutd-cpp");
  Result<StatusReply> status();
  // Accepted; events follow. An empty req.rid is replaced by a random one (the reply carries it).
  Result<GenerateReply> submit(const GenerateRequest& req);
  Result<AbortReply> abort(const std::string& rid);
  Result<AbortReply> abort_all();
  Result<ShutdownReply> shutdown(bool drain = true, double deadline_s = 30.0);

  // ---- weight updates (SPEC §11) ----
  // selector: parameter-name prefixes the session may touch (nullopt: all).
  Result<BeginWeightUpdateReply> begin_weight_update(
      std::optional<std::vector<std::string>> selector = std::nullopt, double timeout_s = 60.0);
  // One bucket whose bytes travel as payload frame 0 of the message. `checksum`:
  // crc32(payload), checked by the daemon before it applies anything.
  Result<UpdateWeightsReply> update_weights_inline(uint64_t session,
                                                   std::vector<BucketEntry> entries,
                                                   std::string_view payload,
                                                   std::optional<uint32_t> checksum = std::nullopt);
  // One bucket in [offset, offset + size) of POSIX shared memory `shm_name` ("/...").
  // The daemon has copied it and unmapped the region once the reply arrives.
  Result<UpdateWeightsReply> update_weights_shm(uint64_t session, std::vector<BucketEntry> entries,
                                                const std::string& shm_name, uint64_t offset,
                                                uint64_t size,
                                                std::optional<uint32_t> checksum = std::nullopt);
  Result<EndWeightUpdateReply> end_weight_update(uint64_t session, uint64_t weight_version);
  Result<AbortWeightUpdateReply> abort_weight_update(uint64_t session);
  Result<GetWeightsByNameReply> get_weights_by_name(const std::string& name, uint32_t truncate = 100);
  Result<WeightsChecksumReply> weights_checksum(
      std::optional<std::vector<std::string>> names = std::nullopt);
  Result<PauseGenerationReply> pause_generation(PauseMode mode);
  Result<ContinueGenerationReply> continue_generation();

  // ---- memory release and resume (SPEC §12) ----
  // Tags from kMemoryTags ("weights", "kv_cache", "cuda_graph"); nullopt = every tag. The
  // daemon must be idle (no request in flight, no weight session open): failed_precondition
  // otherwise. After releasing weights, resume and push weights before generating.
  Result<ReleaseMemoryReply> release_memory(std::optional<std::vector<std::string>> tags = std::nullopt);
  Result<ResumeMemoryReply> resume_memory(std::optional<std::vector<std::string>> tags = std::nullopt);

  // ---- GPU weight transports (SPEC §11.7) ----
  // Joins the daemon to the NCCL group `group` as `rank` of `world_size`; the trainer
  // (`root`) created `unique_id` (128 bytes) and joins at the same time. The daemon
  // replies once joined, so this waits up to max(request_timeout_ms, timeout_s + 5 s).
  Result<InitWeightGroupReply> init_weight_group(const std::string& group,
                                                 const std::string& unique_id,
                                                 uint32_t world_size, uint32_t rank,
                                                 uint32_t root, uint32_t nccl_version,
                                                 double timeout_s = 120.0);
  // Cooperative teardown: the trainer destroys its communicator at the same time.
  Result<DestroyWeightGroupReply> destroy_weight_group(const std::string& group);
  // One bucket of `size` bytes that `root` broadcasts over `group`. The daemon replies
  // after it received and applied the bytes, so the broadcast must already be posted
  // (asynchronously, on a CUDA stream) or be posted by another thread: this call blocks.
  Result<UpdateWeightsReply> update_weights_nccl(uint64_t session, std::vector<BucketEntry> entries,
                                                 const std::string& group, uint32_t root,
                                                 uint64_t size,
                                                 std::optional<uint32_t> checksum = std::nullopt);
  // One bucket in [offset, offset + size) of the CUDA allocation exported as `handle`
  // (64-byte cudaIpcMemHandle_t) on the device `device_uuid` (16 bytes), which must be
  // the daemon's. The daemon has copied and synchronized once the reply arrives, so the
  // producer may reuse or free the memory then.
  Result<UpdateWeightsReply> update_weights_cuda_ipc(
      uint64_t session, std::vector<BucketEntry> entries, const std::string& handle,
      uint64_t offset, uint64_t size, const std::string& device_uuid,
      std::optional<uint32_t> checksum = std::nullopt);

  // Next event for any submitted request (tokens, finished, failed, retracted);
  // nullopt when none arrived within timeout_ms.
  Result<std::optional<Event>> next_event(int timeout_ms);
  // submit + collect events until the final one (bounded by timeout_ms overall).
  // Events of other requests stay queued for next_event(). On a timeout the
  // request is aborted and its later events are dropped. A `retracted` event resets
  // what was collected: the request restarts from its prompt.
  Result<GenerateResult> generate(const GenerateRequest& req, int timeout_ms = 120000);

  // ---- raw transport (used by the Python package and the bad-input tests) ----
  // Waits up to request_timeout_ms (or timeout_ms) for a connected daemon to take
  // the message; kUnavailable when none does.
  Status send_raw(const std::vector<std::string>& frames);
  Status send_raw(const std::vector<std::string>& frames, int timeout_ms);
  // The same without copying the frames first: they must stay valid during the call
  // (the Python transport sends a weight bucket from the caller's buffer this way).
  Status send_raw_views(const std::vector<std::string_view>& frames, int timeout_ms);
  // nullopt on timeout. Returns every frame of one message. With `lost_since` (a
  // disconnects() snapshot taken before sending what the caller waits for), a wait with
  // nothing to receive ends with kUnavailable once a connection drop seen after the
  // snapshot is not followed by a reconnection within kReconnectWaitMs: the daemon is down,
  // and its reply would have come over the dropped connection. Calls do this themselves.
  Result<std::optional<std::vector<std::string>>> recv_raw(int timeout_ms,
                                                           std::optional<uint64_t> lost_since = {});
  // Connection drops seen so far.
  uint64_t disconnects();
  // True when no connection to the daemon is up and the connect grace (2 s after
  // connect()) has passed: a send then waits at most kReconnectWaitMs for a
  // reconnection before failing with kUnavailable.
  bool unreachable();
  static constexpr int kReconnectWaitMs = 300;  // > 2 x ZeroMQ's reconnect interval (100 ms)

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::protocol
