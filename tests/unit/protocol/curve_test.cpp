// protocol/curve.cpp: Z85 keys, certificate text and files, client key validation.
#include "protocol/curve.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace rolloutd::protocol {
namespace {

namespace fs = std::filesystem;

// The key pair of ZeroMQ's RFC 26 test vectors (curve_keygen's documentation): fixed, so the
// derivation is checked against an independent implementation, not against itself.
constexpr const char* kRfcPublic = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID";
constexpr const char* kRfcSecret = "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs";

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "rolloutd-curve-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(CurveTest, ThisLibzmqHasCurve) {
  // Debian's libzmq5 is built with libsodium; the daemon refuses keys without it.
  ASSERT_TRUE(curve_available());
  EXPECT_TRUE(require_curve().ok());
}

TEST(CurveTest, Z85KeysAreFortyCharactersOfTheAlphabet) {
  EXPECT_TRUE(check_z85_key(kRfcPublic, "k").ok());
  EXPECT_EQ(check_z85_key(std::string(kRfcPublic).substr(1), "k").code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(check_z85_key(std::string(kRfcPublic) + "x", "k").code(), ErrorCode::kInvalidArgument);
  std::string bad = kRfcPublic;
  bad[3] = ' ';
  EXPECT_EQ(check_z85_key(bad, "server key").code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(check_z85_key(bad, "server key").message().find("server key"), std::string::npos);
  auto raw = z85_key_bytes(kRfcPublic, "k");
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->size(), kCurveKeyBytes);
  EXPECT_EQ(z85_encode_key(*raw), kRfcPublic);
  EXPECT_EQ(z85_encode_key("short"), "");
}

TEST(CurveTest, PublicKeyIsDerivedFromTheSecretOne) {
  auto pub = curve_public_from_secret(kRfcSecret);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  EXPECT_EQ(*pub, kRfcPublic);
  auto pair = generate_curve_keypair();
  ASSERT_TRUE(pair.ok());
  EXPECT_NE(pair->public_key, pair->secret_key);
  auto again = curve_public_from_secret(pair->secret_key);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, pair->public_key);
  EXPECT_FALSE(curve_public_from_secret("not a key").ok());
}

TEST(CurveTest, CertificateTextRoundTrips) {
  const CurveKeyPair keys{kRfcPublic, kRfcSecret};
  auto secret = parse_curve_key_text(format_curve_certificate(keys, true), true);
  ASSERT_TRUE(secret.ok()) << secret.status().to_string();
  EXPECT_EQ(secret->public_key, kRfcPublic);
  EXPECT_EQ(secret->secret_key, kRfcSecret);
  auto pub = parse_curve_key_text(format_curve_certificate(keys, false), true);
  ASSERT_TRUE(pub.ok());
  EXPECT_EQ(pub->public_key, kRfcPublic);
  EXPECT_TRUE(pub->secret_key.empty());
  EXPECT_EQ(format_curve_certificate(keys, false).find(kRfcSecret), std::string::npos);
}

TEST(CurveTest, CertificatesOfOtherToolsAndBareKeysParse) {
  // czmq / pyzmq layout, single quotes, a bare key that starts with '#' (Z85 has '#').
  auto czmq = parse_curve_key_text(
      "#   ****  Generated on 2024-01-01 by pyzmq  ****\n#   ZeroMQ CURVE Public Certificate\n\nmetadata\n"
      "curve\n    public-key = '" + std::string(kRfcPublic) + "'\n", false);
  ASSERT_TRUE(czmq.ok()) << czmq.status().to_string();
  EXPECT_EQ(czmq->public_key, kRfcPublic);
  const std::string hash_key = "#" + std::string(kRfcPublic).substr(1);
  auto bare = parse_curve_key_text("\n  " + hash_key + "  \n", false);
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->public_key, hash_key);
  auto bare_secret = parse_curve_key_text(std::string(kRfcSecret) + "\n", true);
  ASSERT_TRUE(bare_secret.ok());
  EXPECT_EQ(bare_secret->secret_key, kRfcSecret);
  EXPECT_TRUE(bare_secret->public_key.empty());
}

TEST(CurveTest, MalformedKeyTextIsRefusedWithTheLine) {
  EXPECT_FALSE(parse_curve_key_text("", false).ok());
  EXPECT_FALSE(parse_curve_key_text("# only a comment\nmetadata\n", false).ok());
  auto short_key = parse_curve_key_text("curve\n  public-key = \"abc\"\n", false);
  ASSERT_FALSE(short_key.ok());
  EXPECT_NE(short_key.status().message().find("line 2"), std::string::npos);
  auto twice = parse_curve_key_text(std::string(kRfcPublic) + "\n" + kRfcPublic + "\n", false);
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("second"), std::string::npos);
}

