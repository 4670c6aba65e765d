// The weight hot-reload contracts on the CPU backend: stable addresses, restore/postprocess
// identity and refusal, equivalence with a fresh build, partial sessions, loader mappings,
// dtype conversions, fail-closed errors, pause modes.
#include "core/weights/session.hpp"

#include <cmath>
#include <cstring>
#include <map>

#include "../emulated_device.hpp"
#include "../test_util.hpp"
#include "kernels/bf16.hpp"
#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::core {
namespace {

using test::embedded_engine;
using test::embedded_model;
using test::run_to_idle;
using test::small_limits;

const auto kNow = SteadyClock::now();

struct Bucket {
  std::vector<BucketEntry> entries;
  std::vector<uint8_t> bytes;
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t n) {
    BucketEntry e{name, dtype, std::move(shape), bytes.size(), n};
    entries.push_back(e);
    bytes.insert(bytes.end(), static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  }
};

std::vector<int64_t> shape_of(const TensorView& v) { return {v.shape.data(), v.shape.data() + v.rank()}; }

// Checkpoint-layout bytes of every parameter of `m`.
std::map<std::string, std::vector<uint8_t>> checkpoint_of(const MoeDecoder& m) {
  std::map<std::string, std::vector<uint8_t>> out;
  const auto& reg = m.weights();
  for (size_t i = 0; i < reg.size(); ++i) EXPECT_TRUE(reg.read_checkpoint(i, out[reg.parameters()[i].name]).ok());
  return out;
}

// Stored bytes (whatever the layout) of every parameter.
std::map<std::string, std::vector<uint8_t>> storage_of(const MoeDecoder& m) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& p : m.weights().parameters()) {
    const auto* b = static_cast<const uint8_t*>(p.storage.data);
    out[p.name].assign(b, b + p.storage.nbytes());
  }
  return out;
}

std::map<std::string, const void*> addresses_of(const MoeDecoder& m) {
  std::map<std::string, const void*> out;
  for (const auto& p : m.weights().parameters()) out[p.name] = p.storage.data;
  return out;
}

Bucket full_bucket(const MoeDecoder& source, const std::string& prefix = "") {
  Bucket b;
  for (const auto& [name, bytes] : checkpoint_of(source)) {
    if (name.rfind(prefix, 0) != 0) continue;
    const auto* p = source.weights().find(name);
    b.add(name, DType::kF32, shape_of(p->storage), bytes.data(), bytes.size());
  }
  return b;
}

std::unique_ptr<MoeDecoder> model_with_seed(uint64_t seed) {
  auto l = small_limits();
  auto m = MoeDecoder::create(embedded_model_config(), l, cpu_backend(), ExecContext{});
  EXPECT_TRUE(m.ok());
  EXPECT_TRUE(init_random_weights(**m, seed).ok());
  return std::move(*m);
}

Status push(WeightUpdater& u, const Bucket& b, uint64_t version = 1) {
  auto s = u.begin({}, 60, kNow);
  if (!s.ok()) return s.status();
  auto r = u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, kNow);
  if (!r.ok()) return r.status();
  auto e = u.end(s->session, version, kNow);
  return e.ok() ? Status::Ok() : e.status();
}

TEST(WeightRegistry, RestoreThenPostprocessIsIdentityAndRepeatsAreRefused) {
  auto m = model_with_seed(1);
  auto& reg = m->weights();
  const size_t gu = reg.index_of("model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, SIZE_MAX);
  const auto before = storage_of(*m);
  const auto ckpt = checkpoint_of(*m);
  ASSERT_NE(before.at(reg.parameters()[gu].name), ckpt.at(reg.parameters()[gu].name))
      << "the kernel layout must be a real permutation of the checkpoint layout";
  // A second postprocess is a refused no-op, never a second permutation.
  ASSERT_TRUE(reg.postprocess(gu).ok());
  EXPECT_EQ(reg.counters().refused_postprocesses, 1u);
  EXPECT_EQ(storage_of(*m), before);
  ASSERT_TRUE(reg.restore(gu).ok());
  // In checkpoint layout the stored bytes are the checkpoint bytes.
  EXPECT_EQ(storage_of(*m).at(reg.parameters()[gu].name), ckpt.at(reg.parameters()[gu].name));
  ASSERT_TRUE(reg.restore(gu).ok());
  EXPECT_EQ(reg.counters().refused_restores, 1u);
  ASSERT_TRUE(reg.postprocess(gu).ok());
  EXPECT_EQ(storage_of(*m), before);
}

TEST(WeightUpdater, FullUpdateEqualsFreshBuildAndKeepsAddresses) {
  auto target = model_with_seed(777);
  auto m = model_with_seed(1);
  const auto addrs = addresses_of(*m);
  WeightUpdater u(m->weights());
  ASSERT_TRUE(push(u, full_bucket(*target)).ok());
  EXPECT_EQ(storage_of(*m), storage_of(*target)) << "bit-identical to building fresh from T";
  EXPECT_EQ(addresses_of(*m), addrs);
  EXPECT_TRUE(u.whole());
}

TEST(WeightUpdater, UpdatedEngineGeneratesLikeAFreshOne) {
  auto target = model_with_seed(777);
  auto bucket = full_bucket(*target);
  auto fresh = embedded_engine(small_limits());
  auto updated = embedded_engine(small_limits());
  // Make `fresh` hold the target weights by building it from them, then compare generation.
  WeightUpdater uf(fresh->model().weights());
  ASSERT_TRUE(push(uf, bucket).ok());  // equivalent to a fresh build (previous test)
  ASSERT_TRUE(push(updated->updater(), bucket, 5).ok());
  for (auto* e : {fresh.get(), updated.get()}) {
    RequestSpec s;
    s.rid = "a";
    s.input_ids = {3, 1, 4, 1, 5};
    s.max_new_tokens = 12;
    s.sampling.temperature = 0;
    ASSERT_TRUE(e->submit(s).ok());
  }
  auto tokens = [](const std::vector<EngineEvent>& ev) {
    std::vector<int32_t> t;
    for (const auto& e : ev) t.insert(t.end(), e.token_ids.begin(), e.token_ids.end());
    return t;
  };
  EXPECT_EQ(tokens(run_to_idle(*fresh)), tokens(run_to_idle(*updated)));
}

TEST(WeightUpdater, PartialSessionsEqualAFullReloadWithTheSameFinalValues) {
  auto old_weights = model_with_seed(1);
  auto new_weights = model_with_seed(2);
  const auto old_ckpt = checkpoint_of(*old_weights);
  const auto new_ckpt = checkpoint_of(*new_weights);
  struct Case {
    const char* what;
    std::vector<std::string> prefixes;  // parameters taken from the new weights
  };
  const std::vector<Case> cases = {
      {"empty", {}},
      {"weight-only", {"model.layers.1.self_attn.", "lm_head.weight"}},
      {"scale-only (norms)", {"model.layers.0.input_layernorm", "model.layers.2.post_attention_layernorm", "model.norm"}},
      {"experts", {"model.layers.3.mlp.experts.", "model.layers.0.mlp.experts.gate_up_proj"}},
  };
  for (const Case& c : cases) {
    auto m = model_with_seed(1);
    WeightUpdater u(m->weights());
    Bucket b;
    std::map<std::string, std::vector<uint8_t>> expected = old_ckpt;
    for (const auto& [name, bytes] : new_ckpt) {
      bool take = false;
      for (const auto& p : c.prefixes) take |= name.rfind(p, 0) == 0;
      if (!take) continue;
      b.add(name, DType::kF32, shape_of(m->weights().find(name)->storage), bytes.data(), bytes.size());
      expected[name] = bytes;
    }
    auto s = u.begin({}, 60, kNow);
    ASSERT_TRUE(s.ok()) << c.what;
    if (!b.entries.empty()) {
      ASSERT_TRUE(u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, kNow).ok());
    }
    ASSERT_TRUE(u.end(s->session, 1, kNow).ok());
    // Reference: a full reload of the same final values into a third model.
    auto ref = model_with_seed(3);
    Bucket full;
    for (const auto& [name, bytes] : expected)
      full.add(name, DType::kF32, shape_of(ref->weights().find(name)->storage), bytes.data(), bytes.size());
    WeightUpdater ur(ref->weights());
    ASSERT_TRUE(push(ur, full).ok());
    EXPECT_EQ(storage_of(*m), storage_of(*ref)) << c.what;
    EXPECT_EQ(checkpoint_of(*m), expected) << c.what;
  }
}

