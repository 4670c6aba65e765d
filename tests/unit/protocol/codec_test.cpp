// Every validation rule of protocol/codec.cpp (SPEC §3, §4, §9): each bad input
// gets its typed code and field path; round trips keep every field; the encoder
// writes SPEC's canonical bytes.
#include <gtest/gtest.h>

#include <msgpack.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "protocol/codec.hpp"

namespace rolloutd::protocol {
namespace {

// ---------------------------------------------------------------------------
// A tiny msgpack document builder, so tests can write inputs no encoder of ours
// would produce (wrong types, duplicate keys, raw headers).

struct Raw {
  std::string bytes;  // written verbatim
};
struct Bin {
  std::string bytes;
};

struct Value {
  using Array = std::vector<Value>;
  using Map = std::vector<std::pair<std::string, Value>>;
  std::variant<std::nullptr_t, bool, int64_t, uint64_t, double, std::string, Bin, Raw, Array, Map>
      v;

  Value(std::nullptr_t) : v(nullptr) {}  // NOLINT
  template <class T>
  requires std::is_integral_v<T> Value(T x) {  // NOLINT
    if constexpr (std::is_same_v<T, bool>)
      v = x;
    else if constexpr (std::is_signed_v<T>)
      v = static_cast<int64_t>(x);
    else
      v = static_cast<uint64_t>(x);
  }
  Value(double x) : v(x) {}                    // NOLINT
  Value(const char* s) : v(std::string(s)) {}  // NOLINT
  Value(std::string s) : v(std::move(s)) {}    // NOLINT
  Value(Bin b) : v(std::move(b)) {}            // NOLINT
  Value(Raw r) : v(std::move(r)) {}            // NOLINT
  Value(Array a) : v(std::move(a)) {}          // NOLINT
  Value(Map m) : v(std::move(m)) {}            // NOLINT
};
using Array = Value::Array;
using Map = Value::Map;

void pack(msgpack::sbuffer& buf, const Value& value) {
  msgpack::packer<msgpack::sbuffer> pk(buf);
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::nullptr_t>)
          pk.pack_nil();
        else if constexpr (std::is_same_v<T, Raw>)
          buf.write(x.bytes.data(), x.bytes.size());
        else if constexpr (std::is_same_v<T, double>) {
          // Not pk.pack(double): msgpack-c writes integral doubles as ints, and
          // these tests need 16.0 to arrive as a float.
          uint64_t bits;
          std::memcpy(&bits, &x, sizeof(bits));
          char out[9] = {static_cast<char>(0xcb)};
          for (int i = 0; i < 8; ++i) out[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
          buf.write(out, sizeof(out));
        } else if constexpr (std::is_same_v<T, Bin>) {
          pk.pack_bin(static_cast<uint32_t>(x.bytes.size()));
          pk.pack_bin_body(x.bytes.data(), static_cast<uint32_t>(x.bytes.size()));
        } else if constexpr (std::is_same_v<T, Array>) {
          pk.pack_array(static_cast<uint32_t>(x.size()));
          for (const auto& e : x) pack(buf, e);
        } else if constexpr (std::is_same_v<T, Map>) {
          pk.pack_map(static_cast<uint32_t>(x.size()));
          for (const auto& [k, e] : x) {
            pk.pack(k);
            pack(buf, e);
          }
        } else {
          pk.pack(x);
        }
      },
      value.v);
}

std::string bytes(const Value& v) {
  msgpack::sbuffer buf;
  pack(buf, v);
  return std::string(buf.data(), buf.size());
}

Map envelope(std::string type, uint64_t id, Value body) {
  return Map{{"v", 1}, {"type", std::move(type)}, {"id", id}, {"body", std::move(body)}};
}

// Replaces (or appends) `key`; std::nullopt erases it.
Map with(Map m, const std::string& key, std::optional<Value> value) {
  auto it = std::find_if(m.begin(), m.end(), [&](const auto& kv) { return kv.first == key; });
  if (!value) {
    if (it != m.end()) m.erase(it);
  } else if (it != m.end()) {
    it->second = std::move(*value);
  } else {
    m.emplace_back(key, std::move(*value));
  }
  return m;
}

Map generate_body() {
  return Map{{"rid", "r-1"},
             {"input_ids", Array{1, 2, 3, 4}},
             {"max_new_tokens", 8},
             {"temperature", 0.5},
             {"top_p", 0.9},
             {"top_k", 5},
             {"min_p", 0.1},
             {"seed", 42},
             {"stop_token_ids", Array{2}},
             {"return_logprob", true},
             {"return_routed_experts", true},
             {"routed_experts_start_len", 1},
             {"stream", false}};
}

