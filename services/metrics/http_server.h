// The HTTP/1.1 server of every plain-HTTP front of a process: router-svc's load-balance page and
// its JSON API, attention-svc's REST front (the Open Inference Protocol) and /metrics
// (MetricsServer). On libmicrohttpd (GNU, Debian libmicrohttpd-dev): one epoll thread holds
// every connection, so a connection that sends nothing, or a byte now and then, costs a socket
// and a few KiB, never a thread; the handlers run on a small pool of their own, so a slow
// handler (a Forward) does not stop the event loop either. Against idle and slow clients:
// at most `max_connections` connections, `max_connections_per_address` from one client address,
// the headers within `header_deadline` of the accept and the whole request within
// `request_deadline` (trickling bytes does not extend either), one request per connection
// (Connection: close). Framing by RFC 9112: conflicting Content-Length headers, or one beside
// Transfer-Encoding, are refused (400), a body shorter than its Content-Length is never served
// (the connection is closed at its deadline), a body coded with anything but identity is
// refused naming the coding (415). No files are served: only what the handler returns.
//
//   HttpServer::Start("127.0.0.1", 0, [](const HttpRequest& r) { return HttpResponse{...}; });
#ifndef MOE_SERVICES_METRICS_HTTP_SERVER_H_
#define MOE_SERVICES_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

struct MHD_Daemon;

namespace moe::metrics {

struct HttpRequest {
  std::string method;  // GET, POST, ...
  std::string path;    // without the query
  std::map<std::string, std::string> query;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string peer;  // the client's address (no port)
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

struct HttpServerOptions {
  int workers = 4;                     // threads that run the handler (it may block: a Forward)
  int max_queued_requests = 256;       // complete requests waiting for a worker; past it 503
  size_t max_body_bytes = 1 << 20;     // a larger body is answered 413 before it is read
  size_t max_header_bytes = 16 << 10;  // request line and headers; past it 431
  int max_connections = 4096;
  int max_connections_per_address = 64;
  absl::Duration header_deadline = absl::Seconds(3);    // from the accept
  absl::Duration request_deadline = absl::Seconds(10);  // from the accept, body included
};

// The counts a server keeps (tests, logs).
struct HttpServerStats {
  int64_t requests = 0;  // answered by the handler
  int64_t refused = 0;   // answered by the server (framing, sizes, codings, a full queue)
  int64_t cut_off = 0;   // connections closed at their header or request deadline
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           Handler handler,
                                                           const HttpServerOptions& options);
  // The page's defaults with `workers` handler threads and a body limit.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           Handler handler, int workers = 4,
                                                           size_t max_body_bytes = 1 << 20);
  ~HttpServer();
  int port() const { return port_; }
  HttpServerStats stats() const;
  // Stops accepting, answers queued requests 503, waits for running handlers; idempotent.
  void Stop();

  // Parses "a=1&b=x%20y" (exposed for tests).
  static std::map<std::string, std::string> ParseQuery(const std::string& q);

 private:
  class Impl;
  HttpServer() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_HTTP_SERVER_H_
