#include "core/weights/session.hpp"

#include <zlib.h>

#include <algorithm>
#include <string_view>

namespace rolloutd::core {
namespace {
std::string entry_field(size_t i, const char* what) {
  return "entries[" + std::to_string(i) + "]" + (what[0] ? std::string(".") + what : std::string());
}
double seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

uint32_t crc32_of(std::span<const uint8_t> bytes, uint32_t seed) {
  uLong c = seed;
  // zlib takes uInt lengths: feed large buffers in chunks.
  size_t off = 0;
  while (off < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - off, size_t{1} << 30);
    c = crc32(c, bytes.data() + off, static_cast<uInt>(n));
    off += n;
  }
  return static_cast<uint32_t>(c);
}

Status WeightUpdater::check_session(uint64_t session) const {
  if (open_ && session == id_) return Status::Ok();
  for (const auto& [id, timeout_s] : expired_)
    if (id == session)
      return Status(ErrorCode::kDeadlineExceeded,
                    "weight-update session " + std::to_string(session) + " expired after " +
                        std::to_string(timeout_s) + " s without activity",
                    "session");
  return Status(ErrorCode::kFailedPrecondition,
                open_ ? "session " + std::to_string(session) + " is not open (session " + std::to_string(id_) + " is)"
                      : "no weight-update session is open",
                "session");
}

Result<BeginResult> WeightUpdater::begin(const std::vector<std::string>& selector, double timeout_s,
                                         SteadyClock::time_point now) {
  if (open_)
    return Status(ErrorCode::kFailedPrecondition, "session " + std::to_string(id_) + " is already open", "session");
  if (!(timeout_s > 0 && timeout_s <= 3600))
    return Status(ErrorCode::kOutOfRange, "timeout_s must be in (0, 3600]", "timeout_s");
  if (!reg_.resident())
    return Status(ErrorCode::kFailedPrecondition,
                  "the weights memory is released: resume_memory{weights} before a weight-update session");
  BeginResult r;
  ++epoch_;  // from here on the weights may change, whatever the session ends with
  const auto& params = reg_.parameters();
  // A prefix selects by stored or checkpoint names (what the trainer pushes); one that names
  // nothing is a mistake the trainer would otherwise meet as a refusal of every bucket.
  std::vector<bool> selected(params.size(), selector.empty());
  if (const int64_t k = reg_.mark_selected(selector, selected); k >= 0)
    return Status(ErrorCode::kNotFound, "selector prefix '" + selector[k] + "' names no parameter",
                  "selector[" + std::to_string(k) + "]");
  for (size_t i = 0; i < params.size(); ++i) {
    if (!selected[i]) continue;
    if (params[i].layout == Layout::kKernel && params[i].method->transforms_layout()) ++r.num_parameters_restored;
    Status s = reg_.restore(i);
    if (!s.ok()) {
      // A restore that fails half-way leaves layouts mixed: put back what moved, fail closed.
      open_ = true;
      id_ = next_id_++;
      (void)finish_failed("begin_weight_update failed restoring " + params[i].name + ": " + s.message());
      return s;
    }
  }
  if (Status s = reg_.synchronize(); !s.ok()) {  // the restores have run before the reply
    open_ = true;
    id_ = next_id_++;
    (void)finish_failed("begin_weight_update failed restoring layouts: " + s.message());
    return s;
  }
  open_ = true;
  id_ = next_id_++;
  timeout_s_ = timeout_s;
  started_ = last_activity_ = now;
  clear_written();
  written_rows_.clear();
  buckets_ = 0;
  entries_ = bytes_ = 0;
  r.session = id_;
  return r;
}

Status WeightUpdater::check_bucket(uint64_t session, std::span<const BucketEntry> entries,
                                  uint64_t bucket_size) const {
  RD_RETURN_IF_ERROR(check_session(session));
  std::vector<const CheckpointTensor*> targets;
  return check_table(entries, bucket_size, targets);
}

Status WeightUpdater::check_table(std::span<const BucketEntry> entries, uint64_t bucket_size,
                                  std::vector<const CheckpointTensor*>& targets) const {
  if (entries.empty()) return Status(ErrorCode::kInvalidArgument, "bucket has no entries", "entries");
  // 1. Every entry on its own: known name, in range, dtype/shape acceptable.
  targets.assign(entries.size(), nullptr);
  for (size_t i = 0; i < entries.size(); ++i) {
    const BucketEntry& e = entries[i];
    const CheckpointTensor* t = reg_.resolve(e.name);
    if (!t) return Status(ErrorCode::kNotFound, "unknown parameter '" + e.name + "'", entry_field(i, "name"));
    if (e.byte_offset > bucket_size || e.nbytes > bucket_size - e.byte_offset)
      return Status(ErrorCode::kOutOfRange,
                    "bytes [" + std::to_string(e.byte_offset) + ", +" + std::to_string(e.nbytes) +
                        ") lie outside the bucket of " + std::to_string(bucket_size) + " bytes",
                    entry_field(i, "byte_offset"));
    Status s = reg_.check_load(*t, e.dtype, e.shape, e.nbytes);
    if (!s.ok()) return Status(s.code(), s.message(), entry_field(i, s.field().c_str()));
    targets[i] = t;
  }
  // 2. No two entries share bytes, and no two write the same rows (a duplicate name).
  // Sorted by offset, an entry overlaps an earlier one iff it starts before the furthest end seen
  // so far (comparing neighbours only missed [0, 100) and [50, 60) with an empty entry between
  // them). Empty entries hold no byte.
  std::vector<size_t> order;
  order.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].nbytes > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(entries[a].byte_offset, a) < std::pair(entries[b].byte_offset, b);
  });
  for (size_t k = 1, furthest = order.empty() ? 0 : order[0]; k < order.size(); ++k) {
    const BucketEntry& far = entries[furthest];
    const BucketEntry& e = entries[order[k]];
    if (e.byte_offset < far.byte_offset + far.nbytes)
      return Status(ErrorCode::kInvalidArgument,
                    "entry overlaps entry " + std::to_string(furthest) + " ('" + far.name + "')",
                    entry_field(order[k], ""));
    furthest = order[k];  // starts at or after the furthest end, so it ends further
  }
  // A name resolves to one CheckpointTensor: equal names are equal targets. Sorting (target,
  // index) pairs finds the first entry, in list order, whose name came earlier, without hashing
  // every name again.
  {
    std::vector<std::pair<const CheckpointTensor*, size_t>> by_target(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) by_target[i] = {targets[i], i};
    std::sort(by_target.begin(), by_target.end());
    size_t repeated = SIZE_MAX;
    for (size_t k = 1; k < by_target.size(); ++k)
      if (by_target[k].first == by_target[k - 1].first && (k < 2 || by_target[k - 2].first != by_target[k].first))
        repeated = std::min(repeated, by_target[k].second);  // the second of its group
    if (repeated != SIZE_MAX)
      return Status(ErrorCode::kInvalidArgument, "parameter '" + entries[repeated].name + "' appears twice in the bucket",
                    entry_field(repeated, "name"));
  }
  return Status::Ok();
}

