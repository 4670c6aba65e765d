#include "protocol/curve.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <zmq.h>

namespace rolloutd::protocol {
namespace {

constexpr std::string_view kZ85Alphabet =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

bool all_z85(std::string_view s) {
  for (char c : s)
    if (kZ85Alphabet.find(c) == std::string_view::npos) return false;
  return true;
}

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

// `public-key = "..."` -> the value without quotes; nullopt when the line is not `name =`.
std::optional<std::string_view> value_of(std::string_view line, std::string_view name) {
  if (line.substr(0, name.size()) != name) return std::nullopt;
  std::string_view rest = trim(line.substr(name.size()));
  if (rest.empty() || rest.front() != '=') return std::nullopt;
  rest = trim(rest.substr(1));
  if (rest.size() >= 2 && (rest.front() == '"' || rest.front() == '\'') && rest.back() == rest.front())
    rest = rest.substr(1, rest.size() - 2);
  return rest;
}

std::string errno_text() { return std::strerror(errno); }

// NOTES: plain POSIX calls, not <filesystem>/<fstream>: this file is linked into the Python
// extension, and there <filesystem> pulled a static copy of libstdc++'s runtime into the module
// on the GPU host, which then crashed torch imported after it ("free(): invalid pointer").
bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

Status write_all(int fd, const std::string& text, const std::string& path) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status(ErrorCode::kUnavailable, "cannot write " + path + ": " + errno_text(), "path");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return Status(ErrorCode::kUnavailable, "cannot sync " + path + ": " + errno_text(), "path");
  return Status::Ok();
}

// Creates `path` with `mode` (exclusively unless overwrite) through a temporary file and a
// rename, so a reader never sees half a key and a secret is never world-readable, not even
// for a moment (the mode is set at creation, and again explicitly against a permissive umask's
// opposite: a restrictive umask only removes bits).
Status write_key_file(const std::string& path, const std::string& text, mode_t mode, bool overwrite) {
  if (!overwrite && path_exists(path))
    return Status(ErrorCode::kFailedPrecondition, path + " exists (pass --force to replace it)", "path");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return Status(ErrorCode::kUnavailable, "cannot create " + tmp + ": " + errno_text(), "path");
  Status s = ::fchmod(fd, mode) == 0
                 ? write_all(fd, text, tmp)
                 : Status(ErrorCode::kUnavailable, "cannot chmod " + tmp + ": " + errno_text(), "path");
  ::close(fd);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    s = Status(ErrorCode::kUnavailable, "cannot rename " + tmp + " to " + path + ": " + errno_text(), "path");
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

}  // namespace

bool curve_available() { return zmq_has("curve") != 0; }

Status require_curve() {
  if (curve_available()) return Status::Ok();
  int major = 0, minor = 0, patch = 0;
  zmq_version(&major, &minor, &patch);
  return Status(ErrorCode::kUnimplemented,
                "this libzmq (" + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch) +
                    ") was built without CURVE security (zmq_has(\"curve\") is false); install a libzmq built "
                    "with libsodium (Debian's libzmq5 is)");
}

Status check_z85_key(std::string_view z85, std::string_view what) {
  if (z85.size() != kCurveKeyZ85Chars)
    return Status(ErrorCode::kInvalidArgument,
                  std::string(what) + " must be " + std::to_string(kCurveKeyZ85Chars) + " Z85 characters, got " +
                      std::to_string(z85.size()));
  if (!all_z85(z85))
    return Status(ErrorCode::kInvalidArgument, std::string(what) + " has a character outside the Z85 alphabet");
  return Status::Ok();
}

Result<std::string> z85_key_bytes(std::string_view z85, std::string_view what) {
  RD_RETURN_IF_ERROR(check_z85_key(z85, what));
  const std::string text(z85);  // zmq_z85_decode reads a NUL-terminated string
  std::array<uint8_t, kCurveKeyBytes> raw{};
  if (zmq_z85_decode(raw.data(), text.c_str()) == nullptr)
    return Status(ErrorCode::kInvalidArgument, std::string(what) + " is not valid Z85");
  return std::string(reinterpret_cast<const char*>(raw.data()), raw.size());
}

std::string z85_encode_key(std::string_view raw32) {
  std::array<char, kCurveKeyZ85Chars + 1> out{};
  if (raw32.size() != kCurveKeyBytes ||
      zmq_z85_encode(out.data(), reinterpret_cast<const uint8_t*>(raw32.data()), raw32.size()) == nullptr)
    return {};
  return std::string(out.data(), kCurveKeyZ85Chars);
}

