#include "attention-svc/oip_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "services/common/status_macros.h"
#include "services/transport/status_convert.h"

namespace moe::attention_svc {

namespace {

constexpr char kPrefix[] = "moe-layer-";
constexpr char kInput[] = "hidden_states";
constexpr char kOutput[] = "output";
constexpr char kExpertIds[] = "expert_ids";
constexpr char kWeights[] = "routing_weights";

// A caller's name or value in an error message: at most 64 bytes of it.
std::string Shorten(std::string_view s) {
  if (s.size() <= 64) return std::string(s);
  return absl::StrCat(std::string(s.substr(0, 64)), "... (", s.size(), " bytes)");
}

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(transport::ToGrpc(s));
  return reactor;
}

void AddTensorMetadata(
    const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* out) {
  auto* t = out->Add();
  t->set_name(name);
  t->set_datatype(dtype);
  for (int64_t d : shape) t->add_shape(d);
}

}  // namespace

std::string OipModelName(int32_t layer) { return absl::StrCat(kPrefix, layer); }

absl::StatusOr<int32_t> OipService::LayerOf(const std::string& name,
                                            const std::string& version) const {
  std::vector<std::string> known;
  for (int32_t l : hooks_.layers) {
    if (name == OipModelName(l)) {
      if (!version.empty() && version != "1") {
        return absl::NotFoundError(
            absl::StrCat("model ", name, " has version 1 only, not '", version, "'"));
      }
      return l;
    }
    known.push_back(OipModelName(l));
  }
  return absl::NotFoundError(
      absl::StrCat("no model '", name, "' here (models: ", absl::StrJoin(known, ", "), ")"));
}

grpc::ServerUnaryReactor* OipService::ServerLive(grpc::CallbackServerContext* ctx,
                                                 const inference::ServerLiveRequest*,
                                                 inference::ServerLiveResponse* resp) {
  resp->set_live(true);
  return Finish(ctx, absl::OkStatus());
}

bool OipService::Ready() const {
  bool ready = !hooks_.layers.empty();
  for (int32_t l : hooks_.layers) ready &= hooks_.layer_ready(l);
  return ready;
}

absl::StatusOr<bool> OipService::ModelIsReady(const std::string& name,
                                              const std::string& version) const {
  MOE_ASSIGN_OR_RETURN(int32_t layer, LayerOf(name, version));
  return hooks_.layer_ready(layer);
}

std::vector<std::string> OipService::Extensions() {
  return {"binary_tensor_data", "parameters", "statistics", "model_repository"};
}

inference::ServerMetadataResponse OipService::Metadata() const {
  inference::ServerMetadataResponse resp;
  resp.set_name(hooks_.server_name);
  resp.set_version(hooks_.version);
  for (const std::string& e : Extensions()) resp.add_extensions(e);
  return resp;
}

absl::StatusOr<inference::ModelMetadataResponse> OipService::ModelMeta(
    const std::string& name, const std::string& version) const {
  MOE_RETURN_IF_ERROR(LayerOf(name, version).status());
  inference::ModelMetadataResponse m;
  m.set_name(name);
  m.add_versions("1");
  m.set_platform("stable-latentmoe");
  // Inputs may be BF16 or FP32; the metadata names the preferred one.
  AddTensorMetadata(kInput, "BF16", {-1, hooks_.hidden}, m.mutable_inputs());
  AddTensorMetadata(kOutput, "BF16", {-1, hooks_.hidden}, m.mutable_outputs());
  AddTensorMetadata(kExpertIds, "INT32", {-1, hooks_.top_k}, m.mutable_outputs());
  AddTensorMetadata(kWeights, "FP32", {-1, hooks_.top_k}, m.mutable_outputs());
  return m;
}

