#include "services/metrics/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moe::metrics {

namespace {

using Clock = std::chrono::steady_clock;

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

// A connection, from its accept to its close (the notify-connection callback's socket context):
// what the reaper needs to cut it off at its deadlines.
struct Connection {
  int fd = -1;
  Clock::time_point accepted;
  std::atomic<bool> headers_in{false}, request_in{false};
  bool cut = false;  // shut down by the reaper (counted once)
};

// One request (the access handler's request context), from its request line to its completion.
struct Request {
  std::string raw_uri;  // as sent: the query is parsed from it by ParseQuery
  HttpRequest req;
  bool conflicting_length = false;  // two Content-Length headers that differ
  bool started = false;             // the headers were read and checked
  bool too_large = false;           // the body passed max_body_bytes: answered 413 at the end
  bool dispatched = false;  // handed to a worker (the connection suspended until it answers)
  bool answered = false;    // `resp` holds the worker's answer
  HttpResponse resp;
};

}  // namespace

class HttpServer::Impl {
 public:
  Impl(Handler handler, const HttpServerOptions& o) : handler_(std::move(handler)), o_(o) {}

  absl::Status Start(const std::string& host, int port, int* bound_port) {
    sockaddr_storage addr = {};
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME;
    if (host.find(':') != std::string::npos) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
      a6->sin6_family = AF_INET6;
      a6->sin6_port = htons(static_cast<uint16_t>(port));
      if (::inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("HTTP server: host ", host));
      }
      flags |= MHD_USE_IPv6;
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
      a4->sin_family = AF_INET;
      a4->sin_port = htons(static_cast<uint16_t>(port));
      if (::inet_pton(AF_INET, host.c_str(), &a4->sin_addr) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("HTTP server: host ", host));
      }
    }
    const auto idle_s =
        static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(o_.request_deadline) + 1));
    daemon_ = MHD_start_daemon(
        flags, 0, nullptr, nullptr, &Impl::Access, this, MHD_OPTION_SOCK_ADDR, &addr,
        MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned>(std::max(1, o_.max_connections)),
        MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        static_cast<unsigned>(std::max(1, o_.max_connections_per_address)),
        // The buffer of a connection holds its request line and headers: past it, 431.
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<size_t>(o_.max_header_bytes + 4096),
        // A backstop only: the reaper's deadlines start at the accept and come first.
        MHD_OPTION_CONNECTION_TIMEOUT, idle_s, MHD_OPTION_STRICT_FOR_CLIENT, 1,
        MHD_OPTION_URI_LOG_CALLBACK, &Impl::UriLog, nullptr, MHD_OPTION_NOTIFY_COMPLETED,
        &Impl::Completed, this, MHD_OPTION_NOTIFY_CONNECTION, &Impl::Notify, this,
        MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024u, MHD_OPTION_END);
    if (daemon_ == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("HTTP server: cannot listen on ", host, ":", port));
    }
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_BIND_PORT);
    if (info == nullptr || info->port == 0) return absl::InternalError("HTTP server: no port");
    *bound_port = info->port;
    for (int i = 0; i < std::max(1, o_.workers); ++i) workers_.emplace_back([this] { Work(); });
    reaper_ = std::thread([this] { Reap(); });
    return absl::OkStatus();
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    reaper_cv_.notify_all();
    for (std::thread& t : workers_) t.join();  // the queue is answered 503 first (Work)
    reaper_.join();
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
    daemon_ = nullptr;
  }

  HttpServerStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Job {
    MHD_Connection* conn;
    Request* r;
  };

  static void* UriLog(void*, const char* uri, MHD_Connection*) {
    auto* r = new Request();  // freed by Completed
    r->raw_uri = uri != nullptr ? uri : "";
    return r;
  }

  static void Completed(void*, MHD_Connection*, void** req_cls, MHD_RequestTerminationCode) {
    delete static_cast<Request*>(*req_cls);
    *req_cls = nullptr;
  }

  static void Notify(void* cls, MHD_Connection* conn, void** socket_context,
                     MHD_ConnectionNotificationCode code) {
    auto* self = static_cast<Impl*>(cls);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      auto* c = new Connection();
      const MHD_ConnectionInfo* info =
          MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
      c->fd = info != nullptr ? info->connect_fd : -1;
      c->accepted = Clock::now();
      *socket_context = c;
      std::lock_guard<std::mutex> lock(self->mu_);
      self->open_.insert(c);
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED && *socket_context != nullptr) {
      auto* c = static_cast<Connection*>(*socket_context);
      {  // out of the reaper's set before MHD closes the socket: its fd is never reused under it
        std::lock_guard<std::mutex> lock(self->mu_);
        self->open_.erase(c);
      }
      delete c;
      *socket_context = nullptr;
    }
  }

  static Connection* ConnectionOf(MHD_Connection* conn) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info != nullptr ? static_cast<Connection*>(info->socket_context) : nullptr;
  }

  // Queues a complete response; the connection closes after it.
  static MHD_Result Reply(MHD_Connection* conn, const HttpResponse& r) {
    MHD_Response* resp = MHD_create_response_from_buffer(
        r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
    if (resp == nullptr) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    for (const auto& [name, value] : r.headers) {
      MHD_add_response_header(resp, name.c_str(), value.c_str());
    }
    const MHD_Result ok = MHD_queue_response(conn, static_cast<unsigned>(r.status), resp);
    MHD_destroy_response(resp);
    return ok;
  }

  MHD_Result Refuse(MHD_Connection* conn, int status, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.refused;
    }
    return Reply(conn, {status, "text/plain; charset=utf-8", why + "\n"});
  }

  static MHD_Result CollectHeader(void* cls, MHD_ValueKind, const char* key, size_t key_size,
                                  const char* value, size_t value_size) {
    auto* r = static_cast<Request*>(cls);
    std::string name = absl::AsciiStrToLower(absl::string_view(key, key_size));
    std::string v(absl::StripAsciiWhitespace(absl::string_view(value, value_size)));
    const auto [it, first] = r->req.headers.emplace(std::move(name), std::move(v));
    // Repeated fields keep their first value; a Content-Length that disagrees is remembered.
    if (!first && it->first == "content-length" &&
        it->second != absl::StripAsciiWhitespace(absl::string_view(value, value_size))) {
      r->conflicting_length = true;
    }
    return MHD_YES;
  }

  // The headers are in: framing and codings checked before any body is read (RFC 9112 6.3:
  // conflicting lengths, or a length beside Transfer-Encoding, are a request to refuse).
  MHD_Result Begin(MHD_Connection* conn, const char* url, const char* method, Request* r) {
    r->started = true;
    r->req.method = method != nullptr ? method : "";
    r->req.path = url != nullptr ? url : "";
    const size_t q = r->raw_uri.find('?');
    if (q != std::string::npos) r->req.query = ParseQuery(r->raw_uri.substr(q + 1));
    MHD_get_connection_values_n(conn, MHD_HEADER_KIND, &Impl::CollectHeader, r);
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (info != nullptr && info->client_addr != nullptr) {
      char text[INET6_ADDRSTRLEN] = "";
      const sockaddr* a = info->client_addr;
      if (a->sa_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, text,
                    sizeof(text));
      } else if (a->sa_family == AF_INET6) {
        ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, text,
                    sizeof(text));
      }
      r->req.peer = text;
    }
    auto& h = r->req.headers;
    if (r->conflicting_length) {
      return Refuse(conn, 400, "conflicting Content-Length headers (RFC 9112, 6.3)");
    }
    if (h.count("content-length") > 0 && h.count("transfer-encoding") > 0) {
      return Refuse(conn, 400,
                    "Content-Length and Transfer-Encoding together (RFC 9112, 6.3): send one");
    }
    if (auto it = h.find("content-length"); it != h.end()) {
      const std::string& v = it->second;
      const bool digits =
          !v.empty() && v.size() <= 19 &&
          std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits) return Refuse(conn, 400, "Content-Length is not a decimal number");
      if (std::stoull(v) > o_.max_body_bytes) {
        return Refuse(
            conn, 413,
            absl::StrCat("body too large (", v, " bytes; at most ", o_.max_body_bytes, ")"));
      }
    }
    if (auto it = h.find("content-encoding");
        it != h.end() && !absl::EqualsIgnoreCase(it->second, "identity")) {
      return Refuse(conn, 415,
                    absl::StrCat("Content-Encoding ", it->second.substr(0, 64),
                                 " is not supported (send the body uncoded)"));
    }
    if (Connection* c = ConnectionOf(conn)) c->headers_in = true;
    return MHD_YES;
  }

  static MHD_Result Access(void* cls, MHD_Connection* conn, const char* url, const char* method,
                           const char*, const char* upload_data, size_t* upload_data_size,
                           void** req_cls) {
    auto* self = static_cast<Impl*>(cls);
    auto* r = static_cast<Request*>(*req_cls);
    if (r == nullptr) return MHD_NO;  // no request line seen: nothing to answer
    if (!r->started) return self->Begin(conn, url, method, r);
    if (*upload_data_size > 0) {  // a piece of the body
      if (r->req.body.size() + *upload_data_size > self->o_.max_body_bytes) {
        r->too_large = true;  // chunked past the limit: the rest is read and dropped
      } else {
        r->req.body.append(upload_data, *upload_data_size);
      }
      *upload_data_size = 0;
      return MHD_YES;
    }
    if (r->answered) return Reply(conn, r->resp);
    if (r->too_large) {
      return self->Refuse(conn, 413,
                          absl::StrCat("body too large (at most ", self->o_.max_body_bytes, ")"));
    }
    if (r->dispatched) return MHD_YES;  // resumed before the answer: wait on
    if (Connection* c = ConnectionOf(conn)) c->request_in = true;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (!self->stopping_ &&
          self->queue_.size() < static_cast<size_t>(std::max(1, self->o_.max_queued_requests))) {
        r->dispatched = true;
        MHD_suspend_connection(conn);
        self->queue_.push_back({conn, r});
        self->cv_.notify_one();
        return MHD_YES;
      }
    }
    return self->Refuse(conn, 503, "too many requests queued; try again");
  }

  void Work() {
    for (;;) {
      Job job;
      bool stopping;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        job = queue_.front();
        queue_.pop_front();
        stopping = stopping_;
      }
      job.r->resp = stopping ? HttpResponse{503, "text/plain; charset=utf-8", "stopping\n"}
                             : handler_(job.r->req);
      job.r->answered = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++(stopping ? stats_.refused : stats_.requests);
      }
      MHD_resume_connection(job.conn);
    }
  }

  // Cuts off connections past their deadlines from the accept: the headers within
  // header_deadline, the whole request within request_deadline, however slowly bytes trickle.
  // A shutdown socket reads as closed on MHD's loop, which then closes the connection.
  void Reap() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!reaper_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; })) {
      const Clock::time_point now = Clock::now();
      for (Connection* c : open_) {
        if (c->cut || c->fd < 0 || c->request_in.load()) continue;
        const absl::Duration age = absl::FromChrono(now - c->accepted);
        if (age > o_.request_deadline || (!c->headers_in.load() && age > o_.header_deadline)) {
          ::shutdown(c->fd, SHUT_RDWR);
          c->cut = true;
          ++stats_.cut_off;
        }
      }
    }
  }

  const Handler handler_;
  const HttpServerOptions o_;
  MHD_Daemon* daemon_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;         // the workers': a request queued, or stopping
  std::condition_variable reaper_cv_;  // the reaper's: stopping (one waiter per condition)
  bool stopping_ = false;
  std::deque<Job> queue_;
  std::set<Connection*> open_;
  HttpServerStats stats_;
  std::vector<std::thread> workers_;
  std::thread reaper_;
};

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
                                                              Handler handler,
                                                              const HttpServerOptions& options) {
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->impl_ = std::make_unique<Impl>(std::move(handler), options);
  if (absl::Status st = s->impl_->Start(host, port, &s->port_); !st.ok()) {
    s->impl_.reset();
    return st;
  }
  return s;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                              Handler handler, int workers,
                                                              size_t max_body_bytes) {
  HttpServerOptions o;
  o.workers = workers;
  o.max_body_bytes = max_body_bytes;
  return Start(host, port, std::move(handler), o);
}

HttpServerStats HttpServer::stats() const {
  return impl_ != nullptr ? impl_->stats() : HttpServerStats{};
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (impl_ != nullptr) impl_->Stop();
}

}  // namespace moe::metrics
