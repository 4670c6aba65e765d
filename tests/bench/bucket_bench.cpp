// Bucket apply throughput on the CPU backend (a benchmark, not a test).
//
//   bucket_bench [--json out.json]
//
// 1. Throughput: one bucket of N MiB of FP32 tensors applied through WeightUpdater (validation,
//    CRC-32 when asked, row copies into stable storage) against a plain memcpy of the same bytes
//    in the same run. Target (issue 3): >= 0.8 x memcpy for buckets >= 64 MiB, no checksum.
// 2. Per-entry overhead: a bucket of 10,000 small tensors (64 floats each): time per entry.
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

}  // namespace

int main(int argc, char** argv) {
  std::string json_out;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--json") json_out = argv[i + 1];
  nlohmann::json out;
  for (size_t mib : {16, 64, 256}) {
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
  {
    Setup s = make(10000, 64);
    std::vector<double> t;
    for (int rep = 0; rep < 7; ++rep) t.push_back(apply_seconds(s, false));
    out["per_entry"] = {{"entries", 10000}, {"elements_each", 64}, {"us_per_entry", median(t) / 10000 * 1e6}};
  }
  std::cout << out.dump(2) << std::endl;
  if (!json_out.empty()) std::ofstream(json_out) << out.dump(2) << "\n";
  return 0;
}
