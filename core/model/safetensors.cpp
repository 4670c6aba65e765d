#include "core/model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace rolloutd::core {
namespace {

using nlohmann::json;

Status bad(std::string message, std::string field = "header") {
  return Status(ErrorCode::kInvalidArgument, std::move(message), std::move(field));
}

// safetensors' dtype names (safetensors/src/tensor.rs, Dtype), and what this build reads.
// F4/F6 count 4- or 6-bit elements in their shape (not PyTorch's float4_e2m1fn_x2 bytes):
// refused until a family needs them; MXFP4 checkpoints (gpt-oss) store U8 blocks + scales.
struct StDtype {
  std::string_view name;
  std::optional<DType> dtype;
};
constexpr StDtype kStDtypes[] = {
    {"BOOL", DType::kBool},    {"U8", DType::kU8},         {"I8", DType::kI8},
    {"I16", DType::kI16},      {"U16", DType::kU16},       {"F16", DType::kF16},
    {"BF16", DType::kBF16},    {"I32", DType::kI32},       {"U32", DType::kU32},
    {"F32", DType::kF32},      {"I64", DType::kI64},       {"F8_E4M3", DType::kF8E4M3},
    {"F8_E8M0", DType::kE8M0}, {"F64", std::nullopt},      {"U64", std::nullopt},
    {"F8_E5M2", std::nullopt}, {"F4", std::nullopt},       {"F6_E2M3", std::nullopt},
    {"F6_E3M2", std::nullopt}, {"C64", std::nullopt},
};

std::string_view st_dtype_name(DType t) {
  for (const auto& d : kStDtypes)
    if (d.dtype == t) return d.name;
  return {};
}

// Thrown from the parser callback to stop at once on a structure no header has (nesting
// deeper than an entry's shape list, a key twice): bounds the work a hostile header costs.
struct HeaderShapeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Result<SafetensorsEntry> parse_entry(const std::string& name, const json& v) {
  if (name.empty()) return bad("tensor name is empty");
  if (name.size() > kMaxSafetensorsNameBytes)
    return bad("tensor name longer than " + std::to_string(kMaxSafetensorsNameBytes) + " bytes");
  if (!v.is_object()) return bad("entry is not an object", name);
  for (const auto& [k, _] : v.items())
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      return bad("unknown key '" + k + "' in entry", name);
  SafetensorsEntry e;
  e.name = name;
  const auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return bad("'dtype' missing or not a string", name);
  const std::string& dname = dt->get_ref<const std::string&>();
  const StDtype* known = nullptr;
  for (const auto& d : kStDtypes)
    if (d.name == dname) known = &d;
  if (!known) return bad("unknown dtype '" + dname + "'", name);
  if (!known->dtype)
    return Status(ErrorCode::kUnimplemented, "dtype '" + dname + "' is not supported by rolloutd", name);
  e.dtype = *known->dtype;

