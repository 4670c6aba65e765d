#include "daemon/security/control_auth.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "daemon/obs/log.hpp"
#include "daemon/obs/metrics.hpp"

namespace rolloutd::daemon {
namespace {

constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";  // fixed by RFC 27
constexpr char kMonitorEndpoint[] = "inproc://rolloutd-control-auth-monitor";
constexpr auto kPollSlice = std::chrono::milliseconds(100);
constexpr auto kLogInterval = std::chrono::seconds(10);
// A ZAP request has 6 frames plus the mechanism's credentials (one for CURVE); anything
// longer is not from libzmq.
constexpr size_t kMaxZapFrames = 16;
constexpr size_t kMaxAllowlistFileBytes = 16 * 1024 * 1024;

// The reasons rolloutd_auth_denied_total is labelled with (a fixed set).
constexpr const char* kDeniedReasons[] = {"unknown_key", "not_curve", "handshake_failed", "handshake_aborted",
                                          "bad_request"};

Result<std::string> read_bounded(const std::string& path, size_t limit) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(ErrorCode::kNotFound, "cannot read " + path + ": " + std::strerror(errno), "curve_allow");
  std::string text(limit + 1, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(f.gcount()));
  if (text.size() > limit)
    return Status(ErrorCode::kTooLarge, path + " is larger than " + std::to_string(limit) + " bytes", "curve_allow");
  return text;
}

Status add_key(std::vector<AllowedClient>& out, std::string_view z85, std::string name) {
  if (out.size() >= kMaxAllowedClients)
    return Status(ErrorCode::kTooLarge, "more than " + std::to_string(kMaxAllowedClients) + " allowed client keys",
                  "curve_allow");
  auto raw = protocol::z85_key_bytes(z85, "client public key");
  if (!raw.ok()) return Status(raw.status().code(), name + ": " + raw.status().message(), "curve_allow");
  out.push_back({std::move(*raw), std::move(name)});
  return Status::Ok();
}

// One public key per certificate, as keygen writes them.
Status load_certificate(std::vector<AllowedClient>& out, const std::filesystem::path& file) {
  RD_ASSIGN_OR_RETURN(std::string text, read_bounded(file.string(), protocol::kMaxCurveKeyFileBytes));
  auto parsed = protocol::parse_curve_key_text(text, /*bare_is_secret=*/false);
  if (!parsed.ok()) return Status(parsed.status().code(), file.string() + ": " + parsed.status().message(), "curve_allow");
  if (!parsed->secret_key.empty())
    return Status(ErrorCode::kInvalidArgument,
                  file.string() + " holds a secret key: an allowlist takes public certificates (<name>.key) only; "
                                  "move the secret one back to its owner",
                  "curve_allow");
  return add_key(out, parsed->public_key, file.filename().string());
}

// A list: one key per line, bare or `public-key = "..."`; `#` comments (a bare key is
// recognised before a comment, since Z85 has '#').
Status load_list(std::vector<AllowedClient>& out, const std::string& path) {
  RD_ASSIGN_OR_RETURN(std::string text, read_bounded(path, kMaxAllowlistFileBytes));
  const std::string base = std::filesystem::path(path).filename().string();
  size_t start = 0, line_no = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    auto parsed = protocol::parse_curve_key_text(line, /*bare_is_secret=*/false);
    if (!parsed.ok()) {
      // Blank lines, comments and certificate scaffolding ("metadata", "curve") hold no key.
      const auto first = line.find_first_not_of(" \t\r");
      if (first == std::string::npos || line[first] == '#' || line.find('=') == std::string::npos) continue;
      return Status(parsed.status().code(),
                    path + ":" + std::to_string(line_no) + ": " + parsed.status().message(), "curve_allow");
    }
    if (!parsed->secret_key.empty())
      return Status(ErrorCode::kInvalidArgument,
                    path + ":" + std::to_string(line_no) + " is a secret key: list public keys only", "curve_allow");
    RD_RETURN_IF_ERROR(add_key(out, parsed->public_key, base + ":" + std::to_string(line_no)));
  }
  return Status::Ok();
}

