// The golden files of protocol/golden/ were written by Python's msgpack from dict
// literals (make_golden.py). Decoding each with the C++ codec and re-encoding it
// must give the same bytes: that pins key order, integer widths, float64, nil
// handling and payload frames to an implementation the C++ encoder did not write.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
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
// list and the directory in step. A golden with `upgrades_to` is what a daemon sent
// before SPEC §11 (or §11.7) added optional fields to its message: it must still
// decode, and re-encoding it writes those fields at their defaults, giving that other
// golden.
struct Case {
  const char* name;
  const char* type;
  const char* upgrades_to = nullptr;
};
constexpr Case kGoldens[] = {
    {"hello", "hello"},
    {"status", "status"},
    {"generate", "generate"},
    {"generate_greedy", "generate"},
    {"generate_top_logprobs", "generate"},
    {"abort", "abort"},
    {"abort_all", "abort"},
    {"shutdown", "shutdown"},
    {"hello_ok", "hello.ok", "hello_ok_cpu"},
    {"status_ok", "status.ok", "status_ok_full"},
    {"generate_ok", "generate.ok"},
    {"abort_ok", "abort.ok"},
    {"shutdown_ok", "shutdown.ok"},
    {"error", "error"},
    {"tokens_uint8", "tokens"},
    {"tokens_uint16", "tokens"},
    {"tokens_no_rows", "tokens"},
    {"tokens_plain", "tokens"},
    {"tokens_top_logprobs", "tokens"},
    {"finished", "finished"},
    {"finished_abort", "finished"},
    {"failed", "failed"},
    // weight updates and generation control (SPEC §11)
    {"hello_ok_full", "hello.ok", "hello_ok_cpu"},
    {"status_ok_full", "status.ok"},
    {"status_ok_paused", "status.ok"},
    {"begin_weight_update", "begin_weight_update"},
    {"begin_weight_update_all", "begin_weight_update"},
    {"update_weights_inline", "update_weights"},
    {"update_weights_shm", "update_weights"},
    {"end_weight_update", "end_weight_update"},
    {"abort_weight_update", "abort_weight_update"},
    {"get_weights_by_name", "get_weights_by_name"},
    {"weights_checksum", "weights_checksum"},
    {"weights_checksum_all", "weights_checksum"},
    {"pause_generation", "pause_generation"},
    {"continue_generation", "continue_generation"},
    {"begin_weight_update_ok", "begin_weight_update.ok"},
    {"update_weights_ok", "update_weights.ok"},
    {"end_weight_update_ok", "end_weight_update.ok"},
    {"abort_weight_update_ok", "abort_weight_update.ok"},
    {"get_weights_by_name_ok", "get_weights_by_name.ok"},
    {"weights_checksum_ok", "weights_checksum.ok"},
    {"pause_generation_ok", "pause_generation.ok"},
    {"continue_generation_ok", "continue_generation.ok"},
    {"retracted", "retracted"},
    {"finished_abort_weight_update", "finished"},
    // GPU weight transports (SPEC §11.7)
    {"hello_ok_cpu", "hello.ok"},
    {"hello_ok_gpu", "hello.ok"},
    {"init_weight_group", "init_weight_group"},
    {"init_weight_group_ok", "init_weight_group.ok"},
    {"destroy_weight_group", "destroy_weight_group"},
    {"destroy_weight_group_ok", "destroy_weight_group.ok"},
    {"update_weights_nccl", "update_weights"},
    {"update_weights_cuda_ipc", "update_weights"},
    // memory release and resume (SPEC §12)
    {"release_memory", "release_memory"},
    {"release_memory_all", "release_memory"},
    {"release_memory_ok", "release_memory.ok"},
    {"resume_memory", "resume_memory"},
    {"resume_memory_ok", "resume_memory.ok"},
};

bool is_request_type(std::string_view t) {
  return t.find('.') == std::string_view::npos && t != "error" && t != "tokens" &&
         t != "finished" && t != "failed" && t != "retracted";
}

