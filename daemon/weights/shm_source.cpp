#include "daemon/weights/shm_source.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <cstring>

namespace rolloutd::daemon {

Status check_shm_name(const std::string& name, const std::string& prefix) {
  if (name.size() < 2 || name.size() > 251 || name[0] != '/')
    return Status(ErrorCode::kInvalidArgument, "shared-memory name must be '/' followed by 1-250 characters",
                  "body.source.name");
  for (size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'))
      return Status(ErrorCode::kInvalidArgument, "shared-memory name may hold only [A-Za-z0-9._-]",
                    "body.source.name");
  }
  // The prefix is a name component, not a string prefix: with `/rolloutd_tenant_a`, a tenant
  // naming `/rolloutd_tenant_ab...` must not reach its neighbour's objects. What follows the
  // prefix starts with a separator ('.', '_' or '-'), unless the prefix ends with one.
  const auto separator = [](char c) { return c == '.' || c == '_' || c == '-'; };
  const bool inside = name.rfind(prefix, 0) == 0 &&
                      (name.size() == prefix.size() || separator(prefix.back()) || separator(name[prefix.size()]));
  if (!inside)
    return Status(ErrorCode::kInvalidArgument,
                  "shared-memory name '" + name + "' is outside this daemon's prefix '" + prefix +
                      "' (the prefix, then '.', '_' or '-' and the rest)",
                  "body.source.name");
  return Status::Ok();
}

Status read_shm(const std::string& name, uint64_t offset, uint64_t size, std::vector<uint8_t>& out,
                uint64_t max_bytes) {
  if (size > max_bytes)
    return Status(ErrorCode::kTooLarge,
                  "a shared-memory bucket of " + std::to_string(size) + " bytes is above this daemon's bound of " +
                      std::to_string(max_bytes) + " (--max-shm-bucket-bytes); send smaller buckets",
                  "body.source.size");
  // O_NONBLOCK: /dev/shm is writable by every user, and a FIFO put there under the name would
  // block open (and then read) on the engine thread for ever. Only a regular file is read.
  const int fd = shm_open(name.c_str(), O_RDONLY | O_NONBLOCK, 0);
  if (fd < 0)
    return Status(errno == ENOENT ? ErrorCode::kNotFound : ErrorCode::kUnavailable,
                  "cannot open shared memory '" + name + "': " + std::strerror(errno), "body.source");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    return Status(ErrorCode::kUnavailable, std::string("fstat failed: ") + std::strerror(e), "body.source");
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return Status(ErrorCode::kInvalidArgument,
                  "'" + name + "' is not a shared-memory object (a FIFO, device or directory of that name)",
                  "body.source.name");
  }
  const uint64_t have = static_cast<uint64_t>(st.st_size);
  if (offset > have || size > have - offset) {
    close(fd);
    return Status(ErrorCode::kOutOfRange,
                  "range [" + std::to_string(offset) + ", +" + std::to_string(size) + ") lies outside '" + name +
                      "' of " + std::to_string(have) + " bytes",
                  "body.source");
  }
  out.resize(size);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = pread(fd, out.data() + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      close(fd);
      return Status(ErrorCode::kUnavailable, n == 0 ? "shared memory shrank while being read"
                                                                 : std::string("read failed: ") + std::strerror(e),
                    "body.source");
    }
    done += static_cast<uint64_t>(n);
  }
  close(fd);
  return Status::Ok();
}

}  // namespace rolloutd::daemon
