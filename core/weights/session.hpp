#pragma once
// Weight-update sessions: begin -> any number of flattened buckets -> end, with the
// fail-closed contract. Runs on the engine's thread (the only writer of parameters),
// between forward steps.
//
//  - begin restores the selected parameters to checkpoint layout (in place);
//  - a bucket is validated as a whole (names, dtypes, shapes, byte ranges, overlaps,
//    checksum) before a single byte is written, so a rejected bucket changes nothing;
//  - end re-derives kernel layouts (in place) and sets the weight version;
//  - a session that ends any other way (abort, idle deadline) after it wrote a bucket
//    leaves the model "not whole": the daemon reports not ready and refuses generation
//    until a completed session has rewritten every parameter the failed one touched.
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/weights/registry.hpp"
#include "kernels/dtype.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

using SteadyClock = std::chrono::steady_clock;

struct BucketEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t byte_offset = 0;
  uint64_t nbytes = 0;
};

struct BeginResult {
  uint64_t session = 0;
  uint32_t num_parameters_restored = 0;  // parameters whose layout actually moved
};
struct BucketResult {
  uint32_t num_entries = 0;
  uint64_t num_bytes = 0;
  double duration_s = 0;
};
struct EndResult {
  uint64_t session = 0;
  uint64_t weight_version = 0;
  uint32_t num_buckets = 0;
  uint64_t num_entries = 0;
  uint64_t num_bytes = 0;
  uint32_t num_parameters_updated = 0;
  double duration_s = 0;
  double postprocess_s = 0;
  bool whole = true;  // false: parameters from an earlier failed session still hold partial data
};

uint32_t crc32_of(std::span<const uint8_t> bytes, uint32_t seed = 0);

class WeightUpdater {
 public:
  explicit WeightUpdater(WeightRegistry& registry) : reg_(registry) {}

  Result<BeginResult> begin(const std::vector<std::string>& selector, double timeout_s,
                            SteadyClock::time_point now);
  // `bucket` is the whole flat buffer the entries' byte offsets refer to. `now`: the bucket's
  // receipt; it restarts the idle deadline (refused or not) and starts the result's duration_s.
  // `on_device`: the bucket lives on the model's CUDA device (NCCL staging, CUDA IPC).
  // `wait_device` (on_device only): synchronize the device copies before returning. false leaves
  // them queued on the model's stream: the caller must wait for that stream before it tells the
  // producer its memory is free, and abort() the session if the queued work fails.
  Result<BucketResult> apply_bucket(uint64_t session, std::span<const BucketEntry> entries,
                                    std::span<const uint8_t> bucket, std::optional<uint32_t> crc32,
                                    SteadyClock::time_point now, bool on_device = false, bool wait_device = true);
  // What apply_bucket checks before it reads a byte: the session, then the table against the
  // parameters (names, ranges within `bucket_size`, dtypes, shapes, layouts, overlaps, repeated
  // names). A shared-memory bucket is checked so before its object is opened and read (SPEC
  // 11.2's order: a misnamed entry is reported as such, and never costs a read of the bucket).
  // Writes nothing and is not activity (the caller touch()es the session on a refusal).
  Status check_bucket(uint64_t session, std::span<const BucketEntry> entries, uint64_t bucket_size) const;
  Result<EndResult> end(uint64_t session, uint64_t weight_version, SteadyClock::time_point now);
  // Ends the session without a new version. Returns whether the model is whole afterwards.
  Result<bool> abort(uint64_t session, const std::string& why);
  // A request naming the open session that was refused before its bucket reached apply_bucket
  // (a shm object missing, say) is activity too: restarts the idle deadline (SPEC 11.4).
  void touch(uint64_t session, SteadyClock::time_point now);
  // Ends an open session whose idle deadline passed; returns its error (kDeadlineExceeded).
  std::optional<Status> expire_if_idle(SteadyClock::time_point now);

  bool session_open() const { return open_; }
  // Changes whenever the weights may have changed (a session begun, the weights memory lost):
  // what is derived from them (cached KV) is stale once it moves.
  uint64_t epoch() const { return epoch_; }
  // Ok when `session` is the open session; else failed_precondition, or deadline_exceeded for
  // one of the last kMaxExpiredRemembered sessions that expired (SPEC 11: a trainer must tell
  // "too slow" from "wrong id").
  Status check_session(uint64_t session) const;
  static constexpr size_t kMaxExpiredRemembered = 64;
  uint64_t session_id() const { return open_ ? id_ : 0; }
  // Servable: no session open and nothing left half-written by a failed one.
  bool whole() const { return !open_ && broken_.empty(); }
  // Why the model is not whole after a failed session ("" otherwise).
  const std::string& broken_reason() const { return broken_reason_; }
  // Every parameter's values are gone (the weights memory was released): the model is not
  // whole, with `reason`, until completed sessions have rewritten every parameter.
  void mark_all_lost(const std::string& reason);

 private:
  Status finish_failed(const std::string& why);
  // check_bucket's table checks; `targets` gets each entry's checkpoint tensor.
  Status check_table(std::span<const BucketEntry> entries, uint64_t bucket_size,
                     std::vector<const CheckpointTensor*>& targets) const;

  WeightRegistry& reg_;
  bool open_ = false;
  uint64_t epoch_ = 0;
  uint64_t id_ = 0;
  uint64_t next_id_ = 1;
  double timeout_s_ = 60;
  std::deque<std::pair<uint64_t, double>> expired_;  // (session, its idle timeout), oldest first
  SteadyClock::time_point started_, last_activity_;
  // Parameters this session wrote, each once (a bucket of 10,000 tensors inserted into a
  // std::set cost a node allocation per entry), and the mask that keeps them distinct.
  std::vector<size_t> written_;
  std::vector<uint8_t> written_mask_;
  void mark_written(size_t param);
  void clear_written();
  // Rows (expert-major, RowGeometry order) this session wrote, per parameter: a session that
  // writes one expert's per-expert tensor rewrites those rows of the stacked parameter only.
  std::map<size_t, std::vector<bool>> written_rows_;
  // Parameters written by failed sessions or lost to a memory release, with the rows not yet
  // rewritten by a completed session; empty: the model is whole.
  std::map<size_t, std::vector<bool>> broken_;
  void mark_broken(size_t param);
  std::string broken_reason_;
  std::string broken_cause_ = "written by a failed weight-update session";  // for end()'s reason
  uint32_t buckets_ = 0;
  uint64_t entries_ = 0, bytes_ = 0;
};

}  // namespace rolloutd::core
