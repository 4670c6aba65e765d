#pragma once
// A "device" backend for tests and benchmarks on machines without a GPU: the CPU backend's
// operations under a CUDA context (Device::cuda(0)), with the device-side calls counted. The
// weight registry then takes its device paths (a bucket in device memory is copied with
// Backend::convert, one call per run of rows), so the number of copies a bucket costs on the GPU
// can be counted, and their results compared, on the CPU. Only what those paths call is wired:
// convert, copy, synchronize and the memory functions; everything else stays the CPU's, which
// refuses a CUDA context.
#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.hpp"

namespace rolloutd::test {

struct EmulatedDeviceCounters {
  std::atomic<uint64_t> converts{0}, copies{0}, synchronizes{0};
  // > 0: that convert call (1-based, counted from reset()) fails with kCudaError, writing nothing.
  std::atomic<uint64_t> fail_convert_at{0};
  void reset() {
    converts = 0;
    copies = 0;
    synchronizes = 0;
    fail_convert_at = 0;
  }
};

inline EmulatedDeviceCounters& emulated_device_counters() {
  static EmulatedDeviceCounters c;
  return c;
}

inline const Backend& emulated_device_backend() {
  static const Backend b = [] {
    Backend e = cpu_backend();
    e.name = "emulated-device";
    e.kind = DeviceKind::kCuda;
    e.alloc = [](const ExecContext&, size_t bytes, void** out) { return cpu_backend().alloc({}, bytes, out); };
    e.free = [](const ExecContext&, void* p) { return cpu_backend().free({}, p); };
    e.copy = [](const ExecContext&, void* dst, const void* src, size_t bytes, CopyKind) {
      ++emulated_device_counters().copies;
      return cpu_backend().copy({}, dst, src, bytes, CopyKind::kHostToHost);
    };
    e.synchronize = [](const ExecContext&) {
      ++emulated_device_counters().synchronizes;
      return Status::Ok();
    };
    e.convert = [](const ExecContext&, void* dst, DType dt, const void* src, DType st, size_t n) {
      auto& c = emulated_device_counters();
      if (++c.converts == c.fail_convert_at) return Status(ErrorCode::kCudaError, "injected device fault");
      return cpu_backend().convert({}, dst, dt, src, st, n);
    };
    return e;
  }();
  return b;
}

inline ExecContext emulated_device_context() {
  ExecContext ctx;
  ctx.device = Device::cuda(0);
  return ctx;
}

// Host memory handed out in order, as an arena does: views of `device` (default: the emulated
// device's memory; Device::cpu() for the host path).
struct EmulatedDeviceMemory {
  std::vector<uint8_t> bytes;
  size_t used = 0;
  Device device = Device::cuda(0);
  explicit EmulatedDeviceMemory(size_t capacity, Device d = Device::cuda(0)) : bytes(capacity), device(d) {}
  // A contiguous view at the next `alignment`-aligned offset (aborts past the capacity).
  TensorView allocate(DType dtype, const Shape& shape, size_t alignment = 256) {
    const auto base = reinterpret_cast<uintptr_t>(bytes.data());
    size_t off = (base + used + alignment - 1) / alignment * alignment - base;
    TensorView v = TensorView::contiguous(bytes.data() + off, dtype, shape, device);
    used = off + v.nbytes();
    if (used > bytes.size()) std::abort();
    return v;
  }
};

}  // namespace rolloutd::test
