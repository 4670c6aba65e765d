// daemon/actors/connection_flush: the /proc/net/tcp parser on hand-written rows (the layout of
// net/ipv4/tcp_ipv4.c's get_tcp4_sock), the live reading on a loopback connection whose reader
// stops reading, so our send queue fills, then reads, so it empties; and the watch's verdicts
// on made-up sequences of readings.
#include "daemon/actors/connection_flush.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace rolloutd::daemon {
namespace {

constexpr const char* kHeader =
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";

TEST(ConnectionFlush, SumsOnlyOwnConnectionsAtThePort) {
  // Port 0x1DB0 = 7600. Rows: our listener (skipped: LISTEN), two of our connections, one at
  // another port, one of another process (inode not ours), an orphan (inode 0).
  const std::string table = std::string(kHeader) +
      "   0: 0100007F:1DB0 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0\n"
      "   1: 0100007F:1DB0 0100007F:A000 01 00001000:00000010 01:00000014 00000000  1000        0 222 3 0 20 4 30 10 -1\n"
      "   2: 0100007F:1DB0 0100007F:A001 01 00000200:00000000 00:00000000 00000000  1000        0 333 2 0 20 4 30 10 -1\n"
      "   3: 0100007F:1F90 0100007F:A002 01 00005000:00000000 00:00000000 00000000  1000        0 444 2 0 20 4 30 10 -1\n"
      "   4: 0100007F:1DB0 0100007F:A003 01 00007000:00000000 00:00000000 00000000  1000        0 555 2 0 20 4 30 10 -1\n"
      "   5: 0100007F:1DB0 0100007F:A004 04 00009000:00000000 00:00000000 00000000  1000        0 0 2 0 20 4 30 10 -1\n";
  std::vector<TcpConnection> q;
  ASSERT_TRUE(add_tcp_table(table, 7600, {111, 222, 333, 444}, q).ok());
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[0].inode, 222u);
  EXPECT_EQ(q[0].unacked_bytes, 0x1000u);
  EXPECT_EQ(q[0].unread_bytes, 0x10u);
  EXPECT_EQ(q[1].inode, 333u);
  EXPECT_EQ(q[1].unacked_bytes, 0x200u);
  EXPECT_EQ(q[1].unread_bytes, 0u);
}

TEST(ConnectionFlush, ASocketListedTwiceCountsOnce) {
  // The kernel's tables can list a socket twice when sockets come and go between two reads of
  // the file; also across the tcp and tcp6 tables (appended to the same `out`).
  const std::string row =
      "   1: 0100007F:1DB0 0100007F:A000 01 00001000:00000010 01:00000014 00000000  1000        0 222 3 0 20 4 30 10 -1\n";
  const std::string other =
      "   2: 0100007F:1DB0 0100007F:A001 01 00000200:00000000 00:00000000 00000000  1000        0 333 2 0 20 4 30 10 -1\n";
  std::vector<TcpConnection> q;
  ASSERT_TRUE(add_tcp_table(std::string(kHeader) + row + other + row, 7600, {222, 333}, q).ok());
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[0].inode, 222u);
  EXPECT_EQ(q[1].inode, 333u);
  ASSERT_TRUE(add_tcp_table(std::string(kHeader) + other, 7600, {222, 333}, q).ok());
  EXPECT_EQ(q.size(), 2u);
}

TEST(ConnectionFlush, ReadsIpv6Rows) {
  const std::string table = std::string(kHeader) +
      "   0: 00000000000000000000000001000000:1DB0 00000000000000000000000001000000:B000 01 "
      "00000abc:00000000 00:00000000 00000000  1000        0 777 2 0 20 4 30 10 -1\n";
  std::vector<TcpConnection> q;
  ASSERT_TRUE(add_tcp_table(table, 7600, {777}, q).ok());
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].unacked_bytes, 0xabcu);
}

TEST(ConnectionFlush, MalformedRowsAreErrorsThatNameThem) {
  for (const char* row : {"   0: 0100007F:1DB0 0100007F:A000 01\n",                       // too few fields
                          "   0: 0100007F 0100007F:A000 01 0:0 00:0 0 1000 0 222 3\n",   // no port
                          "   0: 0100007F:1DB0 0100007F:A000 01 10 00:0 0 1000 0 222 3\n",  // queues
                          "   0: 0100007F:1DB0 0100007F:A000 01 1:x 00:0 0 1000 0 222 3\n",
                          "   0: 0100007F:1DB0 0100007F:A000 01 1:1 00:0 0 1000 0 2x2 3\n",  // inode
                          "   0: 0100007F:12345 0100007F:A000 01 1:1 00:0 0 1000 0 222 3\n"}) {
    // A good row first: a table with a bad row adds nothing.
    const std::string good = "   0: 0100007F:1DB0 0100007F:A000 01 1:1 00:0 0 1000 0 222 3\n";
    std::vector<TcpConnection> q;
    const Status s = add_tcp_table(std::string(kHeader) + good + row, 7600, {222}, q);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << row;
    EXPECT_NE(s.message().find("line 3"), std::string::npos) << s.message();
    EXPECT_TRUE(q.empty()) << row;
  }
  std::vector<TcpConnection> q;  // a header alone, or nothing at all, is an empty table
  EXPECT_TRUE(add_tcp_table(kHeader, 7600, {}, q).ok());
  EXPECT_TRUE(add_tcp_table("", 7600, {}, q).ok());
  EXPECT_TRUE(q.empty());
}

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

