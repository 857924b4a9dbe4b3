// A started gRPC server with what every server here carries (STYLE.md "gRPC"): the standard
// health service, server reflection, loopback or any address, port 0 for tests, message limits.
//
//   GrpcServerOptions o; o.services = {&my_service};
//   MOE_ASSIGN_OR_RETURN(auto server, GrpcServer::Start(o));
//   server->SetServing(true);  // health: SERVING
//   ... server->Shutdown(absl::Seconds(2));
#ifndef MOE_SERVICES_TRANSPORT_GRPC_SERVER_H_
#define MOE_SERVICES_TRANSPORT_GRPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/transport/channel.h"

namespace grpc {
class Server;
class ServerContextBase;
class ServerCredentials;
class Service;
}  // namespace grpc

namespace moe::transport {

// The health-service name a liveness probe asks for (SERVING from start to shutdown); the
// overall status "" is readiness.
inline constexpr char kLivenessService[] = "moe.liveness";

struct GrpcServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port (read it back with port())
  int max_receive_message_bytes = kDefaultMaxMessageBytes;
  int max_send_message_bytes = kDefaultMaxMessageBytes;
  std::vector<grpc::Service*> services;  // not owned; must outlive the server
  // Accept gzip/deflate-compressed requests (off: refused, UNIMPLEMENTED, before inflating).
  bool allow_compression = false;
  // null: the process's (security.h; plaintext unless TLS is configured).
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options);
  ~GrpcServer();

  int port() const { return port_; }
  std::string endpoint() const;
  // Readiness: the overall health status ("" service).
  void SetServing(bool serving);
  // Stops accepting calls, lets running ones finish until the deadline, then cancels them.
  void Shutdown(absl::Duration grace);
  void Wait();

 private:
  GrpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::string host_;
  int port_ = 0;
  bool shut_down_ = false;
};

// Whether the call's metadata `key` (kClusterTokenMetadata, kAdminTokenMetadata) carries
// `expected`, compared in constant time. False when expected is empty.
bool HasSecretMetadata(const grpc::ServerContextBase& context, const char* key,
                       const std::string& expected);

// A member call's identity check. With mutual TLS (ProcessBindsMemberIdentity): OK only when
// the caller's certificate carries the member SPIFFE ID of `role` and, unless `name` is empty,
// of that name; else PERMISSION_DENIED saying what it carries and what `what` needs. Without
// mutual TLS: OK (membership is the token's alone; docs/security.md says what that allows).
// The caller's identity goes to *who when given (empty without mutual TLS).
absl::Status CheckPeerMember(const grpc::ServerContextBase& context, const std::string& role,
                             const std::string& name, const std::string& what,
                             std::string* who = nullptr);

// Writes the port to path atomically (tmp file + rename), for launchers that start servers on
// port 0.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_GRPC_SERVER_H_