grpc::ServerUnaryReactor* OipService::ServerReady(grpc::CallbackServerContext* ctx,
                                                  const inference::ServerReadyRequest*,
                                                  inference::ServerReadyResponse* resp) {
  resp->set_ready(Ready());
  return Finish(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* OipService::ModelReady(grpc::CallbackServerContext* ctx,
                                                 const inference::ModelReadyRequest* req,
                                                 inference::ModelReadyResponse* resp) {
  absl::StatusOr<bool> ready = ModelIsReady(req->name(), req->version());
  if (!ready.ok()) return Finish(ctx, ready.status());
  resp->set_ready(*ready);
  return Finish(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* OipService::ServerMetadata(grpc::CallbackServerContext* ctx,
                                                     const inference::ServerMetadataRequest*,
                                                     inference::ServerMetadataResponse* resp) {
  *resp = Metadata();
  return Finish(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* OipService::ModelMetadata(grpc::CallbackServerContext* ctx,
                                                    const inference::ModelMetadataRequest* req,
                                                    inference::ModelMetadataResponse* resp) {
  absl::StatusOr<inference::ModelMetadataResponse> m = ModelMeta(req->name(), req->version());
  if (!m.ok()) return Finish(ctx, m.status());
  *resp = *std::move(m);
  return Finish(ctx, absl::OkStatus());
}

absl::Status OipService::ToForward(const inference::ModelInferRequest& req, int32_t layer,
                                   v1::ForwardRequest* out,
                                   std::vector<std::string>* outputs) const {
  if (req.inputs_size() != 1 || req.inputs(0).name() != kInput) {
    std::vector<std::string> names;
    for (const auto& in : req.inputs()) names.push_back(in.name());
    return absl::InvalidArgumentError(
        absl::StrCat("expected one input '", kInput, "', got [", absl::StrJoin(names, ", "), "]"));
  }
  const auto& in = req.inputs(0);
  if (in.shape_size() != 2 || in.shape(1) != hooks_.hidden || in.shape(0) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kInput, ": shape [", absl::StrJoin(in.shape(), ", "), "], expected [T, ",
                     hooks_.hidden, "] with T >= 1"));
  }
  const int64_t n = in.shape(0) * in.shape(1);
  v1::Tensor* x = out->mutable_hidden_states();
  x->add_shape(in.shape(0));
  x->add_shape(in.shape(1));
  size_t elem = 0;
  if (in.datatype() == "BF16") {
    x->set_dtype(v1::DTYPE_BF16);
    elem = 2;
  } else if (in.datatype() == "FP32") {
    x->set_dtype(v1::DTYPE_F32);
    elem = 4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(kInput, ": datatype '", in.datatype(), "', expected BF16 or FP32"));
  }
  if (req.raw_input_contents_size() > 0) {
    if (req.raw_input_contents_size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(req.raw_input_contents_size(), " raw_input_contents for 1 input"));
    }
    if (req.raw_input_contents(0).size() != static_cast<size_t>(n) * elem) {
      return absl::InvalidArgumentError(absl::StrCat(kInput, ": ", req.raw_input_contents(0).size(),
                                                     " raw bytes, shape and ", in.datatype(),
                                                     " need ", static_cast<size_t>(n) * elem));
    }
    x->set_data(req.raw_input_contents(0));
  } else if (in.datatype() == "FP32" && in.contents().fp32_contents_size() == n) {
    std::string* d = x->mutable_data();
    d->resize(static_cast<size_t>(n) * 4);
    std::memcpy(d->data(), in.contents().fp32_contents().data(), d->size());
  } else {
    return absl::InvalidArgumentError(absl::StrCat(kInput, ": no data (raw_input_contents, or ", n,
                                                   " fp32_contents for FP32; BF16 is raw "
                                                   "only)"));
  }
  out->set_layer(layer);
  // Parameters: the ones below, each once; anything else is refused by name (shortened, so
  // that a 64 MiB name does not come back in the message), as are parameters on the input and
  // the requested outputs, where this model takes none.
  auto refuse_unknown = [](const std::string& key, const std::string& where) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown parameter '", Shorten(key), "'", where,
                     " (this model takes precision, reply_mode and expert_budget on the request, "
                     "nothing else)"));
  };
  for (const auto& [key, value] : req.parameters()) {
    if (key != "precision" && key != "reply_mode" && key != "expert_budget") {
      return refuse_unknown(key, "");
    }
  }
  for (const auto& [key, value] : in.parameters()) return refuse_unknown(key, " on the input");
  for (const auto& o : req.outputs()) {
    for (const auto& [key, value] : o.parameters()) {
      return refuse_unknown(key, absl::StrCat(" on output '", Shorten(o.name()), "'"));
    }
  }
  for (const auto& [key, value] : req.parameters()) {
    if (key == "precision") {
      if (value.string_param() == "w4a16") {
        out->mutable_options()->set_precision(v1::PRECISION_W4A16);
      } else if (value.string_param() == "w4a8") {
        out->mutable_options()->set_precision(v1::PRECISION_W4A8);
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter precision '", Shorten(value.string_param()), "', expected w4a16 or w4a8"));
      }
      continue;
    }
    if (key == "expert_budget") {  // dynamic k: a cap on the layer's budget (docs/math.md 4.1)
      if (value.parameter_choice_case() != inference::InferParameter::kInt64Param ||
          value.int64_param() < 0 || value.int64_param() > hooks_.top_k) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter expert_budget must be an int64 in [0, top-k = ", hooks_.top_k,
                         "] (0: the layer's budget)"));
      }
      out->mutable_options()->set_expert_budget(static_cast<int32_t>(value.int64_param()));
      continue;
    }
    if (value.string_param() == "per_pair") {
      out->mutable_options()->set_reply_mode(v1::REPLY_MODE_PER_PAIR);
    } else if (value.string_param() == "partial_sum") {
      out->mutable_options()->set_reply_mode(v1::REPLY_MODE_PARTIAL_SUM);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("parameter reply_mode '",
                                                     Shorten(value.string_param()),
                                                     "', expected per_pair or partial_sum"));
    }
  }
  if (req.outputs_size() == 0) {
    *outputs = {kOutput, kExpertIds, kWeights};
  } else {
    for (const auto& o : req.outputs()) {
      if (o.name() != kOutput && o.name() != kExpertIds && o.name() != kWeights) {
        return absl::InvalidArgumentError(absl::StrCat("no output '", Shorten(o.name()),
                                                       "' (outputs: ", kOutput, ", ", kExpertIds,
                                                       ", ", kWeights, ")"));
      }
      if (std::find(outputs->begin(), outputs->end(), o.name()) != outputs->end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("output '", o.name(), "' requested twice (each output at most once)"));
      }
      outputs->push_back(o.name());
    }
  }
  for (const std::string& o : *outputs) {
    if (o != kOutput) out->mutable_options()->set_return_routing(true);
  }
  return absl::OkStatus();
}

