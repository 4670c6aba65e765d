// The CUDA backend: memory ops, `linear` through cuBLASLt, error plumbing and the op table.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/op_checks.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace rolloutd {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;

const char* base_name(const char* path) {
  const char* name = path;
  for (const char* p = path; *p != '\0'; ++p)
    if (*p == '/') name = p + 1;
  return name;
}

Status cublas_status(cublasStatus_t st, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  return Status(ErrorCode::kCudaError,
                std::string(expr) + " failed: " + cublasGetStatusName(st) + " (" +
                    cublasGetStatusString(st) + ") at " + base_name(file) + ":" +
                    std::to_string(line));
}

#define RD_CUBLAS_CHECK(expr)                                                     \
  do {                                                                            \
    const cublasStatus_t rd_blas_st_ = (expr);                                    \
    if (rd_blas_st_ != CUBLAS_STATUS_SUCCESS)                                     \
      return cublas_status(rd_blas_st_, #expr, __FILE__, __LINE__);              \
  } while (0)

Status check_ctx(const ExecContext& ctx) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  if (ctx.device.index >= kMaxDevices)
    return Status(ErrorCode::kInvalidArgument,
                  "device index " + std::to_string(ctx.device.index) + " above " +
                      std::to_string(kMaxDevices - 1),
                  "ctx.device");
  return Status::Ok();
}

// ---- linear: cuBLASLt plans ----
// NOTES:
// - cuBLAS's own choice for decode shapes (M = 1..256, K = 2880) is mostly a split-K kernel plus
//   a separate splitKreduce launch, and the SIMT sgemm for the FP32 router; at M = 32 the reduce
//   launches alone cost ~114 us of a 2.5 ms step on the H200. So `linear` keeps one cuBLASLt plan
//   per (M, N, K, dtype, pointer alignments): descriptors, the heuristic's candidates and the algo
//   picked by timing them once (eager, inside a CUDA graph, L2 flushed between calls: the way a
//   decode step sees its weights), falling back to the heuristic's first while a stream captures,
//   when tuning fails or ROLLOUTD_LINEAR_TUNE=0.
// - Every algo runs CUBLAS_COMPUTE_32F: FP32 accumulation, FP32 products for FP32 operands (never
//   TF32). A split-K algo sums K in parts and adds the FP32 partials: same precision, another
//   summation order, so results can differ from cublasGemmEx's in the last bits.
// - Memory: one workspace per device, kLtWorkspaceBytes (32 MiB), allocated on the first eager call
//   and never freed; tuning borrows a 2 x L2 flush buffer (~100 MB on an H200) for its duration
//   only. Plans are host-side descriptors (< 1 KiB each), at most kMaxPlans per device; past that,
//   new shapes take cublasGemmEx (which has its own default workspace).
// - The workspace is shared by every stream of the device, as cuBLAS's default workspace is by a
//   handle's streams: two split-K GEMMs must not run on two streams of one device at once. The
//   daemon issues every linear of a device on one stream (graphs replay on the context's stream).
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
constexpr int kNumCandidates = 8;          // heuristic results timed per shape
constexpr int64_t kMaxTunedM = 1024;       // above: heuristic first (tuning cost grows with M)
constexpr size_t kMaxPlans = 1024;         // per device; bounded for prefill's many M values
constexpr int kTuneCalls = 10;             // calls per timed graph
constexpr int kTuneLaunches = 3;           // timed replays per graph, the fastest kept
constexpr float kTuneMargin = 0.98f;       // a later candidate must beat the best by 2%

struct LinearKey {
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t in = CUDA_R_32F;
  uint32_t align_w = 0, align_x = 0, align_y = 0;
  bool operator==(const LinearKey&) const = default;
};

struct LinearKeyHash {
  size_t operator()(const LinearKey& key) const {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t v : {uint64_t(key.m), uint64_t(key.n), uint64_t(key.k), uint64_t(key.in),
                       uint64_t(key.align_w) << 32 | key.align_x, uint64_t(key.align_y)})
      h = (h ^ v) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct LinearPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ready = false;        // algo holds a heuristic result for the workspace size below
  bool settled = false;      // chosen eagerly (tuned, or tuning off or declined): kept for good
  bool unsupported = false;  // cuBLASLt has no algo for it: cublasGemmEx takes it
  size_t workspace_bytes = 0;
};

