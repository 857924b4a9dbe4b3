// TLS and mutual TLS for every gRPC channel and server of a process: certificate, key and CA from
// files (PEM), watched and reloaded when they change (a rotated certificate is used by new
// connections without a restart). Without TLS options the process speaks plaintext, as before.
//
// A service's main() configures it once, before any channel or server exists; MakeChannel and
// GrpcServer::Start then use it:
//   TlsOptions tls;  tls.cert_file = "/var/run/moe/tls/tls.crt"; ... (flags: AddTlsFlags)
//   MOE_RETURN_IF_ERROR(ConfigureProcessTls(tls, /*server=*/true));
// A library user who holds several configurations passes credentials explicitly instead:
//   MOE_ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
//   auto channel = MakeChannel("moe-attention:50051", kDefaultMaxMessageBytes, creds);
#ifndef MOE_SERVICES_TRANSPORT_SECURITY_H_
#define MOE_SERVICES_TRANSPORT_SECURITY_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace moe::transport {

struct TlsOptions {
  std::string cert_file;  // this process's certificate chain (PEM); servers need one
  std::string key_file;   // its private key (PEM; not readable by others)
  std::string ca_file;    // the CA bundle peers are verified against (PEM); empty: no TLS
  // Servers: ask every client for a certificate signed by the CA and refuse those without one
  // (mutual TLS). Off: any client may connect (server-authenticated TLS only).
  bool require_client_cert = true;
  int refresh_seconds = 60;  // how often the files are checked for a new version
  // Members' certificates carry spiffe://<trust_domain>/<role>/<name> (role expert or
  // attention): with mutual TLS a member may act only as the one its certificate names.
  std::string trust_domain = "moe";
  // With mutual TLS, bind members to their certificates' identities (above). Off only where
  // every member shares one certificate (a single Secret): members are then all equal.
  bool member_identity = true;

  bool enabled() const { return !ca_file.empty(); }
};

// INVALID_ARGUMENT for an incomplete set (a key without its certificate, a CA missing), NOT_FOUND
// for a file that cannot be read or holds no PEM block, PERMISSION_DENIED for a key others may
// read. Checked before gRPC sees the files: its file watcher only logs what it cannot load.
absl::Status ValidateTlsOptions(const TlsOptions& tls, bool server);

// Credentials for channels (server certificates verified against the CA and the target's host
// name; the process's own certificate presented when it has one) and for servers.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls);
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls);

// The process-wide credentials MakeChannel and GrpcServer::Start use when given none. Call once,
// before any channel or server is made; options without a CA leave the process in plaintext.
// server: the process serves (it then needs a certificate).
absl::Status ConfigureProcessTls(const TlsOptions& tls, bool server);
bool ProcessTlsEnabled();

// Member tokens, for clusters without mutual TLS. router-svc holds the cluster secret; no member
// does. An expert's token names it: hex(SHA-256(secret ":expert:" shard)) (ExpertMemberToken), so
// that it registers and heartbeats under its own shard name only (another expert's token, or
// the token of a name the deployment never gave, is refused). The attention tier's token is its
// role's, hex(SHA-256(secret ":attention")) (MemberRoleToken): attention nodes are replicas of
// one Deployment with no name one holds and another lacks; it lets them report statistics and
// dispatch. expert-svc checks Dispatch against the attention token's SHA-256
// (MemberTokenDigest), so that no expert holds a token that acts as an attention node, nor the
// other way round. With mutual TLS the certificates bind every name instead (docs/security.md).
std::string MemberRoleToken(const std::string& cluster_secret, const std::string& role);
std::string ExpertMemberToken(const std::string& cluster_secret, const std::string& shard);
// hex(SHA-256(token)).
std::string MemberTokenDigest(const std::string& token);

// A member's identity from its certificate: the SPIFFE ID spiffe://<trust domain>/<role>/<name>.
struct MemberIdentity {
  std::string role;  // "expert" or "attention"
  std::string name;  // the shard or node name (letters, digits, - . _; 1 to 128 bytes)
};
// A member's name (a shard, a node; a StatefulSet pod name fits): 1 to 128 letters, digits,
// '-', '.' and '_'. The rule of SPIFFE names here and of router-svc's registrations.
inline constexpr size_t kMaxMemberNameBytes = 128;
bool IsMemberName(const std::string& name);
// INVALID_ARGUMENT saying what is wrong (scheme, trust domain, role, name).
absl::StatusOr<MemberIdentity> ParseMemberSpiffeId(const std::string& id,
                                                   const std::string& trust_domain);
// Whether this process's servers bind members to their certificates: TLS with client
// certificates required (the default with --tls_ca_file). The trust domain they expect.
bool ProcessBindsMemberIdentity();
std::string ProcessTrustDomain();
std::shared_ptr<grpc::ChannelCredentials> ProcessChannelCredentials();
// FAILED_PRECONDITION in a TLS process configured without a certificate (a client only): it
// never falls back to a plaintext server.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ProcessServerCredentials();

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_SECURITY_H_
