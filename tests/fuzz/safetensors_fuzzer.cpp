// Fuzz target: the safetensors header parser, core::parse_safetensors, on a whole file
// (8-byte length, JSON header, data section) as a checkpoint loader sees it after mmap.
//
// Oracle beyond the sanitizers: an accepted header describes only what the file holds --
// every tensor's [begin, end) lies in the data section, its size is product(shape) x dtype
// size, no two tensors share a byte, names are distinct and non-empty -- checked here
// independently of the parser's own code; a refusal carries a message.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "core/model/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace rolloutd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::Tally tally("safetensors");
  auto r = core::parse_safetensors({data, size});
  tally.count(r.ok());
  if (!r.ok()) {
    FUZZ_CHECK(!r.status().message().empty(), "refusal without a message");
    return 0;
  }
  const core::SafetensorsHeader& h = *r;
  FUZZ_CHECK(h.data_offset >= 8 && h.data_offset <= size, "data offset %llu outside the file",
             static_cast<unsigned long long>(h.data_offset));
  FUZZ_CHECK(h.data_offset + h.data_size == size, "data section does not end the file");
  std::set<std::string> names;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& e : h.tensors) {
    FUZZ_CHECK(!e.name.empty() && names.insert(e.name).second, "empty or repeated name");
    FUZZ_CHECK(e.begin <= e.end && e.end <= h.data_size, "tensor %s outside the data section", e.name.c_str());
    FUZZ_CHECK(e.shape.size() <= core::kMaxSafetensorsDims, "too many dimensions");
    unsigned __int128 bytes = dtype_size(e.dtype);
    for (int64_t d : e.shape) {
      FUZZ_CHECK(d >= 0 && d <= core::kMaxSafetensorsDim, "dimension out of range");
      bytes *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(bytes == e.end - e.begin, "tensor %s: size disagrees with shape", e.name.c_str());
    if (e.begin != e.end) ranges.emplace_back(e.begin, e.end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    FUZZ_CHECK(ranges[i].first >= ranges[i - 1].second, "two tensors share bytes");
  return 0;
}
