// Fuzz target: the daemon's settings parser, daemon::parse_config (CLI11 over argv, the
// ROLLOUTD_* environment twins, the placement variables), then validate() and the JSON the
// daemon logs as its first line.
//
// Input: NUL-separated tokens. A token "$NAME=VALUE" sets an environment variable (only
// ROLLOUTD_* and the placement variables SLURM_LOCALID, LOCAL_RANK, CUDA_VISIBLE_DEVICES;
// unset again afterwards), every other token is one argv element after "rolloutd".
// tests/fuzz/run.sh passes a dictionary of the flag and variable names found in
// daemon/config.cpp.
//
// Oracle beyond the sanitizers: no exception escapes (the daemon calls parse_config
// outside any try block, so one would abort the process instead of exiting 64), and a
// refusal is exit code 64 (usage) or 0 (--help, --version), never anything else.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/config.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace rolloutd;

namespace {

bool allowed_env(std::string_view name) {
  return name.rfind("ROLLOUTD_", 0) == 0 || name == "SLURM_LOCALID" || name == "LOCAL_RANK" ||
         name == "CUDA_VISIBLE_DEVICES";
}

// CLI11 prints usage errors and --help to std::cout/std::cerr: keep the fuzzer's output
// readable by sending them nowhere (a stream without a buffer drops what it is given).
struct Silence {
  Silence() {
    std::cout.rdbuf(nullptr);
    std::cerr.rdbuf(nullptr);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Silence silence;
  std::vector<std::string> args{"rolloutd"};
  std::vector<std::string> env_set;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  while (start <= all.size() && args.size() + env_set.size() < 64) {
    size_t end = all.find('\0', start);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view tok = all.substr(start, end - start);
    start = end + 1;
    if (!tok.empty() && tok[0] == '$') {
      const size_t eq = tok.find('=');
      if (eq == std::string_view::npos) continue;
      const std::string name(tok.substr(1, eq - 1));
      if (!allowed_env(name)) continue;
      if (setenv(name.c_str(), std::string(tok.substr(eq + 1)).c_str(), 1) == 0) env_set.push_back(name);
    } else {
      args.emplace_back(tok);
    }
  }
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);

  daemon::ParseOutcome out = daemon::parse_config(static_cast<int>(args.size()), argv.data());
  static fuzz::Tally tally("config");
  tally.count(!out.exit_now && daemon::validate(out.config).ok());
  if (out.exit_now) {
    FUZZ_CHECK(out.exit_code == 0 || out.exit_code == 64, "parse_config exit code %d", out.exit_code);
  } else {
    (void)daemon::validate(out.config);
    // What obs::log does with the configuration line (invalid UTF-8 replaced, never thrown).
    const std::string line = daemon::to_json(out.config).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    FUZZ_CHECK(!line.empty(), "empty configuration JSON");
  }
  for (const auto& name : env_set) unsetenv(name.c_str());
  return 0;
}