void OipService::Record(int32_t layer, bool ok, int64_t total_ns, int64_t queue_ns,
                        int64_t input_ns, int64_t infer_ns, int64_t output_ns) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  ModelStats& m = stats_[layer];
  Duration& d = ok ? m.success : m.fail;
  ++d.count;
  d.ns += total_ns;
  if (ok) {
    for (auto [dur, ns] : {std::pair<Duration*, int64_t>{&m.queue, queue_ns},
                           {&m.compute_input, input_ns},
                           {&m.compute_infer, infer_ns},
                           {&m.compute_output, output_ns}}) {
      ++dur->count;
      dur->ns += ns;
    }
  }
  m.last_inference_ms = absl::ToUnixMillis(absl::Now());
}

void OipService::Infer(
    std::shared_ptr<const inference::ModelInferRequest> req, absl::Time deadline,
    const char* method,
    std::function<void(const absl::Status&, inference::ModelInferResponse*)> done) {
  const absl::Time start = absl::Now();
  auto refused = [&](int32_t layer, const absl::Status& s) {
    if (hooks_.on_error) hooks_.on_error(method, s);
    if (layer >= 0) Record(layer, false, absl::ToInt64Nanoseconds(absl::Now() - start), 0, 0, 0, 0);
    done(s, nullptr);
  };
  absl::StatusOr<int32_t> layer = LayerOf(req->model_name(), req->model_version());
  if (!layer.ok()) return refused(-1, layer.status());
  auto forward = std::make_shared<v1::ForwardRequest>();
  auto outputs = std::make_shared<std::vector<std::string>>();
  if (absl::Status s = ToForward(*req, *layer, forward.get(), outputs.get()); !s.ok()) {
    return refused(*layer, s);
  }
  const absl::Time decoded = absl::Now();
  const int32_t l = *layer;
  auto work = [this, req, forward, outputs, deadline, done, start, decoded, l] {
    const absl::Time begun = absl::Now();
    v1::ForwardResponse fr;
    const absl::Status s = hooks_.forward(*forward, deadline, &fr);
    const absl::Time computed = absl::Now();
    if (!s.ok()) {
      Record(l, false, absl::ToInt64Nanoseconds(computed - start), 0, 0, 0, 0);
      done(s, nullptr);
      return;
    }
    inference::ModelInferResponse resp;
    resp.set_model_name(req->model_name());
    resp.set_model_version("1");
    resp.set_id(req->id());
    (*resp.mutable_parameters())["bias_version"].set_int64_param(
        static_cast<int64_t>(fr.bias_version()));
    (*resp.mutable_parameters())["precision"].set_string_param(
        fr.precision() == v1::PRECISION_W4A8 ? "w4a8" : "w4a16");
    (*resp.mutable_parameters())["expert_budget"].set_int64_param(fr.expert_budget());
    (*resp.mutable_parameters())["routed_pairs"].set_int64_param(fr.routed_pairs());
    // A decimal string: the protocol's parameters have no double (Triton's double_param is an
    // extension a KServe v2 client may not know).
    (*resp.mutable_parameters())["routing_mass_kept"].set_string_param(
        absl::StrFormat("%.6f", fr.routing_mass_kept()));
    const int64_t tokens = fr.output().shape(0);
    for (const std::string& name : *outputs) {
      auto* o = resp.add_outputs();
      o->set_name(name);
      if (name == kOutput) {
        o->set_datatype("BF16");
        o->add_shape(tokens);
        o->add_shape(hooks_.hidden);
        resp.add_raw_output_contents(std::move(*fr.mutable_output()->mutable_data()));
      } else if (name == kExpertIds) {
        o->set_datatype("INT32");
        o->add_shape(tokens);
        o->add_shape(fr.routing().top_k());
        const auto& ids = fr.routing().expert_ids();
        resp.add_raw_output_contents(
            std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t)));
      } else {
        o->set_datatype("FP32");
        o->add_shape(tokens);
        o->add_shape(fr.routing().top_k());
        const auto& w = fr.routing().weights();
        resp.add_raw_output_contents(
            std::string(reinterpret_cast<const char*>(w.data()), w.size() * sizeof(float)));
      }
    }
    const absl::Time encoded = absl::Now();
    Record(l, true, absl::ToInt64Nanoseconds(encoded - start),
           absl::ToInt64Nanoseconds(begun - decoded), absl::ToInt64Nanoseconds(decoded - start),
           absl::ToInt64Nanoseconds(computed - begun),
           absl::ToInt64Nanoseconds(encoded - computed));
    done(absl::OkStatus(), &resp);
  };
  if (!hooks_.submit(work)) {
    refused(l, absl::ResourceExhaustedError("attention node: too many requests waiting"));
  }
}

