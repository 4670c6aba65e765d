// Bucket apply throughput on the CPU backend (a benchmark, not a test).
//
//   bucket_bench [--json out.json] [--only throughput|per_entry|device]
//
// 1. Throughput: one bucket of N MiB of FP32 tensors applied through WeightUpdater (validation,
//    CRC-32 when asked, row copies into stable storage) against a plain memcpy of the same bytes
//    in the same run. Target (issue 3): >= 0.8 x memcpy for buckets >= 64 MiB, no checksum.
// 2. Per-entry overhead: a bucket of 10,000 small tensors (64 floats each): time per entry.
// 3. The daemon's per-entry path for a device bucket (issue 7: 10,000 x 2 KiB BF16 by CUDA IPC),
//    on the CPU: decoding the update_weights table (protocol codec), then apply_bucket through an
//    emulated device backend (tests/unit/core/emulated_device.hpp), which counts the
//    Backend::convert calls -- one cudaMemcpyAsync each on the GPU, ~2-3 us of host time there.
//    "contiguous": the parameters lie back to back as the bucket does (the bench's synthetic
//    small parameters); "gapped": a 256-byte hole after each parameter, so no two entries can
//    share a copy.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/storage/arena.hpp"
#include "core/weights/registry.hpp"
#include "core/weights/session.hpp"
#include "protocol/codec.hpp"
#include "tests/unit/core/emulated_device.hpp"

using namespace rolloutd;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Setup {
  std::unique_ptr<core::StableArena> arena;
  std::unique_ptr<core::WeightRegistry> reg;
  std::vector<core::BucketEntry> entries;
  std::vector<uint8_t> bucket;
};

// `count` FP32 parameters of `elems` elements each, and a bucket holding all of them.
Setup make(size_t count, size_t elems) {
  Setup s;
  s.arena = std::make_unique<core::StableArena>(cpu_backend(), ExecContext{}, core::MemoryTag::kWeights,
                                                std::max<size_t>(64u << 20, count * elems * 4 + 4096));
  s.reg = std::make_unique<core::WeightRegistry>(cpu_backend(), ExecContext{});
  s.bucket.resize(count * elems * 4);
  // Real data, not zeros.
  for (size_t i = 0; i < s.bucket.size() / 4; ++i) {
    const float f = static_cast<float>((i * 2654435761u) % 10007) * 1e-3f - 5.0f;
    std::memcpy(&s.bucket[i * 4], &f, 4);
  }
  for (size_t i = 0; i < count; ++i) {
    const std::string name = "p." + std::to_string(i);
    auto v = s.arena->allocate(DType::kF32, Shape{static_cast<int64_t>(elems)});
    (void)s.reg->add(name, *v, nullptr);
    std::memset(v->data, 0, v->nbytes());  // touch the pages before timing
    s.entries.push_back({name, DType::kF32, {static_cast<int64_t>(elems)}, i * elems * 4, elems * 4});
  }
  (void)s.reg->postprocess_all();
  return s;
}

double apply_seconds(Setup& s, bool checksum) {
  core::WeightUpdater u(*s.reg);
  const auto now = Clock::now();
  auto b = u.begin({}, 60, now);
  std::optional<uint32_t> crc;
  if (checksum) crc = core::crc32_of(s.bucket);
  const auto t0 = Clock::now();
  auto r = u.apply_bucket(b->session, s.entries, s.bucket, crc, now);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!r.ok()) std::cerr << r.status().to_string() << "\n";
  (void)u.end(b->session, 1, now);
  return dt;
}

// The daemon's side of a device bucket of `count` BF16 tensors of `elems` each.
struct DeviceSetup {
  std::unique_ptr<test::EmulatedDeviceMemory> memory;
  std::unique_ptr<core::WeightRegistry> reg;
  std::vector<core::BucketEntry> entries;
  std::vector<uint8_t> bucket;
};

