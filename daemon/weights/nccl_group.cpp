#include "daemon/weights/nccl_group.hpp"

#if defined(ROLLOUTD_WITH_NCCL)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#endif

#include <cstring>
#include <deque>
#include <type_traits>

#include "daemon/obs/log.hpp"

namespace rolloutd::daemon {

using Clock = std::chrono::steady_clock;

#if defined(ROLLOUTD_WITH_NCCL)

namespace {

// libnccl.so.2 is loaded on first use, not linked: the daemon must run where NCCL is absent
// (CPU hosts, an offline bundle), and the library it uses must be the trainer's -- whichever
// LD_LIBRARY_PATH finds first (NOTES: PyTorch ships its own).
struct NcclApi {
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  std::string error;
  bool ok() const { return error.empty(); }
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      a.error = std::string("cannot load libnccl.so.2 (") + (e ? e : "unknown") +
                "): put the trainer's NCCL on LD_LIBRARY_PATH (PyTorch: <site-packages>/nvidia/nccl/lib)";
      return a;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && a.error.empty()) a.error = std::string("libnccl.so.2 lacks ") + name;
    };
    sym(a.GetVersion, "ncclGetVersion");
    sym(a.CommInitRankConfig, "ncclCommInitRankConfig");
    sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.Broadcast, "ncclBroadcast");
    sym(a.GetErrorString, "ncclGetErrorString");
    return a;
  }();
  return api;
}

Status nccl_status(ncclResult_t r, const std::string& what) {
  return Status(ErrorCode::kUnavailable, what + ": " + nccl().GetErrorString(r), "nccl");
}
Status cuda_status(cudaError_t e, const std::string& what) {
  (void)cudaGetLastError();
  return Status(ErrorCode::kCudaError, what + ": " + cudaGetErrorString(e), "cuda");
}
Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
}  // namespace

struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  Clock::time_point join_deadline;
  bool joined = false;
  // Broadcasts posted and not yet seen complete, oldest first; completion events are used
  // round robin (at most kMaxInFlight are in the queue).
  struct Bcast {
    cudaEvent_t done = nullptr;
    Clock::time_point deadline;
    uint64_t bytes = 0;
    bool enqueued = false;  // ncclBroadcast finished enqueueing (ncclSuccess, not ncclInProgress)
  };
  std::deque<Bcast> in_flight;
  cudaEvent_t events[kMaxInFlight] = {};
  int next_event = 0;
};

int NcclGroup::loaded_version() {
  if (!nccl().ok()) return 0;
  int v = 0;
  return nccl().GetVersion(&v) == ncclSuccess ? v : 0;
}

NcclGroup::NcclGroup(std::string name, int device)
    : name_(std::move(name)), device_(device), impl_(std::make_unique<Impl>()) {}

NcclGroup::~NcclGroup() {
  if (!impl_) return;
  cudaSetDevice(device_);
  if (impl_->comm) {
    // A communicator whose peers may be gone cannot be destroyed cooperatively without risking
    // a hang (ncclCommDestroy waits for them): abort it.
    nccl().CommAbort(impl_->comm);
  }
  for (cudaEvent_t e : impl_->events)
    if (e) cudaEventDestroy(e);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

Result<std::unique_ptr<NcclGroup>> NcclGroup::start_join(const std::string& name, const std::string& unique_id,
                                                         int world, int rank, int root, int device, double timeout_s) {
  if (unique_id.size() != sizeof(ncclUniqueId))
    return Status(ErrorCode::kInvalidArgument, "unique_id must be " + std::to_string(sizeof(ncclUniqueId)) + " bytes",
                  "body.unique_id");
  if (!nccl().ok()) return Status(ErrorCode::kUnimplemented, nccl().error, "");
  std::unique_ptr<NcclGroup> g(new NcclGroup(name, device));
  g->root_ = root;
  g->timeout_s_ = timeout_s;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return cuda_status(e, "cudaSetDevice");
  if (cudaError_t e = cudaStreamCreateWithFlags(&g->impl_->stream, cudaStreamNonBlocking); e != cudaSuccess)
    return cuda_status(e, "cudaStreamCreate");
  for (cudaEvent_t& ev : g->impl_->events)
    if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess)
      return cuda_status(e, "cudaEventCreate");
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  g->impl_->join_deadline = deadline_after(timeout_s);
  const ncclResult_t r = nccl().CommInitRankConfig(&g->impl_->comm, world, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    g->impl_->comm = nullptr;
    return nccl_status(r, "ncclCommInitRankConfig");
  }
  return g;
}

Result<bool> NcclGroup::poll_join() {
  if (aborted_) return Status(ErrorCode::kUnavailable, "group '" + name_ + "' was aborted", "group");
  if (impl_->joined) return true;
  cudaSetDevice(device_);
  ncclResult_t state = ncclInProgress;
  const ncclResult_t r = nccl().CommGetAsyncError(impl_->comm, &state);
  if (r != ncclSuccess) {
    abort("ncclCommGetAsyncError failed");
    return nccl_status(r, "ncclCommGetAsyncError");
  }
  if (state == ncclSuccess) {
    impl_->joined = true;
    return true;
  }
  if (state != ncclInProgress) {
    abort("join failed");
    return nccl_status(state, "joining group '" + name_ + "'");
  }
  if (Clock::now() > impl_->join_deadline) {
    abort("join deadline");
    return Status(ErrorCode::kDeadlineExceeded, "the trainer did not join group '" + name_ + "' in time", "body.timeout_s");
  }
  return false;
}

bool NcclGroup::broadcast_in_flight() const { return impl_ && !impl_->in_flight.empty(); }

