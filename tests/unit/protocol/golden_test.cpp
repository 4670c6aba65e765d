// The golden files of protocol/golden/ were written by Python's msgpack from dict
// literals (make_golden.py). Decoding each with the C++ codec and re-encoding it
// must give the same bytes: that pins key order, integer widths, float64, nil
// handling and payload frames to an implementation the C++ encoder did not write.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "protocol/codec.hpp"

namespace rolloutd::protocol {
namespace {

namespace fs = std::filesystem;

fs::path golden_dir() {
  const char* root = std::getenv("ROLLOUTD_SOURCE_ROOT");
  return fs::path(root ? root : ".") / "protocol" / "golden";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << p << " (is ROLLOUTD_SOURCE_ROOT set? ctest sets it)";
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

Frame as_frame(const std::string& s) {
  return Frame(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

struct Golden {
  std::string envelope;
  std::vector<std::string> frames;
  std::vector<Frame> frame_views() const {
    std::vector<Frame> v;
    for (const auto& f : frames) v.push_back(as_frame(f));
    return v;
  }
};

Golden load(const std::string& name) {
  Golden g;
  g.envelope = read_file(golden_dir() / (name + ".msgpack"));
  for (int i = 0;; ++i) {
    const fs::path p = golden_dir() / (name + ".frame" + std::to_string(i) + ".bin");
    if (!fs::exists(p)) break;
    g.frames.push_back(read_file(p));
  }
  return g;
}

// Every golden and the message type it holds. GoldenSet.NoneUntested keeps this
// list and the directory in step.
struct Case {
  const char* name;
  const char* type;
};
constexpr Case kGoldens[] = {
    {"hello", "hello"},
    {"status", "status"},
    {"generate", "generate"},
    {"generate_greedy", "generate"},
    {"abort", "abort"},
    {"abort_all", "abort"},
    {"shutdown", "shutdown"},
    {"hello_ok", "hello.ok"},
    {"status_ok", "status.ok"},
    {"generate_ok", "generate.ok"},
    {"abort_ok", "abort.ok"},
    {"shutdown_ok", "shutdown.ok"},
    {"error", "error"},
    {"tokens_uint8", "tokens"},
    {"tokens_uint16", "tokens"},
    {"tokens_no_rows", "tokens"},
    {"tokens_plain", "tokens"},
    {"finished", "finished"},
    {"finished_abort", "finished"},
    {"failed", "failed"},
};

bool is_request_type(std::string_view t) {
  return t == "hello" || t == "status" || t == "generate" || t == "abort" || t == "shutdown";
}

WireMessage reencode(uint64_t id, const Incoming& msg) {
  return std::visit(
      [&](const auto& m) -> WireMessage {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ErrorInfo>)
          return encode_error(id, m);
        else if constexpr (std::is_same_v<T, TokensEvent> || std::is_same_v<T, FinishedEvent> ||
                           std::is_same_v<T, FailedEvent>)
          return encode_event(id, Event(m));
        else
          return encode_reply(id, m);
      },
      msg);
}

class GoldenRoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(GoldenRoundTrip, DecodesAndReencodesIdentically) {
  const Case c = GetParam();
  const Golden g = load(c.name);
  const auto frames = g.frame_views();
  WireMessage again;
  if (is_request_type(c.type)) {
    const RequestDecodeResult r = decode_request(as_frame(g.envelope), frames, Limits{});
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(r.env.type, c.type);
    again = encode_request(r.env.id, *r.request);
  } else {
    const auto r = decode_incoming(as_frame(g.envelope), frames, Limits{});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->env.type, c.type);
    again = reencode(r->env.id, r->msg);
  }
  EXPECT_EQ(again.envelope, g.envelope) << "re-encoding " << c.name << " changed its bytes";
  EXPECT_EQ(again.frames, g.frames);
}

INSTANTIATE_TEST_SUITE_P(Protocol, GoldenRoundTrip, ::testing::ValuesIn(kGoldens),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(GoldenSet, NoneUntested) {
  std::set<std::string> listed;
  for (const Case& c : kGoldens) listed.insert(c.name);
  for (const auto& entry : fs::directory_iterator(golden_dir())) {
    const std::string file = entry.path().filename().string();
    if (entry.path().extension() != ".msgpack" || file.rfind("bad_", 0) == 0) continue;
    EXPECT_TRUE(listed.count(entry.path().stem().string())) << file << " is not in kGoldens";
  }
}

// Round trips alone would pass a codec that swapped two fields of one type
// consistently; these check that values land where SPEC says.
TEST(GoldenValues, Generate) {
  const Golden g = load("generate");
  const RequestDecodeResult r = decode_request(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.env.id, 3u);
  const auto& req = std::get<GenerateRequest>(*r.request);
  EXPECT_EQ(req.rid, "rollout-0007");
  EXPECT_EQ(req.input_ids, (std::vector<int32_t>{1, 17, 300, 0, 511, 128, 255, 256}));
  EXPECT_EQ(req.max_new_tokens, 64u);
  EXPECT_EQ(req.temperature, 0.7);
  EXPECT_EQ(req.top_p, 0.95);
  EXPECT_EQ(req.top_k, 40);
  EXPECT_EQ(req.min_p, 0.05);
  EXPECT_EQ(req.seed, std::optional<uint64_t>(UINT64_MAX));
  EXPECT_EQ(req.stop_token_ids, (std::vector<int32_t>{2, 70000}));
  EXPECT_TRUE(req.return_logprob);
  EXPECT_TRUE(req.return_routed_experts);
  EXPECT_EQ(req.routed_experts_start_len, 3u);
  EXPECT_TRUE(req.stream);

  const Golden greedy = load("generate_greedy");
  const RequestDecodeResult r2 = decode_request(as_frame(greedy.envelope), {}, Limits{});
  ASSERT_TRUE(r2.status.ok()) << r2.status.to_string();
  EXPECT_FALSE(std::get<GenerateRequest>(*r2.request).seed.has_value());
  EXPECT_FALSE(std::get<GenerateRequest>(*r2.request).stream);
}

TEST(GoldenValues, AbortAllHasNoRid) {
  const Golden g = load("abort_all");
  const RequestDecodeResult r = decode_request(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& a = std::get<AbortRequest>(*r.request);
  EXPECT_FALSE(a.rid.has_value());
  EXPECT_TRUE(a.all);
}

TEST(GoldenValues, HelloOkAdvertisesDefaultLimits) {
  const Golden g = load("hello_ok");
  const auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& h = std::get<HelloReply>(r->msg);
  EXPECT_EQ(h.gpu, -1);
  EXPECT_EQ(h.model.routed_experts_dtype, "uint8");
  // SPEC §9's defaults table, the golden and messages.hpp must agree.
  const Limits d;
  EXPECT_EQ(h.limits.max_envelope_bytes, d.max_envelope_bytes);
  EXPECT_EQ(h.limits.max_frame_bytes, d.max_frame_bytes);
  EXPECT_EQ(h.limits.max_frames, d.max_frames);
  EXPECT_EQ(h.limits.max_rid_bytes, d.max_rid_bytes);
  EXPECT_EQ(h.limits.max_string_bytes, d.max_string_bytes);
  EXPECT_EQ(h.limits.max_input_tokens, d.max_input_tokens);
  EXPECT_EQ(h.limits.max_new_tokens, d.max_new_tokens);
  EXPECT_EQ(h.limits.max_stop_token_ids, d.max_stop_token_ids);
  EXPECT_EQ(h.limits.max_versions, d.max_versions);
}

TEST(GoldenValues, RoutedExpertsAreLittleEndianRows) {
  const Golden g = load("tokens_uint16");
  const auto frames = g.frame_views();
  const auto r = decode_incoming(as_frame(g.envelope), frames, Limits{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& t = std::get<TokensEvent>(r->msg);
  ASSERT_TRUE(t.routed_experts.has_value());
  const RoutedExperts& re = *t.routed_experts;
  EXPECT_EQ(re.dtype, "uint16");
  ASSERT_EQ(re.data.size(), size_t{3} * 3 * 2 * 2);
  // Row [token 0, layer 1] = {259, 40000}: element 2 and 3, bytes in LE order.
  const auto* b = reinterpret_cast<const uint8_t*>(re.data.data());
  EXPECT_EQ(b[4] | (b[5] << 8), 259);
  EXPECT_EQ(b[6] | (b[7] << 8), 40000);
  EXPECT_EQ(t.logprobs.size(), 0u);
  EXPECT_EQ(t.weight_versions, (std::vector<uint64_t>{6, 7, 7}));

  const Golden u8 = load("tokens_uint8");
  const auto f8 = u8.frame_views();
  const auto r8 = decode_incoming(as_frame(u8.envelope), f8, Limits{});
  ASSERT_TRUE(r8.ok()) << r8.status().to_string();
  const auto& re8 = *std::get<TokensEvent>(r8->msg).routed_experts;
  EXPECT_EQ(re8.start_pos, 8u);
  EXPECT_EQ(re8.data, std::string("\x01\x05\x00\x07\x03\x02\x06\x04\x02\x01\x07\x00", 12));
}

TEST(GoldenValues, FailedCarriesTypedError) {
  const Golden g = load("failed");
  const auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& f = std::get<FailedEvent>(r->msg);
  EXPECT_EQ(f.error.code, "internal");
  EXPECT_EQ(f.error.field, "");
}

// Bad inputs: each must be refused with the code and field path bad_cases.json
// lists, and with the envelope id echoed whenever it could be read.
TEST(GoldenBadCases, RefusedWithTypedError) {
  const nlohmann::json cases = nlohmann::json::parse(read_file(golden_dir() / "bad_cases.json"));
  ASSERT_GE(cases.size(), 10u);
  std::set<std::string> files;
  for (const auto& c : cases) {
    const std::string file = c.at("file");
    files.insert(file);
    SCOPED_TRACE(file);
    const std::string bytes = read_file(golden_dir() / file);
    const RequestDecodeResult r = decode_request(as_frame(bytes), {}, Limits{});
    ASSERT_FALSE(r.status.ok());
    EXPECT_EQ(error_code_name(r.status.code()), c.at("code").get<std::string>())
        << r.status.to_string();
    EXPECT_EQ(r.status.field(), c.at("field").get<std::string>()) << r.status.to_string();
    EXPECT_EQ(r.env.id, c.at("id").get<uint64_t>());
    EXPECT_FALSE(r.request.has_value());
  }
  for (const auto& entry : fs::directory_iterator(golden_dir())) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("bad_", 0) == 0 && entry.path().extension() == ".msgpack") {
      EXPECT_TRUE(files.count(file)) << file << " has no entry in bad_cases.json";
    }
  }
}

}  // namespace
}  // namespace rolloutd::protocol
