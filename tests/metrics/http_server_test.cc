// The page's HTTP server and router-svc's JSON API over real loopback sockets.
#include "services/metrics/http_server.h"

#include <string>

#include "gtest/gtest.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/synthetic.h"
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
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET /" + std::string(20000, 'a'))), 413);
  // Still serving.
  EXPECT_EQ(HttpStatusOf(HttpExchange(port, "GET / HTTP/1.1\r\n\r\n")), 200);
  (*server)->Stop();
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
  EXPECT_EQ(HttpBodyOf(r), R"({"experts":16,"layers":[1],"top_k":4})");
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
