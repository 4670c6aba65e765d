#include "core/storage/static_state.hpp"

#include <zlib.h>

namespace rolloutd::core {

CopyKind StaticState::to_host() const {
  return ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
}
CopyKind StaticState::to_device() const {
  return ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
}

Status StaticState::add(std::string name, MemoryTag tag, TensorView region) {
  for (const Entry& e : entries_)
    if (e.name == name) return Status(ErrorCode::kInternal, "static state registered twice", name);
  if (region.data == nullptr || !region.is_contiguous())
    return Status(ErrorCode::kInternal, "static state must be a contiguous region", name);
  Entry e;
  e.name = std::move(name);
  e.tag = tag;
  e.region = region;
  entries_.push_back(std::move(e));
  return Status::Ok();
}

Status StaticState::backup(MemoryTag tag) {
  for (Entry& e : entries_) {
    if (e.tag != tag || e.backed_up) continue;
    e.backup.resize(e.region.nbytes());
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, e.backup.data(), e.region.data, e.backup.size(), to_host()));
  }
  RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  for (Entry& e : entries_)
    if (e.tag == tag) e.backed_up = true;
  return Status::Ok();
}

Status StaticState::restore(MemoryTag tag) {
  for (Entry& e : entries_) {
    if (e.tag != tag || !e.backed_up) continue;
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, e.region.data, e.backup.data(), e.backup.size(), to_device()));
  }
  // The host copies are read asynchronously: keep them until the device has them.
  RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  for (Entry& e : entries_) {
    if (e.tag != tag || !e.backed_up) continue;
    e.backed_up = false;
    std::vector<uint8_t>().swap(e.backup);
  }
  return Status::Ok();
}

Status StaticState::read(size_t i, std::vector<uint8_t>& out) const {
  const Entry& e = entries_.at(i);
  if (e.backed_up) {
    out = e.backup;
    return Status::Ok();
  }
  out.resize(e.region.nbytes());
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, out.data(), e.region.data, out.size(), to_host()));
  return backend_.synchronize(ctx_);
}

Result<uint32_t> StaticState::digest(MemoryTag tag) const {
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].tag != tag) continue;
    RD_RETURN_IF_ERROR(read(i, bytes));
    const std::string& n = entries_[i].name;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(n.data()), static_cast<uInt>(n.size()));
    const Bytef zero = 0;
    crc = crc32(crc, &zero, 1);
    crc = crc32(crc, bytes.data(), static_cast<uInt>(bytes.size()));
  }
  return static_cast<uint32_t>(crc);
}

size_t StaticState::bytes(MemoryTag tag) const {
  size_t n = 0;
  for (const Entry& e : entries_)
    if (e.tag == tag) n += e.region.nbytes();
  return n;
}

size_t StaticState::count(MemoryTag tag) const {
  size_t n = 0;
  for (const Entry& e : entries_) n += e.tag == tag;
  return n;
}

}  // namespace rolloutd::core
