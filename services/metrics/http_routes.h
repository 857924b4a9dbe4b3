// The paths of one HTTP server by their first segment, each to the front that serves it (as
// TF Serving's HTTP server hands each path to its handler): attention-svc's "/v2/..." to the
// Open Inference Protocol's REST front. A second REST flavour is one adapter and one Add; a
// path no front serves is 404 naming the ones served.
//
//   HttpRoutes routes;
//   routes.Add("v2", std::make_shared<OipRest>(oip, timeout_ms));  // anything with Handle()
//   HttpServer::Start(host, port, routes.AsHandler(), options);
#ifndef MOE_SERVICES_METRICS_HTTP_ROUTES_H_
#define MOE_SERVICES_METRICS_HTTP_ROUTES_H_

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "services/metrics/http_server.h"

namespace moe::metrics {

class HttpRoutes {
 public:
  // `front` serves every path whose first segment is `segment`; the routes keep it alive for
  // as long as the server may call it. Add every route before AsHandler.
  template <typename Front>
  void Add(const std::string& segment, std::shared_ptr<Front> front) {
    fronts_[segment] = [front](const HttpRequest& r) { return front->Handle(r); };
  }

  HttpResponse Handle(const HttpRequest& r) const {
    const size_t begin = r.path.find_first_not_of('/');
    const size_t end = begin == std::string::npos ? begin : r.path.find('/', begin);
    const std::string first =
        begin == std::string::npos
            ? ""
            : r.path.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    auto it = fronts_.find(first);
    if (it != fronts_.end()) return it->second(r);
    std::string served;
    for (const auto& [segment, unused] : fronts_)
      served += (served.empty() ? "/" : ", /") + segment;
    std::string path = r.path.substr(0, 64);
    for (char& c : path) {  // the path as JSON text without escapes: printable ASCII, no quotes
      if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') c = '?';
    }
    return {404,
            "application/json",
            "{\"error\":\"no such path " + path + " (this server serves " + served + ")\"}",
            {}};
  }

  // What HttpServer::Start takes: the routes, shared with the server.
  HttpServer::Handler AsHandler() const {
    auto fronts = std::make_shared<const HttpRoutes>(*this);
    return [fronts](const HttpRequest& r) { return fronts->Handle(r); };
  }

 private:
  std::map<std::string, HttpServer::Handler> fronts_;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_HTTP_ROUTES_H_
