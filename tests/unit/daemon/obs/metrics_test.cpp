#include "daemon/obs/metrics.hpp"

#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>

namespace rolloutd::obs {
namespace {

// "name{labels} value" lines of the exposition, keyed by everything before the value.
std::map<std::string, double> samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    EXPECT_NE(sp, std::string::npos) << line;
    if (sp == std::string::npos) continue;
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

size_t count_series(const std::map<std::string, double>& s, const std::string& family) {
  size_t n = 0;
  for (const auto& [key, value] : s) {
    if (key.rfind(family + "{", 0) == 0 || key == family) ++n;
  }
  return n;
}

TEST(MetricsTest, ExposesExactNamesAfterUpdates) {
  Metrics m;
  m.on_request("generate");
  m.on_request("generate");
  m.on_request("status");
  m.on_error("out_of_range");
  m.add_prompt_tokens(7);
  m.add_generated_tokens(5);
  m.add_generated_tokens(3);
  m.add_preemptions(2, 40);
  m.add_preemptions(1, 9);
  m.on_finished("stop");
  m.on_finished("length");
  m.on_stream_abort("client_gone");
  m.on_reply_dropped();
  m.on_reply_dropped();
  m.set_queue_depth(4, 2);
  m.observe_step_seconds(0.003);
  m.observe_control_seconds(0.00002);
  m.set_ready(true);
  m.set_weight_version(42);
  m.set_uptime_seconds(12.5);
  m.set_build_info("0.1.0", false);

  const std::string text = m.serialize();
  auto s = samples(text);
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="generate"})"], 2);
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="status"})"], 1);
  EXPECT_EQ(s[R"(rolloutd_errors_total{code="out_of_range"})"], 1);
  EXPECT_EQ(s["rolloutd_prompt_tokens_total"], 7);
  EXPECT_EQ(s["rolloutd_tokens_generated_total"], 8);
  EXPECT_EQ(s["rolloutd_preemptions_total"], 3);
  EXPECT_EQ(s["rolloutd_recomputed_tokens_total"], 49);
  EXPECT_EQ(s[R"(rolloutd_requests_finished_total{reason="stop"})"], 1);
  EXPECT_EQ(s[R"(rolloutd_requests_finished_total{reason="length"})"], 1);
  EXPECT_EQ(s[R"(rolloutd_stream_aborts_total{reason="client_gone"})"], 1);
  EXPECT_EQ(s["rolloutd_replies_dropped_total"], 2);
  EXPECT_EQ(s[R"(rolloutd_queue_depth{state="waiting"})"], 4);
  EXPECT_EQ(s[R"(rolloutd_queue_depth{state="running"})"], 2);
  EXPECT_EQ(s["rolloutd_engine_step_duration_seconds_count"], 1);
  EXPECT_DOUBLE_EQ(s["rolloutd_engine_step_duration_seconds_sum"], 0.003);
  EXPECT_EQ(s[R"(rolloutd_engine_step_duration_seconds_bucket{le="+Inf"})"], 1);
  EXPECT_EQ(s["rolloutd_control_handle_duration_seconds_count"], 1);
  EXPECT_EQ(s["rolloutd_ready"], 1);
  EXPECT_EQ(s["rolloutd_weight_version"], 42);
  EXPECT_EQ(s["rolloutd_uptime_seconds"], 12.5);
  EXPECT_EQ(s[R"(rolloutd_build_info{cuda="false",version="0.1.0"})"], 1);

  // Counters are named with _total exactly once: the 1.0 serializer adds no suffix.
  EXPECT_EQ(text.find("_total_total"), std::string::npos);
  EXPECT_NE(text.find("# TYPE rolloutd_requests_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE rolloutd_queue_depth gauge"), std::string::npos);
  EXPECT_NE(text.find("# TYPE rolloutd_engine_step_duration_seconds histogram"), std::string::npos);
  for (const auto& [key, value] : s) EXPECT_EQ(key.rfind("rolloutd_", 0), 0u) << key;
}