TEST(WeightUpdater, RepeatedEmptySessionsChangeNothing) {
  auto m = model_with_seed(1);
  const auto before = storage_of(*m);
  WeightUpdater u(m->weights());
  for (int i = 0; i < 5; ++i) {
    auto s = u.begin({}, 60, kNow);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(u.end(s->session, static_cast<uint64_t>(i), kNow).ok());
  }
  // Selector sessions restore only what they select; the rest is never touched twice.
  auto s = u.begin({"model.layers.2."}, 60, kNow);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_parameters_restored, 1u) << "one stacked gate_up per layer moves";
  ASSERT_TRUE(u.end(s->session, 9, kNow).ok());
  EXPECT_EQ(storage_of(*m), before);
}

TEST(WeightUpdater, LoaderMappingsPerExpertFusedQkvAndInterleavedGateUp) {
  auto target = model_with_seed(42);
  auto m = model_with_seed(1);
  const auto ckpt = checkpoint_of(*target);
  const auto& c = m->config();
  const int64_t I = c.moe_intermediate_size, H = c.hidden_size, D = c.head_dim;
  const int64_t QH = c.num_attention_heads, KVH = c.num_key_value_heads;
  Bucket b;
  for (const auto& [name, bytes] : ckpt) {
    const auto* p = m->weights().find(name);
    if (name.find("mlp.experts.gate_up_proj") != std::string::npos) {
      const std::string layer = name.substr(0, name.find("mlp."));
      for (int64_t e = 0; e < c.num_experts; ++e) {  // per-expert gate_proj / up_proj
        const uint8_t* base = bytes.data() + static_cast<size_t>(e * 2 * I * H) * 4;
        b.add(layer + "mlp.experts." + std::to_string(e) + ".gate_proj.weight", DType::kF32, {I, H}, base,
              static_cast<size_t>(I * H) * 4);
        b.add(layer + "mlp.experts." + std::to_string(e) + ".up_proj.weight", DType::kF32, {I, H},
              base + static_cast<size_t>(I * H) * 4, static_cast<size_t>(I * H) * 4);
      }
    } else if (name.find("self_attn.q_proj") != std::string::npos) {
      const std::string layer = name.substr(0, name.find("self_attn."));
      std::vector<uint8_t> qkv = bytes;
      const auto& k = ckpt.at(layer + "self_attn.k_proj.weight");
      const auto& v = ckpt.at(layer + "self_attn.v_proj.weight");
      qkv.insert(qkv.end(), k.begin(), k.end());
      qkv.insert(qkv.end(), v.begin(), v.end());
      b.add(layer + "self_attn.qkv_proj.weight", DType::kF32, {(QH + 2 * KVH) * D, H}, qkv.data(), qkv.size());
    } else if (name.find("self_attn.k_proj") != std::string::npos ||
               name.find("self_attn.v_proj") != std::string::npos) {
      continue;  // inside the fused QKV above
    } else {
      b.add(name, DType::kF32, shape_of(p->storage), bytes.data(), bytes.size());
    }
  }
  WeightUpdater u(m->weights());
  ASSERT_TRUE(push(u, b).ok());
  EXPECT_EQ(storage_of(*m), storage_of(*target));

  // A checkpoint whose fused gate_up interleaves rows (gpt-oss order) lands the same values.
  auto cfg = embedded_model_config();
  cfg.gate_up_checkpoint_interleaved = true;
  auto mi = MoeDecoder::create(cfg, small_limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(mi.ok());
  ASSERT_TRUE(init_random_weights(**mi, 5).ok());
  Bucket bi;
  for (const auto& [name, bytes] : ckpt) {
    std::vector<uint8_t> data = bytes;
    if (name.find("mlp.experts.gate_up_proj") != std::string::npos) {
      for (int64_t e = 0; e < c.num_experts; ++e)
        for (int64_t j = 0; j < I; ++j) {
          const size_t row = static_cast<size_t>(H) * 4;
          const size_t base = static_cast<size_t>(e * 2 * I) * row;
          std::memcpy(&data[base + static_cast<size_t>(2 * j) * row], &bytes[base + static_cast<size_t>(j) * row], row);
          std::memcpy(&data[base + static_cast<size_t>(2 * j + 1) * row], &bytes[base + static_cast<size_t>(I + j) * row], row);
        }
    }
    bi.add(name, DType::kF32, shape_of((*mi)->weights().find(name)->storage), data.data(), data.size());
  }
  WeightUpdater ui((*mi)->weights());
  ASSERT_TRUE(push(ui, bi).ok());
  EXPECT_EQ(storage_of(**mi), storage_of(*target));
}

TEST(WeightUpdater, Bf16InputAndItsFp32ExportGiveIdenticalParameters) {
  auto m1 = model_with_seed(1), m2 = model_with_seed(1);
  const auto* p = m1->weights().find("model.layers.1.mlp.gate.weight");
  const size_t n = static_cast<size_t>(p->storage.numel());
  std::vector<uint16_t> bf(n);
  std::vector<float> f32(n);
  test::fill_bf16_values(bf, 99);
  for (size_t i = 0; i < n; ++i) f32[i] = bf16_bits_to_f32(bf[i]);
  Bucket a, b;
  a.add(p->name, DType::kBF16, shape_of(p->storage), bf.data(), n * 2);
  b.add(p->name, DType::kF32, shape_of(p->storage), f32.data(), n * 4);
  WeightUpdater u1(m1->weights()), u2(m2->weights());
  ASSERT_TRUE(push(u1, a).ok());
  ASSERT_TRUE(push(u2, b).ok());
  EXPECT_EQ(storage_of(*m1), storage_of(*m2));
}

TEST(WeightUpdater, FailClosedErrorsAreTypedAndNameTheEntry) {
  auto m = model_with_seed(1);
  const auto before = storage_of(*m);
  WeightUpdater u(m->weights());
  auto s = u.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(u.begin({}, 60, kNow).status().code(), ErrorCode::kFailedPrecondition) << "second begin";
  const auto* norm = m->weights().find("model.norm.weight");
  std::vector<float> ones(64, 1.0f);
  auto expect = [&](const Bucket& b, ErrorCode code, const std::string& field, std::optional<uint32_t> crc = {}) {
    auto r = u.apply_bucket(s->session, b.entries, b.bytes, crc, kNow);
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    EXPECT_EQ(r.status().field(), field) << r.status().to_string();
  };
  Bucket ok;
  ok.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  Bucket unknown = ok;
  unknown.add("model.nope.weight", DType::kF32, {64}, ones.data(), 256);
  expect(unknown, ErrorCode::kNotFound, "entries[1].name");
  Bucket bad_dtype;
  bad_dtype.add("model.norm.weight", DType::kI32, {64}, ones.data(), 256);
  expect(bad_dtype, ErrorCode::kInvalidArgument, "entries[0].dtype");
  Bucket bad_shape;
  bad_shape.add("model.norm.weight", DType::kF32, {32, 2}, ones.data(), 256);
  expect(bad_shape, ErrorCode::kInvalidArgument, "entries[0].shape");
  Bucket outside = ok;
  outside.entries[0].byte_offset = 8;
  expect(outside, ErrorCode::kOutOfRange, "entries[0].byte_offset");
  Bucket overlap;
  overlap.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  overlap.add("model.layers.0.input_layernorm.weight", DType::kF32, {64}, ones.data(), 256);
  overlap.entries[1].byte_offset = 128;
  overlap.bytes.resize(384);
  expect(overlap, ErrorCode::kInvalidArgument, "entries[1]");
  Bucket twice;
  twice.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  twice.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  expect(twice, ErrorCode::kInvalidArgument, "entries[1].name");
  expect(ok, ErrorCode::kInvalidArgument, "checksum", crc32_of(ok.bytes) ^ 1u);
  EXPECT_EQ(u.apply_bucket(s->session + 1, ok.entries, ok.bytes, std::nullopt, kNow).status().code(),
            ErrorCode::kFailedPrecondition);
  // Rejected buckets change nothing; the session stays usable and ends whole.
  ASSERT_TRUE(u.end(s->session, 1, kNow).ok());
  EXPECT_TRUE(u.whole());
  EXPECT_EQ(storage_of(*m), before);
  EXPECT_EQ(u.end(s->session, 1, kNow).status().code(), ErrorCode::kFailedPrecondition) << "no session open";
  (void)norm;
}

// ---- Coalesced copies (issue 7): a bucket's plain loads are copied with adjacent runs merged ----

// Parameters stored in order (each 256-byte aligned, optionally with a hole after each), on the
// emulated device (the registry's device path: one Backend::convert per copy) or on the host.
struct CoalesceCase {
  std::unique_ptr<test::EmulatedDeviceMemory> memory;
  std::unique_ptr<WeightRegistry> reg;
  std::vector<TensorView> views;
  bool on_device = false;

  CoalesceCase(bool device, DType stored, const std::vector<int64_t>& sizes, bool gapped) : on_device(device) {
    memory = std::make_unique<test::EmulatedDeviceMemory>(size_t{1} << 20, device ? Device::cuda(0) : Device::cpu());
    reg = device ? std::make_unique<WeightRegistry>(test::emulated_device_backend(), test::emulated_device_context())
                 : std::make_unique<WeightRegistry>(cpu_backend(), ExecContext{});
    for (size_t i = 0; i < sizes.size(); ++i) {
      views.push_back(memory->allocate(stored, Shape{sizes[i]}));
      std::memset(views.back().data, 0xEE, views.back().nbytes());
      if (gapped) (void)memory->allocate(DType::kU8, Shape{256});
      EXPECT_TRUE(reg->add("p." + std::to_string(i), views.back(), nullptr).ok());
    }
    EXPECT_TRUE(reg->postprocess_all().ok());
  }
  std::vector<std::vector<uint8_t>> stored() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& v : views) {
      const auto* b = static_cast<const uint8_t*>(v.data);
      out.emplace_back(b, b + v.nbytes());
    }
    return out;
  }
  // Applies `entries` of `bytes` as one bucket (or one bucket per entry); the copies it took.
  uint64_t apply(const std::vector<BucketEntry>& entries, const std::vector<uint8_t>& bytes, bool one_by_one) {
    WeightUpdater u(*reg);
    auto s = u.begin({}, 60, kNow);
    EXPECT_TRUE(s.ok());
    const uint64_t before = reg->num_copy_calls();
    test::emulated_device_counters().reset();
    if (one_by_one) {
      for (const BucketEntry& e : entries)
        EXPECT_TRUE(u.apply_bucket(s->session, std::span(&e, 1), bytes, std::nullopt, kNow, on_device).ok());
    } else {
      auto r = u.apply_bucket(s->session, entries, bytes, std::nullopt, kNow, on_device);
      EXPECT_TRUE(r.ok()) << r.status().to_string();
    }
    EXPECT_TRUE(u.end(s->session, 1, kNow).ok());
    const uint64_t calls = reg->num_copy_calls() - before;
    if (on_device) {
      EXPECT_EQ(test::emulated_device_counters().converts, calls) << "one backend call per copy";
    }
    return calls;
  }
};