// One cuBLAS and one cuBLASLt handle per device, created on first use, with the plan cache and
// the workspace. The mutex is held across cublasSetStream + the GEMM (a cublas handle carries its
// stream as state, so two threads sharing it without the lock could launch on each other's
// stream) and across plan lookup, tuning and the cuBLASLt call (the cache and the workspace).
struct BlasSlot {
  std::mutex mu;
  cublasHandle_t handle = nullptr;  // never destroyed: process exit may tear the CUDA
                                    // context down first, and cublasDestroy would then fail
  cublasLtHandle_t lt = nullptr;    // likewise
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool workspace_tried = false;
  cudaStream_t tune_stream = nullptr;
  cudaEvent_t tune_start = nullptr, tune_stop = nullptr;
  std::unordered_map<LinearKey, LinearPlan, LinearKeyHash> plans;
};

BlasSlot& blas_slot(int device) {
  static BlasSlot slots[kMaxDevices];
  return slots[device];
}

Status alloc(const ExecContext& ctx, size_t bytes, void** out) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (out == nullptr) return Status(ErrorCode::kInvalidArgument, "null output pointer", "out");
  *out = nullptr;
  if (bytes == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const cudaError_t err = cudaMalloc(out, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    *out = nullptr;
    return Status(ErrorCode::kResourceExhausted,
                  "device allocation of " + std::to_string(bytes) + " bytes on " +
                      ctx.device.to_string() + " failed",
                  "bytes");
  }
  RD_CUDA_CHECK(err);
  return Status::Ok();
}

Status free_mem(const ExecContext& ctx, void* ptr) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (ptr == nullptr) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaFree(ptr));
  return Status::Ok();
}

Status host_alloc(const ExecContext& ctx, size_t bytes, void** out) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (out == nullptr) return Status(ErrorCode::kInvalidArgument, "null output pointer", "out");
  *out = nullptr;
  if (bytes == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const cudaError_t err = cudaHostAlloc(out, bytes, cudaHostAllocDefault);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    *out = nullptr;
    return Status(ErrorCode::kResourceExhausted, "page-locked host allocation of " + std::to_string(bytes) + " bytes failed",
                  "bytes");
  }
  RD_CUDA_CHECK(err);
  return Status::Ok();
}

Status host_free(const ExecContext& ctx, void* ptr) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (ptr == nullptr) return Status::Ok();
  RD_CUDA_CHECK(cudaFreeHost(ptr));
  return Status::Ok();
}

// Asynchronous on the context's stream: synchronize() before reading host memory.
Status copy(const ExecContext& ctx, void* dst, const void* src, size_t bytes, CopyKind kind) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  cudaMemcpyKind k = cudaMemcpyDefault;
  switch (kind) {
    case CopyKind::kHostToDevice: k = cudaMemcpyHostToDevice; break;
    case CopyKind::kDeviceToHost: k = cudaMemcpyDeviceToHost; break;
    case CopyKind::kDeviceToDevice: k = cudaMemcpyDeviceToDevice; break;
    case CopyKind::kHostToHost: k = cudaMemcpyHostToHost; break;
    default: return Status(ErrorCode::kInvalidArgument, "unknown copy kind", "kind");
  }
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument,
                  "null pointer in a copy of " + std::to_string(bytes) + " bytes",
                  dst == nullptr ? "dst" : "src");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, stream_of(ctx)));
  return Status::Ok();
}

Status copy_2d(const ExecContext& ctx, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
               size_t height, CopyKind kind) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (width == 0 || height == 0) return Status::Ok();
  if (dst_pitch < width || src_pitch < width)
    return Status(ErrorCode::kInvalidArgument, "a pitch is smaller than the row width", "pitch");
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null pointer in a 2D copy", dst == nullptr ? "dst" : "src");
  cudaMemcpyKind k = cudaMemcpyDefault;
  switch (kind) {
    case CopyKind::kHostToDevice: k = cudaMemcpyHostToDevice; break;
    case CopyKind::kDeviceToHost: k = cudaMemcpyDeviceToHost; break;
    case CopyKind::kDeviceToDevice: k = cudaMemcpyDeviceToDevice; break;
    case CopyKind::kHostToHost: k = cudaMemcpyHostToHost; break;
    default: return Status(ErrorCode::kInvalidArgument, "unknown copy kind", "kind");
  }
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, k, stream_of(ctx)));
  return Status::Ok();
}

