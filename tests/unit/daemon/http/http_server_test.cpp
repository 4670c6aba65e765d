#include "daemon/http/http_server.hpp"

#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <gtest/gtest.h>

namespace rolloutd::http {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct ParsedResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// A deliberately dumb HTTP/1.1 client over a plain Asio socket: it writes raw bytes
// and reads with deadlines, so tests can send what a real client never would and
// observe exactly when the server closes.
class RawClient {
 public:
  explicit RawClient(uint16_t port) : socket_(ioc_) {
    boost::system::error_code ec;
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port), ec);
    connected_ = !ec;
  }
  bool connected() const { return connected_; }

  // Errors (the server may already have closed) are left for the read to observe.
  void send(const std::string& raw) {
    boost::system::error_code ec;
    net::write(socket_, net::buffer(raw), ec);
  }

  std::optional<ParsedResponse> get(const std::string& path, milliseconds timeout = milliseconds(3000)) {
    send("GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n");
    return read_response(false, timeout);
  }

  // One response; nullopt if the connection closed or the deadline passed first.
  std::optional<ParsedResponse> read_response(bool head = false, milliseconds timeout = milliseconds(3000)) {
    const auto deadline = Clock::now() + timeout;
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (read_more(deadline) != Read::kData) return std::nullopt;
    }
    ParsedResponse r;
    const std::string head_text = buf_.substr(0, end + 2);
    buf_.erase(0, end + 4);
    size_t pos = head_text.find("\r\n");
    const std::string status_line = head_text.substr(0, pos);  // HTTP/1.1 200 OK
    r.status = std::stoi(status_line.substr(status_line.find(' ') + 1, 3));
    pos += 2;
    while (pos < head_text.size()) {
      const size_t eol = head_text.find("\r\n", pos);
      const std::string line = head_text.substr(pos, eol - pos);
      pos = eol + 2;
      const size_t colon = line.find(':');
      std::string name = line.substr(0, colon);
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      std::string value = line.substr(colon + 1);
      while (!value.empty() && value.front() == ' ') value.erase(0, 1);
      r.headers[name] = value;
    }
    const size_t length = head ? 0 : std::stoul(r.header("content-length").empty() ? "0" : r.header("content-length"));
    while (buf_.size() < length) {
      if (read_more(deadline) != Read::kData) return std::nullopt;
    }
    r.body = buf_.substr(0, length);
    buf_.erase(0, length);
    return r;
  }

  // True if the server ends the connection (EOF or reset) before the deadline,
  // with no further bytes arriving.
  bool wait_closed(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      switch (read_more(deadline)) {
        case Read::kClosed: return true;
        case Read::kTimeout: return false;
        case Read::kData: break;
      }
    }
  }
  const std::string& unread() const { return buf_; }

 private:
  enum class Read { kData, kClosed, kTimeout };

  Read read_more(Clock::time_point deadline) {
    std::array<char, 4096> tmp;
    bool done = false;
    boost::system::error_code result;
    size_t n = 0;
    socket_.async_read_some(net::buffer(tmp), [&](boost::system::error_code ec, size_t k) {
      done = true;
      result = ec;
      n = k;
    });
    ioc_.restart();
    ioc_.run_until(deadline);
    if (!done) {
      socket_.cancel();
      ioc_.restart();
      ioc_.run();  // let the cancelled read finish before `tmp` goes away
      return Read::kTimeout;
    }
    if (result) return Read::kClosed;
    buf_.append(tmp.data(), n);
    return Read::kData;
  }

  net::io_context ioc_;
  tcp::socket socket_;
  bool connected_ = false;
  std::string buf_;
};

std::map<std::string, HttpHandler> default_routes(std::atomic<int>* calls = nullptr) {
  return {
      {"/livez", [calls] {
         if (calls) ++*calls;
         return HttpResponse{200, "text/plain; charset=utf-8", "ok\n"};
       }},
      {"/metrics", [] { return HttpResponse{200, "text/plain; version=0.0.4", "rolloutd_ready 1\n"}; }},
      {"/v1/status", [] { return HttpResponse{200, "application/json", R"({"ready":true})"}; }},
  };
}

std::unique_ptr<HttpServer> start_or_die(HttpServerOptions opts, std::map<std::string, HttpHandler> routes) {
  auto r = HttpServer::start(opts, std::move(routes));
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

TEST(HttpServerTest, PortZeroBindsARealPort) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  EXPECT_NE(server->port(), 0);
  RawClient c(server->port());
  ASSERT_TRUE(c.connected());
}

TEST(HttpServerTest, RoutesAnswerWithBodyAndContentType) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  auto r = c.get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->header("content-type"), "text/plain; version=0.0.4");
  EXPECT_EQ(r->body, "rolloutd_ready 1\n");
  EXPECT_EQ(r->header("content-length"), std::to_string(r->body.size()));

  r = c.get("/v1/status?verbose=1");  // the query string does not take part in routing
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->header("content-type"), "application/json");
  EXPECT_EQ(r->body, R"({"ready":true})");
}