Frame as_frame(const std::string& s) {
  return Frame(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::vector<Frame> as_frames(const std::vector<std::string>& v) {
  std::vector<Frame> out;
  for (const auto& s : v) out.push_back(as_frame(s));
  return out;
}

RequestDecodeResult decode(const std::string& env, const Limits& limits = {},
                           const std::vector<std::string>& frames = {}) {
  const auto views = as_frames(frames);
  return decode_request(as_frame(env), views, limits);
}

Result<DecodedIncoming> decode_in(const WireMessage& m, const Limits& limits = {}) {
  const auto views = as_frames(m.frames);
  return decode_incoming(as_frame(m.envelope), views, limits);
}

std::string repeat(char c, size_t n) { return std::string(n, c); }

Array count_up(size_t n) {
  Array a;
  for (size_t i = 0; i < n; ++i) a.emplace_back(static_cast<int64_t>(i % 100));
  return a;
}

// ---------------------------------------------------------------------------
// Refused requests: table of (input, code, field path).

struct BadCase {
  std::string name;
  std::string envelope;  // encoded
  ErrorCode code;
  std::string field;
  uint64_t id = 0;  // expected env.id (0: could not be read)
  Limits limits{};
  std::vector<std::string> frames{};  // payload frames sent with the envelope
};

BadCase bad_body(std::string name, std::string type, Map body, ErrorCode code, std::string field,
                 Limits limits = {}) {
  return BadCase{std::move(name),
                 bytes(envelope(std::move(type), 77, std::move(body))),
                 code,
                 std::move(field),
                 77,
                 limits};
}
BadCase bad_gen(std::string name, std::string key, std::optional<Value> value, ErrorCode code,
                std::string field) {
  return bad_body(std::move(name), "generate", with(generate_body(), key, std::move(value)), code,
                  std::move(field));
}
BadCase bad_env(std::string name, Value env, ErrorCode code, std::string field, uint64_t id = 0) {
  return BadCase{std::move(name), bytes(env), code, std::move(field), id};
}

// {v:1, type:"status", id:77, 1:2}: the fourth key is an int.
std::string envelope_with_int_key() {
  return "\x84" + bytes("v") + bytes(1) + bytes("type") + bytes("status") + bytes("id") +
         bytes(77) + "\x01\x02";
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr uint64_t k2p31 = uint64_t{1} << 31;
constexpr uint64_t k2p32 = uint64_t{1} << 32;

using E = ErrorCode;

// ---- weight updates (SPEC §11) ----
Map entry(std::string name, std::string dtype, Array shape, uint64_t offset, uint64_t nbytes) {
  return Map{{"name", std::move(name)},
             {"dtype", std::move(dtype)},
             {"shape", std::move(shape)},
             {"byte_offset", offset},
             {"nbytes", nbytes}};
}

// Three entries in three dtypes over a 32-byte bucket, as in the update_weights_inline golden.
Array bucket_entries() {
  return Array{entry("q", "bfloat16", Array{2, 3}, 0, 12), entry("norm", "float32", Array{3}, 16, 12),
               entry("e", "float8_e4m3fn", Array{2, 2}, 28, 4)};
}
const std::string kBucket(32, '\x01');

Map update_body(Array entries = bucket_entries()) {
  return Map{{"session", 7},
             {"load_format", "flattened_bucket"},
             {"entries", std::move(entries)},
             {"source", Map{{"kind", "inline"}, {"frame", 0}}},
             {"checksum", Map{{"algo", "crc32"}, {"value", 5}}}};
}

Map shm_source(Value name = "/rolloutd-w", Value offset = 4096, Value size = 32) {
  return Map{{"kind", "shm"}, {"name", std::move(name)}, {"offset", std::move(offset)},
             {"size", std::move(size)}};
}

// `entries` with entry i's `key` replaced (std::nullopt erases it).
Array entries_with(size_t i, const std::string& key, std::optional<Value> value,
                   Array entries = bucket_entries()) {
  entries[i] = with(std::get<Map>(entries[i].v), key, std::move(value));
  return entries;
}

BadCase bad_update(std::string name, Map body, ErrorCode code, std::string field,
                   std::vector<std::string> frames = {kBucket}, Limits limits = {}) {
  BadCase c = bad_body(std::move(name), "update_weights", std::move(body), code, std::move(field),
                       limits);
  c.frames = std::move(frames);
  return c;
}
BadCase bad_entry(std::string name, size_t i, const std::string& key, std::optional<Value> value,
                  ErrorCode code, std::string field) {
  return bad_update(std::move(name), update_body(entries_with(i, key, std::move(value))), code,
                    std::move(field));
}

std::vector<BadCase> weight_update_bad_cases() {
  Limits two_entries;
  two_entries.max_bucket_entries = 2;
  Limits short_strings;  // a field limit below the parse-time string bound (max_rid_bytes)
  short_strings.max_string_bytes = 100;
  const Map update = update_body();
  const Map shm = with(update, "source", shm_source());
  return {
      // ---- update_weights: top-level fields ----
      bad_update("UpdateSessionMissing", with(update, "session", std::nullopt), E::kMissingField,
                 "body.session"),
      bad_update("UpdateSessionNegative", with(update, "session", -1), E::kOutOfRange, "body.session"),
      bad_update("UpdateSessionFloat", with(update, "session", 7.0), E::kWrongType, "body.session"),
      bad_update("LoadFormatMissing", with(update, "load_format", std::nullopt), E::kMissingField,
                 "body.load_format"),
      bad_update("LoadFormatUnknown", with(update, "load_format", "safetensors"),
                 E::kInvalidArgument, "body.load_format"),
      bad_update("EntriesMissing", with(update, "entries", std::nullopt), E::kMissingField,
                 "body.entries"),
      bad_update("EntriesNotArray", with(update, "entries", Map{}), E::kWrongType, "body.entries"),
      bad_update("EntriesEmpty", update_body(Array{}), E::kInvalidArgument, "body.entries"),
      bad_update("EntriesOverLimit", update, E::kTooLarge, "body.entries", {kBucket}, two_entries),
      bad_update("EntryNotMap", update_body(Array{entry("a", "int8", Array{1}, 0, 1), 5}),
                 E::kWrongType, "body.entries[1]"),
      // ---- update_weights: one entry ----
      bad_entry("EntryNameMissing", 0, "name", std::nullopt, E::kMissingField, "body.entries[0].name"),
      bad_entry("EntryNameEmpty", 1, "name", "", E::kInvalidArgument, "body.entries[1].name"),
      bad_entry("EntryNameBin", 0, "name", Bin{"q"}, E::kWrongType, "body.entries[0].name"),
      bad_update("EntryNameTooLong", update_body(entries_with(0, "name", repeat('n', 101))),
                 E::kTooLarge, "body.entries[0].name", {kBucket}, short_strings),
      bad_entry("EntryDtypeUnknown", 1, "dtype", "complex64", E::kInvalidArgument,
                "body.entries[1].dtype"),
      bad_entry("EntryDtypeFloat64", 1, "dtype", "float64", E::kInvalidArgument,
                "body.entries[1].dtype"),
      bad_entry("EntryDtypeEmpty", 1, "dtype", "", E::kInvalidArgument, "body.entries[1].dtype"),
      bad_entry("EntryDtypeInt", 1, "dtype", 4, E::kWrongType, "body.entries[1].dtype"),
      bad_entry("EntryShapeMissing", 0, "shape", std::nullopt, E::kMissingField,
                "body.entries[0].shape"),
      bad_entry("EntryShapeNotArray", 0, "shape", 6, E::kWrongType, "body.entries[0].shape"),
      bad_entry("EntryShapeRankNine", 0, "shape", Array{1, 1, 1, 1, 1, 1, 1, 1, 1}, E::kTooLarge,
                "body.entries[0].shape"),
      bad_entry("EntryShapeDimNegative", 0, "shape", Array{2, -3}, E::kOutOfRange,
                "body.entries[0].shape[1]"),
      bad_entry("EntryShapeDimOver2p40", 0, "shape", Array{(uint64_t{1} << 40) + 1}, E::kOutOfRange,
                "body.entries[0].shape[0]"),
      bad_entry("EntryShapeDimFloat", 0, "shape", Array{2.0, 3}, E::kWrongType,
                "body.entries[0].shape[0]"),
      // 2^40 * 2^40 * 2 bytes does not fit 64 bits: refused, not wrapped to a small size.
      bad_entry("EntryShapeBytesOverflow", 0, "shape",
                Array{uint64_t{1} << 40, uint64_t{1} << 40}, E::kOutOfRange,
                "body.entries[0].shape"),
      bad_entry("EntryNbytesMismatch", 0, "nbytes", 10, E::kInvalidArgument,
                "body.entries[0].nbytes"),
      bad_entry("EntryNbytesMissing", 0, "nbytes", std::nullopt, E::kMissingField,
                "body.entries[0].nbytes"),
      // float4_e2m1fn_x2 counts stored bytes (pairs of values): [2, 2] is 4 bytes, not 2.
      bad_update("EntryFp4NbytesAreStoredBytes",
                 update_body(Array{entry("blocks", "float4_e2m1fn_x2", Array{2, 2}, 0, 2)}),
                 E::kInvalidArgument, "body.entries[0].nbytes"),
      bad_entry("EntryOffsetNegative", 0, "byte_offset", -1, E::kOutOfRange,
                "body.entries[0].byte_offset"),
      bad_entry("EntryOffsetMissing", 2, "byte_offset", std::nullopt, E::kMissingField,
                "body.entries[2].byte_offset"),
      bad_entry("EntryEndOverflows", 2, "byte_offset", UINT64_MAX - 2, E::kOutOfRange,
                "body.entries[2].byte_offset"),
      // ---- update_weights: the bucket as a whole ----
      bad_update("EntryBeyondInlineFrame", update, E::kOutOfRange, "body.entries[2].byte_offset",
                 {kBucket.substr(0, 31)}),
      bad_update("EntryStartsBeyondInlineFrame",
                 update_body(Array{entry("z", "int8", Array{0}, 33, 0)}), E::kOutOfRange,
                 "body.entries[0].byte_offset"),
      bad_entry("EntriesOverlap", 1, "byte_offset", 8, E::kInvalidArgument, "body.entries[1]"),
      // The entry starting later is named, whatever the list order; nesting is caught too.
      bad_update("EntriesOverlapNested",
                 update_body(Array{entry("small", "int8", Array{4}, 20, 4),
                                   entry("big", "int8", Array{32}, 0, 32)}),
                 E::kInvalidArgument, "body.entries[0]"),
      bad_update("EntriesOverlapFirstFound",
                 update_body(Array{entry("a", "int8", Array{16}, 0, 16),
                                   entry("b", "int8", Array{2}, 4, 2),
                                   entry("c", "int8", Array{4}, 12, 4)}),
                 E::kInvalidArgument, "body.entries[1]"),
      bad_update("EntriesSameOffset",
                 update_body(Array{entry("a", "int8", Array{4}, 8, 4),
                                   entry("b", "int8", Array{1}, 8, 1)}),
                 E::kInvalidArgument, "body.entries[1]"),
      // Entries that look like the common case but are not (the one-pass reader hands them to
      // the generic one, which names the problem): five keys with one repeated or one unknown,
      // a non-string key, a name that is not UTF-8, a dtype over the string limit.
      bad_update("EntryKeyRepeatedInFive",
                 update_body(Array{Map{{"name", "q"}, {"dtype", "bfloat16"}, {"shape", Array{2, 3}},
                                       {"byte_offset", 0}, {"name", "q"}}}),
                 E::kBadMessage, "body.entries[0].name"),
      bad_update("EntryUnknownKeyInFive",
                 update_body(Array{Map{{"name", "q"}, {"dtype", "bfloat16"}, {"shape", Array{2, 3}},
                                       {"byte_offset", 0}, {"n_bytes", 12}}}),
                 E::kMissingField, "body.entries[0].nbytes"),
      bad_update("EntryIntKey",
                 update_body(Array{entry("q", "bfloat16", Array{2, 3}, 0, 12),
                                   Raw{"\x85\xa4name\xa1n\xa5" "dtype\xa4int8\xa5shape\x91\x01\xab"
                                       "byte_offset\x10\x07\x01"}}),
                 E::kBadMessage, "body.entries[1]"),
      bad_entry("EntryNameInvalidUtf8", 1, "name", "n\xff", E::kInvalidArgument, "body.entries[1].name"),
      bad_update("EntryDtypeTooLong",
                 update_body(Array{entry("q", "torch.float8_e4m3fn", Array{2, 3}, 0, 6)}), E::kTooLarge,
                 "body.entries[0].dtype", {kBucket},
                 [] {
                   Limits l;
                   l.max_string_bytes = 16;  // "flattened_bucket" fits, the 19-byte dtype does not
                   return l;
                 }()),
      bad_entry("EntryNameTwice", 2, "name", "q", E::kInvalidArgument, "body.entries[2].name"),
      bad_update("EntryNamesTwiceFirstInListOrder",
                 update_body(Array{entry("z", "int8", Array{1}, 0, 1), entry("b", "int8", Array{1}, 1, 1),
                                   entry("b", "int8", Array{1}, 2, 1), entry("z", "int8", Array{1}, 3, 1)}),
                 E::kInvalidArgument, "body.entries[2].name"),
      // ---- update_weights: source ----
      bad_update("SourceMissing", with(update, "source", std::nullopt), E::kMissingField,
                 "body.source"),
      bad_update("SourceNotMap", with(update, "source", "inline"), E::kWrongType, "body.source"),
      bad_update("SourceKindMissing", with(update, "source", Map{{"frame", 0}}), E::kMissingField,
                 "body.source.kind"),
      bad_update("SourceKindUnknown", with(update, "source", Map{{"kind", "rdma"}}),
                 E::kInvalidArgument, "body.source.kind"),
      bad_update("InlineFrameMissingField", with(update, "source", Map{{"kind", "inline"}}),
                 E::kMissingField, "body.source.frame"),
      bad_update("InlineWithoutPayloadFrame", update, E::kOutOfRange, "body.source.frame", {}),
      bad_update("InlineFrameIndexPastFrames",
                 with(update, "source", Map{{"kind", "inline"}, {"frame", 1}}), E::kOutOfRange,
                 "body.source.frame"),
      bad_update("ShmNameNoSlash", with(update, "source", shm_source("rolloutd-w")),
                 E::kInvalidArgument, "body.source.name", {}),
      bad_update("ShmNameOnlySlash", with(update, "source", shm_source("/")), E::kInvalidArgument,
                 "body.source.name", {}),
      bad_update("ShmNameInnerSlash", with(update, "source", shm_source("/a/b")),
                 E::kInvalidArgument, "body.source.name", {}),
      bad_update("ShmNameDotDot", with(update, "source", shm_source("/..")), E::kInvalidArgument,
                 "body.source.name", {}),
      bad_update("ShmNameSpace", with(update, "source", shm_source("/a b")), E::kInvalidArgument,
                 "body.source.name", {}),
      bad_update("ShmNameTooLong", with(update, "source", shm_source("/" + repeat('x', 251))),
                 E::kInvalidArgument, "body.source.name", {}),
      bad_update("ShmNameInt", with(update, "source", shm_source(5)), E::kWrongType,
                 "body.source.name", {}),
      bad_update("ShmSizeMissing",
                 with(update, "source", with(shm_source(), "size", std::nullopt)),
                 E::kMissingField, "body.source.size", {}),
      bad_update("ShmOffsetNegative", with(update, "source", shm_source("/w", -1)),
                 E::kOutOfRange, "body.source.offset", {}),
      bad_update("ShmEndOverflows", with(update, "source", shm_source("/w", UINT64_MAX - 8, 32)),
                 E::kOutOfRange, "body.source.size", {}),
      bad_update("ShmEntryBeyondRegion", with(update, "source", shm_source("/w", 0, 31)),
                 E::kOutOfRange, "body.entries[2].byte_offset", {}),
      // ---- update_weights: checksum ----
      bad_update("ChecksumNotMap", with(shm, "checksum", 5), E::kWrongType, "body.checksum", {}),
      bad_update("ChecksumAlgoUnknown", with(shm, "checksum", Map{{"algo", "sha256"}, {"value", 1}}),
                 E::kInvalidArgument, "body.checksum.algo", {}),
      bad_update("ChecksumAlgoMissing", with(shm, "checksum", Map{{"value", 1}}), E::kMissingField,
                 "body.checksum.algo", {}),
      bad_update("ChecksumValueOver32Bits",
                 with(shm, "checksum", Map{{"algo", "crc32"}, {"value", k2p32}}), E::kOutOfRange,
                 "body.checksum.value", {}),
      // ---- begin_weight_update ----
      bad_body("SelectorEmptyList", "begin_weight_update", Map{{"selector", Array{}}},
               E::kInvalidArgument, "body.selector"),
      bad_body("SelectorEmptyPrefix", "begin_weight_update", Map{{"selector", Array{"a.", ""}}},
               E::kInvalidArgument, "body.selector[1]"),
      bad_body("SelectorNotArray", "begin_weight_update", Map{{"selector", "model."}},
               E::kWrongType, "body.selector"),
      bad_body("SelectorPrefixInt", "begin_weight_update", Map{{"selector", Array{1}}},
               E::kWrongType, "body.selector[0]"),
      bad_body("SelectorOverLimit", "begin_weight_update", Map{{"selector", Array{"a", "b", "c"}}},
               E::kTooLarge, "body.selector", two_entries),
      bad_body("TimeoutZero", "begin_weight_update", Map{{"timeout_s", 0}}, E::kOutOfRange,
               "body.timeout_s"),
      bad_body("TimeoutOverAnHour", "begin_weight_update", Map{{"timeout_s", 3600.5}},
               E::kOutOfRange, "body.timeout_s"),
      bad_body("TimeoutNaN", "begin_weight_update", Map{{"timeout_s", kNaN}}, E::kOutOfRange,
               "body.timeout_s"),
      bad_body("TimeoutNil", "begin_weight_update", Map{{"timeout_s", nullptr}}, E::kWrongType,
               "body.timeout_s"),
      // ---- end / abort ----
      bad_body("EndSessionMissing", "end_weight_update", Map{{"weight_version", 1}},
               E::kMissingField, "body.session"),
      bad_body("EndVersionMissing", "end_weight_update", Map{{"session", 1}}, E::kMissingField,
               "body.weight_version"),
      bad_body("EndVersionFloat", "end_weight_update", Map{{"session", 1}, {"weight_version", 2.0}},
               E::kWrongType, "body.weight_version"),
      bad_body("AbortUpdateSessionString", "abort_weight_update", Map{{"session", "7"}},
               E::kWrongType, "body.session"),
      bad_body("AbortUpdateNoBody", "abort_weight_update", Map{}, E::kMissingField, "body.session"),
      // ---- get_weights_by_name / weights_checksum ----
      bad_body("GetWeightsNameMissing", "get_weights_by_name", Map{{"truncate", 1}},
               E::kMissingField, "body.name"),
      bad_body("GetWeightsNameEmpty", "get_weights_by_name", Map{{"name", ""}},
               E::kInvalidArgument, "body.name"),
      bad_body("GetWeightsTruncateOverMax", "get_weights_by_name",
               Map{{"name", "w"}, {"truncate", 1000001}}, E::kOutOfRange, "body.truncate"),
      bad_body("GetWeightsTruncateNegative", "get_weights_by_name",
               Map{{"name", "w"}, {"truncate", -1}}, E::kOutOfRange, "body.truncate"),
      bad_body("ChecksumNamesEmptyList", "weights_checksum", Map{{"names", Array{}}},
               E::kInvalidArgument, "body.names"),
      bad_body("ChecksumNameEmpty", "weights_checksum", Map{{"names", Array{""}}},
               E::kInvalidArgument, "body.names[0]"),
      bad_body("ChecksumNameInt", "weights_checksum", Map{{"names", Array{"a", 2}}}, E::kWrongType,
               "body.names[1]"),
      // The first name (in list order) seen before is named, whichever sorts first.
      bad_body("ChecksumNamesRepeated", "weights_checksum",
               Map{{"names", Array{"z", "b", "a", "b", "z"}}}, E::kInvalidArgument, "body.names[3]"),
      // ---- pause_generation ----
      bad_body("PauseModeMissing", "pause_generation", Map{}, E::kMissingField, "body.mode"),
      bad_body("PauseModeUnknown", "pause_generation", Map{{"mode", "drain"}}, E::kInvalidArgument,
               "body.mode"),
      bad_body("PauseModeInt", "pause_generation", Map{{"mode", 1}}, E::kWrongType, "body.mode"),
  };
}

// ---- GPU weight transports (SPEC §11.7) ----
const std::string kUniqueId(128, '\x9c');  // bytes >= 0x80: not valid UTF-8, so bin only
const std::string kIpcHandle(64, '\xfe');
const std::string kUuid(16, '\x42');

Map init_group_body() {
  return Map{{"group", "weights"},   {"unique_id", Bin{kUniqueId}}, {"world_size", 3},
             {"rank", 1},            {"root", 0},                   {"nccl_version", 22809},
             {"timeout_s", 120.0}};
}

Map nccl_source(Value group = "weights", Value root = 0, Value size = 32) {
  return Map{{"kind", "nccl"}, {"group", std::move(group)}, {"root", std::move(root)},
             {"size", std::move(size)}};
}

Map ipc_source(Value handle = Bin{kIpcHandle}, Value offset = 1 << 20, Value size = 32,
               Value uuid = Bin{kUuid}) {
  return Map{{"kind", "cuda_ipc"},
             {"handle", std::move(handle)},
             {"offset", std::move(offset)},
             {"size", std::move(size)},
             {"device_uuid", std::move(uuid)}};
}

BadCase bad_init(std::string name, const std::string& key, std::optional<Value> value, ErrorCode code,
                 std::string field) {
  return bad_body(std::move(name), "init_weight_group", with(init_group_body(), key, std::move(value)),
                  code, std::move(field));
}

std::vector<BadCase> transport_bad_cases() {
  const Map update = update_body();
  const Map nccl = with(update, "source", nccl_source());
  const uint64_t k2p40 = uint64_t{1} << 40;
  return {
      // ---- init_weight_group ----
      bad_init("GroupMissing", "group", std::nullopt, E::kMissingField, "body.group"),
      bad_init("GroupEmpty", "group", "", E::kInvalidArgument, "body.group"),
      bad_init("GroupSlash", "group", "a/b", E::kInvalidArgument, "body.group"),
      bad_init("GroupSpace", "group", "a b", E::kInvalidArgument, "body.group"),
      bad_init("GroupTooLong", "group", repeat('g', 65), E::kInvalidArgument, "body.group"),
      bad_init("GroupBin", "group", Bin{"weights"}, E::kWrongType, "body.group"),
      bad_init("UniqueIdMissing", "unique_id", std::nullopt, E::kMissingField, "body.unique_id"),
      bad_init("UniqueIdStr", "unique_id", repeat('u', 128), E::kWrongType, "body.unique_id"),
      bad_init("UniqueIdShort", "unique_id", Bin{kUniqueId.substr(1)}, E::kInvalidArgument,
               "body.unique_id"),
      bad_init("UniqueIdLong", "unique_id", Bin{kUniqueId + "x"}, E::kInvalidArgument,
               "body.unique_id"),
      bad_init("WorldSizeMissing", "world_size", std::nullopt, E::kMissingField, "body.world_size"),
      bad_init("WorldSizeOne", "world_size", 1, E::kOutOfRange, "body.world_size"),
      bad_init("WorldSizeOver65536", "world_size", 65537, E::kOutOfRange, "body.world_size"),
      bad_init("WorldSizeFloat", "world_size", 3.0, E::kWrongType, "body.world_size"),
      bad_init("RankMissing", "rank", std::nullopt, E::kMissingField, "body.rank"),
      bad_init("RankNegative", "rank", -1, E::kOutOfRange, "body.rank"),
      bad_init("RankAtWorldSize", "rank", 3, E::kOutOfRange, "body.rank"),
      bad_init("RankIsRoot", "rank", 0, E::kInvalidArgument, "body.rank"),
      bad_init("RootAtWorldSize", "root", 3, E::kOutOfRange, "body.root"),
      bad_body("RankIsDefaultRoot", "init_weight_group",
               with(with(init_group_body(), "root", std::nullopt), "rank", 0), E::kInvalidArgument,
               "body.rank"),
      bad_init("NcclVersionMissing", "nccl_version", std::nullopt, E::kMissingField,
               "body.nccl_version"),
      bad_init("NcclVersionString", "nccl_version", "2.28.9", E::kWrongType, "body.nccl_version"),
      bad_init("NcclVersionOver32Bits", "nccl_version", k2p32, E::kOutOfRange, "body.nccl_version"),
      bad_init("GroupTimeoutZero", "timeout_s", 0.0, E::kOutOfRange, "body.timeout_s"),
      bad_init("GroupTimeoutOverAnHour", "timeout_s", 3601, E::kOutOfRange, "body.timeout_s"),
      bad_init("GroupTimeoutInf", "timeout_s", kInf, E::kOutOfRange, "body.timeout_s"),
      // ---- destroy_weight_group ----
      bad_body("DestroyGroupMissing", "destroy_weight_group", Map{}, E::kMissingField, "body.group"),
      bad_body("DestroyGroupInvalid", "destroy_weight_group", Map{{"group", "/x"}},
               E::kInvalidArgument, "body.group"),
      // ---- release_memory / resume_memory (SPEC §12) ----
      bad_body("ReleaseTagsEmpty", "release_memory", Map{{"tags", Array{}}}, E::kInvalidArgument, "body.tags"),
      bad_body("ReleaseTagUnknown", "release_memory", Map{{"tags", Array{"weights", "activations"}}},
               E::kInvalidArgument, "body.tags[1]"),
      bad_body("ReleaseTagTwice", "release_memory", Map{{"tags", Array{"kv_cache", "kv_cache"}}},
               E::kInvalidArgument, "body.tags[1]"),
      bad_body("ReleaseTagNotString", "release_memory", Map{{"tags", Array{1}}}, E::kWrongType, "body.tags[0]"),
      bad_body("ResumeTagEmptyString", "resume_memory", Map{{"tags", Array{""}}}, E::kInvalidArgument,
               "body.tags[0]"),
      bad_body("ResumeTagsNotArray", "resume_memory", Map{{"tags", "weights"}}, E::kWrongType, "body.tags"),
      // ---- update_weights with an nccl source ----
      bad_update("NcclGroupMissing", with(update, "source", with(nccl_source(), "group", std::nullopt)),
                 E::kMissingField, "body.source.group", {}),
      bad_update("NcclGroupInvalid", with(update, "source", nccl_source("w eights")),
                 E::kInvalidArgument, "body.source.group", {}),
      bad_update("NcclRootMissing", with(update, "source", with(nccl_source(), "root", std::nullopt)),
                 E::kMissingField, "body.source.root", {}),
      bad_update("NcclRootNegative", with(update, "source", nccl_source("weights", -1)),
                 E::kOutOfRange, "body.source.root", {}),
      bad_update("NcclSizeMissing", with(update, "source", with(nccl_source(), "size", std::nullopt)),
                 E::kMissingField, "body.source.size", {}),
      bad_update("NcclSizeOver2p40", with(update, "source", nccl_source("weights", 0, k2p40 + 1)),
                 E::kOutOfRange, "body.source.size", {}),
      bad_update("NcclEntryBeyondSize", with(update, "source", nccl_source("weights", 0, 31)),
                 E::kOutOfRange, "body.entries[2].byte_offset", {}),
      bad_update("NcclChecksumAlgo", with(nccl, "checksum", Map{{"algo", "xxh3"}, {"value", 1}}),
                 E::kInvalidArgument, "body.checksum.algo", {}),
      // ---- update_weights with a cuda_ipc source ----
      bad_update("IpcHandleMissing", with(update, "source", with(ipc_source(), "handle", std::nullopt)),
                 E::kMissingField, "body.source.handle", {}),
      bad_update("IpcHandleStr", with(update, "source", ipc_source(repeat('h', 64))), E::kWrongType,
                 "body.source.handle", {}),
      bad_update("IpcHandleShort", with(update, "source", ipc_source(Bin{kIpcHandle.substr(2)})),
                 E::kInvalidArgument, "body.source.handle", {}),
      // torch's _share_cuda_() gives 66 bytes: its 2-byte prefix must be stripped first.
      bad_update("IpcHandleWithTorchPrefix",
                 with(update, "source", ipc_source(Bin{std::string(2, '\0') + kIpcHandle})),
                 E::kInvalidArgument, "body.source.handle", {}),
      bad_update("IpcOffsetNegative", with(update, "source", ipc_source(Bin{kIpcHandle}, -4)),
                 E::kOutOfRange, "body.source.offset", {}),
      bad_update("IpcSizeOver2p40",
                 with(update, "source", ipc_source(Bin{kIpcHandle}, 0, k2p40 + 1)), E::kOutOfRange,
                 "body.source.size", {}),
      bad_update("IpcEndOverflows",
                 with(update, "source", ipc_source(Bin{kIpcHandle}, UINT64_MAX - 8, 32)),
                 E::kOutOfRange, "body.source.size", {}),
      bad_update("IpcUuidMissing",
                 with(update, "source", with(ipc_source(), "device_uuid", std::nullopt)),
                 E::kMissingField, "body.source.device_uuid", {}),
      bad_update("IpcUuidEmpty",
                 with(update, "source", ipc_source(Bin{kIpcHandle}, 0, 32, Bin{""})),
                 E::kInvalidArgument, "body.source.device_uuid", {}),
      bad_update("IpcUuidAsText",
                 with(update, "source",
                      ipc_source(Bin{kIpcHandle}, 0, 32, "GPU-a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90")),
                 E::kWrongType, "body.source.device_uuid", {}),
      bad_update("IpcEntryBeyondRange", with(update, "source", ipc_source(Bin{kIpcHandle}, 0, 30)),
                 E::kOutOfRange, "body.entries[2].byte_offset", {}),
  };
}

std::vector<BadCase> bad_cases() {
  const Map status_env = envelope("status", 77, Map{});
  Limits small;  // makes per-field size checks reachable below the parse-time bound
  small.max_input_tokens = 4;
  small.max_versions = 8;
  small.max_stop_token_ids = 2;
  small.max_bucket_entries = 8;  // a bucket's entries bound the parse too (SPEC §9)
  Limits two_versions;
  two_versions.max_versions = 2;

  return {
      // ---- envelope ----
      bad_env("EnvelopeNotMap", Array{1, "status", 77, Map{}}, E::kBadMessage, ""),
      bad_env("EnvelopeIsScalar", 1, E::kBadMessage, ""),
      bad_env("VersionMissing", with(status_env, "v", std::nullopt), E::kMissingField, "v", 77),
      bad_env("VersionString", with(status_env, "v", "1"), E::kWrongType, "v", 77),
      bad_env("VersionFloat", with(status_env, "v", 1.0), E::kWrongType, "v", 77),
      bad_env("VersionTwo", with(status_env, "v", 2), E::kUnsupportedVersion, "v", 77),
      bad_env("VersionZero", with(status_env, "v", 0), E::kUnsupportedVersion, "v", 77),
      bad_env("VersionNegative", with(status_env, "v", -1), E::kUnsupportedVersion, "v", 77),
      bad_env("IdMissing", with(status_env, "id", std::nullopt), E::kMissingField, "id"),
      bad_env("IdNegative", with(status_env, "id", -1), E::kOutOfRange, "id"),
      bad_env("IdFloat", with(status_env, "id", 7.0), E::kWrongType, "id"),
      bad_env("TypeMissing", with(status_env, "type", std::nullopt), E::kMissingField, "type", 77),
      bad_env("TypeInt", with(status_env, "type", 3), E::kWrongType, "type", 77),
      bad_env("TypeUnknown", with(status_env, "type", "frobnicate"), E::kUnknownType, "type", 77),
      bad_env("TypeEmpty", with(status_env, "type", ""), E::kUnknownType, "type", 77),
      bad_env("TypeIsAReply", with(status_env, "type", "status.ok"), E::kUnknownType, "type", 77),
      bad_env("BodyArray", with(status_env, "body", Array{}), E::kWrongType, "body", 77),
      bad_env("BodyNil", with(status_env, "body", nullptr), E::kWrongType, "body", 77),
      bad_env("DuplicateEnvelopeKey", Map{{"v", 1}, {"type", "status"}, {"id", 77}, {"id", 78}},
              E::kBadMessage, "id", 77),
      BadCase{"NonStringEnvelopeKey", envelope_with_int_key(), E::kBadMessage, "", 77},
      bad_env("NonStringBodyKey", envelope("status", 77, Raw{"\x81\x01\x02"}), E::kBadMessage,
              "body", 77),
      bad_body(
          "DuplicateBodyKey", "generate",
          [] {
            Map m = generate_body();
            m.emplace_back("rid", "again");
            return m;
          }(),
          E::kBadMessage, "body.rid"),

      // ---- generate ----
      bad_gen("RidMissing", "rid", std::nullopt, E::kMissingField, "body.rid"),
      bad_gen("RidInt", "rid", 5, E::kWrongType, "body.rid"),
      bad_gen("RidBin", "rid", Bin{"r-1"}, E::kWrongType, "body.rid"),
      bad_gen("RidNil", "rid", nullptr, E::kWrongType, "body.rid"),
      bad_gen("RidEmpty", "rid", "", E::kInvalidArgument, "body.rid"),
      bad_gen("RidTooLong", "rid", repeat('r', 257), E::kTooLarge, "body.rid"),
      bad_gen("RidInvalidUtf8", "rid", "\xff\xfe", E::kInvalidArgument, "body.rid"),
      bad_gen("RidOverlongUtf8", "rid", "\xc0\xaf", E::kInvalidArgument, "body.rid"),
      bad_gen("RidSurrogateUtf8", "rid", "\xed\xa0\x80", E::kInvalidArgument, "body.rid"),
      bad_gen("RidTruncatedUtf8", "rid", "ab\xe2\x82", E::kInvalidArgument, "body.rid"),
      bad_gen("InputIdsMissing", "input_ids", std::nullopt, E::kMissingField, "body.input_ids"),
      bad_gen("InputIdsString", "input_ids", "1 2 3", E::kWrongType, "body.input_ids"),
      bad_gen("InputIdsEmpty", "input_ids", Array{}, E::kInvalidArgument, "body.input_ids"),
      bad_gen("InputIdNegative", "input_ids", Array{1, 2, 3, -1}, E::kOutOfRange,
              "body.input_ids[3]"),
      bad_gen("InputIdTooBig", "input_ids", Array{k2p31}, E::kOutOfRange, "body.input_ids[0]"),
      bad_gen("InputIdFloat", "input_ids", Array{1, 2.0}, E::kWrongType, "body.input_ids[1]"),
      bad_gen("InputIdNil", "input_ids", Array{1, nullptr}, E::kWrongType, "body.input_ids[1]"),
      bad_gen("MaxNewTokensZero", "max_new_tokens", 0, E::kOutOfRange, "body.max_new_tokens"),
      bad_gen("MaxNewTokensOverLimit", "max_new_tokens", 65537, E::kOutOfRange,
              "body.max_new_tokens"),
      bad_gen("MaxNewTokensNegative", "max_new_tokens", -3, E::kOutOfRange, "body.max_new_tokens"),
      bad_gen("MaxNewTokensFloat", "max_new_tokens", 16.0, E::kWrongType, "body.max_new_tokens"),
      bad_gen("MaxNewTokensString", "max_new_tokens", "16", E::kWrongType, "body.max_new_tokens"),
      bad_gen("MaxNewTokensNil", "max_new_tokens", nullptr, E::kWrongType, "body.max_new_tokens"),
      bad_gen("TemperatureString", "temperature", "hot", E::kWrongType, "body.temperature"),
      bad_gen("TemperatureBool", "temperature", true, E::kWrongType, "body.temperature"),
      bad_gen("TemperatureNegative", "temperature", -0.5, E::kOutOfRange, "body.temperature"),
      bad_gen("TemperatureHuge", "temperature", 100.5, E::kOutOfRange, "body.temperature"),
      bad_gen("TemperatureNaN", "temperature", kNaN, E::kOutOfRange, "body.temperature"),
      bad_gen("TemperatureInf", "temperature", kInf, E::kOutOfRange, "body.temperature"),
      bad_gen("TemperatureMinusInf", "temperature", -kInf, E::kOutOfRange, "body.temperature"),
      bad_gen("DeadlineNegative", "deadline_s", -0.5, E::kOutOfRange, "body.deadline_s"),
      bad_gen("DeadlineOverADay", "deadline_s", 86400.5, E::kOutOfRange, "body.deadline_s"),
      bad_gen("DeadlineNaN", "deadline_s", kNaN, E::kOutOfRange, "body.deadline_s"),
      bad_gen("DeadlineInf", "deadline_s", kInf, E::kOutOfRange, "body.deadline_s"),
      bad_gen("DeadlineString", "deadline_s", "5", E::kWrongType, "body.deadline_s"),
      bad_gen("TopPZero", "top_p", 0.0, E::kOutOfRange, "body.top_p"),
      bad_gen("TopPIntZero", "top_p", 0, E::kOutOfRange, "body.top_p"),
      bad_gen("TopPAboveOne", "top_p", 1.5, E::kOutOfRange, "body.top_p"),
      bad_gen("TopPNaN", "top_p", kNaN, E::kOutOfRange, "body.top_p"),
      bad_gen("TopKNegative", "top_k", -1, E::kOutOfRange, "body.top_k"),
      bad_gen("TopKTooBig", "top_k", k2p31, E::kOutOfRange, "body.top_k"),
      bad_gen("TopKFloat", "top_k", 4.0, E::kWrongType, "body.top_k"),
      bad_gen("MinPNegative", "min_p", -0.01, E::kOutOfRange, "body.min_p"),
      bad_gen("MinPAboveOne", "min_p", 1.01, E::kOutOfRange, "body.min_p"),
      bad_gen("SeedNegative", "seed", -1, E::kOutOfRange, "body.seed"),
      bad_gen("SeedFloat", "seed", 1.0, E::kWrongType, "body.seed"),
      bad_gen("SeedString", "seed", "42", E::kWrongType, "body.seed"),
      bad_gen("StopIdsString", "stop_token_ids", "2", E::kWrongType, "body.stop_token_ids"),
      bad_gen("StopIdNegative", "stop_token_ids", Array{1, -2}, E::kOutOfRange,
              "body.stop_token_ids[1]"),
      bad_gen("StopIdsTooMany", "stop_token_ids", count_up(257), E::kTooLarge,
              "body.stop_token_ids"),
      bad_gen("ReturnLogprobInt", "return_logprob", 1, E::kWrongType, "body.return_logprob"),
      bad_gen("ReturnLogprobNil", "return_logprob", nullptr, E::kWrongType, "body.return_logprob"),
      bad_gen("ReturnRoutedExpertsInt", "return_routed_experts", 0, E::kWrongType,
              "body.return_routed_experts"),
      bad_gen("StreamString", "stream", "true", E::kWrongType, "body.stream"),
      bad_gen("StartLenNegative", "routed_experts_start_len", -1, E::kOutOfRange,
              "body.routed_experts_start_len"),
      bad_gen("StartLenTooBig", "routed_experts_start_len", k2p32, E::kOutOfRange,
              "body.routed_experts_start_len"),
      bad_gen("StartLenFloat", "routed_experts_start_len", 1.0, E::kWrongType,
              "body.routed_experts_start_len"),
      bad_body("InputIdsOverFieldLimit", "generate",
               with(generate_body(), "input_ids", count_up(5)), E::kTooLarge, "body.input_ids",
               small),

      // ---- abort ----
      bad_body("AbortNeither", "abort", Map{}, E::kInvalidArgument, "body"),
      bad_body("AbortBoth", "abort", Map{{"rid", "a"}, {"all", true}}, E::kInvalidArgument, "body"),
      bad_body("AbortAllFalse", "abort", Map{{"all", false}}, E::kInvalidArgument, "body"),
      bad_body("AbortRidNilAllFalse", "abort", Map{{"rid", nullptr}, {"all", false}},
               E::kInvalidArgument, "body"),
      bad_body("AbortRidEmpty", "abort", Map{{"rid", ""}}, E::kInvalidArgument, "body.rid"),
      bad_body("AbortRidInt", "abort", Map{{"rid", 5}}, E::kWrongType, "body.rid"),
      bad_body("AbortRidTooLong", "abort", Map{{"rid", repeat('x', 257)}}, E::kTooLarge,
               "body.rid"),
      bad_body("AbortAllInt", "abort", Map{{"all", 1}}, E::kWrongType, "body.all"),
      bad_env("AbortNoBody", with(envelope("abort", 77, Map{}), "body", std::nullopt),
              E::kInvalidArgument, "body", 77),

      // ---- hello ----
      bad_body("HelloNoVersions", "hello", Map{{"client", "c"}}, E::kMissingField, "body.versions"),
      bad_body("HelloVersionsEmpty", "hello", Map{{"versions", Array{}}}, E::kInvalidArgument,
               "body.versions"),
      bad_body("HelloVersionsInt", "hello", Map{{"versions", 1}}, E::kWrongType, "body.versions"),
      bad_body("HelloVersionNegative", "hello", Map{{"versions", Array{1, -1}}}, E::kOutOfRange,
               "body.versions[1]"),
      bad_body("HelloVersionTooBig", "hello", Map{{"versions", Array{k2p32}}}, E::kOutOfRange,
               "body.versions[0]"),
      bad_body("HelloVersionsTooMany", "hello", Map{{"versions", count_up(3)}}, E::kTooLarge,
               "body.versions", two_versions),
      bad_body("HelloClientInt", "hello", Map{{"client", 5}, {"versions", Array{1}}}, E::kWrongType,
               "body.client"),

      // ---- shutdown ----
      bad_body("ShutdownDrainInt", "shutdown", Map{{"drain", 1}}, E::kWrongType, "body.drain"),
      bad_body("ShutdownDeadlineNegative", "shutdown", Map{{"deadline_s", -1}}, E::kOutOfRange,
               "body.deadline_s"),
      bad_body("ShutdownDeadlineHuge", "shutdown", Map{{"deadline_s", 3600.5}}, E::kOutOfRange,
               "body.deadline_s"),
      bad_body("ShutdownDeadlineNaN", "shutdown", Map{{"deadline_s", kNaN}}, E::kOutOfRange,
               "body.deadline_s"),
      bad_body("ShutdownDeadlineString", "shutdown", Map{{"deadline_s", "5"}}, E::kWrongType,
               "body.deadline_s"),

      // ---- parse-time bounds: refused before allocation, no field read yet ----
      bad_body("ArrayOverParseBound", "generate", with(generate_body(), "input_ids", count_up(9)),
               E::kTooLarge, "", small),
      bad_body("StringOverParseBound", "status", Map{{"note", repeat('n', 4097)}}, E::kTooLarge,
               ""),
      bad_body("BinOverParseBound", "status", Map{{"blob", Bin{repeat('b', 4097)}}}, E::kTooLarge,
               ""),
      bad_body(
          "MapOverParseBound", "status",
          [] {
            Map m;
            for (int i = 0; i < 129; ++i) m.emplace_back("k" + std::to_string(i), i);
            return m;
          }(),
          E::kTooLarge, ""),
      bad_body(
          "NestedTooDeep", "status",
          [] {
            Value v = 1;
            for (int i = 0; i < 15; ++i) v = Array{v};  // + envelope + body = 17 levels
            return Map{{"deep", v}};
          }(),
          E::kTooLarge, ""),
      bad_env("ArrayHeaderClaimsFourBillion",
              Map{{"v", 1},
                  {"type", "generate"},
                  {"id", 5},
                  {"body", Raw{"\x81\xa9input_ids\xdd\xff\xff\xff\xff"}}},
              E::kTooLarge, "", 5),
      // The id after the fault is found too, as long as the bytes up to it are msgpack.
      bad_env(
          "IdAfterOversizedBody",
          Map{{"v", 1}, {"type", "generate"}, {"body", Map{{"x", count_up(200000)}}}, {"id", 5}},
          E::kTooLarge, "", 5),
  };
}

class RefusedRequest : public ::testing::TestWithParam<BadCase> {};

TEST_P(RefusedRequest, TypedCodeAndField) {
  const BadCase& c = GetParam();
  const RequestDecodeResult r = decode(c.envelope, c.limits, c.frames);
  ASSERT_FALSE(r.status.ok());
  EXPECT_EQ(error_code_name(r.status.code()), error_code_name(c.code)) << r.status.to_string();
  EXPECT_EQ(r.status.field(), c.field) << r.status.to_string();
  EXPECT_EQ(r.env.id, c.id) << "the error reply must echo the id whenever it was readable";
  EXPECT_FALSE(r.request.has_value());
  EXPECT_FALSE(r.status.message().empty());
}

INSTANTIATE_TEST_SUITE_P(Codec, RefusedRequest, ::testing::ValuesIn(bad_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(WeightUpdate, RefusedRequest, ::testing::ValuesIn(weight_update_bad_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Transports, RefusedRequest, ::testing::ValuesIn(transport_bad_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(RefusedRequestTable, IntKeyInputsReallyHaveIntKeys) {
  // The non-string-key cases splice raw bytes; check that msgpack reads them as
  // the intended map and not as something truncated or with trailing bytes.
  const std::string env = envelope_with_int_key();
  size_t off = 0;
  msgpack::object_handle h = msgpack::unpack(env.data(), env.size(), off);
  EXPECT_EQ(off, env.size());
  ASSERT_EQ(h.get().type, msgpack::type::MAP);
  ASSERT_EQ(h.get().via.map.size, 4u);
  EXPECT_EQ(h.get().via.map.ptr[3].key.type, msgpack::type::POSITIVE_INTEGER);
}

// ---------------------------------------------------------------------------
// Accepted requests.

GenerateRequest decode_generate(const Map& body, const Limits& limits = {}) {
  const RequestDecodeResult r = decode(bytes(envelope("generate", 9, body)), limits);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  if (!r.status.ok()) return {};
  return std::get<GenerateRequest>(*r.request);
}

TEST(AcceptedRequest, GenerateAllFields) {
  const GenerateRequest g = decode_generate(generate_body());
  EXPECT_EQ(g.rid, "r-1");
  EXPECT_EQ(g.input_ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(g.max_new_tokens, 8u);
  EXPECT_EQ(g.temperature, 0.5);
  EXPECT_EQ(g.top_p, 0.9);
  EXPECT_EQ(g.top_k, 5);
  EXPECT_EQ(g.min_p, 0.1);
  EXPECT_EQ(g.seed, std::optional<uint64_t>(42));
  EXPECT_EQ(g.stop_token_ids, (std::vector<int32_t>{2}));
  EXPECT_TRUE(g.return_logprob);
  EXPECT_TRUE(g.return_routed_experts);
  EXPECT_EQ(g.routed_experts_start_len, 1u);
  EXPECT_FALSE(g.stream);
}

TEST(AcceptedRequest, GenerateMinimalTakesStructDefaults) {
  const GenerateRequest g = decode_generate(Map{{"rid", "x"}, {"input_ids", Array{0}}});
  const GenerateRequest d;
  EXPECT_EQ(g.max_new_tokens, d.max_new_tokens);
  EXPECT_EQ(g.temperature, d.temperature);
  EXPECT_EQ(g.top_p, d.top_p);
  EXPECT_EQ(g.top_k, d.top_k);
  EXPECT_EQ(g.min_p, d.min_p);
  EXPECT_FALSE(g.seed.has_value());
  EXPECT_TRUE(g.stop_token_ids.empty());
  EXPECT_EQ(g.return_logprob, d.return_logprob);
  EXPECT_EQ(g.return_routed_experts, d.return_routed_experts);
  EXPECT_EQ(g.routed_experts_start_len, d.routed_experts_start_len);
  EXPECT_EQ(g.stream, d.stream);
}

TEST(AcceptedRequest, DeadlineIsOptionalAndRoundTrips) {
  EXPECT_EQ(decode_generate(generate_body()).deadline_s, 0.0);
  EXPECT_EQ(decode_generate(with(generate_body(), "deadline_s", 2.5)).deadline_s, 2.5);
  EXPECT_EQ(decode_generate(with(generate_body(), "deadline_s", 86400.0)).deadline_s, 86400.0);
}

TEST(AcceptedRequest, NilSeedMeansAbsent) {
  EXPECT_FALSE(decode_generate(with(generate_body(), "seed", nullptr)).seed.has_value());
  EXPECT_EQ(decode_generate(with(generate_body(), "seed", UINT64_MAX)).seed,
            std::optional<uint64_t>(UINT64_MAX));
  EXPECT_EQ(decode_generate(with(generate_body(), "seed", 0)).seed, std::optional<uint64_t>(0));
}

TEST(AcceptedRequest, BoundaryValues) {
  Map b = generate_body();
  b = with(b, "input_ids", Array{0, k2p31 - 1});
  b = with(b, "max_new_tokens", 65536);
  b = with(b, "temperature", 100.0);
  b = with(b, "top_p", 1.0);
  b = with(b, "top_k", k2p31 - 1);
  b = with(b, "min_p", 1.0);
  b = with(b, "routed_experts_start_len", k2p32 - 1);
  b = with(b, "stop_token_ids", count_up(256));
  b = with(b, "rid", repeat('r', 256));
  const GenerateRequest g = decode_generate(b);
  EXPECT_EQ(g.input_ids[1], std::numeric_limits<int32_t>::max());
  EXPECT_EQ(g.max_new_tokens, 65536u);
  EXPECT_EQ(g.top_k, std::numeric_limits<int32_t>::max());
  EXPECT_EQ(g.routed_experts_start_len, std::numeric_limits<uint32_t>::max());
  EXPECT_EQ(g.stop_token_ids.size(), 256u);
  EXPECT_EQ(g.rid.size(), 256u);
  EXPECT_EQ(decode_generate(with(generate_body(), "temperature", 0.0)).temperature, 0.0);
  EXPECT_EQ(decode_generate(with(generate_body(), "min_p", 0.0)).min_p, 0.0);
}

TEST(AcceptedRequest, IntegersWhereFloatsAreExpected) {
  Map b = with(generate_body(), "temperature", 1);
  b = with(b, "top_p", 1);
  b = with(b, "min_p", 0);
  const GenerateRequest g = decode_generate(b);
  EXPECT_EQ(g.temperature, 1.0);
  EXPECT_EQ(g.top_p, 1.0);
  EXPECT_EQ(g.min_p, 0.0);
}

TEST(AcceptedRequest, AnyIntegerEncodingAndFloat32) {
  // int8 5, int64 7, uint16 300 for fields of other widths; float32 0.5.
  Map b = with(generate_body(), "max_new_tokens", Raw{std::string("\xd0\x05", 2)});
  b = with(b, "top_k", Raw{std::string("\xd3\0\0\0\0\0\0\0\x07", 9)});
  b = with(b, "input_ids", Array{Raw{std::string("\xcd\x01\x2c", 3)}});
  b = with(b, "temperature", Raw{std::string("\xca\x3f\x00\x00\x00", 5)});
  const GenerateRequest g = decode_generate(b);
  EXPECT_EQ(g.max_new_tokens, 5u);
  EXPECT_EQ(g.top_k, 7);
  EXPECT_EQ(g.input_ids, std::vector<int32_t>{300});
  EXPECT_EQ(g.temperature, 0.5);
}

TEST(AcceptedRequest, ManyBucketEntriesDecodeAndTheFirstRepeatIsNamed) {
  // 5,000 entries whose names share a long prefix: every one decoded as written, and a name
  // repeated twice over is reported at its first repeat in list order.
  Array entries;
  for (int i = 0; i < 5000; ++i)
    entries.push_back(entry("model.layers." + std::to_string(i) + ".mlp.weight", "bfloat16", Array{2}, 4u * i, 4));
  const std::string bucket(5000 * 4, '\x02');
  Map body = with(update_body(entries), "checksum", std::nullopt);
  RequestDecodeResult r = decode(bytes(envelope("update_weights", 3, body)), {}, {bucket});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& got = std::get<UpdateWeightsRequest>(*r.request).entries;
  ASSERT_EQ(got.size(), 5000u);
  EXPECT_EQ(got[4321].name, "model.layers.4321.mlp.weight");
  EXPECT_EQ(got[4321].dtype, DType::kBF16);
  EXPECT_EQ(got[4321].shape, std::vector<int64_t>{2});
  EXPECT_EQ(got[4321].byte_offset, 4u * 4321);
  EXPECT_EQ(got[4321].nbytes, 4u);
  entries[4000] = with(std::get<Map>(entries[4000].v), "name", "model.layers.10.mlp.weight");
  entries[3000] = with(std::get<Map>(entries[3000].v), "name", "model.layers.2999.mlp.weight");
  r = decode(bytes(envelope("update_weights", 3, with(update_body(entries), "checksum", std::nullopt))), {}, {bucket});
  EXPECT_EQ(r.status.field(), "body.entries[3000].name") << r.status.to_string();
}

TEST(AcceptedRequest, UnknownKeysAreIgnoredAtEveryLevel) {
  Map body = with(generate_body(), "future_field", Map{{"nested", Array{1, "x", nullptr, 2.5}}});
  Map env = with(envelope("generate", 9, body), "trace_id", "abc");
  const RequestDecodeResult r = decode(bytes(env));
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(std::get<GenerateRequest>(*r.request).rid, "r-1");
}

TEST(AcceptedRequest, NestingUpToTheBoundPasses) {
  Value v = 1;
  for (int i = 0; i < 14; ++i) v = Array{v};  // + envelope + body = 16 levels
  const RequestDecodeResult r = decode(bytes(envelope("status", 1, Map{{"deep", v}})));
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}

TEST(AcceptedRequest, KeyOrderDoesNotMatter) {
  Map body = generate_body();
  std::reverse(body.begin(), body.end());
  Map env{{"body", body}, {"id", 9}, {"type", "generate"}, {"v", 1}};
  const RequestDecodeResult r = decode(bytes(env));
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.env.id, 9u);
  EXPECT_EQ(std::get<GenerateRequest>(*r.request).top_k, 5);
}

TEST(AcceptedRequest, AbsentBodyIsEmptyMap) {
  const RequestDecodeResult s =
      decode(bytes(with(envelope("status", 3, Map{}), "body", std::nullopt)));
  ASSERT_TRUE(s.status.ok()) << s.status.to_string();
  EXPECT_TRUE(std::holds_alternative<StatusRequest>(*s.request));
  EXPECT_EQ(s.env.type, "status");
  EXPECT_EQ(s.env.v, 1u);

  const RequestDecodeResult d =
      decode(bytes(with(envelope("shutdown", 4, Map{}), "body", std::nullopt)));
  ASSERT_TRUE(d.status.ok()) << d.status.to_string();
  const auto& sd = std::get<ShutdownRequest>(*d.request);
  EXPECT_TRUE(sd.drain);
  EXPECT_EQ(sd.deadline_s, 30.0);
}

TEST(AcceptedRequest, AbortForms) {
  auto abort_of = [](Map body) {
    const RequestDecodeResult r = decode(bytes(envelope("abort", 1, std::move(body))));
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    return r.status.ok() ? std::get<AbortRequest>(*r.request) : AbortRequest{};
  };
  AbortRequest a = abort_of(Map{{"rid", "x"}});
  EXPECT_EQ(a.rid, std::optional<std::string>("x"));
  EXPECT_FALSE(a.all);
  a = abort_of(Map{{"rid", "x"}, {"all", false}});
  EXPECT_EQ(a.rid, std::optional<std::string>("x"));
  a = abort_of(Map{{"all", true}});
  EXPECT_FALSE(a.rid.has_value());
  EXPECT_TRUE(a.all);
  a = abort_of(Map{{"rid", nullptr}, {"all", true}});
  EXPECT_FALSE(a.rid.has_value());
}

TEST(AcceptedRequest, HelloAndShutdown) {
  RequestDecodeResult r = decode(bytes(envelope("hello", 1, Map{{"versions", Array{1, 2, 7}}})));
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& h = std::get<HelloRequest>(*r.request);
  EXPECT_EQ(h.versions, (std::vector<uint32_t>{1, 2, 7}));
  EXPECT_EQ(h.client, "");

  r = decode(bytes(envelope("shutdown", 2, Map{{"drain", false}, {"deadline_s", 10}})));
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_FALSE(std::get<ShutdownRequest>(*r.request).drain);
  EXPECT_EQ(std::get<ShutdownRequest>(*r.request).deadline_s, 10.0);
}

TEST(AcceptedRequest, Utf8StringsPass) {
  EXPECT_EQ(
      decode_generate(with(generate_body(), "rid", "r\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x98\x80")).rid,
      "r\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x98\x80");
}

TEST(AcceptedRequest, IdIsFilledForEveryType) {
  const RequestDecodeResult r = decode(bytes(envelope("status", UINT64_MAX, Map{})));
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.env.id, UINT64_MAX);
}

// ---------------------------------------------------------------------------
// Envelope-level framing and limits.

TEST(Framing, TrailingBytesAreRefused) {
  const std::string env = bytes(envelope("status", 3, Map{}));
  const RequestDecodeResult r = decode(env + std::string("\xc0", 1));
  EXPECT_EQ(r.status.code(), ErrorCode::kBadMessage);
  EXPECT_NE(r.status.message().find("trailing"), std::string::npos);
  EXPECT_EQ(r.env.id, 3u);
  // Two complete envelopes back to back are trailing bytes too.
  EXPECT_EQ(decode(env + env).status.code(), ErrorCode::kBadMessage);
}

TEST(Framing, EveryTruncationIsBadMessage) {
  const std::string env = bytes(envelope("generate", 9, generate_body()));
  // {v, type, id: 9, ...}: the id is readable from the prefix that ends right after it.
  const size_t id_end = env.find(std::string("\xa2id\x09", 4)) + 4;
  for (size_t n = 0; n < env.size(); ++n) {
    const RequestDecodeResult r = decode(env.substr(0, n));
    EXPECT_EQ(r.status.code(), ErrorCode::kBadMessage) << "prefix of " << n << " bytes";
    EXPECT_EQ(r.env.id, n >= id_end ? 9u : 0u) << "prefix of " << n << " bytes";
  }
}

TEST(Framing, ReservedByteIsBadMessage) {
  EXPECT_EQ(decode(std::string("\xc1", 1)).status.code(), ErrorCode::kBadMessage);
}

TEST(Framing, EnvelopeOverLimitIsNotParsed) {
  Limits l;
  l.max_envelope_bytes = 64;
  const std::string env = bytes(envelope("generate", 9, generate_body()));
  ASSERT_GT(env.size(), 64u);
  const RequestDecodeResult r = decode(env, l);
  EXPECT_EQ(r.status.code(), ErrorCode::kTooLarge);
  EXPECT_EQ(r.status.field(), "");
  // Not decoded, but the id near its start is still echoed.
  EXPECT_EQ(r.env.id, 9u);
  l.max_envelope_bytes = env.size();
  EXPECT_TRUE(decode(env, l).status.ok());
}

TEST(Framing, PayloadFrameLimits) {
  Limits l;
  l.max_frames = 2;
  l.max_frame_bytes = 8;
  const std::string env = bytes(envelope("status", 3, Map{}));
  // v1 requests carry no payload frames; ones within the limits are ignored.
  EXPECT_TRUE(decode(env, l, {"a", "12345678"}).status.ok());

  RequestDecodeResult r = decode(env, l, {"a", "b", "c"});
  EXPECT_EQ(r.status.code(), ErrorCode::kTooLarge);
  EXPECT_EQ(r.env.id, 3u);

  r = decode(env, l, {"a", "123456789"});
  EXPECT_EQ(r.status.code(), ErrorCode::kTooLarge);
  EXPECT_EQ(r.status.field(), "frames[1]");
}

TEST(Framing, ParseBoundFollowsLimits) {
  // The longest array any request field allows is the parse-time bound.
  Limits l;
  l.max_input_tokens = 1000;
  const Map body = with(generate_body(), "input_ids", count_up(1000));
  EXPECT_TRUE(decode(bytes(envelope("generate", 1, body)), l).status.ok());
  const Map over = with(generate_body(), "input_ids", count_up(1001));
  const RequestDecodeResult r = decode(bytes(envelope("generate", 1, over)), l);
  EXPECT_EQ(r.status.code(), ErrorCode::kTooLarge);
}

TEST(Framing, GarbageNeverCrashes) {
  // Random bytes and random corruptions of a valid message: every outcome must
  // be a status (and under ASan, no memory error), never an exception.
  std::mt19937 rng(1234);
  const std::string valid = bytes(envelope("generate", 9, generate_body()));
  for (int i = 0; i < 3000; ++i) {
    std::string s;
    if (i % 2 == 0) {
      s.resize(rng() % 64);
      for (auto& c : s) c = static_cast<char>(rng());
    } else {
      s = valid;
      for (int k = 0, n = 1 + rng() % 4; k < n; ++k) s[rng() % s.size()] = static_cast<char>(rng());
    }
    const RequestDecodeResult r = decode(s);
    if (r.status.ok())
      EXPECT_TRUE(r.request.has_value());
    else
      EXPECT_FALSE(r.request.has_value());
  }
}

// ---------------------------------------------------------------------------
// Round trips: encode, decode, re-encode. Instances use non-default values in
// every field, so a field the decoder dropped would change the re-encoding.

template <class T>
T request_round_trip(const T& req, uint64_t id = 41) {
  const WireMessage m = encode_request(id, Request(req));
  EXPECT_TRUE(m.frames.empty());
  const RequestDecodeResult r = decode(m.envelope);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  if (!r.status.ok()) return T{};
  EXPECT_EQ(r.env.id, id);
  EXPECT_EQ(r.env.type, request_type_name(Request(req)));
  EXPECT_EQ(encode_request(id, *r.request).envelope, m.envelope);
  return std::get<T>(*r.request);
}

TEST(RoundTrip, GenerateDeadlineIsWrittenOnlyWhenSet) {
  GenerateRequest g;
  g.rid = "r";
  g.input_ids = {1};
  const std::string plain = encode_request(3, Request(g)).envelope;
  g.deadline_s = 7.25;
  EXPECT_EQ(request_round_trip(g).deadline_s, 7.25);
  EXPECT_GT(encode_request(3, Request(g)).envelope.size(), plain.size());
  EXPECT_EQ(plain.find("deadline_s"), std::string::npos);
  // A bad value is written, not dropped, so the daemon refuses it instead of ignoring it.
  g.deadline_s = -1.0;
  const RequestDecodeResult r = decode(encode_request(3, Request(g)).envelope);
  EXPECT_EQ(r.status.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status.field(), "body.deadline_s");
}

GenerateRequest sample_generate() {
  GenerateRequest g;
  g.rid = "rid-é";
  g.input_ids = {0, 1, 127, 128, 255, 256, 65535, 65536, std::numeric_limits<int32_t>::max()};
  g.max_new_tokens = 300;
  g.temperature = 0.3;
  g.top_p = 0.25;
  g.top_k = 70000;
  g.min_p = 0.125;
  g.seed = 1ull << 40;
  g.stop_token_ids = {7, 8};
  g.return_logprob = true;
  g.return_routed_experts = true;
  g.routed_experts_start_len = 5;
  g.stream = false;
  return g;
}

TEST(RoundTrip, Requests) {
  const GenerateRequest g = request_round_trip(sample_generate());
  EXPECT_EQ(g.input_ids, sample_generate().input_ids);
  EXPECT_EQ(g.seed, sample_generate().seed);

  GenerateRequest no_seed = sample_generate();
  no_seed.seed.reset();
  EXPECT_FALSE(request_round_trip(no_seed).seed.has_value());

  HelloRequest h;
  h.client = "trainer";
  h.versions = {1, 2};
  EXPECT_EQ(request_round_trip(h).versions, h.versions);

  request_round_trip(StatusRequest{});

  AbortRequest a;
  a.rid = "x";
  EXPECT_EQ(request_round_trip(a).rid, a.rid);
  AbortRequest all;
  all.all = true;
  EXPECT_TRUE(request_round_trip(all).all);

  ShutdownRequest s;
  s.drain = false;
  s.deadline_s = 1.5;
  EXPECT_EQ(request_round_trip(s).deadline_s, 1.5);
}

template <class T>
T incoming_round_trip(const WireMessage& m, const Limits& limits = {}) {
  const auto r = decode_in(m, limits);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return T{};
  EXPECT_TRUE(std::holds_alternative<T>(r->msg));
  return std::get<T>(r->msg);
}

ModelInfo sample_model() { return ModelInfo{"m", "qwen3_moe", 151936, 48, 47, 128, 8, "uint8"}; }

TEST(RoundTrip, Replies) {
  HelloReply h;
  h.build = "b";
  h.gpu = 3;
  h.model = sample_model();
  h.weight_version = 9;
  h.limits.max_frames = 3;
  h.limits.max_frame_bytes = 1ull << 40;
  WireMessage m = encode_reply(5, h);
  HelloReply h2 = incoming_round_trip<HelloReply>(m);
  EXPECT_EQ(encode_reply(5, h2).envelope, m.envelope);
  EXPECT_EQ(h2.limits.max_frame_bytes, 1ull << 40);
  EXPECT_EQ(h2.model.vocab_size, 151936u);

  StatusReply s;
  s.state = "draining";
  s.ready = true;
  s.reason = "r";
  s.weight_version = 2;
  s.num_waiting = 3;
  s.num_running = 4;
  s.num_requests_total = 5;
  s.num_tokens_generated_total = 6;
  s.uptime_s = 7.5;
  s.build = "b";
  s.model = sample_model();
  m = encode_reply(6, s);
  EXPECT_EQ(encode_reply(6, incoming_round_trip<StatusReply>(m)).envelope, m.envelope);

  m = encode_reply(7, GenerateReply{"rid"});
  EXPECT_EQ(incoming_round_trip<GenerateReply>(m).rid, "rid");
  m = encode_reply(8, AbortReply{4});
  EXPECT_EQ(incoming_round_trip<AbortReply>(m).num_aborted, 4u);
  m = encode_reply(9, ShutdownReply{false});
  EXPECT_FALSE(incoming_round_trip<ShutdownReply>(m).accepted);

  m = encode_error(10, ErrorInfo{"duplicate_rid", "already in flight", "body.rid"});
  const ErrorInfo e = incoming_round_trip<ErrorInfo>(m);
  EXPECT_EQ(e.code, "duplicate_rid");
  EXPECT_EQ(e.message, "already in flight");
  EXPECT_EQ(e.field, "body.rid");
  const auto r = decode_in(m);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->env.id, 10u);
  EXPECT_EQ(r->env.type, "error");
}

TokensEvent sample_tokens() {
  TokensEvent t;
  t.rid = "r";
  t.token_ids = {5, 6};
  t.logprobs = {-0.5, -std::numeric_limits<double>::infinity()};
  t.weight_versions = {1, 2};
  RoutedExperts re;
  re.dtype = "int32";
  re.num_tokens = 2;
  re.num_layers = 1;
  re.top_k = 2;
  re.start_pos = 11;
  re.data = std::string("\x01\0\0\0\x02\0\0\0\xff\xff\x01\0\x00\x00\x00\x00", 16);
  t.routed_experts = re;
  return t;
}

TEST(RoundTrip, Events) {
  const WireMessage m = encode_event(3, Event(sample_tokens()));
  ASSERT_EQ(m.frames.size(), 1u);
  EXPECT_EQ(m.frames[0], sample_tokens().routed_experts->data);
  const TokensEvent t = incoming_round_trip<TokensEvent>(m);
  ASSERT_TRUE(t.routed_experts.has_value());
  EXPECT_EQ(t.routed_experts->data, sample_tokens().routed_experts->data);
  EXPECT_EQ(t.routed_experts->start_pos, 11u);
  EXPECT_TRUE(std::isinf(t.logprobs[1]));
  const WireMessage again = encode_event(3, Event(t));
  EXPECT_EQ(again.envelope, m.envelope);
  EXPECT_EQ(again.frames, m.frames);

  TokensEvent zero_rows = sample_tokens();
  zero_rows.routed_experts->num_tokens = 0;
  zero_rows.routed_experts->data.clear();
  const WireMessage z = encode_event(3, Event(zero_rows));
  EXPECT_TRUE(z.frames.empty()) << "no payload frame for zero bytes of rows";
  EXPECT_EQ(incoming_round_trip<TokensEvent>(z).routed_experts->num_tokens, 0u);

  TokensEvent plain = sample_tokens();
  plain.routed_experts.reset();
  plain.logprobs.clear();
  EXPECT_FALSE(incoming_round_trip<TokensEvent>(encode_event(3, Event(plain))).routed_experts);

  FinishedEvent f{"r", "abort", "backpressure", 10, 20};
  const WireMessage fm = encode_event(4, Event(f));
  const FinishedEvent f2 = incoming_round_trip<FinishedEvent>(fm);
  EXPECT_EQ(f2.abort_reason, "backpressure");
  EXPECT_EQ(f2.completion_tokens, 20u);
  EXPECT_EQ(encode_event(4, Event(f2)).envelope, fm.envelope);

  FailedEvent fail{"r", ErrorInfo{"resource_exhausted", "no KV blocks", ""}};
  const FailedEvent fail2 = incoming_round_trip<FailedEvent>(encode_event(5, Event(fail)));
  EXPECT_EQ(fail2.error.code, "resource_exhausted");
  EXPECT_EQ(fail2.error.message, "no KV blocks");
}

// ---------------------------------------------------------------------------
// Refused replies and events (the client side).

Map tokens_body() {
  return Map{{"rid", "r"},
             {"token_ids", Array{1, 2}},
             {"logprobs", Array{-1.0, -2.0}},
             {"weight_versions", Array{0, 0}},
             {"routed_experts", Map{{"dtype", "uint8"},
                                    {"num_tokens", 2},
                                    {"num_layers", 1},
                                    {"top_k", 2},
                                    {"start_pos", 0},
                                    {"frame", 0}}}};
}

Map routed(Map re_overrides) {
  Map re = std::get<Map>(tokens_body()[4].second.v);
  for (auto& [k, v] : re_overrides) re = with(re, k, v);
  return with(tokens_body(), "routed_experts", re);
}

void expect_incoming_error(const Map& env, const std::vector<std::string>& frames, ErrorCode code,
                           const std::string& field, const Limits& limits = {}) {
  const auto r = decode_in(WireMessage{bytes(env), frames}, limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(error_code_name(r.status().code()), error_code_name(code)) << r.status().to_string();
  EXPECT_EQ(r.status().field(), field) << r.status().to_string();
}

TEST(RefusedIncoming, TokensEventChecks) {
  const std::vector<std::string> four{"abcd"};
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("tokens", 1, tokens_body())), four}).ok());

  expect_incoming_error(envelope("tokens", 1, routed({{"frame", 1}})), four, E::kOutOfRange,
                        "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, tokens_body()), {}, E::kOutOfRange,
                        "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, tokens_body()), {"abc"}, E::kInvalidArgument,
                        "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, routed({{"dtype", "uint16"}})), four,
                        E::kInvalidArgument, "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, routed({{"frame", nullptr}})), four, E::kMissingField,
                        "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, routed({{"frame", -1}})), four, E::kOutOfRange,
                        "body.routed_experts.frame");
  expect_incoming_error(envelope("tokens", 1, routed({{"dtype", "float16"}})), four,
                        E::kInvalidArgument, "body.routed_experts.dtype");
  // 2^32-1 cubed times 4 does not fit 64 bits; a wrapped product must not pass.
  expect_incoming_error(envelope("tokens", 1,
                                 routed({{"dtype", "int32"},
                                         {"num_tokens", k2p32 - 1},
                                         {"num_layers", k2p32 - 1},
                                         {"top_k", k2p32 - 1}})),
                        four, E::kOutOfRange, "body.routed_experts");
  expect_incoming_error(envelope("tokens", 1, routed({{"num_tokens", k2p32}})), four,
                        E::kOutOfRange, "body.routed_experts.num_tokens");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "routed_experts", std::nullopt)),
                        four, E::kMissingField, "body.routed_experts");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "routed_experts", 5)), four,
                        E::kWrongType, "body.routed_experts");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "logprobs", Array{-1.0})), four,
                        E::kInvalidArgument, "body.logprobs");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "logprobs", Array{-1.0, "x"})),
                        four, E::kWrongType, "body.logprobs[1]");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "weight_versions", Array{0})),
                        four, E::kInvalidArgument, "body.weight_versions");
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "token_ids", Array{1, -2})), four,
                        E::kOutOfRange, "body.token_ids[1]");
  Limits few;
  few.max_new_tokens = 1;  // below the parse-time bound, which get_weights_by_name sets (§9)
  expect_incoming_error(envelope("tokens", 1, tokens_body()), four, E::kTooLarge, "body.token_ids",
                        few);

  // Top log-probs: n entries per token in both arrays, n within [0, 20].
  const Map top = with(with(with(tokens_body(), "top_logprobs_num", 2), "top_token_ids", Array{3, 1, 5, 6}),
                       "top_logprobs", Array{-0.5, -1.5, -0.25, -3.0});
  const auto ok = decode_in(WireMessage{bytes(envelope("tokens", 1, top)), four});
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(std::get<TokensEvent>(ok->msg).top_token_ids, (std::vector<int32_t>{3, 1, 5, 6}));
  expect_incoming_error(envelope("tokens", 1, with(top, "top_token_ids", Array{3, 1, 5})), four,
                        E::kInvalidArgument, "body.top_token_ids");
  expect_incoming_error(envelope("tokens", 1, with(top, "top_logprobs", Array{-0.5})), four,
                        E::kInvalidArgument, "body.top_logprobs");
  expect_incoming_error(envelope("tokens", 1, with(top, "top_logprobs_num", 21)), four, E::kOutOfRange,
                        "body.top_logprobs_num");
  expect_incoming_error(envelope("tokens", 1, with(top, "top_logprobs_num", 0)), four, E::kInvalidArgument,
                        "body.top_token_ids");
  expect_incoming_error(envelope("tokens", 1, with(top, "top_token_ids", Array{3, 1, 5, -6})), four,
                        E::kOutOfRange, "body.top_token_ids[3]");
  // Entries without n: refused, not dropped.
  expect_incoming_error(envelope("tokens", 1, with(tokens_body(), "top_logprobs", Array{-1.0, -2.0})), four,
                        E::kInvalidArgument, "body.top_logprobs");
}

