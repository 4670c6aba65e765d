#pragma once
// The v1 wire contract as C++ types. protocol/SPEC.md is normative; this header
// mirrors it. Codecs (protocol/codec.hpp) turn these into msgpack maps and back,
// validating every field.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kernels/dtype.hpp"
#include "kernels/status.hpp"

namespace rolloutd::protocol {

inline constexpr uint32_t kProtocolVersion = 1;

// Bounds applied by decoders before anything is allocated. The daemon reports
// the values it enforces in its hello reply.
struct Limits {
  uint64_t max_envelope_bytes = 4u << 20;   // first frame (msgpack envelope)
  uint64_t max_frame_bytes = 256u << 20;    // each payload frame
  uint32_t max_frames = 16;                 // payload frames after the envelope
  uint32_t max_rid_bytes = 256;
  uint32_t max_string_bytes = 4096;         // any other string field
  uint32_t max_input_tokens = 131072;
  uint32_t max_new_tokens = 65536;
  uint32_t max_stop_token_ids = 256;
  uint32_t max_versions = 16;
  uint32_t max_bucket_entries = 65536;      // entries of one update_weights bucket
};

// Fixed bounds of the weight-update messages (SPEC §4.1), not configurable.
inline constexpr uint32_t kMaxTensorRank = 8;                 // BucketEntry::shape
inline constexpr int64_t kMaxTensorDim = int64_t{1} << 40;    // each shape dimension
inline constexpr uint32_t kMaxGetWeightsTruncate = 1000000;   // get_weights_by_name.truncate
inline constexpr uint32_t kMaxTopLogprobs = 20;                // generate.top_logprobs_num
inline constexpr double kMaxDeadlineS = 86400.0;               // generate.deadline_s

// GPU weight transports (SPEC §11.7), fixed by NCCL and CUDA, not configurable.
inline constexpr size_t kNcclUniqueIdBytes = 128;             // ncclUniqueId (NCCL_UNIQUE_ID_BYTES)
inline constexpr size_t kCudaIpcHandleBytes = 64;             // cudaIpcMemHandle_t
inline constexpr size_t kDeviceUuidBytes = 16;                // cudaDeviceProp::uuid
inline constexpr uint64_t kMaxDeviceBucketBytes = uint64_t{1} << 40;  // NcclSource/CudaIpcSource::size
inline constexpr uint32_t kMinWeightGroupSize = 2;            // a trainer rank and a daemon
inline constexpr uint32_t kMaxWeightGroupSize = 65536;
inline constexpr size_t kMaxWeightGroupNameBytes = 64;        // ^[A-Za-z0-9._-]{1,64}$

// ---------------------------------------------------------------- envelope --
// Every message's first frame: msgpack map {v, type, id, body}.
struct Envelope {
  uint32_t v = kProtocolVersion;
  std::string type;
  uint64_t id = 0;  // chosen by the client; replies and events echo it
};

// ----------------------------------------------------------------- errors ---
struct ErrorInfo {
  std::string code;     // error_code_name(), e.g. "out_of_range"
  std::string message;
  std::string field;    // offending field path, "" if none
};
ErrorInfo to_error_info(const Status& s);

// ---------------------------------------------------------------- requests --
struct HelloRequest {
  std::string client;                 // free-form name, for logs
  std::vector<uint32_t> versions;     // protocol versions the client speaks
};

struct StatusRequest {};

struct GenerateRequest {
  std::string rid;                    // unique among this daemon's in-flight requests
  std::vector<int32_t> input_ids;     // non-empty, each in [0, vocab)
  uint32_t max_new_tokens = 16;       // >= 1, <= limit
  double temperature = 1.0;           // 0 = greedy
  double top_p = 1.0;                 // (0, 1]
  int32_t top_k = 0;                  // 0 = disabled
  double min_p = 0.0;                 // [0, 1]
  std::optional<uint64_t> seed;       // absent: the daemon picks one
  std::vector<int32_t> stop_token_ids;
  bool return_logprob = false;
  bool return_routed_experts = false;
  uint32_t routed_experts_start_len = 0;  // first position recorded
  bool stream = true;
  // [0, kMaxTopLogprobs]: with n > 0 every sampled token also carries the n most likely tokens
  // and their log-probs (SPEC §4.1). Written only when n > 0, so older daemons' bytes are unchanged.
  uint32_t top_logprobs_num = 0;
  // [0, kMaxDeadlineS] seconds from the daemon's receipt; then the request ends with
  // finished{abort, deadline} wherever it is (queued, running, paused). 0 = none. Written only when
  // > 0, like top_logprobs_num.
  double deadline_s = 0.0;
};

struct AbortRequest {
  std::optional<std::string> rid;     // exactly one of rid / all
  bool all = false;
};

struct ShutdownRequest {
  bool drain = true;                  // finish in-flight requests (bounded by deadline_s)
  double deadline_s = 30.0;
};

// ---- weight updates (SPEC §11) ----
struct BeginWeightUpdateRequest {
  // Parameter-name prefixes the session may touch; absent = every parameter.
  std::optional<std::vector<std::string>> selector;
  double timeout_s = 60.0;            // idle deadline of the session, (0, 3600]
};

// One tensor of a bucket: checkpoint name, dtype and shape, and where its bytes lie
// in the bucket buffer (little-endian, row-major).
struct BucketEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;         // rank <= kMaxTensorRank, each dim in [0, kMaxTensorDim]
  uint64_t byte_offset = 0;           // from the start of the bucket buffer
  uint64_t nbytes = 0;                // == product(shape) * dtype_size(dtype)
};