std::vector<uint8_t> pattern_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(((i + 1) * 2654435761u + seed * 40503u) >> 11);
  return out;
}

// Entries for parameters p.0.. of `sizes` elements of `dtype`, at `offsets` in a bucket of `bucket_bytes`.
std::vector<BucketEntry> coalesce_entries(DType dtype, const std::vector<int64_t>& sizes,
                                          const std::vector<uint64_t>& offsets) {
  std::vector<BucketEntry> out;
  for (size_t i = 0; i < sizes.size(); ++i)
    out.push_back({"p." + std::to_string(i), dtype, {sizes[i]}, offsets[i],
                   static_cast<uint64_t>(sizes[i]) * dtype_size(dtype)});
  return out;
}

// One bucket and the same entries one by one give byte-identical parameters; returns the copies
// (merged, one by one).
std::pair<uint64_t, uint64_t> coalesce_check(bool device, DType stored, DType sent, const std::vector<int64_t>& sizes,
                                             const std::vector<uint64_t>& offsets, bool gapped, size_t bucket_bytes) {
  const auto entries = coalesce_entries(sent, sizes, offsets);
  const auto bytes = pattern_bytes(bucket_bytes, 7);
  CoalesceCase merged(device, stored, sizes, gapped), single(device, stored, sizes, gapped);
  const uint64_t merged_calls = merged.apply(entries, bytes, false);
  const uint64_t single_calls = single.apply(entries, bytes, true);
  EXPECT_EQ(merged.stored(), single.stored()) << "coalescing changed the parameters";
  EXPECT_NE(merged.stored()[0], std::vector<uint8_t>(merged.views[0].nbytes(), 0xEE)) << "nothing was written";
  return {merged_calls, single_calls};
}

