#pragma once
// Mailboxes between actors: a ZeroMQ inproc PAIR per pair of actors, so one
// zmq::poll waits on the network and the mailbox alike. A mail is a heap object
// whose ownership moves through the socket as a pointer-sized message: nothing
// is copied and nothing is shared between threads except through this hand-off.
//
// The send side never blocks: inproc PAIR sockets get an unlimited high-water
// mark, and the consumers drain them every loop turn. Bounds on memory live
// where the policy lives (the engine's waiting queue, the per-client outbox).
#include <memory>
#include <string>
#include <utility>

#include <zmq.hpp>

#include "kernels/status.hpp"

namespace rolloutd::daemon {

class MailboxEnd {
 public:
  // Binds (first end) or connects (second end) `inproc://<name>` on `ctx`.
  static Result<std::unique_ptr<MailboxEnd>> bind(zmq::context_t& ctx, const std::string& name);
  static Result<std::unique_ptr<MailboxEnd>> connect(zmq::context_t& ctx, const std::string& name);
  ~MailboxEnd();

  template <class T>
  Status send(std::unique_ptr<T> mail) {
    T* raw = mail.release();
    Status s = send_pointer(raw);
    if (!s.ok()) delete raw;
    return s;
  }
  // nullptr when the mailbox is empty.
  template <class T>
  std::unique_ptr<T> try_recv() {
    return std::unique_ptr<T>(static_cast<T*>(recv_pointer()));
  }
  zmq::socket_t& socket() { return socket_; }

 private:
  explicit MailboxEnd(zmq::socket_t s) : socket_(std::move(s)) {}
  Status send_pointer(void* p);
  void* recv_pointer();
  zmq::socket_t socket_;
};

}  // namespace rolloutd::daemon
