#include "protocol/codec.hpp"

#include <msgpack.hpp>

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

namespace rolloutd::protocol {
namespace {

// ---------------------------------------------------------------- names ----

constexpr std::string_view kHello = "hello";
constexpr std::string_view kStatus = "status";
constexpr std::string_view kGenerate = "generate";
constexpr std::string_view kAbort = "abort";
constexpr std::string_view kShutdown = "shutdown";
constexpr std::string_view kHelloOk = "hello.ok";
constexpr std::string_view kStatusOk = "status.ok";
constexpr std::string_view kGenerateOk = "generate.ok";
constexpr std::string_view kAbortOk = "abort.ok";
constexpr std::string_view kShutdownOk = "shutdown.ok";
constexpr std::string_view kError = "error";
constexpr std::string_view kTokens = "tokens";
constexpr std::string_view kFinished = "finished";
constexpr std::string_view kFailed = "failed";
// Weight updates and generation control (SPEC §11).
constexpr std::string_view kBeginWeightUpdate = "begin_weight_update";
constexpr std::string_view kUpdateWeights = "update_weights";
constexpr std::string_view kEndWeightUpdate = "end_weight_update";
constexpr std::string_view kAbortWeightUpdate = "abort_weight_update";
constexpr std::string_view kGetWeightsByName = "get_weights_by_name";
constexpr std::string_view kWeightsChecksum = "weights_checksum";
constexpr std::string_view kPauseGeneration = "pause_generation";
constexpr std::string_view kContinueGeneration = "continue_generation";
constexpr std::string_view kBeginWeightUpdateOk = "begin_weight_update.ok";
constexpr std::string_view kUpdateWeightsOk = "update_weights.ok";
constexpr std::string_view kEndWeightUpdateOk = "end_weight_update.ok";
constexpr std::string_view kAbortWeightUpdateOk = "abort_weight_update.ok";
constexpr std::string_view kGetWeightsByNameOk = "get_weights_by_name.ok";
constexpr std::string_view kWeightsChecksumOk = "weights_checksum.ok";
constexpr std::string_view kPauseGenerationOk = "pause_generation.ok";
constexpr std::string_view kContinueGenerationOk = "continue_generation.ok";
constexpr std::string_view kRetracted = "retracted";
// NCCL weight groups (SPEC §11.7).
constexpr std::string_view kInitWeightGroup = "init_weight_group";
constexpr std::string_view kDestroyWeightGroup = "destroy_weight_group";
constexpr std::string_view kInitWeightGroupOk = "init_weight_group.ok";
constexpr std::string_view kDestroyWeightGroupOk = "destroy_weight_group.ok";
// Memory release and resume (SPEC §12).
constexpr std::string_view kReleaseMemory = "release_memory";
constexpr std::string_view kResumeMemory = "resume_memory";
constexpr std::string_view kReleaseMemoryOk = "release_memory.ok";
constexpr std::string_view kResumeMemoryOk = "resume_memory.ok";
constexpr size_t kMaxMemoryTags = std::size(kMemoryTags);

constexpr std::string_view kFlattenedBucket = "flattened_bucket";
constexpr std::string_view kCrc32 = "crc32";

// Parse-time bounds that Limits does not name (SPEC §9). v1 maps have at most 13
// keys and nest 5 containers deep (update_weights: envelope, body, entries, entry, shape);
// the slack is for fields added later in v1.
constexpr size_t kMaxMapEntries = 128;
constexpr size_t kMaxDepth = 16;

constexpr int32_t kMaxTokenId = std::numeric_limits<int32_t>::max();

// ------------------------------------------------------------- decoding ----

// A field path, rendered only when an error names it: decoding a valid message
// builds no path strings. Nodes live on the stack of the decoding functions.
struct Path {
  static constexpr size_t kNoIndex = static_cast<size_t>(-1);
  const Path* parent = nullptr;
  std::string_view key;
  size_t index = kNoIndex;

  Path child(std::string_view k) const { return Path{this, k, kNoIndex}; }
  Path at(size_t i) const { return Path{this, {}, i}; }
  std::string str() const {
    std::string s = parent ? parent->str() : std::string();
    if (index != kNoIndex) return s + "[" + std::to_string(index) + "]";
    if (!s.empty()) s += '.';
    return s += key;
  }
};

Status error_at(ErrorCode code, const Path& p, std::string message) {
  return Status(code, std::move(message), p.str());
}

const char* msgpack_type_name(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "nil";
    case msgpack::type::BOOLEAN: return "bool";
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER: return "int";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return "float";
    case msgpack::type::STR: return "str";
    case msgpack::type::BIN: return "bin";
    case msgpack::type::ARRAY: return "array";
    case msgpack::type::MAP: return "map";
    case msgpack::type::EXT: return "ext";
  }
  return "unknown";
}

Status wrong_type(const Path& p, const msgpack::object& o, std::string_view expected) {
  return error_at(ErrorCode::kWrongType, p,
                  "expected " + std::string(expected) + ", got " + msgpack_type_name(o));
}

// Either integer family is accepted when the value fits (a sender may write 5
// as int8). Floats are never narrowed to integers: 16.0 for a count is a sender
// bug worth reporting, not rounding.
template <class T>
Status read_int(const msgpack::object& o, const Path& p, T lo, T hi, T& out) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  std::string got;
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (std::cmp_greater_equal(o.via.u64, lo) && std::cmp_less_equal(o.via.u64, hi)) {
      out = static_cast<T>(o.via.u64);
      return Status::Ok();
    }
    got = std::to_string(o.via.u64);
  } else if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    if (std::cmp_greater_equal(o.via.i64, lo) && std::cmp_less_equal(o.via.i64, hi)) {
      out = static_cast<T>(o.via.i64);
      return Status::Ok();
    }
    got = std::to_string(o.via.i64);
  } else {
    return wrong_type(p, o, "int");
  }
  return error_at(
      ErrorCode::kOutOfRange, p,
      "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + got);
}

// Shortest form that reads back as the same double ("0.1", "100", "nan").
std::string format_double(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, ec == std::errc() ? end : buf);
}

// A closed or half-open interval of finite bounds. The comparisons are written
// so that NaN fails them; infinities fail them because the bounds are finite.
struct Interval {
  double lo = -std::numeric_limits<double>::max();
  double hi = std::numeric_limits<double>::max();
  bool lo_open = false;

  bool contains(double v) const { return (lo_open ? v > lo : v >= lo) && v <= hi; }
  std::string str() const {
    return (lo_open ? "(" : "[") + format_double(lo) + ", " + format_double(hi) + "]";
  }
};

Status read_number(const msgpack::object& o, const Path& p, double& out) {
  switch (o.type) {
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: out = o.via.f64; return Status::Ok();
    case msgpack::type::POSITIVE_INTEGER: out = static_cast<double>(o.via.u64); return Status::Ok();
    case msgpack::type::NEGATIVE_INTEGER: out = static_cast<double>(o.via.i64); return Status::Ok();
    default: return wrong_type(p, o, "float");
  }
}

Status read_float(const msgpack::object& o, const Path& p, const Interval& range, double& out) {
  RD_RETURN_IF_ERROR(read_number(o, p, out));
  if (!range.contains(out)) {
    return error_at(ErrorCode::kOutOfRange, p,
                    "must be finite and in " + range.str() + ", got " + format_double(out));
  }
  return Status::Ok();
}

// A msgpack bin of exactly one of `sizes` bytes (the parse bound already capped it at
// max_string_bytes). A str is refused: handles and ids are raw bytes, and a str
// would have to be valid UTF-8, which a random ncclUniqueId is not.
Status read_bin(const msgpack::object& o, const Path& p, std::initializer_list<size_t> sizes,
                std::string& out) {
  if (o.type != msgpack::type::BIN) return wrong_type(p, o, "bin");
  const size_t n = o.via.bin.size;
  if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) {
    std::string want;
    for (size_t k : sizes) want += (want.empty() ? "" : " or ") + std::to_string(k);
    return error_at(ErrorCode::kInvalidArgument, p,
                    std::to_string(n) + " bytes; must be exactly " + want);
  }
  out.assign(o.via.bin.ptr, n);
  return Status::Ok();
}

Status read_bool(const msgpack::object& o, const Path& p, bool& out) {
  if (o.type != msgpack::type::BOOLEAN) return wrong_type(p, o, "bool");
  out = o.via.boolean;
  return Status::Ok();
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
// Checked because strings end up in JSON logs and Python clients, both of which
// reject invalid UTF-8 far from where it entered.
bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // n continuation bytes follow a lead byte 110xxxxx, 1110xxxx or 11110xxx.
    const size_t n = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
    if (n == 0 || c >= 0xF8 || i + n >= s.size()) return false;
    uint32_t cp = c & (0x3F >> n);
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

Status read_str(const msgpack::object& o, const Path& p, size_t max_bytes, std::string& out) {
  if (o.type != msgpack::type::STR) return wrong_type(p, o, "str");
  const std::string_view s(o.via.str.ptr, o.via.str.size);
  if (s.size() > max_bytes) {
    return error_at(ErrorCode::kTooLarge, p,
                    std::to_string(s.size()) + " bytes, limit " + std::to_string(max_bytes));
  }
  if (!is_valid_utf8(s)) return error_at(ErrorCode::kInvalidArgument, p, "not valid UTF-8");
  out.assign(s);
  return Status::Ok();
}

template <class T, class ReadElement>
Status read_array(const msgpack::object& o, const Path& p, size_t max_count, std::vector<T>& out,
                  ReadElement&& read_element) {
  if (o.type != msgpack::type::ARRAY) return wrong_type(p, o, "array");
  const msgpack::object_array& a = o.via.array;
  if (a.size > max_count) {
    return error_at(ErrorCode::kTooLarge, p,
                    std::to_string(a.size) + " entries, limit " + std::to_string(max_count));
  }
  out.clear();
  out.reserve(a.size);
  for (uint32_t i = 0; i < a.size; ++i) {
    T v{};
    RD_RETURN_IF_ERROR(read_element(a.ptr[i], p.at(i), v));
    out.push_back(std::move(v));
  }
  return Status::Ok();
}

Status require_non_empty(const Path& p, size_t size) {
  if (size == 0) return error_at(ErrorCode::kInvalidArgument, p, "must not be empty");
  return Status::Ok();
}

enum class Need { kRequired, kOptional };

// Typed access to the fields of one msgpack map. Optional fields that are absent
// leave the output untouched, so the struct's defaults (messages.hpp, SPEC §4)
// are the protocol's defaults. Keys not asked for are ignored: that is what lets
// v1 grow new fields.
class MapReader {
 public:
  static constexpr uint32_t kPairwiseKeyCheck = 16;

  MapReader(const msgpack::object_kv* entries, uint32_t size, const Path& path)
      : entries_(entries), size_(size), path_(path) {}

  // Fails on non-string or duplicate keys: with duplicates, a decoder that keeps
  // the first and one that keeps the last (Python's dict) would read different
  // messages from the same bytes.
  Status check_keys() const {
    // Small maps (every v1 map; a bucket has thousands of entry maps) are checked
    // pairwise without allocating; larger ones by sorting.
    if (size_ <= kPairwiseKeyCheck) {
      for (uint32_t i = 0; i < size_; ++i) {
        const msgpack::object& k = entries_[i].key;
        if (k.type != msgpack::type::STR) {
          return error_at(ErrorCode::kBadMessage, path_,
                          std::string("map key must be str, got ") + msgpack_type_name(k));
        }
      }
      for (uint32_t i = 0; i < size_; ++i) {
        const std::string_view ki(entries_[i].key.via.str.ptr, entries_[i].key.via.str.size);
        for (uint32_t j = i + 1; j < size_; ++j) {
          if (ki == std::string_view(entries_[j].key.via.str.ptr, entries_[j].key.via.str.size))
            return error_at(ErrorCode::kBadMessage, path_.child(ki), "duplicate key");
        }
      }
      return Status::Ok();
    }
    std::vector<std::string_view> keys;
    keys.reserve(size_);
    for (uint32_t i = 0; i < size_; ++i) {
      const msgpack::object& k = entries_[i].key;
      if (k.type != msgpack::type::STR) {
        return error_at(ErrorCode::kBadMessage, path_,
                        std::string("map key must be str, got ") + msgpack_type_name(k));
      }
      keys.emplace_back(k.via.str.ptr, k.via.str.size);
    }
    std::sort(keys.begin(), keys.end());
    if (auto dup = std::adjacent_find(keys.begin(), keys.end()); dup != keys.end()) {
      return error_at(ErrorCode::kBadMessage, path_.child(*dup), "duplicate key");
    }
    return Status::Ok();
  }

  const Path& path() const { return path_; }
  Path path(std::string_view key) const { return path_.child(key); }

  // The first entry with this key; non-string keys never match (check_keys
  // reports them, possibly after the envelope id was looked up).
  const msgpack::object* find(std::string_view key) const {
    for (uint32_t i = 0; i < size_; ++i) {
      const msgpack::object& k = entries_[i].key;
      if (k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key) {
        return &entries_[i].val;
      }
    }
    return nullptr;
  }

  // Calls read(value, path) if the key is present; kMissingField if it is required.
  template <class Read>
  Status field(std::string_view key, Need need, Read&& read) const {
    const msgpack::object* o = find(key);
    if (o == nullptr) {
      if (need == Need::kOptional) return Status::Ok();
      return error_at(ErrorCode::kMissingField, path(key), "required");
    }
    return read(*o, path(key));
  }

  Status str(std::string_view key, Need need, size_t max_bytes, std::string& out) const {
    return field(key, need, [&](const msgpack::object& o, const Path& p) {
      return read_str(o, p, max_bytes, out);
    });
  }
  template <class T>
  Status integer(std::string_view key, Need need, T lo, T hi, T& out) const {
    return field(key, need, [&](const msgpack::object& o, const Path& p) {
      return read_int(o, p, lo, hi, out);
    });
  }
  template <class T>
  Status integer(std::string_view key, Need need, T& out) const {
    return integer(key, need, std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), out);
  }
  Status number(std::string_view key, Need need, const Interval& range, double& out) const {
    return field(key, need, [&](const msgpack::object& o, const Path& p) {
      return read_float(o, p, range, out);
    });
  }
  Status bin(std::string_view key, Need need, std::initializer_list<size_t> sizes,
             std::string& out) const {
    return field(key, need, [&](const msgpack::object& o, const Path& p) {
      return read_bin(o, p, sizes, out);
    });
  }
  Status boolean(std::string_view key, Need need, bool& out) const {
    return field(key, need,
                 [&](const msgpack::object& o, const Path& p) { return read_bool(o, p, out); });
  }
  template <class T>
  Status int_array(std::string_view key, Need need, size_t max_count, T lo, T hi,
                   std::vector<T>& out) const {
    return field(key, need, [&](const msgpack::object& o, const Path& p) {
      return read_array(o, p, max_count, out, [&](const msgpack::object& e, const Path& ep, T& v) {
        return read_int(e, ep, lo, hi, v);
      });
    });
  }
  // The fields SPEC marks "nil ok": nil and absent both mean absent.
  template <class T>
  Status nullable_integer(std::string_view key, std::optional<T>& out) const {
    return field(key, Need::kOptional, [&](const msgpack::object& o, const Path& p) {
      if (o.type == msgpack::type::NIL) return Status::Ok();
      T v{};
      RD_RETURN_IF_ERROR(
          read_int(o, p, std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), v));
      out = v;
      return Status::Ok();
    });
  }
  Status nullable_str(std::string_view key, size_t max_bytes,
                      std::optional<std::string>& out) const {
    return field(key, Need::kOptional, [&](const msgpack::object& o, const Path& p) {
      if (o.type == msgpack::type::NIL) return Status::Ok();
      std::string v;
      RD_RETURN_IF_ERROR(read_str(o, p, max_bytes, v));
      out = std::move(v);
      return Status::Ok();
    });
  }

 private:
  const msgpack::object_kv* entries_;
  uint32_t size_;
  Path path_;
};

