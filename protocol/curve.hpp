#pragma once
// CURVE keys for the control socket (SPEC §1.2): Z85 text as zmq_curve_keypair makes it,
// key files in ZeroMQ's certificate format (what `rolloutctl keygen`, pyzmq's
// zmq.auth.create_certificates and czmq write), and what a client needs to connect to a
// daemon that requires CURVE. The daemon side (allowlist, ZAP handler) is
// daemon/security/control_auth.hpp.
//
// A certificate is a text file with lines `public-key = "<Z85>"` and, in the secret one,
// `secret-key = "<Z85>"`; other lines are ignored. A file holding one bare Z85 key (40
// characters on a line of its own) is accepted too.
#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/status.hpp"

namespace rolloutd::protocol {

inline constexpr size_t kCurveKeyZ85Chars = 40;  // a 32-byte key in Z85
inline constexpr size_t kCurveKeyBytes = 32;
// Key files are a few hundred bytes; anything much larger is not one (bounded read).
inline constexpr size_t kMaxCurveKeyFileBytes = 64 * 1024;

struct CurveKeyPair {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85
};

// What a client needs to connect to a daemon that requires CURVE.
struct CurveClientKeys {
  std::string server_public_key;  // the daemon's public key (Z85); empty: a plain connection
  CurveKeyPair client;            // this client's pair; its public key is in the daemon's allowlist
  bool enabled() const { return !server_public_key.empty(); }
};

// What a key file or text holds; either part may be empty.
struct CurveKeyText {
  std::string public_key;
  std::string secret_key;
};

// Whether this libzmq was built with CURVE (zmq_has("curve"): libsodium or tweetnacl).
bool curve_available();
// kUnimplemented with a message saying what to install when curve_available() is false.
Status require_curve();

// A key is 40 characters of the Z85 alphabet that decode to 32 bytes. `what` names the key
// in the error ("server public key").
Status check_z85_key(std::string_view z85, std::string_view what);
// The 32 raw bytes of a valid Z85 key (check_z85_key first).
Result<std::string> z85_key_bytes(std::string_view z85, std::string_view what);
std::string z85_encode_key(std::string_view raw32);

Result<CurveKeyPair> generate_curve_keypair();
Result<std::string> curve_public_from_secret(std::string_view z85_secret);

// Parses certificate text (see above). A bare key line counts as a secret key when
// `bare_is_secret`, else as a public key. Errors name the line.
Result<CurveKeyText> parse_curve_key_text(std::string_view text, bool bare_is_secret);
// Reads and parses a key file (at most kMaxCurveKeyFileBytes).
Result<CurveKeyText> read_curve_key_file(const std::string& path, bool bare_is_secret);

// A key pair from a secret certificate (or a file holding the bare secret key): the public
// key is derived from the secret one, and must match a public-key line if the file has one.
Result<CurveKeyPair> load_curve_keypair_file(const std::string& path);
// A key pair from a bare Z85 secret key (an environment variable).
Result<CurveKeyPair> curve_keypair_from_secret(std::string_view z85_secret);
// A public key given either as Z85 text or as the path of a (public or secret) certificate.
Result<std::string> load_curve_public_key(const std::string& z85_or_path);

// Certificate text for `keys`; with the secret line when `with_secret`.
std::string format_curve_certificate(const CurveKeyPair& keys, bool with_secret);

struct CurveKeyFiles {
  std::string public_path;  // <base>.key, mode 0644: goes into daemons' allowlists
  std::string secret_path;  // <base>.key_secret, mode 0600: stays with its owner
};
// Writes a new key pair as <base>.key and <base>.key_secret (pyzmq's naming), the secret one
// created with mode 0600. Refuses to overwrite either file unless `overwrite`.
Result<CurveKeyFiles> write_curve_keypair_files(const std::string& base, const CurveKeyPair& keys,
                                                bool overwrite);

// Client keys from the daemon's public key (Z85 text or a certificate path) and the client's
// secret certificate: what rolloutctl's --server-key / --client-key-file take.
Result<CurveClientKeys> load_curve_client_keys(const std::string& server_key,
                                               const std::string& client_key_file);
// Every key present and valid (the client's public key matches its secret key).
Status validate_curve_client_keys(const CurveClientKeys& keys);

}  // namespace rolloutd::protocol