  const auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return bad("'shape' missing or not a list", name);
  if (sh->size() > kMaxSafetensorsDims)
    return bad("shape has more than " + std::to_string(kMaxSafetensorsDims) + " dimensions", name);
  bool has_zero = false;
  for (const auto& d : *sh) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(kMaxSafetensorsDim))
      return bad("shape dimension is not an integer in [0, 2^40]", name);
    e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    has_zero = has_zero || e.shape.back() == 0;
  }
  // Up to 8 dimensions of 2^40 overflow 64 bits: multiply with a check (an empty tensor has
  // size 0 whatever its other dimensions are).
  uint64_t bytes = has_zero ? 0 : dtype_size(e.dtype);
  for (int64_t d : e.shape) {
    if (bytes == 0) break;
    if (bytes > UINT64_MAX / static_cast<uint64_t>(d)) return bad("shape's byte size overflows 64 bits", name);
    bytes *= static_cast<uint64_t>(d);
  }

  const auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    return bad("'data_offsets' missing or not [begin, end] unsigned integers", name);
  e.begin = (*off)[0].get<uint64_t>();
  e.end = (*off)[1].get<uint64_t>();
  if (e.begin > e.end) return bad("data_offsets begin > end", name);
  if (e.end - e.begin != bytes)
    return bad("shape " + json(e.shape).dump() + " x " + std::string(dname) + " is " + std::to_string(bytes) +
                   " bytes but data_offsets span " + std::to_string(e.end - e.begin),
               name);
  return e;
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Result<SafetensorsHeader> parse_safetensors(std::span<const uint8_t> file) {
  if (file.size() < 8) return bad("file is shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[static_cast<size_t>(i)];
  if (n > kMaxSafetensorsHeaderBytes)
    return bad("header length " + std::to_string(n) + " exceeds the limit of " +
               std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  if (n > file.size() - 8)
    return bad("header length " + std::to_string(n) + " runs past the end of the file (" +
               std::to_string(file.size()) + " bytes)");
  if (n == 0 || file[8] != '{') return bad("header does not start with '{'");
  const auto* begin = file.data() + 8;
  const auto* end = begin + n;

  // Keys seen per open object (by nesting depth): the JSON parser keeps the last of two
  // equal keys, which would let a header hide a tensor; refuse instead.
  std::vector<std::set<std::string>> keys(5);
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (depth > 3) throw HeaderShapeError("header nests deeper than an entry's shape list");
    if (event == json::parse_event_t::object_start) {
      keys[static_cast<size_t>(depth) + 1].clear();
    } else if (event == json::parse_event_t::key) {
      if (!keys[static_cast<size_t>(depth)].insert(parsed.get<std::string>()).second)
        throw HeaderShapeError("key '" + parsed.get<std::string>().substr(0, kMaxSafetensorsNameBytes) +
                               "' appears twice");
    }
    return true;
  };
  json j;
  try {
    j = json::parse(begin, end, cb);
  } catch (const HeaderShapeError& e) {
    return bad(std::string("header: ") + e.what());
  } catch (const json::exception& e) {
    return bad(std::string("header is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return bad("header is not a JSON object");

  SafetensorsHeader h;
  h.data_offset = 8 + n;
  h.data_size = file.size() - h.data_offset;
  h.tensors.reserve(j.size());
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object", "__metadata__");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) return bad("__metadata__['" + k + "'] is not a string", "__metadata__");
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    RD_ASSIGN_OR_RETURN(SafetensorsEntry e, parse_entry(name, v));
    if (e.end > h.data_size)
      return bad("data_offsets end " + std::to_string(e.end) + " lies past the data section (" +
                     std::to_string(h.data_size) + " bytes)",
                 name);
    h.tensors.push_back(std::move(e));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
  });
  // No two tensors share a byte (empty tensors hold none). Holes are allowed: the format's
  // writers leave none, but a gap harms nothing a reader does.
  uint64_t covered = 0;
  const SafetensorsEntry* last = nullptr;
  for (const auto& e : h.tensors) {
    if (e.begin == e.end) continue;
    if (last && e.begin < covered)
      return bad("bytes [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") overlap tensor '" +
                     last->name + "'",
                 e.name);
    covered = e.end;
    last = &e;
  }
  return h;
}

// ---------------------------------------------------------------------------------------

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::kNotFound : ErrorCode::kUnavailable,
                  "cannot open " + path + ": " + std::strerror(err), path);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(ErrorCode::kUnavailable, path + " is not a readable regular file", path);
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return Status(ErrorCode::kUnavailable, "cannot map " + path + ": " + std::strerror(err), path);
    }
    f->map_ = static_cast<const uint8_t*>(p);
    // Loaders read each tensor once, front to back.
    ::madvise(p, f->size_, MADV_SEQUENTIAL);
  }
  ::close(fd);  // the mapping keeps the file
  auto h = parse_safetensors({f->map_, f->size_});
  if (!h.ok()) {
    const Status& s = h.status();
    return Status(s.code(), path + ": " + s.message(), s.field());
  }
  f->header_ = std::move(*h);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
}