TEST(MetricsTest, HistogramBucketsSpan100usTo10s) {
  Metrics m;
  m.observe_step_seconds(0.00005);  // below the first bound
  m.observe_step_seconds(20.0);     // above the last
  auto s = samples(m.serialize());
  // 16 finite bounds + "+Inf".
  size_t buckets = 0;
  double first = -1;
  for (const auto& [key, value] : s) {
    if (key.rfind("rolloutd_engine_step_duration_seconds_bucket{", 0) != 0) continue;
    ++buckets;
    const std::string le = key.substr(key.find("le=\"") + 4);
    const std::string bound = le.substr(0, le.find('"'));
    if (bound != "+Inf" && (first < 0 || std::stod(bound) < first)) first = std::stod(bound);
    if (bound == "+Inf") {
      EXPECT_EQ(value, 2);
    }
  }
  EXPECT_EQ(buckets, 17u);
  EXPECT_DOUBLE_EQ(first, 1e-4);
  EXPECT_EQ(s[R"(rolloutd_engine_step_duration_seconds_bucket{le="10"})"], 1);
}

TEST(MetricsTest, ClosedLabelSetsStartAtZero) {
  Metrics m;
  auto s = samples(m.serialize());
  for (const char* r : {"stop", "length", "abort", "failed"}) {
    const std::string key = std::string(R"(rolloutd_requests_finished_total{reason=")") + r + "\"}";
    ASSERT_TRUE(s.count(key)) << key;
    EXPECT_EQ(s[key], 0);
  }
  EXPECT_TRUE(s.count(R"(rolloutd_stream_aborts_total{reason="backpressure"})"));
  EXPECT_EQ(s.count("rolloutd_replies_dropped_total"), 1u);
  EXPECT_TRUE(s.count(R"(rolloutd_errors_total{code="internal"})"));
  EXPECT_TRUE(s.count(R"(rolloutd_errors_total{code="bad_message"})"));
  EXPECT_FALSE(s.count(R"(rolloutd_errors_total{code="ok"})"));
  EXPECT_EQ(s["rolloutd_ready"], 0);
}

TEST(MetricsTest, LabelValuesAreCappedWithOther) {
  Metrics m(8);
  for (int i = 0; i < 20; ++i) m.on_request("type" + std::to_string(i));
  m.on_request("type0");   // an admitted value keeps its own series
  m.on_request("");        // no empty label values
  auto s = samples(m.serialize());
  EXPECT_EQ(count_series(s, "rolloutd_requests_total"), 8u);  // 7 named + "other"
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="type0"})"], 2);
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="type6"})"], 1);
  EXPECT_FALSE(s.count(R"(rolloutd_requests_total{type="type7"})"));
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="other"})"], 14);  // type7..type19 and ""
}

TEST(MetricsTest, DefaultCapIs64SeriesPerFamily) {
  Metrics m;
  for (int i = 0; i < 200; ++i) m.on_error("code" + std::to_string(i));
  auto s = samples(m.serialize());
  EXPECT_EQ(count_series(s, "rolloutd_errors_total"), Metrics::kDefaultMaxLabelValues);
}

TEST(MetricsTest, BuildInfoIsReplacedNotDuplicated) {
  Metrics m;
  m.set_build_info("0.1.0", false);
  m.set_build_info("0.2.0", true);
  auto s = samples(m.serialize());
  EXPECT_EQ(count_series(s, "rolloutd_build_info"), 1u);
  EXPECT_EQ(s[R"(rolloutd_build_info{cuda="true",version="0.2.0"})"], 1);
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  Metrics m;
  constexpr int kThreads = 4, kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < kPerThread; ++i) {
        m.add_generated_tokens(1);
        m.on_request(t % 2 ? "generate" : "abort");
        m.observe_step_seconds(0.001);
        if (i % 1000 == 0) (void)m.serialize();  // scrapes race with updates
      }
    });
  }
  for (auto& th : threads) th.join();
  auto s = samples(m.serialize());
  EXPECT_EQ(s["rolloutd_tokens_generated_total"], kThreads * kPerThread);
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="generate"})"], kThreads / 2 * kPerThread);
  EXPECT_EQ(s[R"(rolloutd_requests_total{type="abort"})"], kThreads / 2 * kPerThread);
  EXPECT_EQ(s["rolloutd_engine_step_duration_seconds_count"], kThreads * kPerThread);
}

TEST(MetricsTest, OtherModulesRegisterIntoTheSameExposition) {
  Metrics m;
  prometheus::BuildCounter()
      .Name("rolloutd_weight_updates_total")
      .Help("test")
      .Register(m.registry())
      .Add({})
      .Increment(3);
  auto s = samples(m.serialize());
  EXPECT_EQ(s["rolloutd_weight_updates_total"], 3);
}

}  // namespace
}  // namespace rolloutd::obs