Result<BucketResult> WeightUpdater::apply_bucket(uint64_t session, std::span<const BucketEntry> entries,
                                                 std::span<const uint8_t> bucket, std::optional<uint32_t> crc,
                                                 SteadyClock::time_point now, bool on_device,
                                                 bool wait_device) {
  RD_RETURN_IF_ERROR(check_session(session));
  const auto t_entry = SteadyClock::now();
  // Any bucket naming the open session is activity, refused or not (SPEC 11.4): a trainer
  // correcting a refused bucket must not find its session expired meanwhile.
  last_activity_ = std::max(last_activity_, now);
  std::vector<const CheckpointTensor*> targets;
  RD_RETURN_IF_ERROR(check_table(entries, bucket.size(), targets));
  // 3. The payload is what the trainer sent.
  if (crc) {
    // A device-resident bucket is checksummed from a host copy: a check the trainer asks for
    // (tests, suspected corruption), not the fast path.
    std::vector<uint8_t> host;
    if (on_device) {
      host.resize(bucket.size());
      RD_RETURN_IF_ERROR(reg_.backend().copy(reg_.context(), host.data(), bucket.data(), bucket.size(),
                                             CopyKind::kDeviceToHost));
      RD_RETURN_IF_ERROR(reg_.backend().synchronize(reg_.context()));
    }
    const uint32_t got = crc32_of(on_device ? std::span<const uint8_t>(host) : bucket);
    if (got != *crc)
      return Status(ErrorCode::kInvalidArgument,
                    "bucket checksum mismatch: crc32 " + std::to_string(got) + ", expected " + std::to_string(*crc),
                    "checksum");
  }
  // 4. Write. Validation above is complete, so a failure here is an environment fault
  // (device error): the session fails closed. Plain loads become copy runs, copied together with
  // adjacent runs merged (WeightRegistry::copy_runs); a quantizing load first flushes the runs
  // before it, so everything is written in the bucket's order. An entry's parameters count as
  // written once its runs are queued: a failed merged copy may have written any of them.
  std::vector<WeightRegistry::CopyRun> runs;
  std::vector<size_t> run_entry;  // the entry each run belongs to, for the error's field
  runs.reserve(entries.size());
  run_entry.reserve(entries.size());
  auto fail = [&](size_t i, const Status& s) {
    (void)finish_failed("bucket write failed at " + entries[i].name + ": " + s.message());
    return Status(s.code(), s.message(), entry_field(i, ""));
  };
  auto flush = [&]() -> Status {
    size_t failed = 0;
    Status s = reg_.copy_runs(runs, on_device, &failed);
    if (!s.ok()) return fail(run_entry[failed], s);
    runs.clear();
    run_entry.clear();
    return Status::Ok();
  };
  for (size_t i = 0; i < entries.size(); ++i) {
    const BucketEntry& e = entries[i];
    const CheckpointTensor& t = *targets[i];
    const bool quantizes = t.quantizes_from(e.dtype);
    if (quantizes) {
      for (size_t p : t.targets(e.dtype)) mark_written(p);
    } else {
      for (const RowCopy& c : t.pieces) mark_written(c.param);
    }
    // Rows are tracked only for parameters waiting to be made whole (none in steady state).
    for (const RowCopy& c : broken_.empty() ? std::vector<RowCopy>{} : reg_.rows_written(t, e.dtype)) {
      if (!broken_.count(c.param)) continue;
      const RowGeometry g = row_geometry(reg_.parameters()[c.param].storage);
      std::vector<bool>& rows = written_rows_[c.param];
      rows.resize(static_cast<size_t>(g.experts * g.rows), false);
      const int64_t base = (c.expert < 0 ? 0 : c.expert) * g.rows;
      for (int64_t k = 0; k < c.count; ++k) rows[static_cast<size_t>(base + c.dst_start + k * c.dst_stride)] = true;
    }
    const std::span<const uint8_t> src = bucket.subspan(e.byte_offset, e.nbytes);
    if (!quantizes) {
      reg_.append_copy_runs(t, e.dtype, src, runs);
      run_entry.resize(runs.size(), i);
      continue;
    }
    RD_RETURN_IF_ERROR(flush());
    if (Status s = reg_.load(t, e.dtype, e.shape, src, on_device); !s.ok()) return fail(i, s);
  }
  RD_RETURN_IF_ERROR(flush());
  if (on_device && wait_device) {
    // The reply that follows promises the bytes are in place: wait for the device copies.
    Status s = reg_.backend().synchronize(reg_.context());
    if (!s.ok()) {
      (void)finish_failed("device copy failed: " + s.message());
      return s;
    }
  }
  // The entries' bytes (SPEC 11.1), not the buffer's: a shm region or frame may hold gaps and a tail.
  uint64_t entry_bytes = 0;
  for (const BucketEntry& e : entries) entry_bytes += e.nbytes;
  ++buckets_;
  entries_ += entries.size();
  bytes_ += entry_bytes;
  // Idle from the bucket's completion, on the caller's clock: `now` plus the time spent here
  // (a large copy is not idle time; the daemon also touch()es after a long shm read).
  last_activity_ = std::max(last_activity_, now + (SteadyClock::now() - t_entry));
  BucketResult r;
  r.num_entries = static_cast<uint32_t>(entries.size());
  r.num_bytes = entry_bytes;
  r.duration_s = std::max(0.0, seconds(SteadyClock::now() - now));  // from `now`, the bucket's receipt
  return r;
}