std::string z85_of(std::string_view raw) { return protocol::z85_encode_key(raw); }

}  // namespace

Result<std::vector<AllowedClient>> load_client_allowlist(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<AllowedClient> out;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec || !fs::exists(st))
    return Status(ErrorCode::kNotFound, "client allowlist " + path + " does not exist", "curve_allow");
  if (fs::is_directory(st)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const auto name = entry.path().filename().string();
      if (name.empty() || name[0] == '.' || entry.path().extension() != ".key") continue;
      if (!entry.is_regular_file(ec)) continue;
      files.push_back(entry.path());
    }
    if (ec) return Status(ErrorCode::kUnavailable, "cannot list " + path + ": " + ec.message(), "curve_allow");
    std::sort(files.begin(), files.end());  // a stable order for logs
    for (const auto& f : files) RD_RETURN_IF_ERROR(load_certificate(out, f));
  } else {
    RD_RETURN_IF_ERROR(load_list(out, path));
  }
  if (out.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "client allowlist " + path + " holds no public key: no client could connect", "curve_allow");
  return out;
}

nlohmann::json ControlSecurity::describe() const {
  nlohmann::json j{{"curve", curve}, {"insecure_bind_any", insecure_bind_any},
                   {"clients_allowed", curve ? allowed.size() : 0}};
  if (curve) j["curve_public_key"] = server.public_key;
  return j;
}

Result<ControlSecurity> load_control_security(const DaemonConfig& config) {
  ControlSecurity sec;
  sec.insecure_bind_any = config.insecure_bind_any;
  const bool has_key = !config.curve_key_file.empty() || !config.curve_secret_key.empty();
  if (!has_key) return sec;
  RD_RETURN_IF_ERROR(protocol::require_curve());
  if (!config.curve_key_file.empty()) {
    auto pair = protocol::load_curve_keypair_file(config.curve_key_file);
    if (!pair.ok()) return Status(pair.status().code(), pair.status().message(), "curve_key_file");
    sec.server = std::move(*pair);
    // Like ssh with its host keys, but a warning only: Kubernetes mounts secrets 0644 by default.
    std::error_code ec;
    const auto perms = std::filesystem::status(config.curve_key_file, ec).permissions();
    if (!ec && (perms & (std::filesystem::perms::group_all | std::filesystem::perms::others_all)) !=
                   std::filesystem::perms::none)
      obs::log_warn("daemon", "the daemon's secret key file is readable by other users; chmod 600 it",
                    {{"curve_key_file", config.curve_key_file}});
  } else {
    auto pair = protocol::curve_keypair_from_secret(config.curve_secret_key);
    if (!pair.ok())
      return Status(pair.status().code(), "ROLLOUTD_CURVE_SECRET_KEY: " + pair.status().message(), "curve_secret_key");
    sec.server = std::move(*pair);
  }
  RD_ASSIGN_OR_RETURN(sec.allowed, load_client_allowlist(config.curve_allow));
  sec.curve = true;
  return sec;
}

// ------------------------------------------------------------ CurveAuthenticator --

CurveAuthenticator::CurveAuthenticator(zmq::context_t& ctx, const ControlSecurity& security, obs::Metrics& metrics)
    : ctx_(ctx),
      server_(security.server),
      num_allowed_(security.allowed.size()),
      zap_(ctx, zmq::socket_type::rep),
      monitor_(ctx, zmq::socket_type::pair) {
  for (const auto& c : security.allowed) allowed_.emplace(c.key, c.name);
  auto& denied = prometheus::BuildCounter()
                     .Name("rolloutd_auth_denied_total")
                     .Help("Connections to the control socket refused by CURVE authentication, by reason: "
                           "unknown_key (not in --curve-allow), not_curve (a plain client), handshake_failed "
                           "(wrong server key, malformed handshake), handshake_aborted (the peer left mid-"
                           "handshake: often a plain client, or a port probe), bad_request")
                     .Register(metrics.registry());
  for (const char* reason : kDeniedReasons) denied_counters_[reason] = &denied.Add({{"reason", reason}});
  accepted_counter_ = &prometheus::BuildCounter()
                           .Name("rolloutd_auth_accepted_total")
                           .Help("Connections to the control socket whose client key was allowed")
                           .Register(metrics.registry())
                           .Add({});
}