WireMessage reencode(uint64_t id, const Incoming& msg) {
  return std::visit(
      [&](const auto& m) -> WireMessage {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ErrorInfo>)
          return encode_error(id, m);
        else if constexpr (std::is_same_v<T, TokensEvent> || std::is_same_v<T, FinishedEvent> ||
                           std::is_same_v<T, FailedEvent> || std::is_same_v<T, RetractedEvent>)
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
    // A request's payload frames are the caller's (an inline bucket): the decoder
    // points at them, the encoder leaves them to the sender.
    EXPECT_TRUE(again.frames.empty());
    if (const auto* u = std::get_if<UpdateWeightsRequest>(&*r.request)) {
      const Frame bucket = inline_bucket(*u, frames);
      if (std::holds_alternative<InlineSource>(u->source)) {
        ASSERT_EQ(g.frames.size(), 1u);
        EXPECT_EQ(bucket.data(), frames[0].data()) << "the inline bucket must not be copied";
        again.frames.emplace_back(reinterpret_cast<const char*>(bucket.data()), bucket.size());
      }
    }
  } else {
    const auto r = decode_incoming(as_frame(g.envelope), frames, Limits{});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->env.type, c.type);
    again = reencode(r->env.id, r->msg);
  }
  const Golden expected = c.upgrades_to ? load(c.upgrades_to) : g;
  EXPECT_EQ(again.envelope, expected.envelope) << "re-encoding " << c.name << " changed its bytes";
  EXPECT_EQ(again.frames, expected.frames);
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

