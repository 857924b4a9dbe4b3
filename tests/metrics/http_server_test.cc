// The page's HTTP server and router-svc's JSON API over real loopback sockets.
#include "services/metrics/http_server.h"

#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/synthetic.h"
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
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "garbage\r\n\r\n")), 400);
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n")),
            413);
  // Headers over 16 KiB: CivetWeb's 400, at once.
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET /" + std::string(20000, 'a'))), 400);
  // Still serving.
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\n\r\n")), 200);
  (*server)->Stop();
}

// Slow clients (slowloris: a header byte now and then, or nothing at all) cannot take the page
// down: 48 of them hold connections while every normal request is answered at once, and each
// is cut off by the 10 s request deadline (not kept for as long as it trickles).
TEST(HttpServer, ManySlowConnectionsDoNotStarveOthers) {
  auto server = HttpServer::Start("127.0.0.1", 0, [](const HttpRequest&) {
    return HttpResponse{200, "text/plain", "ok"};
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> slow;
  for (int i = 0; i < 48; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ::send(fd, "GET / HTTP/1.1\r\nX-Slow: ", 24, MSG_NOSIGNAL);
    slow.push_back(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 6; ++round) {
    for (int fd : slow) ::send(fd, "a", 1, MSG_NOSIGNAL);  // keep trickling
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\n\r\n")), 200);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  // Every slow connection is closed by the server within the deadline (plus slack), although
  // it kept sending.
  int closed = 0;
  for (int fd : slow) {
    timeval tv = {1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[256];
    for (int i = 0; i < 20; ++i) {
      ::send(fd, "a", 1, MSG_NOSIGNAL);
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n == 0 || (n > 0 && std::string(buf, 12).find("HTTP/1.") == 0)) {
        ++closed;
        break;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        ++closed;  // reset by the server
        break;
      }
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(16)) break;
    }
    ::close(fd);
  }
  EXPECT_EQ(closed, 48);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(17));
  (*server)->Stop();
}

// Idle and slow clients cannot blind a service: with 300 connections that send nothing and 100
// that trickle a header, both CivetWeb servers of a process (/metrics on prometheus-cpp's
// Exposer, the page on HttpServer) answer every probe within 4 s (the 3 s request timeout
// frees the workers the first wave holds); and each stops in well under a second.
TEST(HttpServer, MetricsAndThePageAnswerUnderHundredsOfIdleConnections) {
  auto metrics = MetricsServer::Start("127.0.0.1", 0);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto page = HttpServer::Start("127.0.0.1", 0, [](const HttpRequest&) {
    return HttpResponse{200, "text/plain", "ok"};
  });
  ASSERT_TRUE(page.ok()) << page.status();
  auto dial = [](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  };
  std::vector<int> held;
  for (int port : {(*metrics)->port(), (*page)->port()}) {
    for (int i = 0; i < 300; ++i) held.push_back(dial(port));  // idle: nothing sent
    for (int i = 0; i < 100; ++i) {
      const int fd = dial(port);
      ::send(fd, "GET /metrics HTTP/1.1\r\nX-Slow: ", 31, MSG_NOSIGNAL);
      held.push_back(fd);
    }
  }
  std::chrono::steady_clock::duration worst{};
  int answered = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
  while (std::chrono::steady_clock::now() < until) {  // bounded: 8 s of probes
    for (int port : {(*metrics)->port(), (*page)->port()}) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::string r =
          HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
      worst = std::max(worst, std::chrono::steady_clock::now() - t0);
      EXPECT_EQ(HttpStatusOf(r), 200);
      answered += HttpStatusOf(r) == 200;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::printf("[800 idle/slow connections] %d probes answered, the slowest in %.2f s\n", answered,
              std::chrono::duration<double>(worst).count());
  EXPECT_LT(worst, std::chrono::seconds(4));
  for (int fd : held) ::close(fd);
  // Prompt stops: the listener's 2 s poll is woken.
  auto t0 = std::chrono::steady_clock::now();
  (*page)->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(800));
  t0 = std::chrono::steady_clock::now();
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
    return HttpExchange(port, "GET " + path + " HTTP/1.1\r\n" + extra + "\r\n");
  };
  auto post = [&](const std::string& path, const std::string& extra = "") {
    return HttpExchange(port,
                        "POST " + path + " HTTP/1.1\r\nContent-Length: 0\r\n" + extra + "\r\n");
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
