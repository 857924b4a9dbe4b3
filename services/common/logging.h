// The one logging facility of the services and tools: spdlog (Debian libspdlog-dev), to
// stderr, one line per event with time, level and the process's name:
//   2026-12-01T15:04:05.123 info expert-svc: shard shard-0 serving experts [0, 64)
// Levels: trace, debug, info (default), warn, error; every binary takes --log_level (SvcFlags).
//
//   InitLogging("expert-svc");                 // once, in main()
//   MOE_LOG_INFO("shard {} up", name);         // fmt syntax (spdlog's)
//   MOE_LOG_WARN("ReportStats failed: {}", s.ToString());
#ifndef MOE_SERVICES_COMMON_LOGGING_H_
#define MOE_SERVICES_COMMON_LOGGING_H_

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <string>

namespace moe {

// Names the process in every line; safe to call again (the name changes).
void InitLogging(const std::string& name);
// "trace|debug|info|warn|error|off"; false for anything else.
bool SetLogLevel(const std::string& level);
// Whether stderr is a terminal (progress lines redraw in place there, are logged otherwise).
bool StderrIsTerminal();

}  // namespace moe

#define MOE_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define MOE_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define MOE_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define MOE_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)

#endif  // MOE_SERVICES_COMMON_LOGGING_H_
