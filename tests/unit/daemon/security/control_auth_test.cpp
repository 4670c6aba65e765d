// daemon/security/control_auth.cpp: the allowlist, the start-up security decision, and the
// ZAP handler on a real CURVE ROUTER with real clients (protocol::Client) over loopback TCP.
#include "daemon/security/control_auth.hpp"

#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "daemon/config.hpp"
#include "daemon/obs/metrics.hpp"
#include "protocol/client.hpp"
#include "protocol/curve.hpp"

namespace rolloutd::daemon {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using protocol::CurveKeyPair;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "rolloutd-auth-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

CurveKeyPair new_pair() {
  auto k = protocol::generate_curve_keypair();
  EXPECT_TRUE(k.ok());
  return *k;
}

// Sample of a Prometheus counter in `text` (0 if absent).
double sample(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') return std::stod(text.substr(at + series.size() + 1));
    at += series.size();
  }
  return 0;
}

// ------------------------------------------------------------------ allowlist --

TEST(ClientAllowlist, ListFileTakesBareKeysCertificateLinesAndComments) {
  TempDir dir;
  const auto a = new_pair(), b = new_pair();
  write(dir.file("clients.txt"), "# trainers\n\n" + a.public_key + "\n    public-key = \"" + b.public_key +
                                     "\"\nmetadata\ncurve\n");
  auto list = load_client_allowlist(dir.file("clients.txt"));
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].key, *protocol::z85_key_bytes(a.public_key, "k"));
  EXPECT_EQ((*list)[0].name, "clients.txt:3");
  EXPECT_EQ((*list)[1].key, *protocol::z85_key_bytes(b.public_key, "k"));
}

TEST(ClientAllowlist, DirectoryTakesEveryPublicCertificateAndNothingElse) {
  TempDir dir;
  const auto a = new_pair(), b = new_pair();
  ASSERT_TRUE(protocol::write_curve_keypair_files(dir.file("alice"), a, false).ok());
  ASSERT_TRUE(protocol::write_curve_keypair_files(dir.file("bob"), b, false).ok());
  // The secret certificates lie there too (keygen wrote them): *.key_secret is not read.
  write(dir.file("notes.txt"), "not a key\n");
  write(dir.file(".hidden.key"), "garbage\n");
  auto list = load_client_allowlist(dir.path());
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "alice.key");
  EXPECT_EQ((*list)[1].name, "bob.key");
  EXPECT_EQ((*list)[1].key, *protocol::z85_key_bytes(b.public_key, "k"));
}