TEST(RefusedIncoming, OtherMessages) {
  const Map finished{{"rid", "r"},
                     {"reason", "stop"},
                     {"abort_reason", ""},
                     {"prompt_tokens", 1},
                     {"completion_tokens", 1}};
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("finished", 1, finished)), {}}).ok());
  expect_incoming_error(envelope("finished", 1, with(finished, "reason", "done")), {},
                        E::kInvalidArgument, "body.reason");
  expect_incoming_error(envelope("finished", 1, with(finished, "abort_reason", nullptr)), {},
                        E::kWrongType, "body.abort_reason");
  expect_incoming_error(envelope("failed", 1, Map{{"rid", "r"}, {"error", Map{{"code", "x"}}}}), {},
                        E::kMissingField, "body.error.message");
  expect_incoming_error(envelope("generate", 1, generate_body()), {}, E::kUnknownType, "type");
  expect_incoming_error(envelope("abort.ok", 1, Map{{"num_aborted", -1}}), {}, E::kOutOfRange,
                        "body.num_aborted");
  expect_incoming_error(with(envelope("abort.ok", 1, Map{{"num_aborted", 1}}), "v", 3), {},
                        E::kUnsupportedVersion, "v");

  // A hello.ok whose limits map lacks a key names the nested path.
  const WireMessage m = encode_reply(1, HelloReply{});
  std::string env = m.envelope;
  const std::string key = "\xacmax_versions";  // fixstr(12) "max_versions"
  const size_t at = env.find(key);
  ASSERT_NE(at, std::string::npos);
  env.replace(at, key.size(), "\xacmax_Versions");  // same length: now an unknown key
  const auto r = decode_incoming(as_frame(env), {}, Limits{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kMissingField);
  EXPECT_EQ(r.status().field(), "body.limits.max_versions");
}

