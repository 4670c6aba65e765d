#include "core/storage/arena.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

namespace rolloutd::core {
namespace {
size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }
}  // namespace

std::string_view memory_tag_name(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::kWeights: return "weights";
    case MemoryTag::kKvCache: return "kv_cache";
    case MemoryTag::kCudaGraph: return "cuda_graph";
    case MemoryTag::kScratch: return "scratch";
  }
  return "scratch";
}

bool memory_tag_from_name(std::string_view name, MemoryTag& out) {
  for (MemoryTag t : kAllMemoryTags)
    if (memory_tag_name(t) == name) {
      out = t;
      return true;
    }
  return false;
}

StableArena::StableArena(const Backend& backend, ExecContext ctx, MemoryTag tag, size_t chunk_bytes,
                         size_t reserve_bytes)
    : backend_(backend), ctx_(ctx), tag_(tag), chunk_bytes_(chunk_bytes), reserve_bytes_(reserve_bytes) {
  if (reserve_bytes_ == 0)
    reserve_bytes_ = backend.kind == DeviceKind::kCuda ? size_t{8} << 30 : size_t{1} << 30;
  reserve_bytes_ = std::max(reserve_bytes_, chunk_bytes_);
}

StableArena::~StableArena() {
  for (const Piece& p : pieces_)
    if (p.mapped) (void)backend_.vm_unmap(ctx_, p.addr, p.bytes);
  for (const Segment& s : segments_) (void)backend_.vm_free(ctx_, s.base, s.reserved);
}

Status StableArena::new_segment(size_t min_bytes) {
  if (granularity_ == 0) {
    RD_RETURN_IF_ERROR(backend_.vm_granularity(ctx_, &granularity_));
    if (granularity_ == 0 || (granularity_ & (granularity_ - 1)) != 0)
      return Status(ErrorCode::kInternal, "virtual memory granularity is not a power of two", "granularity");
  }
  Segment s;
  s.reserved = round_up(std::max(reserve_bytes_, min_bytes), granularity_);
  void* base = nullptr;
  RD_RETURN_IF_ERROR(backend_.vm_reserve(ctx_, s.reserved, &base));
  s.base = static_cast<char*>(base);
  segments_.push_back(s);
  reserved_ += s.reserved;
  return Status::Ok();
}

// Maps pieces until [base, end) of the segment is backed.
Status StableArena::grow(Segment& s, size_t end) {
  if (end <= s.mapped) return Status::Ok();
  const size_t want = round_up(std::max(end - s.mapped, chunk_bytes_), granularity_);
  const size_t bytes = std::min(want, s.reserved - s.mapped);
  Piece p{s.base + s.mapped, bytes, false};
  RD_RETURN_IF_ERROR(backend_.vm_map(ctx_, p.addr, p.bytes));
  p.mapped = true;
  pieces_.push_back(p);
  s.mapped += bytes;
  backed_ += bytes;
  resident_ += bytes;
  return Status::Ok();
}

Result<TensorView> StableArena::allocate(DType dtype, const Shape& shape, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return Status(ErrorCode::kInvalidArgument, "alignment must be a power of two", "alignment");
  for (int i = 0; i < shape.rank(); ++i)
    if (shape[i] < 0) return Status(ErrorCode::kInvalidArgument, "negative dimension", "shape");
  if (released_)
    return Status(ErrorCode::kFailedPrecondition,
                  "the " + std::string(memory_tag_name(tag_)) + " arena is released; resume it first", "arena");
  const int64_t numel = shape.numel();
  size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
  if (bytes == 0) bytes = 1;  // distinct, valid address even for empty tensors

  // Ranges are granularity-aligned (>= a page), so offsets aligned within one are aligned in
  // memory for any alignment up to the granularity; larger ones align the address itself.
  auto start_in = [&](const Segment& s) {
    const auto base = reinterpret_cast<uintptr_t>(s.base);
    return static_cast<size_t>(((base + s.offset + alignment - 1) & ~(uintptr_t{alignment} - 1)) - base);
  };
  if (segments_.empty() || start_in(segments_.back()) + bytes > segments_.back().reserved)
    RD_RETURN_IF_ERROR(new_segment(bytes + alignment));
  Segment& s = segments_.back();
  const size_t off = start_in(s);
  if (off + bytes > s.reserved)
    return Status(ErrorCode::kInternal, "arena range too small after alignment", "alignment");
  RD_RETURN_IF_ERROR(grow(s, off + bytes));
  s.offset = off + bytes;
  used_ += bytes;
  return TensorView::contiguous(s.base + off, dtype, shape, ctx_.device);
}

Result<size_t> StableArena::release() {
  if (released_) return size_t{0};
  // Whatever the device still has queued may read the arena.
  RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  size_t freed = 0;
  for (Piece& p : pieces_) {
    if (!p.mapped) continue;
    RD_RETURN_IF_ERROR(backend_.vm_unmap(ctx_, p.addr, p.bytes));
    p.mapped = false;
    freed += p.bytes;
    resident_ -= p.bytes;
  }
  released_ = true;
  return freed;
}

Result<size_t> StableArena::resume() {
  if (!released_) return size_t{0};
  size_t mapped = 0;
  for (Piece& p : pieces_) {
    if (p.mapped) continue;
    RD_RETURN_IF_ERROR(backend_.vm_map(ctx_, p.addr, p.bytes));
    p.mapped = true;
    mapped += p.bytes;
    resident_ += p.bytes;
  }
  released_ = false;
  return mapped;
}

std::vector<StableArena::Range> StableArena::ranges() const {
  std::vector<Range> out;
  for (const Segment& s : segments_) out.push_back({reinterpret_cast<uintptr_t>(s.base), s.reserved});
  return out;
}

bool StableArena::contains(const void* p, size_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Segment& s : segments_) {
    const auto b = reinterpret_cast<uintptr_t>(s.base);
    if (a >= b && a - b <= s.offset && bytes <= s.offset - (a - b)) return true;
  }
  return false;
}

}  // namespace rolloutd::core
