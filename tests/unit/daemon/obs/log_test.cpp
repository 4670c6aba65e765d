#include "daemon/obs/log.hpp"

#include <atomic>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace rolloutd::obs {
namespace {

using nlohmann::json;

// Captures every line for the life of the fixture; restores stdout afterwards.
class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    init_logging(LogLevel::kDebug, 0);
    set_log_sink_for_test([this](std::string_view line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(line);
    });
  }
  void TearDown() override {
    set_log_sink_for_test({});
    init_logging(LogLevel::kInfo, -1);
  }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }
  json only_line() {
    auto l = lines();
    EXPECT_EQ(l.size(), 1u);
    return l.empty() ? json() : json::parse(l.back());
  }

  std::mutex mu_;
  std::vector<std::string> lines_;
};

TEST(LogLevelTest, ParsesExactNames) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("info"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("error"), LogLevel::kError);
  EXPECT_FALSE(parse_log_level("INFO"));
  EXPECT_FALSE(parse_log_level("warning"));
  EXPECT_FALSE(parse_log_level(""));
  for (auto l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError}) {
    EXPECT_EQ(parse_log_level(log_level_name(l)), l);
  }
}

// Runs in a fresh process (threadsafe death-test style re-executes the binary), so
// the defaults are seen exactly as main() would before init_logging().
TEST(LogDefaultsDeathTest, BeforeInitLogsInfoWithGpuMinusOne) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::vector<std::string> got;
        set_log_sink_for_test([&](std::string_view line) { got.emplace_back(line); });
        log_debug("test", "hidden");
        log_info("test", "shown");
        set_log_sink_for_test({});
        bool ok = got.size() == 1 && json::parse(got[0])["gpu"] == -1 && json::parse(got[0])["msg"] == "shown";
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(LogTest, FixedKeysComeFirstInOrder) {
  init_logging(LogLevel::kInfo, 5);
  log_info("engine", "step", {{"duration_s", 0.25}, {"batch", 3}});
  auto l = lines();
  ASSERT_EQ(l.size(), 1u);
  const std::string& line = l[0];
  EXPECT_EQ(line.rfind(R"({"ts":")", 0), 0u) << line;
  const size_t ts = line.find("\"ts\""), lv = line.find("\"level\""), sub = line.find("\"subsys\""),
               gpu = line.find("\"gpu\""), msg = line.find("\"msg\""), field = line.find("\"batch\"");
  EXPECT_LT(ts, lv);
  EXPECT_LT(lv, sub);
  EXPECT_LT(sub, gpu);
  EXPECT_LT(gpu, msg);
  EXPECT_LT(msg, field);

  json j = json::parse(line);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["subsys"], "engine");
  EXPECT_EQ(j["gpu"], 5);
  EXPECT_EQ(j["msg"], "step");
  EXPECT_DOUBLE_EQ(j["duration_s"].get<double>(), 0.25);
  EXPECT_EQ(j["batch"], 3);
  static const std::regex kRfc3339(R"(^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$)");
  EXPECT_TRUE(std::regex_match(j["ts"].get<std::string>(), kRfc3339)) << j["ts"];
}

TEST_F(LogTest, EscapesQuotesNewlinesControlAndUnicode) {
  const std::string nasty = "say \"hi\"\nsecond line\r\n\ttab \\ back\x01 caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x9A\x80";
  log_warn("control", nasty, {{"peer", "a\"b\nc"}, {"nested", {{"k", "v\n"}}}});
  auto l = lines();
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].find('\n'), std::string::npos) << "a log record must stay on one line";
  EXPECT_EQ(l[0].find('\r'), std::string::npos);
  json j = json::parse(l[0]);
  EXPECT_EQ(j["msg"], nasty);  // round-trips byte for byte
  EXPECT_EQ(j["peer"], "a\"b\nc");
  EXPECT_EQ(j["nested"]["k"], "v\n");
  EXPECT_EQ(j["level"], "warn");
}

TEST_F(LogTest, InvalidUtf8IsReplacedNotDropped) {
  log_error("protocol", std::string("bad \xFF\xFE bytes"), {{"raw", std::string("\xC3")}});
  json j = only_line();
  EXPECT_EQ(j["level"], "error");
  EXPECT_NE(j["msg"].get<std::string>().find("\xEF\xBF\xBD"), std::string::npos);  // U+FFFD
  EXPECT_NE(j["raw"].get<std::string>().find("\xEF\xBF\xBD"), std::string::npos);
}

TEST_F(LogTest, FieldsCannotOverwriteFixedKeys) {
  log_info("http", "real", {{"msg", "fake"}, {"level", "error"}, {"size_bytes", 10}});
  json j = only_line();
  EXPECT_EQ(j["msg"], "real");
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["field_msg"], "fake");
  EXPECT_EQ(j["field_level"], "error");
  EXPECT_EQ(j["size_bytes"], 10);
}

TEST_F(LogTest, NonObjectFieldsAreKept) {
  log_info("x", "array", json::array({1, 2}));
  json j = only_line();
  EXPECT_EQ(j["fields"], json::array({1, 2}));
}

TEST_F(LogTest, LevelFilteringAndGpu) {
  init_logging(LogLevel::kWarn, 3);
  EXPECT_FALSE(log_enabled(LogLevel::kInfo));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn));
  log_debug("t", "d");
  log_info("t", "i");
  log_warn("t", "w");
  log_error("t", "e");
  log(LogLevel::kInfo, "t", "i2");
  auto l = lines();
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(json::parse(l[0])["msg"], "w");
  EXPECT_EQ(json::parse(l[1])["msg"], "e");
  EXPECT_EQ(json::parse(l[0])["gpu"], 3);

  init_logging(LogLevel::kDebug, 0);
  log_debug("t", "d");
  EXPECT_EQ(lines().size(), 3u);
}

TEST_F(LogTest, ConcurrentWritersProduceWholeLines) {
  constexpr int kThreads = 8, kPerThread = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kPerThread; ++i) log_info("engine", "tick", {{"thread", t}, {"i", i}});
    });
  }
  for (auto& th : threads) th.join();
  auto l = lines();
  ASSERT_EQ(l.size(), static_cast<size_t>(kThreads * kPerThread));
  std::vector<int> per_thread(kThreads, 0);
  for (const auto& line : l) {
    json j = json::parse(line);  // throws (fails the test) on an interleaved line
    per_thread[j["thread"].get<int>()]++;
  }
  for (int n : per_thread) EXPECT_EQ(n, kPerThread);
}

TEST_F(LogTest, WritesJsonLinesToStdoutWithoutCapture) {
  set_log_sink_for_test({});
  ::testing::internal::CaptureStdout();
  log_info("main", "to stdout", {{"port", 8080}});
  flush_logs();
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(out.find('\n'), out.size() - 1);
  json j = json::parse(out);
  EXPECT_EQ(j["msg"], "to stdout");
  EXPECT_EQ(j["port"], 8080);
}

}  // namespace
}  // namespace rolloutd::obs