TEST(AcceptedIncoming, UnknownErrorCodesAndExtraFieldsPass) {
  const Map err{
      {"code", "some_future_code"}, {"message", "m"}, {"field", ""}, {"retry_after_s", 1}};
  const auto r = decode_in(WireMessage{bytes(envelope("error", 2, err)), {}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(std::get<ErrorInfo>(r->msg).code, "some_future_code");
}

// ---------------------------------------------------------------------------
// Canonical bytes (SPEC §3): what Python's msgpack writes for the same values.

// The bytes that follow `key` (a fixstr) in an encoded envelope.
std::string after_key(const std::string& env, const std::string& key, size_t n) {
  const std::string k = std::string(1, static_cast<char>(0xa0 | key.size())) + key;
  const size_t at = env.find(k);
  EXPECT_NE(at, std::string::npos) << key;
  return at == std::string::npos ? "" : env.substr(at + k.size(), n);
}

TEST(CanonicalBytes, IntegersUseSmallestPositiveFamily) {
  HelloReply h;
  h.gpu = 300;  // int32 field, positive: uint16, not int16
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 3), std::string("\xcd\x01\x2c", 3));
  h.gpu = 5;
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 1), "\x05");
  h.gpu = 200;
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 2), "\xcc\xc8");
  h.gpu = -1;
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 1), "\xff");
  h.gpu = -33;
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 2), "\xd0\xdf");
  h.gpu = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "gpu", 5), std::string("\xd2\x80\0\0\0", 5));
  h.weight_version = UINT64_MAX;
  EXPECT_EQ(after_key(encode_reply(1, h).envelope, "weight_version", 9),
            "\xcf" + std::string(8, '\xff'));
}

