// Sampling on the device (Backend::sample on CUDA) against what the engine did before: the D2H
// copy of the [R, vocab] logits into page-locked memory plus core::Sampler on the host, at
// Qwen3's vocabulary (151,936), rows 1, 32 and 256, same run; two settings add top log-probs
// (20 with greedy, 5 with top-p), on both sides. The floor of the device op is one
// read of the logits at the measured device-to-device copy bandwidth (also this run).
// Host sampling is timed on min(R, 8) rows and scaled by R (rows are independent and the host
// samples them one after another). Reports a table and, with --json, a file
// (tests/gpu/bench-sampling.sh; tests/bench/NOTES.md "Device sampling").
//
//   device_sampling_bench [--vocab N] [--json PATH]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/sampling/sampler.hpp"
#include "kernels/backend.hpp"

namespace {

using namespace rolloutd;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

#define CHECK_OK(expr)                                                         \
  do {                                                                         \
    const Status st_ = (expr);                                                 \
    if (!st_.ok()) {                                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, st_.to_string().c_str());         \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int64_t V = 151936;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--vocab" && i + 1 < argc) V = std::atoll(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: device_sampling_bench [--vocab N] [--json PATH]\n");
      return 2;
    }
  }
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA backend or no visible GPU\n");
    return 1;
  }
  const ExecContext ctx{Device::cuda(0), nullptr};
  const int64_t kMaxRows = 256;
  const size_t logits_bytes = static_cast<size_t>(kMaxRows * V) * sizeof(float);

  // LLM-like logits (sampler_bench's shape): a long normal-ish tail and a few strong candidates.
  std::vector<float> logits(static_cast<size_t>(kMaxRows * V));
  uint64_t x = 7;
  auto uni = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(x >> 40) / 16777216.0f;
  };
  for (auto& l : logits) l = 2.0f * (uni() + uni() + uni() + uni() - 2.0f);
  for (int64_t r = 0; r < kMaxRows; ++r)
    for (int i = 0; i < 20; ++i) logits[static_cast<size_t>(r * V + static_cast<int64_t>(uni() * V))] += 12.0f;

  void *d_logits = nullptr, *d_copy = nullptr, *d_rows = nullptr, *d_tokens = nullptr, *d_logprobs = nullptr;
  void *d_top_ids = nullptr, *d_top_lps = nullptr;
  void* h_logits = nullptr;
  CHECK_OK(cuda->alloc(ctx, logits_bytes, &d_logits));
  CHECK_OK(cuda->alloc(ctx, logits_bytes, &d_copy));
  CHECK_OK(cuda->alloc(ctx, kMaxRows * sizeof(SamplingRow), &d_rows));
  CHECK_OK(cuda->alloc(ctx, kMaxRows * 4, &d_tokens));
  CHECK_OK(cuda->alloc(ctx, kMaxRows * 4, &d_logprobs));
  CHECK_OK(cuda->alloc(ctx, kMaxRows * kMaxTopLogprobs * 4, &d_top_ids));
  CHECK_OK(cuda->alloc(ctx, kMaxRows * kMaxTopLogprobs * 4, &d_top_lps));
  CHECK_OK(cuda->host_alloc(ctx, logits_bytes, &h_logits));
  CHECK_OK(cuda->copy(ctx, d_logits, logits.data(), logits_bytes, CopyKind::kHostToDevice));
  CHECK_OK(cuda->synchronize(ctx));

  // Ceiling: device-to-device copy of the whole logits buffer.
  for (int i = 0; i < 3; ++i) CHECK_OK(cuda->copy(ctx, d_copy, d_logits, logits_bytes, CopyKind::kDeviceToDevice));
  CHECK_OK(cuda->synchronize(ctx));
  auto t0 = Clock::now();
  const int kCopies = 20;
  for (int i = 0; i < kCopies; ++i) CHECK_OK(cuda->copy(ctx, d_copy, d_logits, logits_bytes, CopyKind::kDeviceToDevice));
  CHECK_OK(cuda->synchronize(ctx));
  const double d2d_s = seconds_since(t0) / kCopies;
  const double copy_bw = static_cast<double>(logits_bytes) / d2d_s;  // payload bytes/s

  struct Setting {
    const char* name;
    core::SamplingParams p;
    int64_t top_n = 0;  // top log-probs per row (SampleArgs::top_ids)
  };
  const Setting settings[] = {{"greedy", {0.0f, 1.0f, 0, 0.0f, 1}},
                              {"t1_top_p_0.9", {1.0f, 0.9f, 0, 0.0f, 1}},
                              {"t1_no_filter", {1.0f, 1.0f, 0, 0.0f, 1}},
                              {"t0.7_top_k_50", {0.7f, 1.0f, 50, 0.0f, 1}},
                              {"t1_min_p_0.05", {1.0f, 1.0f, 0, 0.05f, 1}},
                              {"greedy_top20", {0.0f, 1.0f, 0, 0.0f, 1}, 20},
                              {"t1_top_p_0.9_top5", {1.0f, 0.9f, 0, 0.0f, 1}, 5}};
  nlohmann::json out;
  out["vocab"] = V;
  out["d2d_copy_payload_GBps"] = copy_bw / 1e9;
  out["cases"] = nlohmann::json::array();
  std::printf("vocab %lld; device-to-device copy %.0f GB/s payload\n", static_cast<long long>(V), copy_bw / 1e9);
  std::printf("%-16s %5s %12s %12s %12s %12s %10s %10s\n", "setting", "rows", "device_us", "floor_us", "d2h_us",
              "host_us", "host_total", "speedup");
  core::Sampler sampler;
  for (const Setting& s : settings) {
    for (int64_t R : {int64_t{1}, int64_t{32}, int64_t{256}}) {
      std::vector<SamplingRow> rows;
      for (int64_t r = 0; r < R; ++r) {
        core::SamplingParams p = s.p;
        p.seed = 1000 + static_cast<uint64_t>(r);
        rows.push_back(core::sampling_row(p, 5));
      }
      CHECK_OK(cuda->copy(ctx, d_rows, rows.data(), rows.size() * sizeof(SamplingRow), CopyKind::kHostToDevice));
      SampleArgs a;
      a.logits = TensorView::contiguous(d_logits, DType::kF32, Shape{R, V}, ctx.device);
      a.rows = TensorView::contiguous(d_rows, DType::kU8, Shape{R, 32}, ctx.device);
      a.tokens = TensorView::contiguous(d_tokens, DType::kI32, Shape{R}, ctx.device);
      a.logprobs = TensorView::contiguous(d_logprobs, DType::kF32, Shape{R}, ctx.device);
      if (s.top_n > 0) {
        a.top_ids = TensorView::contiguous(d_top_ids, DType::kI32, Shape{R, s.top_n}, ctx.device);
        a.top_logprobs = TensorView::contiguous(d_top_lps, DType::kF32, Shape{R, s.top_n}, ctx.device);
      }
      for (int i = 0; i < 3; ++i) CHECK_OK(cuda->sample(ctx, a));
      CHECK_OK(cuda->synchronize(ctx));
      // Device: each step is the op plus its synchronisation (what a step pays).
      const int iters = 50;
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        CHECK_OK(cuda->sample(ctx, a));
        CHECK_OK(cuda->synchronize(ctx));
      }
      const double device_s = seconds_since(t0) / iters;
      // Before: the logits copied back, then the host sampler.
      const size_t bytes = static_cast<size_t>(R * V) * sizeof(float);
      t0 = Clock::now();
      for (int i = 0; i < 5; ++i) {
        CHECK_OK(cuda->copy(ctx, h_logits, d_logits, bytes, CopyKind::kDeviceToHost));
        CHECK_OK(cuda->synchronize(ctx));
      }
      const double d2h_s = seconds_since(t0) / 5;
      const int64_t timed_rows = std::min<int64_t>(R, 8);
      const float* hl = static_cast<const float*>(h_logits);
      uint64_t sink = 0;
      core::TopLogprobs top;
      t0 = Clock::now();
      for (int64_t r = 0; r < timed_rows; ++r)
        sink += static_cast<uint64_t>(
            sampler.sample(std::span<const float>(hl + r * V, static_cast<size_t>(V)), s.p, 5, s.top_n, &top).token);
      const double host_s = seconds_since(t0) / static_cast<double>(timed_rows) * static_cast<double>(R);
      const double floor_s = static_cast<double>(bytes) / copy_bw;
      std::vector<int32_t> toks(static_cast<size_t>(R));
      CHECK_OK(cuda->copy(ctx, toks.data(), d_tokens, toks.size() * 4, CopyKind::kDeviceToHost));
      CHECK_OK(cuda->synchronize(ctx));
      std::printf("%-16s %5lld %12.1f %12.1f %12.1f %12.1f %10.1f %9.1fx  (sink %llu, token0 %d)\n", s.name,
                  static_cast<long long>(R), device_s * 1e6, floor_s * 1e6, d2h_s * 1e6, host_s * 1e6,
                  (d2h_s + host_s) * 1e6, (d2h_s + host_s) / device_s, static_cast<unsigned long long>(sink), toks[0]);
      out["cases"].push_back({{"setting", s.name},
                              {"rows", R},
                              {"device_us", device_s * 1e6},
                              {"floor_one_read_us", floor_s * 1e6},
                              {"d2h_logits_us", d2h_s * 1e6},
                              {"host_sampler_us", host_s * 1e6},
                              {"host_timed_rows", timed_rows},
                              {"speedup_vs_d2h_plus_host", (d2h_s + host_s) / device_s}});
      std::fflush(stdout);
    }
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  for (void* p : {d_logits, d_copy, d_rows, d_tokens, d_logprobs, d_top_ids, d_top_lps}) (void)cuda->free(ctx, p);
  (void)cuda->host_free(ctx, h_logits);
  return 0;
}
