// The CUDA backend: memory ops, `linear` through cuBLAS, error plumbing and the op table.
#include <cublas_v2.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <climits>
#include <mutex>
#include <string>

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

// One cuBLAS handle per device, created on first use. The mutex is held across
// cublasSetStream + the GEMM: a handle carries its stream as state, so two threads
// sharing it without the lock could launch on each other's stream.
struct BlasSlot {
  std::mutex mu;
  cublasHandle_t handle = nullptr;  // never destroyed: process exit may tear the CUDA
                                    // context down first, and cublasDestroy would then fail
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

// Row-major y[M,N] = x[M,K] * w[N,K]^T is, read column-major, y^T[N,M] = w[N,K] * x^T[K,M]:
// w's buffer is a column-major K x N matrix (so op T), x's a column-major K x M one (op N).
Status linear(const ExecContext& ctx, TensorView y, TensorView x, TensorView w) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::linear(ctx, y, x, w));
  const int64_t n = w.size(0), k = w.size(1), m = x.numel() / k;
  if (m == 0) return Status::Ok();
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "linear dimensions above INT_MAX for cuBLAS", "x");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  if (linear_decode_applies(y, x, w)) return linear_decode(ctx, y, x, w);
  BlasSlot& slot = blas_slot(ctx.device.index);
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.handle == nullptr) {
    cublasHandle_t handle = nullptr;
    RD_CUBLAS_CHECK(cublasCreate(&handle));
    slot.handle = handle;
  }
  RD_CUBLAS_CHECK(cublasSetStream(slot.handle, stream_of(ctx)));
  const float alpha = 1.0f, beta = 0.0f;
  // FP32 x FP32 or BF16 x BF16, FP32 out. CUBLAS_COMPUTE_32F: FP32 accumulation, and for FP32
  // operands true FP32 products, never TF32 (that needs _FAST_TF32).
  const cudaDataType_t in = w.dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  RD_CUBLAS_CHECK(cublasGemmEx(slot.handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                               static_cast<int>(m), static_cast<int>(k), &alpha, w.data,
                               in, static_cast<int>(k), x.data, in,
                               static_cast<int>(k), &beta, y.data, CUDA_R_32F,
                               static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
      cuda::add_rmsnorm,
      cuda::rope_qk,
      cuda::router,
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