DeviceSetup make_device(size_t count, size_t elems, bool gapped) {
  DeviceSetup s;
  const size_t bytes = elems * 2;
  s.memory = std::make_unique<test::EmulatedDeviceMemory>(count * (bytes + 512) + 4096);
  s.reg = std::make_unique<core::WeightRegistry>(test::emulated_device_backend(), test::emulated_device_context());
  s.bucket.assign(count * bytes, 0);
  for (size_t i = 0; i < s.bucket.size(); ++i) s.bucket[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  for (size_t i = 0; i < count; ++i) {
    const std::string name = "synthetic_small." + std::to_string(i) + ".weight";
    TensorView v = s.memory->allocate(DType::kBF16, Shape{static_cast<int64_t>(elems)});
    if (gapped) (void)s.memory->allocate(DType::kU8, Shape{256});
    (void)s.reg->add(name, v, nullptr);
    s.entries.push_back({name, DType::kBF16, {static_cast<int64_t>(elems)}, i * bytes, bytes});
  }
  (void)s.reg->postprocess_all();
  return s;
}

// (seconds, converts) of one apply of the whole bucket as a device bucket.
std::pair<double, uint64_t> apply_device(DeviceSetup& s) {
  core::WeightUpdater u(*s.reg);
  const auto now = Clock::now();
  auto b = u.begin({}, 60, now);
  test::emulated_device_counters().reset();
  const auto t0 = Clock::now();
  auto r = u.apply_bucket(b->session, s.entries, s.bucket, std::nullopt, now, /*on_device=*/true,
                          /*wait_device=*/false);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  const uint64_t converts = test::emulated_device_counters().converts;
  if (!r.ok()) std::cerr << r.status().to_string() << "\n";
  (void)u.end(b->session, 1, now);
  return {dt, converts};
}

// Seconds to decode one update_weights envelope of `entries` (a CUDA IPC source), as the
// daemon's control actor does.
double decode_seconds(const std::vector<core::BucketEntry>& entries, uint64_t size) {
  protocol::UpdateWeightsRequest r;
  r.session = 1;
  for (const auto& e : entries) r.entries.push_back({e.name, e.dtype, e.shape, e.byte_offset, e.nbytes});
  r.source = protocol::CudaIpcSource{std::string(64, '\1'), 0, size, std::string(16, '\2')};
  const protocol::WireMessage m = protocol::encode_request(7, protocol::Request{r});
  const protocol::Frame env(reinterpret_cast<const uint8_t*>(m.envelope.data()), m.envelope.size());
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {  // the best of 5: the first touches fresh pages
    const auto t0 = Clock::now();
    auto d = protocol::decode_request(env, {}, protocol::Limits{});
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (!d.status.ok()) std::cerr << d.status.to_string() << "\n";
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_out, only;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--json") json_out = argv[i + 1];
    if (std::string(argv[i]) == "--only") only = argv[i + 1];
  }
  auto run = [&](const char* section) { return only.empty() || only == section; };
  nlohmann::json out;
  for (size_t mib : {16, 64, 256}) {
    if (!run("throughput")) break;
    // 64 tensors per bucket, as a trainer's bucket of mid-size linears.
    const size_t count = 64, elems = mib * (1u << 20) / 4 / count;
    Setup s = make(count, elems);
    std::vector<uint8_t> dst(s.bucket.size());
    std::memset(dst.data(), 1, dst.size());
    std::vector<double> tm, ta, tc;
    for (int rep = 0; rep < 7; ++rep) {
      const auto t0 = Clock::now();
      std::memcpy(dst.data(), s.bucket.data(), s.bucket.size());
      tm.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      ta.push_back(apply_seconds(s, false));
      tc.push_back(apply_seconds(s, true));
    }
    const double bytes = static_cast<double>(s.bucket.size());
    const double m = median(tm), a = median(ta), c = median(tc);
    out["throughput"][std::to_string(mib) + "MiB"] = {
        {"memcpy_GBps", bytes / m / 1e9}, {"apply_GBps", bytes / a / 1e9},
        {"apply_with_crc32_GBps", bytes / c / 1e9}, {"ratio_vs_memcpy", m / a}, {"ratio_with_crc32", m / c}};
  }
  if (run("per_entry")) {
    Setup s = make(10000, 64);
    std::vector<double> t;
    for (int rep = 0; rep < 7; ++rep) t.push_back(apply_seconds(s, false));
    out["per_entry"] = {{"entries", 10000}, {"elements_each", 64}, {"us_per_entry", median(t) / 10000 * 1e6}};
  }
  if (run("device")) {
    constexpr size_t kCount = 10000, kElems = 1024;  // bench_push.py's small tensors
    for (bool gapped : {false, true}) {
      DeviceSetup s = make_device(kCount, kElems, gapped);
      std::vector<double> t, d;
      uint64_t converts = 0;
      for (int rep = 0; rep < 7; ++rep) {
        auto [dt, n] = apply_device(s);
        t.push_back(dt);
        converts = n;
        d.push_back(decode_seconds(s.entries, s.bucket.size()));
      }
      out[gapped ? "device_bucket_gapped" : "device_bucket_contiguous"] = {
          {"entries", kCount},
          {"bytes_each", kElems * 2},
          {"decode_us_per_entry", median(d) / kCount * 1e6},
          {"apply_us_per_entry", median(t) / kCount * 1e6},
          {"device_copies", converts}};
    }
  }
  std::cout << out.dump(2) << std::endl;
  if (!json_out.empty()) std::ofstream(json_out) << out.dump(2) << "\n";
  return 0;
}