Result<EndResult> WeightUpdater::end(uint64_t session, uint64_t weight_version, SteadyClock::time_point now) {
  RD_RETURN_IF_ERROR(check_session(session));
  const auto t0 = SteadyClock::now();
  Status s = reg_.postprocess_all();
  if (!s.ok()) {
    (void)finish_failed("postprocess failed: " + s.message());
    return s;
  }
  EndResult r;
  r.session = id_;
  r.weight_version = weight_version;
  r.num_buckets = buckets_;
  r.num_entries = entries_;
  r.num_bytes = bytes_;
  r.num_parameters_updated = static_cast<uint32_t>(written_.size());
  r.postprocess_s = seconds(SteadyClock::now() - t0);
  r.duration_s = seconds(now - started_) + r.postprocess_s;
  // A broken parameter is whole again once every one of its rows has been rewritten.
  for (const auto& [p, rows] : written_rows_) {
    auto it = broken_.find(p);
    if (it == broken_.end()) continue;
    std::vector<bool>& left = it->second;
    for (size_t k = 0; k < left.size() && k < rows.size(); ++k)
      if (rows[k]) left[k] = false;
    if (std::find(left.begin(), left.end(), true) == left.end()) broken_.erase(it);
  }
  if (broken_.empty()) broken_reason_.clear();
  else
    broken_reason_ = std::to_string(broken_.size()) + " parameters " + broken_cause_ +
                     " have not been wholly rewritten (e.g. " + reg_.parameters()[broken_.begin()->first].name + ")";
  if (broken_.empty()) broken_cause_ = "written by a failed weight-update session";
  r.whole = broken_.empty();
  open_ = false;
  clear_written();
  written_rows_.clear();
  return r;
}