std::vector<uint64_t> packed_offsets(const std::vector<int64_t>& sizes, size_t elem, size_t align) {
  std::vector<uint64_t> out;
  uint64_t off = 0;
  for (int64_t n : sizes) {
    off = (off + align - 1) / align * align;
    out.push_back(off);
    off += static_cast<uint64_t>(n) * elem;
  }
  return out;
}

TEST(WeightUpdater, CoalescedBucketEqualsItsEntriesOneByOne) {
  const std::vector<int64_t> sizes(64, 128);  // 256 bytes of BF16 each: back to back in storage
  const auto packed = packed_offsets(sizes, 2, 256);
  for (bool device : {true, false}) {
    SCOPED_TRACE(device ? "emulated device" : "host");
    // In order and back to back in the bucket and in storage: one copy for the bucket.
    EXPECT_EQ(coalesce_check(device, DType::kBF16, DType::kBF16, sizes, packed, false, 64 * 256),
              std::pair(uint64_t{1}, uint64_t{64}));
    // A hole after each parameter in storage: no two entries share a copy.
    EXPECT_EQ(coalesce_check(device, DType::kBF16, DType::kBF16, sizes, packed, true, 64 * 256).first, 64u);
    // Back to back in storage, holes in the bucket: neither.
    EXPECT_EQ(coalesce_check(device, DType::kBF16, DType::kBF16, sizes, packed_offsets(sizes, 2, 512), false,
                             64 * 512).first,
              64u);
    // The bucket holds them in the opposite order of storage: each entry is its own copy.
    std::vector<uint64_t> reversed(packed.rbegin(), packed.rend());
    EXPECT_EQ(coalesce_check(device, DType::kBF16, DType::kBF16, sizes, reversed, false, 64 * 256).first, 64u);
    // Converted on the way (BF16 sent, FP32 stored: 512 bytes each, still back to back): one convert.
    EXPECT_EQ(coalesce_check(device, DType::kF32, DType::kBF16, sizes, packed, false, 64 * 256).first, 1u);
    // Runs end where storage has a hole: 100 BF16 elements leave 56 bytes before the next 256-byte slot.
    const std::vector<int64_t> mixed = {128, 100, 128, 128, 100, 100};
    EXPECT_EQ(coalesce_check(device, DType::kBF16, DType::kBF16, mixed, packed_offsets(mixed, 2, 256), false, 4096)
                  .first,
              3u);  // {0, 1}, {2, 3, 4}, {5}
  }
}

TEST(WeightUpdater, MixedDtypesInOneBucketBreakRunsWhereTheDtypeChanges) {
  // FP32 parameters; entries alternate FP32 and BF16 in pairs: a copy per pair of one dtype.
  const std::vector<int64_t> sizes(8, 64);  // 256 bytes each as FP32: back to back in storage
  std::vector<BucketEntry> entries;
  uint64_t off = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const DType d = (i / 2) % 2 ? DType::kBF16 : DType::kF32;
    entries.push_back({"p." + std::to_string(i), d, {sizes[i]}, off, static_cast<uint64_t>(sizes[i]) * dtype_size(d)});
    off += entries.back().nbytes;
  }
  const auto bytes = pattern_bytes(off, 3);
  for (bool device : {true, false}) {
    CoalesceCase merged(device, DType::kF32, sizes, false), single(device, DType::kF32, sizes, false);
    EXPECT_EQ(merged.apply(entries, bytes, false), 4u);
    EXPECT_EQ(single.apply(entries, bytes, true), 8u);
    EXPECT_EQ(merged.stored(), single.stored());
  }
}

TEST(WeightUpdater, ModelBucketEqualsItsEntriesOneByOne) {
  // The embedded model's whole checkpoint (stacked experts, aliases, norms) in one bucket and
  // entry by entry: the same parameters, in fewer copies.
  auto target = model_with_seed(42);
  const Bucket b = full_bucket(*target);
  auto merged = model_with_seed(1), single = model_with_seed(1);
  WeightUpdater um(merged->weights()), us(single->weights());
  const uint64_t m0 = merged->weights().num_copy_calls(), s0 = single->weights().num_copy_calls();
  ASSERT_TRUE(push(um, b).ok());
  auto s = us.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  for (const BucketEntry& e : b.entries)
    ASSERT_TRUE(us.apply_bucket(s->session, std::span(&e, 1), b.bytes, std::nullopt, kNow).ok());
  ASSERT_TRUE(us.end(s->session, 1, kNow).ok());
  EXPECT_EQ(storage_of(*merged), storage_of(*single));
  EXPECT_EQ(storage_of(*merged), storage_of(*target));
  EXPECT_LE(merged->weights().num_copy_calls() - m0, single->weights().num_copy_calls() - s0);
}

TEST(WeightUpdater, AFailedMergedCopyFailsTheSessionClosedNamingItsFirstEntry) {
  const std::vector<int64_t> sizes(16, 128);
  const auto entries = coalesce_entries(DType::kBF16, sizes, packed_offsets(sizes, 2, 256));
  const auto bytes = pattern_bytes(16 * 256, 5);
  CoalesceCase c(true, DType::kBF16, sizes, false);
  // Entries 0-7 and 8-15 are two copies: a hole between 7 and 8 in the bucket.
  auto split = entries;
  std::vector<uint8_t> holed(bytes.size() + 256);
  for (size_t i = 0; i < split.size(); ++i) {
    if (i >= 8) split[i].byte_offset += 256;
    std::memcpy(&holed[split[i].byte_offset], &bytes[entries[i].byte_offset], 256);
  }
  WeightUpdater u(*c.reg);
  auto s = u.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  test::emulated_device_counters().reset();
  test::emulated_device_counters().fail_convert_at = 2;  // the copy of entries 8-15
  auto r = u.apply_bucket(s->session, split, holed, std::nullopt, kNow, true);
  test::emulated_device_counters().reset();
  EXPECT_EQ(r.status().code(), ErrorCode::kCudaError);
  EXPECT_EQ(r.status().field(), "entries[8]");
  EXPECT_FALSE(u.session_open());
  EXPECT_FALSE(u.whole()) << "a device fault mid-bucket leaves the model not whole";
}

