#include "services/metrics/http_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <mutex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moe::metrics {

namespace {

constexpr size_t kMaxHeaderBytes = 16 << 10;

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 409:
      return "Conflict";
    case 412:
      return "Precondition Failed";
    case 413:
      return "Payload Too Large";
    case 503:
      return "Service Unavailable";
    default:
      return status < 500 ? "Client Error" : "Server Error";
  }
}

// A complete response (Connection: close; CivetWeb closes after it).
void Respond(mg_connection* conn, const HttpResponse& r) {
  const std::string head =
      absl::StrCat("HTTP/1.1 ", r.status, " ", Reason(r.status),
                   "\r\nContent-Type: ", r.content_type, "\r\nContent-Length: ", r.body.size(),
                   "\r\nCache-Control: no-store\r\nConnection: close\r\n");
  std::string extra;
  for (const auto& [name, value] : r.headers) absl::StrAppend(&extra, name, ": ", value, "\r\n");
  const std::string all = absl::StrCat(head, extra, "\r\n");
  mg_write(conn, all.data(), all.size());
  if (!r.body.empty()) mg_write(conn, r.body.data(), r.body.size());
}

std::string Unescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(s[i + 1]) &&
               std::isxdigit(s[i + 2])) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

std::map<std::string, std::string> HttpServer::ParseQuery(const std::string& q) {
  std::map<std::string, std::string> out;
  for (absl::string_view part : absl::StrSplit(q, '&', absl::SkipEmpty())) {
    const size_t eq = part.find('=');
    if (eq == absl::string_view::npos) {
      out[Unescape(part)] = "";
    } else {
      out[Unescape(part.substr(0, eq))] = Unescape(part.substr(eq + 1));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                              Handler handler, int workers,
                                                              size_t max_body_bytes) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->handler_ = std::move(handler);
  s->max_body_bytes_ = max_body_bytes;
  const bool v6 = host.find(':') != std::string::npos;
  const std::string ports =
      v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
  const std::string threads = absl::StrCat(std::max(1, workers));
  const std::string timeout = absl::StrCat(kHttpRequestTimeoutMs);
  const std::string max_request = absl::StrCat(kMaxHeaderBytes);
  // No document root: nothing but the handler is served.
  const char* options[] = {"listening_ports",
                           ports.c_str(),
                           "num_threads",
                           threads.c_str(),
                           "request_timeout_ms",
                           timeout.c_str(),
                           "max_request_size",
                           max_request.c_str(),
                           "enable_keep_alive",
                           "no",
                           nullptr};
  mg_callbacks callbacks = {};
  // CivetWeb logs to stderr by default; its errors become the response or Start's status.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  s->ctx_ = mg_start(&callbacks, s.get(), options);
  if (s->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("web server: cannot listen on ", ports));
  }
  mg_set_request_handler(s->ctx_, "/", &HttpServer::Handle, s.get());
  mg_server_port bound[4] = {};
  if (mg_get_server_ports(s->ctx_, 4, bound) < 1) {
    return absl::InternalError("web server: no listening port");
  }
  s->port_ = bound[0].port;
  return s;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (ctx_ == nullptr) return;
  // Waits for the workers (bounded by the request timeout) and the listener (woken at once).
  StopCivetPromptly(port_, [this] { mg_stop(ctx_); });
  ctx_ = nullptr;
}

void StopCivetPromptly(int port, const std::function<void()>& stop) {
  std::atomic<bool> done{false};
  std::thread stopper([&] {
    stop();
    done = true;
  });
  // Bounded: the stop itself ends by the request timeout; these pokes only wake the listener.
  for (int i = 0; i < 500 && !done.load(); ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      sockaddr_in a = {};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
      (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      ::close(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stopper.join();
}

int HttpServer::Handle(mg_connection* conn, void* self) {
  const mg_request_info* ri = mg_get_request_info(conn);
  HttpRequest req;
  req.method = ri->request_method != nullptr ? ri->request_method : "";
  req.path = ri->local_uri != nullptr ? ri->local_uri : "";
  if (ri->query_string != nullptr) req.query = ParseQuery(ri->query_string);
  for (int i = 0; i < ri->num_headers; ++i) {
    req.headers[absl::AsciiStrToLower(ri->http_headers[i].name)] =
        std::string(absl::StripAsciiWhitespace(ri->http_headers[i].value));
  }
  const size_t max_body = static_cast<HttpServer*>(self)->max_body_bytes_;
  if (ri->content_length > static_cast<long long>(max_body)) {
    Respond(conn, {413, "text/plain; charset=utf-8", "body too large\n"});
    return 413;
  }
  char buf[4096];
  for (;;) {
    const int n = mg_read(conn, buf, sizeof(buf));
    if (n <= 0) break;
    req.body.append(buf, static_cast<size_t>(n));
    if (req.body.size() > max_body) {
      Respond(conn, {413, "text/plain; charset=utf-8", "body too large\n"});
      return 413;
    }
  }
  const HttpResponse resp = static_cast<HttpServer*>(self)->handler_(req);
  Respond(conn, resp);
  return resp.status;
}

}  // namespace moe::metrics
