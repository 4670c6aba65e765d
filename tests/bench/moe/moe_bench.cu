// The MoE layer (core/moe/layer: FP32 gate GEMM, router, routed experts) with MXFP4 expert
// weights and bf16 or MXFP8 activations, timed as issued (eager) and replayed from a CUDA graph,
// against
// - the HBM floor: the bytes of the experts this batch activates (MXFP4 values + E8M0 scales of
//   gate_up and down, read once) over the device-to-device copy bandwidth of the same run
//   (read + write, the HBM's total rate);
// - the PyTorch peer: a BF16 layer on torch._grouped_mm (torch_moe_peer.py), timed by
//   bench-moe.sh in the same session and handed over as a TSV.
// Shapes: gpt-oss-120b (128 experts, hidden 2880, intermediate 2880, top-4) and Qwen3-30B-A3B
// (128 experts, hidden 2048, intermediate 768, top-8), at 1, 8, 64, 256, 1024 and 8192 tokens.
//
//   moe_bench OUT.json [--peer PEER.tsv] [--quick] [--only SHAPE:TOKENS:ACT] [--tokens 1,8,...]
// (--only runs one case, e.g. gpt-oss-120b:64:bf16: for a profiler; --tokens only those token
// counts, ascending: a same-run A/B of kernel builds needs a few)
//
// tests/bench/moe/NOTES.md has the floor arithmetic; tests/gpu/bench-moe.sh runs this.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/moe/layer/moe_layer.hpp"
#include "tests/bench/bench_checks.hpp"

namespace {

using namespace rolloutd;
using bench::mix;
using bench::Timer;

__global__ void fill_bytes(uint8_t* p, int64_t n, uint32_t seed, uint32_t lo, uint32_t span) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint8_t>(span == 0 ? mix(i, seed) : lo + mix(i, seed) % span);
}
// Uniform in [-a, a).
__global__ void fill_f32(float* p, int64_t n, uint32_t seed, float a) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = a * (static_cast<float>(mix(i, seed) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

struct DeviceArena {
  std::vector<void*> ptrs;
  ~DeviceArena() {
    for (void* p : ptrs) (void)cudaFree(p);
  }
  TensorView make(DType dtype, Shape shape) {
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(1, static_cast<size_t>(shape.numel()) * dtype_size(dtype));
    CHECK_CUDA(cudaMalloc(&p, bytes));
    ptrs.push_back(p);
    return TensorView::contiguous(p, dtype, shape, Device::cuda(0));
  }
};

void fill(const TensorView& v, uint32_t seed, uint32_t lo = 0, uint32_t span = 0) {
  fill_bytes<<<1024, 256>>>(static_cast<uint8_t*>(v.data), static_cast<int64_t>(v.nbytes()), seed, lo, span);
  CHECK_CUDA(cudaGetLastError());
}
void fill_uniform(const TensorView& v, uint32_t seed, float a) {
  fill_f32<<<1024, 256>>>(static_cast<float*>(v.data), v.numel(), seed, a);
  CHECK_CUDA(cudaGetLastError());
}

struct ShapeSpec {
  std::string name;
  int64_t experts, hidden, inter, top_k;
  bool gpt_oss;
};

struct Row {
  std::string shape, precision;
  int64_t tokens;
  double ms, graph_ms, floor_ms, active, tflops, peer_ms;
  std::string note;
};

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) o += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return o;
}

