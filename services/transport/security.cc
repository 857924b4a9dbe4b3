#include "services/transport/security.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/temp_dir.h"

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

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// OK when the PEM texts hold a certificate and a private key that belong together.
absl::Status CheckPair(const std::string& cert_pem, const std::string& key_pem) {
  BIO* cb = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  BIO* kb = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  X509* cert = cb != nullptr ? PEM_read_bio_X509(cb, nullptr, nullptr, nullptr) : nullptr;
  EVP_PKEY* key = kb != nullptr ? PEM_read_bio_PrivateKey(kb, nullptr, nullptr, nullptr) : nullptr;
  absl::Status s = absl::OkStatus();
  if (cert == nullptr) {
    s = absl::InvalidArgumentError("the certificate file holds no readable certificate");
  } else if (key == nullptr) {
    s = absl::InvalidArgumentError("the key file holds no readable private key");
  } else if (X509_check_private_key(cert, key) != 1) {
    s = absl::InvalidArgumentError("the key does not match the certificate");
  }
  ERR_clear_error();
  X509_free(cert);
  EVP_PKEY_free(key);
  BIO_free(cb);
  BIO_free(kb);
  return s;
}

// The last good certificate and key of one (cert_file, key_file), where gRPC's file watcher
// reads them: copies in a private directory (generation g<N>, and a symlink `current` swapped
// atomically to the newest), replaced only when the operator's files hold a new pair whose key
// matches its certificate. gRPC's own watcher stops every new handshake when it reads a
// mismatched pair (a half-done or broken rotation); here a broken rotation is logged once per
// new content and the last good pair keeps serving, and a good pair later is taken as usual.
class PairKeeper {
 public:
  static absl::StatusOr<std::shared_ptr<PairKeeper>> For(const TlsOptions& tls) {
    static std::mutex mu;
    static auto* keepers = new std::map<std::string, std::shared_ptr<PairKeeper>>();
    std::lock_guard<std::mutex> lock(mu);
    const std::string id = tls.cert_file + "\n" + tls.key_file;
    auto it = keepers->find(id);
    if (it != keepers->end()) return it->second;
    // A copy of the private key lives here: removed when the process ends normally.
    absl::StatusOr<std::string> dir = MakeTempDir("moe-tls");
    if (!dir.ok()) return dir.status();
    RemoveTreeAtExit(*dir);
    auto k = std::shared_ptr<PairKeeper>(new PairKeeper(tls, *dir));
    const std::string cert = ReadAll(tls.cert_file), key = ReadAll(tls.key_file);
    if (absl::Status s = CheckPair(cert, key); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS ", tls.cert_file, " and ", tls.key_file, ": ", s.message()));
    }
    if (absl::Status s = k->Publish(cert, key); !s.ok()) return s;
    // Process-wide, like the credentials that read it: the keeper is never destroyed.
    std::thread([k = k.get()] { k->Watch(); }).detach();
    (*keepers)[id] = k;
    return k;
  }
  std::string cert_path() const { return dir_ + "/current/tls.crt"; }
  std::string key_path() const { return dir_ + "/current/tls.key"; }

 private:
  PairKeeper(const TlsOptions& tls, std::string dir)
      : cert_file_(tls.cert_file),
        key_file_(tls.key_file),
        refresh_(std::chrono::seconds(std::max(1, tls.refresh_seconds))),
        dir_(std::move(dir)) {}

  absl::Status Publish(const std::string& cert, const std::string& key) {
    const std::string gen = absl::StrCat("g", ++generation_);
    const std::string gdir = dir_ + "/" + gen;
    if (::mkdir(gdir.c_str(), 0700) != 0) return absl::InternalError("mkdir " + gdir);
    for (const auto& [name, text] :
         {std::pair<const char*, const std::string&>{"tls.crt", cert}, {"tls.key", key}}) {
      const std::string path = gdir + "/" + name;
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f << text;
      if (!f) return absl::InternalError("cannot write " + path);
      ::chmod(path.c_str(), 0600);
    }
    const std::string link = dir_ + "/current.tmp";
    ::unlink(link.c_str());
    if (::symlink(gen.c_str(), link.c_str()) != 0 ||
        ::rename(link.c_str(), (dir_ + "/current").c_str()) != 0) {
      return absl::InternalError("cannot publish the TLS pair in " + dir_);
    }
    // Two generations back is no longer read by anyone.
    if (generation_ > 2) {
      const std::string old = absl::StrCat(dir_, "/g", generation_ - 2);
      ::unlink((old + "/tls.crt").c_str());
      ::unlink((old + "/tls.key").c_str());
      ::rmdir(old.c_str());
    }
    last_cert_ = cert;
    last_key_ = key;
    return absl::OkStatus();
  }