Status copy_3d(const ExecContext& ctx, void* dst, size_t dst_pitch, size_t dst_slice_pitch, const void* src,
               size_t src_pitch, size_t src_slice_pitch, size_t width, size_t height, size_t depth, CopyKind kind) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::copy_3d_shape(dst_pitch, dst_slice_pitch, src_pitch, src_slice_pitch, width, height));
  if (width == 0 || height == 0 || depth == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null pointer in a 3D copy", dst == nullptr ? "dst" : "src");
  cudaMemcpy3DParms p{};
  p.srcPtr = make_cudaPitchedPtr(const_cast<void*>(src), src_pitch, width, src_slice_pitch / src_pitch);
  p.dstPtr = make_cudaPitchedPtr(dst, dst_pitch, width, dst_slice_pitch / dst_pitch);
  p.extent = make_cudaExtent(width, height, depth);
  switch (kind) {
    case CopyKind::kHostToDevice: p.kind = cudaMemcpyHostToDevice; break;
    case CopyKind::kDeviceToHost: p.kind = cudaMemcpyDeviceToHost; break;
    case CopyKind::kDeviceToDevice: p.kind = cudaMemcpyDeviceToDevice; break;
    case CopyKind::kHostToHost: p.kind = cudaMemcpyHostToHost; break;
    default: return Status(ErrorCode::kInvalidArgument, "unknown copy kind", "kind");
  }
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaMemcpy3DAsync(&p, stream_of(ctx)));
  return Status::Ok();
}

Status synchronize(const ExecContext& ctx) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  return Status::Ok();
}

// ---- CUDA graphs ----
// The body issues its work on a private non-blocking stream in thread-local capture mode:
// capture cannot happen on the legacy default stream the daemon's context may use, and
// thread-local mode keeps other threads' unrelated CUDA calls (a transfer thread's
// allocation) from invalidating it. Replays go to the context's stream.
Status graph_capture(const ExecContext& ctx, Backend::GraphBody body, void* arg, void** graph) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (graph == nullptr || body == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null graph output or body", graph ? "body" : "graph");
  *graph = nullptr;
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  cudaStream_t stream = nullptr;
  RD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamOwner {
    cudaStream_t s;
    ~StreamOwner() { (void)cudaStreamDestroy(s); }
  } owner{stream};
  RD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const ExecContext capture_ctx{ctx.device, stream};
  const Status body_status = body(arg, capture_ctx);
  cudaGraph_t g = nullptr;
  // End the capture whatever the body did: a stream left capturing poisons later calls.
  const cudaError_t end_err = cudaStreamEndCapture(stream, &g);
  struct GraphOwner {
    cudaGraph_t g;
    ~GraphOwner() {
      if (g) (void)cudaGraphDestroy(g);
    }
  } graph_owner{g};
  if (!body_status.ok()) {
    (void)cudaGetLastError();
    return body_status;
  }
  RD_CUDA_CHECK(end_err);
  cudaGraphExec_t exec = nullptr;
  RD_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  // Uploading now moves the one-time setup cost out of the first replay.
  if (cudaError_t err = cudaGraphUpload(exec, stream_of(ctx)); err != cudaSuccess) {
    (void)cudaGraphExecDestroy(exec);
    return error_status(err, "cudaGraphUpload", __FILE__, __LINE__);
  }
  *graph = exec;
  return Status::Ok();
}

Status graph_launch(const ExecContext& ctx, void* graph) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (graph == nullptr) return Status(ErrorCode::kInvalidArgument, "null graph", "graph");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), stream_of(ctx)));
  return Status::Ok();
}

Status graph_destroy(const ExecContext& ctx, void* graph) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (graph == nullptr) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
  return Status::Ok();
}