TEST(CanonicalBytes, FloatsAreFloat64AndSeedNil) {
  GenerateRequest g = sample_generate();
  g.temperature = 1.0;
  g.seed.reset();
  const std::string env = encode_request(1, Request(g)).envelope;
  EXPECT_EQ(after_key(env, "temperature", 9), std::string("\xcb\x3f\xf0\0\0\0\0\0\0", 9));
  EXPECT_EQ(after_key(env, "seed", 1), "\xc0");
}

TEST(CanonicalBytes, EnvelopeKeyOrderAndAbortOmitsRid) {
  AbortRequest all;
  all.all = true;
  const std::string env = encode_request(6, Request(all)).envelope;
  // The golden abort_all bytes, spelled out: {v:1, type:"abort", id:6, body:{all:true}}.
  EXPECT_EQ(env, std::string("\x84\xa1v\x01\xa4type\xa5"
                             "abort\xa2id\x06\xa4"
                             "body\x81\xa3"
                             "all\xc3"));
}

TEST(CanonicalBytes, StringsUseStr8FromThirtyTwoBytes) {
  GenerateReply g{std::string(40, 'a')};
  EXPECT_EQ(after_key(encode_reply(1, g).envelope, "rid", 2), "\xd9\x28");
  g.rid = std::string(31, 'a');
  EXPECT_EQ(after_key(encode_reply(1, g).envelope, "rid", 1), "\xbf");
}