TEST(ClientAllowlist, SecretKeysBadKeysAndEmptyListsAreRefused) {
  TempDir dir;
  const auto a = new_pair();
  write(dir.file("secret.key"), protocol::format_curve_certificate(a, true));
  auto secret_in_dir = load_client_allowlist(dir.path());
  ASSERT_FALSE(secret_in_dir.ok());
  EXPECT_NE(secret_in_dir.status().message().find("secret"), std::string::npos);

  write(dir.file("list"), "secret-key = \"" + a.secret_key + "\"\n");
  EXPECT_FALSE(load_client_allowlist(dir.file("list")).ok());
  write(dir.file("list"), a.public_key + "\npublic-key = \"tooshort\"\n");
  auto bad = load_client_allowlist(dir.file("list"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(":2"), std::string::npos) << bad.status().message();
  write(dir.file("empty"), "# nobody\n");
  EXPECT_EQ(load_client_allowlist(dir.file("empty")).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(load_client_allowlist(dir.file("missing")).status().code(), ErrorCode::kNotFound);
}

// --------------------------------------------------------- start-up decisions --

TEST(ControlSecurity, LoopbackAddresses) {
  for (const char* a : {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"})
    EXPECT_TRUE(is_loopback_address(a)) << a;
  for (const char* a : {"0.0.0.0", "*", "10.0.0.1", "128.0.0.1", "::", "eth0", "example.com", "", "127.0.0.1.evil"})
    EXPECT_FALSE(is_loopback_address(a)) << a;
}

TEST(ControlSecurity, WithoutKeysOnlyLoopbackUnlessInsecureBindAny) {
  DaemonConfig c;
  EXPECT_TRUE(validate(c).ok());
  c.bind_address = "0.0.0.0";
  const Status s = validate(c);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.field(), "bind");
  EXPECT_NE(s.message().find("--insecure-bind-any"), std::string::npos);
  EXPECT_NE(s.message().find("--curve-key-file"), std::string::npos);
  c.insecure_bind_any = true;
  EXPECT_TRUE(validate(c).ok());
  // With keys any address is fine, flag or not.
  c.insecure_bind_any = false;
  c.curve_key_file = "/k";
  c.curve_allow = "/a";
  EXPECT_TRUE(validate(c).ok());
}

TEST(ControlSecurity, KeysAndAllowlistComeTogetherAndFromOneSource) {
  DaemonConfig c;
  c.curve_key_file = "/k";
  EXPECT_EQ(validate(c).field(), "curve_allow");
  c.curve_allow = "/a";
  c.curve_secret_key = "x";
  EXPECT_EQ(validate(c).field(), "curve_key_file");
  DaemonConfig d;
  d.curve_allow = "/a";
  EXPECT_EQ(validate(d).field(), "curve_allow");
}

TEST(ControlSecurity, LoadsTheKeyPairFromAFileOrTheEnvironmentValue) {
  TempDir dir;
  const auto server = new_pair(), client = new_pair();
  auto files = protocol::write_curve_keypair_files(dir.file("daemon"), server, false);
  ASSERT_TRUE(files.ok());
  write(dir.file("allow"), client.public_key + "\n");
  DaemonConfig c;
  EXPECT_FALSE(load_control_security(c)->curve);
  c.curve_key_file = files->secret_path;
  c.curve_allow = dir.file("allow");
  auto sec = load_control_security(c);
  ASSERT_TRUE(sec.ok()) << sec.status().to_string();
  EXPECT_TRUE(sec->curve);
  EXPECT_EQ(sec->server.public_key, server.public_key);
  EXPECT_EQ(sec->allowed.size(), 1u);
  const auto j = sec->describe();
  EXPECT_EQ(j["curve_public_key"], server.public_key);
  EXPECT_EQ(j["clients_allowed"], 1);
  EXPECT_EQ(j.dump().find(server.secret_key), std::string::npos) << "the secret must never be described";

  DaemonConfig e;
  e.curve_secret_key = server.secret_key;
  e.curve_allow = dir.file("allow");
  auto from_env = load_control_security(e);
  ASSERT_TRUE(from_env.ok());
  EXPECT_EQ(from_env->server.public_key, server.public_key);

  e.curve_secret_key = "not-a-key";
  EXPECT_EQ(load_control_security(e).status().field(), "curve_secret_key");
  DaemonConfig f;
  f.curve_key_file = files->public_path;  // the public certificate is no key pair
  f.curve_allow = dir.file("allow");
  EXPECT_EQ(load_control_security(f).status().field(), "curve_key_file");
}

TEST(ControlSecurity, TheSecretKeyIsNeverInTheConfigurationLine) {
  DaemonConfig c;
  c.curve_secret_key = new_pair().secret_key;
  const std::string line = to_json(c).dump();
  EXPECT_EQ(line.find(c.curve_secret_key), std::string::npos);
  EXPECT_NE(line.find("ROLLOUTD_CURVE_SECRET_KEY"), std::string::npos);
}

// ------------------------------------------------------------ the ZAP handler --

// A CURVE ROUTER on an ephemeral loopback port, secured by a CurveAuthenticator, echoing
// every message back to its sender from a thread of its own.
class SecuredEcho {
 public:
  explicit SecuredEcho(std::vector<CurveKeyPair> allowed_clients)
      : server_(new_pair()), router_(ctx_, zmq::socket_type::router) {
    ControlSecurity sec;
    sec.curve = true;
    sec.server = server_;
    for (const auto& c : allowed_clients)
      sec.allowed.push_back({*protocol::z85_key_bytes(c.public_key, "k"), "test"});
    auto auth = CurveAuthenticator::create(ctx_, sec, metrics_);
    EXPECT_TRUE(auth.ok()) << auth.status().to_string();
    auth_ = std::move(*auth);
    router_.set(zmq::sockopt::linger, 0);
    EXPECT_TRUE(auth_->secure(router_).ok());
    router_.bind("tcp://127.0.0.1:*");
    endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, std::chrono::milliseconds(20));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        std::vector<zmq::message_t> parts;
        (void)zmq::recv_multipart(router_, std::back_inserter(parts));
        received_.fetch_add(1);
        zmq::send_multipart(router_, parts);
      }
    });
  }
  ~SecuredEcho() {
    stop_.store(true);
    thread_.join();
    router_.close();  // before the authenticator, as the daemon does
    auth_.reset();
  }
  const std::string& endpoint() const { return endpoint_; }
  const CurveKeyPair& server() const { return server_; }
  CurveAuthenticator& auth() { return *auth_; }
  int received() const { return received_.load(); }
  std::string metrics() const { return metrics_.serialize(); }
  zmq::context_t& context() { return ctx_; }

 private:
  zmq::context_t ctx_{1};
  obs::Metrics metrics_;
  CurveKeyPair server_;
  std::unique_ptr<CurveAuthenticator> auth_;
  zmq::socket_t router_;
  std::string endpoint_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> received_{0};
};