// ---- virtual memory management ----
// The driver's cuMem* entry points, looked up once through the runtime
// (cudaGetDriverEntryPointByVersion): the library never links libcuda, so it still loads on a
// machine without a driver (CI), where every call below reports kUnavailable.
struct VmApi {
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  std::string missing;  // the first entry point that could not be found
};

const VmApi& vm_api() {
  static const VmApi api = [] {
    VmApi a;
    auto get = [&](const char* name, void** fn, unsigned version) {
      cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(name, fn, version, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || *fn == nullptr) {
        (void)cudaGetLastError();
        *fn = nullptr;
        if (a.missing.empty()) a.missing = name;
      }
    };
    get("cuMemAddressReserve", reinterpret_cast<void**>(&a.reserve), 10020);
    get("cuMemAddressFree", reinterpret_cast<void**>(&a.address_free), 10020);
    get("cuMemCreate", reinterpret_cast<void**>(&a.create), 10020);
    get("cuMemRelease", reinterpret_cast<void**>(&a.release), 10020);
    get("cuMemMap", reinterpret_cast<void**>(&a.map), 10020);
    get("cuMemUnmap", reinterpret_cast<void**>(&a.unmap), 10020);
    get("cuMemSetAccess", reinterpret_cast<void**>(&a.set_access), 10020);
    get("cuMemGetAllocationGranularity", reinterpret_cast<void**>(&a.granularity), 10020);
    get("cuGetErrorName", reinterpret_cast<void**>(&a.error_name), 6000);
    return a;
  }();
  return api;
}

Status driver_status(CUresult r, const char* what, size_t bytes) {
  const char* name = "?";
  if (vm_api().error_name) (void)vm_api().error_name(r, &name);
  const ErrorCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? ErrorCode::kResourceExhausted : ErrorCode::kCudaError;
  return Status(code, std::string(what) + " of " + std::to_string(bytes) + " bytes failed: " + name, "bytes");
}

// Sets the device and makes its primary context current (the driver calls need one).
Status vm_enter(const ExecContext& ctx, DeviceGuard& guard) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (!vm_api().missing.empty())
    return Status(ErrorCode::kUnavailable,
                  "CUDA virtual memory management is not available (driver entry point " + vm_api().missing +
                      " not found)");
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  RD_CUDA_CHECK(cudaFree(nullptr));  // initializes the primary context if nothing did yet
  return Status::Ok();
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

Status vm_granularity(const ExecContext& ctx, size_t* out) {
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(vm_enter(ctx, guard));
  const CUmemAllocationProp prop = device_prop(ctx.device.index);
  size_t g = 0;
  if (CUresult r = vm_api().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM); r != CUDA_SUCCESS)
    return driver_status(r, "cuMemGetAllocationGranularity", 0);
  *out = g;
  return Status::Ok();
}

Status vm_reserve(const ExecContext& ctx, size_t bytes, void** out) {
  *out = nullptr;
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(vm_enter(ctx, guard));
  CUdeviceptr p = 0;
  if (CUresult r = vm_api().reserve(&p, bytes, 0, 0, 0); r != CUDA_SUCCESS)
    return driver_status(r, "cuMemAddressReserve", bytes);
  *out = reinterpret_cast<void*>(p);
  return Status::Ok();
}

Status vm_free(const ExecContext& ctx, void* base, size_t bytes) {
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(vm_enter(ctx, guard));
  if (CUresult r = vm_api().address_free(reinterpret_cast<CUdeviceptr>(base), bytes); r != CUDA_SUCCESS)
    return driver_status(r, "cuMemAddressFree", bytes);
  return Status::Ok();
}

// One physical allocation per call. Its handle is released as soon as it is mapped: the
// mapping keeps the memory alive, and cuMemUnmap then frees it, so nothing else is tracked.
Status vm_map(const ExecContext& ctx, void* addr, size_t bytes) {
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(vm_enter(ctx, guard));
  const VmApi& api = vm_api();
  const CUmemAllocationProp prop = device_prop(ctx.device.index);
  const auto ptr = reinterpret_cast<CUdeviceptr>(addr);
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = api.create(&handle, bytes, &prop, 0); r != CUDA_SUCCESS) return driver_status(r, "cuMemCreate", bytes);
  if (CUresult r = api.map(ptr, bytes, 0, handle, 0); r != CUDA_SUCCESS) {
    (void)api.release(handle);
    return driver_status(r, "cuMemMap", bytes);
  }
  (void)api.release(handle);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = api.set_access(ptr, bytes, &access, 1); r != CUDA_SUCCESS) {
    (void)api.unmap(ptr, bytes);
    return driver_status(r, "cuMemSetAccess", bytes);
  }
  return Status::Ok();
}

