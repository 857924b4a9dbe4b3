#include "services/transport/security.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moe::transport {
namespace {

namespace gx = grpc::experimental;

absl::Status CheckPemFile(const std::string& what, const std::string& path, bool private_key) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read the TLS ", what, " file ", path));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::NotFoundError(absl::StrCat("the TLS ", what, " file ", path, " holds no PEM"));
  }
  struct stat st;
  // A key others can read is as good as published (the group may: a Kubernetes Secret mounted
  // 0440 for the pod's fsGroup).
  if (private_key && ::stat(path.c_str(), &st) == 0 && (st.st_mode & S_IROTH) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("the TLS key file ", path, " is readable by others (chmod 600 it)"));
  }
  return absl::OkStatus();
}

std::shared_ptr<gx::FileWatcherCertificateProvider> Provider(const TlsOptions& tls) {
  const unsigned refresh = static_cast<unsigned>(std::max(1, tls.refresh_seconds));
  if (tls.cert_file.empty()) {
    return std::make_shared<gx::FileWatcherCertificateProvider>(tls.ca_file, refresh);
  }
  return std::make_shared<gx::FileWatcherCertificateProvider>(tls.key_file, tls.cert_file,
                                                              tls.ca_file, refresh);
}

struct ProcessCredentials {
  std::mutex mu;
  bool configured = false;
  std::shared_ptr<grpc::ChannelCredentials> channel;
  std::shared_ptr<grpc::ServerCredentials> server;
  bool binds_identity = false;
  std::string trust_domain = "moe";
};

ProcessCredentials& Process() {
  static auto* p = new ProcessCredentials();
  return *p;
}

}  // namespace

absl::Status ValidateTlsOptions(const TlsOptions& tls, bool server) {
  if (!tls.enabled()) {
    if (!tls.cert_file.empty() || !tls.key_file.empty()) {
      return absl::InvalidArgumentError(
          "a TLS certificate or key without a CA file (--tls_ca_file): peers cannot be verified");
    }
    return absl::OkStatus();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "a TLS certificate needs its key and a key its certificate (--tls_cert_file, "
        "--tls_key_file)");
  }
  if (server && tls.cert_file.empty()) {
    return absl::InvalidArgumentError("a TLS server needs a certificate (--tls_cert_file)");
  }
  if (tls.refresh_seconds < 1) {
    return absl::InvalidArgumentError("the TLS refresh period must be at least 1 s");
  }
  if (auto s = CheckPemFile("CA", tls.ca_file, false); !s.ok()) return s;
  if (tls.cert_file.empty()) return absl::OkStatus();
  if (auto s = CheckPemFile("certificate", tls.cert_file, false); !s.ok()) return s;
  return CheckPemFile("key", tls.key_file, true);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls) {
  if (auto s = ValidateTlsOptions(tls, /*server=*/false); !s.ok()) return s;
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  gx::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(Provider(tls));
  o.watch_root_certs();
  if (!tls.cert_file.empty()) o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);  // chain to the CA, and the target host in its names
  auto creds = gx::TlsCredentials(o);
  if (creds == nullptr) return absl::InternalError("gRPC refused the TLS channel options");
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls) {
  if (auto s = ValidateTlsOptions(tls, /*server=*/true); !s.ok()) return s;
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  gx::TlsServerCredentialsOptions o(Provider(tls));
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(tls.require_client_cert
                              ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                              : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  auto creds = gx::TlsServerCredentials(o);
  if (creds == nullptr) return absl::InternalError("gRPC refused the TLS server options");
  return creds;
}

absl::Status ConfigureProcessTls(const TlsOptions& tls, bool server_side) {
  if (auto s = ValidateTlsOptions(tls, server_side); !s.ok()) return s;
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.configured) return absl::FailedPreconditionError("process TLS is configured once");
  std::shared_ptr<grpc::ChannelCredentials> channel;
  std::shared_ptr<grpc::ServerCredentials> server;
  if (tls.enabled()) {
    auto c = MakeChannelCredentials(tls);
    if (!c.ok()) return c.status();
    channel = *std::move(c);
    // A process without a certificate of its own (a client) has no server side.
    if (!tls.cert_file.empty()) {
      auto s = MakeServerCredentials(tls);
      if (!s.ok()) return s.status();
      server = *std::move(s);
    }
  }
  p.configured = true;
  p.channel = std::move(channel);
  p.binds_identity = server != nullptr && tls.require_client_cert;
  p.server = std::move(server);
  p.trust_domain = tls.trust_domain;
  return absl::OkStatus();
}

bool ProcessBindsMemberIdentity() {
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.binds_identity;
}

std::string ProcessTrustDomain() {
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.trust_domain;
}

absl::StatusOr<MemberIdentity> ParseMemberSpiffeId(const std::string& id,
                                                   const std::string& trust_domain) {
  const std::string prefix = "spiffe://" + trust_domain + "/";
  if (id.compare(0, prefix.size(), prefix) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("'", id.substr(0, 160),
                                                   "' is not a SPIFFE ID of the trust domain ",
                                                   trust_domain, " (", prefix, "<role>/<name>)"));
  }
  const std::string rest = id.substr(prefix.size());
  const size_t slash = rest.find('/');
  MemberIdentity m;
  if (slash != std::string::npos) {
    m.role = rest.substr(0, slash);
    m.name = rest.substr(slash + 1);
  }
  if (m.role != "expert" && m.role != "attention") {
    return absl::InvalidArgumentError(
        absl::StrCat("'", id.substr(0, 160), "' names no member role (expert or attention)"));
  }
  bool ok = !m.name.empty() && m.name.size() <= 128;
  for (char c : m.name) {
    ok &= absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", id.substr(0, 160), "': a member name is 1 to 128 letters, digits, - . _"));
  }
  return m;
}

bool ProcessTlsEnabled() {
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.channel != nullptr;
}

std::shared_ptr<grpc::ChannelCredentials> ProcessChannelCredentials() {
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.channel != nullptr ? p.channel : grpc::InsecureChannelCredentials();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ProcessServerCredentials() {
  ProcessCredentials& p = Process();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.server != nullptr) return p.server;
  if (p.channel != nullptr) {
    return absl::FailedPreconditionError(
        "this process has TLS without a certificate of its own: it cannot serve TLS");
  }
  return grpc::InsecureServerCredentials();
}

}  // namespace moe::transport