// ---------------------------------------------------------------------------
// Small helpers of codec.hpp.

TEST(Helpers, ToErrorInfo) {
  const ErrorInfo e = to_error_info(Status(ErrorCode::kOutOfRange, "too big", "body.top_k"));
  EXPECT_EQ(e.code, "out_of_range");
  EXPECT_EQ(e.message, "too big");
  EXPECT_EQ(e.field, "body.top_k");
}

TEST(Helpers, NamesAndSizes) {
  EXPECT_EQ(request_type_name(Request(HelloRequest{})), "hello");
  EXPECT_EQ(request_type_name(Request(StatusRequest{})), "status");
  EXPECT_EQ(request_type_name(Request(GenerateRequest{})), "generate");
  EXPECT_EQ(request_type_name(Request(AbortRequest{})), "abort");
  EXPECT_EQ(request_type_name(Request(ShutdownRequest{})), "shutdown");
  EXPECT_EQ(routed_experts_dtype_size("uint8"), 1u);
  EXPECT_EQ(routed_experts_dtype_size("uint16"), 2u);
  EXPECT_EQ(routed_experts_dtype_size("int32"), 4u);
  EXPECT_EQ(routed_experts_dtype_size("int8"), 0u);
}

// ---------------------------------------------------------------------------
// Weight updates and generation control (SPEC §11).

UpdateWeightsRequest decode_update(const Map& body, const std::vector<std::string>& frames = {kBucket},
                                   const Limits& limits = {}) {
  const RequestDecodeResult r = decode(bytes(envelope("update_weights", 9, body)), limits, frames);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  if (!r.status.ok()) return {};
  return std::get<UpdateWeightsRequest>(*r.request);
}