Status vm_unmap(const ExecContext& ctx, void* addr, size_t bytes) {
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(vm_enter(ctx, guard));
  // Work queued on any stream may still read the range.
  RD_CUDA_CHECK(cudaDeviceSynchronize());
  if (CUresult r = vm_api().unmap(reinterpret_cast<CUdeviceptr>(addr), bytes); r != CUDA_SUCCESS)
    return driver_status(r, "cuMemUnmap", bytes);
  return Status::Ok();
}

}  // namespace

Status error_status(cudaError_t err, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  return Status(ErrorCode::kCudaError, std::string(expr) + " failed: " + cudaGetErrorName(err) +
                                           " (" + cudaGetErrorString(err) + ") at " +
                                           base_name(file) + ":" + std::to_string(line));
}

Status DeviceGuard::set(int device) {
  int current = 0;
  RD_CUDA_CHECK(cudaGetDevice(&current));
  if (current == device) return Status::Ok();
  RD_CUDA_CHECK(cudaSetDevice(device));
  previous_ = current;
  changed_ = true;
  return Status::Ok();
}

namespace {

// ROLLOUTD_LINEAR_TUNE: "0" takes the heuristic's first algo (no timing: the same choice on every
// run); unset or anything else tunes; "log" also prints each tuned shape's timings to stderr.
enum class TuneMode { kOff, kOn, kLog };

TuneMode linear_tune_mode() {
  static const TuneMode mode = [] {
    const char* v = std::getenv("ROLLOUTD_LINEAR_TUNE");
    if (v == nullptr) return TuneMode::kOn;
    if (std::strcmp(v, "0") == 0) return TuneMode::kOff;
    if (std::strcmp(v, "log") == 0) return TuneMode::kLog;
    return TuneMode::kOn;
  }();
  return mode;
}

// cuBLASLt assumes 256-byte aligned buffers unless told otherwise; views into a larger buffer
// (a row offset) can be less aligned, and an algo relying on more would read wrongly.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t r = 256;
  while (r > 1 && a % r != 0) r >>= 1;
  return r;
}

// A query that fails (another thread capturing in global mode makes the legacy stream's query
// an error) counts as capturing: nothing is timed, allocated or synchronised then.
bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return st != cudaStreamCaptureStatusNone;
}

