#pragma once
// Reading safetensors checkpoints (https://github.com/huggingface/safetensors, format
// section): 8 bytes little-endian header length N, N bytes of UTF-8 JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the
// data section; offsets are relative to its start.
//
// Files are memory-mapped read-only: a tensor's bytes are a span into the mapping, so a
// checkpoint is never copied whole into host memory (the kernel pages it in as the loader
// reads it). The header is validated in full before anything is used -- a checkpoint comes
// from disk and may be truncated, hand-edited or hostile -- and every error names the tensor
// (Status::field) or the file.
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dtype.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

// Bounds on what a header may declare, checked before anything is allocated for it. The
// header limit is the safetensors library's own (100 MB): a real checkpoint's header is a
// few hundred kilobytes even at thousands of tensors.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
inline constexpr size_t kMaxSafetensorsNameBytes = 1024;
inline constexpr size_t kMaxSafetensorsDims = 8;
inline constexpr int64_t kMaxSafetensorsDim = int64_t{1} << 40;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section: [begin, end)
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;       // in data-section order (by begin, then name)
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_offset = 0;                     // 8 + N: where the data section starts in the file
  uint64_t data_size = 0;                       // file size - data_offset
  const SafetensorsEntry* find(std::string_view name) const;
};

// Parses and validates the header of a whole safetensors file held in `file` (its full
// contents, or a mapping of them). Checks, in order: the file holds the 8-byte length; the
// length is at most kMaxSafetensorsHeaderBytes and within the file; the header is a JSON
// object (starting with '{', nesting at most 3 deep, no name twice); `__metadata__`, when
// present, maps strings to strings; each tensor has exactly `dtype` (a safetensors dtype
// this build supports), `shape` (at most 8 dimensions, each in [0, 2^40]) and
// `data_offsets` ([begin, end], begin <= end); product(shape) x element size == end - begin;
// end lies inside the data section; no two tensors share a byte. Errors: kInvalidArgument
// (kUnimplemented for a dtype safetensors knows but rolloutd does not), field = the tensor's
// name, or "header" for the structure.
Result<SafetensorsHeader> parse_safetensors(std::span<const uint8_t> file);

// A read-only memory mapping of one safetensors file, with its validated header.
class SafetensorsFile {
 public:
  // Maps `path` (errors: kNotFound, kUnavailable for I/O, parse_safetensors' for the
  // contents; messages name the path).
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The tensor's bytes inside the mapping (valid while this object lives).
  std::span<const uint8_t> data(const SafetensorsEntry& e) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  SafetensorsHeader header_;
};

// A Hugging Face checkpoint directory: `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {name: shard file}}).
// Shard names must be plain file names inside the directory. Every tensor of the weight
// map must be in the shard it names, and every tensor of a shard must be in the weight map
// under that shard (a checkpoint whose index and shards disagree is refused, naming the
// tensor); no name appears in two shards.
class SafetensorsCheckpoint {
 public:
  struct Tensor {
    const SafetensorsFile* file;
    const SafetensorsEntry* entry;
  };
  static Result<std::unique_ptr<SafetensorsCheckpoint>> open(const std::string& dir);

  // Every tensor, sorted by name.
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const Tensor* find(std::string_view name) const;
  std::span<const uint8_t> data(const Tensor& t) const { return t.file->data(*t.entry); }
  size_t num_files() const { return files_.size(); }
  uint64_t total_bytes() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Tensor> tensors_;
};

// Writes a safetensors file (the tests' and `rolloutctl make-test-model`'s writer): tensors
// in the given order, contiguous, header padded with spaces to a multiple of 8 bytes (as the
// safetensors library does, so the data section is aligned). Sizes are checked as the
// reader checks them.
struct SafetensorsTensorIn {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};
Status write_safetensors(const std::string& path, std::span<const SafetensorsTensorIn> tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace rolloutd::core