TEST(WeightUpdate, InlineBucketIsNotCopied) {
  const std::vector<std::string> frames{kBucket};
  const auto views = as_frames(frames);
  const RequestDecodeResult r =
      decode_request(as_frame(bytes(envelope("update_weights", 9, update_body()))), views, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& u = std::get<UpdateWeightsRequest>(*r.request);
  EXPECT_EQ(u.session, 7u);
  ASSERT_EQ(u.entries.size(), 3u);
  EXPECT_EQ(u.entries[0].name, "q");
  EXPECT_EQ(u.entries[0].dtype, DType::kBF16);
  EXPECT_EQ(u.entries[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(u.entries[2].dtype, DType::kF8E4M3);
  EXPECT_EQ(u.entries[2].byte_offset, 28u);
  EXPECT_EQ(std::get<InlineSource>(u.source).frame, 0u);
  ASSERT_TRUE(u.checksum.has_value());
  EXPECT_EQ(u.checksum->value, 5u);
  const Frame bucket = inline_bucket(u, views);
  EXPECT_EQ(bucket.data(), views[0].data());
  EXPECT_EQ(bucket.size(), 32u);
}

TEST(WeightUpdate, DtypeSpellingsAndFp4Bytes) {
  const std::pair<const char*, DType> spellings[] = {
      {"torch.bfloat16", DType::kBF16}, {"BF16", DType::kBF16},       {"float", DType::kF32},
      {"half", DType::kF16},            {"F8_E4M3", DType::kF8E4M3},  {"float8_e8m0fnu", DType::kE8M0},
      {"torch.int64", DType::kI64},     {"bool", DType::kBool},
  };
  for (const auto& [name, dtype] : spellings) {
    const size_t size = dtype_size(dtype);
    const UpdateWeightsRequest u =
        decode_update(update_body(Array{entry("w", name, Array{2}, 0, 2 * size)}));
    ASSERT_EQ(u.entries.size(), 1u) << name;
    EXPECT_EQ(u.entries[0].dtype, dtype) << name;
  }
  // float4_e2m1fn_x2 [2, 2]: four stored bytes (eight E2M1 values).
  EXPECT_EQ(decode_update(update_body(Array{entry("b", "float4_e2m1fn_x2", Array{2, 2}, 0, 4)}))
                .entries[0]
                .dtype,
            DType::kFP4x2);
}

TEST(WeightUpdate, LayoutsThatAreAllowed) {
  // Any order, gaps, unused bytes at the end, zero-size entries anywhere in bounds
  // (even inside another entry: they hold no byte), and a scalar.
  const UpdateWeightsRequest u = decode_update(update_body(Array{
      entry("late", "int8", Array{4}, 24, 4), entry("early", "float32", Array{2}, 0, 8),
      entry("empty", "float32", Array{0, 5}, 2, 0), entry("empty_end", "int8", Array{0}, 32, 0),
      entry("scalar", "int32", Array{}, 12, 4)}));
  EXPECT_EQ(u.entries.size(), 5u);
  EXPECT_TRUE(u.entries[4].shape.empty());
  // A zero dimension makes the product 0, however large the others (no false overflow).
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(decode_update(update_body(Array{entry("z", "float32", Array{big, big, big, 0}, 0, 0)}))
                .entries[0]
                .nbytes,
            0u);
  // Shared memory: an entry may end exactly at size; offsets past 4 GiB.
  const Map shm = with(update_body(Array{entry("w", "float32", Array{big}, 0, uint64_t{4} << 40)}),
                       "source", shm_source("/rolloutd-0.a_b-C", uint64_t{1} << 33, uint64_t{4} << 40));
  const UpdateWeightsRequest s = decode_update(shm, {});
  const auto& src = std::get<ShmSource>(s.source);
  EXPECT_EQ(src.name, "/rolloutd-0.a_b-C");
  EXPECT_EQ(src.offset, uint64_t{1} << 33);
  EXPECT_EQ(s.entries[0].nbytes, uint64_t{4} << 40);
  EXPECT_TRUE(inline_bucket(s, {}).empty());
  // A nil checksum means none; a name of 250 characters is the longest.
  const UpdateWeightsRequest n =
      decode_update(with(with(update_body(), "checksum", nullptr), "source",
                         shm_source("/" + repeat('n', 250), 0, 32)),
                    {});
  EXPECT_FALSE(n.checksum.has_value());
}

TEST(WeightUpdate, BucketEntryLimitRaisesTheParseBound) {
  Limits l;
  l.max_input_tokens = 4;
  l.max_stop_token_ids = 4;
  l.max_versions = 4;
  l.max_bucket_entries = 6;
  Array six;
  for (int i = 0; i < 6; ++i) six.push_back(entry("w" + std::to_string(i), "int8", Array{1}, i, 1));
  EXPECT_EQ(decode_update(update_body(six), {kBucket}, l).entries.size(), 6u);
}

TEST(WeightUpdate, OtherRequestsDecode) {
  auto req = [](std::string type, Map body) {
    const RequestDecodeResult r = decode(bytes(envelope(std::move(type), 3, std::move(body))));
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    return r.status.ok() ? *r.request : Request{};
  };
  const auto begin = std::get<BeginWeightUpdateRequest>(req("begin_weight_update", Map{}));
  EXPECT_FALSE(begin.selector.has_value());
  EXPECT_EQ(begin.timeout_s, 60.0);
  const auto sel = std::get<BeginWeightUpdateRequest>(
      req("begin_weight_update", Map{{"selector", Array{"model.layers.1."}}, {"timeout_s", 3600}}));
  EXPECT_EQ(sel.selector, (std::vector<std::string>{"model.layers.1."}));
  EXPECT_EQ(sel.timeout_s, 3600.0);
  EXPECT_FALSE(std::get<BeginWeightUpdateRequest>(req("begin_weight_update", Map{{"selector", nullptr}}))
                   .selector.has_value());
  const auto end = std::get<EndWeightUpdateRequest>(
      req("end_weight_update", Map{{"session", 4}, {"weight_version", UINT64_MAX}}));
  EXPECT_EQ(end.weight_version, UINT64_MAX);
  EXPECT_EQ(std::get<GetWeightsByNameRequest>(req("get_weights_by_name", Map{{"name", "w"}})).truncate,
            100u);
  EXPECT_EQ(std::get<GetWeightsByNameRequest>(
                req("get_weights_by_name", Map{{"name", "w"}, {"truncate", 1000000}}))
                .truncate,
            1000000u);
  EXPECT_FALSE(std::get<WeightsChecksumRequest>(req("weights_checksum", Map{})).names.has_value());
  EXPECT_EQ(std::get<PauseGenerationRequest>(req("pause_generation", Map{{"mode", "in_place"}})).mode,
            PauseMode::kInPlace);
  EXPECT_TRUE(std::holds_alternative<ContinueGenerationRequest>(req("continue_generation", Map{})));
}

TEST(WeightUpdate, RequestsRoundTrip) {
  UpdateWeightsRequest u;
  u.session = 1ull << 40;
  u.entries = {BucketEntry{"a", DType::kBF16, {2, 3}, 0, 12},
               BucketEntry{"b", DType::kFP4x2, {4}, 16, 4}};
  u.source = InlineSource{1};
  u.checksum = BucketChecksum{"crc32", 0xFFFFFFFFu};
  const WireMessage m = encode_request(41, Request(u));
  EXPECT_TRUE(m.frames.empty()) << "an inline bucket is the sender's frame";
  const RequestDecodeResult r = decode(m.envelope, {}, {"unused", std::string(20, '\0')});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& u2 = std::get<UpdateWeightsRequest>(*r.request);
  EXPECT_EQ(u2.entries[1].dtype, DType::kFP4x2);
  EXPECT_EQ(std::get<InlineSource>(u2.source).frame, 1u);
  EXPECT_EQ(encode_request(41, *r.request).envelope, m.envelope);

  UpdateWeightsRequest s = u;
  s.source = ShmSource{"/x", 3, 20};
  s.checksum.reset();
  const UpdateWeightsRequest s2 = request_round_trip(s);
  EXPECT_EQ(std::get<ShmSource>(s2.source).size, 20u);
  EXPECT_FALSE(s2.checksum.has_value());

  EXPECT_EQ(request_round_trip(BeginWeightUpdateRequest{std::vector<std::string>{"a", "b."}, 0.5})
                .selector->size(),
            2u);
  EXPECT_FALSE(request_round_trip(BeginWeightUpdateRequest{}).selector.has_value());
  EXPECT_EQ(request_round_trip(EndWeightUpdateRequest{3, 9}).weight_version, 9u);
  EXPECT_EQ(request_round_trip(AbortWeightUpdateRequest{3}).session, 3u);
  EXPECT_EQ(request_round_trip(GetWeightsByNameRequest{"w", 0}).truncate, 0u);
  EXPECT_EQ(request_round_trip(WeightsChecksumRequest{std::vector<std::string>{"w"}}).names->at(0), "w");
  EXPECT_FALSE(request_round_trip(WeightsChecksumRequest{}).names.has_value());
  for (PauseMode mode : {PauseMode::kAbort, PauseMode::kRetract, PauseMode::kInPlace})
    EXPECT_EQ(request_round_trip(PauseGenerationRequest{mode}).mode, mode);
  request_round_trip(ContinueGenerationRequest{});
}

TEST(WeightUpdate, RepliesAndEventRoundTrip) {
  auto again = [](const WireMessage& m, auto decoded) {
    EXPECT_EQ(encode_reply(1, decoded).envelope, m.envelope);
    return decoded;
  };
  WireMessage m = encode_reply(1, BeginWeightUpdateReply{7, 11, 48});
  EXPECT_EQ(again(m, incoming_round_trip<BeginWeightUpdateReply>(m)).num_parameters_restored, 48u);
  m = encode_reply(1, UpdateWeightsReply{7, 3, 1ull << 35, 0.25});
  EXPECT_EQ(again(m, incoming_round_trip<UpdateWeightsReply>(m)).num_bytes, 1ull << 35);
  m = encode_reply(1, EndWeightUpdateReply{7, 12, 2, 5, 100, 5, 2.5, 0.0});
  EXPECT_EQ(again(m, incoming_round_trip<EndWeightUpdateReply>(m)).postprocess_s, 0.0);
  m = encode_reply(1, AbortWeightUpdateReply{7, "not_ready"});
  EXPECT_EQ(again(m, incoming_round_trip<AbortWeightUpdateReply>(m)).state, "not_ready");
  m = encode_reply(1, GetWeightsByNameReply{"w", "bfloat16", {2, 2}, {1.0, kNaN, -kInf, -0.0}});
  const auto g = again(m, incoming_round_trip<GetWeightsByNameReply>(m));
  EXPECT_TRUE(std::isnan(g.values[1]));
  EXPECT_TRUE(std::signbit(g.values[3]));
  WeightsChecksumReply w;
  w.weight_version = 3;
  w.model_checksum = 0xCAFEF00Du;
  w.parameters = {ParameterChecksum{"a", "float32", {3}, 1}, ParameterChecksum{"b", "int8", {}, 2}};
  m = encode_reply(1, w);
  EXPECT_EQ(again(m, incoming_round_trip<WeightsChecksumReply>(m)).parameters[1].checksum, 2u);
  m = encode_reply(1, PauseGenerationReply{1, 2, 3});
  EXPECT_EQ(again(m, incoming_round_trip<PauseGenerationReply>(m)).num_paused, 3u);
  m = encode_reply(1, ContinueGenerationReply{4});
  EXPECT_EQ(again(m, incoming_round_trip<ContinueGenerationReply>(m)).num_resumed, 4u);

  StatusReply s;
  s.paused = true;
  s.update_session = 9;
  m = encode_reply(1, s);
  const StatusReply s2 = again(m, incoming_round_trip<StatusReply>(m));
  EXPECT_TRUE(s2.paused);
  EXPECT_EQ(s2.update_session, 9u);
  HelloReply h;
  h.limits.max_bucket_entries = 7;
  m = encode_reply(1, h);
  EXPECT_EQ(again(m, incoming_round_trip<HelloReply>(m)).limits.max_bucket_entries, 7u);

  const RetractedEvent ev{"r", 5, "weight_update"};
  const WireMessage e = encode_event(3, Event(ev));
  const RetractedEvent ev2 = incoming_round_trip<RetractedEvent>(e);
  EXPECT_EQ(ev2.num_tokens_discarded, 5u);
  EXPECT_EQ(encode_event(3, Event(ev2)).envelope, e.envelope);
}

TEST(WeightUpdate, RefusedReplies) {
  const Map checksum_ok{{"algo", "crc32"},
                        {"weight_version", 1},
                        {"model_checksum", 2},
                        {"parameters", Array{Map{{"name", "a"},
                                                 {"dtype", "float32"},
                                                 {"shape", Array{2}},
                                                 {"checksum", 3}}}}};
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("weights_checksum.ok", 1, checksum_ok)), {}}).ok());
  expect_incoming_error(envelope("weights_checksum.ok", 1, with(checksum_ok, "algo", "md5")), {},
                        E::kInvalidArgument, "body.algo");
  expect_incoming_error(
      envelope("weights_checksum.ok", 1,
               with(checksum_ok, "parameters",
                    Array{Map{{"name", "a"}, {"dtype", "f"}, {"shape", Array{}}, {"checksum", k2p32}}})),
      {}, E::kOutOfRange, "body.parameters[0].checksum");
  expect_incoming_error(envelope("weights_checksum.ok", 1, with(checksum_ok, "model_checksum", -1)),
                        {}, E::kOutOfRange, "body.model_checksum");
  const Map weights_ok{
      {"name", "w"}, {"dtype", "bfloat16"}, {"shape", Array{2}}, {"values", Array{1.0, 2}}};
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("get_weights_by_name.ok", 1, weights_ok)), {}}).ok());
  expect_incoming_error(
      envelope("get_weights_by_name.ok", 1, with(weights_ok, "values", Array{1.0, "x"})), {},
      E::kWrongType, "body.values[1]");
  expect_incoming_error(
      envelope("get_weights_by_name.ok", 1, with(weights_ok, "shape", Array{1, 1, 1, 1, 1, 1, 1, 1, 1})),
      {}, E::kTooLarge, "body.shape");
  expect_incoming_error(envelope("retracted", 1, Map{{"rid", "r"}, {"num_tokens_discarded", 1}}), {},
                        E::kMissingField, "body.reason");
  expect_incoming_error(
      envelope("retracted", 1, Map{{"rid", "r"}, {"num_tokens_discarded", -1}, {"reason", ""}}), {},
      E::kOutOfRange, "body.num_tokens_discarded");
  expect_incoming_error(envelope("update_weights.ok", 1,
                                 Map{{"session", 1}, {"num_entries", 1}, {"num_bytes", 1},
                                     {"duration_s", kInf}}),
                        {}, E::kOutOfRange, "body.duration_s");
  expect_incoming_error(envelope("pause_generation.ok", 1, Map{{"num_aborted", 1}, {"num_retracted", 0}}),
                        {}, E::kMissingField, "body.num_paused");
  // Fields added to status.ok and hello.ok limits are optional, but typed when present.
  StatusReply s;
  Map status = with(Map{{"state", "ready"},      {"ready", true},        {"reason", ""},
                        {"weight_version", 0},   {"num_waiting", 0},     {"num_running", 0},
                        {"num_requests_total", 0}, {"num_tokens_generated_total", 0},
                        {"uptime_s", 1.0},       {"build", "b"}},
                    "model",
                    Map{{"name", "m"}, {"family", "f"}, {"vocab_size", 1}, {"num_layers", 1},
                        {"num_moe_layers", 1}, {"num_experts", 1}, {"top_k", 1},
                        {"routed_experts_dtype", "uint8"}});
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("status.ok", 1, status)), {}}).ok());
  expect_incoming_error(envelope("status.ok", 1, with(status, "paused", 1)), {}, E::kWrongType,
                        "body.paused");
  expect_incoming_error(envelope("status.ok", 1, with(status, "update_session", -2)), {},
                        E::kOutOfRange, "body.update_session");
}

TEST(WeightUpdate, ClientParseBoundAllowsAMillionValues) {
  GetWeightsByNameReply r;
  r.name = "w";
  r.dtype = "float32";
  r.shape = {1000000};
  r.values.assign(1000000, 0.5);
  Limits l;
  l.max_envelope_bytes = 16u << 20;  // 9 MB of float64: over the default 4 MiB envelope
  const WireMessage m = encode_reply(1, r);
  EXPECT_EQ(decode_in(m).status().code(), ErrorCode::kTooLarge);
  EXPECT_EQ(incoming_round_trip<GetWeightsByNameReply>(m, l).values.size(), 1000000u);
  r.values.push_back(0.5);
  const auto over = decode_in(encode_reply(1, r), l);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), ErrorCode::kTooLarge);
  EXPECT_EQ(over.status().field(), "") << "refused while parsing, before allocating";
}

TEST(WeightUpdate, CanonicalBytes) {
  // An alias is read as the dtype and written back under its PyTorch name.
  const Map alias_body = update_body(Array{entry("w", "BF16", Array{2}, 0, 4)});
  const RequestDecodeResult r = decode(bytes(envelope("update_weights", 1, alias_body)), {}, {kBucket});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const Map canonical = update_body(Array{entry("w", "bfloat16", Array{2}, 0, 4)});
  EXPECT_EQ(encode_request(1, *r.request).envelope, bytes(envelope("update_weights", 1, canonical)));
  // Absent "nil ok" fields are written as nil.
  const std::string begin = encode_request(1, Request(BeginWeightUpdateRequest{})).envelope;
  EXPECT_EQ(after_key(begin, "selector", 1), "\xc0");
  UpdateWeightsRequest u;
  u.entries = {BucketEntry{"w", DType::kI8, {1}, 0, 1}};
  u.source = ShmSource{"/w", 0, 1};
  EXPECT_EQ(after_key(encode_request(1, Request(u)).envelope, "checksum", 1), "\xc0");
}

