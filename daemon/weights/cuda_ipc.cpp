#include "daemon/weights/cuda_ipc.hpp"

#include <thread>

#if defined(ROLLOUTD_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#include <cstring>

#include "daemon/obs/log.hpp"

namespace rolloutd::daemon {

#if defined(ROLLOUTD_WITH_CUDA)

std::string cuda_device_uuid(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  return std::string(reinterpret_cast<const char*>(&prop.uuid), sizeof(prop.uuid));
}

Result<const uint8_t*> CudaIpcImporter::map(const std::string& handle, uint64_t offset, uint64_t size,
                                            const std::string& device_uuid) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return Status(ErrorCode::kInvalidArgument, "handle must be 64 bytes", "body.source.handle");
  // NOTES: device_uuid is the sender's claim, and the only check there is. A handle of another
  // GPU sent with this GPU's UUID opens through peer access, and CUDA does not say where the
  // mapping lives: cudaPointerGetAttributes().device and CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL both
  // report this daemon's device for it (tried on the GPU host: H200, CUDA 13, driver 580), and
  // the open refuses flags without cudaIpcMemLazyEnablePeerAccess. Such a handle still only
  // reads memory its sender exported on purpose.
  if (!uuid_read_) {
    uuid_ = cuda_device_uuid(device_);
    uuid_read_ = !uuid_.empty();
  }
  if (device_uuid != uuid_)
    return Status(ErrorCode::kInvalidArgument,
                  "the handle belongs to another GPU than this daemon's (device_uuid mismatch): send it to the "
                  "daemon colocated with the trainer's device, or use nccl",
                  "body.source.device_uuid");
  cudaSetDevice(device_);
  auto it = open_.find(handle);
  if (it == open_.end()) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof h);
    void* base = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status(ErrorCode::kInvalidArgument, std::string("cudaIpcOpenMemHandle: ") + cudaGetErrorString(e),
                    "body.source.handle");
    }
    // The allocation's real extent bounds every range read through this handle. The driver
    // entry point is looked up through the runtime, so the daemon does not link libcuda and
    // still starts on a machine without a driver.
    using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static GetRange get_range = [] {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return static_cast<GetRange>(nullptr);
      }
      return reinterpret_cast<GetRange>(fn);
    }();
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    if (!get_range || get_range(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
      cudaIpcCloseMemHandle(base);
      return Status(ErrorCode::kInvalidArgument, "cannot read the imported allocation's extent", "body.source.handle");
    }
    const uint64_t extent = range_size - (reinterpret_cast<CUdeviceptr>(base) - range_base);
    it = open_.emplace(handle, Mapping{base, extent}).first;
    ++opened_total_;
  }
  const Mapping& m = it->second;
  if (offset > m.extent || size > m.extent - offset)
    return Status(ErrorCode::kOutOfRange,
                  "range [" + std::to_string(offset) + ", +" + std::to_string(size) +
                      ") lies outside the allocation of " + std::to_string(m.extent) + " bytes",
                  "body.source.offset");
  return static_cast<const uint8_t*>(m.base) + offset;
}

size_t CudaIpcImporter::close_all() {
  const size_t n = open_.size();
  if (n) cudaSetDevice(device_);
  for (auto& [h, m] : open_) {
    if (cudaIpcCloseMemHandle(m.base) != cudaSuccess) {
      (void)cudaGetLastError();
      obs::log_warn("ipc", "cudaIpcCloseMemHandle failed");
    }
  }
  open_.clear();
  return n;
}

DeviceFence& DeviceFence::operator=(DeviceFence&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = o.event_;
    o.event_ = nullptr;
  }
  return *this;
}

DeviceFence::~DeviceFence() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

Result<DeviceFence> DeviceFence::record(void* stream) {
  DeviceFence f;
  cudaEvent_t e = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(ErrorCode::kInternal, std::string("cudaEventCreate: ") + cudaGetErrorString(err));
  }
  f.event_ = e;
  if (cudaError_t err = cudaEventRecord(e, static_cast<cudaStream_t>(stream)); err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(ErrorCode::kInternal, std::string("cudaEventRecord: ") + cudaGetErrorString(err));
  }
  return f;
}

Result<bool> DeviceFence::done() const {
  if (!event_) return true;
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  (void)cudaGetLastError();
  return Status(ErrorCode::kCudaError, std::string("device copy failed: ") + cudaGetErrorString(e));
}

Status DeviceFence::wait(std::chrono::milliseconds timeout) const {
  if (!event_) return Status::Ok();
  // Polled rather than cudaEventSynchronize: a copy that never completes must not hang the
  // caller past its deadline.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto done = this->done();
    if (!done.ok()) return done.status();
    if (*done) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline)
      return Status(ErrorCode::kCudaError, "device copy did not complete within " +
                                               std::to_string(timeout.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

#else

DeviceFence& DeviceFence::operator=(DeviceFence&& o) noexcept {
  event_ = o.event_;
  o.event_ = nullptr;
  return *this;
}
DeviceFence::~DeviceFence() = default;
Result<DeviceFence> DeviceFence::record(void*) {
  return Status(ErrorCode::kUnimplemented, "this daemon was built without CUDA");
}
Result<bool> DeviceFence::done() const { return true; }
Status DeviceFence::wait(std::chrono::milliseconds) const { return Status::Ok(); }

std::string cuda_device_uuid(int) { return {}; }
Result<const uint8_t*> CudaIpcImporter::map(const std::string&, uint64_t, uint64_t, const std::string&) {
  return Status(ErrorCode::kUnimplemented, "this daemon was built without CUDA", "body.source");
}
size_t CudaIpcImporter::close_all() { return 0; }

#endif

}  // namespace rolloutd::daemon