// Opens `o` (at `p`) as a map. The returned reader points into `o` and `p`.
Status open_map(const msgpack::object& o, const Path& p, std::optional<MapReader>& out) {
  if (o.type != msgpack::type::MAP) return wrong_type(p, o, "map");
  out.emplace(o.via.map.ptr, o.via.map.size, p);
  return out->check_keys();
}

// A required nested map, e.g. body.model.
template <class T, class Decode>
Status nested(const MapReader& parent, std::string_view key, T& out, Decode&& decode) {
  return parent.field(key, Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    std::optional<MapReader> m;
    RD_RETURN_IF_ERROR(open_map(o, p, m));
    return decode(*m, out);
  });
}

// Strings and binaries point into the caller's frame instead of being copied:
// the frame outlives the decode, and nothing is allocated for a string before
// its field has been checked.
bool reference_in_place(msgpack::type::object_type, std::size_t, void*) { return true; }

// Finds the envelope's top-level "id" in bytes that failed to parse (truncated,
// over a bound, malformed further on), so the error reply still correlates when
// the id precedes the problem, as it does in canonical key order. It builds
// nothing, and it stops at the id or at kMaxDepth, so it allocates no more than
// the bounded parse would have.
class IdFinder : public msgpack::null_visitor {
 public:
  std::optional<uint64_t> id;

  // Returning false stops the parse: at a root that is not a map, or too deep.
  bool start_array(uint32_t) {
    ++depth_;
    return depth_ > 1 && depth_ <= kMaxDepth;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool start_map(uint32_t) { return ++depth_ <= kMaxDepth; }
  bool end_map() {
    --depth_;
    return true;
  }
  bool start_map_key() {
    in_root_key_ = depth_ == 1;
    return true;
  }
  bool end_map_key() {
    in_root_key_ = false;
    return true;
  }
  bool visit_str(const char* v, uint32_t size) {
    if (in_root_key_) at_id_value_ = std::string_view(v, size) == "id";
    return true;
  }
  bool end_map_value() {
    if (depth_ == 1) at_id_value_ = false;
    return true;
  }
  bool visit_positive_integer(uint64_t v) {
    if (!at_id_value_ || depth_ != 1) return true;
    id = v;
    return false;  // found: stop parsing
  }
  void parse_error(size_t, size_t) {}
  void insufficient_bytes(size_t, size_t) {}

 private:
  size_t depth_ = 0;
  bool in_root_key_ = false;
  bool at_id_value_ = false;
};

uint64_t salvage_id(Frame envelope, uint64_t max_bytes) {
  IdFinder finder;
  size_t offset = 0;
  const size_t n = std::min<uint64_t>(envelope.size(), max_bytes);
  msgpack::parse(reinterpret_cast<const char*>(envelope.data()), n, offset, finder);
  return finder.id.value_or(0);
}

// A parsed envelope; the readers point into `handle`.
struct OpenedEnvelope {
  msgpack::object_handle handle;  // owns the objects `body` points into
  std::optional<MapReader> envelope;
  std::optional<MapReader> body;  // an empty map when the body is absent
};

Status check_frame_limits(Frame envelope, std::span<const Frame> frames, const Limits& limits) {
  if (envelope.size() > limits.max_envelope_bytes) {
    return Status(ErrorCode::kTooLarge, "envelope of " + std::to_string(envelope.size()) +
                                            " bytes, limit " +
                                            std::to_string(limits.max_envelope_bytes));
  }
  if (frames.size() > limits.max_frames) {
    return Status(ErrorCode::kTooLarge, std::to_string(frames.size()) + " payload frames, limit " +
                                            std::to_string(limits.max_frames));
  }
  for (size_t i = 0; i < frames.size(); ++i) {
    if (frames[i].size() > limits.max_frame_bytes) {
      return Status(ErrorCode::kTooLarge,
                    std::to_string(frames[i].size()) + " bytes, limit " +
                        std::to_string(limits.max_frame_bytes),
                    "frames[" + std::to_string(i) + "]");
    }
  }
  return Status::Ok();
}

// msgpack-c reports every parse failure by exception; each becomes a typed
// status here so that nothing escapes into the daemon's event loop.
Status parse_envelope(Frame envelope, const Limits& limits, size_t max_array,
                      msgpack::object_handle& out) {
  const size_t max_str = std::max<size_t>(limits.max_string_bytes, limits.max_rid_bytes);
  const msgpack::unpack_limit unpack_limit(max_array, kMaxMapEntries, max_str,
                                           limits.max_string_bytes, limits.max_string_bytes,
                                           kMaxDepth);
  size_t offset = 0;
  try {
    out = msgpack::unpack(reinterpret_cast<const char*>(envelope.data()), envelope.size(), offset,
                          reference_in_place, nullptr, unpack_limit);
  } catch (const msgpack::insufficient_bytes&) {
    return Status(ErrorCode::kBadMessage, "truncated msgpack");
  } catch (const msgpack::array_size_overflow&) {
    return Status(ErrorCode::kTooLarge,
                  "array longer than " + std::to_string(max_array) + " entries");
  } catch (const msgpack::map_size_overflow&) {
    return Status(ErrorCode::kTooLarge,
                  "map with more than " + std::to_string(kMaxMapEntries) + " entries");
  } catch (const msgpack::str_size_overflow&) {
    return Status(ErrorCode::kTooLarge, "string longer than " + std::to_string(max_str) + " bytes");
  } catch (const msgpack::bin_size_overflow&) {
    return Status(ErrorCode::kTooLarge,
                  "bin longer than " + std::to_string(limits.max_string_bytes) + " bytes");
  } catch (const msgpack::ext_size_overflow&) {
    return Status(ErrorCode::kTooLarge,
                  "ext longer than " + std::to_string(limits.max_string_bytes) + " bytes");
  } catch (const msgpack::depth_size_overflow&) {
    return Status(ErrorCode::kTooLarge,
                  "nested deeper than " + std::to_string(kMaxDepth) + " containers");
  } catch (const msgpack::unpack_error& e) {
    return Status(ErrorCode::kBadMessage, std::string("not msgpack: ") + e.what());
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::kResourceExhausted, "out of memory while parsing the envelope");
  }
  if (offset != envelope.size()) {
    return Status(ErrorCode::kBadMessage,
                  std::to_string(envelope.size() - offset) + " trailing bytes after the envelope");
  }
  return Status::Ok();
}

// Everything that precedes the body: frame limits, msgpack parse, envelope keys.
// Fills `env` field by field so that a later failure still reports the id.
Status open_envelope(Frame envelope, std::span<const Frame> frames, const Limits& limits,
                     size_t max_array, Envelope& env, OpenedEnvelope& out) {
  static const Path kNoField{};
  Status parsed = check_frame_limits(envelope, frames, limits);
  if (parsed.ok()) parsed = parse_envelope(envelope, limits, max_array, out.handle);
  if (!parsed.ok()) {
    env.id = salvage_id(envelope, limits.max_envelope_bytes);
    return parsed;
  }
  const msgpack::object& root = out.handle.get();
  if (root.type != msgpack::type::MAP) {
    return Status(ErrorCode::kBadMessage,
                  std::string("envelope must be a map, got ") + msgpack_type_name(root));
  }
  out.envelope.emplace(root.via.map.ptr, root.via.map.size, kNoField);
  const MapReader& e = *out.envelope;
  // The id first, whatever else is wrong, so the error reply can be correlated.
  if (const msgpack::object* id = e.find("id");
      id != nullptr && id->type == msgpack::type::POSITIVE_INTEGER) {
    env.id = id->via.u64;
  }
  RD_RETURN_IF_ERROR(e.check_keys());
  RD_RETURN_IF_ERROR(e.field("v", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    // Any integer but 1 is a version we do not speak (a negative one included),
    // not a range error: the client should renegotiate, not fix a field.
    const bool is_int =
        o.type == msgpack::type::POSITIVE_INTEGER || o.type == msgpack::type::NEGATIVE_INTEGER;
    if (!is_int) return wrong_type(p, o, "int");
    if (o.type == msgpack::type::NEGATIVE_INTEGER || o.via.u64 != kProtocolVersion) {
      return error_at(ErrorCode::kUnsupportedVersion, p,
                      "this daemon speaks protocol version " + std::to_string(kProtocolVersion));
    }
    env.v = kProtocolVersion;
    return Status::Ok();
  }));
  RD_RETURN_IF_ERROR(e.integer("id", Need::kRequired, env.id));
  RD_RETURN_IF_ERROR(e.str("type", Need::kRequired, limits.max_string_bytes, env.type));

  static const Path kBody{nullptr, "body"};
  if (const msgpack::object* body = e.find("body"); body != nullptr) {
    return open_map(*body, kBody, out.body);
  }
  out.body.emplace(nullptr, 0, kBody);
  return Status::Ok();
}

// ---- requests ----

Status decode_body(const MapReader& b, const Limits& l, HelloRequest& r) {
  RD_RETURN_IF_ERROR(b.str("client", Need::kOptional, l.max_string_bytes, r.client));
  RD_RETURN_IF_ERROR(b.int_array<uint32_t>("versions", Need::kRequired, l.max_versions, 0,
                                           std::numeric_limits<uint32_t>::max(), r.versions));
  return require_non_empty(b.path("versions"), r.versions.size());
}

Status decode_body(const MapReader&, const Limits&, StatusRequest&) { return Status::Ok(); }