TEST(ConnectionFlush, SeesALoopbackSendQueueFillAndEmpty) {
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  ASSERT_GE(listener.fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener.fd, 1), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(listener.fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const uint16_t port = ntohs(addr.sin_port);

  Fd reader(::socket(AF_INET, SOCK_STREAM, 0));
  const int small = 4096;
  ASSERT_EQ(::setsockopt(reader.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
  ASSERT_EQ(::connect(reader.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  Fd server(::accept(listener.fd, nullptr, nullptr));  // our connection at `port`
  ASSERT_GE(server.fd, 0);

  auto conns = tcp_connections_at_port(port);
  ASSERT_TRUE(conns.ok()) << conns.status().to_string();
  // The reader's end has `port` as its remote port, not its local one: only the accepted end counts.
  ASSERT_EQ(conns->size(), 1u);
  EXPECT_EQ((*conns)[0].unacked_bytes, 0u);

  // Write until the kernel takes no more: the reader's window is full, the rest waits unacknowledged.
  ASSERT_EQ(::fcntl(server.fd, F_SETFL, ::fcntl(server.fd, F_GETFL) | O_NONBLOCK), 0);
  std::vector<char> chunk(64 * 1024, 'x');
  size_t written = 0;
  while (true) {
    const ssize_t n = ::send(server.fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  ASSERT_GT(written, 0u);
  conns = tcp_connections_at_port(port);
  ASSERT_TRUE(conns.ok());
  ASSERT_EQ(conns->size(), 1u);
  EXPECT_GT((*conns)[0].unacked_bytes, 0u);
  EXPECT_LE((*conns)[0].unacked_bytes, written);

  // The reader reads everything; the queue empties (acks on loopback are prompt, but bounded here).
  size_t read_total = 0;
  while (read_total < written) {
    const ssize_t n = ::recv(reader.fd, chunk.data(), chunk.size(), 0);
    ASSERT_GT(n, 0);
    read_total += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((conns = tcp_connections_at_port(port)).ok() && conns->size() == 1 && (*conns)[0].unacked_bytes != 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(conns.ok());
  ASSERT_EQ(conns->size(), 1u);
  EXPECT_EQ((*conns)[0].unacked_bytes, 0u);

  // Closed, it is no longer ours (an orphan or gone).
  ::close(server.fd);
  server.fd = -1;
  conns = tcp_connections_at_port(port);
  ASSERT_TRUE(conns.ok());
  EXPECT_TRUE(conns->empty());
}

using Clock = ConnectionFlushWatch::Clock;
constexpr auto kSettle = std::chrono::milliseconds(50);

TEST(ConnectionFlush, NothingToWaitForWithoutConnections) {
  ConnectionFlushWatch w(kSettle);
  w.observe({}, Clock::now());
  EXPECT_TRUE(w.all_flushed());
  EXPECT_EQ(w.num_lost(), 0u);
}

TEST(ConnectionFlush, ZeroMustHoldForTheSettleTime) {
  ConnectionFlushWatch w(kSettle);
  const auto t0 = Clock::now();
  w.observe({{1, 5000, 0}}, t0);
  EXPECT_FALSE(w.all_flushed());
  EXPECT_EQ(w.unacked_bytes(), 5000u);
  w.observe({{1, 0, 0}}, t0 + std::chrono::milliseconds(10));
  w.observe({{1, 0, 0}}, t0 + std::chrono::milliseconds(40));  // zero for 30 ms: not yet
  EXPECT_FALSE(w.all_flushed());
  w.observe({{1, 70, 0}}, t0 + std::chrono::milliseconds(50));  // ZeroMQ wrote more: start again
  w.observe({{1, 0, 0}}, t0 + std::chrono::milliseconds(60));
  w.observe({{1, 0, 0}}, t0 + std::chrono::milliseconds(100));
  EXPECT_FALSE(w.all_flushed());
  w.observe({{1, 0, 0}}, t0 + std::chrono::milliseconds(110));
  EXPECT_TRUE(w.all_flushed());
  EXPECT_EQ(w.num_flushed(), 1u);
  EXPECT_EQ(w.unacked_bytes(), 0u);
}

TEST(ConnectionFlush, AFlushedConnectionStaysFlushedAndEachIsJudgedAlone) {
  ConnectionFlushWatch w(kSettle);
  const auto t0 = Clock::now();
  auto at = [&](int ms) { return t0 + std::chrono::milliseconds(ms); };
  w.observe({{1, 0, 0}, {2, 900, 0}}, at(0));
  w.observe({{1, 0, 0}, {2, 0, 0}}, at(50));  // 1 flushed, 2 zero since 50
  EXPECT_EQ(w.num_flushed(), 1u);
  w.observe({{1, 33, 0}, {2, 0, 0}}, at(80));  // a heartbeat PING on 1: still flushed
  EXPECT_FALSE(w.all_flushed());
  w.observe({{1, 33, 0}, {2, 0, 0}}, at(100));
  EXPECT_TRUE(w.all_flushed());  // the sum was never zero here, each connection was
}

TEST(ConnectionFlush, AConnectionGoneRightAfterOneBusyReadingIsClosedNotLost) {
  ConnectionFlushWatch w(kSettle);
  const auto t0 = Clock::now();
  auto at = [&](int ms) { return t0 + std::chrono::milliseconds(ms); };
  w.observe({{1, 0, 0}}, at(0));
  w.observe({{1, 11, 0}}, at(10));  // a PING (or a reply) in flight as the client closes
  w.observe({}, at(20));
  w.observe({}, at(30));
  EXPECT_TRUE(w.all_flushed());
  EXPECT_EQ(w.num_closed(), 1u);
  EXPECT_EQ(w.num_lost(), 0u);
}

TEST(ConnectionFlush, AConnectionGoneWithinTheDelayedAckTimeIsClosedNotLost) {
  // A reply in flight over several readings as its client closes: the peer's kernel may hold its
  // ACK for up to 200 ms (seen on a loaded CI machine: two readings 10 ms apart).
  ConnectionFlushWatch w(kSettle);
  const auto t0 = Clock::now();
  auto at = [&](int ms) { return t0 + std::chrono::milliseconds(ms); };
  w.observe({{1, 0, 0}}, at(0));
  w.observe({{1, 120, 0}}, at(10));
  w.observe({{1, 120, 0}}, at(20));
  w.observe({{1, 120, 0}}, at(250));  // 240 ms since the first busy reading: under kBehind
  w.observe({}, at(270));
  w.observe({}, at(280));
  EXPECT_TRUE(w.all_flushed());
  EXPECT_EQ(w.num_closed(), 1u);
  EXPECT_EQ(w.num_lost(), 0u);
  EXPECT_EQ(w.num_closed_unacked(), 1u) << "counted apart: its last reading had 120 bytes unacked";
  EXPECT_EQ(w.closed_unacked_bytes(), 120u);
}

TEST(ConnectionFlush, AConnectionGoneWithBytesUnackedIsLostAndOneMissedReadingIsNot) {
  ConnectionFlushWatch w(kSettle);
  const auto t0 = Clock::now();
  auto at = [&](int ms) { return t0 + std::chrono::milliseconds(ms); };
  w.observe({{1, 4000, 0}, {2, 100, 0}}, at(0));
  w.observe({{2, 100, 0}}, at(10));  // 1 missed once: a row the reading skipped
  EXPECT_EQ(w.num_waiting(), 2u);
  w.observe({{1, 3000, 0}, {2, 100, 0}}, at(250));  // back, unacked since 0: behind
  w.observe({{2, 100, 0}}, at(260));
  w.observe({{2, 100, 0}}, at(270));  // 1 missing twice: reset by its peer with 3,000 bytes unacked
  EXPECT_EQ(w.num_lost(), 1u);
  EXPECT_EQ(w.lost_bytes(), 3000u);
  EXPECT_EQ(w.num_waiting(), 1u);
  w.observe({}, at(280));
  w.observe({}, at(290));  // 2 gone too
  EXPECT_TRUE(w.all_flushed());
  EXPECT_EQ(w.num_lost(), 2u);
  EXPECT_EQ(w.lost_bytes(), 3100u);
  EXPECT_EQ(w.num_closed(), 0u);
  EXPECT_EQ(w.num_closed_unacked(), 0u);
  w.observe({{1, 5, 0}}, at(300));  // the inode reused by a new connection: not waited for
  EXPECT_TRUE(w.all_flushed());
}

}  // namespace
}  // namespace rolloutd::daemon