// The path before cuBLASLt plans, kept for shapes past the plan cache's bound and for any shape
// cuBLASLt's heuristic has no algo for.
// Row-major y[M,N] = x[M,K] * w[N,K]^T is, read column-major, y^T[N,M] = w[N,K] * x^T[K,M]:
// w's buffer is a column-major K x N matrix (so op T), x's a column-major K x M one (op N).
Status linear_gemm_ex(BlasSlot& slot, cudaStream_t stream, const LinearKey& key, void* y,
                      const void* x, const void* w) {
  if (slot.handle == nullptr) {
    cublasHandle_t handle = nullptr;
    RD_CUBLAS_CHECK(cublasCreate(&handle));
    slot.handle = handle;
  }
  RD_CUBLAS_CHECK(cublasSetStream(slot.handle, stream));
  const float alpha = 1.0f, beta = 0.0f;
  const int m = static_cast<int>(key.m), n = static_cast<int>(key.n), k = static_cast<int>(key.k);
  RD_CUBLAS_CHECK(cublasGemmEx(slot.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, key.in, k,
                               x, key.in, k, &beta, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

// The plan's descriptors (made once; the same column-major reading as linear_gemm_ex) and the
// heuristic's candidates for the workspace the slot has now, best first. None: `out` is empty.
// (A plain array: nvcc 13's front end crashes on std::vector of cuBLASLt's result struct.)
Status plan_candidates(BlasSlot& slot, const LinearKey& key, LinearPlan& plan,
                       cublasLtMatmulHeuristicResult_t (&out)[kNumCandidates], int* num_out) {
  *num_out = 0;
  if (plan.op == nullptr) {
    cublasLtMatmulDesc_t op = nullptr;
    RD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    plan.op = op;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    RD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    RD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  }
  const auto rows = [](int64_t v) { return static_cast<uint64_t>(v); };
  if (plan.w == nullptr)
    RD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.w, key.in, rows(key.k), rows(key.n), key.k));
  if (plan.x == nullptr)
    RD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.x, key.in, rows(key.k), rows(key.m), key.k));
  if (plan.y == nullptr)
    RD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.y, CUDA_R_32F, rows(key.n), rows(key.m), key.n));

  cublasLtMatmulPreference_t pref = nullptr;
  RD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefOwner {
    cublasLtMatmulPreference_t p;
    ~PrefOwner() { (void)cublasLtMatmulPreferenceDestroy(p); }
  } pref_owner{pref};
  const uint64_t workspace = slot.workspace_bytes;
  RD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &workspace, sizeof(workspace)));
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const uint32_t align_bytes[4] = {key.align_w, key.align_x, key.align_y, key.align_y};
  for (int i = 0; i < 4; ++i)
    RD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &align_bytes[i],
                                                         sizeof(align_bytes[i])));
  cublasLtMatmulHeuristicResult_t results[kNumCandidates] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      slot.lt, plan.op, plan.w, plan.x, plan.y, plan.y, pref, kNumCandidates, results, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return Status::Ok();  // no algo: cublasGemmEx
  if (st != CUBLAS_STATUS_SUCCESS)
    return cublas_status(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace)
      out[(*num_out)++] = results[i];
  plan.workspace_bytes = slot.workspace_bytes;
  return Status::Ok();
}

std::string algo_brief(const cublasLtMatmulAlgo_t& algo) {
  int32_t id = -1, splitk = -1;
  uint32_t tile = 0, reduction = 0;
  size_t written = 0;
  (void)cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  (void)cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  (void)cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &written);
  (void)cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                             sizeof(reduction), &written);
  return "\"id" + std::to_string(id) + " tile" + std::to_string(tile) + " splitk" +
         std::to_string(splitk) + " red" + std::to_string(reduction) + "\"";
}