Status decode_body(const MapReader& b, const Limits& l, GenerateRequest& r) {
  RD_RETURN_IF_ERROR(b.str("rid", Need::kRequired, l.max_rid_bytes, r.rid));
  RD_RETURN_IF_ERROR(require_non_empty(b.path("rid"), r.rid.size()));
  RD_RETURN_IF_ERROR(b.int_array<int32_t>("input_ids", Need::kRequired, l.max_input_tokens, 0,
                                          kMaxTokenId, r.input_ids));
  RD_RETURN_IF_ERROR(require_non_empty(b.path("input_ids"), r.input_ids.size()));
  RD_RETURN_IF_ERROR(b.integer<uint32_t>("max_new_tokens", Need::kOptional, 1, l.max_new_tokens,
                                         r.max_new_tokens));
  RD_RETURN_IF_ERROR(b.number("temperature", Need::kOptional, {0.0, 100.0}, r.temperature));
  RD_RETURN_IF_ERROR(b.number("top_p", Need::kOptional, {0.0, 1.0, /*lo_open=*/true}, r.top_p));
  RD_RETURN_IF_ERROR(b.integer<int32_t>("top_k", Need::kOptional, 0, kMaxTokenId, r.top_k));
  RD_RETURN_IF_ERROR(b.number("min_p", Need::kOptional, {0.0, 1.0}, r.min_p));
  RD_RETURN_IF_ERROR(b.nullable_integer("seed", r.seed));
  RD_RETURN_IF_ERROR(b.int_array<int32_t>("stop_token_ids", Need::kOptional, l.max_stop_token_ids,
                                          0, kMaxTokenId, r.stop_token_ids));
  RD_RETURN_IF_ERROR(b.boolean("return_logprob", Need::kOptional, r.return_logprob));
  RD_RETURN_IF_ERROR(b.boolean("return_routed_experts", Need::kOptional, r.return_routed_experts));
  RD_RETURN_IF_ERROR(
      b.integer("routed_experts_start_len", Need::kOptional, r.routed_experts_start_len));
  RD_RETURN_IF_ERROR(b.boolean("stream", Need::kOptional, r.stream));
  RD_RETURN_IF_ERROR(b.integer<uint32_t>("top_logprobs_num", Need::kOptional, 0, kMaxTopLogprobs, r.top_logprobs_num));
  return b.number("deadline_s", Need::kOptional, {0.0, kMaxDeadlineS}, r.deadline_s);
}

Status decode_body(const MapReader& b, const Limits& l, AbortRequest& r) {
  RD_RETURN_IF_ERROR(b.nullable_str("rid", l.max_rid_bytes, r.rid));
  RD_RETURN_IF_ERROR(b.boolean("all", Need::kOptional, r.all));
  if (r.rid.has_value() == r.all) {
    return error_at(ErrorCode::kInvalidArgument, b.path(),
                    r.all ? "give either rid or all=true, not both" : "give rid or all=true");
  }
  return r.rid ? require_non_empty(b.path("rid"), r.rid->size()) : Status::Ok();
}

Status decode_body(const MapReader& b, const Limits&, ShutdownRequest& r) {
  RD_RETURN_IF_ERROR(b.boolean("drain", Need::kOptional, r.drain));
  return b.number("deadline_s", Need::kOptional, {0.0, 3600.0}, r.deadline_s);
}

// ---- weight updates (SPEC §11) ----

// What a request decoder may need besides its body: update_weights checks its
// entries against the payload frame they point into.
struct RequestContext {
  const Limits& limits;
  std::span<const Frame> frames;
};

// The requests without payload frames decode from the limits alone.
template <class T>
Status decode_body(const MapReader& b, const RequestContext& c, T& r) {
  return decode_body(b, c.limits, r);
}

// The first position (in list order) whose name appeared earlier in the list, or
// nullopt. Sorting keeps this O(n log n) for a bucket of 65536 entries. NOTES: names are
// sorted by hash first and compared as strings only within a run of equal hashes (a repeat, or
// a collision): sorting 10,000 names that share a long prefix ("model.layers.") by the strings
// themselves was a third of decoding an update_weights table. A run is sorted by name, so
// colliding names cost O(r log r), never O(r^2).
template <class NameAt>
std::optional<size_t> first_repeated(size_t n, NameAt&& name_at) {
  std::vector<std::pair<size_t, size_t>> hashes;
  hashes.reserve(n);
  for (size_t i = 0; i < n; ++i) hashes.emplace_back(std::hash<std::string_view>{}(name_at(i)), i);
  std::sort(hashes.begin(), hashes.end());
  std::optional<size_t> first;
  std::vector<std::pair<std::string_view, size_t>> run;
  for (size_t a = 0, b = 0; a < hashes.size(); a = b) {
    for (b = a + 1; b < hashes.size() && hashes[b].first == hashes[a].first;) ++b;
    if (b - a < 2) continue;
    run.clear();
    for (size_t k = a; k < b; ++k) run.emplace_back(name_at(hashes[k].second), hashes[k].second);
    std::sort(run.begin(), run.end());
    for (size_t k = 1; k < run.size(); ++k)
      if (run[k].first == run[k - 1].first && (!first || run[k].second < *first)) first = run[k].second;
  }
  return first;
}

// A "nil ok" list of non-empty names (selector prefixes, parameter names). nil, not
// [], means "all": an empty list is refused so that a client bug cannot turn "these
// parameters" into "no parameter" silently.
Status read_name_list(const MapReader& b, std::string_view key, const Limits& l,
                      std::optional<std::vector<std::string>>& out, bool distinct) {
  return b.field(key, Need::kOptional, [&](const msgpack::object& o, const Path& p) {
    if (o.type == msgpack::type::NIL) return Status::Ok();
    std::vector<std::string> names;
    RD_RETURN_IF_ERROR(read_array(
        o, p, l.max_bucket_entries, names,
        [&](const msgpack::object& e, const Path& ep, std::string& name) {
          RD_RETURN_IF_ERROR(read_str(e, ep, l.max_string_bytes, name));
          return require_non_empty(ep, name.size());
        }));
    if (names.empty())
      return error_at(ErrorCode::kInvalidArgument, p, "must not be empty; nil means all");
    if (distinct) {
      if (auto i = first_repeated(names.size(), [&](size_t k) { return std::string_view(names[k]); }))
        return error_at(ErrorCode::kInvalidArgument, p.at(*i), "'" + names[*i] + "' is listed twice");
    }
    out = std::move(names);
    return Status::Ok();
  });
}

Status read_shape(const msgpack::object& o, const Path& p, std::vector<int64_t>& out) {
  return read_array(o, p, kMaxTensorRank, out,
                    [](const msgpack::object& e, const Path& ep, int64_t& dim) {
                      return read_int<int64_t>(e, ep, 0, kMaxTensorDim, dim);
                    });
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// product(shape) * element_bytes, or nullopt when it does not fit 64 bits. A zero
// dimension makes the product 0 whatever the others are (no false overflow).
std::optional<uint64_t> shape_bytes(const std::vector<int64_t>& shape, size_t element_bytes) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t n = element_bytes;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  return n;
}

// ^/[A-Za-z0-9._-]{1,250}$, and not "/." or "/..", which name directories, not objects.
bool is_valid_shm_name(std::string_view name) {
  if (name.size() < 2 || name.size() > 251 || name[0] != '/') return false;
  if (name == "/." || name == "/..") return false;
  return std::all_of(name.begin() + 1, name.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  });
}

Status check_group_name(const Path& p, const std::string& name) {
  if (is_valid_weight_group_name(name)) return Status::Ok();
  return error_at(ErrorCode::kInvalidArgument, p,
                  "'" + name + "' is not a weight-group name: 1 to 64 of A-Z a-z 0-9 . _ -");
}

// The common case of an entry, in one pass over its map: exactly the five keys, each of the
// type SPEC gives, every value in range. True when `e` holds the entry decode_bucket_entry
// would give; false (e possibly half-filled) when anything differs -- an extra or repeated key,
// a wrong type, a bound -- and the generic reader must decode it and name the problem. NOTES:
// a MapReader checks the keys pairwise and finds each field by a scan, a dozen string compares
// per entry before any value is read (issue 7: 10,000 entries per bucket).
bool decode_bucket_entry_fast(const msgpack::object& o, const Limits& l, BucketEntry& e) {
  if (o.type != msgpack::type::MAP || o.via.map.size != 5) return false;
  const msgpack::object *name = nullptr, *dtype = nullptr, *shape = nullptr, *offset = nullptr, *nbytes = nullptr;
  for (uint32_t i = 0; i < 5; ++i) {
    const msgpack::object_kv& kv = o.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) return false;
    const std::string_view k(kv.key.via.str.ptr, kv.key.via.str.size);
    const msgpack::object** slot = k == "name"          ? &name
                                   : k == "dtype"       ? &dtype
                                   : k == "shape"       ? &shape
                                   : k == "byte_offset" ? &offset
                                   : k == "nbytes"      ? &nbytes
                                                        : nullptr;
    if (slot == nullptr || *slot != nullptr) return false;  // unknown or repeated: five keys are all five
    *slot = &kv.val;
  }
  if (name->type != msgpack::type::STR || dtype->type != msgpack::type::STR || shape->type != msgpack::type::ARRAY ||
      offset->type != msgpack::type::POSITIVE_INTEGER || nbytes->type != msgpack::type::POSITIVE_INTEGER)
    return false;
  const std::string_view n(name->via.str.ptr, name->via.str.size), d(dtype->via.str.ptr, dtype->via.str.size);
  if (n.empty() || n.size() > l.max_string_bytes || d.size() > l.max_string_bytes || !is_valid_utf8(n)) return false;
  const std::optional<DType> dt = dtype_from_name(d);  // a known name is ASCII: valid UTF-8
  if (!dt || shape->via.array.size > kMaxTensorRank) return false;
  e.shape.resize(shape->via.array.size);
  for (uint32_t i = 0; i < shape->via.array.size; ++i) {
    const msgpack::object& dim = shape->via.array.ptr[i];
    if (dim.type != msgpack::type::POSITIVE_INTEGER || dim.via.u64 > static_cast<uint64_t>(kMaxTensorDim)) return false;
    e.shape[i] = static_cast<int64_t>(dim.via.u64);
  }
  e.dtype = *dt;
  e.byte_offset = offset->via.u64;
  e.nbytes = nbytes->via.u64;
  const std::optional<uint64_t> expected = shape_bytes(e.shape, dtype_size(e.dtype));
  uint64_t end = 0;
  if (!expected || e.nbytes != *expected || __builtin_add_overflow(e.byte_offset, e.nbytes, &end)) return false;
  e.name.assign(n);
  return true;
}

Status decode_bucket_entry(const MapReader& m, const Limits& l, BucketEntry& e) {
  RD_RETURN_IF_ERROR(m.str("name", Need::kRequired, l.max_string_bytes, e.name));
  RD_RETURN_IF_ERROR(require_non_empty(m.path("name"), e.name.size()));
  std::string dtype;
  RD_RETURN_IF_ERROR(m.str("dtype", Need::kRequired, l.max_string_bytes, dtype));
  const std::optional<DType> dt = dtype_from_name(dtype);
  if (!dt) {
    return error_at(ErrorCode::kInvalidArgument, m.path("dtype"),
                    "unknown dtype '" + dtype + "'; expected a PyTorch or safetensors name");
  }
  e.dtype = *dt;
  RD_RETURN_IF_ERROR(m.field("shape", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_shape(o, p, e.shape);
  }));
  RD_RETURN_IF_ERROR(m.integer("byte_offset", Need::kRequired, e.byte_offset));
  RD_RETURN_IF_ERROR(m.integer("nbytes", Need::kRequired, e.nbytes));
  // float4_e2m1fn_x2 counts stored bytes (pairs), as kernels/dtype.hpp does.
  const std::optional<uint64_t> expected = shape_bytes(e.shape, dtype_size(e.dtype));
  if (!expected) {
    return error_at(ErrorCode::kOutOfRange, m.path("shape"),
                    "shape " + shape_str(e.shape) + " of " + std::string(dtype_name(e.dtype)) +
                        " is more than 2^64 bytes");
  }
  if (e.nbytes != *expected) {
    return error_at(ErrorCode::kInvalidArgument, m.path("nbytes"),
                    std::to_string(e.nbytes) + " bytes, but shape " + shape_str(e.shape) +
                        " of " + std::string(dtype_name(e.dtype)) + " is " +
                        std::to_string(*expected));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(e.byte_offset, e.nbytes, &end)) {
    return error_at(ErrorCode::kOutOfRange, m.path("byte_offset"),
                    "byte_offset + nbytes overflows 64 bits");
  }
  return Status::Ok();
}