TEST(CurveTest, KeygenFilesHaveTheRightModesAndRefuseToOverwrite) {
  TempDir dir;
  const std::string base = dir.file("trainer");
  auto keys = generate_curve_keypair();
  ASSERT_TRUE(keys.ok());
  ::umask(0);  // the secret must be 0600 whatever the umask says
  auto files = write_curve_keypair_files(base, *keys, false);
  ::umask(022);
  ASSERT_TRUE(files.ok()) << files.status().to_string();
  EXPECT_EQ(files->public_path, base + ".key");
  EXPECT_EQ(files->secret_path, base + ".key_secret");
  struct stat st {};
  ASSERT_EQ(::stat(files->secret_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(files->public_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);

  auto pair = load_curve_keypair_file(files->secret_path);
  ASSERT_TRUE(pair.ok()) << pair.status().to_string();
  EXPECT_EQ(pair->public_key, keys->public_key);
  EXPECT_EQ(pair->secret_key, keys->secret_key);
  auto pub = load_curve_public_key(files->public_path);
  ASSERT_TRUE(pub.ok());
  EXPECT_EQ(*pub, keys->public_key);
  auto from_secret_file = load_curve_public_key(files->secret_path);
  ASSERT_TRUE(from_secret_file.ok());
  EXPECT_EQ(*from_secret_file, keys->public_key);

  auto again = write_curve_keypair_files(base, *keys, false);
  EXPECT_EQ(again.status().code(), ErrorCode::kFailedPrecondition);
  auto other = generate_curve_keypair();
  ASSERT_TRUE(write_curve_keypair_files(base, *other, true).ok());
  EXPECT_EQ(load_curve_keypair_file(files->secret_path)->public_key, other->public_key);
}

TEST(CurveTest, KeyPairFilesAreChecked) {
  TempDir dir;
  // The public certificate is not a key pair.
  write(dir.file("pub.key"), format_curve_certificate({kRfcPublic, kRfcSecret}, false));
  auto no_secret = load_curve_keypair_file(dir.file("pub.key"));
  ASSERT_FALSE(no_secret.ok());
  EXPECT_NE(no_secret.status().message().find("key_secret"), std::string::npos);
  // A public-key line that does not belong to the secret key.
  auto other = generate_curve_keypair();
  write(dir.file("mixed.key_secret"),
        "curve\n  public-key = \"" + other->public_key + "\"\n  secret-key = \"" + std::string(kRfcSecret) + "\"\n");
  EXPECT_EQ(load_curve_keypair_file(dir.file("mixed.key_secret")).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(load_curve_keypair_file(dir.file("missing")).status().code(), ErrorCode::kNotFound);
  // Bounded read: a huge file is not a key file.
  write(dir.file("big"), std::string(kMaxCurveKeyFileBytes + 10, 'a'));
  EXPECT_EQ(load_curve_keypair_file(dir.file("big")).status().code(), ErrorCode::kTooLarge);
  // A bare secret key on its own.
  write(dir.file("bare"), std::string(kRfcSecret) + "\n");
  auto bare = load_curve_keypair_file(dir.file("bare"));
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->public_key, kRfcPublic);
}

TEST(CurveTest, ClientKeysNeedBothPartsAndAMatchingPair) {
  TempDir dir;
  auto keys = generate_curve_keypair();
  auto files = write_curve_keypair_files(dir.file("c"), *keys, false);
  ASSERT_TRUE(files.ok());
  auto none = load_curve_client_keys("", "");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->enabled());
  EXPECT_EQ(load_curve_client_keys(kRfcPublic, "").status().field(), "client_key_file");
  EXPECT_EQ(load_curve_client_keys("", files->secret_path).status().field(), "server_key");
  auto ok = load_curve_client_keys(kRfcPublic, files->secret_path);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_TRUE(ok->enabled());
  EXPECT_EQ(ok->server_public_key, kRfcPublic);
  EXPECT_TRUE(validate_curve_client_keys(*ok).ok());

  CurveClientKeys wrong = *ok;
  wrong.client.public_key = kRfcPublic;  // not the pair's
  EXPECT_EQ(validate_curve_client_keys(wrong).field(), "curve_public_key");
  wrong = *ok;
  wrong.server_public_key = "too short";
  EXPECT_EQ(validate_curve_client_keys(wrong).field(), "curve_server_key");
  EXPECT_TRUE(validate_curve_client_keys(CurveClientKeys{}).ok());
}

}  // namespace
}  // namespace rolloutd::protocol
