// Quantization kernels against the device-to-device copy ceiling measured in the same run
// (tests/bench/NOTES.md has the floors). Every op is timed through the public entry points of
// kernels/quant/quant_ops.hpp on one stream; bandwidth counts the bytes each op must read and
// write, and the ratio divides it by the copy's (read + write) bandwidth at the same size.
//
//   quant_bench OUT.json [--quick]
//
// --quick runs only the smallest size (a smoke test). The in-place permutation is checked: after
// an even number of forward/inverse passes the tensor must equal its saved copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/bench/bench_checks.hpp"

namespace {

using namespace rolloutd;
using namespace rolloutd::quant;
using bench::Timer;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Heavy-tailed bf16 test data from a hash: uniform mantissa, exponent spread over 2^-8..2^7.
__global__ void fill_bf16(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h = bench::mix(static_cast<uint64_t>(i), seed);
    const uint32_t exp = 119u + (h >> 28);  // 2^-8 .. 2^7
    x[i] = static_cast<uint16_t>(((h & 1u) << 15) | (exp << 7) | ((h >> 8) & 0x7fu));
  }
}

__global__ void count_diff(const uint8_t* a, const uint8_t* b, int64_t n, unsigned long long* out) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    local += a[i] != b[i];
  if (local) atomicAdd(out, local);
}

