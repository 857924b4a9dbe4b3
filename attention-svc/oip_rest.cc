#include "attention-svc/oip_rest.h"

#include <cstring>
#include <future>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "services/common/status_macros.h"
#include "services/tensor/bf16.h"

namespace moe::attention_svc {

namespace {

using metrics::HttpRequest;
using metrics::HttpResponse;
using Json = nlohmann::json;

HttpResponse JsonResponse(int status, const Json& j) {
  return {status, "application/json", j.dump(), {}};
}

int HttpStatusOf(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

HttpResponse Error(const absl::Status& s) {
  return JsonResponse(HttpStatusOf(s.code()), Json{{"error", std::string(s.message())}});
}

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

// Appends every number of a (possibly nested) JSON array, row-major. Nesting deeper than a
// tensor's rank could be is refused (the recursion is bounded).
constexpr int kMaxDataDepth = 8;
absl::Status Flatten(const Json& j, std::vector<double>* out, int depth = 0) {
  if (j.is_array()) {
    if (depth >= kMaxDataDepth) return Bad("data nested deeper than 8 levels");
    for (const Json& x : j) {
      if (absl::Status s = Flatten(x, out, depth + 1); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (!j.is_number()) return Bad("data: a value that is not a number");
  out->push_back(j.get<double>());
  return absl::OkStatus();
}

// Whether JSON text nests arrays and objects deeper than `limit` (strings skipped): checked
// before parsing, so that a body of brackets never becomes millions of nested values.
bool NestsDeeperThan(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// A JSON parameter value -> InferParameter (bool, integer, string, or a double).
absl::Status ToParameter(const std::string& key, const Json& v, inference::InferParameter* p) {
  if (v.is_boolean()) {
    p->set_bool_param(v.get<bool>());
  } else if (v.is_number_integer()) {
    p->set_int64_param(v.get<int64_t>());
  } else if (v.is_number_unsigned()) {
    p->set_uint64_param(v.get<uint64_t>());
  } else if (v.is_string()) {
    p->set_string_param(v.get<std::string>());
  } else if (v.is_number_float()) {
    p->set_double_param(v.get<double>());
  } else {
    return Bad(absl::StrCat("parameter '", key.substr(0, 64),
                            "': a value that is not a bool, number or string"));
  }
  return absl::OkStatus();
}

Json FromParameter(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return p.bool_param();
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      return p.uint64_param();
    case inference::InferParameter::kDoubleParam:
      return p.double_param();
    case inference::InferParameter::kStringParam:
      return p.string_param();
    default:
      return nullptr;
  }
}

// The bytes of a raw output as JSON numbers of its datatype.
Json DataOf(const std::string& datatype, const std::string& raw) {
  Json data = Json::array();
  if (datatype == "BF16") {
    for (size_t i = 0; i + 2 <= raw.size(); i += 2) {
      tensor::Bf16 b;
      std::memcpy(&b.bits, raw.data() + i, 2);
      data.push_back(b.ToFloat());
    }
  } else if (datatype == "INT32") {
    for (size_t i = 0; i + 4 <= raw.size(); i += 4) {
      int32_t v;
      std::memcpy(&v, raw.data() + i, 4);
      data.push_back(v);
    }
  } else {  // FP32
    for (size_t i = 0; i + 4 <= raw.size(); i += 4) {
      float v;
      std::memcpy(&v, raw.data() + i, 4);
      data.push_back(v);
    }
  }
  return data;
}

}  // namespace

absl::StatusOr<inference::ModelInferRequest> OipRest::ParseInfer(
    const std::string& body, const std::string& header_length, const std::string& model,
    const std::string& version, std::vector<bool>* binary_outputs, bool* binary_all) {
  size_t json_size = body.size();
  if (!header_length.empty()) {
    if (!absl::SimpleAtoi(header_length, &json_size) || json_size > body.size()) {
      return Bad(absl::StrCat("Inference-Header-Content-Length ", header_length.substr(0, 32),
                              " for a body of ", body.size(), " bytes"));
    }
  }
  if (NestsDeeperThan(std::string_view(body).substr(0, json_size), 3 + kMaxDataDepth)) {
    return Bad("the request's JSON is nested deeper than a tensor's data could be");
  }
  const Json j = Json::parse(body.begin(), body.begin() + static_cast<ptrdiff_t>(json_size),
                             nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("the request is not a JSON object");
  inference::ModelInferRequest req;
  req.set_model_name(model);
  req.set_model_version(version);
  if (auto id = j.find("id"); id != j.end()) {
    if (!id->is_string()) return Bad("id must be a string");
    req.set_id(id->get<std::string>());
  }
  *binary_all = false;
  if (auto params = j.find("parameters"); params != j.end()) {
    if (!params->is_object()) return Bad("parameters must be an object");
    for (const auto& [key, value] : params->items()) {
      if (key == "binary_data_output") {  // the binary tensor data extension's
        if (!value.is_boolean()) return Bad("binary_data_output must be a bool");
        *binary_all = value.get<bool>();
        continue;
      }
      MOE_RETURN_IF_ERROR(ToParameter(key, value, &(*req.mutable_parameters())[key]));
    }
  }
  auto inputs = j.find("inputs");
  if (inputs == j.end() || !inputs->is_array()) return Bad("inputs must be an array");
  size_t offset = json_size;
  for (const Json& in : *inputs) {
    if (!in.is_object()) return Bad("an input that is not an object");
    auto* t = req.add_inputs();
    const auto name = in.find("name"), dtype = in.find("datatype"), shape = in.find("shape");
    if (name == in.end() || !name->is_string() || dtype == in.end() || !dtype->is_string() ||
        shape == in.end() || !shape->is_array()) {
      return Bad("an input needs name, datatype and shape");
    }
    t->set_name(name->get<std::string>());
    t->set_datatype(dtype->get<std::string>());
    int64_t count = 1;
    for (const Json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 32)) {
        return Bad(absl::StrCat("input '", t->name().substr(0, 64), "': a bad dimension"));
      }
      t->add_shape(d.get<int64_t>());
      count *= std::max<int64_t>(d.get<int64_t>(), 1);
      if (count > (int64_t{1} << 32)) return Bad("an input of more than 2^32 elements");
    }
    int64_t binary_size = -1;
    if (auto p = in.find("parameters"); p != in.end()) {
      if (!p->is_object()) return Bad("input parameters must be an object");
      for (const auto& [key, value] : p->items()) {
        if (key == "binary_data_size") {
          if (!value.is_number_unsigned() && !value.is_number_integer()) {
            return Bad("binary_data_size must be an integer");
          }
          binary_size = value.get<int64_t>();
          continue;
        }
        MOE_RETURN_IF_ERROR(
            ToParameter(key, value, &(*t->mutable_parameters())[key]));  // refused later by name
      }
    }
    if (binary_size >= 0) {
      if (header_length.empty()) {
        return Bad("binary_data_size without Inference-Header-Content-Length");
      }
      if (static_cast<uint64_t>(binary_size) > body.size() - offset) {
        return Bad(absl::StrCat("input '", t->name().substr(0, 64), "': binary_data_size ",
                                binary_size, " past the end of the body"));
      }
      req.add_raw_input_contents(body.substr(offset, static_cast<size_t>(binary_size)));
      offset += static_cast<size_t>(binary_size);
      continue;
    }
    auto data = in.find("data");
    if (data == in.end())
      return Bad(absl::StrCat("input '", t->name().substr(0, 64), "': no data"));
    std::vector<double> values;
    MOE_RETURN_IF_ERROR(Flatten(*data, &values));
    if (t->datatype() != "FP32" && t->datatype() != "BF16") {
      return Bad(absl::StrCat("input '", t->name().substr(0, 64), "': JSON data of datatype ",
                              t->datatype().substr(0, 16), " (this model takes BF16 or FP32)"));
    }
    // JSON numbers arrive as FP32 (a BF16 input is rounded to bf16 on arrival as FP32 is).
    t->set_datatype("FP32");
    for (double v : values) t->mutable_contents()->add_fp32_contents(static_cast<float>(v));
  }
  if (offset != body.size() && !header_length.empty()) {
    return Bad(absl::StrCat(body.size() - offset, " bytes of binary data no input claims"));
  }
  binary_outputs->clear();
  if (auto outputs = j.find("outputs"); outputs != j.end()) {
    if (!outputs->is_array()) return Bad("outputs must be an array");
    for (const Json& o : *outputs) {
      if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) {
        return Bad("an output needs a name");
      }
      auto* r = req.add_outputs();
      r->set_name(o["name"].get<std::string>());
      bool binary = false;
      if (auto p = o.find("parameters"); p != o.end()) {
        if (!p->is_object()) return Bad("output parameters must be an object");
        for (const auto& [key, value] : p->items()) {
          if (key == "binary_data") {
            if (!value.is_boolean()) return Bad("binary_data must be a bool");
            binary = value.get<bool>();
            continue;
          }
          MOE_RETURN_IF_ERROR(ToParameter(key, value, &(*r->mutable_parameters())[key]));
        }
      }
      binary_outputs->push_back(binary);
    }
  }
  return req;
}

HttpResponse OipRest::Infer(const HttpRequest& http, const std::string& model,
                            const std::string& version) const {
  std::vector<bool> binary_outputs;
  bool binary_all = false;
  auto it = http.headers.find("inference-header-content-length");
  absl::StatusOr<inference::ModelInferRequest> parsed =
      ParseInfer(http.body, it != http.headers.end() ? it->second : "", model, version,
                 &binary_outputs, &binary_all);
  if (!parsed.ok()) {
    oip_->CountRefusal("ModelInfer", parsed.status());
    return Error(parsed.status());
  }
  auto req = std::make_shared<const inference::ModelInferRequest>(*std::move(parsed));
  std::promise<HttpResponse> answer;
  std::future<HttpResponse> future = answer.get_future();
  oip_->Infer(
      req, absl::Now() + absl::Milliseconds(default_timeout_ms_), "ModelInfer",
      [&answer, &binary_outputs, binary_all](const absl::Status& s,
                                             inference::ModelInferResponse* r) {
        if (!s.ok()) {
          answer.set_value(Error(s));
          return;
        }
        Json j = {{"model_name", r->model_name()},
                  {"model_version", r->model_version()},
                  {"outputs", Json::array()}};
        if (!r->id().empty()) j["id"] = r->id();
        Json params = Json::object();
        for (const auto& [k, v] : r->parameters()) params[k] = FromParameter(v);
        j["parameters"] = params;
        std::string blob;
        for (int i = 0; i < r->outputs_size(); ++i) {
          const auto& o = r->outputs(i);
          Json out = {{"name", o.name()},
                      {"datatype", o.datatype()},
                      {"shape", Json(std::vector<int64_t>(o.shape().begin(), o.shape().end()))}};
          const std::string& raw = r->raw_output_contents(i);
          const bool binary = binary_all || (static_cast<size_t>(i) < binary_outputs.size() &&
                                             binary_outputs[static_cast<size_t>(i)]);
          if (binary) {
            out["parameters"] = {{"binary_data_size", raw.size()}};
            blob += raw;
          } else {
            out["data"] = DataOf(o.datatype(), raw);
          }
          j["outputs"].push_back(std::move(out));
        }
        std::string header = j.dump();
        if (blob.empty()) {
          answer.set_value({200, "application/json", std::move(header), {}});
          return;
        }
        HttpResponse resp{200, "application/octet-stream", header + blob, {}};
        resp.headers.emplace_back("Inference-Header-Content-Length", std::to_string(header.size()));
        answer.set_value(std::move(resp));
      });
  return future.get();
}

HttpResponse OipRest::Handle(const HttpRequest& req) const {
  std::vector<std::string> parts = absl::StrSplit(req.path, '/', absl::SkipEmpty());
  if (parts.empty() || parts[0] != "v2") {
    return Error(absl::NotFoundError(absl::StrCat("no such path ", req.path.substr(0, 64),
                                                  " (the Open Inference Protocol is under /v2)")));
  }
  const bool get = req.method == "GET", post = req.method == "POST";
  if (parts.size() == 1 && get) {
    const inference::ServerMetadataResponse m = oip_->Metadata();
    return JsonResponse(
        200, Json{{"name", m.name()},
                  {"version", m.version()},
                  {"extensions",
                   Json(std::vector<std::string>(m.extensions().begin(), m.extensions().end()))}});
  }
  if (parts.size() == 3 && parts[1] == "health" && get) {
    if (parts[2] == "live") return JsonResponse(200, Json{{"live", true}});
    if (parts[2] == "ready") {
      const bool ready = oip_->Ready();
      return JsonResponse(ready ? 200 : 503, Json{{"ready", ready}});
    }
  }
  if (parts.size() == 3 && parts[1] == "repository" && parts[2] == "index" && post) {
    return {200, "application/json", oip_->RepositoryIndexJson(), {}};
  }
  if (parts.size() >= 2 && parts[1] == "models") {
    if (parts.size() == 3 && parts[2] == "stats" && get) {
      absl::StatusOr<std::string> s = oip_->StatisticsJson("", "");
      return s.ok() ? HttpResponse{200, "application/json", *s, {}} : Error(s.status());
    }
    if (parts.size() < 3) return Error(absl::NotFoundError("/v2/models needs a model name"));
    const std::string model = parts[2];
    std::string version;
    size_t next = 3;
    if (parts.size() >= 5 && parts[3] == "versions") {
      version = parts[4];
      next = 5;
    }
    const std::string action = parts.size() > next ? parts[next] : "";
    if (parts.size() > next + 1) return Error(absl::NotFoundError("no such path"));
    if (action.empty() && get) {
      absl::StatusOr<inference::ModelMetadataResponse> m = oip_->ModelMeta(model, version);
      if (!m.ok()) return Error(m.status());
      auto tensors = [](const auto& list) {
        Json a = Json::array();
        for (const auto& t : list) {
          a.push_back({{"name", t.name()},
                       {"datatype", t.datatype()},
                       {"shape", Json(std::vector<int64_t>(t.shape().begin(), t.shape().end()))}});
        }
        return a;
      };
      return JsonResponse(200, Json{{"name", m->name()},
                                    {"versions", Json(std::vector<std::string>(
                                                     m->versions().begin(), m->versions().end()))},
                                    {"platform", m->platform()},
                                    {"inputs", tensors(m->inputs())},
                                    {"outputs", tensors(m->outputs())}});
    }
    if (action == "ready" && get) {
      absl::StatusOr<bool> ready = oip_->ModelIsReady(model, version);
      if (!ready.ok()) return Error(ready.status());
      return JsonResponse(*ready ? 200 : 503, Json{{"name", model}, {"ready", *ready}});
    }
    if (action == "infer" && post) return Infer(req, model, version);
    if (action == "stats" && get) {
      absl::StatusOr<std::string> s = oip_->StatisticsJson(model, version);
      return s.ok() ? HttpResponse{200, "application/json", *s, {}} : Error(s.status());
    }
  }
  return Error(absl::NotFoundError(
      absl::StrCat("no such path ", req.path.substr(0, 64), " for ", req.method.substr(0, 8))));
}

}  // namespace moe::attention_svc