// A plain bitwise CRC-32 (zlib's polynomial, reflected), to check the table-driven one.
uint32_t crc32_bitwise(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

std::span<const uint8_t> u8(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(Checksums, Crc32IsZlibs) {
  EXPECT_EQ(crc32(u8("123456789")), 0xCBF43926u);  // the CRC-32 check value
  EXPECT_EQ(crc32(u8("")), 0u);
  EXPECT_EQ(crc32(u8("The quick brown fox jumps over the lazy dog")), 0x414FA339u);
  std::mt19937 rng(7);
  std::string data(1000, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  // Every length and start (alignment) against the bitwise reference, and chaining.
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; n + start <= 80; ++n) {
      const std::string piece = data.substr(start, n);
      ASSERT_EQ(crc32(u8(piece)), crc32_bitwise(piece)) << start << "+" << n;
    }
  }
  EXPECT_EQ(crc32(u8(data)), crc32_bitwise(data));
  EXPECT_EQ(crc32(u8(data.substr(333)), crc32(u8(data.substr(0, 333)))), crc32(u8(data)));
}

TEST(Checksums, ModelChecksumIsTheSpecFormula) {
  // SPEC §11.5 spelled out: name + NUL + LE32, in name order (byte-wise, so "B" < "a" < "é").
  const std::vector<std::pair<std::string, uint32_t>> sums = {
      {"a.weight", 0x11223344u}, {"\xc3\xa9", 0xFFFFFFFFu}, {"B", 0u}};
  const std::string concat = std::string("B") + '\0' + std::string("\0\0\0\0", 4) + "a.weight" + '\0' +
                             std::string("\x44\x33\x22\x11", 4) + "\xc3\xa9" + '\0' +
                             std::string("\xff\xff\xff\xff", 4);
  EXPECT_EQ(model_checksum(sums), crc32(u8(concat)));
  EXPECT_EQ(model_checksum({}), 0u);
}

TEST(Helpers, WeightUpdateNames) {
  EXPECT_EQ(request_type_name(Request(BeginWeightUpdateRequest{})), "begin_weight_update");
  EXPECT_EQ(request_type_name(Request(UpdateWeightsRequest{})), "update_weights");
  EXPECT_EQ(request_type_name(Request(EndWeightUpdateRequest{})), "end_weight_update");
  EXPECT_EQ(request_type_name(Request(AbortWeightUpdateRequest{})), "abort_weight_update");
  EXPECT_EQ(request_type_name(Request(GetWeightsByNameRequest{})), "get_weights_by_name");
  EXPECT_EQ(request_type_name(Request(WeightsChecksumRequest{})), "weights_checksum");
  EXPECT_EQ(request_type_name(Request(PauseGenerationRequest{})), "pause_generation");
  EXPECT_EQ(request_type_name(Request(ContinueGenerationRequest{})), "continue_generation");
  EXPECT_EQ(pause_mode_name(PauseMode::kInPlace), "in_place");
  EXPECT_EQ(pause_mode_from_name("retract"), PauseMode::kRetract);
  EXPECT_FALSE(pause_mode_from_name("in-place").has_value());
}

// ---------------------------------------------------------------------------
// GPU weight transports (SPEC §11.7).

TEST(Transports, InitWeightGroupDecodes) {
  const RequestDecodeResult r = decode(bytes(envelope("init_weight_group", 5, init_group_body())));
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& g = std::get<InitWeightGroupRequest>(*r.request);
  EXPECT_EQ(g.group, "weights");
  EXPECT_EQ(g.unique_id, kUniqueId);
  EXPECT_EQ(g.world_size, 3u);
  EXPECT_EQ(g.rank, 1u);
  EXPECT_EQ(g.nccl_version, 22809u);
  // root and timeout_s may be omitted; a root other than 0 and the widest group are fine.
  const Map minimal = with(with(init_group_body(), "root", std::nullopt), "timeout_s", std::nullopt);
  const RequestDecodeResult m = decode(bytes(envelope("init_weight_group", 6, minimal)));
  ASSERT_TRUE(m.status.ok()) << m.status.to_string();
  EXPECT_EQ(std::get<InitWeightGroupRequest>(*m.request).root, 0u);
  EXPECT_EQ(std::get<InitWeightGroupRequest>(*m.request).timeout_s, 120.0);
  const Map wide = with(with(with(init_group_body(), "world_size", 65536), "rank", 0), "root", 65535);
  const RequestDecodeResult w = decode(bytes(envelope("init_weight_group", 7, wide)));
  ASSERT_TRUE(w.status.ok()) << w.status.to_string();
  EXPECT_EQ(std::get<InitWeightGroupRequest>(*w.request).root, 65535u);
  // The longest name, every allowed character.
  const std::string name = "A-Z.a_z-0.9" + repeat('x', 53);
  ASSERT_EQ(name.size(), 64u);
  EXPECT_TRUE(decode(bytes(envelope("init_weight_group", 8, with(init_group_body(), "group", name))))
                  .status.ok());
  EXPECT_TRUE(is_valid_weight_group_name(name));
  EXPECT_FALSE(is_valid_weight_group_name(name + "x"));
  EXPECT_FALSE(is_valid_weight_group_name(""));
  EXPECT_FALSE(is_valid_weight_group_name("w\xc3\xa9"));
}

TEST(Transports, DeviceSourcesDecode) {
  const UpdateWeightsRequest n = decode_update(with(update_body(), "source", nccl_source()), {});
  const auto& ns = std::get<NcclSource>(n.source);
  EXPECT_EQ(ns.group, "weights");
  EXPECT_EQ(ns.size, 32u);
  EXPECT_TRUE(inline_bucket(n, {}).empty());
  // The largest size; payload frames are ignored for device sources.
  const uint64_t k2p40 = uint64_t{1} << 40;
  const UpdateWeightsRequest big = decode_update(
      with(update_body(Array{entry("w", "bfloat16", Array{k2p40 / 2}, 0, k2p40)}), "source",
           nccl_source("w.1", 7, k2p40)),
      {kBucket});
  EXPECT_EQ(std::get<NcclSource>(big.source).root, 7u);
  EXPECT_EQ(std::get<NcclSource>(big.source).size, k2p40);

  const UpdateWeightsRequest i = decode_update(with(update_body(), "source", ipc_source()), {});
  const auto& is = std::get<CudaIpcSource>(i.source);
  EXPECT_EQ(is.handle, kIpcHandle);
  EXPECT_EQ(is.offset, 1u << 20);
  EXPECT_EQ(is.size, 32u);
  EXPECT_EQ(is.device_uuid, kUuid);
  EXPECT_TRUE(inline_bucket(i, {}).empty());
}

TEST(Transports, RequestsRoundTrip) {
  const InitWeightGroupRequest init{"g-1", kUniqueId, 5, 4, 1, 22809, 0.5};
  const InitWeightGroupRequest init2 = request_round_trip(init);
  EXPECT_EQ(init2.unique_id, kUniqueId);
  EXPECT_EQ(init2.root, 1u);
  EXPECT_EQ(init2.timeout_s, 0.5);
  EXPECT_EQ(request_round_trip(DestroyWeightGroupRequest{"g-1"}).group, "g-1");

  UpdateWeightsRequest u;
  u.session = 3;
  u.entries = {BucketEntry{"a", DType::kBF16, {2, 3}, 0, 12}, BucketEntry{"b", DType::kF32, {}, 256, 4}};
  u.source = NcclSource{"weights", 0, 260};
  u.checksum = BucketChecksum{"crc32", 9};
  const UpdateWeightsRequest n = request_round_trip(u);
  EXPECT_EQ(std::get<NcclSource>(n.source).size, 260u);
  EXPECT_EQ(n.checksum->value, 9u);
  u.source = CudaIpcSource{kIpcHandle, 4096, 260, kUuid};
  u.checksum.reset();
  const UpdateWeightsRequest i = request_round_trip(u);
  EXPECT_EQ(std::get<CudaIpcSource>(i.source).handle, kIpcHandle);
  EXPECT_EQ(std::get<CudaIpcSource>(i.source).device_uuid, kUuid);
  EXPECT_EQ(request_type_name(Request(InitWeightGroupRequest{})), "init_weight_group");
  EXPECT_EQ(request_type_name(Request(DestroyWeightGroupRequest{})), "destroy_weight_group");
}

TEST(Transports, CanonicalBytes) {
  // Handles, ids and uuids are msgpack bin (bin8 for these sizes), in SPEC key order.
  const std::string env = encode_request(1, Request(InitWeightGroupRequest{
                                                "w", kUniqueId, 2, 1, 0, 22809, 120.0}))
                              .envelope;
  EXPECT_EQ(env, bytes(envelope("init_weight_group", 1,
                                Map{{"group", "w"}, {"unique_id", Bin{kUniqueId}}, {"world_size", 2},
                                    {"rank", 1}, {"root", 0}, {"nccl_version", 22809},
                                    {"timeout_s", 120.0}})));
  EXPECT_EQ(after_key(env, "unique_id", 2), "\xc4\x80");
  UpdateWeightsRequest u;
  u.entries = {BucketEntry{"w", DType::kI8, {1}, 0, 1}};
  u.source = CudaIpcSource{kIpcHandle, 0, 1, kUuid};
  const std::string ipc = encode_request(1, Request(u)).envelope;
  EXPECT_EQ(after_key(ipc, "handle", 2), "\xc4\x40");
  EXPECT_EQ(after_key(ipc, "device_uuid", 2), "\xc4\x10");
  // hello.ok writes the two added fields last; an empty uuid is an empty bin.
  const std::string hello = encode_reply(1, HelloReply{}).envelope;
  EXPECT_EQ(after_key(hello, "nccl_version", 1), std::string(1, '\0'));
  EXPECT_EQ(after_key(hello, "device_uuid", 2), std::string("\xc4\x00", 2));
}

TEST(Transports, RepliesRoundTrip) {
  HelloReply h;
  h.gpu = 1;
  h.nccl_version = 22809;
  h.device_uuid = kUuid;
  WireMessage m = encode_reply(1, h);
  const HelloReply h2 = incoming_round_trip<HelloReply>(m);
  EXPECT_EQ(h2.nccl_version, 22809u);
  EXPECT_EQ(h2.device_uuid, kUuid);
  EXPECT_EQ(encode_reply(1, h2).envelope, m.envelope);

  m = encode_reply(2, InitWeightGroupReply{"weights", 22809, 1, 2, 0.125});
  const auto g = incoming_round_trip<InitWeightGroupReply>(m);
  EXPECT_EQ(g.group, "weights");
  EXPECT_EQ(g.nccl_version, 22809u);
  EXPECT_EQ(g.rank, 1u);
  EXPECT_EQ(g.world_size, 2u);
  EXPECT_EQ(g.duration_s, 0.125);
  EXPECT_EQ(encode_reply(2, g).envelope, m.envelope);
  m = encode_reply(3, DestroyWeightGroupReply{"weights"});
  EXPECT_EQ(incoming_round_trip<DestroyWeightGroupReply>(m).group, "weights");
}

TEST(Memory, RequestsAndRepliesRoundTrip) {
  EXPECT_FALSE(request_round_trip(ReleaseMemoryRequest{}).tags.has_value());
  const auto r = request_round_trip(ReleaseMemoryRequest{std::vector<std::string>{"cuda_graph", "weights"}});
  EXPECT_EQ(*r.tags, (std::vector<std::string>{"cuda_graph", "weights"}));
  EXPECT_EQ(*request_round_trip(ResumeMemoryRequest{std::vector<std::string>{"kv_cache"}}).tags,
            std::vector<std::string>{"kv_cache"});
  EXPECT_EQ(request_type_name(Request(ReleaseMemoryRequest{})), "release_memory");
  EXPECT_EQ(request_type_name(Request(ResumeMemoryRequest{})), "resume_memory");
  WireMessage m = encode_reply(4, ReleaseMemoryReply{{"weights"}, 1ull << 34, 0.25});
  const auto rel = incoming_round_trip<ReleaseMemoryReply>(m);
  EXPECT_EQ(rel.tags, std::vector<std::string>{"weights"});
  EXPECT_EQ(rel.num_bytes, 1ull << 34);
  EXPECT_EQ(rel.duration_s, 0.25);
  m = encode_reply(5, ResumeMemoryReply{{}, 0, 1.0});
  EXPECT_TRUE(incoming_round_trip<ResumeMemoryReply>(m).tags.empty());
  EXPECT_TRUE(is_memory_tag("kv_cache"));
  EXPECT_FALSE(is_memory_tag("scratch")) << "scratch is never released through the protocol";
}

TEST(Transports, RefusedReplies) {
  const Map hello = Map{{"version", 1},
                        {"daemon", "rolloutd"},
                        {"build", "b"},
                        {"gpu", 0},
                        {"model", Map{{"name", "m"}, {"family", "f"}, {"vocab_size", 1},
                                      {"num_layers", 1}, {"num_moe_layers", 1}, {"num_experts", 1},
                                      {"top_k", 1}, {"routed_experts_dtype", "uint8"}}},
                        {"weight_version", 0},
                        {"limits", Map{{"max_envelope_bytes", 1}, {"max_frame_bytes", 1},
                                       {"max_frames", 1}, {"max_rid_bytes", 1},
                                       {"max_string_bytes", 1}, {"max_input_tokens", 1},
                                       {"max_new_tokens", 1}, {"max_stop_token_ids", 1},
                                       {"max_versions", 1}}}};
  EXPECT_TRUE(decode_in(WireMessage{bytes(envelope("hello.ok", 1, hello)), {}}).ok());
  expect_incoming_error(envelope("hello.ok", 1, with(hello, "device_uuid", Bin{"short"})), {},
                        E::kInvalidArgument, "body.device_uuid");
  expect_incoming_error(envelope("hello.ok", 1, with(hello, "device_uuid", kUuid)), {},
                        E::kWrongType, "body.device_uuid");
  expect_incoming_error(envelope("hello.ok", 1, with(hello, "nccl_version", -1)), {},
                        E::kOutOfRange, "body.nccl_version");
  expect_incoming_error(envelope("init_weight_group.ok", 1,
                                 Map{{"group", "g"}, {"nccl_version", 1}, {"rank", 1}, {"world_size", 2}}),
                        {}, E::kMissingField, "body.duration_s");
  expect_incoming_error(envelope("destroy_weight_group.ok", 1, Map{}), {}, E::kMissingField,
                        "body.group");
}

TEST(Transports, NcclVersionString) {
  EXPECT_EQ(nccl_version_string(22809), "2.28.9");
  EXPECT_EQ(nccl_version_string(22803), "2.28.3");
  EXPECT_EQ(nccl_version_string(21903), "2.19.3");
  EXPECT_EQ(nccl_version_string(2708), "2.7.8");  // before 2.9: X*1000 + Y*100 + Z
}

}  // namespace
}  // namespace rolloutd::protocol