Status decode_source(const MapReader& m, const RequestContext& c, BucketSource& out) {
  std::string kind;
  RD_RETURN_IF_ERROR(m.str("kind", Need::kRequired, c.limits.max_string_bytes, kind));
  if (kind == "inline") {
    InlineSource s;
    RD_RETURN_IF_ERROR(m.integer("frame", Need::kRequired, s.frame));
    if (s.frame >= c.frames.size()) {
      return error_at(ErrorCode::kOutOfRange, m.path("frame"),
                      "payload frame " + std::to_string(s.frame) + " of " +
                          std::to_string(c.frames.size()));
    }
    out = s;
    return Status::Ok();
  }
  if (kind == "shm") {
    ShmSource s;
    RD_RETURN_IF_ERROR(m.str("name", Need::kRequired, c.limits.max_string_bytes, s.name));
    if (!is_valid_shm_name(s.name)) {
      return error_at(ErrorCode::kInvalidArgument, m.path("name"),
                      "'" + s.name + "' is not a shared-memory name: '/' then 1 to 250 of "
                                     "A-Z a-z 0-9 . _ -");
    }
    RD_RETURN_IF_ERROR(m.integer("offset", Need::kRequired, s.offset));
    RD_RETURN_IF_ERROR(m.integer("size", Need::kRequired, s.size));
    uint64_t end = 0;
    if (__builtin_add_overflow(s.offset, s.size, &end)) {
      return error_at(ErrorCode::kOutOfRange, m.path("size"), "offset + size overflows 64 bits");
    }
    out = std::move(s);
    return Status::Ok();
  }
  if (kind == "nccl") {
    NcclSource s;
    RD_RETURN_IF_ERROR(m.str("group", Need::kRequired, c.limits.max_string_bytes, s.group));
    RD_RETURN_IF_ERROR(check_group_name(m.path("group"), s.group));
    RD_RETURN_IF_ERROR(m.integer("root", Need::kRequired, s.root));
    RD_RETURN_IF_ERROR(m.integer<uint64_t>("size", Need::kRequired, 0, kMaxDeviceBucketBytes, s.size));
    out = std::move(s);
    return Status::Ok();
  }
  if (kind == "cuda_ipc") {
    CudaIpcSource s;
    RD_RETURN_IF_ERROR(m.bin("handle", Need::kRequired, {kCudaIpcHandleBytes}, s.handle));
    RD_RETURN_IF_ERROR(m.integer("offset", Need::kRequired, s.offset));
    RD_RETURN_IF_ERROR(m.integer<uint64_t>("size", Need::kRequired, 0, kMaxDeviceBucketBytes, s.size));
    uint64_t end = 0;
    if (__builtin_add_overflow(s.offset, s.size, &end)) {
      return error_at(ErrorCode::kOutOfRange, m.path("size"), "offset + size overflows 64 bits");
    }
    RD_RETURN_IF_ERROR(m.bin("device_uuid", Need::kRequired, {kDeviceUuidBytes}, s.device_uuid));
    out = std::move(s);
    return Status::Ok();
  }
  return error_at(ErrorCode::kInvalidArgument, m.path("kind"),
                  "unknown source kind '" + kind + "'; expected inline, shm, nccl or cuda_ipc");
}

// Checks that need every entry: each lies inside the bucket buffer, no two share a
// byte, no name appears twice. Entries were checked one by one already, so
// byte_offset + nbytes does not overflow.
Status check_bucket_layout(const MapReader& b, const UpdateWeightsRequest& r, uint64_t bucket_size,
                           std::string_view bucket) {
  const Path entries = b.path("entries");
  for (size_t i = 0; i < r.entries.size(); ++i) {
    const BucketEntry& e = r.entries[i];
    if (e.byte_offset + e.nbytes > bucket_size) {
      const Path at = entries.at(i);
      return error_at(ErrorCode::kOutOfRange, at.child("byte_offset"),
                      "bytes [" + std::to_string(e.byte_offset) + ", " +
                          std::to_string(e.byte_offset + e.nbytes) + ") lie outside the " +
                          std::string(bucket) + " of " + std::to_string(bucket_size) + " bytes");
    }
  }
  // NOTES: overlapping entries would make the applied values depend on the order
  // the daemon copies them in; sorted by offset, an entry overlaps an earlier one
  // iff it starts before the furthest end seen so far. Empty entries hold no byte.
  std::vector<uint32_t> order;
  order.reserve(r.entries.size());
  for (uint32_t i = 0; i < r.entries.size(); ++i)
    if (r.entries[i].nbytes > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b2) {
    return std::pair(r.entries[a].byte_offset, a) < std::pair(r.entries[b2].byte_offset, b2);
  });
  uint64_t furthest_end = 0;
  uint32_t furthest = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const BucketEntry& e = r.entries[order[k]];
    if (k > 0 && e.byte_offset < furthest_end) {
      const BucketEntry& o = r.entries[furthest];
      return error_at(ErrorCode::kInvalidArgument, entries.at(order[k]),
                      "bytes [" + std::to_string(e.byte_offset) + ", " +
                          std::to_string(e.byte_offset + e.nbytes) + ") overlap entries[" +
                          std::to_string(furthest) + "] ('" + o.name + "') at [" +
                          std::to_string(o.byte_offset) + ", " +
                          std::to_string(o.byte_offset + o.nbytes) + ")");
    }
    if (k == 0 || e.byte_offset + e.nbytes > furthest_end) {
      furthest_end = e.byte_offset + e.nbytes;
      furthest = order[k];
    }
  }
  // Two entries for one parameter: which one wins would be an accident of order.
  if (auto i = first_repeated(r.entries.size(),
                              [&](size_t k) { return std::string_view(r.entries[k].name); })) {
    const Path at = entries.at(*i);
    return error_at(ErrorCode::kInvalidArgument, at.child("name"),
                    "'" + r.entries[*i].name + "' appears earlier in the bucket too");
  }
  return Status::Ok();
}

Status decode_body(const MapReader& b, const Limits& l, BeginWeightUpdateRequest& r) {
  RD_RETURN_IF_ERROR(read_name_list(b, "selector", l, r.selector, /*distinct=*/false));
  return b.number("timeout_s", Need::kOptional, {0.0, 3600.0, /*lo_open=*/true}, r.timeout_s);
}

Status decode_body(const MapReader& b, const RequestContext& c, UpdateWeightsRequest& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  RD_RETURN_IF_ERROR(b.str("load_format", Need::kRequired, l.max_string_bytes, r.load_format));
  if (r.load_format != kFlattenedBucket) {
    return error_at(ErrorCode::kInvalidArgument, b.path("load_format"),
                    "unknown load_format '" + r.load_format + "'; expected flattened_bucket");
  }
  RD_RETURN_IF_ERROR(b.field("entries", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_array(o, p, l.max_bucket_entries, r.entries,
                      [&](const msgpack::object& e, const Path& ep, BucketEntry& entry) {
                        if (decode_bucket_entry_fast(e, l, entry)) return Status::Ok();
                        entry = BucketEntry{};
                        std::optional<MapReader> m;
                        RD_RETURN_IF_ERROR(open_map(e, ep, m));
                        return decode_bucket_entry(*m, l, entry);
                      });
  }));
  RD_RETURN_IF_ERROR(require_non_empty(b.path("entries"), r.entries.size()));
  RD_RETURN_IF_ERROR(nested(b, "source", r.source, [&](const MapReader& m, BucketSource& out) {
    return decode_source(m, c, out);
  }));
  RD_RETURN_IF_ERROR(b.field("checksum", Need::kOptional, [&](const msgpack::object& o, const Path& p) {
    if (o.type == msgpack::type::NIL) return Status::Ok();
    std::optional<MapReader> m;
    RD_RETURN_IF_ERROR(open_map(o, p, m));
    BucketChecksum& sum = r.checksum.emplace();
    RD_RETURN_IF_ERROR(m->str("algo", Need::kRequired, l.max_string_bytes, sum.algo));
    if (sum.algo != kCrc32) {
      return error_at(ErrorCode::kInvalidArgument, m->path("algo"),
                      "unknown checksum algo '" + sum.algo + "'; expected crc32");
    }
    return m->integer("value", Need::kRequired, sum.value);
  }));
  if (const auto* in = std::get_if<InlineSource>(&r.source))
    return check_bucket_layout(b, r, c.frames[in->frame].size(),
                               "payload frame " + std::to_string(in->frame));
  if (const auto* shm = std::get_if<ShmSource>(&r.source))
    return check_bucket_layout(b, r, shm->size, "shared-memory region");
  if (const auto* nccl = std::get_if<NcclSource>(&r.source))
    return check_bucket_layout(b, r, nccl->size, "broadcast buffer");
  return check_bucket_layout(b, r, std::get<CudaIpcSource>(r.source).size, "CUDA IPC range");
}

Status decode_body(const MapReader& b, const Limits&, EndWeightUpdateRequest& r) {
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  return b.integer("weight_version", Need::kRequired, r.weight_version);
}

Status decode_body(const MapReader& b, const Limits&, AbortWeightUpdateRequest& r) {
  return b.integer("session", Need::kRequired, r.session);
}

Status decode_body(const MapReader& b, const Limits& l, GetWeightsByNameRequest& r) {
  RD_RETURN_IF_ERROR(b.str("name", Need::kRequired, l.max_string_bytes, r.name));
  RD_RETURN_IF_ERROR(require_non_empty(b.path("name"), r.name.size()));
  return b.integer<uint32_t>("truncate", Need::kOptional, 0, kMaxGetWeightsTruncate, r.truncate);
}

Status decode_body(const MapReader& b, const Limits& l, WeightsChecksumRequest& r) {
  return read_name_list(b, "names", l, r.names, /*distinct=*/true);
}

Status decode_body(const MapReader& b, const Limits& l, PauseGenerationRequest& r) {
  std::string mode;
  RD_RETURN_IF_ERROR(b.str("mode", Need::kRequired, l.max_string_bytes, mode));
  const std::optional<PauseMode> m = pause_mode_from_name(mode);
  if (!m) {
    return error_at(ErrorCode::kInvalidArgument, b.path("mode"),
                    "unknown mode '" + mode + "'; expected abort, retract or in_place");
  }
  r.mode = *m;
  return Status::Ok();
}

Status decode_body(const MapReader&, const Limits&, ContinueGenerationRequest&) {
  return Status::Ok();
}

Status decode_body(const MapReader& b, const Limits& l, InitWeightGroupRequest& r) {
  RD_RETURN_IF_ERROR(b.str("group", Need::kRequired, l.max_string_bytes, r.group));
  RD_RETURN_IF_ERROR(check_group_name(b.path("group"), r.group));
  RD_RETURN_IF_ERROR(b.bin("unique_id", Need::kRequired, {kNcclUniqueIdBytes}, r.unique_id));
  RD_RETURN_IF_ERROR(b.integer<uint32_t>("world_size", Need::kRequired, kMinWeightGroupSize,
                                         kMaxWeightGroupSize, r.world_size));
  RD_RETURN_IF_ERROR(b.integer("rank", Need::kRequired, r.rank));
  RD_RETURN_IF_ERROR(b.integer("root", Need::kOptional, r.root));
  RD_RETURN_IF_ERROR(b.integer("nccl_version", Need::kRequired, r.nccl_version));
  RD_RETURN_IF_ERROR(
      b.number("timeout_s", Need::kOptional, {0.0, 3600.0, /*lo_open=*/true}, r.timeout_s));
  // Cross-field checks, after every field's own: ranks are positions in the group.
  const std::string world = std::to_string(r.world_size);
  if (r.rank >= r.world_size)
    return error_at(ErrorCode::kOutOfRange, b.path("rank"),
                    "rank " + std::to_string(r.rank) + " is not below world_size " + world);
  if (r.root >= r.world_size)
    return error_at(ErrorCode::kOutOfRange, b.path("root"),
                    "root " + std::to_string(r.root) + " is not below world_size " + world);
  if (r.rank == r.root)
    return error_at(ErrorCode::kInvalidArgument, b.path("rank"),
                    "rank " + std::to_string(r.rank) +
                        " is the root's: the daemon receives, the trainer (root) broadcasts");
  return Status::Ok();
}

Status decode_body(const MapReader& b, const Limits& l, DestroyWeightGroupRequest& r) {
  RD_RETURN_IF_ERROR(b.str("group", Need::kRequired, l.max_string_bytes, r.group));
  return check_group_name(b.path("group"), r.group);
}

// tags: nil (every tag) or 1..3 distinct names from kMemoryTags.
Status read_memory_tags(const MapReader& b, const Limits& l, std::optional<std::vector<std::string>>& out) {
  RD_RETURN_IF_ERROR(read_name_list(b, "tags", l, out, /*distinct=*/true));
  if (!out) return Status::Ok();
  for (size_t i = 0; i < out->size(); ++i)
    if (!is_memory_tag((*out)[i]))
      return error_at(ErrorCode::kInvalidArgument, b.path("tags").at(i),
                      "unknown memory tag '" + (*out)[i] + "'; expected weights, kv_cache or cuda_graph");
  return Status::Ok();
}

