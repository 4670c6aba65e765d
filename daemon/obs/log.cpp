#include "daemon/obs/log.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <spdlog/details/log_msg.h>
#include <spdlog/logger.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

namespace rolloutd::obs {
namespace {

// One sink for both destinations so that switching to a test capture is a member
// change under the sink's own mutex: swapping sinks on a live logger is not
// thread-safe in spdlog, and a second logger would split the flush policy.
// base_sink<std::mutex> is what spdlog's *_mt sinks are built on.
class JsonLineSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void set_capture(std::function<void(std::string_view)> capture) {
    std::lock_guard<std::mutex> lock(mutex_);
    capture_ = std::move(capture);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    if (capture_) {
      std::string_view line(buf.data(), buf.size());
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
      capture_(line);
      return;
    }
    std::fwrite(buf.data(), 1, buf.size(), stdout);
  }
  void flush_() override { std::fflush(stdout); }

 private:
  std::function<void(std::string_view)> capture_;
};

struct LogState {
  std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
  std::atomic<int> gpu{-1};
  std::shared_ptr<JsonLineSink> sink;
  std::shared_ptr<spdlog::logger> logger;
};

LogState& state() {
  // Leaked on purpose: destructors of other statics (and threads still running at
  // exit) may log, and must never see a destroyed logger.
  static LogState* const s = [] {
    auto* st = new LogState;
    st->sink = std::make_shared<JsonLineSink>();
    st->sink->set_pattern("%v");  // the payload is the whole JSON object
    st->logger = std::make_shared<spdlog::logger>("rolloutd.jsonl", st->sink);
    st->logger->set_level(spdlog::level::trace);  // filtering happens before encoding
    // A warn or error is often the last line before a crash or a kill: write it now.
    st->logger->flush_on(spdlog::level::warn);
    try {
      spdlog::register_logger(st->logger);  // flush_every only reaches registered loggers
    } catch (const spdlog::spdlog_ex&) {
      // Name taken by someone else: lines still flush on warn and at exit.
    }
    // Bounds what a SIGKILL loses to about one second of info lines.
    spdlog::flush_every(std::chrono::seconds(1));
    return st;
  }();
  return *s;
}

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
  }
  return spdlog::level::err;
}

// RFC 3339, UTC, microseconds: 2024-05-01T12:34:56.123456Z
std::string rfc3339_now() {
  const auto now = std::chrono::system_clock::now();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count();
  std::time_t secs = static_cast<std::time_t>(us / 1000000);
  long frac = static_cast<long>(us % 1000000);
  if (frac < 0) {  // before 1970: keep the fraction positive
    frac += 1000000;
    secs -= 1;
  }
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const int n = std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900,
                              tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, frac);
  return std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}

bool is_fixed_key(std::string_view key) {
  return key == "ts" || key == "level" || key == "subsys" || key == "gpu" || key == "msg";
}

std::string encode_line(LogLevel level, std::string_view subsys, std::string_view msg,
                        const nlohmann::json& fields, int gpu) {
  // ordered_json keeps the fixed keys first, in the documented order.
  nlohmann::ordered_json line;
  line["ts"] = rfc3339_now();
  line["level"] = std::string(log_level_name(level));
  line["subsys"] = std::string(subsys);
  line["gpu"] = gpu;
  line["msg"] = std::string(msg);
  if (fields.is_object()) {
    for (const auto& [key, value] : fields.items()) {
      line[is_fixed_key(key) ? "field_" + key : key] = value;
    }
  } else if (!fields.is_null()) {
    line["fields"] = fields;
  }
  // `replace`: a peer-supplied string with broken UTF-8 must not cost the whole line.
  return line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

std::optional<LogLevel> parse_log_level(std::string_view text) {
  if (text == "debug") return LogLevel::kDebug;
  if (text == "info") return LogLevel::kInfo;
  if (text == "warn") return LogLevel::kWarn;
  if (text == "error") return LogLevel::kError;
  return std::nullopt;
}

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
  }
  return "error";
}

void init_logging(LogLevel min_level, int gpu) {
  LogState& s = state();
  s.min_level.store(static_cast<int>(min_level), std::memory_order_relaxed);
  s.gpu.store(gpu, std::memory_order_relaxed);
}

void set_log_sink_for_test(std::function<void(std::string_view line)> sink) {
  state().sink->set_capture(std::move(sink));
}

void flush_logs() { state().logger->flush(); }

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) >= state().min_level.load(std::memory_order_relaxed);
}

void log(LogLevel level, std::string_view subsys, std::string_view msg, const nlohmann::json& fields) {
  if (!log_enabled(level)) return;
  LogState& s = state();
  std::string line;
  try {
    line = encode_line(level, subsys, msg, fields, s.gpu.load(std::memory_order_relaxed));
  } catch (...) {
    // Only allocation failure gets here; say that a line was lost rather than nothing.
    line = R"({"level":"error","subsys":"log","msg":"log line could not be encoded"})";
  }
  // spdlog catches sink exceptions itself (its error handler writes to stderr).
  s.logger->log(to_spdlog(level), spdlog::string_view_t(line.data(), line.size()));
}

}  // namespace rolloutd::obs
