// The HTTP server of every plain-HTTP front (the page, /metrics, REST) and router-svc's JSON API
// over real loopback sockets, with hand-written clients (raw requests, idle and slow sockets).
#include "services/metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/synthetic.h"
#include "services/metrics/http_routes.h"
#include "services/metrics/metrics_server.h"
#include "tests/common/http_client.h"

namespace moe::metrics {
namespace {

using moe::testing::HttpBodyOf;
using moe::testing::HttpExchange;
using moe::testing::HttpStatusOf;

TEST(HttpServer, ParsesRequestsAndBoundsThem) {
  HttpRequest seen;
  auto server = HttpServer::Start("127.0.0.1", 0, [&](const HttpRequest& r) {
    seen = r;
    return HttpResponse{200, "text/plain", "hello " + r.body};
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const std::string r =
      HttpExchange(port,
                   "POST /a/b?x=1&name=two%20words&flag HTTP/1.1\r\nHost: h\r\nX-Moe-Admin-Token: "
                   "t0k \r\nContent-Length: 5\r\n\r\nworld");
  EXPECT_EQ(HttpStatusOf(r), 200);
  EXPECT_EQ(HttpBodyOf(r), "hello world");
  EXPECT_EQ(seen.method, "POST");
  EXPECT_EQ(seen.path, "/a/b");
  EXPECT_EQ(seen.query.at("x"), "1");
  EXPECT_EQ(seen.query.at("name"), "two words");
  EXPECT_EQ(seen.query.count("flag"), 1u);
  EXPECT_EQ(seen.headers.at("x-moe-admin-token"), "t0k");
  EXPECT_EQ(seen.peer, "127.0.0.1");
  // Not a request line: closed at once, nothing served.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "garbage\r\n\r\n")), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(HttpStatusOf(HttpExchange(port,
                                      "GET / HTTP/1.1\r\nHost: h\r\nContent-Length: "
                                      "99999999\r\n\r\n")),
            413);
  // A request line or headers past 16 KiB: 414 / 431, at once.
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET /" + std::string(40000, 'a'))), 414);
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\nHost: h\r\nX-Big: " +
                                                std::string(40000, 'b') + "\r\n\r\n")),
            431);
  // Still serving.
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\nHost: h\r\n\r\n")), 200);
  EXPECT_EQ((*server)->stats().requests, 2);
  (*server)->Stop();
}

// A front that answers with its name and the path it was handed.
struct NamedFront {
  std::string name;
  HttpResponse Handle(const HttpRequest& r) const { return {200, "text/plain", name + r.path}; }
};

// The routes hand each path to the front of its first segment, over a real server; a path no
// front serves is 404 naming the served ones, with the path's hostile bytes neutralized; the
// fronts outlive the routes object that registered them (the server holds them).
TEST(HttpRoutes, HandEachPathToTheFrontOfItsFirstSegment) {
  std::unique_ptr<HttpServer> server;
  {
    HttpRoutes routes;
    routes.Add("v2", std::make_shared<NamedFront>(NamedFront{"oip:"}));
    routes.Add("v1", std::make_shared<NamedFront>(NamedFront{"other:"}));
    auto s = HttpServer::Start("127.0.0.1", 0, routes.AsHandler());
    ASSERT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
  }
  const int port = server->port();
  auto get = [&](const std::string& path) {
    return HttpExchange(port, "GET " + path + " HTTP/1.1\r\nHost: h\r\n\r\n");
  };
  EXPECT_EQ(HttpBodyOf(get("/v2/health/live")), "oip:/v2/health/live");
  EXPECT_EQ(HttpBodyOf(get("/v2")), "oip:/v2");
  EXPECT_EQ(HttpBodyOf(get("//v1/models")), "other://v1/models");
  for (const std::string path : {"/", "/v3/x", "/v2x", "/%22%5C%0A"}) {
    SCOPED_TRACE(path);
    const std::string r = get(path);
    EXPECT_EQ(HttpStatusOf(r), 404);
    EXPECT_NE(HttpBodyOf(r).find("(this server serves /v1, /v2)"), std::string::npos)
        << HttpBodyOf(r);
    EXPECT_EQ(HttpBodyOf(r).find_first_of("\\\n"), std::string::npos) << HttpBodyOf(r);
  }
  server->Stop();
}

