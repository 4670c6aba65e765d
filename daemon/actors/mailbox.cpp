#include "daemon/actors/mailbox.hpp"

#include <cstring>

// ThreadSanitizer cannot see the hand-off: libzmq (Debian's, not instrumented) carries the
// pointer through lock-free queues. Sending p releases p and receiving it acquires p, the
// edge the queue provides, per mail and nothing wider; without it every mail looks like a
// race between the sender's writes and the receiver's reads.
#if defined(__SANITIZE_THREAD__)
#define ROLLOUTD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ROLLOUTD_TSAN 1
#endif
#endif
#ifdef ROLLOUTD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace rolloutd::daemon {
namespace {
zmq::socket_t make_pair_socket(zmq::context_t& ctx) {
  zmq::socket_t s(ctx, zmq::socket_type::pair);
  s.set(zmq::sockopt::sndhwm, 0);  // unlimited: see the header
  s.set(zmq::sockopt::rcvhwm, 0);
  s.set(zmq::sockopt::linger, 0);
  return s;
}
}  // namespace

Result<std::unique_ptr<MailboxEnd>> MailboxEnd::bind(zmq::context_t& ctx, const std::string& name) {
  try {
    zmq::socket_t s = make_pair_socket(ctx);
    s.bind("inproc://" + name);
    return std::unique_ptr<MailboxEnd>(new MailboxEnd(std::move(s)));
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kInternal, std::string("mailbox bind failed: ") + e.what(), name);
  }
}

Result<std::unique_ptr<MailboxEnd>> MailboxEnd::connect(zmq::context_t& ctx, const std::string& name) {
  try {
    zmq::socket_t s = make_pair_socket(ctx);
    s.connect("inproc://" + name);
    return std::unique_ptr<MailboxEnd>(new MailboxEnd(std::move(s)));
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kInternal, std::string("mailbox connect failed: ") + e.what(), name);
  }
}

MailboxEnd::~MailboxEnd() = default;

Status MailboxEnd::send_pointer(void* p) {
  try {
    zmq::message_t m(sizeof(void*));
    std::memcpy(m.data(), &p, sizeof(void*));
#ifdef ROLLOUTD_TSAN
    __tsan_release(p);
#endif
    // Unlimited HWM: a blocking send cannot block on an inproc PAIR with a live peer.
    if (!socket_.send(m, zmq::send_flags::dontwait))
      return Status(ErrorCode::kUnavailable, "mailbox peer not connected", "mailbox");
    return Status::Ok();
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kUnavailable, std::string("mailbox send failed: ") + e.what(), "mailbox");
  }
}

void* MailboxEnd::recv_pointer() {
  try {
    zmq::message_t m;
    if (!socket_.recv(m, zmq::recv_flags::dontwait)) return nullptr;
    if (m.size() != sizeof(void*)) return nullptr;  // cannot happen: only send_pointer writes here
    void* p = nullptr;
    std::memcpy(&p, m.data(), sizeof(void*));
#ifdef ROLLOUTD_TSAN
    __tsan_acquire(p);
#endif
    return p;
  } catch (const zmq::error_t&) {
    return nullptr;
  }
}

}  // namespace rolloutd::daemon