TEST(HttpServerTest, UnknownPathIs404) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  for (const char* path : {"/nope", "/", "/livez/", "/LIVEZ"}) {
    auto r = c.get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path;
  }
}

TEST(HttpServerTest, OtherMethodsAre405WithAllowAndNeverReachTheHandler) {
  std::atomic<int> calls{0};
  auto server = start_or_die({}, default_routes(&calls));
  ASSERT_TRUE(server);
  for (const char* method : {"POST", "PUT", "DELETE", "PATCH", "OPTIONS"}) {
    RawClient c(server->port());
    c.send(std::string(method) + " /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    auto r = c.read_response();
    ASSERT_TRUE(r) << method;
    EXPECT_EQ(r->status, 405) << method;
    EXPECT_EQ(r->header("allow"), "GET, HEAD") << method;
    // The unread body would corrupt the next request: the server ends the connection.
    EXPECT_EQ(r->header("connection"), "close") << method;
    EXPECT_TRUE(c.wait_closed(milliseconds(2000))) << method;
  }
  // Without a body the connection stays usable.
  RawClient c(server->port());
  c.send("POST /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  auto r = c.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  r = c.get("/livez");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(calls.load(), 1);
}

TEST(HttpServerTest, HeadSendsHeadersOnly) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  c.send("HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n");
  auto r = c.read_response(/*head=*/true);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->header("content-length"), "3");  // what GET would send
  EXPECT_EQ(r->header("content-type"), "text/plain; charset=utf-8");
  // A body after a HEAD response would be read as the start of this one.
  r = c.get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "rolloutd_ready 1\n");
  EXPECT_TRUE(c.unread().empty());
}

TEST(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  for (int i = 0; i < 3; ++i) {
    auto r = c.get("/livez");
    ASSERT_TRUE(r) << i;
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "ok\n");
    EXPECT_NE(r->header("connection"), "close");
  }
  // Pipelined: both requests in one write, answered in order.
  c.send("GET /livez HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  auto a = c.read_response();
  auto b = c.read_response();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->body, "ok\n");
  EXPECT_EQ(b->body, "rolloutd_ready 1\n");
}

TEST(HttpServerTest, ConnectionCloseAndHttp10AreHonoured) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient a(server->port());
  a.send("GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  auto r = a.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(a.wait_closed(milliseconds(2000)));

  RawClient b(server->port());
  b.send("GET /livez HTTP/1.0\r\n\r\n");
  r = b.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(b.wait_closed(milliseconds(2000)));
}

TEST(HttpServerTest, BodyOnGetIsIgnoredAndEndsTheConnection) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  c.send("GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + std::string(20000, 'x'));
  auto r = c.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "ok\n");
  EXPECT_TRUE(c.wait_closed(milliseconds(3000)));
}

TEST(HttpServerTest, OversizedHeaderIs431) {
  HttpServerOptions opts;
  opts.max_header_bytes = 1024;
  auto server = start_or_die(opts, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  c.send("GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4000, 'a') + "\r\n\r\n");
  auto r = c.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 431);
  EXPECT_TRUE(c.wait_closed(milliseconds(3000)));
}

TEST(HttpServerTest, GarbageIs400) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  RawClient c(server->port());
  c.send("\x01\x02 not http at all\r\n\r\n");
  auto r = c.read_response();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
}

TEST(HttpServerTest, IdleConnectionIsClosedAfterTimeoutWhileOthersAreServed) {
  HttpServerOptions opts;
  opts.io_timeout_ms = 300;
  auto server = start_or_die(opts, default_routes());
  ASSERT_TRUE(server);
  const auto t0 = Clock::now();
  RawClient idle(server->port());  // connects, never sends
  ASSERT_TRUE(idle.connected());
  RawClient busy(server->port());
  auto r = busy.get("/livez");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(idle.wait_closed(milliseconds(3000)));
  const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  EXPECT_GE(waited.count(), 250);
  EXPECT_LT(waited.count(), 2500);
  // A slot freed by the timeout can be used again; the busy client still works too.
  RawClient again(server->port());
  ASSERT_TRUE(again.get("/livez"));
}

