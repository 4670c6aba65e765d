// core/model/safetensors: header validation on hand-built (and hand-broken) files, the
// memory-mapped reader, sharded checkpoints, and the writer round trip.
#include "core/model/safetensors.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

namespace rolloutd {
namespace {

using core::parse_safetensors;

std::vector<uint8_t> file_of(const std::string& header, size_t data_bytes, uint64_t declared_len = UINT64_MAX) {
  const uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<uint8_t> f(8);
  for (int i = 0; i < 8; ++i) f[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  f.insert(f.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) f.push_back(static_cast<uint8_t>(i));
  return f;
}

Status parse(const std::string& header, size_t data_bytes) {
  return parse_safetensors(file_of(header, data_bytes)).status();
}

TEST(Safetensors, ParsesAValidHeader) {
  const std::string h =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
      R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"s":{"dtype":"I64","shape":[],"data_offsets":[28,36]},)"
      R"("z":{"dtype":"U8","shape":[0,5],"data_offsets":[36,36]}}   )";
  auto r = parse_safetensors(file_of(h, 36));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->tensors.size(), 4u);
  EXPECT_EQ(r->tensors[0].name, "a");  // data-section order
  EXPECT_EQ(r->tensors[1].name, "b");
  EXPECT_EQ(r->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(r->tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r->tensors[2].shape.size(), 0u);  // a scalar
  EXPECT_EQ(r->metadata.at("format"), "pt");
  EXPECT_EQ(r->data_offset, 8 + h.size());
  EXPECT_EQ(r->data_size, 36u);
  EXPECT_NE(r->find("z"), nullptr);
}

struct Bad {
  const char* what;
  std::string header;
  size_t data;
  ErrorCode code;
  std::string field;
};

TEST(Safetensors, RefusesMalformedHeadersNamingTheTensor) {
  const auto code = ErrorCode::kInvalidArgument;
  const std::vector<Bad> cases = {
      {"not json", "{\"a\":", 0, code, "header"},
      {"not an object", "[1,2]", 0, code, "header"},
      {"not starting with {", " {}", 0, code, "header"},
      {"entry not an object", R"({"w":[1]})", 0, code, "w"},
      {"unknown dtype", R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1, code, "w"},
      {"unsupported dtype", R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
       ErrorCode::kUnimplemented, "w"},
      {"missing shape", R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4, code, "w"},
      {"negative dim", R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, code, "w"},
      {"float dim", R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4, code, "w"},
      {"dim over 2^40", R"({"w":{"dtype":"U8","shape":[1099511627777],"data_offsets":[0,1]}})", 1, code, "w"},
      {"too many dims", R"({"w":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1, code, "w"},
      {"size overflows", R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})", 4,
       code, "w"},
      {"size mismatch", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 8, code, "w"},
      {"begin > end", R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 8, code, "w"},
      {"offsets not a pair", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1, code, "w"},
      {"end past data", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 15, code, "w"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, code, "b"},
      {"unknown entry key", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1, code, "w"},
      {"duplicate tensor",
       R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
       2, code, "header"},
      {"duplicate key in entry", R"({"w":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", 1, code,
       "header"},
      {"nested too deep", R"({"w":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", 1, code, "header"},
      {"metadata not strings", R"({"__metadata__":{"a":1}})", 0, code, "__metadata__"},
      {"metadata not an object", R"({"__metadata__":"x"})", 0, code, "__metadata__"},
      {"empty name", R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, code, "header"},
  };
  for (const auto& c : cases) {
    const Status s = parse(c.header, c.data);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s.to_string();
    EXPECT_EQ(s.field(), c.field) << c.what << ": " << s.to_string();
  }
}

TEST(Safetensors, RefusesBadLengths) {
  EXPECT_FALSE(parse_safetensors(std::vector<uint8_t>{1, 2, 3}).ok()) << "shorter than 8 bytes";
  const std::string h = R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  // The declared length runs past the file.
  auto past = file_of(h, 1, h.size() + 2);
  EXPECT_NE(parse_safetensors(past).status().message().find("past the end"), std::string::npos);
  // Over the 100 MB bound: refused before anything is read or allocated.
  auto huge = file_of(h, 1, core::kMaxSafetensorsHeaderBytes + 1);
  EXPECT_NE(parse_safetensors(huge).status().message().find("exceeds the limit"), std::string::npos);
  auto max = file_of(h, 1, UINT64_MAX - 1);
  EXPECT_FALSE(parse_safetensors(max).ok());
  EXPECT_FALSE(parse_safetensors(file_of("", 0)).ok()) << "empty header";
}

class SafetensorsFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("rolloutd-st-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& f) const { return (dir_ / f).string(); }
  void write(const std::string& f, const std::string& text) const { std::ofstream(path(f)) << text; }
  std::filesystem::path dir_;
};

TEST_F(SafetensorsFiles, WriterRoundTripsThroughTheMappedReader) {
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  std::vector<uint8_t> b = {7, 8, 9};
  const core::SafetensorsTensorIn in[] = {
      {"a", DType::kF32, {2, 3}, {reinterpret_cast<const uint8_t*>(a.data()), a.size() * 4}},
      {"b", DType::kU8, {3}, b},
  };
  ASSERT_TRUE(core::write_safetensors(path("model.safetensors"), in, {{"format", "pt"}}).ok());
  auto f = core::SafetensorsFile::open(path("model.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->header().data_offset % 8, 0u) << "header padded to 8 bytes";
  const auto* e = (*f)->header().find("a");
  ASSERT_NE(e, nullptr);
  auto bytes = (*f)->data(*e);
  ASSERT_EQ(bytes.size(), 24u);
  EXPECT_EQ(std::memcmp(bytes.data(), a.data(), 24), 0);
  EXPECT_EQ((*f)->data(*(*f)->header().find("b"))[2], 9);

  auto c = core::SafetensorsCheckpoint::open(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ((*c)->tensors().size(), 2u);
  EXPECT_EQ((*c)->total_bytes(), 27u);
}

TEST_F(SafetensorsFiles, MissingAndTruncatedFiles) {
  EXPECT_EQ(core::SafetensorsFile::open(path("nope.safetensors")).status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(core::SafetensorsCheckpoint::open(dir_.string()).status().code(), ErrorCode::kNotFound);
  std::vector<uint8_t> x(100, 1);
  const core::SafetensorsTensorIn in[] = {{"w", DType::kU8, {100}, x}};
  ASSERT_TRUE(core::write_safetensors(path("model.safetensors"), in).ok());
  std::filesystem::resize_file(path("model.safetensors"), std::filesystem::file_size(path("model.safetensors")) - 1);
  auto r = core::SafetensorsFile::open(path("model.safetensors"));
  EXPECT_EQ(r.status().field(), "w") << r.status().to_string();
  EXPECT_NE(r.status().message().find(path("model.safetensors")), std::string::npos) << "names the file";
}

TEST_F(SafetensorsFiles, ShardedCheckpoint) {
  std::vector<uint8_t> x(4, 1), y(8, 2);
  const core::SafetensorsTensorIn s1[] = {{"x", DType::kU8, {4}, x}};
  const core::SafetensorsTensorIn s2[] = {{"y", DType::kU16, {4}, y}};
  ASSERT_TRUE(core::write_safetensors(path("m-1.safetensors"), s1).ok());
  ASSERT_TRUE(core::write_safetensors(path("m-2.safetensors"), s2).ok());
  write("model.safetensors.index.json",
        R"({"metadata":{"total_size":12},"weight_map":{"x":"m-1.safetensors","y":"m-2.safetensors"}})");
  auto c = core::SafetensorsCheckpoint::open(dir_.string());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ((*c)->num_files(), 2u);
  ASSERT_NE((*c)->find("y"), nullptr);
  EXPECT_EQ((*c)->data(*(*c)->find("y")).size(), 8u);

  // Index and shards disagree: each refusal names the tensor.
  write("model.safetensors.index.json", R"({"weight_map":{"x":"m-2.safetensors","y":"m-2.safetensors"}})");
  EXPECT_EQ(core::SafetensorsCheckpoint::open(dir_.string()).status().field(), "x");
  write("model.safetensors.index.json", R"({"weight_map":{"x":"m-1.safetensors"}})");
  EXPECT_TRUE(core::SafetensorsCheckpoint::open(dir_.string()).ok()) << "a subset of the shards";
  write("model.safetensors.index.json", R"({"weight_map":{"y":"m-1.safetensors"}})");
  EXPECT_FALSE(core::SafetensorsCheckpoint::open(dir_.string()).ok()) << "shard holds x, not listed";
  write("model.safetensors.index.json", R"({"weight_map":{"x":"../m-1.safetensors"}})");
  EXPECT_EQ(core::SafetensorsCheckpoint::open(dir_.string()).status().field(), "x") << "path outside the directory";
  write("model.safetensors.index.json", R"({"weight_map":{"x":"m-3.safetensors"}})");
  EXPECT_EQ(core::SafetensorsCheckpoint::open(dir_.string()).status().code(), ErrorCode::kNotFound);
  write("model.safetensors.index.json", R"({"weights":{}})");
  EXPECT_EQ(core::SafetensorsCheckpoint::open(dir_.string()).status().field(), "weight_map");
}

}  // namespace
}  // namespace rolloutd
