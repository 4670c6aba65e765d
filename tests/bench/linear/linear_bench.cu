// Backend::linear (kernels/cuda/cuda_backend.cu) against a direct cublasGemmEx call, at the
// decode projections of the hidden-2880 model (engine_bench --models h2880), and the HBM floor from
// a device-to-device copy measured in the same run. Backend::linear is that cublasGemmEx call
// except at 1-4 rows of BF16 with up to 8,192 outputs, where it runs its own GEMV
// (kernels/cuda/linear_decode.cu; ROLLOUTD_DENSE_DECODE=0 sends those to cuBLAS too, and "old" and
// "new" then agree); the bench is the harness for a change to `linear`. At commit
// 27cc2da `linear` ran cuBLASLt plans with timed algo choice (ROLLOUTD_LINEAR_TUNE=0 there: the
// heuristic's first); result-h200-2026-12-01-lt-*.json hold that run (their floor fields divide by
// the copy's payload rate, twice the floor below), tests/bench/NOTES.md what came of it.
//
//   linear_bench [OUT.json] [--quick]
//
// Each (shape, dtype, M) is timed the way the engine runs it: a CUDA graph of kCallsPerGraph
// back-to-back calls (Backend::graph_capture, replayed on the legacy stream), so launch gaps
// count; the calls cycle through enough copies of the weight to exceed the L2 several times, so
// each reads its weight from HBM as a decode step does (the router's 0.4-0.7 MB weight cannot:
// 50 copies still fit in L2). The new path is called once eagerly first, timed ("1st ms": plan
// set-up or tuning shows there), as the engine's warm-up steps do. The two outputs are compared:
// both accumulate in FP32, only the summation order may differ (split-K). The floor reads the
// weight once at the copy's read + write rate (twice its payload rate): a GEMM only reads it.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "tests/bench/bench_checks.hpp"

