#pragma once
// A small HTTP/1.1 server for the operator endpoints (/livez, /readyz, /metrics,
// /v1/status). GET and HEAD only: there is no way to change the daemon over HTTP,
// by construction, so the port can be scraped without guarding it like the
// control socket.
//
// One Asio thread serves every connection. Handlers run on that thread and must be
// cheap and non-blocking (read a published snapshot, never wait on the engine):
// a handler that blocks stalls every probe, and stop() waits for it.
//
// Beast stays inside http_server.cpp; this header is all the daemon compiles against.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/status.hpp"

namespace rolloutd::http {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

using HttpHandler = std::function<HttpResponse()>;

struct HttpServerOptions {
  std::string bind_address = "127.0.0.1";
  uint16_t port = 0;  // 0 = an ephemeral port; port() says which
  // Connections beyond this are closed as soon as they are accepted, so a flood of
  // idle sockets cannot exhaust file descriptors.
  int max_connections = 64;
  // Deadline for reading one request header (including the idle wait between
  // keep-alive requests) and for writing one response. A client that connects and
  // never sends frees its slot after this long.
  int io_timeout_ms = 5000;
  // Request line + headers; bigger requests get 431 and the connection is closed.
  size_t max_header_bytes = 8192;
  // Told about handler exceptions and accept failures (on the server thread; must not
  // block). The daemon logs them; empty = silent.
  std::function<void(std::string_view what)> on_error;
};

class HttpServer {
 public:
  // Binds (SO_REUSEADDR, so a restarted daemon gets its port back at once), listens,
  // then serves on its own thread. Routes match the path exactly; the query string is
  // ignored. A port already taken gives kUnavailable with field "http_port"; an
  // unparsable address gives kInvalidArgument with field "http_bind_address".
  static Result<std::unique_ptr<HttpServer>> start(const HttpServerOptions& options,
                                                   std::map<std::string, HttpHandler> routes);

  uint16_t port() const;

  // Closes the listening socket and every connection, then joins the server thread.
  // Idempotent and thread-safe. Bounded (about 2 s) as long as handlers do not block.
  // Called from a handler it only requests the stop; the join happens in the destructor,
  // which must not itself run on the server thread.
  void stop();

  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  struct Impl;  // opaque; public only so that http_server.cpp's connection type can name it

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::http
