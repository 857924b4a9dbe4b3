// A small HTTP/1.1 server for the load-balance page and its JSON API (router-svc): one accept
// thread, a few connection workers, one request per connection (Connection: close), bounded
// request sizes and socket timeouts. Not a general web server: it serves what the handler
// returns, on loopback or wherever it is bound.
//
//   HttpServer::Start("127.0.0.1", 0, [](const HttpRequest& r) { return HttpResponse{...}; });
#ifndef MOE_SERVICES_METRICS_HTTP_SERVER_H_
#define MOE_SERVICES_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::metrics {

struct HttpRequest {
  std::string method;  // GET, POST, ...
  std::string path;    // without the query
  std::map<std::string, std::string> query;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           Handler handler, int workers = 2);
  ~HttpServer();
  int port() const { return port_; }
  void Stop();

  // Parses "a=1&b=x%20y" (exposed for tests).
  static std::map<std::string, std::string> ParseQuery(const std::string& q);

 private:
  HttpServer() = default;
  void AcceptLoop();
  void Serve(int fd);

  Handler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> active_{0};
  int max_active_ = 2;
  std::thread accept_thread_;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_HTTP_SERVER_H_
