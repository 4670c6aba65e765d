#pragma once
// An NCCL broadcast group joined from a unique id the trainer created (SPEC §12).
//
// Everything is non-blocking: the communicator is created with `blocking = 0`, joins and
// broadcasts are polled from the engine actor's loop (which keeps serving meanwhile), and
// every wait has a deadline after which the communicator is aborted (ncclCommAbort), so a
// dead trainer never hangs the daemon. A watchdog reads ncclCommGetAsyncError on every poll.
//
// Built only with CUDA + NCCL; without them every entry point returns kUnimplemented.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/status.hpp"

namespace rolloutd::daemon {

class NcclGroup {
 public:
  // NCCL_VERSION_CODE of the library this process loaded (0 when built without NCCL).
  static int loaded_version();

  // Starts joining as `rank` of `world` on CUDA device `device`; poll_join() completes it.
  // `root` is the trainer's rank; `timeout_s` bounds the join and each broadcast.
  static Result<std::unique_ptr<NcclGroup>> start_join(const std::string& name, const std::string& unique_id,
                                                       int world, int rank, int root, int device, double timeout_s);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  // true: joined; false: still joining; error: failed or past the deadline (aborted).
  Result<bool> poll_join();
  // Up to this many broadcasts may be posted at once (the daemon's staging is double-buffered):
  // bucket i+1 is received while bucket i is applied.
  static constexpr int kMaxInFlight = 2;
  // Receives `bytes` from `root` into device memory `dst` (posted on the group's stream, after
  // any broadcast still in flight). Needs can_start_broadcast().
  Status start_broadcast(void* dst, uint64_t bytes);
  // Joined, not aborted, fewer than kMaxInFlight posted, and the last one enqueued (NCCL's rule
  // for non-blocking communicators: no new call while one is still in progress).
  bool can_start_broadcast() const;
  bool broadcast_in_flight() const;
  int broadcasts_in_flight() const;
  // For the OLDEST broadcast in flight: true when it completed (it leaves the queue); false:
  // in flight; error: peer failure or deadline (the group is aborted, every broadcast lost).
  Result<bool> poll_broadcast();
  // Aborts the communicator (a peer is gone or a deadline passed): the group is unusable.
  void abort(const std::string& why);
  bool aborted() const { return aborted_; }
  const std::string& name() const { return name_; }
  int root() const { return root_; }
  double timeout_s() const { return timeout_s_; }
  int device() const { return device_; }

 private:
  struct Impl;
  NcclGroup(std::string name, int device);
  std::string name_;
  int device_;
  int root_ = 0;
  double timeout_s_ = 120.0;
  bool aborted_ = false;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::daemon