namespace {

using namespace rolloutd;

#define CHECK_BLAS(expr)                                                                  \
  do {                                                                                    \
    const cublasStatus_t b_ = (expr);                                                     \
    if (b_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cublasGetStatusName(b_),    \
                   __FILE__, __LINE__);                                                   \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kCallsPerGraph = 50;
constexpr int kWarmLaunches = 2;
constexpr int kTimedLaunches = 10;
constexpr int kNumLayers = 8;  // engine_bench --models h2880

// Uniform values in [-scale, scale] from a hash of the index.
__global__ void fill_kernel(void* out, bool bf16, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ seed ^
                 static_cast<uint32_t>(i >> 32) * 0x85ebca6bu;
    h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12, h *= 0x297a2d39u, h ^= h >> 15;
    const float v = scale * (static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
    if (bf16)
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(v);
    else
      static_cast<float*>(out)[i] = v;
  }
}

void fill(void* p, bool bf16, int64_t n, uint32_t seed, float scale) {
  fill_kernel<<<1024, 256>>>(p, bf16, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

struct ProjShape {
  const char* name;
  int64_t n, k;
  bool f32;  // also timed with FP32 operands
};

// The hidden-2880 model's dense GEMMs (64 query / 8 KV heads of 64, 32 experts, vocab 16,384;
// gpt-oss's vocabulary of 201,088 for the LM head as well).
const ProjShape kShapes[] = {
    {"q_proj", 4096, 2880, true},   {"kv_proj", 512, 2880, true},
    {"o_proj", 2880, 4096, true},   {"router", 32, 2880, true},
    {"lm_head", 16384, 2880, true}, {"lm_head_201k", 201088, 2880, false},
};

struct GraphArgs {
  const Backend* backend;
  cublasHandle_t handle;
  bool old_path;
  bool bf16;
  int64_t m, n, k;
  std::vector<void*> weights;  // copies, cycled
  void* x;
  float* y;
};

cudaDataType_t data_type(bool bf16) { return bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// The call kernels/cuda/cuda_backend.cu makes: the reference a change to `linear` is timed against.
cublasStatus_t gemm_ex(cublasHandle_t h, cudaStream_t s, const GraphArgs& a, const void* w) {
  cublasStatus_t st = cublasSetStream(h, s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float alpha = 1.0f, beta = 0.0f;
  const int m = static_cast<int>(a.m), n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, data_type(a.bf16), k, a.x,
                      data_type(a.bf16), k, &beta, a.y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

Status new_call(const GraphArgs& a, const ExecContext& ctx, void* w) {
  const DType dt = a.bf16 ? DType::kBF16 : DType::kF32;
  const Device dev = ctx.device;
  return a.backend->linear(ctx, TensorView::contiguous(a.y, DType::kF32, Shape{a.m, a.n}, dev),
                           TensorView::contiguous(a.x, dt, Shape{a.m, a.k}, dev),
                           TensorView::contiguous(w, dt, Shape{a.n, a.k}, dev));
}

Status graph_body(void* arg, const ExecContext& ctx) {
  const GraphArgs& a = *static_cast<const GraphArgs*>(arg);
  for (int i = 0; i < kCallsPerGraph; ++i) {
    void* w = a.weights[static_cast<size_t>(i) % a.weights.size()];
    if (a.old_path) {
      if (gemm_ex(a.handle, static_cast<cudaStream_t>(ctx.stream), a, w) != CUBLAS_STATUS_SUCCESS)
        return Status(ErrorCode::kCudaError, "cublasGemmEx failed while capturing");
    } else {
      RD_RETURN_IF_ERROR(new_call(a, ctx, w));
    }
  }
  return Status::Ok();
}

// Microseconds per call: the median over kTimedLaunches replays of the graph; NaN when the
// capture fails (reported, the other rows still run).
double time_graph(const Backend& b, const ExecContext& ctx, GraphArgs& args) {
  void* graph = nullptr;
  if (const Status st = b.graph_capture(ctx, graph_body, &args, &graph); !st.ok()) {
    std::fprintf(stderr, "capture failed (%s, M=%lld N=%lld): %s\n",
                 args.old_path ? "old" : "new", static_cast<long long>(args.m),
                 static_cast<long long>(args.n), st.to_string().c_str());
    return std::nan("");
  }
  for (int i = 0; i < kWarmLaunches; ++i) CHECK_OK(b.graph_launch(ctx, graph));
  cudaEvent_t ev[kTimedLaunches + 1];
  for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  CHECK_CUDA(cudaEventRecord(ev[0], nullptr));
  for (int i = 0; i < kTimedLaunches; ++i) {
    CHECK_OK(b.graph_launch(ctx, graph));
    CHECK_CUDA(cudaEventRecord(ev[i + 1], nullptr));
  }
  CHECK_CUDA(cudaEventSynchronize(ev[kTimedLaunches]));
  std::vector<double> us;
  for (int i = 0; i < kTimedLaunches; ++i) {
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    us.push_back(ms * 1000.0 / kCallsPerGraph);
  }
  for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  CHECK_OK(b.graph_destroy(ctx, graph));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Payload bytes per second of a device-to-device copy of `bytes` (median of 10).
double copy_bandwidth(size_t bytes) {
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  CHECK_CUDA(cudaMemset(src, 1, bytes));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> bw;
  for (int i = 0; i < 12; ++i) {
    CHECK_CUDA(cudaEventRecord(a, nullptr));
    CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
    CHECK_CUDA(cudaEventRecord(b, nullptr));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2) bw.push_back(static_cast<double>(bytes) / (ms * 1e-3));
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  std::sort(bw.begin(), bw.end());
  return bw[bw.size() / 2];
}

// A shape whose first call is captured, replayed, then called eagerly, both outputs against
// cublasGemmEx's; returns the larger relative difference, NaN when the capture failed. Run after
// other calls (at 27cc2da: the plan made while capturing, heuristic first, then redone and tuned by
// the eager call). (As the process's very first linear, the capture fails, as it did before cuBLASLt
// plans: creating a cuBLAS handle inside a capture gives CUBLAS_STATUS_NOT_INITIALIZED; the
// engine's eager warm-up steps come first.)
double capture_first_check(const Backend& b, const ExecContext& ctx, cublasHandle_t handle,
                           int64_t n) {
  GraphArgs a{&b, handle, false, true, 5, n, 2880, {}, nullptr, nullptr};
  void *w = nullptr, *x = nullptr;
  float *y = nullptr, *y_ref = nullptr;
  CHECK_CUDA(cudaMalloc(&w, n * 2880 * 2));
  CHECK_CUDA(cudaMalloc(&x, 5 * 2880 * 2));
  CHECK_CUDA(cudaMalloc(&y, 5 * n * 4));
  CHECK_CUDA(cudaMalloc(&y_ref, 5 * n * 4));
  fill(w, true, n * 2880, 3u, 0.02f);
  fill(x, true, 5 * 2880, 4u, 1.0f);
  a.weights.push_back(w);
  a.x = x;
  a.y = y_ref;
  CHECK_BLAS(gemm_ex(handle, nullptr, a, w));
  std::vector<float> ref(static_cast<size_t>(5 * n)), got(ref.size());
  CHECK_CUDA(cudaMemcpy(ref.data(), y_ref, ref.size() * 4, cudaMemcpyDeviceToHost));
  auto rel_diff = [&]() {
    CHECK_CUDA(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost));
    double max_abs = 0.0, max_diff = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(ref[i])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(ref[i]) - got[i]));
    }
    return max_diff / max_abs;
  };
  a.y = y;
  struct One {
    static Status body(void* arg, const ExecContext& c) {
      const GraphArgs& g = *static_cast<const GraphArgs*>(arg);
      return new_call(g, c, g.weights[0]);
    }
  };
  void* graph = nullptr;
  CHECK_CUDA(cudaMemset(y, 0, 5 * n * 4));
  double captured = std::nan("");
  if (const Status st = b.graph_capture(ctx, One::body, &a, &graph); !st.ok()) {
    std::printf("capture-first check (N=%lld): capture failed: %s\n", static_cast<long long>(n),
                st.to_string().c_str());
  } else {
    CHECK_OK(b.graph_launch(ctx, graph));
    CHECK_CUDA(cudaDeviceSynchronize());
    captured = rel_diff();
    CHECK_OK(b.graph_destroy(ctx, graph));
  }
  CHECK_CUDA(cudaMemset(y, 0, 5 * n * 4));
  CHECK_OK(new_call(a, ctx, w));
  CHECK_CUDA(cudaDeviceSynchronize());
  const double eager = rel_diff();
  for (void* p : {w, x, static_cast<void*>(y), static_cast<void*>(y_ref)}) CHECK_CUDA(cudaFree(p));
  std::printf("capture-first check (M=5 N=%lld K=2880 bf16): captured %.2e, eager %.2e\n",
              static_cast<long long>(n), captured, eager);
  return std::isnan(captured) ? captured : std::max(captured, eager);
}

// A JSON number, or null for NaN (a failed capture).
std::string jnum(double v, const char* fmt) {
  if (std::isnan(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

struct Row {
  std::string shape, dtype;
  int64_t m, n, k, weight_bytes, copies;
  double old_us, new_us, floor_w_us, floor_all_us, max_rel_diff, first_call_ms;
};

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else
      json_path = argv[i];
  }
  const Backend* backend = cuda_backend();
  if (backend == nullptr || cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const ExecContext ctx{Device::cuda(0), nullptr};
  CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const size_t l2 = static_cast<size_t>(prop.l2CacheSize);
  const double copy_bps = copy_bandwidth(size_t{1} << 30);
  const double read_bps = 2.0 * copy_bps;  // a copy reads and writes its payload
  const char* tune_env = std::getenv("ROLLOUTD_LINEAR_TUNE");  // read by 27cc2da's linear
  std::printf("device %s, L2 %.1f MiB, D2D copy %.0f GB/s payload, ROLLOUTD_LINEAR_TUNE=%s\n",
              prop.name, l2 / 1048576.0, copy_bps / 1e9, tune_env ? tune_env : "(unset)");
  std::printf("%-13s %-4s %4s %7s %5s | %9s %9s %7s | %9s %8s %8s | %9s %8s\n", "shape", "type",
              "M", "N", "K", "old us", "new us", "old/new", "floor us", "old/fl", "new/fl",
              "rel diff", "1st ms");

  cublasHandle_t handle = nullptr;
  CHECK_BLAS(cublasCreate(&handle));
  std::vector<Row> rows;
  const std::vector<int64_t> ms = quick ? std::vector<int64_t>{1, 32} : std::vector<int64_t>{1, 8, 32, 256};
  for (const ProjShape& shape : kShapes) {
    if (quick && shape.n > 16384) continue;
    for (const bool bf16 : {true, false}) {
      if (!bf16 && !shape.f32) continue;
      const int64_t elt = bf16 ? 2 : 4;
      const int64_t weight_bytes = shape.n * shape.k * elt;
      const int64_t stride = (weight_bytes + 255) / 256 * 256;
      const int64_t copies = std::clamp<int64_t>(
          (static_cast<int64_t>(4 * l2) + weight_bytes - 1) / weight_bytes, 1, kCallsPerGraph);
      char* wbuf = nullptr;
      CHECK_CUDA(cudaMalloc(&wbuf, static_cast<size_t>(stride * copies)));
      GraphArgs args{backend, handle, false, bf16, 0, shape.n, shape.k, {}, nullptr, nullptr};
      for (int64_t c = 0; c < copies; ++c) {
        void* w = wbuf + c * stride;
        fill(w, bf16, shape.n * shape.k, 17u + static_cast<uint32_t>(c),
             1.0f / std::sqrt(static_cast<float>(shape.k)));
        args.weights.push_back(w);
      }
      for (const int64_t m : ms) {
        args.m = m;
        void* x = nullptr;
        float *y_old = nullptr, *y_new = nullptr;
        CHECK_CUDA(cudaMalloc(&x, static_cast<size_t>(m * shape.k * elt)));
        CHECK_CUDA(cudaMalloc(&y_old, static_cast<size_t>(m * shape.n * 4)));
        CHECK_CUDA(cudaMalloc(&y_new, static_cast<size_t>(m * shape.n * 4)));
        fill(x, bf16, m * shape.k, 5u, 1.0f);
        args.x = x;
        // Eager: the new path's first call (any set-up of its own); then both outputs for the check.
        args.y = y_new;
        CHECK_CUDA(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        CHECK_OK(new_call(args, ctx, args.weights[0]));
        CHECK_CUDA(cudaDeviceSynchronize());
        const double first_call_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        args.y = y_old;
        CHECK_BLAS(gemm_ex(handle, nullptr, args, args.weights[0]));
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<float> h_old(static_cast<size_t>(m * shape.n)), h_new(h_old.size());
        CHECK_CUDA(cudaMemcpy(h_old.data(), y_old, h_old.size() * 4, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(h_new.data(), y_new, h_new.size() * 4, cudaMemcpyDeviceToHost));
        double max_abs = 0.0, max_diff = 0.0;
        for (size_t i = 0; i < h_old.size(); ++i) {
          max_abs = std::max(max_abs, std::fabs(static_cast<double>(h_old[i])));
          max_diff = std::max(max_diff, std::fabs(static_cast<double>(h_old[i]) - h_new[i]));
        }
        args.old_path = true;
        args.y = y_old;
        const double old_us = time_graph(*backend, ctx, args);
        args.old_path = false;
        args.y = y_new;
        const double new_us = time_graph(*backend, ctx, args);
        const int64_t io_bytes = m * shape.k * elt + m * shape.n * 4;
        Row r{shape.name, bf16 ? "bf16" : "f32", m, shape.n, shape.k, weight_bytes, copies, old_us,
              new_us, weight_bytes / read_bps * 1e6, (weight_bytes + io_bytes) / read_bps * 1e6,
              max_abs > 0 ? max_diff / max_abs : max_diff, first_call_ms};
        std::printf("%-13s %-4s %4lld %7lld %5lld | %9.2f %9.2f %7.2f | %9.2f %8.2f %8.2f | %9.2e %8.2f\n",
                    r.shape.c_str(), r.dtype.c_str(), static_cast<long long>(m),
                    static_cast<long long>(shape.n), static_cast<long long>(shape.k), old_us,
                    new_us, old_us / new_us, r.floor_w_us, old_us / r.floor_w_us,
                    new_us / r.floor_w_us, r.max_rel_diff, first_call_ms);
        std::fflush(stdout);
        rows.push_back(r);
        CHECK_CUDA(cudaFree(x));
        CHECK_CUDA(cudaFree(y_old));
        CHECK_CUDA(cudaFree(y_new));
      }
      CHECK_CUDA(cudaFree(wbuf));
    }
  }

  const double capture_first_diff = capture_first_check(*backend, ctx, handle, 80);

  // A decode step's dense GEMMs (attention projections and router per layer, then the head), as
  // engine_bench --models h2880 --dense-bf16 1 runs them: BF16 projections, FP32 router.
  auto find = [&](const char* shape, const char* dtype, int64_t m) -> const Row* {
    for (const Row& r : rows)
      if (r.shape == shape && r.dtype == dtype && r.m == m) return &r;
    return nullptr;
  };
  std::string step_json;
  std::printf("\nper decode step (%d x (q + 2 kv + o + router f32) + lm_head 16384), us:\n",
              kNumLayers);
  for (const int64_t m : ms) {
    const Row* parts[] = {find("q_proj", "bf16", m), find("kv_proj", "bf16", m),
                          find("kv_proj", "bf16", m), find("o_proj", "bf16", m),
                          find("router", "f32", m)};
    const Row* head = find("lm_head", "bf16", m);
    if (head == nullptr) continue;
    double old_us = head->old_us, new_us = head->new_us, floor_us = head->floor_w_us;
    for (const Row* p : parts) {
      if (p == nullptr) continue;
      old_us += kNumLayers * p->old_us;
      new_us += kNumLayers * p->new_us;
      floor_us += kNumLayers * p->floor_w_us;
    }
    std::printf("  M=%-4lld old %8.1f  new %8.1f  floor %8.1f  saved %7.1f\n",
                static_cast<long long>(m), old_us, new_us, floor_us, old_us - new_us);
    step_json += std::string(step_json.empty() ? "" : ",") + "{\"m\":" + std::to_string(m) +
                 ",\"old_us\":" + jnum(old_us, "%.2f") + ",\"new_us\":" + jnum(new_us, "%.2f") +
                 ",\"floor_w_us\":" + jnum(floor_us, "%.2f") + "}";
  }

  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path);
      return 1;
    }
    std::fprintf(f,
                 "{\"bench\":\"linear\",\"device\":\"%s\",\"l2_bytes\":%zu,\"copy_payload_gbps\":%.1f,"
                 "\"floor_read_gbps\":%.1f,\"calls_per_graph\":%d,\"linear_tune\":\"%s\",\"capture_first_rel_diff\":%s,"
                 "\"rows\":[",
                 prop.name, l2, copy_bps / 1e9, read_bps / 1e9, kCallsPerGraph, tune_env ? tune_env : "",
                 jnum(capture_first_diff, "%.3e").c_str());
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "%s\n{\"shape\":\"%s\",\"dtype\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
                   "\"weight_bytes\":%lld,\"weight_copies\":%lld,\"old_us\":%s,\"new_us\":%s,"
                   "\"floor_w_us\":%.3f,\"floor_all_us\":%.3f,\"max_rel_diff\":%.3e,"
                   "\"first_call_ms\":%.2f}",
                   i ? "," : "", r.shape.c_str(), r.dtype.c_str(), static_cast<long long>(r.m),
                   static_cast<long long>(r.n), static_cast<long long>(r.k),
                   static_cast<long long>(r.weight_bytes), static_cast<long long>(r.copies),
                   jnum(r.old_us, "%.3f").c_str(), jnum(r.new_us, "%.3f").c_str(), r.floor_w_us,
                   r.floor_all_us, r.max_rel_diff, r.first_call_ms);
    }
    std::fprintf(f, "],\n\"decode_step_dense\":[%s]}\n", step_json.c_str());
    std::fclose(f);
  }
  // Loose: both accumulate the same products in FP32; only the summation order may differ.
  if (!(capture_first_diff < 1e-4)) {
    std::fprintf(stderr, "capture-first outputs differ: rel %.3e\n", capture_first_diff);
    return 3;
  }
  for (const Row& r : rows)
    if (!(r.max_rel_diff < 1e-4)) {
      std::fprintf(stderr, "outputs differ: %s %s M=%lld rel %.3e\n", r.shape.c_str(),
                   r.dtype.c_str(), static_cast<long long>(r.m), r.max_rel_diff);
      return 3;
    }
  return 0;
}