TEST(HttpServerTest, ConnectionsBeyondTheLimitAreClosedAtOnce) {
  HttpServerOptions opts;
  opts.max_connections = 2;
  auto server = start_or_die(opts, default_routes());
  ASSERT_TRUE(server);
  auto c1 = std::make_unique<RawClient>(server->port());
  RawClient c2(server->port());
  ASSERT_TRUE(c1->get("/livez"));  // both accepted and holding a slot
  ASSERT_TRUE(c2.get("/livez"));

  RawClient c3(server->port());
  c3.send("GET /livez HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_FALSE(c3.read_response(false, milliseconds(2000)));

  c1.reset();  // frees a slot once the server sees the EOF
  const auto deadline = Clock::now() + milliseconds(3000);
  bool served = false;
  while (!served && Clock::now() < deadline) {
    RawClient c4(server->port());
    served = c4.get("/livez", milliseconds(500)).has_value();
    if (!served) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(served);
  EXPECT_TRUE(c2.get("/livez"));
}

TEST(HttpServerTest, SecondServerOnTheSamePortGetsATypedError) {
  auto first = start_or_die({}, default_routes());
  ASSERT_TRUE(first);
  HttpServerOptions opts;
  opts.port = first->port();
  auto second = HttpServer::start(opts, default_routes());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), ErrorCode::kUnavailable);
  EXPECT_EQ(second.status().field(), "http_port");
  EXPECT_NE(second.status().message().find("address in use"), std::string::npos) << second.status().message();
}

TEST(HttpServerTest, RestartedServerRebindsTheSamePortAtOnce) {
  auto first = start_or_die({}, default_routes());
  ASSERT_TRUE(first);
  const uint16_t port = first->port();
  {
    RawClient c(port);
    ASSERT_TRUE(c.get("/livez"));
    first->stop();  // the server closes first: its side of the connection sits in TIME_WAIT
    EXPECT_TRUE(c.wait_closed(milliseconds(2000)));
  }
  HttpServerOptions opts;
  opts.port = port;
  auto second = HttpServer::start(opts, default_routes());
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  RawClient c(port);
  EXPECT_TRUE(c.get("/livez"));
}

TEST(HttpServerTest, BadOptionsAreRejected) {
  HttpServerOptions opts;
  opts.bind_address = "not-an-address";
  auto r = HttpServer::start(opts, default_routes());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "http_bind_address");

  opts = {};
  opts.max_connections = 0;
  EXPECT_EQ(HttpServer::start(opts, default_routes()).status().code(), ErrorCode::kInvalidArgument);
}

TEST(HttpServerTest, StopIsIdempotentAndPromptWithOpenConnections) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  const uint16_t port = server->port();
  RawClient idle(port);
  RawClient kept(port);
  ASSERT_TRUE(kept.get("/livez"));

  const auto t0 = Clock::now();
  server->stop();
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count(), 1000);
  server->stop();
  EXPECT_TRUE(idle.wait_closed(milliseconds(1000)));
  EXPECT_TRUE(kept.wait_closed(milliseconds(1000)));
  RawClient late(port);
  EXPECT_FALSE(late.connected() && late.get("/livez", milliseconds(500)).has_value());
  server.reset();  // the destructor's stop() is a no-op now
}

TEST(HttpServerTest, StopFromAnotherThreadWhileServing) {
  auto server = start_or_die({}, default_routes());
  ASSERT_TRUE(server);
  std::atomic<bool> run{true};
  std::thread client([&] {
    while (run) {
      RawClient c(server->port());
      (void)c.get("/livez", milliseconds(500));
    }
  });
  std::this_thread::sleep_for(milliseconds(100));
  std::thread a([&] { server->stop(); });
  std::thread b([&] { server->stop(); });
  a.join();
  b.join();
  run = false;
  client.join();
}

TEST(HttpServerTest, ThrowingHandlerGives500AndTheServerKeepsServing) {
  std::vector<std::string> errors;
  std::mutex mu;
  HttpServerOptions opts;
  opts.on_error = [&](std::string_view what) {
    std::lock_guard<std::mutex> lock(mu);
    errors.emplace_back(what);
  };
  auto routes = default_routes();
  routes["/boom"] = []() -> HttpResponse { throw std::runtime_error("snapshot missing"); };
  routes["/odd"] = [] { return HttpResponse{1000, "text/plain", "?"}; };
  routes["/weird"] = []() -> HttpResponse { throw 42; };
  auto server = start_or_die(opts, std::move(routes));
  ASSERT_TRUE(server);
  RawClient c(server->port());
  for (const char* path : {"/boom", "/odd", "/weird"}) {
    auto r = c.get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 500) << path;
  }
  auto r = c.get("/livez");  // same connection, still alive
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[0].find("snapshot missing"), std::string::npos);
}

TEST(HttpServerTest, HandlerStatusAndHeadersPassThrough) {
  auto routes = default_routes();
  routes["/readyz"] = [] { return HttpResponse{503, "text/plain; charset=utf-8", "not ready: draining\n"}; };
  auto server = start_or_die({}, std::move(routes));
  ASSERT_TRUE(server);
  RawClient c(server->port());
  auto r = c.get("/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(r->body, "not ready: draining\n");
  EXPECT_EQ(r->header("cache-control"), "no-store");
}

}  // namespace
}  // namespace rolloutd::http