std::span<const uint8_t> SafetensorsFile::data(const SafetensorsEntry& e) const {
  return {map_ + header_.data_offset + e.begin, static_cast<size_t>(e.nbytes())};
}

// ---------------------------------------------------------------------------------------

const SafetensorsCheckpoint::Tensor* SafetensorsCheckpoint::find(std::string_view name) const {
  const auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

uint64_t SafetensorsCheckpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [_, t] : tensors_) n += t.entry->nbytes();
  return n;
}

Result<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::open(const std::string& dir) {
  std::unique_ptr<SafetensorsCheckpoint> c(new SafetensorsCheckpoint());
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ifstream index(index_path);
  if (!index) {
    RD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(dir + "/model.safetensors"));
    for (const auto& e : f->header().tensors) c->tensors_.emplace(e.name, Tensor{f.get(), &e});
    c->files_.push_back(std::move(f));
    return c;
  }
  auto fail = [&](std::string msg, std::string field) {
    return Status(ErrorCode::kInvalidArgument, index_path + ": " + msg, std::move(field));
  };
  json j;
  try {
    j = json::parse(index);
  } catch (const json::exception& e) {
    return fail(std::string("not valid JSON: ") + e.what(), "weight_map");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    return fail("no 'weight_map' object", "weight_map");
  std::map<std::string, SafetensorsFile*> shards;
  std::map<std::string, std::string> wanted;  // tensor -> shard
  for (const auto& [name, shard] : j["weight_map"].items()) {
    if (!shard.is_string()) return fail("weight_map entry is not a file name", name);
    const std::string s = shard.get<std::string>();
    // Plain names only: an index must not make the daemon map files outside the model.
    if (s.empty() || s.find('/') != std::string::npos || s == "." || s == ".." || s.find('\0') != std::string::npos)
      return fail("shard '" + s + "' is not a file name inside the checkpoint directory", name);
    wanted[name] = s;
    if (!shards.count(s)) {
      RD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(dir + "/" + s));
      shards[s] = f.get();
      c->files_.push_back(std::move(f));
    }
  }
  for (const auto& [shard, f] : shards) {
    for (const auto& e : f->header().tensors) {
      const auto w = wanted.find(e.name);
      if (w == wanted.end())
        return fail("tensor in shard " + shard + " is not listed in weight_map", e.name);
      if (w->second != shard)
        return fail("tensor is in shard " + shard + " but weight_map names " + w->second, e.name);
      c->tensors_.emplace(e.name, Tensor{f, &e});
    }
  }
  for (const auto& [name, shard] : wanted)
    if (!c->tensors_.count(name)) return fail("weight_map names shard " + shard + " but the tensor is not in it", name);
  return c;
}

// ---------------------------------------------------------------------------------------

Status write_safetensors(const std::string& path, std::span<const SafetensorsTensorIn> tensors,
                         const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    if (bytes != t.bytes.size())
      return Status(ErrorCode::kInvalidArgument, "byte size does not match shape and dtype", t.name);
    const std::string_view dn = st_dtype_name(t.dtype);
    if (dn.empty()) return Status(ErrorCode::kInvalidArgument, "dtype has no safetensors name", t.name);
    if (h.contains(t.name)) return Status(ErrorCode::kInvalidArgument, "tensor written twice", t.name);
    h[t.name] = {{"dtype", dn}, {"shape", t.shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  // Insertion order is lost (json objects sort their keys); readers sort by offset anyway.
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status(ErrorCode::kUnavailable, "cannot write " + tmp, path);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& t : tensors)
      out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    if (!out.flush()) return Status(ErrorCode::kUnavailable, "write failed: " + tmp, path);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status(ErrorCode::kUnavailable, "cannot rename " + tmp + " to " + path, path);
  return Status::Ok();
}

}  // namespace rolloutd::core
