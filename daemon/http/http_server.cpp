#include "daemon/http/http_server.hpp"

#include <array>
#include <chrono>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pthread.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace rolloutd::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// After the last response on a connection whose request still has unread bytes
// (a body we never read, a rejected header), closing at once would make the
// kernel answer those bytes with RST, and the client could lose the response we
// just sent. So: half-close, read and discard for a short, bounded while, then close.
constexpr auto kLingerTime = std::chrono::milliseconds(500);
constexpr size_t kLingerMaxBytes = 64 * 1024;
// A failing accept (out of file descriptors) is retried after a pause instead of
// spinning the server thread.
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);
// How long stop() waits for connections to wind down before it stops the loop.
constexpr auto kStopGrace = std::chrono::seconds(2);

class Session;

bool is_http_error(const beast::error_code& ec) {
  return ec.category() == beast::error_code(bhttp::error::bad_method).category();
}

std::string_view path_of(std::string_view target) {
  const size_t end = target.find_first_of("?#");
  return end == std::string_view::npos ? target : target.substr(0, end);
}

}  // namespace

struct HttpServer::Impl {
  Impl(HttpServerOptions opts, std::map<std::string, HttpHandler> r)
      : options(std::move(opts)), routes(r.begin(), r.end()) {}

  void accept_next();
  void on_accepted(tcp::socket socket);
  void close_all();  // server thread only
  void report(std::string_view what) {
    if (!options.on_error) return;
    try {
      options.on_error(what);
    } catch (...) {
      // A failing logger must not take the server down with it.
    }
  }

  // Destroyed after io_context (declared before it): sessions still owned by
  // unrun handlers unregister themselves while io_context is torn down.
  const HttpServerOptions options;
  const std::map<std::string, HttpHandler, std::less<>> routes;
  std::unordered_map<Session*, std::weak_ptr<Session>> sessions;  // server thread only
  bool stopping = false;                                          // server thread only

  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_retry{ioc};
  uint16_t bound_port = 0;