Status decode_body(const MapReader& b, const Limits& l, ReleaseMemoryRequest& r) {
  return read_memory_tags(b, l, r.tags);
}

Status decode_body(const MapReader& b, const Limits& l, ResumeMemoryRequest& r) {
  return read_memory_tags(b, l, r.tags);
}

template <class T>
Result<Request> decode_request_as(const MapReader& body, const RequestContext& c) {
  T r;
  RD_RETURN_IF_ERROR(decode_body(body, c, r));
  return Request(std::move(r));
}

using RequestDecoder = Result<Request> (*)(const MapReader&, const RequestContext&);
constexpr std::pair<std::string_view, RequestDecoder> kRequestDecoders[] = {
    {kHello, &decode_request_as<HelloRequest>},
    {kStatus, &decode_request_as<StatusRequest>},
    {kGenerate, &decode_request_as<GenerateRequest>},
    {kAbort, &decode_request_as<AbortRequest>},
    {kShutdown, &decode_request_as<ShutdownRequest>},
    {kBeginWeightUpdate, &decode_request_as<BeginWeightUpdateRequest>},
    {kUpdateWeights, &decode_request_as<UpdateWeightsRequest>},
    {kEndWeightUpdate, &decode_request_as<EndWeightUpdateRequest>},
    {kAbortWeightUpdate, &decode_request_as<AbortWeightUpdateRequest>},
    {kGetWeightsByName, &decode_request_as<GetWeightsByNameRequest>},
    {kWeightsChecksum, &decode_request_as<WeightsChecksumRequest>},
    {kPauseGeneration, &decode_request_as<PauseGenerationRequest>},
    {kContinueGeneration, &decode_request_as<ContinueGenerationRequest>},
    {kInitWeightGroup, &decode_request_as<InitWeightGroupRequest>},
    {kDestroyWeightGroup, &decode_request_as<DestroyWeightGroupRequest>},
    {kReleaseMemory, &decode_request_as<ReleaseMemoryRequest>},
    {kResumeMemory, &decode_request_as<ResumeMemoryRequest>},
};

// ---- replies and events ----

struct IncomingContext {
  const Limits& limits;
  std::span<const Frame> frames;
};

Status decode_model(const MapReader& m, const Limits& l, ModelInfo& r) {
  RD_RETURN_IF_ERROR(m.str("name", Need::kRequired, l.max_string_bytes, r.name));
  RD_RETURN_IF_ERROR(m.str("family", Need::kRequired, l.max_string_bytes, r.family));
  RD_RETURN_IF_ERROR(m.integer("vocab_size", Need::kRequired, r.vocab_size));
  RD_RETURN_IF_ERROR(m.integer("num_layers", Need::kRequired, r.num_layers));
  RD_RETURN_IF_ERROR(m.integer("num_moe_layers", Need::kRequired, r.num_moe_layers));
  RD_RETURN_IF_ERROR(m.integer("num_experts", Need::kRequired, r.num_experts));
  RD_RETURN_IF_ERROR(m.integer("top_k", Need::kRequired, r.top_k));
  return m.str("routed_experts_dtype", Need::kRequired, l.max_string_bytes, r.routed_experts_dtype);
}

Status decode_limits(const MapReader& m, Limits& r) {
  RD_RETURN_IF_ERROR(m.integer("max_envelope_bytes", Need::kRequired, r.max_envelope_bytes));
  RD_RETURN_IF_ERROR(m.integer("max_frame_bytes", Need::kRequired, r.max_frame_bytes));
  RD_RETURN_IF_ERROR(m.integer("max_frames", Need::kRequired, r.max_frames));
  RD_RETURN_IF_ERROR(m.integer("max_rid_bytes", Need::kRequired, r.max_rid_bytes));
  RD_RETURN_IF_ERROR(m.integer("max_string_bytes", Need::kRequired, r.max_string_bytes));
  RD_RETURN_IF_ERROR(m.integer("max_input_tokens", Need::kRequired, r.max_input_tokens));
  RD_RETURN_IF_ERROR(m.integer("max_new_tokens", Need::kRequired, r.max_new_tokens));
  RD_RETURN_IF_ERROR(m.integer("max_stop_token_ids", Need::kRequired, r.max_stop_token_ids));
  RD_RETURN_IF_ERROR(m.integer("max_versions", Need::kRequired, r.max_versions));
  // Added with the weight-update messages: a daemon from before them omits it.
  return m.integer("max_bucket_entries", Need::kOptional, r.max_bucket_entries);
}

Status decode_error_info(const MapReader& m, const Limits& l, ErrorInfo& r) {
  // Codes are an open set (SPEC §4.3): a newer daemon's code is passed through.
  RD_RETURN_IF_ERROR(m.str("code", Need::kRequired, l.max_string_bytes, r.code));
  RD_RETURN_IF_ERROR(m.str("message", Need::kRequired, l.max_string_bytes, r.message));
  return m.str("field", Need::kRequired, l.max_string_bytes, r.field);
}

Status decode_body(const MapReader& b, const IncomingContext& c, HelloReply& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.integer("version", Need::kRequired, r.version));
  RD_RETURN_IF_ERROR(b.str("daemon", Need::kRequired, l.max_string_bytes, r.daemon));
  RD_RETURN_IF_ERROR(b.str("build", Need::kRequired, l.max_string_bytes, r.build));
  RD_RETURN_IF_ERROR(b.integer("gpu", Need::kRequired, r.gpu));
  RD_RETURN_IF_ERROR(nested(b, "model", r.model, [&](const MapReader& m, ModelInfo& out) {
    return decode_model(m, l, out);
  }));
  RD_RETURN_IF_ERROR(b.integer("weight_version", Need::kRequired, r.weight_version));
  RD_RETURN_IF_ERROR(nested(b, "limits", r.limits, decode_limits));
  // Added with the GPU weight transports (SPEC §11.7): an older daemon omits both.
  RD_RETURN_IF_ERROR(b.integer("nccl_version", Need::kOptional, r.nccl_version));
  return b.bin("device_uuid", Need::kOptional, {0, kDeviceUuidBytes}, r.device_uuid);
}

Status decode_body(const MapReader& b, const IncomingContext& c, StatusReply& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.str("state", Need::kRequired, l.max_string_bytes, r.state));
  RD_RETURN_IF_ERROR(b.boolean("ready", Need::kRequired, r.ready));
  RD_RETURN_IF_ERROR(b.str("reason", Need::kRequired, l.max_string_bytes, r.reason));
  RD_RETURN_IF_ERROR(b.integer("weight_version", Need::kRequired, r.weight_version));
  RD_RETURN_IF_ERROR(b.integer("num_waiting", Need::kRequired, r.num_waiting));
  RD_RETURN_IF_ERROR(b.integer("num_running", Need::kRequired, r.num_running));
  RD_RETURN_IF_ERROR(b.integer("num_requests_total", Need::kRequired, r.num_requests_total));
  RD_RETURN_IF_ERROR(
      b.integer("num_tokens_generated_total", Need::kRequired, r.num_tokens_generated_total));
  RD_RETURN_IF_ERROR(b.number("uptime_s", Need::kRequired, {}, r.uptime_s));
  RD_RETURN_IF_ERROR(b.str("build", Need::kRequired, l.max_string_bytes, r.build));
  RD_RETURN_IF_ERROR(nested(b, "model", r.model, [&](const MapReader& m, ModelInfo& out) {
    return decode_model(m, l, out);
  }));
  // Added with the weight-update messages: a daemon from before them omits both.
  RD_RETURN_IF_ERROR(b.boolean("paused", Need::kOptional, r.paused));
  return b.integer("update_session", Need::kOptional, r.update_session);
}

Status decode_body(const MapReader& b, const IncomingContext& c, GenerateReply& r) {
  return b.str("rid", Need::kRequired, c.limits.max_rid_bytes, r.rid);
}

Status decode_body(const MapReader& b, const IncomingContext&, AbortReply& r) {
  return b.integer("num_aborted", Need::kRequired, r.num_aborted);
}

Status decode_body(const MapReader& b, const IncomingContext&, ShutdownReply& r) {
  return b.boolean("accepted", Need::kRequired, r.accepted);
}

Status decode_body(const MapReader& b, const IncomingContext& c, ErrorInfo& r) {
  return decode_error_info(b, c.limits, r);
}

Status decode_routed_experts(const MapReader& m, const IncomingContext& c, RoutedExperts& r) {
  RD_RETURN_IF_ERROR(m.str("dtype", Need::kRequired, c.limits.max_string_bytes, r.dtype));
  const size_t element_bytes = routed_experts_dtype_size(r.dtype);
  if (element_bytes == 0) {
    return error_at(ErrorCode::kInvalidArgument, m.path("dtype"),
                    "unknown dtype '" + r.dtype + "'; expected uint8, uint16 or int32");
  }
  RD_RETURN_IF_ERROR(m.integer("num_tokens", Need::kRequired, r.num_tokens));
  RD_RETURN_IF_ERROR(m.integer("num_layers", Need::kRequired, r.num_layers));
  RD_RETURN_IF_ERROR(m.integer("top_k", Need::kRequired, r.top_k));
  RD_RETURN_IF_ERROR(m.integer("start_pos", Need::kRequired, r.start_pos));
  std::optional<uint32_t> frame;
  RD_RETURN_IF_ERROR(m.nullable_integer("frame", frame));

  // Three uint32 factors and a size can exceed 64 bits; a wrapped product could
  // match a small frame and let a reader index past it.
  uint64_t expected = 0;
  if (__builtin_mul_overflow(uint64_t{r.num_tokens} * r.num_layers, r.top_k, &expected) ||
      __builtin_mul_overflow(expected, element_bytes, &expected)) {
    return error_at(ErrorCode::kOutOfRange, m.path(), "num_tokens*num_layers*top_k overflows");
  }
  if (!frame) {
    if (expected != 0) {
      return error_at(ErrorCode::kMissingField, m.path("frame"),
                      std::to_string(expected) + " bytes of rows need a payload frame");
    }
    r.data.clear();
    return Status::Ok();
  }
  if (*frame >= c.frames.size()) {
    return error_at(
        ErrorCode::kOutOfRange, m.path("frame"),
        "payload frame " + std::to_string(*frame) + " of " + std::to_string(c.frames.size()));
  }
  const Frame bytes = c.frames[*frame];
  if (bytes.size() != expected) {
    return error_at(ErrorCode::kInvalidArgument, m.path("frame"),
                    "frame holds " + std::to_string(bytes.size()) + " bytes, shape needs " +
                        std::to_string(expected));
  }
  r.data.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return Status::Ok();
}

Status decode_body(const MapReader& b, const IncomingContext& c, TokensEvent& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.str("rid", Need::kRequired, l.max_rid_bytes, r.rid));
  RD_RETURN_IF_ERROR(b.int_array<int32_t>("token_ids", Need::kRequired, l.max_new_tokens, 0,
                                          kMaxTokenId, r.token_ids));
  RD_RETURN_IF_ERROR(
      b.field("logprobs", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
        // Any float: a client should see what the sampler produced, even -inf.
        return read_array(o, p, l.max_new_tokens, r.logprobs, read_number);
      }));
  if (!r.logprobs.empty() && r.logprobs.size() != r.token_ids.size()) {
    return error_at(ErrorCode::kInvalidArgument, b.path("logprobs"),
                    std::to_string(r.logprobs.size()) + " logprobs for " +
                        std::to_string(r.token_ids.size()) + " tokens");
  }
  RD_RETURN_IF_ERROR(b.int_array<uint64_t>("weight_versions", Need::kRequired, l.max_new_tokens, 0,
                                           std::numeric_limits<uint64_t>::max(),
                                           r.weight_versions));
  if (r.weight_versions.size() != r.token_ids.size()) {
    return error_at(ErrorCode::kInvalidArgument, b.path("weight_versions"),
                    std::to_string(r.weight_versions.size()) + " weight versions for " +
                        std::to_string(r.token_ids.size()) + " tokens");
  }
  RD_RETURN_IF_ERROR(b.field("routed_experts", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    if (o.type == msgpack::type::NIL) return Status::Ok();
    std::optional<MapReader> m;
    RD_RETURN_IF_ERROR(open_map(o, p, m));
    return decode_routed_experts(*m, c, r.routed_experts.emplace());
  }));
  // Top log-probs (SPEC §4.3): present only for requests that asked; n entries per token.
  RD_RETURN_IF_ERROR(b.integer<uint32_t>("top_logprobs_num", Need::kOptional, 0, kMaxTopLogprobs, r.top_logprobs_num));
  const size_t want = r.token_ids.size() * r.top_logprobs_num;
  RD_RETURN_IF_ERROR(b.int_array<int32_t>("top_token_ids", Need::kOptional,
                                          size_t{l.max_new_tokens} * kMaxTopLogprobs, 0, kMaxTokenId,
                                          r.top_token_ids));
  RD_RETURN_IF_ERROR(b.field("top_logprobs", Need::kOptional, [&](const msgpack::object& o, const Path& p) {
    return read_array(o, p, size_t{l.max_new_tokens} * kMaxTopLogprobs, r.top_logprobs, read_number);
  }));
  for (auto [n, key] : {std::pair{r.top_token_ids.size(), "top_token_ids"}, std::pair{r.top_logprobs.size(), "top_logprobs"}})
    if (n != want)
      return error_at(ErrorCode::kInvalidArgument, b.path(key),
                      std::to_string(n) + " entries for " + std::to_string(r.token_ids.size()) + " tokens of " +
                          std::to_string(r.top_logprobs_num) + " (top_logprobs_num)");
  return Status::Ok();
}