Result<CurveKeyPair> generate_curve_keypair() {
  RD_RETURN_IF_ERROR(require_curve());
  std::array<char, kCurveKeyZ85Chars + 1> pub{}, sec{};
  if (zmq_curve_keypair(pub.data(), sec.data()) != 0)
    return Status(ErrorCode::kInternal, std::string("zmq_curve_keypair failed: ") + zmq_strerror(zmq_errno()));
  return CurveKeyPair{std::string(pub.data(), kCurveKeyZ85Chars), std::string(sec.data(), kCurveKeyZ85Chars)};
}

Result<std::string> curve_public_from_secret(std::string_view z85_secret) {
  RD_RETURN_IF_ERROR(require_curve());
  RD_RETURN_IF_ERROR(z85_key_bytes(z85_secret, "secret key").status());
  const std::string secret(z85_secret);
  std::array<char, kCurveKeyZ85Chars + 1> pub{};
  if (zmq_curve_public(pub.data(), secret.c_str()) != 0)
    return Status(ErrorCode::kInvalidArgument,
                  std::string("cannot derive the public key: ") + zmq_strerror(zmq_errno()));
  return std::string(pub.data(), kCurveKeyZ85Chars);
}

Result<CurveKeyText> parse_curve_key_text(std::string_view text, bool bare_is_secret) {
  CurveKeyText out;
  size_t line_no = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = trim(text.substr(start, end - start));
    start = end + 1;
    ++line_no;
    const std::string where = "line " + std::to_string(line_no);
    std::string* slot = nullptr;
    std::string_view value;
    // A bare key first: Z85 has '#' and '=' in its alphabet, so a key may look like a comment.
    if (line.size() == kCurveKeyZ85Chars && all_z85(line)) {
      slot = bare_is_secret ? &out.secret_key : &out.public_key;
      value = line;
    } else if (line.empty() || line.front() == '#') {
      continue;
    } else if (auto v = value_of(line, "public-key")) {
      slot = &out.public_key;
      value = *v;
    } else if (auto s = value_of(line, "secret-key")) {
      slot = &out.secret_key;
      value = *s;
    } else {
      continue;  // "metadata", "curve", other certificate properties
    }
    if (!slot->empty())
      return Status(ErrorCode::kInvalidArgument, where + ": a second " +
                                                     (slot == &out.secret_key ? "secret" : "public") + " key");
    Status s = check_z85_key(value, slot == &out.secret_key ? "secret key" : "public key");
    if (!s.ok()) return Status(s.code(), where + ": " + s.message());
    *slot = std::string(value);
  }
  if (out.public_key.empty() && out.secret_key.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "no CURVE key found (expected `public-key = \"<40 Z85 chars>\"` / `secret-key = ...` lines, "
                  "or one bare Z85 key)");
  return out;
}

Result<CurveKeyText> read_curve_key_file(const std::string& path, bool bare_is_secret) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return Status(errno == ENOENT ? ErrorCode::kNotFound : ErrorCode::kUnavailable,
                  "cannot read key file " + path + ": " + errno_text(), "path");
  // One byte more than the bound tells a file that is too large from one that just fits.
  std::string text(kMaxCurveKeyFileBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = errno_text();
      ::close(fd);
      return Status(ErrorCode::kUnavailable, "cannot read key file " + path + ": " + why, "path");
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  if (text.size() > kMaxCurveKeyFileBytes)
    return Status(ErrorCode::kTooLarge,
                  "key file " + path + " is larger than " + std::to_string(kMaxCurveKeyFileBytes) + " bytes", "path");
  auto parsed = parse_curve_key_text(text, bare_is_secret);
  if (!parsed.ok()) return Status(parsed.status().code(), path + ": " + parsed.status().message(), "path");
  return parsed;
}

Result<CurveKeyPair> curve_keypair_from_secret(std::string_view z85_secret) {
  RD_ASSIGN_OR_RETURN(std::string pub, curve_public_from_secret(z85_secret));
  return CurveKeyPair{std::move(pub), std::string(z85_secret)};
}