Result<std::unique_ptr<CurveAuthenticator>> CurveAuthenticator::create(zmq::context_t& ctx,
                                                                       const ControlSecurity& security,
                                                                       obs::Metrics& metrics) {
  if (!security.curve) return Status(ErrorCode::kInternal, "CurveAuthenticator without CURVE keys");
  std::unique_ptr<CurveAuthenticator> auth(new CurveAuthenticator(ctx, security, metrics));
  try {
    auth->zap_.set(zmq::sockopt::linger, 0);
    auth->zap_.bind(kZapEndpoint);
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kUnavailable, std::string("cannot bind the ZAP handler: ") + e.what());
  }
  return auth;
}

Status CurveAuthenticator::secure(zmq::socket_t& router) {
  if (thread_.joinable()) return Status(ErrorCode::kFailedPrecondition, "the control socket is secured already");
  try {
    const auto secret = protocol::z85_key_bytes(server_.secret_key, "daemon secret key");
    if (!secret.ok()) return secret.status();
    router.set(zmq::sockopt::curve_server, true);
    router.set(zmq::sockopt::curve_secretkey, zmq::buffer(secret->data(), secret->size()));
    router.set(zmq::sockopt::zap_domain, std::string(kControlZapDomain));
    // The handshakes that never reach ZAP (a plain client, a wrong server key) show only here.
    if (zmq_socket_monitor(router.handle(), kMonitorEndpoint,
                           ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0)
      return Status(ErrorCode::kUnavailable, std::string("cannot monitor the control socket: ") +
                                                 zmq_strerror(zmq_errno()));
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.connect(kMonitorEndpoint);
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kUnavailable, std::string("cannot make the control socket a CURVE server: ") + e.what());
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    return Status(ErrorCode::kResourceExhausted, std::string("cannot start the ZAP handler thread: ") + e.what());
  }
  obs::log_info("auth", "control socket requires CURVE",
                {{"curve_public_key", server_.public_key}, {"clients_allowed", num_allowed_}});
  return Status::Ok();
}

CurveAuthenticator::~CurveAuthenticator() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void CurveAuthenticator::run() {
  while (!stop_.load()) {
    zmq::pollitem_t items[] = {{zap_.handle(), 0, ZMQ_POLLIN, 0}, {monitor_.handle(), 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, kPollSlice);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      if (e.num() != EINTR) obs::log_error("auth", "poll failed", {{"error", e.what()}});
      continue;
    }
    try {
      if (items[0].revents & ZMQ_POLLIN) handle_zap_request();
      if (items[1].revents & ZMQ_POLLIN) handle_monitor_event();
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      obs::log_error("auth", "ZAP handler error", {{"error", e.what()}});
    }
  }
}

void CurveAuthenticator::deny(std::string_view reason, const nlohmann::json& fields) {
  denied_.fetch_add(1);
  if (auto it = denied_counters_.find(std::string(reason)); it != denied_counters_.end()) it->second->Increment();
  const auto now = std::chrono::steady_clock::now();
  if (last_denial_log_ != std::chrono::steady_clock::time_point{} && now - last_denial_log_ < kLogInterval) {
    ++denials_not_logged_;
    return;
  }
  nlohmann::json f = fields;
  f["reason"] = reason;
  if (denials_not_logged_ > 0) f["refusals_not_logged"] = denials_not_logged_;
  obs::log_warn("auth", "control connection refused", f);
  last_denial_log_ = now;
  denials_not_logged_ = 0;
}