Status decode_body(const MapReader& b, const IncomingContext& c, FinishedEvent& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.str("rid", Need::kRequired, l.max_rid_bytes, r.rid));
  RD_RETURN_IF_ERROR(b.str("reason", Need::kRequired, l.max_string_bytes, r.reason));
  if (r.reason != "stop" && r.reason != "length" && r.reason != "abort") {
    return error_at(ErrorCode::kInvalidArgument, b.path("reason"),
                    "unknown reason '" + r.reason + "'; expected stop, length or abort");
  }
  RD_RETURN_IF_ERROR(b.str("abort_reason", Need::kRequired, l.max_string_bytes, r.abort_reason));
  RD_RETURN_IF_ERROR(b.integer("prompt_tokens", Need::kRequired, r.prompt_tokens));
  return b.integer("completion_tokens", Need::kRequired, r.completion_tokens);
}

Status decode_body(const MapReader& b, const IncomingContext& c, FailedEvent& r) {
  RD_RETURN_IF_ERROR(b.str("rid", Need::kRequired, c.limits.max_rid_bytes, r.rid));
  return nested(b, "error", r.error, [&](const MapReader& m, ErrorInfo& out) {
    return decode_error_info(m, c.limits, out);
  });
}

Status decode_body(const MapReader& b, const IncomingContext&, BeginWeightUpdateReply& r) {
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  RD_RETURN_IF_ERROR(b.integer("weight_version", Need::kRequired, r.weight_version));
  return b.integer("num_parameters_restored", Need::kRequired, r.num_parameters_restored);
}

Status decode_body(const MapReader& b, const IncomingContext&, UpdateWeightsReply& r) {
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  RD_RETURN_IF_ERROR(b.integer("num_entries", Need::kRequired, r.num_entries));
  RD_RETURN_IF_ERROR(b.integer("num_bytes", Need::kRequired, r.num_bytes));
  return b.number("duration_s", Need::kRequired, {}, r.duration_s);
}

Status decode_body(const MapReader& b, const IncomingContext&, EndWeightUpdateReply& r) {
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  RD_RETURN_IF_ERROR(b.integer("weight_version", Need::kRequired, r.weight_version));
  RD_RETURN_IF_ERROR(b.integer("num_buckets", Need::kRequired, r.num_buckets));
  RD_RETURN_IF_ERROR(b.integer("num_entries", Need::kRequired, r.num_entries));
  RD_RETURN_IF_ERROR(b.integer("num_bytes", Need::kRequired, r.num_bytes));
  RD_RETURN_IF_ERROR(b.integer("num_parameters_updated", Need::kRequired, r.num_parameters_updated));
  RD_RETURN_IF_ERROR(b.number("duration_s", Need::kRequired, {}, r.duration_s));
  return b.number("postprocess_s", Need::kRequired, {}, r.postprocess_s);
}

Status decode_body(const MapReader& b, const IncomingContext& c, AbortWeightUpdateReply& r) {
  RD_RETURN_IF_ERROR(b.integer("session", Need::kRequired, r.session));
  // An open set, like status.ok.state: a newer daemon's value is passed through.
  return b.str("state", Need::kRequired, c.limits.max_string_bytes, r.state);
}

Status decode_body(const MapReader& b, const IncomingContext& c, GetWeightsByNameReply& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.str("name", Need::kRequired, l.max_string_bytes, r.name));
  RD_RETURN_IF_ERROR(b.str("dtype", Need::kRequired, l.max_string_bytes, r.dtype));
  RD_RETURN_IF_ERROR(b.field("shape", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_shape(o, p, r.shape);
  }));
  return b.field("values", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    // Any float: a parameter may hold NaN or infinities, and a check must show them.
    return read_array(o, p, kMaxGetWeightsTruncate, r.values, read_number);
  });
}

Status decode_parameter_checksum(const MapReader& m, const Limits& l, ParameterChecksum& r) {
  RD_RETURN_IF_ERROR(m.str("name", Need::kRequired, l.max_string_bytes, r.name));
  RD_RETURN_IF_ERROR(m.str("dtype", Need::kRequired, l.max_string_bytes, r.dtype));
  RD_RETURN_IF_ERROR(m.field("shape", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_shape(o, p, r.shape);
  }));
  return m.integer("checksum", Need::kRequired, r.checksum);
}

Status decode_body(const MapReader& b, const IncomingContext& c, WeightsChecksumReply& r) {
  const Limits& l = c.limits;
  RD_RETURN_IF_ERROR(b.str("algo", Need::kRequired, l.max_string_bytes, r.algo));
  if (r.algo != kCrc32) {
    return error_at(ErrorCode::kInvalidArgument, b.path("algo"),
                    "unknown checksum algo '" + r.algo + "'; expected crc32");
  }
  RD_RETURN_IF_ERROR(b.integer("weight_version", Need::kRequired, r.weight_version));
  RD_RETURN_IF_ERROR(b.integer("model_checksum", Need::kRequired, r.model_checksum));
  return b.field("parameters", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_array(o, p, l.max_bucket_entries, r.parameters,
                      [&](const msgpack::object& e, const Path& ep, ParameterChecksum& out) {
                        std::optional<MapReader> m;
                        RD_RETURN_IF_ERROR(open_map(e, ep, m));
                        return decode_parameter_checksum(*m, l, out);
                      });
  });
}

Status decode_body(const MapReader& b, const IncomingContext&, PauseGenerationReply& r) {
  RD_RETURN_IF_ERROR(b.integer("num_aborted", Need::kRequired, r.num_aborted));
  RD_RETURN_IF_ERROR(b.integer("num_retracted", Need::kRequired, r.num_retracted));
  return b.integer("num_paused", Need::kRequired, r.num_paused);
}

Status decode_body(const MapReader& b, const IncomingContext&, ContinueGenerationReply& r) {
  return b.integer("num_resumed", Need::kRequired, r.num_resumed);
}

Status decode_body(const MapReader& b, const IncomingContext& c, RetractedEvent& r) {
  RD_RETURN_IF_ERROR(b.str("rid", Need::kRequired, c.limits.max_rid_bytes, r.rid));
  RD_RETURN_IF_ERROR(b.integer("num_tokens_discarded", Need::kRequired, r.num_tokens_discarded));
  return b.str("reason", Need::kRequired, c.limits.max_string_bytes, r.reason);
}

Status decode_body(const MapReader& b, const IncomingContext& c, InitWeightGroupReply& r) {
  RD_RETURN_IF_ERROR(b.str("group", Need::kRequired, c.limits.max_string_bytes, r.group));
  RD_RETURN_IF_ERROR(b.integer("nccl_version", Need::kRequired, r.nccl_version));
  RD_RETURN_IF_ERROR(b.integer("rank", Need::kRequired, r.rank));
  RD_RETURN_IF_ERROR(b.integer("world_size", Need::kRequired, r.world_size));
  return b.number("duration_s", Need::kRequired, {}, r.duration_s);
}

Status decode_body(const MapReader& b, const IncomingContext& c, DestroyWeightGroupReply& r) {
  return b.str("group", Need::kRequired, c.limits.max_string_bytes, r.group);
}

template <class T>
Status decode_memory_reply(const MapReader& b, const IncomingContext& c, T& r) {
  RD_RETURN_IF_ERROR(b.field("tags", Need::kRequired, [&](const msgpack::object& o, const Path& p) {
    return read_array(o, p, kMaxMemoryTags, r.tags, [&](const msgpack::object& e, const Path& ep, std::string& t) {
      return read_str(e, ep, c.limits.max_string_bytes, t);
    });
  }));
  RD_RETURN_IF_ERROR(b.integer("num_bytes", Need::kRequired, r.num_bytes));
  return b.number("duration_s", Need::kRequired, {}, r.duration_s);
}

Status decode_body(const MapReader& b, const IncomingContext& c, ReleaseMemoryReply& r) {
  return decode_memory_reply(b, c, r);
}

Status decode_body(const MapReader& b, const IncomingContext& c, ResumeMemoryReply& r) {
  return decode_memory_reply(b, c, r);
}

template <class T>
Result<Incoming> decode_incoming_as(const MapReader& body, const IncomingContext& c) {
  T r;
  RD_RETURN_IF_ERROR(decode_body(body, c, r));
  return Incoming(std::move(r));
}

using IncomingDecoder = Result<Incoming> (*)(const MapReader&, const IncomingContext&);
constexpr std::pair<std::string_view, IncomingDecoder> kIncomingDecoders[] = {
    {kHelloOk, &decode_incoming_as<HelloReply>},
    {kStatusOk, &decode_incoming_as<StatusReply>},
    {kGenerateOk, &decode_incoming_as<GenerateReply>},
    {kAbortOk, &decode_incoming_as<AbortReply>},
    {kShutdownOk, &decode_incoming_as<ShutdownReply>},
    {kError, &decode_incoming_as<ErrorInfo>},
    {kTokens, &decode_incoming_as<TokensEvent>},
    {kFinished, &decode_incoming_as<FinishedEvent>},
    {kFailed, &decode_incoming_as<FailedEvent>},
    {kBeginWeightUpdateOk, &decode_incoming_as<BeginWeightUpdateReply>},
    {kUpdateWeightsOk, &decode_incoming_as<UpdateWeightsReply>},
    {kEndWeightUpdateOk, &decode_incoming_as<EndWeightUpdateReply>},
    {kAbortWeightUpdateOk, &decode_incoming_as<AbortWeightUpdateReply>},
    {kGetWeightsByNameOk, &decode_incoming_as<GetWeightsByNameReply>},
    {kWeightsChecksumOk, &decode_incoming_as<WeightsChecksumReply>},
    {kPauseGenerationOk, &decode_incoming_as<PauseGenerationReply>},
    {kContinueGenerationOk, &decode_incoming_as<ContinueGenerationReply>},
    {kRetracted, &decode_incoming_as<RetractedEvent>},
    {kInitWeightGroupOk, &decode_incoming_as<InitWeightGroupReply>},
    {kDestroyWeightGroupOk, &decode_incoming_as<DestroyWeightGroupReply>},
    {kReleaseMemoryOk, &decode_incoming_as<ReleaseMemoryReply>},
    {kResumeMemoryOk, &decode_incoming_as<ResumeMemoryReply>},
};

template <class Decoder, size_t N>
Decoder find_decoder(const std::pair<std::string_view, Decoder> (&table)[N],
                     std::string_view type) {
  for (const auto& [name, decoder] : table)
    if (name == type) return decoder;
  return nullptr;
}

Status unknown_type(std::string_view type) {
  return Status(ErrorCode::kUnknownType, "unknown message type '" + std::string(type) + "'",
                "type");
}

// ------------------------------------------------------------- encoding ----

// msgpack-c's packer plus a float64 writer of our own: msgpack-c 4.x packs a
// double with an integral value (1.0, 0.0, even -0.0) as an int, while SPEC
// (and Python's msgpack) write float64, so goldens like temperature=0.0 would
// not round-trip and -0.0 would lose its sign.
class Packer {
 public:
  explicit Packer(msgpack::sbuffer& buffer) : buffer_(buffer), pk_(buffer) {}
  msgpack::packer<msgpack::sbuffer>& msgpack() { return pk_; }
  void float64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    char out[9];
    out[0] = static_cast<char>(0xcb);
    for (int i = 0; i < 8; ++i) out[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
    buffer_.write(out, sizeof(out));
  }

 private:
  msgpack::sbuffer& buffer_;
  msgpack::packer<msgpack::sbuffer> pk_;
};

// Raw bytes written as msgpack bin (handles, ids, uuids); plain strings are str.
struct BinBytes {
  std::string_view bytes;
};

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};
template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};

