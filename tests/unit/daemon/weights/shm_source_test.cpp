// daemon/weights/shm_source.cpp: names confined to the configured prefix, sizes bounded
// before anything is opened or allocated, ranges checked against the object.
#include "daemon/weights/shm_source.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <vector>

namespace rolloutd::daemon {
namespace {

TEST(ShmSource, NamesMustCarryThePrefixAndTheGrammar) {
  const std::string prefix = "/rolloutd_tenant_a";
  EXPECT_TRUE(check_shm_name("/rolloutd_tenant_a", prefix).ok());
  EXPECT_TRUE(check_shm_name("/rolloutd_tenant_a.bucket-1", prefix).ok());
  EXPECT_TRUE(check_shm_name("/rolloutd_tenant_a_7", prefix).ok());
  EXPECT_TRUE(check_shm_name("/rolloutd_tenant_a-x", prefix).ok());
  // The prefix is a whole name component: a neighbour whose prefix extends this one's is out.
  for (const char* bad : {"/rolloutd_tenant_b_x", "/rolloutd", "/other", "rolloutd_tenant_a", "/",
                          "/rolloutd_tenant_a/../x", "/rolloutd_tenant_a x", "/rolloutd_tenant_a\n",
                          "/rolloutd_tenant_ab", "/rolloutd_tenant_ab_x", "/rolloutd_tenant_a7"}) {
    const Status s = check_shm_name(bad, prefix);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.field(), "body.source.name") << bad;
  }
  // A prefix that ends with a separator takes any continuation; the default takes the Python
  // client's names (/rolloutd-<hex>).
  EXPECT_TRUE(check_shm_name("/rolloutd_x", "/rolloutd_").ok());
  EXPECT_TRUE(check_shm_name("/rolloutd-0123abcd", "/rolloutd").ok());
  EXPECT_FALSE(check_shm_name("/rolloutdx", "/rolloutd").ok());
  EXPECT_FALSE(check_shm_name("/" + std::string(251, 'a'), "/a").ok());  // > 250 characters
}

TEST(ShmSource, SizeIsBoundedBeforeTheObjectIsOpened) {
  std::vector<uint8_t> out;
  // No such object: the bound answers first, so nothing was opened, let alone allocated.
  const Status s = read_shm("/rolloutd-test-no-such-object", 0, (uint64_t{1} << 40), out, uint64_t{1} << 20);
  EXPECT_EQ(s.code(), ErrorCode::kTooLarge);
  EXPECT_EQ(s.field(), "body.source.size");
  EXPECT_TRUE(out.empty());
  // The default bound applies to callers that pass none.
  EXPECT_EQ(read_shm("/rolloutd-test-no-such-object", 0, kDefaultMaxShmBucketBytes + 1, out).code(),
            ErrorCode::kTooLarge);
  EXPECT_EQ(read_shm("/rolloutd-test-no-such-object", 0, 16, out).code(), ErrorCode::kNotFound);
}

TEST(ShmSource, ASparseObjectIsNoLicenceToAllocate) {
  // Growing an object costs its maker nothing until pages are written: its size bounds nothing.
  const std::string name = "/rolloutd-test-sparse-" + std::to_string(::getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, off_t{1} << 32), 0);
  ::close(fd);
  std::vector<uint8_t> out;
  EXPECT_EQ(read_shm(name, 0, uint64_t{1} << 32, out, uint64_t{1} << 20).code(), ErrorCode::kTooLarge);
  EXPECT_TRUE(out.empty());
  // In bounds, the range is still checked against the object.
  EXPECT_EQ(read_shm(name, (uint64_t{1} << 32) - 8, 16, out, uint64_t{1} << 20).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(read_shm(name, ~uint64_t{0}, 16, out, uint64_t{1} << 20).code(), ErrorCode::kOutOfRange);
  ASSERT_TRUE(read_shm(name, 4096, 64, out, uint64_t{1} << 20).ok());
  EXPECT_EQ(out, std::vector<uint8_t>(64, 0));
  shm_unlink(name.c_str());
}

TEST(ShmSource, AFifoOfThatNameIsRefusedWithoutBlocking) {
  // /dev/shm is writable by every user: a FIFO there under a bucket's name blocked the engine
  // thread in open() for ever (no writer), beyond every deadline and past SIGTERM.
  const std::string name = "/rolloutd-test-fifo-" + std::to_string(::getpid());
  const std::string path = "/dev/shm" + name;
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  std::vector<uint8_t> out;
  auto read = std::async(std::launch::async, [&] { return read_shm(name, 0, 16, out); });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "read_shm blocked on a FIFO";
    // Release it: a writer's open completes the reader's, whose read then sees end of file.
    const int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
  }
  const Status s = read.get();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.field(), "body.source.name");
  EXPECT_TRUE(out.empty());
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace rolloutd::daemon
