// The HTTP/1.1 server of the load-balance page and its JSON API (router-svc), on CivetWeb (the
// server prometheus-cpp already links): a pool of workers, one request per connection
// (Connection: close), at most 16 KiB of headers and 1 MiB of body (or what the server is
// started with), and 3 s per read or write, so that slow or silent clients cannot hold the pool. No
// files are served: only what the handler returns.
//
//   HttpServer::Start("127.0.0.1", 0, [](const HttpRequest& r) { return HttpResponse{...}; });
#ifndef MOE_SERVICES_METRICS_HTTP_SERVER_H_
#define MOE_SERVICES_METRICS_HTTP_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

struct mg_connection;
struct mg_context;

namespace moe::metrics {

struct HttpRequest {
  std::string method;  // GET, POST, ...
  std::string path;    // without the query
  std::map<std::string, std::string> query;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

struct HttpResponse {
  HttpResponse(int s = 200, std::string type = "text/plain; charset=utf-8", std::string b = "",
               std::vector<std::pair<std::string, std::string>> h = {})
      : status(s), content_type(std::move(type)), body(std::move(b)), headers(std::move(h)) {}
  int status;
  std::string content_type;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // beyond the standard ones
};

// What both CivetWeb servers of a process (the page, /metrics) hold against idle and slow
// clients: many workers (a connection holds one until its request is in or the timeout cuts
// it), a short timeout for the whole request, no keep-alive.
inline constexpr int kHttpWorkers = 256;
inline constexpr int kHttpRequestTimeoutMs = 3000;

// Runs stop (a CivetWeb mg_stop, which waits for its listener's 2 s poll) while connecting to
// 127.0.0.1:port now and then, so that the listener wakes and sees the stop at once: a server
// stops in milliseconds, not 2 s (SIGTERM's grace is for running calls).
void StopCivetPromptly(int port, const std::function<void()>& stop);

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  // max_body_bytes: a larger request body is answered 413 before it is read.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           Handler handler,
                                                           int workers = kHttpWorkers,
                                                           size_t max_body_bytes = 1 << 20);
  ~HttpServer();
  int port() const { return port_; }
  void Stop();

  // Parses "a=1&b=x%20y" (exposed for tests).
  static std::map<std::string, std::string> ParseQuery(const std::string& q);

 private:
  HttpServer() = default;
  static int Handle(mg_connection* conn, void* self);

  Handler handler_;
  size_t max_body_bytes_ = 1 << 20;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_HTTP_SERVER_H_