// One writer for every value type, chosen at compile time, so a string literal
// can never turn into a bool and an int32 never into a negative-family int.
template <class T>
void write(Packer& packer, const T& v) {
  auto& pk = packer.msgpack();
  if constexpr (std::is_same_v<T, bool>) {
    v ? pk.pack_true() : pk.pack_false();
  } else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T>) {
    pk.pack_uint64(v);
  } else if constexpr (std::is_integral_v<T>) {
    // Python's msgpack writes every non-negative int in the positive family;
    // matching it keeps C++ and Python encodings byte-identical.
    if (v >= 0)
      pk.pack_uint64(static_cast<uint64_t>(v));
    else
      pk.pack_int64(v);
  } else if constexpr (std::is_same_v<T, double>) {
    packer.float64(v);
  } else if constexpr (std::is_same_v<T, BinBytes>) {
    pk.pack_bin(static_cast<uint32_t>(v.bytes.size()));
    pk.pack_bin_body(v.bytes.data(), static_cast<uint32_t>(v.bytes.size()));
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    const std::string_view s(v);
    pk.pack_str(static_cast<uint32_t>(s.size()));
    pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
  } else if constexpr (IsVector<T>::value) {
    pk.pack_array(static_cast<uint32_t>(v.size()));
    for (const auto& e : v) write(packer, e);
  } else if constexpr (IsOptional<T>::value) {
    if (v)
      write(packer, *v);
    else
      pk.pack_nil();
  } else {
    static_assert(!sizeof(T), "no msgpack writer for this type");
  }
}

// Writes one map of a fixed number of fields. The count goes into the map header
// before the fields, so a mismatch would corrupt everything after it: the
// destructor checks that exactly that many fields were written.
class MapWriter {
 public:
  MapWriter(Packer& pk, uint32_t num_fields) : pk_(pk), remaining_(num_fields) {
    pk_.msgpack().pack_map(num_fields);
  }
  ~MapWriter() { assert(remaining_ == 0 && "map header count differs from fields written"); }
  MapWriter(const MapWriter&) = delete;
  MapWriter& operator=(const MapWriter&) = delete;

  template <class T>
  MapWriter& put(std::string_view key, const T& value) {
    write_key(key);
    write(pk_, value);
    return *this;
  }
  // For a nested value written by the caller right after this call.
  Packer& key(std::string_view key) {
    write_key(key);
    return pk_;
  }

 private:
  void write_key(std::string_view key) {
    assert(remaining_ > 0 && "more fields than the map header announced");
    --remaining_;
    write(pk_, key);
  }
  Packer& pk_;
  uint32_t remaining_;
};

// Envelope {v, type, id, body}; `body(packer, frames)` writes the body map and
// appends any payload frames.
template <class WriteBody>
WireMessage encode_message(std::string_view type, uint64_t id, WriteBody&& body) {
  WireMessage msg;
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  {
    MapWriter envelope(pk, 4);
    envelope.put("v", kProtocolVersion).put("type", type).put("id", id);
    body(envelope.key("body"), msg.frames);
  }
  msg.envelope.assign(buffer.data(), buffer.size());
  return msg;
}

// Field order below is SPEC §4's order; golden files pin it.

void write_body(Packer& pk, const HelloRequest& r) {
  MapWriter(pk, 2).put("client", r.client).put("versions", r.versions);
}
void write_body(Packer& pk, const StatusRequest&) { MapWriter(pk, 0); }
void write_body(Packer& pk, const GenerateRequest& r) {
  // deadline_s: any value but 0 is written, so a negative or NaN one is refused by the daemon
  // rather than dropped here.
  MapWriter w(pk, 13 + (r.top_logprobs_num > 0 ? 1 : 0) + (r.deadline_s != 0 ? 1 : 0));
  w.put("rid", r.rid)
      .put("input_ids", r.input_ids)
      .put("max_new_tokens", r.max_new_tokens)
      .put("temperature", r.temperature)
      .put("top_p", r.top_p)
      .put("top_k", r.top_k)
      .put("min_p", r.min_p)
      .put("seed", r.seed)
      .put("stop_token_ids", r.stop_token_ids)
      .put("return_logprob", r.return_logprob)
      .put("return_routed_experts", r.return_routed_experts)
      .put("routed_experts_start_len", r.routed_experts_start_len)
      .put("stream", r.stream);
  if (r.top_logprobs_num > 0) w.put("top_logprobs_num", r.top_logprobs_num);
  if (r.deadline_s != 0) w.put("deadline_s", r.deadline_s);
}
void write_body(Packer& pk, const AbortRequest& r) {
  // rid is omitted rather than nil when absent (SPEC §4.1).
  MapWriter w(pk, r.rid ? 2 : 1);
  if (r.rid) w.put("rid", *r.rid);
  w.put("all", r.all);
}
void write_body(Packer& pk, const ShutdownRequest& r) {
  MapWriter(pk, 2).put("drain", r.drain).put("deadline_s", r.deadline_s);
}

void write_body(Packer& pk, const BeginWeightUpdateRequest& r) {
  MapWriter(pk, 2).put("selector", r.selector).put("timeout_s", r.timeout_s);
}

void write_bucket_entry(Packer& pk, const BucketEntry& e) {
  MapWriter(pk, 5)
      .put("name", e.name)
      .put("dtype", dtype_name(e.dtype))
      .put("shape", e.shape)
      .put("byte_offset", e.byte_offset)
      .put("nbytes", e.nbytes);
}

void write_body(Packer& pk, const UpdateWeightsRequest& r) {
  MapWriter w(pk, 5);
  w.put("session", r.session).put("load_format", r.load_format);
  Packer& entries = w.key("entries");
  entries.msgpack().pack_array(static_cast<uint32_t>(r.entries.size()));
  for (const BucketEntry& e : r.entries) write_bucket_entry(entries, e);
  Packer& source = w.key("source");
  if (const auto* in = std::get_if<InlineSource>(&r.source)) {
    MapWriter(source, 2).put("kind", "inline").put("frame", in->frame);
  } else if (const auto* shm = std::get_if<ShmSource>(&r.source)) {
    MapWriter(source, 4)
        .put("kind", "shm")
        .put("name", shm->name)
        .put("offset", shm->offset)
        .put("size", shm->size);
  } else if (const auto* nccl = std::get_if<NcclSource>(&r.source)) {
    MapWriter(source, 4)
        .put("kind", "nccl")
        .put("group", nccl->group)
        .put("root", nccl->root)
        .put("size", nccl->size);
  } else {
    const auto& ipc = std::get<CudaIpcSource>(r.source);
    MapWriter(source, 5)
        .put("kind", "cuda_ipc")
        .put("handle", BinBytes{ipc.handle})
        .put("offset", ipc.offset)
        .put("size", ipc.size)
        .put("device_uuid", BinBytes{ipc.device_uuid});
  }
  Packer& checksum = w.key("checksum");
  if (r.checksum)
    MapWriter(checksum, 2).put("algo", r.checksum->algo).put("value", r.checksum->value);
  else
    checksum.msgpack().pack_nil();
}

void write_body(Packer& pk, const EndWeightUpdateRequest& r) {
  MapWriter(pk, 2).put("session", r.session).put("weight_version", r.weight_version);
}
void write_body(Packer& pk, const AbortWeightUpdateRequest& r) {
  MapWriter(pk, 1).put("session", r.session);
}
void write_body(Packer& pk, const GetWeightsByNameRequest& r) {
  MapWriter(pk, 2).put("name", r.name).put("truncate", r.truncate);
}
void write_body(Packer& pk, const WeightsChecksumRequest& r) {
  MapWriter(pk, 1).put("names", r.names);
}
void write_body(Packer& pk, const PauseGenerationRequest& r) {
  MapWriter(pk, 1).put("mode", pause_mode_name(r.mode));
}
void write_body(Packer& pk, const ContinueGenerationRequest&) { MapWriter(pk, 0); }
void write_body(Packer& pk, const InitWeightGroupRequest& r) {
  MapWriter(pk, 7)
      .put("group", r.group)
      .put("unique_id", BinBytes{r.unique_id})
      .put("world_size", r.world_size)
      .put("rank", r.rank)
      .put("root", r.root)
      .put("nccl_version", r.nccl_version)
      .put("timeout_s", r.timeout_s);
}
void write_body(Packer& pk, const DestroyWeightGroupRequest& r) {
  MapWriter(pk, 1).put("group", r.group);
}
void write_body(Packer& pk, const ReleaseMemoryRequest& r) { MapWriter(pk, 1).put("tags", r.tags); }
void write_body(Packer& pk, const ResumeMemoryRequest& r) { MapWriter(pk, 1).put("tags", r.tags); }

void write_model(Packer& pk, const ModelInfo& m) {
  MapWriter(pk, 8)
      .put("name", m.name)
      .put("family", m.family)
      .put("vocab_size", m.vocab_size)
      .put("num_layers", m.num_layers)
      .put("num_moe_layers", m.num_moe_layers)
      .put("num_experts", m.num_experts)
      .put("top_k", m.top_k)
      .put("routed_experts_dtype", m.routed_experts_dtype);
}

void write_limits(Packer& pk, const Limits& l) {
  MapWriter(pk, 10)
      .put("max_envelope_bytes", l.max_envelope_bytes)
      .put("max_frame_bytes", l.max_frame_bytes)
      .put("max_frames", l.max_frames)
      .put("max_rid_bytes", l.max_rid_bytes)
      .put("max_string_bytes", l.max_string_bytes)
      .put("max_input_tokens", l.max_input_tokens)
      .put("max_new_tokens", l.max_new_tokens)
      .put("max_stop_token_ids", l.max_stop_token_ids)
      .put("max_versions", l.max_versions)
      .put("max_bucket_entries", l.max_bucket_entries);
}

void write_error_info(Packer& pk, const ErrorInfo& e) {
  MapWriter(pk, 3).put("code", e.code).put("message", e.message).put("field", e.field);
}

void write_routed_experts(Packer& pk, const RoutedExperts& r, std::vector<std::string>& frames) {
  assert(r.data.size() ==
             uint64_t{r.num_tokens} * r.num_layers * r.top_k * routed_experts_dtype_size(r.dtype) &&
         "routed-expert bytes do not match their shape");
  std::optional<uint32_t> frame;
  if (!r.data.empty()) {
    frame = static_cast<uint32_t>(frames.size());
    frames.push_back(r.data);
  }
  MapWriter(pk, 6)
      .put("dtype", r.dtype)
      .put("num_tokens", r.num_tokens)
      .put("num_layers", r.num_layers)
      .put("top_k", r.top_k)
      .put("start_pos", r.start_pos)
      .put("frame", frame);
}

std::string_view event_type(const TokensEvent&) { return kTokens; }
std::string_view event_type(const FinishedEvent&) { return kFinished; }
std::string_view event_type(const FailedEvent&) { return kFailed; }
std::string_view event_type(const RetractedEvent&) { return kRetracted; }

void write_event(Packer& pk, const TokensEvent& e, std::vector<std::string>& frames) {
  MapWriter w(pk, e.top_logprobs_num > 0 ? 8 : 5);
  w.put("rid", e.rid)
      .put("token_ids", e.token_ids)
      .put("logprobs", e.logprobs)
      .put("weight_versions", e.weight_versions);
  Packer& re = w.key("routed_experts");
  if (e.routed_experts)
    write_routed_experts(re, *e.routed_experts, frames);
  else
    re.msgpack().pack_nil();
  if (e.top_logprobs_num > 0)
    w.put("top_logprobs_num", e.top_logprobs_num).put("top_token_ids", e.top_token_ids).put("top_logprobs", e.top_logprobs);
}
void write_event(Packer& pk, const FinishedEvent& e, std::vector<std::string>&) {
  MapWriter(pk, 5)
      .put("rid", e.rid)
      .put("reason", e.reason)
      .put("abort_reason", e.abort_reason)
      .put("prompt_tokens", e.prompt_tokens)
      .put("completion_tokens", e.completion_tokens);
}
void write_event(Packer& pk, const FailedEvent& e, std::vector<std::string>&) {
  MapWriter w(pk, 2);
  w.put("rid", e.rid);
  write_error_info(w.key("error"), e.error);
}
void write_event(Packer& pk, const RetractedEvent& e, std::vector<std::string>&) {
  MapWriter(pk, 3)
      .put("rid", e.rid)
      .put("num_tokens_discarded", e.num_tokens_discarded)
      .put("reason", e.reason);
}

void write_parameter_checksum(Packer& pk, const ParameterChecksum& p) {
  MapWriter(pk, 4)
      .put("name", p.name)
      .put("dtype", p.dtype)
      .put("shape", p.shape)
      .put("checksum", p.checksum);
}

