#include "services/transport/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/server_interceptor.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "services/common/secret_file.h"
#include "services/transport/security.h"

namespace moe::transport {
namespace {

// gRPC's callback API answers a request it cannot parse with UNIMPLEMENTED and no message, as
// if the method did not exist. This names the method and the message type instead
// (INVALID_ARGUMENT). Handlers here never answer UNIMPLEMENTED without a message.
class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED && s.error_message().empty()) {
        methods->ModifySendStatus(Rewrite());
      }
    }
    methods->Proceed();
  }

 private:
  grpc::Status Rewrite() const {
    // "/moe.v1.AttentionService/Forward" -> "moe.v1.AttentionService.Forward"
    std::string full = method_.size() > 1 ? method_.substr(1) : method_;
    const size_t slash = full.rfind('/');
    if (slash != std::string::npos) full[slash] = '.';
    const google::protobuf::MethodDescriptor* m =
        google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full);
    if (m == nullptr) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                          absl::StrCat("unknown method ", method_));
    }
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(method_, ": the request is not a valid ",
                                     m->input_type()->full_name(), " (protobuf parse failed)"));
  }
  const std::string method_;
};

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info->method() != nullptr ? info->method() : "");
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::unique_ptr<GrpcServer> s(new GrpcServer());
  s->host_ = options.host;
  const std::string address = options.host.find(':') != std::string::npos
                                  ? absl::StrCat("[", options.host, "]:", options.port)
                                  : absl::StrCat(options.host, ":", options.port);
  std::shared_ptr<grpc::ServerCredentials> credentials = options.credentials;
  if (credentials == nullptr) {
    auto process = ProcessServerCredentials();
    if (!process.ok()) return process.status();
    credentials = *std::move(process);
  }
  builder.AddListeningPort(address, credentials, &s->port_);
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(options.max_send_message_bytes);
  // Tensor payloads are MBs: bigger HTTP/2 frames and windows mean fewer frames and flow-control
  // round trips per batch (cluster_bench).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2FrameBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2LookaheadBytes);
  if (!options.allow_compression) {
    // A small compressed message can inflate to GBs before the size limit sees it; tensors
    // barely compress anyway. Compressed requests are refused before they are inflated.
    builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
    builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<ParseErrorInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  s->SetServing(false);
  // Liveness ("moe.liveness") is SERVING while the process serves at all; readiness ("") only
  // once the service can answer requests (for attention-svc: every expert has a healthy shard).
  if (auto* health = s->server_->GetHealthCheckService()) {
    health->SetServingStatus(kLivenessService, true);
  }
  return s;
}

GrpcServer::~GrpcServer() {
  if (server_ != nullptr && !shut_down_) Shutdown(absl::ZeroDuration());
}

std::string GrpcServer::endpoint() const {
  return host_.find(':') != std::string::npos ? absl::StrCat("[", host_, "]:", port_)
                                              : absl::StrCat(host_, ":", port_);
}

void GrpcServer::SetServing(bool serving) {
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus("", serving);
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace));
}

void GrpcServer::Wait() { server_->Wait(); }

bool HasSecretMetadata(const grpc::ServerContextBase& context, const char* key,
                       const std::string& expected) {
  if (expected.empty()) return false;
  const auto& md = context.client_metadata();
  auto it = md.find(key);
  return it != md.end() &&
         SecretEquals(std::string(it->second.data(), it->second.size()), expected);
}

absl::Status CheckPeerMember(const grpc::ServerContextBase& context, const std::string& role,
                             const std::string& name, const std::string& what, std::string* who) {
  if (!ProcessBindsMemberIdentity()) return absl::OkStatus();
  const std::string trust_domain = ProcessTrustDomain();
  std::vector<std::string> ids;
  if (std::shared_ptr<const grpc::AuthContext> auth = context.auth_context()) {
    for (const char* property : {"peer_spiffe_id", "peer_uri", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& v : auth->FindPropertyValues(property)) {
        std::string id(v.data(), v.size());
        if (id.rfind("spiffe://", 0) == 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) {
          ids.push_back(std::move(id));
        }
      }
    }
  }
  const std::string want =
      absl::StrCat("spiffe://", trust_domain, "/", role, "/", name.empty() ? "<name>" : name);
  if (ids.size() != 1) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, " needs a member certificate naming one SPIFFE ID (", want,
                     "); the caller's has ", ids.size()));
  }
  absl::StatusOr<MemberIdentity> m = ParseMemberSpiffeId(ids[0], trust_domain);
  if (!m.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, " needs ", want, ": ", m.status().message()));
  }
  if (m->role != role || (!name.empty() && m->name != name)) {
    return absl::PermissionDeniedError(absl::StrCat(what, " needs the certificate of ", want,
                                                    "; the caller's names ", ids[0],
                                                    " (a member acts only as itself)"));
  }
  if (who != nullptr) *who = m->role + "/" + m->name;
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << port << "\n";
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace moe::transport