grpc::ServerUnaryReactor* OipService::ModelInfer(grpc::CallbackServerContext* ctx,
                                                 const inference::ModelInferRequest* req,
                                                 inference::ModelInferResponse* resp) {
  absl::Time deadline = absl::Now() + absl::Milliseconds(hooks_.default_timeout_ms);
  deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  auto* reactor = ctx->DefaultReactor();
  // The request outlives this call on the reactor's context: borrowed, not copied.
  std::shared_ptr<const inference::ModelInferRequest> borrowed(req, [](auto*) {});
  Infer(borrowed, deadline, "ModelInfer",
        [reactor, resp](const absl::Status& s, inference::ModelInferResponse* r) {
          if (s.ok()) *resp = std::move(*r);
          reactor->Finish(transport::ToGrpc(s));
        });
  return reactor;
}

absl::StatusOr<std::string> OipService::StatisticsJson(const std::string& name,
                                                       const std::string& version) const {
  std::vector<int32_t> layers;
  if (name.empty()) {
    layers = hooks_.layers;
  } else {
    MOE_ASSIGN_OR_RETURN(int32_t l, LayerOf(name, version));
    layers.push_back(l);
  }
  nlohmann::json models = nlohmann::json::array();
  std::lock_guard<std::mutex> lock(stats_mu_);
  for (int32_t l : layers) {
    const auto it = stats_.find(l);
    const ModelStats m = it != stats_.end() ? it->second : ModelStats{};
    auto d = [](const Duration& x) { return nlohmann::json{{"count", x.count}, {"ns", x.ns}}; };
    models.push_back({{"name", OipModelName(l)},
                      {"version", "1"},
                      {"last_inference", m.last_inference_ms},
                      {"inference_count", m.success.count},
                      {"execution_count", m.success.count},
                      {"inference_stats",
                       {{"success", d(m.success)},
                        {"fail", d(m.fail)},
                        {"queue", d(m.queue)},
                        {"compute_input", d(m.compute_input)},
                        {"compute_infer", d(m.compute_infer)},
                        {"compute_output", d(m.compute_output)}}},
                      {"batch_stats", nlohmann::json::array()}});
  }
  return nlohmann::json{{"model_stats", models}}.dump();
}

std::string OipService::RepositoryIndexJson() const {
  nlohmann::json index = nlohmann::json::array();
  for (int32_t l : hooks_.layers) {
    const bool ready = hooks_.layer_ready(l);
    nlohmann::json m = {
        {"name", OipModelName(l)}, {"version", "1"}, {"state", ready ? "READY" : "UNAVAILABLE"}};
    if (!ready) m["reason"] = "not every expert of the layer has a healthy shard";
    index.push_back(m);
  }
  return index.dump();
}

}  // namespace moe::attention_svc
