#include "core/storage/arena.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

namespace rolloutd::core {

std::string_view memory_tag_name(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::kWeights: return "weights";
    case MemoryTag::kKvCache: return "kv_cache";
    case MemoryTag::kCudaGraph: return "cuda_graph";
    case MemoryTag::kScratch: return "scratch";
  }
  return "scratch";
}

StableArena::StableArena(const Backend& backend, ExecContext ctx, MemoryTag tag, size_t chunk_bytes)
    : backend_(backend), ctx_(ctx), tag_(tag), chunk_bytes_(chunk_bytes) {}

StableArena::~StableArena() {
  for (auto& c : chunks_) (void)backend_.free(ctx_, c.base);
}

Result<TensorView> StableArena::allocate(DType dtype, const Shape& shape, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return Status(ErrorCode::kInvalidArgument, "alignment must be a power of two", "alignment");
  for (int i = 0; i < shape.rank(); ++i)
    if (shape[i] < 0) return Status(ErrorCode::kInvalidArgument, "negative dimension", "shape");
  const int64_t numel = shape.numel();
  // Packed FP4 stores two elements per byte; everything else is numel * size.
  size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
  if (bytes == 0) bytes = 1;  // distinct, valid address even for empty tensors

  auto fits = [&](const Chunk& c) {
    const size_t start = (c.offset + alignment - 1) & ~(alignment - 1);
    return start + bytes <= c.size;
  };
  if (chunks_.empty() || !fits(chunks_.back())) {
    Chunk c;
    c.size = std::max(chunk_bytes_, bytes + alignment);
    RD_RETURN_IF_ERROR(backend_.alloc(ctx_, c.size, &c.base));
    chunks_.push_back(c);
    reserved_ += c.size;
  }
  Chunk& c = chunks_.back();
  // Backend allocations are at least 64-byte aligned; align the offset relative to the address.
  const auto base = reinterpret_cast<uintptr_t>(c.base);
  const uintptr_t start = (base + c.offset + alignment - 1) & ~(uintptr_t{alignment} - 1);
  const size_t off = static_cast<size_t>(start - base);
  if (off + bytes > c.size)
    return Status(ErrorCode::kInternal, "arena chunk too small after alignment", "alignment");
  c.offset = off + bytes;
  used_ += bytes;
  return TensorView::contiguous(reinterpret_cast<void*>(start), dtype, shape, ctx_.device);
}

}  // namespace rolloutd::core