// Times each candidate as a graph of kTuneCalls calls, each behind an L2 flush (a decode step
// reads its weights from HBM: other layers evict them), less a graph of the flushes alone;
// returns the index of the fastest, ties (within kTuneMargin) to the heuristic's order, or 0
// when anything fails. Runs on a private stream after synchronising the caller's, so y (written
// by every timed call) is no longer read by earlier work; the real call follows on the caller's.
int tune_candidates(BlasSlot& slot, int device, const LinearPlan& plan, const LinearKey& key,
                    const cublasLtMatmulHeuristicResult_t* cands, int num_cands, const void* w,
                    const void* x, void* y, cudaStream_t caller) {
  bool ok = cudaStreamSynchronize(caller) == cudaSuccess;
  if (ok && slot.tune_stream == nullptr)
    ok = cudaStreamCreateWithFlags(&slot.tune_stream, cudaStreamNonBlocking) == cudaSuccess;
  if (ok && slot.tune_start == nullptr) ok = cudaEventCreate(&slot.tune_start) == cudaSuccess;
  if (ok && slot.tune_stop == nullptr) ok = cudaEventCreate(&slot.tune_stop) == cudaSuccess;
  int l2 = 0;
  if (ok) ok = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess;
  size_t flush_bytes = 2 * static_cast<size_t>(l2 > 0 ? l2 : (64 << 20));
  void* flush = nullptr;
  if (ok && cudaMalloc(&flush, flush_bytes) != cudaSuccess) {
    // A device too full for the flush buffer still gets a choice, timed with L2 warm.
    (void)cudaGetLastError();
    flush = nullptr;
    flush_bytes = 0;
  }
  const cudaStream_t s = slot.tune_stream;
  const float alpha = 1.0f, beta = 0.0f;
  // Milliseconds per replay (the fastest of kTuneLaunches after one warm-up), < 0 on failure.
  auto time_graph = [&](const cublasLtMatmulAlgo_t* algo) -> float {
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0f;
    bool good = true;
    for (int i = 0; i < kTuneCalls && good; ++i) {
      if (flush != nullptr) good = cudaMemsetAsync(flush, i & 0xff, flush_bytes, s) == cudaSuccess;
      if (good && algo != nullptr)
        good = cublasLtMatmul(slot.lt, plan.op, &alpha, w, plan.w, x, plan.x, &beta, y, plan.y, y,
                              plan.y, algo, slot.workspace, plan.workspace_bytes,
                              s) == CUBLAS_STATUS_SUCCESS;
    }
    cudaGraph_t g = nullptr;
    good = cudaStreamEndCapture(s, &g) == cudaSuccess && good && g != nullptr;
    cudaGraphExec_t exec = nullptr;
    good = good && cudaGraphInstantiate(&exec, g, 0) == cudaSuccess;
    float best = -1.0f;
    for (int i = 0; good && i <= kTuneLaunches; ++i) {
      float ms = 0.0f;
      good = cudaEventRecord(slot.tune_start, s) == cudaSuccess &&
             cudaGraphLaunch(exec, s) == cudaSuccess &&
             cudaEventRecord(slot.tune_stop, s) == cudaSuccess &&
             cudaEventSynchronize(slot.tune_stop) == cudaSuccess &&
             cudaEventElapsedTime(&ms, slot.tune_start, slot.tune_stop) == cudaSuccess;
      if (good && i > 0 && (best < 0.0f || ms < best)) best = ms;
    }
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (g != nullptr) (void)cudaGraphDestroy(g);
    return good ? best : -1.0f;
  };
  int pick = 0;
  std::vector<float> per_call_us(static_cast<size_t>(num_cands), -1.0f);
  if (ok) {
    const float base_ms = flush != nullptr ? time_graph(nullptr) : 0.0f;
    float best_us = -1.0f;
    for (int i = 0; base_ms >= 0.0f && i < num_cands; ++i) {
      const float ms = time_graph(&cands[i].algo);
      if (ms < 0.0f) continue;  // this algo failed to capture or run: the others still count
      const float us = (ms - base_ms) * 1000.0f / kTuneCalls;
      per_call_us[static_cast<size_t>(i)] = us;
      if (best_us < 0.0f || us < best_us * kTuneMargin) {
        pick = i;
        best_us = us;
      }
    }
  }
  if (flush != nullptr) (void)cudaFree(flush);
  (void)cudaGetLastError();
  if (linear_tune_mode() == TuneMode::kLog) {
    std::string line = "{\"subsys\":\"cuda.linear\",\"gpu\":" + std::to_string(device) +
                       ",\"msg\":\"linear tuned\",\"m\":" + std::to_string(key.m) +
                       ",\"n\":" + std::to_string(key.n) + ",\"k\":" + std::to_string(key.k) +
                       ",\"dtype\":\"" + (key.in == CUDA_R_16BF ? "bf16" : "f32") +
                       "\",\"pick\":" + std::to_string(pick) + ",\"candidates\":[";
    for (int i = 0; i < num_cands; ++i) {
      line += (i ? "," : "") + std::string("{\"algo\":") + algo_brief(cands[i].algo) +
              ",\"duration_us\":" + std::to_string(per_call_us[static_cast<size_t>(i)]) + "}";
    }
    line += "]}\n";
    std::fputs(line.c_str(), stderr);
  }
  return pick;
}

}  // namespace