  std::thread thread;
  std::future<void> finished;  // ready when the server thread's run() has returned
  std::mutex stop_mu;
  bool stop_posted = false;
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& server)
      : server_(server),
        stream_(std::move(socket)),
        // Room for a full header plus some pipelined bytes; never grows past it.
        buffer_(server.options.max_header_bytes + 4096),
        timeout_(std::chrono::milliseconds(server.options.io_timeout_ms)) {}

  ~Session() { server_.sessions.erase(this); }

  void start() { read_request(); }

  // Cancels whatever is pending; the handlers then see operation_aborted and drop
  // their reference, which ends the session.
  void close_now() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

 private:
  void read_request() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(server_.options.max_header_bytes));
    stream_.expires_after(timeout_);
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec == net::error::operation_aborted || server_.stopping) return;
    if (ec == bhttp::error::header_limit) return send_error(431, "request header too large\n");
    if (ec == bhttp::error::end_of_stream || ec == bhttp::error::partial_message || ec == beast::error::timeout ||
        ec == net::error::eof) {
      return close_now();  // the client left, or never spoke in time
    }
    if (is_http_error(ec)) return send_error(400, "bad request\n");
    if (ec) return close_now();

    const auto& req = parser_->get();
    // We never read a request body. With one pending, the next request would start
    // in the middle of it, so the connection ends after this response.
    const bool has_body = parser_->chunked() || parser_->content_length().value_or(0) > 0;
    const bool keep_alive = req.keep_alive() && !has_body;
    const bool head = req.method() == bhttp::verb::head;

    HttpResponse out;
    if (req.method() != bhttp::verb::get && !head) {
      out = {405, "text/plain; charset=utf-8", "method not allowed\n"};
    } else {
      auto it = server_.routes.find(path_of(std::string_view(req.target().data(), req.target().size())));
      if (it == server_.routes.end()) {
        out = {404, "text/plain; charset=utf-8", "not found\n"};
      } else {
        out = call_handler(it->second);
      }
    }
    send(std::move(out), req.version(), keep_alive, head);
  }

  HttpResponse call_handler(const HttpHandler& handler) {
    try {
      HttpResponse r = handler();
      if (r.status < 100 || r.status > 599) {
        server_.report("http handler returned an invalid status " + std::to_string(r.status));
        return {500, "text/plain; charset=utf-8", "internal error\n"};
      }
      return r;
    } catch (const std::exception& e) {
      server_.report(std::string("http handler threw: ") + e.what());
    } catch (...) {
      server_.report("http handler threw a non-standard exception");
    }
    return {500, "text/plain; charset=utf-8", "internal error\n"};
  }

  void send_error(int status, std::string body) {
    send({status, "text/plain; charset=utf-8", std::move(body)}, 11, /*keep_alive=*/false, /*head=*/false);
  }

  void send(HttpResponse out, unsigned version, bool keep_alive, bool head) {
    response_.emplace();
    response_->version(version);
    response_->result(static_cast<unsigned>(out.status));  // any code in [100, 599], named or not
    response_->set(bhttp::field::server, "rolloutd");
    response_->set(bhttp::field::content_type, out.content_type);
    response_->set(bhttp::field::cache_control, "no-store");
    if (out.status == 405) response_->set(bhttp::field::allow, "GET, HEAD");
    response_->keep_alive(keep_alive);
    if (head) {
      response_->content_length(out.body.size());  // what a GET would send, no body
    } else {
      response_->body() = std::move(out.body);
      response_->prepare_payload();
    }
    stream_.expires_after(timeout_);
    bhttp::async_write(stream_, *response_,
                       [self = shared_from_this(), keep_alive](beast::error_code ec, size_t) {
                         self->on_write(ec, keep_alive);
                       });
  }

  void on_write(beast::error_code ec, bool keep_alive) {
    if (ec || server_.stopping) return close_now();
    if (keep_alive) return read_request();
    linger_close();
  }

  void linger_close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close_now();
    stream_.expires_after(kLingerTime);  // one deadline for the whole drain
    drain();
  }

  void drain() {
    stream_.async_read_some(net::buffer(discard_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->drained_ += n;
      if (ec || self->drained_ >= kLingerMaxBytes || self->server_.stopping) return self->close_now();
      self->drain();
    });
  }

  HttpServer::Impl& server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  const std::chrono::milliseconds timeout_;
  std::optional<bhttp::request_parser<bhttp::empty_body>> parser_;
  std::optional<bhttp::response<bhttp::string_body>> response_;
  std::array<char, 4096> discard_{};
  size_t drained_ = 0;
};

}  // namespace

void HttpServer::Impl::accept_next() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (stopping || ec == net::error::operation_aborted) return;
    if (ec) {
      report("http accept failed: " + ec.message());
      accept_retry.expires_after(kAcceptRetryDelay);
      accept_retry.async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec && !stopping) accept_next();
      });
      return;
    }
    on_accepted(std::move(socket));
    accept_next();
  });
}

void HttpServer::Impl::on_accepted(tcp::socket socket) {
  if (sessions.size() >= static_cast<size_t>(options.max_connections)) {
    beast::error_code ec;
    socket.close(ec);  // over the limit: no slot, no timer, no buffer
    return;
  }
  beast::error_code ec;
  socket.set_option(tcp::no_delay(true), ec);  // small responses; don't wait for delayed ACKs
  auto session = std::make_shared<Session>(std::move(socket), *this);
  sessions.emplace(session.get(), session);
  session->start();
}