int NcclGroup::broadcasts_in_flight() const { return impl_ ? static_cast<int>(impl_->in_flight.size()) : 0; }

bool NcclGroup::can_start_broadcast() const {
  return impl_ && !aborted_ && impl_->joined && static_cast<int>(impl_->in_flight.size()) < kMaxInFlight &&
         (impl_->in_flight.empty() || impl_->in_flight.back().enqueued);
}

Status NcclGroup::start_broadcast(void* dst, uint64_t bytes) {
  if (aborted_ || !impl_->joined)
    return Status(ErrorCode::kFailedPrecondition, "group '" + name_ + "' is not joined", "body.source.group");
  if (!can_start_broadcast())
    return Status(ErrorCode::kInternal, "group '" + name_ + "' cannot take another broadcast now", "body.source.group");
  Impl::Bcast b;
  b.done = impl_->events[impl_->next_event];
  b.bytes = bytes;
  b.deadline = deadline_after(timeout_s_);
  cudaSetDevice(device_);
  const ncclResult_t r = nccl().Broadcast(dst, dst, bytes, ncclUint8, root_, impl_->comm, impl_->stream);
  if (r != ncclSuccess && r != ncclInProgress) {
    abort("ncclBroadcast failed");
    return nccl_status(r, "ncclBroadcast");
  }
  impl_->next_event = (impl_->next_event + 1) % kMaxInFlight;
  b.enqueued = r == ncclSuccess;
  if (b.enqueued) {
    if (cudaError_t e = cudaEventRecord(b.done, impl_->stream); e != cudaSuccess) {
      abort("cudaEventRecord failed");
      return cuda_status(e, "cudaEventRecord");
    }
  }
  impl_->in_flight.push_back(b);
  return Status::Ok();
}

Result<bool> NcclGroup::poll_broadcast() {
  if (aborted_) return Status(ErrorCode::kUnavailable, "group '" + name_ + "' was aborted", "body.source");
  if (impl_->in_flight.empty()) return Status(ErrorCode::kInternal, "no broadcast posted", "group");
  cudaSetDevice(device_);
  // The watchdog: a peer failure surfaces here, not as a hang.
  ncclResult_t state = ncclSuccess;
  if (ncclResult_t r = nccl().CommGetAsyncError(impl_->comm, &state); r != ncclSuccess) {
    abort("ncclCommGetAsyncError failed");
    return nccl_status(r, "ncclCommGetAsyncError");
  }
  if (state != ncclSuccess && state != ncclInProgress) {
    abort("asynchronous NCCL error");
    return Status(ErrorCode::kUnavailable,
                  "broadcast in group '" + name_ + "': " + nccl().GetErrorString(state) + " (peer gone?)", "body.source");
  }
  // Only the newest can still be enqueueing (start_broadcast waits for the previous one).
  Impl::Bcast& last = impl_->in_flight.back();
  if (!last.enqueued && state == ncclSuccess) {
    last.enqueued = true;
    if (cudaError_t e = cudaEventRecord(last.done, impl_->stream); e != cudaSuccess) {
      abort("cudaEventRecord failed");
      return cuda_status(e, "cudaEventRecord");
    }
  }
  Impl::Bcast& first = impl_->in_flight.front();
  if (first.enqueued) {
    const cudaError_t q = cudaEventQuery(first.done);
    if (q == cudaSuccess) {
      impl_->in_flight.pop_front();
      return true;
    }
    if (q != cudaErrorNotReady) {
      abort("broadcast completion failed");
      return cuda_status(q, "broadcast completion");
    }
  }
  if (Clock::now() > first.deadline) {
    const uint64_t bytes = first.bytes;
    abort("broadcast deadline");
    return Status(ErrorCode::kDeadlineExceeded,
                  "broadcast of " + std::to_string(bytes) + " bytes in group '" + name_ +
                      "' did not complete in time (trainer gone?)",
                  "body.source");
  }
  return false;
}

void NcclGroup::abort(const std::string& why) {
  if (aborted_) return;
  aborted_ = true;
  obs::log_warn("nccl", "aborting communicator", {{"group", name_}, {"why", why}});
  if (impl_->comm) {
    cudaSetDevice(device_);
    nccl().CommAbort(impl_->comm);
    impl_->comm = nullptr;
  }
  impl_->in_flight.clear();
}

#else  // no NCCL

struct NcclGroup::Impl {};
int NcclGroup::loaded_version() { return 0; }
NcclGroup::NcclGroup(std::string name, int device) : name_(std::move(name)), device_(device) {}
NcclGroup::~NcclGroup() = default;
Result<std::unique_ptr<NcclGroup>> NcclGroup::start_join(const std::string&, const std::string&, int, int, int, int,
                                                         double) {
  return Status(ErrorCode::kUnimplemented, "this daemon was built without CUDA/NCCL", "");
}
bool NcclGroup::broadcast_in_flight() const { return false; }
int NcclGroup::broadcasts_in_flight() const { return 0; }
bool NcclGroup::can_start_broadcast() const { return false; }
Result<bool> NcclGroup::poll_join() { return Status(ErrorCode::kUnimplemented, "no NCCL", "type"); }
Status NcclGroup::start_broadcast(void*, uint64_t) {
  return Status(ErrorCode::kUnimplemented, "no NCCL", "type");
}
Result<bool> NcclGroup::poll_broadcast() { return Status(ErrorCode::kUnimplemented, "no NCCL", "type"); }
void NcclGroup::abort(const std::string&) { aborted_ = true; }

#endif

}  // namespace rolloutd::daemon