struct Row {
  std::string op, shape;
  double input_bytes, moved_bytes, ms, gbps, copy_gbps;
  std::string note;
};

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) o += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.json [--quick]\n", argv[0]);
    return 2;
  }
  const std::string json_path = argv[1];
  const bool quick = argc > 2 && std::strcmp(argv[2], "--quick") == 0;

  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  CHECK_CUDA(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ExecContext ctx{Device::cuda(0), stream};
  Timer timer{stream};

  const std::vector<double> sizes_gib = quick ? std::vector<double>{0.25} : std::vector<double>{0.25, 0.5, 1, 2, 4};
  const double max_gib = sizes_gib.back();
  const size_t max_in = static_cast<size_t>(max_gib * kGiB);
  // Buffers: the bf16 input, a copy destination / FP8 output (input bytes), the MXFP4 output,
  // scales (generously sized).
  void *in = nullptr, *out = nullptr, *scales_a = nullptr, *scales_b = nullptr, *scales_c = nullptr;
  CHECK_CUDA(cudaMalloc(&in, max_in));
  CHECK_CUDA(cudaMalloc(&out, max_in));
  const size_t max_scales = max_in / 2 / 32 + 4096;
  CHECK_CUDA(cudaMalloc(&scales_a, max_scales));
  CHECK_CUDA(cudaMalloc(&scales_b, max_scales));
  CHECK_CUDA(cudaMalloc(&scales_c, max_scales * 4));
  fill_bf16<<<4096, 256, 0, stream>>>(static_cast<uint16_t*>(in), static_cast<int64_t>(max_in / 2), 1234u);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamSynchronize(stream));

  std::vector<Row> rows;
  auto copy_gbps = [&](size_t bytes) {  // read + write bandwidth of a D2D copy of `bytes`
    const int iters = bytes > (1u << 30) ? 10 : 20;
    const double ms = timer.median_ms(
        [&] { CHECK_CUDA(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream)); }, 3, iters);
    const double gbps = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    rows.push_back({"d2d_copy", std::to_string(bytes) + " B", static_cast<double>(bytes), 2.0 * static_cast<double>(bytes), ms, gbps, gbps, "ceiling: read + write"});
    return gbps;
  };
  auto record = [&](const std::string& op, const std::string& shape, double input, double moved, double ms,
                    double ceiling, const std::string& note) {
    const double gbps = moved / (ms * 1e-3) / 1e9;
    rows.push_back({op, shape, input, moved, ms, gbps, ceiling, note});
  };

  for (const double gib : sizes_gib) {
    const size_t in_bytes = static_cast<size_t>(gib * kGiB);
    const double ceiling = copy_gbps(in_bytes);
    const int iters = in_bytes > (1u << 30) ? 10 : 20;

    // MXFP4 from BF16, K = 2880 (gpt-oss hidden), rows a multiple of 32 (one N-row matrix).
    {
      const int64_t k = 2880, rows_n = static_cast<int64_t>(in_bytes / 2 / k) / 32 * 32, nkb = k / 32;
      const double n = static_cast<double>(rows_n * k);
      const std::string shape = "[" + std::to_string(rows_n) + ", " + std::to_string(k) + "]";
      const TensorView x = TensorView::contiguous(in, DType::kBF16, {rows_n, k}, Device::cuda(0));
      const TensorView b = TensorView::contiguous(out, DType::kFP4x2, {rows_n, nkb, 16}, Device::cuda(0));
      const TensorView s = TensorView::contiguous(scales_a, DType::kE8M0, {rows_n, nkb}, Device::cuda(0));
      const TensorView ks = TensorView::contiguous(scales_b, DType::kE8M0, {rows_n, nkb}, Device::cuda(0));
      double ms = timer.median_ms([&] { CHECK_OK(quantize_mxfp4(ctx, x, b, s)); }, 2, iters);
      record("mxfp4_quantize_bf16", shape, 2 * n, 2 * n + n / 2 + n / 32, ms, ceiling, "checkpoint layout");
      ms = timer.median_ms([&] {
        CHECK_OK(quantize_mxfp4_to_kernel_layout(ctx, x, b, s, ks, Mxfp4RowOrder::kGateUpInterleaved));
      }, 2, iters);
      record("mxfp4_quantize_bf16_kernel_layout", shape, 2 * n, 2 * n + n / 2 + 2 * n / 32, ms, ceiling,
             "values in kernel layout + checkpoint scales + kernel scales");
      const TensorView q8 = TensorView::contiguous(out, DType::kF8E4M3, {rows_n, k}, Device::cuda(0));
      ms = timer.median_ms([&] { CHECK_OK(quantize_mxfp8(ctx, x, q8, s)); }, 2, iters);
      record("mxfp8_quantize_bf16", shape, 2 * n, 2 * n + n + n / 32, ms, ceiling, "activations");
    }
    // UE8M0 FP8 from BF16, K = 7168 (DeepSeek-V3 hidden).
    {
      const int64_t k = 7168, rows_n = static_cast<int64_t>(in_bytes / 2 / k), nkb = k / 128;
      const double n = static_cast<double>(rows_n * k);
      const std::string shape = "[" + std::to_string(rows_n) + ", " + std::to_string(k) + "]";
      const TensorView x = TensorView::contiguous(in, DType::kBF16, {rows_n, k}, Device::cuda(0));
      const TensorView q = TensorView::contiguous(out, DType::kF8E4M3, {rows_n, k}, Device::cuda(0));
      const int64_t rb = (rows_n + 127) / 128;
      const TensorView sw = TensorView::contiguous(scales_c, DType::kF32, {rb, nkb}, Device::cuda(0));
      const TensorView pw = TensorView::contiguous(scales_b, DType::kI32, {rb, (nkb + 3) / 4}, Device::cuda(0));
      double ms = timer.median_ms(
          [&] { CHECK_OK(quantize_fp8_blockwise(ctx, x, Fp8ScaleBlock::k128x128, q, sw, pw)); }, 2, iters);
      record("fp8_ue8m0_quantize_bf16_128x128", shape, 2 * n, 2 * n + n + n / 16384 * 5, ms, ceiling, "weights");
      const TensorView st = TensorView::contiguous(scales_c, DType::kF32, {rows_n, nkb}, Device::cuda(0));
      const TensorView pt = TensorView::contiguous(scales_b, DType::kI32, {rows_n, (nkb + 3) / 4}, Device::cuda(0));
      ms = timer.median_ms(
          [&] { CHECK_OK(quantize_fp8_blockwise(ctx, x, Fp8ScaleBlock::k1x128, q, st, pt)); }, 2, iters);
      record("fp8_ue8m0_quantize_bf16_1x128", shape, 2 * n, 2 * n + n + n / 128 * 5, ms, ceiling,
             "activations (online requantization)");
    }
  }

  // In-place permutation of a stacked gate_up MXFP4 tensor: 128 experts x 5760 rows x 1440 bytes.
  bool roundtrip_ok = true;
  {
    const int64_t e = quick ? 8 : 128, n = 5760, row_bytes = 1440, nkb = row_bytes / 16;
    const size_t bytes = static_cast<size_t>(e * n * row_bytes);
    const double ceiling = copy_gbps(bytes);
    void* saved = out;  // the copy destination doubles as the reference (bytes < input size)
    uint8_t* blocks = static_cast<uint8_t*>(in);
    CHECK_CUDA(cudaMemcpyAsync(saved, blocks, bytes, cudaMemcpyDeviceToDevice, stream));
    const TensorView v = TensorView::contiguous(blocks, DType::kFP4x2, {e, n, nkb, 16}, Device::cuda(0));
    const std::string shape = "[" + std::to_string(e) + ", " + std::to_string(n) + ", " + std::to_string(nkb) + ", 16]";
    for (const auto order : {Mxfp4RowOrder::kGateUpInterleaved, Mxfp4RowOrder::kGateUpConcatenated, Mxfp4RowOrder::kPlain}) {
      const char* name = order == Mxfp4RowOrder::kGateUpInterleaved
                             ? "interleaved"
                             : (order == Mxfp4RowOrder::kGateUpConcatenated ? "concatenated" : "plain");
      // Alternate directions so the data is a valid layout before every call.
      std::vector<double> fwd, inv;
      for (int i = 0; i < 11; ++i) {
        fwd.push_back(timer.median_ms([&] { CHECK_OK(mxfp4_blocks_to_kernel_layout(ctx, v, order)); }, 0, 1));
        inv.push_back(timer.median_ms([&] { CHECK_OK(mxfp4_blocks_to_checkpoint_layout(ctx, v, order)); }, 0, 1));
      }
      std::sort(fwd.begin() + 1, fwd.end());  // the first pair is the warm-up
      std::sort(inv.begin() + 1, inv.end());
      const double f = fwd[1 + fwd.size() / 2 - 1], r = inv[1 + inv.size() / 2 - 1];
      record(std::string("mxfp4_layout_to_kernel_") + name, shape, static_cast<double>(bytes), 2.0 * bytes, f, ceiling, "in place");
      record(std::string("mxfp4_layout_to_checkpoint_") + name, shape, static_cast<double>(bytes), 2.0 * bytes, r, ceiling, "in place");
      unsigned long long* d_count = nullptr;
      CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&d_count), sizeof(unsigned long long), stream));
      CHECK_CUDA(cudaMemsetAsync(d_count, 0, sizeof(unsigned long long), stream));
      count_diff<<<4096, 256, 0, stream>>>(blocks, static_cast<const uint8_t*>(saved), static_cast<int64_t>(bytes), d_count);
      unsigned long long diff = 0;
      CHECK_CUDA(cudaMemcpyAsync(&diff, d_count, sizeof diff, cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      CHECK_CUDA(cudaFreeAsync(d_count, stream));
      if (diff != 0) {
        std::fprintf(stderr, "layout %s: %llu bytes differ after forward/inverse pairs\n", name, diff);
        roundtrip_ok = false;
      }
    }
  }

  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  std::printf("%-40s %-26s %10s %10s %10s %8s\n", "op", "shape", "moved GB", "time ms", "GB/s", "x copy");
  for (const Row& r : rows)
    std::printf("%-40s %-26s %10.3f %10.3f %10.1f %8.2f\n", r.op.c_str(), r.shape.c_str(), r.moved_bytes / 1e9, r.ms,
                r.gbps, r.gbps / r.copy_gbps);
  std::printf("layout round trip: %s\n", roundtrip_ok ? "ok" : "FAILED");

  FILE* f = std::fopen(json_path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
    return 2;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"sms\": %d,\n  \"layout_roundtrip_ok\": %s,\n  \"results\": [\n",
               json_escape(prop.name).c_str(), prop.multiProcessorCount, roundtrip_ok ? "true" : "false");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "    {\"op\": \"%s\", \"shape\": \"%s\", \"input_bytes\": %.0f, \"moved_bytes\": %.0f, "
                 "\"time_ms\": %.6f, \"gbps\": %.3f, \"copy_gbps\": %.3f, \"ratio_to_copy\": %.4f, \"note\": \"%s\"}%s\n",
                 json_escape(r.op).c_str(), json_escape(r.shape).c_str(), r.input_bytes, r.moved_bytes, r.ms, r.gbps,
                 r.copy_gbps, r.gbps / r.copy_gbps, json_escape(r.note).c_str(), i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  CHECK_CUDA(cudaFree(in));
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaFree(scales_a));
  CHECK_CUDA(cudaFree(scales_b));
  CHECK_CUDA(cudaFree(scales_c));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return roundtrip_ok ? 0 : 1;
}
