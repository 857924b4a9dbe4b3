#include "services/metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moe::metrics {

namespace {

constexpr size_t kMaxHeaderBytes = 16 << 10;
constexpr size_t kMaxBodyBytes = 1 << 20;

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

void WriteAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
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
                                                              Handler handler, int workers) {
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->handler_ = std::move(handler);
  s->max_active_ = std::max(1, workers);
  const bool v6 = host.find(':') != std::string::npos;
  s->listen_fd_ = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0) return absl::InternalError("socket() failed");
  const int one = 1;
  ::setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_storage addr = {};
  socklen_t len = 0;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET6, host.c_str(), &a->sin6_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("bad address ", host));
    }
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, host.c_str(), &a->sin_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("bad address ", host));
    }
    len = sizeof(*a);
  }
  if (::bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(s->listen_fd_, 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("web server: cannot listen on ", host, ":", port, ": ", std::strerror(errno)));
  }
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = v6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  s->accept_thread_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  // Connection threads are detached; wait (bounded by their socket timeouts) until they end.
  for (int i = 0; i < 600 && active_.load() > 0; ++i) ::usleep(10000);
}

void HttpServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd p = {listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    timeval tv = {5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (active_.load() >= max_active_ * 4) {  // overloaded: refuse rather than queue forever
      WriteAll(
          fd, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
      ::close(fd);
      continue;
    }
    ++active_;
    std::thread([this, fd] {
      Serve(fd);
      ::close(fd);
      --active_;
    }).detach();
  }
}

void HttpServer::Serve(int fd) {
  std::string data;
  char buf[4096];
  size_t header_end = std::string::npos;
  while (header_end == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    data.append(buf, static_cast<size_t>(n));
    header_end = data.find("\r\n\r\n");
    if (header_end == std::string::npos && data.size() > kMaxHeaderBytes) {
      WriteAll(fd,
               "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
      return;
    }
  }
  HttpRequest req;
  std::vector<std::string> lines = absl::StrSplit(data.substr(0, header_end), "\r\n");
  std::vector<std::string> first = absl::StrSplit(lines[0], ' ');
  HttpResponse resp;
  if (first.size() != 3) {
    resp = {400, "text/plain; charset=utf-8", "bad request line\n"};
  } else {
    req.method = first[0];
    const size_t q = first[1].find('?');
    req.path = first[1].substr(0, q);
    if (q != std::string::npos) req.query = ParseQuery(first[1].substr(q + 1));
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == std::string::npos) continue;
      req.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
          std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
    }
    size_t content_length = 0;
    if (auto it = req.headers.find("content-length"); it != req.headers.end()) {
      if (!absl::SimpleAtoi(it->second, &content_length)) content_length = kMaxBodyBytes + 1;
    }
    if (content_length > kMaxBodyBytes) {
      resp = {413, "text/plain; charset=utf-8", "body too large\n"};
    } else {
      req.body = data.substr(header_end + 4);
      while (req.body.size() < content_length) {
        const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) return;
        req.body.append(buf, static_cast<size_t>(n));
      }
      req.body.resize(content_length);
      resp = handler_(req);
    }
  }
  WriteAll(fd, absl::StrCat("HTTP/1.1 ", resp.status, " ", Reason(resp.status),
                            "\r\nContent-Type: ", resp.content_type,
                            "\r\nContent-Length: ", resp.body.size(),
                            "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n", resp.body));
}

}  // namespace moe::metrics
