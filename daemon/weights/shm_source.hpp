#pragma once
// Reading a bucket out of POSIX shared memory (the CPU twin of CUDA IPC).
//
// The region is read with pread() into a daemon-owned buffer rather than mmap()ed:
// a producer that truncates or unlinks the object while the daemon reads it then
// causes a short read (a typed error) instead of SIGBUS killing the daemon. It costs
// one extra pass over the bucket (tests/bench/NOTES.md has the figure). The object is
// closed before the caller replies, so the producer may reuse or unlink it at once.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/status.hpp"

namespace rolloutd::daemon {

// Checks `name` against the allowed prefix ("/rolloutd" by default: the daemon only reads
// objects meant for it) and the shm name grammar.
Status check_shm_name(const std::string& name, const std::string& prefix);

// The largest shm bucket the daemon stages by default (--max-shm-bucket-bytes).
inline constexpr uint64_t kDefaultMaxShmBucketBytes = uint64_t{8} << 30;

// Reads [offset, offset + size) of the shared-memory object `name` into `out` (resized).
// `size` is bounded by `max_bytes` before anything is opened or allocated: the object's own
// size is no bound, since a sparse object of any size costs its producer nothing (too_large,
// field body.source.size).
Status read_shm(const std::string& name, uint64_t offset, uint64_t size, std::vector<uint8_t>& out,
                uint64_t max_bytes = kDefaultMaxShmBucketBytes);

}  // namespace rolloutd::daemon