// Request wire names by type.
std::string_view request_name(const HelloRequest&) { return kHello; }
std::string_view request_name(const StatusRequest&) { return kStatus; }
std::string_view request_name(const GenerateRequest&) { return kGenerate; }
std::string_view request_name(const AbortRequest&) { return kAbort; }
std::string_view request_name(const ShutdownRequest&) { return kShutdown; }
std::string_view request_name(const BeginWeightUpdateRequest&) { return kBeginWeightUpdate; }
std::string_view request_name(const UpdateWeightsRequest&) { return kUpdateWeights; }
std::string_view request_name(const EndWeightUpdateRequest&) { return kEndWeightUpdate; }
std::string_view request_name(const AbortWeightUpdateRequest&) { return kAbortWeightUpdate; }
std::string_view request_name(const GetWeightsByNameRequest&) { return kGetWeightsByName; }
std::string_view request_name(const WeightsChecksumRequest&) { return kWeightsChecksum; }
std::string_view request_name(const PauseGenerationRequest&) { return kPauseGeneration; }
std::string_view request_name(const ContinueGenerationRequest&) { return kContinueGeneration; }
std::string_view request_name(const InitWeightGroupRequest&) { return kInitWeightGroup; }
std::string_view request_name(const DestroyWeightGroupRequest&) { return kDestroyWeightGroup; }
std::string_view request_name(const ReleaseMemoryRequest&) { return kReleaseMemory; }
std::string_view request_name(const ResumeMemoryRequest&) { return kResumeMemory; }

// CRC-32 (zlib's: reflected polynomial 0xEDB88320), slice-by-8: eight table
// lookups per 8 input bytes, several times the byte-at-a-time rate.
struct Crc32Tables {
  uint32_t t[8][256];
};
constexpr Crc32Tables make_crc32_tables() {
  Crc32Tables x{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    x.t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) x.t[s][i] = (x.t[s - 1][i] >> 8) ^ x.t[0][x.t[s - 1][i] & 0xFF];
  return x;
}
constexpr Crc32Tables kCrc32Tables = make_crc32_tables();

uint32_t load_le32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

}  // namespace

// ---------------------------------------------------------------- public ----

ErrorInfo to_error_info(const Status& s) {
  return ErrorInfo{std::string(error_code_name(s.code())), s.message(), s.field()};
}

std::string_view request_type_name(const Request& r) {
  return std::visit([](const auto& req) { return request_name(req); }, r);
}

std::string_view pause_mode_name(PauseMode m) {
  switch (m) {
    case PauseMode::kAbort: return "abort";
    case PauseMode::kRetract: return "retract";
    case PauseMode::kInPlace: return "in_place";
  }
  return "abort";
}

std::optional<PauseMode> pause_mode_from_name(std::string_view name) {
  for (PauseMode m : {PauseMode::kAbort, PauseMode::kRetract, PauseMode::kInPlace})
    if (pause_mode_name(m) == name) return m;
  return std::nullopt;
}

Frame inline_bucket(const UpdateWeightsRequest& r, std::span<const Frame> frames) {
  const auto* in = std::get_if<InlineSource>(&r.source);
  if (in == nullptr || in->frame >= frames.size()) return {};
  return frames[in->frame];
}

uint32_t crc32(std::span<const uint8_t> bytes, uint32_t crc) {
  const auto& t = kCrc32Tables.t;
  uint32_t c = ~crc;
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  for (; n >= 8; p += 8, n -= 8) {
    const uint32_t lo = load_le32(p) ^ c;
    const uint32_t hi = load_le32(p + 4);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t model_checksum(std::vector<std::pair<std::string, uint32_t>> checksums) {
  // std::string compares as unsigned char: byte-wise, which for UTF-8 is code-point
  // order, the order of Python's sorted() over str.
  std::sort(checksums.begin(), checksums.end());
  uint32_t crc = 0;
  for (const auto& [name, sum] : checksums) {
    crc = crc32({reinterpret_cast<const uint8_t*>(name.data()), name.size()}, crc);
    const uint8_t tail[5] = {0, static_cast<uint8_t>(sum), static_cast<uint8_t>(sum >> 8),
                             static_cast<uint8_t>(sum >> 16), static_cast<uint8_t>(sum >> 24)};
    crc = crc32(tail, crc);
  }
  return crc;
}

bool is_valid_weight_group_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxWeightGroupNameBytes) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  });
}

std::string nccl_version_string(uint32_t code) {
  // NCCL_VERSION(X, Y, Z) is X*10000 + Y*100 + Z from 2.9 on, X*1000 + Y*100 + Z before.
  const uint32_t major = code >= 10000 ? code / 10000 : code / 1000;
  const uint32_t minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

size_t routed_experts_dtype_size(std::string_view dtype) {
  if (dtype == "uint8") return 1;
  if (dtype == "uint16") return 2;
  if (dtype == "int32") return 4;
  return 0;
}

RequestDecodeResult decode_request(Frame envelope, std::span<const Frame> frames,
                                   const Limits& limits) {
  RequestDecodeResult out;
  const size_t max_array = std::max({limits.max_input_tokens, limits.max_stop_token_ids,
                                     limits.max_versions, limits.max_bucket_entries});
  OpenedEnvelope opened;
  out.status = open_envelope(envelope, frames, limits, max_array, out.env, opened);
  if (!out.status.ok()) return out;
  const RequestDecoder decode = find_decoder(kRequestDecoders, out.env.type);
  if (decode == nullptr) {
    out.status = unknown_type(out.env.type);
    return out;
  }
  Result<Request> request = decode(*opened.body, RequestContext{limits, frames});
  if (!request.ok()) {
    out.status = request.status();
    return out;
  }
  out.request = std::move(request).value();
  return out;
}

Result<DecodedIncoming> decode_incoming(Frame envelope, std::span<const Frame> frames,
                                        const Limits& limits) {
  DecodedIncoming out;
  OpenedEnvelope opened;
  // The longest array a daemon sends: a tokens event's, a bucket-sized list, or the
  // values of get_weights_by_name.
  const size_t max_array =
      std::max({limits.max_new_tokens, limits.max_bucket_entries, kMaxGetWeightsTruncate});
  RD_RETURN_IF_ERROR(open_envelope(envelope, frames, limits, max_array, out.env, opened));
  const IncomingDecoder decode = find_decoder(kIncomingDecoders, out.env.type);
  if (decode == nullptr) return unknown_type(out.env.type);
  RD_ASSIGN_OR_RETURN(out.msg, decode(*opened.body, IncomingContext{limits, frames}));
  return out;
}

WireMessage encode_request(uint64_t id, const Request& r) {
  return std::visit(
      [&](const auto& req) {
        return encode_message(request_type_name(r), id,
                              [&](Packer& pk, std::vector<std::string>&) { write_body(pk, req); });
      },
      r);
}

WireMessage encode_reply(uint64_t id, const HelloReply& r) {
  return encode_message(kHelloOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter w(pk, 9);
    w.put("version", r.version).put("daemon", r.daemon).put("build", r.build).put("gpu", r.gpu);
    write_model(w.key("model"), r.model);
    w.put("weight_version", r.weight_version);
    write_limits(w.key("limits"), r.limits);
    w.put("nccl_version", r.nccl_version).put("device_uuid", BinBytes{r.device_uuid});
  });
}

WireMessage encode_reply(uint64_t id, const StatusReply& r) {
  return encode_message(kStatusOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter w(pk, 13);
    w.put("state", r.state)
        .put("ready", r.ready)
        .put("reason", r.reason)
        .put("weight_version", r.weight_version)
        .put("num_waiting", r.num_waiting)
        .put("num_running", r.num_running)
        .put("num_requests_total", r.num_requests_total)
        .put("num_tokens_generated_total", r.num_tokens_generated_total)
        .put("uptime_s", r.uptime_s)
        .put("build", r.build);
    write_model(w.key("model"), r.model);
    w.put("paused", r.paused).put("update_session", r.update_session);
  });
}

WireMessage encode_reply(uint64_t id, const GenerateReply& r) {
  return encode_message(kGenerateOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 1).put("rid", r.rid);
  });
}

WireMessage encode_reply(uint64_t id, const AbortReply& r) {
  return encode_message(kAbortOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 1).put("num_aborted", r.num_aborted);
  });
}

WireMessage encode_reply(uint64_t id, const ShutdownReply& r) {
  return encode_message(kShutdownOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 1).put("accepted", r.accepted);
  });
}

WireMessage encode_reply(uint64_t id, const BeginWeightUpdateReply& r) {
  return encode_message(kBeginWeightUpdateOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 3)
        .put("session", r.session)
        .put("weight_version", r.weight_version)
        .put("num_parameters_restored", r.num_parameters_restored);
  });
}

WireMessage encode_reply(uint64_t id, const UpdateWeightsReply& r) {
  return encode_message(kUpdateWeightsOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 4)
        .put("session", r.session)
        .put("num_entries", r.num_entries)
        .put("num_bytes", r.num_bytes)
        .put("duration_s", r.duration_s);
  });
}

WireMessage encode_reply(uint64_t id, const EndWeightUpdateReply& r) {
  return encode_message(kEndWeightUpdateOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 8)
        .put("session", r.session)
        .put("weight_version", r.weight_version)
        .put("num_buckets", r.num_buckets)
        .put("num_entries", r.num_entries)
        .put("num_bytes", r.num_bytes)
        .put("num_parameters_updated", r.num_parameters_updated)
        .put("duration_s", r.duration_s)
        .put("postprocess_s", r.postprocess_s);
  });
}

WireMessage encode_reply(uint64_t id, const AbortWeightUpdateReply& r) {
  return encode_message(kAbortWeightUpdateOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 2).put("session", r.session).put("state", r.state);
  });
}

WireMessage encode_reply(uint64_t id, const GetWeightsByNameReply& r) {
  return encode_message(kGetWeightsByNameOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 4)
        .put("name", r.name)
        .put("dtype", r.dtype)
        .put("shape", r.shape)
        .put("values", r.values);
  });
}

WireMessage encode_reply(uint64_t id, const WeightsChecksumReply& r) {
  return encode_message(kWeightsChecksumOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter w(pk, 4);
    w.put("algo", r.algo).put("weight_version", r.weight_version).put("model_checksum",
                                                                      r.model_checksum);
    Packer& params = w.key("parameters");
    params.msgpack().pack_array(static_cast<uint32_t>(r.parameters.size()));
    for (const ParameterChecksum& p : r.parameters) write_parameter_checksum(params, p);
  });
}

WireMessage encode_reply(uint64_t id, const PauseGenerationReply& r) {
  return encode_message(kPauseGenerationOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 3)
        .put("num_aborted", r.num_aborted)
        .put("num_retracted", r.num_retracted)
        .put("num_paused", r.num_paused);
  });
}

WireMessage encode_reply(uint64_t id, const ContinueGenerationReply& r) {
  return encode_message(kContinueGenerationOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 1).put("num_resumed", r.num_resumed);
  });
}

WireMessage encode_reply(uint64_t id, const InitWeightGroupReply& r) {
  return encode_message(kInitWeightGroupOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 5)
        .put("group", r.group)
        .put("nccl_version", r.nccl_version)
        .put("rank", r.rank)
        .put("world_size", r.world_size)
        .put("duration_s", r.duration_s);
  });
}

WireMessage encode_reply(uint64_t id, const DestroyWeightGroupReply& r) {
  return encode_message(kDestroyWeightGroupOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 1).put("group", r.group);
  });
}

WireMessage encode_reply(uint64_t id, const ReleaseMemoryReply& r) {
  return encode_message(kReleaseMemoryOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 3).put("tags", r.tags).put("num_bytes", r.num_bytes).put("duration_s", r.duration_s);
  });
}

WireMessage encode_reply(uint64_t id, const ResumeMemoryReply& r) {
  return encode_message(kResumeMemoryOk, id, [&](Packer& pk, std::vector<std::string>&) {
    MapWriter(pk, 3).put("tags", r.tags).put("num_bytes", r.num_bytes).put("duration_s", r.duration_s);
  });
}

bool is_memory_tag(std::string_view tag) {
  for (std::string_view t : kMemoryTags)
    if (t == tag) return true;
  return false;
}

WireMessage encode_error(uint64_t id, const ErrorInfo& e) {
  return encode_message(kError, id,
                        [&](Packer& pk, std::vector<std::string>&) { write_error_info(pk, e); });
}

WireMessage encode_event(uint64_t id, const Event& e) {
  return std::visit(
      [&](const auto& ev) {
        return encode_message(
            event_type(ev), id,
            [&](Packer& pk, std::vector<std::string>& frames) { write_event(pk, ev, frames); });
      },
      e);
}

}  // namespace rolloutd::protocol
