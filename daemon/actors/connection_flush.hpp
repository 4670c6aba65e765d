#pragma once
// When has every client received what the control socket sent it?
//
// ZeroMQ closes a connection once it has written the last message into the kernel, not once
// the peer has received it. A client still reading a long backlog then has megabytes in our
// send buffer, and any byte it sends after the close (a heartbeat PONG) makes the kernel answer
// with a reset that discards that buffer, final events included. So at shutdown the control
// actor keeps the socket open until each of its connections has nothing left unacknowledged.
//
// The kernel's queues come from /proc/self/net/tcp{,6} (tx_queue: bytes sent or queued and not
// yet acknowledged, SIOCOUTQ), restricted to the socket inodes open in /proc/self/fd. ZeroMQ
// exposes no connection fds (a socket monitor could, but the CURVE authenticator owns the
// control socket's one monitor). Linux only, as the daemon is.
#include <chrono>
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/status.hpp"

namespace rolloutd::daemon {

struct TcpConnection {
  uint64_t inode = 0;
  uint64_t unacked_bytes = 0;  // sent or queued, not yet acknowledged by the peer
  uint64_t unread_bytes = 0;   // received, not yet read by this process
};

// This process's connections whose local port is `port` (the listener excluded).
Result<std::vector<TcpConnection>> tcp_connections_at_port(uint16_t port);

// The parts, for tests: the socket inodes among /proc/self/fd's links ("socket:[N]")...
Result<std::unordered_set<uint64_t>> own_socket_inodes();
// ...and one /proc/net/tcp or tcp6 table's rows at `port` whose inode is in `inodes`, appended
// to `out` (LISTEN rows skipped; a socket already in `out`, or listed twice, counts once). A
// malformed row is an error that names its line; `out` is then unchanged.
Status add_tcp_table(std::string_view table, uint16_t port, const std::unordered_set<uint64_t>& inodes,
                     std::vector<TcpConnection>& out);

// Successive readings in, a verdict out. A connection is flushed once its unacknowledged count
// has stayed zero for `settle` (ZeroMQ may still hold messages it has not written: the kernel
// queue reads zero until its I/O thread writes them), and stays flushed (a heartbeat PING later
// is not a reason to wait again). A connection missing from two readings in a row is gone
// (closed, or reset by its peer): lost if every reading over at least kBehind before it went had
// bytes unacknowledged (not necessarily the same bytes: it was behind), merely closed otherwise
// (a heartbeat PING or a reply in flight as a client that had what it wanted closed: a peer's
// kernel may hold its ACK for up to 200 ms, TCP's delayed-ACK maximum, so bytes younger than
// that may well have arrived). Closed connections whose last reading still had bytes
// unacknowledged are counted apart (num_closed_unacked): most are such replies, but a client
// killed in the last 250 ms is one too, and the shutdown log says how many.
class ConnectionFlushWatch {
 public:
  using Clock = std::chrono::steady_clock;
  // Longer than Linux's TCP_DELACK_MAX (200 ms): unacknowledged for this long, the bytes had not
  // reached the peer's kernel.
  static constexpr Clock::duration kBehind = std::chrono::milliseconds(250);
  explicit ConnectionFlushWatch(Clock::duration settle) : settle_(settle) {}

  void observe(const std::vector<TcpConnection>& connections, Clock::time_point now);
  bool all_flushed() const { return num_waiting() == 0; }
  size_t num_waiting() const;        // connections neither flushed nor gone
  uint64_t unacked_bytes() const;    // their unacknowledged bytes at the last reading
  size_t num_flushed() const;
  size_t num_closed() const { return num_closed_; }  // gone, not lost
  size_t num_closed_unacked() const { return num_closed_unacked_; }  // of those, with bytes unacked at the end
  uint64_t closed_unacked_bytes() const { return closed_unacked_bytes_; }
  size_t num_lost() const { return num_lost_; }
  uint64_t lost_bytes() const { return lost_bytes_; }

 private:
  struct Conn {
    uint64_t unacked = 0;
    int nonzero_readings = 0;  // in a row
    Clock::time_point nonzero_since, last_seen;
    bool zero = false;
    Clock::time_point zero_since;
    bool flushed = false;
    bool gone = false;
    int missing = 0;
  };
  Clock::duration settle_;
  std::unordered_map<uint64_t, Conn> conns_;
  size_t num_closed_ = 0;
  size_t num_closed_unacked_ = 0;
  uint64_t closed_unacked_bytes_ = 0;
  size_t num_lost_ = 0;
  uint64_t lost_bytes_ = 0;
};

}  // namespace rolloutd::daemon
