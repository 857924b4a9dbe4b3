// The Open Inference Protocol's REST/JSON form (KServe v2 HTTP) on attention-svc's --http_port,
// over the same operations as the gRPC form (OipService): one implementation, two fronts.
//
//   GET  /v2                                     server metadata (name, version, extensions)
//   GET  /v2/health/live, /v2/health/ready       200 when live / ready, 503 when not ready
//   GET  /v2/models/<m>[/versions/1]             model metadata
//   GET  /v2/models/<m>[/versions/1]/ready       200 when ready, 503 when not
//   POST /v2/models/<m>[/versions/1]/infer       JSON, or the binary tensor data extension
//                                                (Inference-Header-Content-Length: the JSON
//                                                header, then each binary input in order)
//   GET  /v2/models[/<m>[/versions/1]]/stats     the statistics extension (Triton's form)
//   POST /v2/repository/index                    the repository extension's index
//
// Errors: {"error": "<message>"} with 400 (bad request), 404 (no such model or path),
// 429 (queue full), 503 (unavailable), 504 (deadline), 500 otherwise. A request's parameters
// are the gRPC form's (precision, reply_mode, expert_budget) plus the REST-only
// binary_data_output; outputs take {"binary_data": true}.
//
//   OipRest rest(&oip, default_timeout_ms);
//   HttpServer::Start(host, port, [&](const HttpRequest& r) { return rest.Handle(r); }, options);
#ifndef MOE_ATTENTION_SVC_OIP_REST_H_
#define MOE_ATTENTION_SVC_OIP_REST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "attention-svc/oip_service.h"
#include "services/metrics/http_server.h"

namespace moe::attention_svc {

class OipRest {
 public:
  OipRest(OipService* oip, int64_t default_timeout_ms)
      : oip_(oip), default_timeout_ms_(default_timeout_ms) {}
  // Thread-safe; an inference blocks its HTTP worker until the node's worker answers.
  metrics::HttpResponse Handle(const metrics::HttpRequest& req) const;

  // The JSON (and binary) request -> ModelInferRequest; *binary_outputs: whether the answer's
  // outputs go as binary data (all of them: binary_data_output, or per output).
  static absl::StatusOr<inference::ModelInferRequest> ParseInfer(
      const std::string& body, const std::string& header_length, const std::string& model,
      const std::string& version, std::vector<bool>* binary_outputs, bool* binary_all);

 private:
  metrics::HttpResponse Infer(const metrics::HttpRequest& req, const std::string& model,
                              const std::string& version) const;

  OipService* const oip_;
  const int64_t default_timeout_ms_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_OIP_REST_H_
