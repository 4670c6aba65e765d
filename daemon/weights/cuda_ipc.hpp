#pragma once
// CUDA IPC buckets from a trainer on the same GPU (SPEC §12): the trainer sends a
// cudaIpcMemHandle_t of the allocation holding its bucket, an offset and a size. The
// daemon opens each allocation once per session (cached by handle), checks the range
// against the allocation's real extent and the handle's device against its own, queues the
// copies, replies once they completed on the device (DeviceFence), and closes every handle
// when the session ends -- so no mapping outlives a session and the producer may free its
// buffer after the reply.
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "kernels/status.hpp"

namespace rolloutd::daemon {

// 16-byte UUID of CUDA device `device` ("" when unavailable).
std::string cuda_device_uuid(int device);

class CudaIpcImporter {
 public:
  explicit CudaIpcImporter(int device) : device_(device) {}
  ~CudaIpcImporter() { close_all(); }
  CudaIpcImporter(const CudaIpcImporter&) = delete;
  CudaIpcImporter& operator=(const CudaIpcImporter&) = delete;

  // Device pointer to [offset, offset + size) of the allocation behind `handle`.
  Result<const uint8_t*> map(const std::string& handle, uint64_t offset, uint64_t size,
                             const std::string& device_uuid);
  // Closes every handle opened so far (session end or abort). Returns how many.
  size_t close_all();
  size_t num_open() const { return open_.size(); }
  uint64_t num_opened_total() const { return opened_total_; }

 private:
  struct Mapping {
    void* base = nullptr;
    uint64_t extent = 0;
  };
  int device_;
  // NOTES: cudaGetDeviceProperties costs tens of microseconds per call on CUDA 12/13 (it reads
  // every attribute); it was paid on every bucket. The device's UUID cannot change: read once.
  std::string uuid_;
  bool uuid_read_ = false;
  std::map<std::string, Mapping> open_;
  uint64_t opened_total_ = 0;
};

// Completion of device work queued on a stream (a cudaEvent recorded after it): lets the engine
// loop acknowledge a CUDA IPC bucket when its copies are done instead of blocking in a
// synchronize, so the next bucket's copies are queued while the previous one is still running.
class DeviceFence {
 public:
  DeviceFence() = default;
  DeviceFence(DeviceFence&& o) noexcept : event_(o.event_) { o.event_ = nullptr; }
  DeviceFence& operator=(DeviceFence&& o) noexcept;
  DeviceFence(const DeviceFence&) = delete;
  DeviceFence& operator=(const DeviceFence&) = delete;
  ~DeviceFence();
  // Records the fence after everything queued so far on `stream` (a cudaStream_t).
  static Result<DeviceFence> record(void* stream);
  // true: the work is done; false: still running; an error: the device work failed.
  Result<bool> done() const;
  // Waits until done, at most `timeout` (kCudaError past it, as for a device fault).
  Status wait(std::chrono::milliseconds timeout) const;

 private:
  void* event_ = nullptr;
};

}  // namespace rolloutd::daemon
