#pragma once
// Helpers shared by the fuzz targets: the multi-frame input format, a byte reader for
// structured inputs, and a check that aborts (so libFuzzer, and the replay driver under
// any build type, report it as a crash).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// Unlike assert(), active in every build type: the replay tests run in RelWithDebInfo.
#define FUZZ_CHECK(cond, ...)                                                     \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "  " __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                                 \
      std::abort();                                                               \
    }                                                                             \
  } while (0)

namespace rolloutd::fuzz {

// A ZeroMQ multipart message as one fuzz input: the envelope, then each payload frame,
// separated by kFrameSeparator. tests/fuzz/run.sh builds the seeds from
// protocol/golden/<name>.msgpack and <name>.frame<i>.bin this way.
inline constexpr std::string_view kFrameSeparator = "\n#FRAME#";

struct SplitMessage {
  std::span<const uint8_t> envelope;
  std::vector<std::span<const uint8_t>> frames;
};

// At most max_frames + 1 separators are honoured; the rest stays in the last frame, so a
// message over the frame limit is still reachable (and refused) without unbounded work.
inline SplitMessage split_frames(const uint8_t* data, size_t size, size_t max_frames = 20) {
  SplitMessage out;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  std::vector<std::span<const uint8_t>> parts;
  while (parts.size() < max_frames + 1) {
    const size_t at = all.find(kFrameSeparator, start);
    if (at == std::string_view::npos) break;
    parts.emplace_back(data + start, at - start);
    start = at + kFrameSeparator.size();
  }
  parts.emplace_back(data + start, size - start);
  out.envelope = parts.front();
  out.frames.assign(parts.begin() + 1, parts.end());
  return out;
}

// Reads little-endian integers and strings off the front of the input; past the end it
// yields zeros, so every input is a complete program.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return n_ == 0; }
  size_t left() const { return n_; }
  uint8_t u8() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return static_cast<uint32_t>(u16()) | (static_cast<uint32_t>(u16()) << 16); }
  uint64_t u64() { return static_cast<uint64_t>(u32()) | (static_cast<uint64_t>(u32()) << 32); }
  // A length byte (mod max_len + 1), then that many bytes.
  std::string str(size_t max_len) {
    const size_t len = std::min<size_t>(u8() % (max_len + 1), n_);
    std::string s(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    return s;
  }
  std::span<const uint8_t> take(size_t len) {
    len = std::min(len, n_);
    std::span<const uint8_t> s(p_, len);
    p_ += len;
    n_ -= len;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

// Counts what a target accepted and refused; prints one line when the process exits
// (libFuzzer exits through exit() at -max_total_time), which run.sh sums into the figures
// ("bad inputs tried").
class Tally {
 public:
  explicit Tally(const char* what) : what_(what) {}
  ~Tally() {
    std::fprintf(stderr, "fuzz-tally %s: accepted %llu refused %llu\n", what_,
                 static_cast<unsigned long long>(accepted_), static_cast<unsigned long long>(refused_));
  }
  void count(bool accepted) { ++(accepted ? accepted_ : refused_); }

 private:
  const char* what_;
  uint64_t accepted_ = 0;
  uint64_t refused_ = 0;
};

}  // namespace rolloutd::fuzz