// Framing by the rules of RFC 9112 and 9110 (the finding: two conflicting Content-Length headers
// were taken, a body shorter than its length was served after 6 s of silence, a gzipped body got
// "not a JSON object"): each refused before the handler sees anything, naming why.
TEST(HttpServer, RefusesAmbiguousFramingAndCodedBodies) {
  int handled = 0;
  HttpServerOptions o;
  o.header_deadline = absl::Seconds(1);
  o.request_deadline = absl::Seconds(2);
  auto server = HttpServer::Start(
      "127.0.0.1", 0,
      [&](const HttpRequest& r) {
        ++handled;
        return HttpResponse{200, "text/plain", "got " + r.body};
      },
      o);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const struct {
    const char* what;
    std::string request;
    int status;
    const char* says;
  } cases[] = {
      {"two Content-Length headers that differ",
       "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde", 400,
       "conflicting Content-Length headers"},
      {"Content-Length beside Transfer-Encoding",
       "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
       "5\r\nabcde\r\n0\r\n\r\n",
       400, "Content-Length and Transfer-Encoding together"},
      {"a gzipped body",
       "POST / HTTP/1.1\r\nHost: h\r\nContent-Encoding: gzip\r\n"
       "Content-Length: 5\r\n\r\nabcde",
       415, "Content-Encoding gzip is not supported"},
      {"a negative length", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -5\r\n\r\nabcde", 400,
       ""},
      {"HTTP/1.1 without Host", "GET / HTTP/1.1\r\n\r\n", 400, ""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string r = HttpExchange(port, c.request);
    EXPECT_EQ(HttpStatusOf(r), c.status) << r;
    EXPECT_NE(HttpBodyOf(r).find(c.says), std::string::npos) << r;
  }
  EXPECT_EQ(handled, 0);
  // The same length twice is one length (RFC 9110, 8.6); chunked framing is read whole.
  EXPECT_EQ(HttpBodyOf(HttpExchange(port,
                                    "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n"
                                    "Content-Length: 5\r\n\r\nabcde")),
            "got abcde");
  EXPECT_EQ(HttpBodyOf(HttpExchange(port,
                                    "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: "
                                    "chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n")),
            "got abcde");
  EXPECT_EQ(handled, 2);
  // A body shorter than its length is incomplete (RFC 9112, 8): never served; the connection is
  // closed at the request deadline, 2 s from the accept here.
  const auto t0 = std::chrono::steady_clock::now();
  const std::string r =
      HttpExchange(port, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nabcde");
  EXPECT_EQ(r, "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
  EXPECT_EQ(handled, 2);
  EXPECT_EQ((*server)->stats().cut_off, 1);
}

// A socket to 127.0.0.1:port from the loopback address `from` (127.0.0.x: many client addresses
// on one host), non-blocking reads; -1 when the connection fails.
int DialFrom(int port, const std::string& from) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in src = {};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &src.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
    ::close(fd);
    return -1;
  }
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed (or reset) this connection: a read that does not wait.
bool ClosedByServer(int fd) {
  char buf[512];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

// p99 and the worst of `probes` requests to each port, one after another, while `tick` keeps
// the slow connections trickling.
std::pair<double, double> ProbeMs(const std::vector<int>& ports, int probes,
                                  const std::function<void()>& tick) {
  std::vector<double> ms;
  for (int i = 0; i < probes; ++i) {
    if (i % 20 == 0) tick();
    for (int port : ports) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::string r =
          HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      EXPECT_EQ(HttpStatusOf(r), 200);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() * 99 / 100], ms.back()};
}

// The issue's bar: 1,000 idle connections plus 200 slowloris ones (a header byte now and then)
// on each of the three kinds of front a process has (/metrics, the page, a REST-like handler) do
// not delay a canary beyond 50 ms p99. First from one client address (the per-address limit
// admits 64; the rest are closed at the accept), then spread over 40 addresses (30 each, all
// held: no connection costs a thread). Slow connections are cut at their header deadline
// however they trickle.
TEST(HttpServer, AThousandIdleAndTwoHundredSlowConnectionsDoNotDelayACanary) {
  auto metrics = MetricsServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto ok = [](const HttpRequest&) { return HttpResponse{200, "text/plain", "ok"}; };
  auto page = HttpServer::Start("127.0.0.1", 0, ok);
  ASSERT_TRUE(page.ok()) << page.status();
  HttpServerOptions rest_options;  // the REST front's: more handler threads, larger bodies
  rest_options.workers = 16;
  rest_options.max_body_bytes = 256 << 20;
  rest_options.request_deadline = absl::Seconds(30);
  auto rest = HttpServer::Start("127.0.0.1", 0, ok, rest_options);
  ASSERT_TRUE(rest.ok()) << rest.status();
  const std::vector<int> ports = {(*metrics)->port(), (*page)->port(), (*rest)->port()};
  for (const bool spread : {false, true}) {
    SCOPED_TRACE(spread ? "40 client addresses" : "one client address");
    std::vector<int> idle, slow;
    int refused = 0;
    for (int port : ports) {
      for (int i = 0; i < 1200; ++i) {
        const std::string from =
            spread ? absl::StrCat("127.0.0.", 10 + i % 40) : std::string("127.0.0.2");
        const int fd = DialFrom(port, from);
        if (fd < 0) {
          ++refused;
          continue;
        }
        if (i < 1000) {
          idle.push_back(fd);
        } else {
          ::send(fd, "GET /metrics HTTP/1.1\r\nX-Slow: ", 31, MSG_NOSIGNAL);
          slow.push_back(fd);
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    int closed = 0;
    for (int fd : idle) closed += ClosedByServer(fd);
    for (int fd : slow) closed += ClosedByServer(fd);
    const auto [p99, worst] = ProbeMs(ports, 200, [&] {
      for (int fd : slow) ::send(fd, "a", 1, MSG_NOSIGNAL);
    });
    std::printf(
        "[%s] %zu connections made, %d refused, %d closed at once; canary p99 %.1f ms, "
        "worst %.1f ms over %zu probes\n",
        spread ? "40 addresses" : "one address", idle.size() + slow.size(), refused, closed, p99,
        worst, 200 * ports.size());
    EXPECT_LT(p99, 50.0);
    if (spread) {
      EXPECT_EQ(closed, 0) << "connections under every limit were closed";
    } else {
      // 64 per address held on each server; every other one closed at the accept.
      EXPECT_EQ(static_cast<int>(idle.size() + slow.size()) - closed, 3 * 64);
    }
    // Slow connections are cut at the header deadline (3 s from the accept) though they trickle.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
    int cut = 0;
    std::vector<bool> done(slow.size(), false);
    while (cut < static_cast<int>(slow.size()) && std::chrono::steady_clock::now() < until) {
      for (size_t i = 0; i < slow.size(); ++i) {
        if (done[i]) continue;
        ::send(slow[i], "a", 1, MSG_NOSIGNAL);
        if (ClosedByServer(slow[i])) {
          done[i] = true;
          ++cut;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_EQ(cut, static_cast<int>(slow.size()));
    for (int fd : idle) ::close(fd);
    for (int fd : slow) ::close(fd);
  }
  // Prompt stops.
  auto t0 = std::chrono::steady_clock::now();
  (*page)->Stop();
  (*rest)->Stop();
  metrics->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(800));
}

TEST(RouterPage, ServesTheEmbeddedPageAndAnswersTheApiWithClearErrors) {
  std::string tmpl = ::testing::TempDir() + "/moe_page_ckpt_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  checkpoint::SyntheticOptions so;
  so.single_file = true;
  ASSERT_TRUE(checkpoint::WriteSyntheticCheckpoint(*PresetConfig("tiny"), dir, so).ok());
  router_svc::RouterServerOptions o;
  o.checkpoint = dir;
  o.web_port = 0;
  o.web_port_file = dir + "/web.port";
  o.admin_token = "abc";
  auto router = router_svc::RouterServer::Start(o);
  ASSERT_TRUE(router.ok()) << router.status();
  int port = 0;
  {
    FILE* f = std::fopen(o.web_port_file.c_str(), "r");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fscanf(f, "%d", &port), 1);
    std::fclose(f);
  }
  auto get = [&](const std::string& path, const std::string& extra = "") {
    return HttpExchange(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\n" + extra + "\r\n");
  };
  auto post = [&](const std::string& path, const std::string& extra = "") {
    return HttpExchange(
        port, "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n" + extra + "\r\n");
  };
  std::string r = get("/");
  EXPECT_EQ(HttpStatusOf(r), 200);
  EXPECT_NE(HttpBodyOf(r).find("<script src=\"/app.js\">"), std::string::npos);
  EXPECT_NE(r.find("Content-Type: text/html"), std::string::npos);
  // The page loads nothing from outside (no CDN).
  for (const char* asset : {"/", "/app.js", "/style.css"}) {
    const std::string body = HttpBodyOf(get(asset));
    EXPECT_FALSE(body.empty()) << asset;
    EXPECT_EQ(body.find("http://"), std::string::npos) << asset;
    EXPECT_EQ(body.find("https://"), std::string::npos) << asset;
  }
  r = get("/api/layers");
  EXPECT_EQ(HttpStatusOf(r), 200);
  EXPECT_EQ(
      HttpBodyOf(r),
      R"({"experts":16,"layers":[1],"state":{"initialized_unix_ms":0,"start":"in_memory","store":"memory"},"top_k":4})");
  r = get("/api/state?layer=1");
  EXPECT_EQ(HttpStatusOf(r), 200);
  EXPECT_NE(HttpBodyOf(r).find(R"("window_tokens":0)"), std::string::npos) << HttpBodyOf(r);
  r = get("/api/state?layer=9");
  EXPECT_EQ(HttpStatusOf(r), 404);
  EXPECT_NE(HttpBodyOf(r).find("layer 9 is not managed"), std::string::npos) << HttpBodyOf(r);
  EXPECT_EQ(HttpStatusOf(get("/api/state")), 400);
  EXPECT_EQ(HttpStatusOf(get("/nope")), 404);
  EXPECT_EQ(HttpStatusOf(get("/api/rebalance?layer=1")), 405);
  r = post("/api/rebalance?layer=1");
  EXPECT_EQ(HttpStatusOf(r), 403);
  EXPECT_NE(HttpBodyOf(r).find("admin token is required"), std::string::npos);
  r = post("/api/rebalance?layer=1", "X-Moe-Admin-Token: wrong\r\n");
  EXPECT_EQ(HttpStatusOf(r), 403);
  EXPECT_NE(HttpBodyOf(r).find("wrong"), std::string::npos);
  r = post("/api/rebalance?layer=1", "X-Moe-Admin-Token: abc\r\n");
  EXPECT_EQ(HttpStatusOf(r), 412);  // no traffic yet
  EXPECT_NE(HttpBodyOf(r).find("no traffic"), std::string::npos) << HttpBodyOf(r);
  r = post("/api/rollback?layer=1&to=0", "X-Moe-Admin-Token: abc\r\n");
  EXPECT_EQ(HttpStatusOf(r), 200);
  EXPECT_EQ(HttpBodyOf(r), R"({"reason":"rollback to 0","version":1})");
  r = post("/api/rollback?layer=1&to=7", "X-Moe-Admin-Token: abc\r\n");
  EXPECT_EQ(HttpStatusOf(r), 404);
  (*router)->Shutdown();
}

}  // namespace
}  // namespace moe::metrics
