#include "daemon/config.hpp"

#include <cstdlib>

#include <gtest/gtest.h>

namespace rolloutd::daemon {
namespace {

ParseOutcome parse(std::vector<const char*> args) {
  args.insert(args.begin(), "rolloutd");
  return parse_config(static_cast<int>(args.size()), args.data());
}

TEST(DaemonConfig, DefaultsAreLoopbackAndValid) {
  unsetenv("ROLLOUTD_CONTROL_PORT");
  auto p = parse({});
  ASSERT_FALSE(p.exit_now);
  EXPECT_EQ(p.config.bind_address, "127.0.0.1");
  EXPECT_EQ(p.config.http_bind_address, "127.0.0.1");
  EXPECT_EQ(p.config.control_port, 7600);
  EXPECT_TRUE(validate(p.config).ok());
}

TEST(DaemonConfig, FlagBeatsEnvironmentBeatsDefault) {
  setenv("ROLLOUTD_CONTROL_PORT", "7111", 1);
  setenv("ROLLOUTD_MAX_RUNNING", "3", 1);
  auto p = parse({"--control-port", "7222"});
  ASSERT_FALSE(p.exit_now);
  EXPECT_EQ(p.config.control_port, 7222);
  EXPECT_EQ(p.config.max_running, 3);
  unsetenv("ROLLOUTD_CONTROL_PORT");
  unsetenv("ROLLOUTD_MAX_RUNNING");
  EXPECT_EQ(parse({}).config.max_running, 64);
}

TEST(DaemonConfig, UsageErrorsExit64HelpExits0) {
  auto bad = parse({"--control-port", "70000"});
  EXPECT_TRUE(bad.exit_now);
  EXPECT_EQ(bad.exit_code, 64);
  auto unknown = parse({"--no-such-flag"});
  EXPECT_TRUE(unknown.exit_now);
  EXPECT_EQ(unknown.exit_code, 64);
  auto device = parse({"--device", "tpu"});
  EXPECT_EQ(device.exit_code, 64);
  auto help = parse({"--help"});
  EXPECT_TRUE(help.exit_now);
  EXPECT_EQ(help.exit_code, 0);
}

TEST(DaemonConfig, SemanticChecks) {
  DaemonConfig c;
  c.device = "cuda";
  EXPECT_EQ(validate(c).field(), "gpu");
  c = {};
  c.gpu = 0;
  EXPECT_EQ(validate(c).field(), "gpu");
  c = {};
  c.http_port = c.control_port;
  EXPECT_EQ(validate(c).field(), "http_port");
  c = {};
  c.model = "/models/foo";  // no such checkpoint directory: a usage error naming --model
  EXPECT_EQ(validate(c).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(validate(c).field(), "model");
  c.model = "embedded:other";
  EXPECT_EQ(validate(c).field(), "model");
  c = {};
  c.max_blocks_per_seq = c.kv_blocks + 1;
  EXPECT_EQ(validate(c).field(), "max_blocks_per_seq");
}

TEST(DaemonConfig, QuantizeExpertsFlagThenEnvironmentThenNone) {
  unsetenv("ROLLOUTD_QUANTIZE_EXPERTS");
  EXPECT_EQ(parse({}).config.quantize_experts, "none");
  setenv("ROLLOUTD_QUANTIZE_EXPERTS", "mxfp4", 1);
  EXPECT_EQ(parse({}).config.quantize_experts, "mxfp4");
  EXPECT_EQ(parse({"--quantize-experts", "none"}).config.quantize_experts, "none");
  unsetenv("ROLLOUTD_QUANTIZE_EXPERTS");
  EXPECT_EQ(parse({"--quantize-experts", "fp8"}).exit_code, 64);
  // The embedded model's weights come from a seed: the flag is for checkpoint directories.
  DaemonConfig c;
  c.quantize_experts = "mxfp4";
  EXPECT_EQ(validate(c).field(), "quantize_experts");
  EXPECT_EQ(to_json(c)["quantize_experts"], "mxfp4");
}

TEST(DaemonConfig, PrefixCacheOnByDefaultOffForTheSlidingPoolUnlessAskedFor) {
  unsetenv("ROLLOUTD_PREFIX_CACHE");
  EXPECT_TRUE(parse({}).config.prefix_cache);
  EXPECT_TRUE(parse({"--prefix-cache"}).config.prefix_cache);
  EXPECT_FALSE(parse({"--no-prefix-cache"}).config.prefix_cache);
  setenv("ROLLOUTD_PREFIX_CACHE", "0", 1);
  EXPECT_FALSE(parse({}).config.prefix_cache);
  EXPECT_TRUE(parse({"--prefix-cache"}).config.prefix_cache);  // the flag beats the environment
  unsetenv("ROLLOUTD_PREFIX_CACHE");
  // The pool turns the default off: a valid configuration.
  auto pool = parse({"--sliding-kv-pool"});
  ASSERT_FALSE(pool.exit_now);
  EXPECT_TRUE(pool.config.sliding_kv_pool);
  EXPECT_FALSE(pool.config.prefix_cache);
  EXPECT_TRUE(pool.config.prefix_cache_off_for_pool);  // on again for a model without a pool
  EXPECT_TRUE(validate(pool.config).ok());
  EXPECT_FALSE(parse({}).config.prefix_cache_off_for_pool);
  auto off = parse({"--sliding-kv-pool", "--no-prefix-cache"});
  EXPECT_FALSE(off.config.prefix_cache);
  EXPECT_FALSE(off.config.prefix_cache_off_for_pool) << "turned off by the user: no model turns it on again";
  // Asked for with the pool, by flag or by environment: kept, and refused by validate().
  auto both = parse({"--sliding-kv-pool", "--prefix-cache"});
  ASSERT_FALSE(both.exit_now);
  EXPECT_TRUE(both.config.prefix_cache);
  EXPECT_EQ(validate(both.config).field(), "sliding_kv_pool");
  setenv("ROLLOUTD_PREFIX_CACHE", "1", 1);
  auto env = parse({"--sliding-kv-pool"});
  EXPECT_TRUE(env.config.prefix_cache);
  EXPECT_EQ(validate(env.config).field(), "sliding_kv_pool");
  unsetenv("ROLLOUTD_PREFIX_CACHE");
}

TEST(DaemonConfig, DenseDtypeFlagThenEnvironmentThenAuto) {
  unsetenv("ROLLOUTD_DENSE_DTYPE");
  EXPECT_EQ(parse({}).config.dense_dtype, "auto");
  setenv("ROLLOUTD_DENSE_DTYPE", "float32", 1);
  EXPECT_EQ(parse({}).config.dense_dtype, "float32");
  EXPECT_EQ(parse({"--dense-dtype", "auto"}).config.dense_dtype, "auto");
  unsetenv("ROLLOUTD_DENSE_DTYPE");
  EXPECT_EQ(parse({"--dense-dtype", "bf16"}).exit_code, 64);
  DaemonConfig c;
  c.dense_dtype = "float16";
  EXPECT_EQ(validate(c).field(), "dense_dtype");
  c.dense_dtype = "float32";
  EXPECT_TRUE(validate(c).ok());
  EXPECT_EQ(to_json(c)["dense_dtype"], "float32");
}

TEST(DaemonConfig, KvCacheDtypeFlagThenEnvironmentThenAuto) {
  unsetenv("ROLLOUTD_KV_CACHE_DTYPE");
  EXPECT_EQ(parse({}).config.kv_cache_dtype, "auto");
  for (const char* v : {"auto", "float32", "bfloat16"}) {
    auto flag = parse({"--kv-cache-dtype", v});
    ASSERT_FALSE(flag.exit_now) << v;
    EXPECT_EQ(flag.config.kv_cache_dtype, v);
    EXPECT_TRUE(validate(flag.config).ok()) << v;
    setenv("ROLLOUTD_KV_CACHE_DTYPE", v, 1);
    auto env = parse({});
    ASSERT_FALSE(env.exit_now) << v;
    EXPECT_EQ(env.config.kv_cache_dtype, v);
  }
  setenv("ROLLOUTD_KV_CACHE_DTYPE", "bfloat16", 1);
  EXPECT_EQ(parse({"--kv-cache-dtype", "float32"}).config.kv_cache_dtype, "float32");
  setenv("ROLLOUTD_KV_CACHE_DTYPE", "fp8", 1);
  EXPECT_EQ(parse({}).exit_code, 64);
  unsetenv("ROLLOUTD_KV_CACHE_DTYPE");
  for (const char* bad : {"bf16", "float16", "BFLOAT16", ""})
    EXPECT_EQ(parse({"--kv-cache-dtype", bad}).exit_code, 64) << bad;
  DaemonConfig c;
  c.kv_cache_dtype = "bf16";
  EXPECT_EQ(validate(c).field(), "kv_cache_dtype");
  c.kv_cache_dtype = "bfloat16";
  EXPECT_TRUE(validate(c).ok());
  EXPECT_EQ(to_json(c)["kv_cache_dtype"], "bfloat16");
}

TEST(DaemonConfig, KvCacheDtypeResolution) {
  // Explicit values hold on either backend and whatever the dense projections.
  for (bool cuda : {false, true})
    for (bool dense_bf16 : {false, true}) {
      EXPECT_EQ(resolve_kv_cache_dtype("float32", cuda, dense_bf16), DType::kF32);
      EXPECT_EQ(resolve_kv_cache_dtype("bfloat16", cuda, dense_bf16), DType::kBF16);
    }
  // auto: BF16 only on CUDA with BF16 dense projections.
  EXPECT_EQ(resolve_kv_cache_dtype("auto", true, true), DType::kBF16);
  EXPECT_EQ(resolve_kv_cache_dtype("auto", true, false), DType::kF32);
  EXPECT_EQ(resolve_kv_cache_dtype("auto", false, true), DType::kF32);
  EXPECT_EQ(resolve_kv_cache_dtype("auto", false, false), DType::kF32);
  EXPECT_EQ(dtype_name(resolve_kv_cache_dtype("auto", true, true)), "bfloat16");
  EXPECT_EQ(dtype_name(resolve_kv_cache_dtype("auto", false, false)), "float32");
}

TEST(DaemonConfig, KvCacheBytesBudgetGivesBlocks) {
  unsetenv("ROLLOUTD_KV_CACHE_BYTES");
  EXPECT_EQ(parse({}).config.kv_cache_bytes, 0u);
  EXPECT_EQ(parse({"--kv-cache-bytes", "1073741824"}).config.kv_cache_bytes, uint64_t{1} << 30);
  setenv("ROLLOUTD_KV_CACHE_BYTES", "2048", 1);
  EXPECT_EQ(parse({}).config.kv_cache_bytes, 2048u);
  unsetenv("ROLLOUTD_KV_CACHE_BYTES");
  EXPECT_EQ(parse({"--kv-cache-bytes", "-1"}).exit_code, 64);
  // With a budget, --kv-blocks is not what max_blocks_per_seq is held to (the model decides).
  DaemonConfig c;
  c.max_blocks_per_seq = c.kv_blocks + 1;
  EXPECT_EQ(validate(c).field(), "max_blocks_per_seq");
  c.kv_cache_bytes = uint64_t{1} << 30;
  EXPECT_TRUE(validate(c).ok());
  // 1 GiB over 64 KiB blocks: 16,384 blocks; a budget of 3.5 blocks holds 3 (rounded down).
  auto blocks = kv_blocks_for_budget(uint64_t{1} << 30, 65536, 256);
  ASSERT_TRUE(blocks.ok());
  EXPECT_EQ(*blocks, 16384);
  blocks = kv_blocks_for_budget(3 * 65536 + 32768, 65536, 3);
  ASSERT_TRUE(blocks.ok());
  EXPECT_EQ(*blocks, 3);
  // Fewer blocks than one request's longest table: refused, naming the figures.
  blocks = kv_blocks_for_budget(3 * 65536 + 32768, 65536, 4);
  ASSERT_FALSE(blocks.ok());
  EXPECT_EQ(blocks.status().field(), "kv_cache_bytes");
  EXPECT_NE(blocks.status().message().find("holds 3 KV blocks of 65536 bytes"), std::string::npos)
      << blocks.status().message();
  // At most 2^24 blocks, as --kv-blocks.
  blocks = kv_blocks_for_budget(uint64_t{1} << 50, 16, 1);
  ASSERT_TRUE(blocks.ok());
  EXPECT_EQ(*blocks, int64_t{1} << 24);
  EXPECT_FALSE(kv_blocks_for_budget(1 << 20, 0, 1).ok());
}

TEST(DaemonConfig, JsonHasEverySetting) {
  const auto j = to_json(DaemonConfig{});
  for (const char* k : {"bind", "control_port", "http_port", "model", "device", "max_running", "kv_blocks",
                        "outbox_limit", "drain_timeout_s", "log_level", "quantize_experts", "dense_dtype",
                        "kv_cache_dtype", "kv_cache_bytes"})
    EXPECT_TRUE(j.contains(k)) << k;
}

}  // namespace
}  // namespace rolloutd::daemon