// The bucket buffer is payload frame `frame` of the same message. The decoder does
// not copy it: the daemon reads it from the frames it passed to decode_request.
struct InlineSource {
  uint32_t frame = 0;
};
// The bucket buffer is [offset, offset + size) of the POSIX shared-memory object `name`.
struct ShmSource {
  std::string name;                   // "/..." (shm_open name)
  uint64_t offset = 0;
  uint64_t size = 0;
};
// The bucket buffer is `size` bytes that the group's `root` (the trainer) broadcasts
// with ncclBroadcast into the daemon's staging buffer (SPEC §11.7).
struct NcclSource {
  std::string group;                  // a group joined with init_weight_group
  uint32_t root = 0;                  // the broadcasting rank: the group's root
  uint64_t size = 0;                  // bytes broadcast into the staging buffer, <= kMaxDeviceBucketBytes
};
// The bucket buffer is [offset, offset + size) of the CUDA allocation the producer
// exported with cudaIpcGetMemHandle, on the daemon's own device (SPEC §11.7).
struct CudaIpcSource {
  std::string handle;                 // exactly kCudaIpcHandleBytes (cudaIpcMemHandle_t), msgpack bin
  uint64_t offset = 0;                // from the base of the allocation
  uint64_t size = 0;                  // <= kMaxDeviceBucketBytes
  std::string device_uuid;            // exactly kDeviceUuidBytes, msgpack bin
};
using BucketSource = std::variant<InlineSource, ShmSource, NcclSource, CudaIpcSource>;

struct BucketChecksum {
  std::string algo = "crc32";         // only "crc32" in v1
  uint32_t value = 0;                 // CRC-32 of the whole bucket buffer
};

struct UpdateWeightsRequest {
  uint64_t session = 0;
  std::string load_format = "flattened_bucket";
  std::vector<BucketEntry> entries;   // non-empty, non-overlapping, inside the buffer
  BucketSource source;
  std::optional<BucketChecksum> checksum;
};

struct EndWeightUpdateRequest {
  uint64_t session = 0;
  uint64_t weight_version = 0;        // the version tokens carry from now on
};

struct AbortWeightUpdateRequest {
  uint64_t session = 0;
};

struct GetWeightsByNameRequest {
  std::string name;
  uint32_t truncate = 100;            // first elements returned, <= kMaxGetWeightsTruncate
};

struct WeightsChecksumRequest {
  std::optional<std::vector<std::string>> names;  // absent = every parameter
};

enum class PauseMode : uint8_t { kAbort, kRetract, kInPlace };
// "abort" | "retract" | "in_place"
std::string_view pause_mode_name(PauseMode m);
std::optional<PauseMode> pause_mode_from_name(std::string_view name);

struct PauseGenerationRequest {
  PauseMode mode = PauseMode::kAbort;
};

struct ContinueGenerationRequest {};

