#include "daemon/actors/connection_flush.hpp"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

namespace rolloutd::daemon {
namespace {

constexpr std::string_view kListenState = "0A";  // TCP_LISTEN, include/net/tcp_states.h

bool parse_number(std::string_view s, int base, uint64_t& v) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  return ec == std::errc() && end == s.data() + s.size();
}

std::vector<std::string_view> fields_of(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

Result<std::string> read_text(const char* path) {
  std::ifstream in(path);
  if (!in) return Status(ErrorCode::kUnavailable, std::string("cannot read ") + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Status add_tcp_table(std::string_view table, uint16_t port, const std::unordered_set<uint64_t>& inodes,
                     std::vector<TcpConnection>& out) {
  // Layout (get_tcp4_sock in net/ipv4/tcp_ipv4.c, get_tcp6_sock in net/ipv6/tcp_ipv6.c): a
  // header line, then "sl: local rem st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
  // ...", addresses HEXADDR:HEXPORT, state and queues in hex, inode in decimal. For a connection
  // tx_queue is write_seq - snd_una and rx_queue rcv_nxt - copied_seq; TIME_WAIT and SYN_RECV
  // rows carry inode 0, so they are never ours.
  std::vector<TcpConnection> found;
  std::unordered_set<uint64_t> counted;  // inodes in out or found: one hash lookup a row
  for (const auto& o : out) counted.insert(o.inode);
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < table.size()) {
    size_t eol = table.find('\n', pos);
    if (eol == std::string_view::npos) eol = table.size();
    const std::string_view line = table.substr(pos, eol - pos);
    pos = eol + 1;
    if (++line_no == 1) continue;  // the header
    const auto f = fields_of(line);
    if (f.empty()) continue;
    auto bad = [&](const char* what) {
      return Status(ErrorCode::kInvalidArgument,
                    "TCP table line " + std::to_string(line_no) + ": " + what + ": " + std::string(line));
    };
    if (f.size() < 10) return bad("fewer than 10 fields");
    const size_t colon = f[1].rfind(':');
    uint64_t local_port = 0;
    if (colon == std::string_view::npos || !parse_number(f[1].substr(colon + 1), 16, local_port) ||
        local_port > 0xffff)
      return bad("local address");
    const size_t qcolon = f[4].find(':');
    TcpConnection c;
    if (qcolon == std::string_view::npos || !parse_number(f[4].substr(0, qcolon), 16, c.unacked_bytes) ||
        !parse_number(f[4].substr(qcolon + 1), 16, c.unread_bytes))
      return bad("queues");
    if (!parse_number(f[9], 10, c.inode)) return bad("inode");
    if (local_port != port || f[3] == kListenState || !inodes.contains(c.inode)) continue;
    // The kernel writes these tables a page per read() and resumes by position, so a socket
    // added or closed between two reads can shift rows and list one twice (seen on a busy CI
    // machine): a socket counts once, first row kept.
    if (!counted.insert(c.inode).second) continue;
    found.push_back(c);
  }
  out.insert(out.end(), found.begin(), found.end());
  return Status::Ok();
}

Result<std::unordered_set<uint64_t>> own_socket_inodes() {
  std::unordered_set<uint64_t> inodes;
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/self/fd", ec);
  if (ec) return Status(ErrorCode::kUnavailable, "cannot list /proc/self/fd: " + ec.message());
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) return Status(ErrorCode::kUnavailable, "cannot list /proc/self/fd: " + ec.message());
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(it->path(), lec).string();
    if (lec) continue;  // closed between the listing and the read: not a connection to wait for
    constexpr std::string_view kPrefix = "socket:[";
    if (!target.starts_with(kPrefix) || !target.ends_with(']')) continue;
    uint64_t inode = 0;
    if (parse_number(std::string_view(target).substr(kPrefix.size(), target.size() - kPrefix.size() - 1), 10, inode))
      inodes.insert(inode);
  }
  return inodes;
}

Result<std::vector<TcpConnection>> tcp_connections_at_port(uint16_t port) {
  RD_ASSIGN_OR_RETURN(auto inodes, own_socket_inodes());
  std::vector<TcpConnection> out;
  bool any = false;
  for (const char* path : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    auto text = read_text(path);
    if (!text.ok()) continue;  // a kernel without IPv6, say
    any = true;
    if (Status s = add_tcp_table(*text, port, inodes, out); !s.ok()) return s;
  }
  if (!any) return Status(ErrorCode::kUnavailable, "cannot read /proc/self/net/tcp or tcp6");
  return out;
}

void ConnectionFlushWatch::observe(const std::vector<TcpConnection>& connections, Clock::time_point now) {
  std::unordered_set<uint64_t> seen;
  for (const auto& c : connections) {
    seen.insert(c.inode);
    Conn& s = conns_[c.inode];
    s.missing = 0;
    if (s.flushed || s.gone) continue;  // gone and back: an inode reused by a new connection is not waited for
    s.unacked = c.unacked_bytes;
    s.last_seen = now;
    if (c.unacked_bytes != 0) {
      if (s.nonzero_readings++ == 0) s.nonzero_since = now;
      s.zero = false;
      continue;
    }
    s.nonzero_readings = 0;
    if (!s.zero) {
      s.zero = true;
      s.zero_since = now;
    }
    if (now - s.zero_since >= settle_) s.flushed = true;
  }
  for (auto& [inode, s] : conns_) {
    if (seen.contains(inode) || s.flushed || s.gone) continue;
    if (++s.missing < 2) continue;  // one reading may miss a row while other sockets change
    s.gone = true;
    if (s.nonzero_readings >= 2 && s.last_seen - s.nonzero_since >= kBehind) {
      ++num_lost_;
      lost_bytes_ += s.unacked;
    } else {
      ++num_closed_;
      if (s.unacked != 0) {
        ++num_closed_unacked_;
        closed_unacked_bytes_ += s.unacked;
      }
    }
  }
}

size_t ConnectionFlushWatch::num_waiting() const {
  size_t n = 0;
  for (const auto& [inode, s] : conns_) n += !s.flushed && !s.gone;
  return n;
}

uint64_t ConnectionFlushWatch::unacked_bytes() const {
  uint64_t n = 0;
  for (const auto& [inode, s] : conns_) n += (!s.flushed && !s.gone) ? s.unacked : 0;
  return n;
}

size_t ConnectionFlushWatch::num_flushed() const {
  size_t n = 0;
  for (const auto& [inode, s] : conns_) n += s.flushed;
  return n;
}

}  // namespace rolloutd::daemon