Result<CurveKeyPair> load_curve_keypair_file(const std::string& path) {
  RD_ASSIGN_OR_RETURN(CurveKeyText text, read_curve_key_file(path, /*bare_is_secret=*/true));
  if (text.secret_key.empty())
    return Status(ErrorCode::kInvalidArgument,
                  path + " holds no secret key: give the secret certificate (<name>.key_secret), not the public "
                         "one",
                  "path");
  auto pair = curve_keypair_from_secret(text.secret_key);
  if (!pair.ok()) return Status(pair.status().code(), path + ": " + pair.status().message(), "path");
  if (!text.public_key.empty() && text.public_key != pair->public_key)
    return Status(ErrorCode::kInvalidArgument, path + ": its public-key line does not belong to its secret key",
                  "path");
  return pair;
}

Result<std::string> load_curve_public_key(const std::string& z85_or_path) {
  if (z85_or_path.size() == kCurveKeyZ85Chars && all_z85(z85_or_path)) {
    RD_RETURN_IF_ERROR(z85_key_bytes(z85_or_path, "public key").status());
    return z85_or_path;
  }
  RD_ASSIGN_OR_RETURN(CurveKeyText text, read_curve_key_file(z85_or_path, /*bare_is_secret=*/false));
  if (!text.public_key.empty()) return text.public_key;
  return curve_public_from_secret(text.secret_key);  // a secret certificate without a public line
}

std::string format_curve_certificate(const CurveKeyPair& keys, bool with_secret) {
  std::string out =
      "#   ****  Generated by rolloutctl keygen  ****\n"
      "#   ZeroMQ CURVE " +
      std::string(with_secret ? "**Secret** Certificate\n"
                                "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n"
                              : "Public Certificate\n"
                                "#   Exchange securely, or upload to a secure location.\n") +
      "\nmetadata\ncurve\n    public-key = \"" + keys.public_key + "\"\n";
  if (with_secret) out += "    secret-key = \"" + keys.secret_key + "\"\n";
  return out;
}

Result<CurveKeyFiles> write_curve_keypair_files(const std::string& base, const CurveKeyPair& keys,
                                                bool overwrite) {
  if (base.empty()) return Status(ErrorCode::kInvalidArgument, "an output path is needed", "path");
  CurveKeyFiles files{base + ".key", base + ".key_secret"};
  if (!overwrite)
    for (const auto* p : {&files.public_path, &files.secret_path})
      if (path_exists(*p))
        return Status(ErrorCode::kFailedPrecondition, *p + " exists (pass --force to replace it)", "path");
  // The secret first: a public file without its secret would be an orphan.
  RD_RETURN_IF_ERROR(write_key_file(files.secret_path, format_curve_certificate(keys, true), 0600, overwrite));
  RD_RETURN_IF_ERROR(write_key_file(files.public_path, format_curve_certificate(keys, false), 0644, overwrite));
  return files;
}

Result<CurveClientKeys> load_curve_client_keys(const std::string& server_key, const std::string& client_key_file) {
  if (server_key.empty() != client_key_file.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "CURVE needs both the daemon's public key and this client's secret key file",
                  server_key.empty() ? "server_key" : "client_key_file");
  CurveClientKeys keys;
  if (server_key.empty()) return keys;
  RD_RETURN_IF_ERROR(require_curve());
  auto server = load_curve_public_key(server_key);
  if (!server.ok()) return Status(server.status().code(), "server key: " + server.status().message(), "server_key");
  auto client = load_curve_keypair_file(client_key_file);
  if (!client.ok())
    return Status(client.status().code(), "client key: " + client.status().message(), "client_key_file");
  keys.server_public_key = std::move(*server);
  keys.client = std::move(*client);
  return keys;
}

Status validate_curve_client_keys(const CurveClientKeys& keys) {
  if (!keys.enabled()) return Status::Ok();
  RD_RETURN_IF_ERROR(require_curve());
  auto field = [](Status s, const char* f) { return s.ok() ? s : Status(s.code(), s.message(), f); };
  RD_RETURN_IF_ERROR(field(z85_key_bytes(keys.server_public_key, "server public key").status(), "curve_server_key"));
  RD_RETURN_IF_ERROR(field(z85_key_bytes(keys.client.public_key, "client public key").status(), "curve_public_key"));
  auto derived = curve_public_from_secret(keys.client.secret_key);
  if (!derived.ok()) return field(derived.status(), "curve_secret_key");
  if (*derived != keys.client.public_key)
    return Status(ErrorCode::kInvalidArgument, "the client public key does not belong to the client secret key",
                  "curve_public_key");
  return Status::Ok();
}

}  // namespace rolloutd::protocol