// ---- NCCL weight groups (SPEC §11.7) ----
// Join the broadcast group the trainer created; the reply comes once joined (or failed).
struct InitWeightGroupRequest {
  std::string group;                  // ^[A-Za-z0-9._-]{1,64}$, unique among the daemon's groups
  std::string unique_id;              // exactly kNcclUniqueIdBytes (ncclUniqueId), msgpack bin
  uint32_t world_size = 0;            // [kMinWeightGroupSize, kMaxWeightGroupSize]
  uint32_t rank = 0;                  // this daemon's rank: < world_size, != root
  uint32_t root = 0;                  // the trainer's rank, which broadcasts: < world_size
  uint32_t nccl_version = 0;          // NCCL_VERSION_CODE of the trainer's NCCL, e.g. 22809
  double timeout_s = 120.0;           // (0, 3600]: bounds the join and each broadcast
};

struct DestroyWeightGroupRequest {
  std::string group;
};

// ---- memory release and resume (SPEC §12) ----
// The memory tags a client names, in canonical order: what `tags: nil` means.
inline constexpr std::string_view kMemoryTags[] = {"weights", "kv_cache", "cuda_graph"};
bool is_memory_tag(std::string_view tag);

// Give the GPU memory of each tag back (addresses stay reserved); only while idle.
struct ReleaseMemoryRequest {
  std::optional<std::vector<std::string>> tags;  // absent = every tag; distinct kMemoryTags
};
// Map memory again under each tag, at the same addresses.
struct ResumeMemoryRequest {
  std::optional<std::vector<std::string>> tags;
};

using Request =
    std::variant<HelloRequest, StatusRequest, GenerateRequest, AbortRequest, ShutdownRequest,
                 BeginWeightUpdateRequest, UpdateWeightsRequest, EndWeightUpdateRequest,
                 AbortWeightUpdateRequest, GetWeightsByNameRequest, WeightsChecksumRequest,
                 PauseGenerationRequest, ContinueGenerationRequest, InitWeightGroupRequest,
                 DestroyWeightGroupRequest, ReleaseMemoryRequest, ResumeMemoryRequest>;

// ----------------------------------------------------------------- replies --
struct ModelInfo {
  std::string name;
  std::string family;
  uint32_t vocab_size = 0;
  uint32_t num_layers = 0;
  uint32_t num_moe_layers = 0;
  uint32_t num_experts = 0;
  uint32_t top_k = 0;
  std::string routed_experts_dtype;   // "uint8" | "uint16" | "int32"
};

struct HelloReply {
  uint32_t version = kProtocolVersion;
  std::string daemon = "rolloutd";
  std::string build;
  int32_t gpu = -1;                   // -1 on the CPU backend
  ModelInfo model;
  uint64_t weight_version = 0;
  Limits limits;
  // Added with the GPU weight transports (SPEC §11.7); optional for decoders.
  uint32_t nccl_version = 0;          // the NCCL the daemon loaded (ncclGetVersion); 0 = none
  std::string device_uuid;            // kDeviceUuidBytes of the daemon's GPU; empty on the CPU backend
};

struct StatusReply {
  std::string state;                  // "starting" | "ready" | "not_ready" | "draining"
  bool ready = false;
  std::string reason;                 // why not ready, "" when ready
  uint64_t weight_version = 0;
  uint32_t num_waiting = 0;
  uint32_t num_running = 0;
  uint64_t num_requests_total = 0;
  uint64_t num_tokens_generated_total = 0;
  double uptime_s = 0.0;
  std::string build;
  ModelInfo model;
  bool paused = false;                // pause_generation in effect
  uint64_t update_session = 0;        // open weight-update session, 0 = none
};

struct GenerateReply {                // the request was accepted; events follow
  std::string rid;
};

struct AbortReply {
  uint32_t num_aborted = 0;           // requests that will receive finished{abort}
};

struct ShutdownReply {
  bool accepted = true;
};

struct BeginWeightUpdateReply {
  uint64_t session = 0;
  uint64_t weight_version = 0;        // version serving when the session began
  uint32_t num_parameters_restored = 0;
};

struct UpdateWeightsReply {
  uint64_t session = 0;
  uint32_t num_entries = 0;
  uint64_t num_bytes = 0;
  double duration_s = 0.0;
};