TEST(GoldenValues, TopLogprobsAreAskedAndCarriedPerToken) {
  const Golden g = load("generate_top_logprobs");
  const RequestDecodeResult r = decode_request(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(std::get<GenerateRequest>(*r.request).top_logprobs_num, 3u);
  // Absent in the older goldens: 0.
  const Golden plain = load("generate");
  const RequestDecodeResult r0 = decode_request(as_frame(plain.envelope), {}, Limits{});
  ASSERT_TRUE(r0.status.ok()) << r0.status.to_string();
  EXPECT_EQ(std::get<GenerateRequest>(*r0.request).top_logprobs_num, 0u);

  const Golden t = load("tokens_top_logprobs");
  const auto e = decode_incoming(as_frame(t.envelope), {}, Limits{});
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const auto& tok = std::get<TokensEvent>(e->msg);
  EXPECT_EQ(tok.top_logprobs_num, 3u);
  EXPECT_EQ(tok.top_token_ids, (std::vector<int32_t>{9, 11, 0, 4, 70000, 1}));
  ASSERT_EQ(tok.top_logprobs.size(), 6u);
  EXPECT_EQ(tok.top_logprobs[0], -0.75);
  EXPECT_EQ(tok.top_logprobs[3], -0.03125);
  EXPECT_TRUE(std::isinf(tok.top_logprobs[5]) && tok.top_logprobs[5] < 0);
  const Golden no_top = load("tokens_plain");
  const auto e0 = decode_incoming(as_frame(no_top.envelope), {}, Limits{});
  ASSERT_TRUE(e0.ok()) << e0.status().to_string();
  EXPECT_EQ(std::get<TokensEvent>(e0->msg).top_logprobs_num, 0u);
  EXPECT_TRUE(std::get<TokensEvent>(e0->msg).top_token_ids.empty());
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
  // Absent in this older form: the default stands.
  EXPECT_EQ(h.limits.max_bucket_entries, d.max_bucket_entries);

  const Golden full = load("hello_ok_full");
  const auto f = decode_incoming(as_frame(full.envelope), {}, Limits{});
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(std::get<HelloReply>(f->msg).limits.max_bucket_entries, d.max_bucket_entries);
}

TEST(GoldenValues, StatusOkPausedAndOlderForm) {
  const Golden g = load("status_ok_paused");
  const auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& s = std::get<StatusReply>(r->msg);
  EXPECT_EQ(s.state, "not_ready");
  EXPECT_TRUE(s.paused);
  EXPECT_EQ(s.update_session, 7u);

  const Golden old = load("status_ok");
  const auto o = decode_incoming(as_frame(old.envelope), {}, Limits{});
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_FALSE(std::get<StatusReply>(o->msg).paused);
  EXPECT_EQ(std::get<StatusReply>(o->msg).update_session, 0u);
}

TEST(GoldenValues, UpdateWeightsInline) {
  const Golden g = load("update_weights_inline");
  const auto frames = g.frame_views();
  const RequestDecodeResult r = decode_request(as_frame(g.envelope), frames, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& u = std::get<UpdateWeightsRequest>(*r.request);
  EXPECT_EQ(u.session, 7u);
  EXPECT_EQ(u.load_format, "flattened_bucket");
  ASSERT_EQ(u.entries.size(), 3u);
  EXPECT_EQ(u.entries[0].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(u.entries[0].dtype, DType::kBF16);
  EXPECT_EQ(u.entries[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(u.entries[1].dtype, DType::kF32);
  EXPECT_EQ(u.entries[1].byte_offset, 16u);
  EXPECT_EQ(u.entries[1].nbytes, 12u);
  EXPECT_EQ(u.entries[2].dtype, DType::kF8E4M3);
  ASSERT_TRUE(std::holds_alternative<InlineSource>(u.source));
  EXPECT_EQ(std::get<InlineSource>(u.source).frame, 0u);
  ASSERT_TRUE(u.checksum.has_value());
  EXPECT_EQ(u.checksum->algo, "crc32");
  // The checksum covers the whole bucket buffer (SPEC §11.5), as zlib computed it.
  EXPECT_EQ(u.checksum->value, crc32(inline_bucket(u, frames)));
  // Entry 1 is float32 [1.0, 0.5, -2.25], little-endian.
  const Frame bucket = inline_bucket(u, frames);
  float norm[3];
  std::memcpy(norm, bucket.data() + u.entries[1].byte_offset, sizeof(norm));
  EXPECT_EQ(norm[0], 1.0f);
  EXPECT_EQ(norm[2], -2.25f);
}

TEST(GoldenValues, UpdateWeightsShmBeyondFourGiB) {
  const Golden g = load("update_weights_shm");
  const RequestDecodeResult r = decode_request(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& u = std::get<UpdateWeightsRequest>(*r.request);
  const auto& shm = std::get<ShmSource>(u.source);
  EXPECT_EQ(shm.name, "/rolloutd-trainer-0");
  EXPECT_EQ(shm.offset, uint64_t{1} << 33);
  EXPECT_EQ(u.entries[0].nbytes, uint64_t{151936} * 2048 * 2);
  EXPECT_EQ(shm.size, u.entries[1].byte_offset + u.entries[1].nbytes);
  EXPECT_FALSE(u.checksum.has_value());
  EXPECT_TRUE(inline_bucket(u, {}).empty());
}

TEST(GoldenValues, WeightsChecksumMatchesZlibAndSpecFormula) {
  const Golden bucket_msg = load("update_weights_inline");
  const auto frames = bucket_msg.frame_views();
  const RequestDecodeResult b = decode_request(as_frame(bucket_msg.envelope), frames, Limits{});
  ASSERT_TRUE(b.status.ok()) << b.status.to_string();
  const auto& u = std::get<UpdateWeightsRequest>(*b.request);

  const Golden g = load("weights_checksum_ok");
  const auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& w = std::get<WeightsChecksumReply>(r->msg);
  ASSERT_EQ(w.parameters.size(), 2u);
  std::vector<std::pair<std::string, uint32_t>> sums;
  for (const ParameterChecksum& p : w.parameters) {
    // Each parameter's checksum is zlib's CRC-32 of its bytes in the inline bucket.
    const auto it = std::find_if(u.entries.begin(), u.entries.end(),
                                 [&](const BucketEntry& e) { return e.name == p.name; });
    ASSERT_NE(it, u.entries.end()) << p.name;
    EXPECT_EQ(p.checksum, crc32(inline_bucket(u, frames).subspan(it->byte_offset, it->nbytes)))
        << p.name;
    sums.emplace_back(p.name, p.checksum);
  }
  std::reverse(sums.begin(), sums.end());  // the formula sorts by name itself
  EXPECT_EQ(model_checksum(sums), w.model_checksum);
}

TEST(GoldenValues, WeightsAndGenerationControl) {
  auto incoming = [](const char* name) {
    const Golden g = load(name);
    auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
    EXPECT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    return r.ok() ? r->msg : Incoming{};
  };
  const auto values = std::get<GetWeightsByNameReply>(incoming("get_weights_by_name_ok")).values;
  ASSERT_EQ(values.size(), 4u);
  EXPECT_EQ(values[1], 0.99609375);
  EXPECT_TRUE(std::signbit(values[2]));
  const auto retracted = std::get<RetractedEvent>(incoming("retracted"));
  EXPECT_EQ(retracted.num_tokens_discarded, 5u);
  EXPECT_EQ(retracted.reason, "weight_update");
  EXPECT_EQ(std::get<FinishedEvent>(incoming("finished_abort_weight_update")).abort_reason,
            "weight_update");
  EXPECT_EQ(std::get<PauseGenerationReply>(incoming("pause_generation_ok")).num_retracted, 3u);

  const Golden pause = load("pause_generation");
  const RequestDecodeResult p = decode_request(as_frame(pause.envelope), {}, Limits{});
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  EXPECT_EQ(std::get<PauseGenerationRequest>(*p.request).mode, PauseMode::kRetract);
  const Golden begin = load("begin_weight_update_all");
  const RequestDecodeResult a = decode_request(as_frame(begin.envelope), {}, Limits{});
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();
  EXPECT_FALSE(std::get<BeginWeightUpdateRequest>(*a.request).selector.has_value());
}

// The made-up ids of make_golden.py: (i * 37 + 11) % 256, (255 - i * 3) % 256.
std::string golden_unique_id() {
  std::string id;
  for (int i = 0; i < 128; ++i) id.push_back(static_cast<char>((i * 37 + 11) % 256));
  return id;
}
std::string golden_ipc_handle() {
  std::string h;
  for (int i = 0; i < 64; ++i) h.push_back(static_cast<char>(((255 - i * 3) % 256 + 256) % 256));
  return h;
}
const std::string kGoldenDeviceUuid =
    "\xa1\xb2\xc3\xd4\xe5\xf6\x07\x18\x29\x3a\x4b\x5c\x6d\x7e\x8f\x90";

TEST(GoldenValues, HelloOkAnnouncesNcclAndDevice) {
  auto hello = [](const char* name) {
    const Golden g = load(name);
    auto r = decode_incoming(as_frame(g.envelope), {}, Limits{});
    EXPECT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    return r.ok() ? std::get<HelloReply>(r->msg) : HelloReply{};
  };
  const HelloReply gpu = hello("hello_ok_gpu");
  EXPECT_EQ(gpu.gpu, 1);
  EXPECT_EQ(gpu.nccl_version, 22809u);
  EXPECT_EQ(nccl_version_string(gpu.nccl_version), "2.28.9");
  EXPECT_EQ(gpu.device_uuid, kGoldenDeviceUuid);
  // A CPU daemon: no NCCL, no device; older daemons omit both and decode the same way.
  for (const char* name : {"hello_ok_cpu", "hello_ok_full", "hello_ok"}) {
    const HelloReply cpu = hello(name);
    EXPECT_EQ(cpu.nccl_version, 0u) << name;
    EXPECT_TRUE(cpu.device_uuid.empty()) << name;
  }
}

TEST(GoldenValues, WeightGroupMessages) {
  const Golden init = load("init_weight_group");
  const RequestDecodeResult r = decode_request(as_frame(init.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& req = std::get<InitWeightGroupRequest>(*r.request);
  EXPECT_EQ(req.group, "weights");
  EXPECT_EQ(req.unique_id, golden_unique_id()) << "the id is raw bytes, high bytes included";
  EXPECT_EQ(req.world_size, 3u);
  EXPECT_EQ(req.rank, 2u);
  EXPECT_EQ(req.root, 0u);
  EXPECT_EQ(req.nccl_version, 22809u);
  EXPECT_EQ(req.timeout_s, 120.0);

  const Golden ok = load("init_weight_group_ok");
  const auto reply = decode_incoming(as_frame(ok.envelope), {}, Limits{});
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  const auto& joined = std::get<InitWeightGroupReply>(reply->msg);
  EXPECT_EQ(joined.rank, 2u);
  EXPECT_EQ(joined.world_size, 3u);
  EXPECT_EQ(joined.duration_s, 0.75);

  const Golden destroy = load("destroy_weight_group");
  const RequestDecodeResult d = decode_request(as_frame(destroy.envelope), {}, Limits{});
  ASSERT_TRUE(d.status.ok()) << d.status.to_string();
  EXPECT_EQ(std::get<DestroyWeightGroupRequest>(*d.request).group, "weights");
}

TEST(GoldenValues, DeviceBucketSources) {
  const Golden nccl = load("update_weights_nccl");
  const RequestDecodeResult n = decode_request(as_frame(nccl.envelope), {}, Limits{});
  ASSERT_TRUE(n.status.ok()) << n.status.to_string();
  const auto& nu = std::get<UpdateWeightsRequest>(*n.request);
  const auto& ns = std::get<NcclSource>(nu.source);
  EXPECT_EQ(ns.group, "weights");
  EXPECT_EQ(ns.root, 0u);
  EXPECT_EQ(ns.size, 131072u + 4096u);
  EXPECT_EQ(nu.entries[1].byte_offset % 256, 0u);
  ASSERT_TRUE(nu.checksum.has_value());
  EXPECT_EQ(nu.checksum->value, 0xDEADBEEFu);
  EXPECT_TRUE(inline_bucket(nu, {}).empty());

  const Golden ipc = load("update_weights_cuda_ipc");
  const RequestDecodeResult i = decode_request(as_frame(ipc.envelope), {}, Limits{});
  ASSERT_TRUE(i.status.ok()) << i.status.to_string();
  const auto& iu = std::get<UpdateWeightsRequest>(*i.request);
  const auto& is = std::get<CudaIpcSource>(iu.source);
  EXPECT_EQ(is.handle, golden_ipc_handle());
  EXPECT_EQ(is.offset, uint64_t{2} << 20);
  EXPECT_EQ(is.size, 131072u + 4096u);
  EXPECT_EQ(is.device_uuid, kGoldenDeviceUuid);
  EXPECT_FALSE(iu.checksum.has_value());
}

TEST(GoldenValues, MemoryReleaseAndResume) {
  const Golden rel = load("release_memory");
  const RequestDecodeResult r = decode_request(as_frame(rel.envelope), {}, Limits{});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto& tags = std::get<ReleaseMemoryRequest>(*r.request).tags;
  ASSERT_TRUE(tags.has_value());
  EXPECT_EQ(*tags, (std::vector<std::string>{"weights", "kv_cache"}));

  const Golden all = load("release_memory_all");
  const RequestDecodeResult a = decode_request(as_frame(all.envelope), {}, Limits{});
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();
  EXPECT_FALSE(std::get<ReleaseMemoryRequest>(*a.request).tags.has_value());

  const Golden ok = load("release_memory_ok");
  auto reply = decode_incoming(as_frame(ok.envelope), {}, Limits{});
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  const auto& rr = std::get<ReleaseMemoryReply>(reply->msg);
  EXPECT_EQ(rr.tags, (std::vector<std::string>{"weights", "kv_cache"}));
  EXPECT_EQ(rr.num_bytes, 17179869184ull + 2147483648ull);
  EXPECT_EQ(rr.duration_s, 0.125);

  const Golden res = load("resume_memory");
  const RequestDecodeResult q = decode_request(as_frame(res.envelope), {}, Limits{});
  ASSERT_TRUE(q.status.ok()) << q.status.to_string();
  EXPECT_EQ(*std::get<ResumeMemoryRequest>(*q.request).tags, (std::vector<std::string>{"weights"}));
  const Golden rok = load("resume_memory_ok");
  auto resumed = decode_incoming(as_frame(rok.envelope), {}, Limits{});
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  EXPECT_TRUE(std::get<ResumeMemoryReply>(resumed->msg).tags.empty());
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
    std::vector<std::string> payload;
    for (const auto& f : c.value("frames", nlohmann::json::array()))
      payload.push_back(read_file(golden_dir() / f.get<std::string>()));
    std::vector<Frame> views;
    for (const auto& f : payload) views.push_back(as_frame(f));
    const RequestDecodeResult r = decode_request(as_frame(bytes), views, Limits{});
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