// shape <TAB> tokens <TAB> milliseconds, from torch_moe_peer.py.
std::map<std::pair<std::string, int64_t>, double> read_peer(const std::string& path) {
  std::map<std::pair<std::string, int64_t>, double> m;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string shape;
    int64_t t = 0;
    double ms = 0;
    if (is >> shape >> t >> ms) m[{shape, t}] = ms;
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.json [--peer PEER.tsv] [--quick] [--only SHAPE:TOKENS:ACT] [--tokens 1,8,...]\n", argv[0]);
    return 2;
  }
  const std::string json_path = argv[1];
  std::string peer_path;
  bool quick = false;
  std::string only, tokens_arg;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    if (std::strcmp(argv[i], "--peer") == 0 && i + 1 < argc) peer_path = argv[++i];
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) tokens_arg = argv[++i];
  }
  // --tokens: the token counts to run (ascending; an A/B of kernel variants needs only a few).
  std::vector<int64_t> tokens_list;
  for (size_t pos = 0; pos < tokens_arg.size();) {
    size_t end = tokens_arg.find(',', pos);
    if (end == std::string::npos) end = tokens_arg.size();
    const long long v = std::atoll(tokens_arg.substr(pos, end - pos).c_str());
    if (v < 1 || v > 65536 || (!tokens_list.empty() && v <= tokens_list.back())) {
      std::fprintf(stderr, "--tokens: ascending counts in [1, 65536], comma-separated\n");
      return 2;
    }
    tokens_list.push_back(v);
    pos = end + 1;
  }
  const auto peer = peer_path.empty() ? std::map<std::pair<std::string, int64_t>, double>{} : read_peer(peer_path);

  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  CHECK_CUDA(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ExecContext ctx{Device::cuda(0), stream};
  Timer timer{stream};
  const Backend& backend = *cuda_backend();

  // Same-run ceiling: a 1 GiB device-to-device copy (read + write bytes over time).
  double copy_rw_gbps = 0;
  {
    const size_t n = size_t{1} << 30;
    void *a = nullptr, *b = nullptr;
    CHECK_CUDA(cudaMalloc(&a, n));
    CHECK_CUDA(cudaMalloc(&b, n));
    const double ms = timer.median_ms([&] { CHECK_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, stream)); }, 3, 10);
    copy_rw_gbps = 2.0 * static_cast<double>(n) / (ms * 1e-3) / 1e9;
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
  }

  const std::vector<ShapeSpec> shapes{{"gpt-oss-120b", 128, 2880, 2880, 4, true},
                                      {"qwen3-30b-a3b", 128, 2048, 768, 8, false}};
  const std::vector<int64_t> token_counts =
      !tokens_list.empty() ? tokens_list
      : quick              ? std::vector<int64_t>{1, 64}
                           : std::vector<int64_t>{1, 8, 64, 256, 1024, 8192};
  const int64_t max_tokens = token_counts.back();
  std::vector<Row> rows;

  for (const ShapeSpec& s : shapes) {
    DeviceArena mem;
    const int64_t e = s.experts, h = s.hidden, i = s.inter, k = s.top_k;
    core::MoeLayerWeights w;
    w.router = mem.make(DType::kF32, Shape{e, h});
    fill_uniform(w.router, 1, 1.7f / std::sqrt(static_cast<float>(h)));
    if (s.gpt_oss) {
      w.router_bias = mem.make(DType::kF32, Shape{e});
      fill_uniform(w.router_bias, 2, 0.1f);
    }
    moe::ExpertWeights& x = w.experts;
    x.format = moe::WeightFormat::kMXFP4;
    x.gate_up_order = s.gpt_oss ? moe::GateUpOrder::kInterleaved : moe::GateUpOrder::kConcatenated;
    x.gate_up = mem.make(DType::kU8, Shape{e, 2 * i, h / 32, 16});
    x.gate_up_scales = mem.make(DType::kU8, Shape{e, 2 * i, h / 32});
    x.down = mem.make(DType::kU8, Shape{e, h, i / 32, 16});
    x.down_scales = mem.make(DType::kU8, Shape{e, h, i / 32});
    fill(x.gate_up, 3);
    fill(x.down, 4);
    fill(x.gate_up_scales, 5, 118, 4);  // 2^-9 .. 2^-6: the sizes of real expert weights
    fill(x.down_scales, 6, 118, 4);
    if (s.gpt_oss) {
      x.gate_up_bias = mem.make(DType::kF32, Shape{e, 2 * i});
      x.down_bias = mem.make(DType::kF32, Shape{e, h});
      fill_uniform(x.gate_up_bias, 7, 0.1f);
      fill_uniform(x.down_bias, 8, 0.1f);
    }
    // Bytes one expert streams: MXFP4 values (half a byte each) plus one scale per 32.
    const double expert_bytes = static_cast<double>(3 * i * h) * (0.5 + 1.0 / 32.0);
    const TensorView xin = mem.make(DType::kF32, Shape{max_tokens, h});
    const TensorView out = mem.make(DType::kF32, Shape{max_tokens, h});
    fill_uniform(xin, 9, 1.7f);
    CHECK_CUDA(cudaDeviceSynchronize());

    for (const moe::ActPrecision prec : {moe::ActPrecision::kBF16, moe::ActPrecision::kMXFP8}) {
      core::MoeLayerConfig c;
      c.name = s.name;
      c.hidden_size = h;
      c.intermediate_size = i;
      c.num_experts = e;
      c.top_k = k;
      c.max_tokens = max_tokens;
      c.weight_format = moe::WeightFormat::kMXFP4;
      c.gate_up_order = x.gate_up_order;
      c.act_precision = prec;
      c.record_routed_experts = false;
      if (s.gpt_oss) {
        c.router.kind = moe::RouterKind::kTopKSoftmax;
        c.router_bias = true;
        c.activation = {moe::ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f};
        c.expert_bias = true;
      } else {
        c.router.kind = moe::RouterKind::kSoftmaxTopK;
        c.router.renormalize = true;
      }
      auto made = core::MoeLayer::create(c, w, backend, ctx);
      CHECK_OK(made.status());
      core::MoeLayer& layer = *made.value();
      for (const int64_t t : token_counts) {
        if (!only.empty() && only != s.name + ":" + std::to_string(t) + ":" + moe::act_precision_name(prec)) continue;
        const TensorView xv = TensorView::contiguous(xin.data, DType::kF32, Shape{t, h}, xin.device);
        const TensorView ov = TensorView::contiguous(out.data, DType::kF32, Shape{t, h}, out.device);
        auto run = [&] { CHECK_OK(layer.forward(ov, xv, TensorView{}, t, nullptr)); };
        const int iters = t >= 4096 ? 5 : 20;
        const double ms = timer.median_ms(run, 3, iters);
        // The same forward captured once in a CUDA graph and replayed (how the daemon runs decode
        // steps): what is left is the kernels without the host's launch cost. NaN if capture fails.
        double graph_ms = NAN;
        {
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
            const Status st = layer.forward(ov, xv, TensorView{}, t, nullptr);
            const cudaError_t ce = cudaStreamEndCapture(stream, &graph);
            if (st.ok() && ce == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
              graph_ms = timer.median_ms([&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); }, 3, iters);
              CHECK_CUDA(cudaGraphExecDestroy(exec));
            } else {
              std::fprintf(stderr, "  graph capture failed: %s / %s\n", st.to_string().c_str(), cudaGetErrorString(ce));
            }
            if (graph != nullptr) CHECK_CUDA(cudaGraphDestroy(graph));
          }
          (void)cudaGetLastError();
          CHECK_CUDA(cudaStreamSynchronize(stream));
        }
        // Experts this batch activates, and a sanity look at the output.
        std::vector<int32_t> ids(static_cast<size_t>(t * k));
        CHECK_CUDA(cudaMemcpy(ids.data(), layer.topk_ids().data, ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
        const std::set<int32_t> active(ids.begin(), ids.end());
        std::vector<float> o(static_cast<size_t>(std::min<int64_t>(t, 8) * h));
        CHECK_CUDA(cudaMemcpy(o.data(), out.data, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
        const bool finite = std::all_of(o.begin(), o.end(), [](float v) { return std::isfinite(v); });
        Row r;
        r.shape = s.name;
        r.precision = moe::act_precision_name(prec);
        r.tokens = t;
        r.ms = ms;
        r.graph_ms = graph_ms;
        r.active = static_cast<double>(active.size());
        r.floor_ms = r.active * expert_bytes / (copy_rw_gbps * 1e9) * 1e3;
        r.tflops = 2.0 * static_cast<double>(t * k) * static_cast<double>(3 * i * h) / (ms * 1e-3) / 1e12;
        const auto it = peer.find({s.name, t});
        r.peer_ms = it == peer.end() ? NAN : it->second;
        r.note = finite ? "" : "OUTPUT NOT FINITE";
        rows.push_back(r);
        std::fprintf(stderr, "  %s %s T=%lld: %.3f ms\n", s.name.c_str(), r.precision.c_str(),
                     static_cast<long long>(t), ms);
      }
    }
  }

  std::printf("device: %s (%d SMs); copy (read + write) %.0f GB/s\n", prop.name, prop.multiProcessorCount, copy_rw_gbps);
  std::printf("%-14s %-6s %6s %10s %10s %7s %10s %8s %8s %8s %10s %9s %9s %s\n", "shape", "act", "tokens",
              "time ms", "graph ms", "experts", "floor ms", "floor/t", "floor/g", "TFLOP/s", "peer ms", "peer/t",
              "peer/g", "note");
  for (const Row& r : rows)
    std::printf("%-14s %-6s %6lld %10.4f %10.4f %7.0f %10.4f %8.3f %8.3f %8.1f %10.4f %9.2f %9.2f %s\n",
                r.shape.c_str(), r.precision.c_str(), static_cast<long long>(r.tokens), r.ms, r.graph_ms, r.active,
                r.floor_ms, r.floor_ms / r.ms, r.floor_ms / r.graph_ms, r.tflops, r.peer_ms, r.peer_ms / r.ms,
                r.peer_ms / r.graph_ms, r.note.c_str());

  FILE* f = std::fopen(json_path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
    return 2;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"sms\": %d,\n  \"copy_rw_gbps\": %.1f,\n  \"peer\": \"%s\",\n  \"results\": [\n",
               json_escape(prop.name).c_str(), prop.multiProcessorCount, copy_rw_gbps,
               peer.empty() ? "absent" : "torch._grouped_mm bf16 (torch_moe_peer.py)");
  for (size_t n = 0; n < rows.size(); ++n) {
    const Row& r = rows[n];
    std::fprintf(f,
                 "    {\"shape\": \"%s\", \"activations\": \"%s\", \"weights\": \"mxfp4\", \"tokens\": %lld, "
                 "\"ms\": %.5f, \"graph_ms\": %s, \"active_experts\": %.0f, \"floor_ms\": %.5f, \"floor_ratio\": %.4f, "
                 "\"tflops\": %.2f, \"peer_ms\": %s, \"speedup_vs_peer\": %s, \"note\": \"%s\"}%s\n",
                 r.shape.c_str(), r.precision.c_str(), static_cast<long long>(r.tokens), r.ms,
                 std::isnan(r.graph_ms) ? "null" : std::to_string(r.graph_ms).c_str(), r.active,
                 r.floor_ms, r.floor_ms / r.ms, r.tflops,
                 std::isnan(r.peer_ms) ? "null" : std::to_string(r.peer_ms).c_str(),
                 std::isnan(r.peer_ms) ? "null" : std::to_string(r.peer_ms / r.ms).c_str(), json_escape(r.note).c_str(),
                 n + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  return 0;
}