TEST(WeightUpdater, RefusedBucketOfCoalescibleEntriesWritesNothing) {
  // Every entry is checked before any copy: a bad last entry leaves the first 63 unwritten too.
  const std::vector<int64_t> sizes(64, 128);
  auto entries = coalesce_entries(DType::kBF16, sizes, packed_offsets(sizes, 2, 256));
  const auto bytes = pattern_bytes(64 * 256, 9);
  for (bool device : {true, false}) {
    CoalesceCase c(device, DType::kBF16, sizes, false);
    const auto before = c.stored();
    WeightUpdater u(*c.reg);
    auto s = u.begin({}, 60, kNow);
    ASSERT_TRUE(s.ok());
    auto bad = entries;
    bad.back().shape = {64, 2};
    auto r = u.apply_bucket(s->session, bad, bytes, std::nullopt, kNow, device);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(r.status().field(), "entries[63].shape");
    bad = entries;
    bad.back().name = "p.0";
    r = u.apply_bucket(s->session, bad, bytes, std::nullopt, kNow, device);
    EXPECT_EQ(r.status().field(), "entries[63].name") << r.status().to_string();
    bad = entries;
    bad[40].byte_offset = bad[39].byte_offset + 128;  // overlaps entry 39
    r = u.apply_bucket(s->session, bad, bytes, std::nullopt, kNow, device);
    EXPECT_EQ(r.status().field(), "entries[40]") << r.status().to_string();
    EXPECT_TRUE(u.session_open());
    EXPECT_EQ(c.stored(), before);
    ASSERT_TRUE(u.end(s->session, 1, kNow).ok());
    EXPECT_TRUE(u.whole());
  }
}

TEST(WeightUpdater, OverlapBehindAnEmptyEntryIsFound) {
  // [0, 256) and [128, 384) with an empty entry at offset 64 between them in offset order:
  // comparing offset-order neighbours only (empty ones skipped) let this one through.
  CoalesceCase c(false, DType::kBF16, {128, 0, 128}, false);
  const auto before = c.stored();
  WeightUpdater u(*c.reg);
  auto s = u.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  const std::vector<BucketEntry> entries = {{"p.0", DType::kBF16, {128}, 0, 256},
                                            {"p.1", DType::kBF16, {0}, 64, 0},
                                            {"p.2", DType::kBF16, {128}, 128, 256}};
  auto r = u.apply_bucket(s->session, entries, pattern_bytes(384, 1), std::nullopt, kNow);
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(r.status().field(), "entries[2]") << r.status().to_string();
  EXPECT_EQ(c.stored(), before);
}

TEST(WeightUpdater, SessionsOutsideTheSelectorCannotWrite) {
  auto m = model_with_seed(1);
  WeightUpdater u(m->weights());
  auto s = u.begin({"model.layers.0."}, 60, kNow);
  ASSERT_TRUE(s.ok());
  std::vector<float> ones(64, 1.0f);
  Bucket b;
  b.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  auto r = u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, kNow);
  EXPECT_EQ(r.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(r.status().field(), "entries[0].name");
  ASSERT_TRUE(u.end(s->session, 1, kNow).ok());
}

TEST(WeightUpdater, ARefusedBucketRestartsTheIdleDeadline) {
  // SPEC 11.4: every bucket naming the session restarts its idle deadline, refused or not, so
  // a trainer correcting a refused bucket finds its session still open.
  auto e = embedded_engine(small_limits());
  auto& u = e->updater();
  auto s = u.begin({}, 2.0, kNow);
  ASSERT_TRUE(s.ok());
  std::vector<float> ones(64, 1.0f);
  Bucket bad;
  bad.add("model.nope.weight", DType::kF32, {64}, ones.data(), 256);
  EXPECT_EQ(u.apply_bucket(s->session, bad.entries, bad.bytes, std::nullopt, kNow + std::chrono::milliseconds(1500))
                .status()
                .code(),
            ErrorCode::kNotFound);
  EXPECT_FALSE(u.expire_if_idle(kNow + std::chrono::seconds(3)));  // 1.5 s since the refused bucket
  EXPECT_TRUE(u.expire_if_idle(kNow + std::chrono::seconds(4)));
}

TEST(WeightUpdater, ABucketReportsItsEntriesBytesAndTheTimeSinceItsReceipt) {
  // SPEC 11.1: num_bytes is the entries' bytes, not the buffer's (a shm region or frame may hold
  // gaps and a tail); duration_s runs from the receipt passed in.
  auto e = embedded_engine(small_limits());
  auto& u = e->updater();
  auto s = u.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  std::vector<float> ones(64, 1.0f);
  Bucket b;
  b.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  b.bytes.resize(b.bytes.size() + 1000, 0);  // an unused tail
  const auto received = SteadyClock::now() - std::chrono::seconds(2);
  auto r = u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, received);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->num_bytes, 256u);
  EXPECT_GE(r->duration_s, 2.0);
  auto end = u.end(s->session, 1, SteadyClock::now());
  ASSERT_TRUE(end.ok());
  EXPECT_EQ(end->num_bytes, 256u);
}