void WeightUpdater::mark_broken(size_t param) {
  const RowGeometry g = row_geometry(reg_.parameters()[param].storage);
  broken_[param].assign(static_cast<size_t>(std::max<int64_t>(g.experts * g.rows, 1)), true);
}

void WeightUpdater::mark_all_lost(const std::string& reason) {
  ++epoch_;
  for (size_t i = 0; i < reg_.size(); ++i) mark_broken(i);
  broken_reason_ = reason;
  broken_cause_ = "lost when the weights memory was released";
}

Status WeightUpdater::finish_failed(const std::string& why) {
  // Return every layout to kernel order so the flags stay truthful; what was written stays
  // written, and those parameters are marked until a completed session rewrites them.
  Status s = reg_.postprocess_all();
  if (!written_.empty()) {
    for (size_t p : written_) mark_broken(p);  // whole parameters: what it left is unknown
    broken_reason_ = "weight-update session " + std::to_string(id_) + " failed after writing " +
                     std::to_string(written_.size()) + " parameters (e.g. " +
                     reg_.parameters()[*std::min_element(written_.begin(), written_.end())].name + "): " + why;
  }
  if (!s.ok()) {
    // Layouts are now unknown: nothing may be served until a full session rewrites them.
    for (size_t i = 0; i < reg_.size(); ++i) mark_broken(i);
    broken_reason_ = "layout restore failed after session " + std::to_string(id_) + ": " + s.message();
  }
  open_ = false;
  clear_written();
  written_rows_.clear();
  return s;
}

void WeightUpdater::mark_written(size_t param) {
  if (written_mask_.size() < reg_.size()) written_mask_.resize(reg_.size(), 0);
  if (written_mask_[param]) return;
  written_mask_[param] = 1;
  written_.push_back(param);
}

void WeightUpdater::clear_written() {
  for (size_t p : written_) written_mask_[p] = 0;
  written_.clear();
}

Result<bool> WeightUpdater::abort(uint64_t session, const std::string& why) {
  RD_RETURN_IF_ERROR(check_session(session));
  (void)finish_failed("aborted: " + why);
  return broken_.empty();
}

void WeightUpdater::touch(uint64_t session, SteadyClock::time_point now) {
  if (open_ && session == id_) last_activity_ = std::max(last_activity_, now);
}

std::optional<Status> WeightUpdater::expire_if_idle(SteadyClock::time_point now) {
  if (!open_) return std::nullopt;
  if (seconds(now - last_activity_) <= timeout_s_) return std::nullopt;
  const uint64_t id = id_;
  (void)finish_failed("idle for more than " + std::to_string(timeout_s_) + " s");
  expired_.emplace_back(id, timeout_s_);
  if (expired_.size() > kMaxExpiredRemembered) expired_.pop_front();
  return Status(ErrorCode::kDeadlineExceeded,
                "weight-update session " + std::to_string(id) + " expired after " + std::to_string(timeout_s_) +
                    " s without activity",
                "session");
}

}  // namespace rolloutd::core