  void Watch() {
    std::string refused_cert, refused_key;
    for (;;) {
      std::this_thread::sleep_for(refresh_);
      const std::string cert = ReadAll(cert_file_), key = ReadAll(key_file_);
      if (cert == last_cert_ && key == last_key_) continue;
      if (absl::Status s = CheckPair(cert, key); !s.ok()) {
        if (cert != refused_cert || key != refused_key) {
          std::fprintf(stderr,
                       "TLS rotation refused (%s and %s: %s): serving the last good certificate "
                       "until a matching pair appears\n",
                       cert_file_.c_str(), key_file_.c_str(), std::string(s.message()).c_str());
          refused_cert = cert;
          refused_key = key;
        }
        continue;
      }
      if (absl::Status s = Publish(cert, key); !s.ok()) {
        std::fprintf(stderr, "TLS rotation: %s\n", std::string(s.message()).c_str());
      }
    }
  }

  const std::string cert_file_, key_file_;
  const std::chrono::seconds refresh_;
  const std::string dir_;
  int64_t generation_ = 0;
  std::string last_cert_, last_key_;
};

absl::StatusOr<std::shared_ptr<gx::FileWatcherCertificateProvider>> Provider(
    const TlsOptions& tls) {
  const unsigned refresh = static_cast<unsigned>(std::max(1, tls.refresh_seconds));
  if (tls.cert_file.empty()) {
    return std::make_shared<gx::FileWatcherCertificateProvider>(tls.ca_file, refresh);
  }
  auto keeper = PairKeeper::For(tls);
  if (!keeper.ok()) return keeper.status();
  return std::make_shared<gx::FileWatcherCertificateProvider>(
      (*keeper)->key_path(), (*keeper)->cert_path(), tls.ca_file, refresh);
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
  if (auto s = CheckPemFile("key", tls.key_file, true); !s.ok()) return s;
  if (auto s = CheckPair(ReadAll(tls.cert_file), ReadAll(tls.key_file)); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS ", tls.cert_file, " and ", tls.key_file, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsOptions& tls) {
  if (auto s = ValidateTlsOptions(tls, /*server=*/false); !s.ok()) return s;
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  auto provider = Provider(tls);
  if (!provider.ok()) return provider.status();
  gx::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(*provider);
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
  auto provider = Provider(tls);
  if (!provider.ok()) return provider.status();
  gx::TlsServerCredentialsOptions o(*provider);
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
  p.binds_identity = server != nullptr && tls.require_client_cert && tls.member_identity;
  p.server = std::move(server);
  p.trust_domain = tls.trust_domain;
  return absl::OkStatus();
}

namespace {
std::string Sha256Hex(const std::string& data) {
  unsigned char md[32];
  unsigned int n = 0;
  EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) {
    out.push_back(kHex[md[i] >> 4]);
    out.push_back(kHex[md[i] & 15]);
  }
  return out;
}
}  // namespace

std::string MemberRoleToken(const std::string& cluster_secret, const std::string& role) {
  return Sha256Hex(cluster_secret + ":" + role);
}

std::string ExpertMemberToken(const std::string& cluster_secret, const std::string& shard) {
  return Sha256Hex(cluster_secret + ":expert:" + shard);
}

std::string MemberTokenDigest(const std::string& token) { return Sha256Hex(token); }

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

bool IsMemberName(const std::string& name) {
  if (name.empty() || name.size() > kMaxMemberNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_') {
      return false;
    }
  }
  return true;
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
  if (!IsMemberName(m.name)) {
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