TEST(WeightUpdater, AnIdleSessionExpiresAndAHalfWrittenModelIsNotServed) {
  auto e = embedded_engine(small_limits());
  auto& u = e->updater();
  const auto addrs = addresses_of(e->model());
  auto s = u.begin({}, 2.0, kNow);
  ASSERT_TRUE(s.ok());
  std::vector<float> ones(64, 1.0f);
  Bucket b;
  b.add("model.norm.weight", DType::kF32, {64}, ones.data(), 256);
  ASSERT_TRUE(u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, kNow).ok());
  EXPECT_FALSE(u.expire_if_idle(kNow + std::chrono::seconds(1)));
  auto expired = u.expire_if_idle(kNow + std::chrono::seconds(3));
  ASSERT_TRUE(expired);
  EXPECT_EQ(expired->code(), ErrorCode::kDeadlineExceeded);
  EXPECT_FALSE(u.session_open());
  EXPECT_FALSE(u.whole());
  // Naming the expired session says it expired (the trainer was too slow), not merely that no
  // session is open (SPEC 11); an id that never was stays failed_precondition.
  EXPECT_EQ(u.apply_bucket(s->session, b.entries, b.bytes, std::nullopt, kNow).status().code(),
            ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(u.end(s->session, 1, kNow).status().code(), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(u.abort(s->session, "late").status().code(), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(u.end(s->session + 100, 1, kNow).status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(u.broken_reason().find("model.norm.weight"), std::string::npos) << u.broken_reason();
  RequestSpec r;
  r.rid = "x";
  r.input_ids = {1};
  EXPECT_EQ(e->submit(r).code(), ErrorCode::kNotReady);
  EXPECT_TRUE(e->model().weights().all_kernel_layout()) << "layouts are put back even when failing";
  // An unrelated completed session does not make it whole; one that rewrites it does.
  auto s2 = u.begin({}, 60, kNow);
  ASSERT_TRUE(s2.ok());
  auto end2 = u.end(s2->session, 3, kNow);
  ASSERT_TRUE(end2.ok());
  EXPECT_FALSE(end2->whole);
  EXPECT_FALSE(u.whole());
  ASSERT_TRUE(push(u, b, 4).ok());
  EXPECT_TRUE(u.whole());
  EXPECT_TRUE(e->submit(r).ok());
  EXPECT_EQ(addresses_of(e->model()), addrs);
}

// After the weights are lost (a memory release), a stacked expert parameter is whole again only
// when every expert's rows have been rewritten, whichever names wrote them.
TEST(WeightUpdater, LostStackedExpertsNeedEveryExpertRewritten) {
  auto e = embedded_engine(small_limits());
  auto& u = e->updater();
  const auto ckpt = checkpoint_of(e->model());
  const auto& c = e->model().config();
  const int64_t I = c.moe_intermediate_size, H = c.hidden_size;
  const std::string fused = "model.layers.0.mlp.experts.gate_up_proj";
  ASSERT_TRUE(ckpt.count(fused)) << "the embedded model stacks its experts";
  u.mark_all_lost("released for the test");
  EXPECT_FALSE(u.whole());
  const auto per_expert = [&](Bucket& b, int64_t from, int64_t to) {
    const auto& bytes = ckpt.at(fused);
    for (int64_t x = from; x < to; ++x) {
      const uint8_t* base = bytes.data() + static_cast<size_t>(x * 2 * I * H) * 4;
      b.add("model.layers.0.mlp.experts." + std::to_string(x) + ".gate_proj.weight", DType::kF32, {I, H}, base,
            static_cast<size_t>(I * H) * 4);
      b.add("model.layers.0.mlp.experts." + std::to_string(x) + ".up_proj.weight", DType::kF32, {I, H},
            base + static_cast<size_t>(I * H) * 4, static_cast<size_t>(I * H) * 4);
    }
  };
  Bucket most;  // everything but the stacked gate_up of layer 0, of which only expert 0
  for (const auto& [name, bytes] : ckpt) {
    if (name == fused) continue;
    const auto* p = e->model().weights().find(name);
    ASSERT_NE(p, nullptr) << name;
    most.add(name, DType::kF32, shape_of(p->storage), bytes.data(), bytes.size());
  }
  per_expert(most, 0, 1);
  ASSERT_TRUE(push(u, most, 2).ok());
  EXPECT_FALSE(u.whole()) << "one expert's rows do not restore the other experts";
  EXPECT_NE(u.broken_reason().find(fused), std::string::npos) << u.broken_reason();
  Bucket rest;
  per_expert(rest, 1, c.num_experts);
  ASSERT_TRUE(push(u, rest, 3).ok());
  EXPECT_TRUE(u.whole()) << u.broken_reason();
}

TEST(WeightUpdater, AbortBeforeAnyBucketLeavesTheModelWhole) {
  auto m = model_with_seed(1);
  const auto before = storage_of(*m);
  WeightUpdater u(m->weights());
  auto s = u.begin({}, 60, kNow);
  ASSERT_TRUE(s.ok());
  auto r = u.abort(s->session, "trainer changed its mind");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
  EXPECT_TRUE(u.whole());
  EXPECT_EQ(storage_of(*m), before);
}

// ---- pause modes ----

RequestSpec greedy(const std::string& rid, uint32_t n) {
  RequestSpec s;
  s.rid = rid;
  s.input_ids = {7, 8, 9};
  s.max_new_tokens = n;
  s.sampling.temperature = 0;
  return s;
}

TEST(EnginePause, AbortModeEndsInFlightRequests) {
  auto e = embedded_engine(small_limits());
  ASSERT_TRUE(e->submit(greedy("a", 50)).ok());
  std::vector<EngineEvent> ev;
  ASSERT_TRUE(e->step(ev).ok());
  auto c = e->pause(Engine::PauseMode::kAbort, ev);
  EXPECT_EQ(c.aborted, 1u);
  EXPECT_EQ(ev.back().kind, EngineEvent::Kind::kFinished);
  EXPECT_EQ(ev.back().abort_reason, "weight_update");
  EXPECT_FALSE(e->has_requests());
}

TEST(EnginePause, RetractRestartsFromThePromptUnderTheNewWeights) {
  auto target = model_with_seed(777);
  auto bucket = full_bucket(*target);
  // Reference: the request run from scratch on the new weights.
  auto ref = embedded_engine(small_limits());
  ASSERT_TRUE(push(ref->updater(), bucket, 2).ok());
  ASSERT_TRUE(ref->submit(greedy("a", 10)).ok());
  std::vector<int32_t> want;
  for (const auto& ev : run_to_idle(*ref)) want.insert(want.end(), ev.token_ids.begin(), ev.token_ids.end());

  auto e = embedded_engine(small_limits());
  ASSERT_TRUE(e->submit(greedy("a", 10)).ok());
  std::vector<EngineEvent> ev;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->step(ev).ok());
  auto c = e->pause(Engine::PauseMode::kRetract, ev);
  EXPECT_EQ(c.retracted, 1u);
  ASSERT_EQ(ev.back().kind, EngineEvent::Kind::kRetracted);
  EXPECT_EQ(ev.back().num_tokens_discarded, 4u);
  EXPECT_FALSE(e->has_work()) << "nothing runs while paused";
  ASSERT_TRUE(push(e->updater(), bucket, 2).ok());
  e->set_weight_version(2);
  e->resume();
  std::vector<int32_t> got;
  for (const auto& x : run_to_idle(*e)) {
    got.insert(got.end(), x.token_ids.begin(), x.token_ids.end());
    for (uint64_t v : x.weight_versions) EXPECT_EQ(v, 2u) << "nothing stale is kept";
  }
  EXPECT_EQ(got, want);
}

TEST(EnginePause, InPlaceKeepsGoingAndVersionsShowTheSwitch) {
  auto e = embedded_engine(small_limits());
  ASSERT_TRUE(e->submit(greedy("a", 8)).ok());
  std::vector<EngineEvent> ev;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e->step(ev).ok());
  auto c = e->pause(Engine::PauseMode::kInPlace, ev);
  EXPECT_EQ(c.paused, 1u);
  ASSERT_TRUE(e->submit(greedy("b", 2)).ok()) << "new requests queue while paused";
  ASSERT_TRUE(push(e->updater(), full_bucket(*model_with_seed(5)), 1).ok());
  e->set_weight_version(1);
  EXPECT_EQ(e->resume(), 1u) << "the held request; 'b' only waits in the queue (SPEC 11.6)";
  EXPECT_EQ(e->resume(), 0u) << "not paused: nothing resumed";
  auto rest = run_to_idle(*e);
  ev.insert(ev.end(), rest.begin(), rest.end());
  std::vector<uint64_t> versions;
  for (const auto& x : ev)
    if (x.rid == "a") versions.insert(versions.end(), x.weight_versions.begin(), x.weight_versions.end());
  EXPECT_EQ(versions, (std::vector<uint64_t>{0, 0, 0, 1, 1, 1, 1, 1}));
}

// Online quantization: a BF16 or FP32 tensor registered with add_mxfp4 is quantized to MXFP4 on
// arrival into its `_blocks` / `_scales` parameters -- the bytes quant::quantize_mxfp4 (checked
// against NumPy and PyTorch goldens in tests/unit/kernels/quant) makes of the same input, at the
// same addresses; other dtypes are refused before anything is written; the blocks and scales also
// take MXFP4 bytes directly (how gpt-oss ships its experts).
TEST(OnlineQuantization, Mxfp4OnArrivalEqualsTheQuantizerAtStableAddresses) {
  auto cfg = embedded_model_config();
  cfg.synthetic_mxfp4_bytes = 3 * 4096 * 2;  // one parameter [3, 4096]
  auto made = MoeDecoder::create(cfg, small_limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  MoeDecoder& m = **made;
  ASSERT_TRUE(init_random_weights(m, 5).ok());
  const auto* blocks = m.weights().find("synthetic_mx.0.weight_blocks");
  const auto* scales = m.weights().find("synthetic_mx.0.weight_scales");
  ASSERT_NE(blocks, nullptr);
  ASSERT_NE(scales, nullptr);
  EXPECT_EQ(shape_of(blocks->storage), (std::vector<int64_t>{3, 128, 16}));
  EXPECT_EQ(shape_of(scales->storage), (std::vector<int64_t>{3, 128}));
  const void* addr_b = blocks->storage.data;
  const void* addr_s = scales->storage.data;

  // Values over several binades, zeros and a negative zero, so every scale differs.
  std::vector<float> x(3 * 4096);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = std::ldexp(static_cast<float>((i * 2654435761u) % 1000) / 250.0f - 2.0f, static_cast<int>(i / 512) % 9 - 4);
  x[7] = 0.0f;
  x[8] = -0.0f;
  auto expect_quantized = [&](const std::vector<float>& in) {
    std::vector<uint8_t> wb(3 * 128 * 16), ws(3 * 128);
    ASSERT_TRUE(quant::quantize_mxfp4({}, TensorView::contiguous(const_cast<float*>(in.data()), DType::kF32, Shape{3, 4096}),
                                      TensorView::contiguous(wb.data(), DType::kU8, Shape{3, 128, 16}),
                                      TensorView::contiguous(ws.data(), DType::kU8, Shape{3, 128}))
                    .ok());
    std::vector<uint8_t> gb, gs;
    ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_blocks"), gb).ok());
    ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_scales"), gs).ok());
    EXPECT_EQ(gb, wb);
    EXPECT_EQ(gs, ws);
  };

  WeightUpdater u(m.weights());
  {  // FP32
    Bucket b;
    b.add("synthetic_mx.0.weight", DType::kF32, {3, 4096}, x.data(), x.size() * 4);
    ASSERT_TRUE(push(u, b, 1).ok());
    expect_quantized(x);
  }
  {  // BF16 (the quantizer sees the same BF16 values, widened)
    std::vector<uint16_t> bf(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bf[i] = f32_to_bf16_bits(x[i] * 3.0f);
      widened[i] = bf16_bits_to_f32(bf[i]);
    }
    Bucket b;
    b.add("synthetic_mx.0.weight", DType::kBF16, {3, 4096}, bf.data(), bf.size() * 2);
    ASSERT_TRUE(push(u, b, 2).ok());
    expect_quantized(widened);
  }
  EXPECT_EQ(blocks->storage.data, addr_b);
  EXPECT_EQ(scales->storage.data, addr_s);

  std::vector<uint8_t> before_b, before_s;
  ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_blocks"), before_b).ok());
  {  // Already-quantized bytes are refused for the BF16 name, and nothing changes.
    std::vector<uint8_t> junk(3 * 4096, 0x11);
    Bucket b;
    b.add("synthetic_mx.0.weight", DType::kU8, {3, 4096}, junk.data(), junk.size());
    auto st = u.begin({}, 60, kNow);
    ASSERT_TRUE(st.ok());
    auto r = u.apply_bucket(st->session, b.entries, b.bytes, std::nullopt, kNow);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("bfloat16 or float32"), std::string::npos) << r.status().message();
    ASSERT_TRUE(u.abort(st->session, "test").ok());
    std::vector<uint8_t> after_b;
    ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_blocks"), after_b).ok());
    EXPECT_EQ(after_b, before_b);
  }
  {  // MXFP4 bytes straight into blocks and scales.
    std::vector<uint8_t> raw_b(3 * 128 * 16), raw_s(3 * 128);
    for (size_t i = 0; i < raw_b.size(); ++i) raw_b[i] = static_cast<uint8_t>(i * 7);
    for (size_t i = 0; i < raw_s.size(); ++i) raw_s[i] = static_cast<uint8_t>(120 + i % 10);
    Bucket b;
    b.add("synthetic_mx.0.weight_blocks", DType::kU8, {3, 128, 16}, raw_b.data(), raw_b.size());
    b.add("synthetic_mx.0.weight_scales", DType::kU8, {3, 128}, raw_s.data(), raw_s.size());
    ASSERT_TRUE(push(u, b, 3).ok());
    std::vector<uint8_t> gb, gs;
    ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_blocks"), gb).ok());
    ASSERT_TRUE(m.weights().read_checkpoint(m.weights().index_of("synthetic_mx.0.weight_scales"), gs).ok());
    EXPECT_EQ(gb, raw_b);
    EXPECT_EQ(gs, raw_s);
  }
}

TEST(OnlineQuantization, Fp8BlockwiseOnArrivalEqualsTheQuantizerAtStableAddresses) {
  constexpr int64_t kRows = 130, kCols = 4096;  // two row blocks, the second partial
  auto cfg = embedded_model_config();
  cfg.synthetic_fp8_bytes = kRows * kCols * 2;
  auto made = MoeDecoder::create(cfg, small_limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  MoeDecoder& m = **made;
  ASSERT_TRUE(init_random_weights(m, 5).ok());
  WeightRegistry& reg = m.weights();
  const size_t qi = reg.index_of("synthetic_fp8.0.weight"), si = reg.index_of("synthetic_fp8.0.weight_scale_inv");
  ASSERT_NE(qi, SIZE_MAX);
  ASSERT_NE(si, SIZE_MAX);
  EXPECT_EQ(reg.parameters()[qi].storage.dtype, DType::kF8E4M3);
  EXPECT_EQ(shape_of(reg.parameters()[qi].storage), (std::vector<int64_t>{kRows, kCols}));
  EXPECT_EQ(shape_of(reg.parameters()[si].storage), (std::vector<int64_t>{2, 32}));
  const void* addr_q = reg.parameters()[qi].storage.data;
  const void* addr_s = reg.parameters()[si].storage.data;

  // Values over several binades per 128 x 128 block, so the blocks' scales differ.
  std::vector<float> x(static_cast<size_t>(kRows * kCols));
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = std::ldexp(static_cast<float>((i * 2654435761u) % 1000) / 250.0f - 2.0f,
                      static_cast<int>((i / kCols) / 16 + (i % kCols) / 128) % 11 - 5);
  auto stored = [&](size_t param) {
    std::vector<uint8_t> out;
    EXPECT_TRUE(reg.read_checkpoint(param, out).ok());
    return out;
  };
  auto expect_quantized = [&](const std::vector<float>& in) {
    std::vector<uint8_t> q(in.size());
    std::vector<float> sc(2 * 32);
    ASSERT_TRUE(quant::quantize_fp8_blockwise(
                    {}, TensorView::contiguous(const_cast<float*>(in.data()), DType::kF32, Shape{kRows, kCols}),
                    quant::Fp8ScaleBlock::k128x128, TensorView::contiguous(q.data(), DType::kF8E4M3, Shape{kRows, kCols}),
                    TensorView::contiguous(sc.data(), DType::kF32, Shape{2, 32}), TensorView{})
                    .ok());
    EXPECT_EQ(stored(qi), q);
    std::vector<uint8_t> sb(sc.size() * 4);
    std::memcpy(sb.data(), sc.data(), sb.size());
    EXPECT_EQ(stored(si), sb);
  };

  WeightUpdater u(reg);
  {  // FP32
    Bucket b;
    b.add("synthetic_fp8.0.weight", DType::kF32, {kRows, kCols}, x.data(), x.size() * 4);
    ASSERT_TRUE(push(u, b, 1).ok());
    expect_quantized(x);
  }
  {  // BF16: the quantizer sees the same BF16 values, widened
    std::vector<uint16_t> bf(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bf[i] = f32_to_bf16_bits(-x[i] * 0.37f);
      widened[i] = bf16_bits_to_f32(bf[i]);
    }
    Bucket b;
    b.add("synthetic_fp8.0.weight", DType::kBF16, {kRows, kCols}, bf.data(), bf.size() * 2);
    ASSERT_TRUE(push(u, b, 2).ok());
    expect_quantized(widened);
  }
  EXPECT_EQ(reg.parameters()[qi].storage.data, addr_q);
  EXPECT_EQ(reg.parameters()[si].storage.data, addr_s);

  const auto before_q = stored(qi), before_s = stored(si);
  {  // float16 is neither quantized nor stored: refused with the accepted dtypes, nothing changes.
    std::vector<uint16_t> h(x.size(), 0x3c00);
    Bucket b;
    b.add("synthetic_fp8.0.weight", DType::kF16, {kRows, kCols}, h.data(), h.size() * 2);
    auto st = u.begin({}, 60, kNow);
    ASSERT_TRUE(st.ok());
    auto r = u.apply_bucket(st->session, b.entries, b.bytes, std::nullopt, kNow);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("float8_e4m3fn"), std::string::npos) << r.status().message();
    ASSERT_TRUE(u.abort(st->session, "test").ok());
    EXPECT_EQ(stored(qi), before_q);
    EXPECT_EQ(stored(si), before_s);
  }
  {  // An FP8 checkpoint (DeepSeek-V3 style): E4M3 bytes and scales go in as they are.
    std::vector<uint8_t> raw_q(x.size());
    std::vector<float> raw_s(2 * 32);
    for (size_t i = 0; i < raw_q.size(); ++i) raw_q[i] = static_cast<uint8_t>((i * 7) & 0x7e);
    for (size_t i = 0; i < raw_s.size(); ++i) raw_s[i] = std::ldexp(1.0f, static_cast<int>(i % 9) - 4);
    Bucket b;
    b.add("synthetic_fp8.0.weight", DType::kF8E4M3, {kRows, kCols}, raw_q.data(), raw_q.size());
    b.add("synthetic_fp8.0.weight_scale_inv", DType::kF32, {2, 32}, raw_s.data(), raw_s.size() * 4);
    ASSERT_TRUE(push(u, b, 3).ok());
    EXPECT_EQ(stored(qi), raw_q);
    std::vector<uint8_t> sb(raw_s.size() * 4);
    std::memcpy(sb.data(), raw_s.data(), sb.size());
    EXPECT_EQ(stored(si), sb);
  }
  // What a session counts as written: a quantized arrival writes the weight and its scales; FP8
  // bytes alone write the weight only.
  auto updated_by = [&](DType dtype, const void* data, size_t nbytes, uint64_t version) -> uint32_t {
    Bucket b;
    b.add("synthetic_fp8.0.weight", dtype, {kRows, kCols}, data, nbytes);
    auto st = u.begin({}, 60, kNow);
    EXPECT_TRUE(st.ok());
    EXPECT_TRUE(u.apply_bucket(st->session, b.entries, b.bytes, std::nullopt, kNow).ok());
    auto end = u.end(st->session, version, kNow);
    EXPECT_TRUE(end.ok());
    return end.ok() ? end->num_parameters_updated : 0;
  };
  EXPECT_EQ(updated_by(DType::kF32, x.data(), x.size() * 4, 4), 2u);
  std::vector<uint8_t> fp8(x.size(), 0x38);
  EXPECT_EQ(updated_by(DType::kF8E4M3, fp8.data(), fp8.size(), 5), 1u);
}

}  // namespace
}  // namespace rolloutd::core