struct EndWeightUpdateReply {
  uint64_t session = 0;
  uint64_t weight_version = 0;
  uint32_t num_buckets = 0;
  uint64_t num_entries = 0;
  uint64_t num_bytes = 0;
  uint32_t num_parameters_updated = 0;
  double duration_s = 0.0;            // begin to end
  double postprocess_s = 0.0;
};

struct AbortWeightUpdateReply {
  uint64_t session = 0;
  std::string state;                  // "ready" | "not_ready" (buckets had been applied)
};

struct GetWeightsByNameReply {
  std::string name;
  std::string dtype;                  // checkpoint dtype name ("bfloat16", ...)
  std::vector<int64_t> shape;
  std::vector<double> values;         // first `truncate` elements, checkpoint layout, flattened
};

struct ParameterChecksum {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint32_t checksum = 0;              // CRC-32 of the checkpoint-layout bytes
};

struct WeightsChecksumReply {
  std::string algo = "crc32";
  uint64_t weight_version = 0;
  uint32_t model_checksum = 0;        // protocol::model_checksum over `parameters`
  std::vector<ParameterChecksum> parameters;  // sorted by name
};

struct PauseGenerationReply {
  uint32_t num_aborted = 0;
  uint32_t num_retracted = 0;
  uint32_t num_paused = 0;
};

struct ContinueGenerationReply {
  uint32_t num_resumed = 0;
};

struct InitWeightGroupReply {
  std::string group;
  uint32_t nccl_version = 0;          // the daemon's loaded NCCL (equal to the trainer's)
  uint32_t rank = 0;
  uint32_t world_size = 0;
  double duration_s = 0.0;            // receipt to joined
};

struct DestroyWeightGroupReply {
  std::string group;
};

struct ReleaseMemoryReply {
  std::vector<std::string> tags;      // tags this call released (canonical order); already released ones are not listed
  uint64_t num_bytes = 0;             // physical bytes given back by this call
  double duration_s = 0.0;
};

struct ResumeMemoryReply {
  std::vector<std::string> tags;      // tags this call resumed (canonical order)
  uint64_t num_bytes = 0;             // physical bytes mapped by this call
  double duration_s = 0.0;
};

// ------------------------------------------------------------------ events --
// Routed-expert rows ride as one raw payload frame (little-endian), described here.
struct RoutedExperts {
  std::string dtype;                  // "uint8" | "uint16" | "int32"
  uint32_t num_tokens = 0;            // rows in this event
  uint32_t num_layers = 0;            // MoE layers
  uint32_t top_k = 0;
  uint32_t start_pos = 0;             // sequence position of the first row
  std::string data;                   // num_tokens * num_layers * top_k * sizeof(dtype) bytes
};

struct TokensEvent {
  std::string rid;
  std::vector<int32_t> token_ids;
  std::vector<double> logprobs;       // empty unless return_logprob
  std::vector<uint64_t> weight_versions;  // one per token
  std::optional<RoutedExperts> routed_experts;  // only when return_routed_experts
  // The request's top_logprobs_num (0: the two arrays are empty and the keys are not written);
  // else token j's n most likely tokens are entries [j*n, (j+1)*n): raw logit descending, id
  // ascending on ties (SPEC §4.1, §4.3).
  uint32_t top_logprobs_num = 0;
  std::vector<int32_t> top_token_ids;
  std::vector<double> top_logprobs;
};

struct FinishedEvent {
  std::string rid;
  std::string reason;                 // "stop" | "length" | "abort"
  std::string abort_reason;           // for "abort": "client" | "shutdown" | "client_gone" | ...
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
};

struct FailedEvent {
  std::string rid;
  ErrorInfo error;
};

// Not final: the request restarts from its prompt; the client discards what it
// received for this rid (tokens, logprobs, versions, routed rows). More events follow.
struct RetractedEvent {
  std::string rid;
  uint32_t num_tokens_discarded = 0;  // tokens delivered so far that are now void
  std::string reason;                 // "weight_update"
};

using Event = std::variant<TokensEvent, FinishedEvent, FailedEvent, RetractedEvent>;

}  // namespace rolloutd::protocol