Status linear(const ExecContext& ctx, TensorView y, TensorView x, TensorView w) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::linear(ctx, y, x, w));
  const int64_t n = w.size(0), k = w.size(1), m = x.numel() / k;
  if (m == 0) return Status::Ok();
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "linear dimensions above INT_MAX for cuBLAS", "x");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  BlasSlot& slot = blas_slot(ctx.device.index);
  std::lock_guard<std::mutex> lock(slot.mu);
  const cudaStream_t stream = stream_of(ctx);
  // FP32 x FP32 or BF16 x BF16, FP32 out. CUBLAS_COMPUTE_32F: FP32 accumulation, and for FP32
  // operands true FP32 products, never TF32 (that needs _FAST_TF32).
  const cudaDataType_t in = w.dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  const LinearKey key{m, n, k, in, alignment_of(w.data), alignment_of(x.data),
                      alignment_of(y.data)};
  const bool capturing = stream_capturing(stream);
  if (slot.lt == nullptr) {
    // Handle creation may allocate, which a capture forbids: a first call while capturing takes
    // cublasGemmEx, as before. (The engine's eager warm-up makes every shape's first call.)
    if (capturing) return linear_gemm_ex(slot, stream, key, y.data, x.data, w.data);
    cublasLtHandle_t lt = nullptr;
    RD_CUBLAS_CHECK(cublasLtCreate(&lt));
    slot.lt = lt;
  }
  if (!capturing && !slot.workspace_tried) {
    // Once: a device too full for 32 MiB keeps to algos that need no workspace.
    slot.workspace_tried = true;
    if (cudaMalloc(&slot.workspace, kLtWorkspaceBytes) == cudaSuccess) {
      slot.workspace_bytes = kLtWorkspaceBytes;
    } else {
      (void)cudaGetLastError();
      slot.workspace = nullptr;
    }
  }
  auto it = slot.plans.find(key);
  if (it == slot.plans.end()) {
    if (slot.plans.size() >= kMaxPlans)
      return linear_gemm_ex(slot, stream, key, y.data, x.data, w.data);
    it = slot.plans.emplace(key, LinearPlan{}).first;
  }
  LinearPlan& plan = it->second;
  if (plan.unsupported) return linear_gemm_ex(slot, stream, key, y.data, x.data, w.data);
  // A plan made while capturing (a shape no eager call has seen: heuristic first) is redone by the
  // next eager call; the engine's eager warm-up steps settle every shape before it captures.
  if (!plan.ready || (!plan.settled && !capturing)) {
    cublasLtMatmulHeuristicResult_t cands[kNumCandidates] = {};
    int num_cands = 0;
    RD_RETURN_IF_ERROR(plan_candidates(slot, key, plan, cands, &num_cands));
    if (num_cands == 0) {
      plan.unsupported = true;
      return linear_gemm_ex(slot, stream, key, y.data, x.data, w.data);
    }
    int pick = 0;
    if (!capturing && linear_tune_mode() != TuneMode::kOff && m <= kMaxTunedM && num_cands > 1)
      pick = tune_candidates(slot, ctx.device.index, plan, key, cands, num_cands, w.data, x.data,
                             y.data, stream);
    plan.algo = cands[pick].algo;
    plan.ready = true;
    plan.settled = !capturing;
  }
  const float alpha = 1.0f, beta = 0.0f;
  RD_CUBLAS_CHECK(cublasLtMatmul(slot.lt, plan.op, &alpha, w.data, plan.w, x.data, plan.x, &beta,
                                 y.data, plan.y, y.data, plan.y, &plan.algo, slot.workspace,
                                 plan.workspace_bytes, stream));
  return Status::Ok();
}

}  // namespace cuda

const Backend* cuda_backend() {
  static const Backend kCudaBackend{
      "cuda",
      DeviceKind::kCuda,
      cuda::alloc,
      cuda::free_mem,
      cuda::copy,
      cuda::synchronize,
      cuda::embedding,
      cuda::rmsnorm,
      cuda::linear,
      cuda::add,
      cuda::rope,
      cuda::kv_store,
      cuda::paged_attention,
      cuda::router_softmax_topk,
      cuda::moe_experts,
      cuda::sample,
      cuda::convert,
      cuda::copy_2d,
      cuda::copy_3d,
      cuda::host_alloc,
      cuda::host_free,
      cuda::copy_valid_rows,
      cuda::graph_capture,
      cuda::graph_launch,
      cuda::graph_destroy,
      cuda::paged_attention_ex,
      cuda::rope_table,
      cuda::add_bias,
      cuda::transpose,
      cuda::vm_granularity,
      cuda::vm_reserve,
      cuda::vm_free,
      cuda::vm_map,
      cuda::vm_unmap,
  };
  return &kCudaBackend;
}

int cuda_device_count() {
  int count = 0;
  // No driver or no device (the CI machine) is an answer, not a failure: zero.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace rolloutd