void HttpServer::Impl::close_all() {
  stopping = true;
  beast::error_code ec;
  acceptor.close(ec);
  accept_retry.cancel();
  // Collect first: close_now() can run destructors that erase from `sessions`.
  std::vector<std::shared_ptr<Session>> live;
  live.reserve(sessions.size());
  for (auto& [ptr, weak] : sessions) {
    if (auto s = weak.lock()) live.push_back(std::move(s));
  }
  for (auto& s : live) s->close_now();
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(const HttpServerOptions& options,
                                                      std::map<std::string, HttpHandler> routes) {
  if (options.max_connections < 1) {
    return Status(ErrorCode::kInvalidArgument, "max_connections must be at least 1", "http_max_connections");
  }
  if (options.io_timeout_ms < 1) {
    return Status(ErrorCode::kInvalidArgument, "io_timeout_ms must be positive", "http_io_timeout_ms");
  }
  if (options.max_header_bytes < 256 || options.max_header_bytes > (1u << 24)) {
    return Status(ErrorCode::kInvalidArgument, "max_header_bytes must be in [256, 16 MiB]", "http_max_header_bytes");
  }

  beast::error_code ec;
  const auto address = net::ip::make_address(options.bind_address, ec);
  if (ec) {
    return Status(ErrorCode::kInvalidArgument, "not an IP address: '" + options.bind_address + "'",
                  "http_bind_address");
  }
  auto impl = std::make_unique<Impl>(options, std::move(routes));
  const tcp::endpoint endpoint(address, options.port);
  const std::string where = options.bind_address + ":" + std::to_string(options.port);

  impl->acceptor.open(endpoint.protocol(), ec);
  if (ec) return Status(ErrorCode::kUnavailable, "http: cannot open socket: " + ec.message(), "http_port");
  // A restarted daemon must get its port back while the old connections sit in
  // TIME_WAIT. On Linux this does not let two live listeners share a port.
  impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (ec) return Status(ErrorCode::kUnavailable, "http: cannot set SO_REUSEADDR: " + ec.message(), "http_port");
  impl->acceptor.bind(endpoint, ec);
  if (ec == net::error::address_in_use) {
    return Status(ErrorCode::kUnavailable, "http: address in use: " + where + " (another process holds the port)",
                  "http_port");
  }
  if (ec == boost::system::errc::address_not_available) {  // no interface has this address
    return Status(ErrorCode::kUnavailable, "http: cannot bind " + where + ": " + ec.message(), "http_bind_address");
  }
  if (ec) return Status(ErrorCode::kUnavailable, "http: cannot bind " + where + ": " + ec.message(), "http_port");
  impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return Status(ErrorCode::kUnavailable, "http: cannot listen on " + where + ": " + ec.message(), "http_port");
  impl->bound_port = impl->acceptor.local_endpoint(ec).port();
  if (ec) return Status(ErrorCode::kUnavailable, "http: no local endpoint: " + ec.message(), "http_port");

  impl->accept_next();
  std::promise<void> finished;
  impl->finished = finished.get_future();
  Impl* raw = impl.get();
  try {
    impl->thread = std::thread([raw, finished = std::move(finished)]() mutable {
      // Named, so tools (top -H, the reliability tests' /livez probe, which reads this
      // thread's scheduler statistics) can tell it from the actors.
      pthread_setname_np(pthread_self(), "rolloutd-http");
      for (;;) {
        try {
          raw->ioc.run();
          break;
        } catch (const std::exception& e) {
          // Handlers catch what user code throws; this is Asio or allocation failure.
          // Keep serving: the probes matter most when something is already wrong.
          raw->report(std::string("http server loop: ") + e.what());
        }
      }
      finished.set_value();
    });
  } catch (const std::system_error& e) {
    return Status(ErrorCode::kResourceExhausted, std::string("http: cannot start thread: ") + e.what());
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

uint16_t HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  if (!impl_->stop_posted) {
    impl_->stop_posted = true;
    Impl* raw = impl_.get();
    net::post(impl_->ioc, [raw] { raw->close_all(); });
  }
  if (!impl_->thread.joinable() || std::this_thread::get_id() == impl_->thread.get_id()) return;
  // Closing completes every pending operation with operation_aborted, so run()
  // returns almost at once; stop() the loop if a handler is slow to let go.
  if (impl_->finished.wait_for(kStopGrace) != std::future_status::ready) impl_->ioc.stop();
  impl_->thread.join();
}

HttpServer::~HttpServer() { stop(); }

}  // namespace rolloutd::http