void CurveAuthenticator::handle_zap_request() {
  // RFC 27 request: version, request id, domain, address, routing id, mechanism, credentials.
  std::vector<zmq::message_t> frames;
  zmq::message_t part;
  bool more = true;
  while (more) {
    if (!zap_.recv(part, zmq::recv_flags::dontwait)) return;  // spurious wakeup
    more = part.more();
    if (frames.size() < kMaxZapFrames) frames.push_back(std::move(part));
  }
  auto text = [&](size_t i) { return i < frames.size() ? frames[i].to_string() : std::string(); };
  const std::string request_id = text(1);
  auto reply = [&](const char* code, const std::string& why, const std::string& user) {
    // A REP socket must answer every request; a malformed one gets 500 and libzmq fails the handshake.
    zap_.send(zmq::str_buffer("1.0"), zmq::send_flags::sndmore);
    zap_.send(zmq::buffer(request_id), zmq::send_flags::sndmore);
    zap_.send(zmq::buffer(std::string_view(code)), zmq::send_flags::sndmore);
    zap_.send(zmq::buffer(why), zmq::send_flags::sndmore);
    zap_.send(zmq::buffer(user), zmq::send_flags::sndmore);
    zap_.send(zmq::message_t(), zmq::send_flags::none);  // no metadata
  };
  // Counted before the reply: whoever sees the outcome (a refused client) sees the count.
  const std::string address = text(3);
  if (frames.size() < 6 || text(0) != "1.0") {
    deny("bad_request", {{"peer", address}});
    reply("500", "malformed ZAP request", "");
    return;
  }
  if (text(2) != kControlZapDomain || text(5) != "CURVE" || frames.size() != 7 ||
      frames[6].size() != protocol::kCurveKeyBytes) {
    deny("bad_request", {{"peer", address}, {"domain", text(2)}, {"mechanism", text(5)}});
    reply("400", "only CURVE clients of the control socket are served", "");
    return;
  }
  const std::string key = frames[6].to_string();
  auto it = allowed_.find(key);
  if (it == allowed_.end()) {
    deny("unknown_key", {{"peer", address}, {"client_public_key", z85_of(key)}});
    reply("400", "client key not allowed", "");
    return;
  }
  accepted_.fetch_add(1);
  accepted_counter_->Increment();
  reply("200", "OK", it->second);
  obs::log_debug("auth", "control connection accepted", {{"peer", address}, {"client", it->second}});
}

void CurveAuthenticator::handle_monitor_event() {
  // Two frames: 6 bytes (uint16 event, uint32 value, host byte order), then the endpoint.
  zmq::message_t head, endpoint;
  if (!monitor_.recv(head, zmq::recv_flags::dontwait)) return;
  if (head.more()) (void)monitor_.recv(endpoint, zmq::recv_flags::dontwait);
  while (endpoint.more()) {  // nothing else is expected; keep the socket in step
    if (!monitor_.recv(endpoint, zmq::recv_flags::dontwait)) break;
  }
  if (head.size() < 6) return;
  uint16_t event = 0;
  uint32_t value = 0;
  std::memcpy(&event, head.data(), sizeof event);
  std::memcpy(&value, static_cast<const char*>(head.data()) + 2, sizeof value);
  // A ZAP refusal (FAILED_AUTH) is not subscribed to: it was counted when it was made.
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
    // A plain client often ends here rather than in the mismatch below: it sees the mismatch
    // first and resets the connection before the daemon has read its greeting. A port probe
    // ends here too.
    deny("handshake_aborted", {{"error", std::strerror(static_cast<int>(value))},
                               {"hint", "the peer left during the handshake: a client without CURVE keys, or a "
                                        "port probe"}});
    return;
  }
  if (event != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) return;
  char code[16];
  std::snprintf(code, sizeof code, "0x%08x", value);
  if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
    deny("not_curve", {{"protocol_error", code}, {"hint", "a client without CURVE keys"}});
  } else {
    deny("handshake_failed", {{"protocol_error", code}, {"hint", "a client with another server public key?"}});
  }
}

}  // namespace rolloutd::daemon
