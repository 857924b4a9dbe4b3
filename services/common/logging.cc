#include "services/common/logging.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <unistd.h>

#include <memory>

namespace moe {

void InitLogging(const std::string& name) {
  auto logger =
      std::make_shared<spdlog::logger>(name, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %l %n: %v");
  logger->set_level(spdlog::default_logger()->level());
  logger->flush_on(spdlog::level::info);  // a line is on stderr when it is logged
  spdlog::set_default_logger(std::move(logger));
}

bool SetLogLevel(const std::string& level) {
  const spdlog::level::level_enum l = spdlog::level::from_str(level);
  // from_str answers "off" for any name it does not know.
  if (l == spdlog::level::off && level != "off") return false;
  spdlog::set_level(l);
  return true;
}

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

}  // namespace moe