std::unique_ptr<protocol::Client> client_of(const std::string& endpoint, const std::string& server_key,
                                            const CurveKeyPair* pair) {
  protocol::ClientOptions o;
  o.endpoint = endpoint;
  o.request_timeout_ms = 10000;
  if (pair) o.curve = {server_key, *pair};
  auto c = protocol::Client::connect(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return std::move(*c);
}

TEST(CurveAuthenticator, AnAllowedKeyConnectsAndIsCounted) {
  const auto client = new_pair();
  SecuredEcho echo({new_pair(), client});
  auto c = client_of(echo.endpoint(), echo.server().public_key, &client);
  ASSERT_TRUE(c->send_raw({"ping", "payload"}).ok());
  auto got = c->recv_raw(5000);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ(**got, (std::vector<std::string>{"ping", "payload"}));
  EXPECT_EQ(echo.auth().num_accepted(), 1u);
  EXPECT_EQ(echo.auth().num_denied(), 0u);
  EXPECT_EQ(echo.auth().num_allowed(), 2u);
  EXPECT_EQ(sample(echo.metrics(), "rolloutd_auth_accepted_total"), 1);
}

// Every refusal: the call fails with kUnauthenticated well before its 10 s deadline, the
// server never sees a message, and the refusal is counted under `reason` (or `alt_reason`).
void expect_refused(SecuredEcho& echo, protocol::Client& c, const std::string& reason,
                    const std::string& alt_reason = "") {
  const auto t0 = Clock::now();
  Status s = c.send_raw({"ping"});
  if (s.ok()) {  // queued before the refusal arrived: the receive reports it
    auto got = c.recv_raw(10000);
    ASSERT_FALSE(got.ok()) << "a refused client received a reply";
    s = got.status();
  }
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(s.code(), ErrorCode::kUnauthenticated) << s.to_string();
  EXPECT_LT(took, 3.0) << "a refusal must not wait for the deadline";
  EXPECT_EQ(echo.received(), 0);
  auto count = [&] {
    double n = sample(echo.metrics(), "rolloutd_auth_denied_total{reason=\"" + reason + "\"}");
    if (!alt_reason.empty()) n += sample(echo.metrics(), "rolloutd_auth_denied_total{reason=\"" + alt_reason + "\"}");
    return n;
  };
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline && count() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GE(count(), 1) << echo.metrics();
  EXPECT_GE(echo.auth().num_denied(), 1u);
}

TEST(CurveAuthenticator, AnUnknownKeyIsRefusedAtOnce) {
  SecuredEcho echo({new_pair()});
  const auto stranger = new_pair();
  auto c = client_of(echo.endpoint(), echo.server().public_key, &stranger);
  expect_refused(echo, *c, "unknown_key");
  EXPECT_NE(c->send_raw({"again"}).message().find("--curve-allow"), std::string::npos);
  EXPECT_EQ(echo.auth().num_accepted(), 0u);
}

TEST(CurveAuthenticator, APlainClientIsRefused) {
  SecuredEcho echo({new_pair()});
  auto c = client_of(echo.endpoint(), "", nullptr);
  // Which one the daemon sees depends on who reads the other's greeting first.
  expect_refused(echo, *c, "not_curve", "handshake_aborted");
  EXPECT_NE(c->send_raw({"again"}).message().find("requires CURVE"), std::string::npos);
}

TEST(CurveAuthenticator, AClientWithAnotherServerKeyIsRefused) {
  const auto client = new_pair();
  SecuredEcho echo({client});
  auto c = client_of(echo.endpoint(), new_pair().public_key, &client);
  expect_refused(echo, *c, "handshake_failed");
}

TEST(CurveAuthenticator, ACurveClientOfAPlainDaemonIsToldSo) {
  zmq::context_t ctx(1);
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind("tcp://127.0.0.1:*");
  const auto client = new_pair();
  auto c = client_of(router.get(zmq::sockopt::last_endpoint), new_pair().public_key, &client);
  Status s = c->send_raw({"ping"});
  if (s.ok()) s = c->recv_raw(5000).status();
  EXPECT_EQ(s.code(), ErrorCode::kUnauthenticated) << s.to_string();
  // The protocol's mismatch report or the dropped handshake, whichever libzmq raises first.
  EXPECT_NE(s.message().find("not use CURVE"), std::string::npos) << s.message();
}

// The handler itself, spoken to directly the way libzmq speaks to it (RFC 27).
TEST(CurveAuthenticator, ZapRequestsAreAnsweredByTheRules) {
  const auto client = new_pair();
  SecuredEcho echo({client});
  zmq::socket_t req(echo.context(), zmq::socket_type::req);
  req.set(zmq::sockopt::linger, 0);
  req.set(zmq::sockopt::rcvtimeo, 5000);
  req.connect("inproc://zeromq.zap.01");
  auto ask = [&](std::vector<std::string> frames) {
    std::vector<zmq::const_buffer> bufs;
    for (const auto& f : frames) bufs.push_back(zmq::buffer(f));
    zmq::send_multipart(req, bufs);
    std::vector<zmq::message_t> reply;
    EXPECT_TRUE(zmq::recv_multipart(req, std::back_inserter(reply)));
    std::vector<std::string> out;
    for (auto& m : reply) out.push_back(m.to_string());
    return out;
  };
  const std::string key = *protocol::z85_key_bytes(client.public_key, "k");
  const std::string other = *protocol::z85_key_bytes(new_pair().public_key, "k");
  const std::string domain(kControlZapDomain);
  auto ok = ask({"1.0", "7", domain, "10.0.0.9", "", "CURVE", key});
  ASSERT_EQ(ok.size(), 6u);
  EXPECT_EQ(ok[0], "1.0");
  EXPECT_EQ(ok[1], "7");
  EXPECT_EQ(ok[2], "200");
  EXPECT_EQ(ok[4], "test");  // user id: the allowlist entry's name
  EXPECT_EQ(ask({"1.0", "8", domain, "10.0.0.9", "", "CURVE", other})[2], "400");
  EXPECT_EQ(ask({"1.0", "9", "another-domain", "10.0.0.9", "", "CURVE", key})[2], "400");
  EXPECT_EQ(ask({"1.0", "10", domain, "10.0.0.9", "", "PLAIN", "user", "pass"})[2], "400");
  EXPECT_EQ(ask({"1.0", "11", domain, "10.0.0.9", "", "CURVE", key.substr(1)})[2], "400");
  EXPECT_EQ(ask({"2.0", "12", domain, "10.0.0.9", "", "CURVE", key})[2], "500");
  EXPECT_EQ(ask({"1.0", "13"})[2], "500");
  std::vector<std::string> flood(40, "x");
  flood[0] = "1.0";
  EXPECT_EQ(ask(flood)[2], "400");  // too many frames: cut at the bound, refused
  EXPECT_EQ(echo.auth().num_accepted(), 1u);
  EXPECT_EQ(echo.auth().num_denied(), 7u);
}

TEST(CurveAuthenticator, ASecondHandlerInTheSameContextIsRefused) {
  zmq::context_t ctx(1);
  obs::Metrics metrics_a, metrics_b;
  ControlSecurity sec;
  sec.curve = true;
  sec.server = new_pair();
  sec.allowed.push_back({*protocol::z85_key_bytes(new_pair().public_key, "k"), "x"});
  auto first = CurveAuthenticator::create(ctx, sec, metrics_a);
  ASSERT_TRUE(first.ok());
  auto second = CurveAuthenticator::create(ctx, sec, metrics_b);
  EXPECT_EQ(second.status().code(), ErrorCode::kUnavailable);
  sec.curve = false;
  EXPECT_FALSE(CurveAuthenticator::create(ctx, sec, metrics_b).ok());
}

}  // namespace
}  // namespace rolloutd::daemon
