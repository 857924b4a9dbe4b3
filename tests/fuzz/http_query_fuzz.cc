// libFuzzer target: the HTTP fronts' query-string parser (metrics/http_server.h; the rest of
// HTTP is libmicrohttpd's) on any bytes: every key and value it returns comes from the input,
// unescaped, never longer than the input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "services/metrics/http_server.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string q(reinterpret_cast<const char*>(data), size);
  size_t total = 0;
  for (const auto& [k, v] : moe::metrics::HttpServer::ParseQuery(q)) total += k.size() + v.size();
  if (total > size) __builtin_trap();
  return 0;
}
