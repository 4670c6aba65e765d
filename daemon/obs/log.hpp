#pragma once
// JSON-lines logging: one object per line on stdout, so a log shipper (or `jq`)
// reads the daemon's output without a grammar. Every line carries
//   ts (RFC 3339 UTC, microseconds), level, subsys, gpu, msg
// followed by the caller's fields. Field names carry their unit
// (`duration_s`, `size_bytes`); this module does not rename or convert them.
//
// Thread-safe; usable before init_logging() (level info, gpu -1), so start-up
// code that runs before the config is parsed can still log.
#include <functional>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

namespace rolloutd::obs {

enum class LogLevel { kDebug, kInfo, kWarn, kError };

// "debug" | "info" | "warn" | "error" (exactly; the config layer reports anything else).
std::optional<LogLevel> parse_log_level(std::string_view text);
std::string_view log_level_name(LogLevel level);

// Sets the minimum level and the GPU ordinal stamped on every line, and starts the
// once-a-second flush. Meant to be called once at start-up; a second call only
// changes level and gpu.
void init_logging(LogLevel min_level, int gpu);

// Lines go to `sink` (without the trailing newline) instead of stdout, until it is
// called again with an empty function. For tests: the sink runs under the log
// mutex, so it must not log itself.
void set_log_sink_for_test(std::function<void(std::string_view line)> sink);

// Writes buffered lines to stdout now. Lines at warn and above are flushed as they
// are written; call this before a deliberate exit so the last info lines survive.
void flush_logs();

// True if a line at `level` would be written: lets a caller skip building
// expensive fields for a debug line nobody will see.
bool log_enabled(LogLevel level);

// `fields` should be an object; its keys follow the fixed ones. A key that collides
// with a fixed one is written as "field_<key>"; a non-object is written as "fields".
// Never throws: invalid UTF-8 is replaced with U+FFFD rather than losing the line.
void log(LogLevel level, std::string_view subsys, std::string_view msg,
         const nlohmann::json& fields = nlohmann::json::object());

inline void log_debug(std::string_view subsys, std::string_view msg,
                      const nlohmann::json& fields = nlohmann::json::object()) {
  log(LogLevel::kDebug, subsys, msg, fields);
}
inline void log_info(std::string_view subsys, std::string_view msg,
                     const nlohmann::json& fields = nlohmann::json::object()) {
  log(LogLevel::kInfo, subsys, msg, fields);
}
inline void log_warn(std::string_view subsys, std::string_view msg,
                     const nlohmann::json& fields = nlohmann::json::object()) {
  log(LogLevel::kWarn, subsys, msg, fields);
}
inline void log_error(std::string_view subsys, std::string_view msg,
                      const nlohmann::json& fields = nlohmann::json::object()) {
  log(LogLevel::kError, subsys, msg, fields);
}

}  // namespace rolloutd::obs
