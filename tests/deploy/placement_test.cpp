// Where a daemon runs on its node (daemon/config.hpp, resolve_placement): GPU by explicit
// flag, then a single visible device, then SLURM_LOCALID / LOCAL_RANK; ports base + local
// index. The environment is a map here, so nothing leaks between cases.
#include <cstdlib>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "daemon/config.hpp"

namespace rolloutd::daemon {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

DaemonConfig cuda() {
  DaemonConfig c;
  c.device = "cuda";
  return c;
}

TEST(Placement, NoEnvironmentMeansIndexZeroAndUnchangedPorts) {
  DaemonConfig c;
  ASSERT_TRUE(resolve_placement(c, 0, env_of({})).ok());
  EXPECT_EQ(c.local_index, 0);
  EXPECT_EQ(c.control_port, 7600);
  EXPECT_EQ(c.http_port, 7700);
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.gpu, -1);
  EXPECT_TRUE(validate(c).ok());
}

TEST(Placement, LocalIndexFromSlurmThenLocalRankAddsToPorts) {
  DaemonConfig c;
  ASSERT_TRUE(resolve_placement(c, 0, env_of({{"SLURM_LOCALID", "3"}, {"LOCAL_RANK", "5"}})).ok());
  EXPECT_EQ(c.local_index, 3);  // Slurm's wins over torchrun's
  EXPECT_EQ(c.control_port, 7603);
  EXPECT_EQ(c.http_port, 7703);
  c = {};
  ASSERT_TRUE(resolve_placement(c, 0, env_of({{"LOCAL_RANK", "5"}})).ok());
  EXPECT_EQ(c.local_index, 5);
  EXPECT_EQ(c.control_port, 7605);
  c = {};
  c.local_index = 1;  // --local-index beats both
  ASSERT_TRUE(resolve_placement(c, 0, env_of({{"SLURM_LOCALID", "3"}})).ok());
  EXPECT_EQ(c.control_port, 7601);
}

TEST(Placement, EphemeralPortsStayEphemeral) {
  DaemonConfig c;
  c.control_port = 0;
  c.http_port = 0;
  ASSERT_TRUE(resolve_placement(c, 0, env_of({{"SLURM_LOCALID", "2"}})).ok());
  EXPECT_EQ(c.control_port, 0);
  EXPECT_EQ(c.http_port, 0);
}

TEST(Placement, ExplicitGpuWins) {
  DaemonConfig c = cuda();
  c.gpu = 6;
  ASSERT_TRUE(resolve_placement(c, 8, env_of({{"CUDA_VISIBLE_DEVICES", "3"}, {"SLURM_LOCALID", "2"}})).ok());
  EXPECT_EQ(c.gpu, 6);
}

TEST(Placement, OneVisibleDeviceIsOrdinalZero) {
  // Slurm --gpus-per-task=1: each task sees its own GPU as device 0, whatever its local id.
  DaemonConfig c = cuda();
  ASSERT_TRUE(resolve_placement(c, 1, env_of({{"CUDA_VISIBLE_DEVICES", "5"}, {"SLURM_LOCALID", "3"}})).ok());
  EXPECT_EQ(c.gpu, 0);
  EXPECT_EQ(c.control_port, 7603);  // ports still follow the local index
  c = cuda();
  ASSERT_TRUE(resolve_placement(c, 1, env_of({{"CUDA_VISIBLE_DEVICES", "GPU-8a7c1f2e-0000"}, {"LOCAL_RANK", "1"}})).ok());
  EXPECT_EQ(c.gpu, 0);
}

TEST(Placement, SharedVisibleSetIsIndexedByLocalRank) {
  DaemonConfig c = cuda();
  ASSERT_TRUE(resolve_placement(c, 4, env_of({{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}, {"LOCAL_RANK", "2"}})).ok());
  EXPECT_EQ(c.gpu, 2);
  c = cuda();
  ASSERT_TRUE(resolve_placement(c, 8, env_of({{"SLURM_LOCALID", "7"}})).ok());  // no CUDA_VISIBLE_DEVICES
  EXPECT_EQ(c.gpu, 7);
  c = cuda();
  ASSERT_TRUE(resolve_placement(c, 8, env_of({})).ok());  // one daemon, no hints: the first GPU
  EXPECT_EQ(c.gpu, 0);
  // CUDA stops at the first invalid entry: "2,-1,3" is one device.
  c = cuda();
  ASSERT_TRUE(resolve_placement(c, 1, env_of({{"CUDA_VISIBLE_DEVICES", "2,-1,3"}, {"LOCAL_RANK", "4"}})).ok());
  EXPECT_EQ(c.gpu, 0);
}

TEST(Placement, AutoPicksCudaOnlyWithAVisibleGpu) {
  DaemonConfig c;
  c.device = "auto";
  c.gpu = 3;
  ASSERT_TRUE(resolve_placement(c, 0, env_of({})).ok());
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.gpu, -1);
  EXPECT_TRUE(validate(c).ok());
  c = {};
  c.device = "auto";
  ASSERT_TRUE(resolve_placement(c, 2, env_of({{"LOCAL_RANK", "1"}})).ok());
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.gpu, 1);
  EXPECT_TRUE(validate(c).ok());
  c = {};
  c.device = "auto";
  EXPECT_EQ(validate(c).field(), "device");  // unresolved
}

TEST(Placement, BadEnvironmentAndPortOverflowAreUsageErrors) {
  DaemonConfig c;
  auto s = resolve_placement(c, 0, env_of({{"SLURM_LOCALID", "two"}}));
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.field(), "SLURM_LOCALID");
  c = {};
  EXPECT_EQ(resolve_placement(c, 0, env_of({{"LOCAL_RANK", "-1"}})).field(), "LOCAL_RANK");
  c = {};
  c.control_port = 65535;
  EXPECT_EQ(resolve_placement(c, 0, env_of({{"SLURM_LOCALID", "1"}})).field(), "control_port");
}

TEST(Placement, ParseConfigResolvesFromTheProcessEnvironment) {
  setenv("SLURM_LOCALID", "2", 1);
  const char* argv[] = {"rolloutd", "--control-port", "9000", "--http-port", "9100", "--device", "auto"};
  auto p = parse_config(7, argv);
  unsetenv("SLURM_LOCALID");
  ASSERT_FALSE(p.exit_now);
  EXPECT_EQ(p.config.local_index, 2);
  EXPECT_EQ(p.config.control_port, 9002);
  EXPECT_EQ(p.config.http_port, 9102);
  EXPECT_NE(p.config.device, "auto");
  EXPECT_EQ(to_json(p.config)["local_index"], 2);

  setenv("SLURM_LOCALID", "x", 1);
  const char* plain[] = {"rolloutd"};
  auto bad = parse_config(1, plain);
  unsetenv("SLURM_LOCALID");
  EXPECT_TRUE(bad.exit_now);
  EXPECT_EQ(bad.exit_code, 64);
}

}  // namespace
}  // namespace rolloutd::daemon
