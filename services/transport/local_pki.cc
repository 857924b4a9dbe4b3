#include "services/transport/local_pki.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/transport/security.h"

namespace moe::transport {

namespace {

struct Free {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
  void operator()(X509* p) const { X509_free(p); }
  void operator()(BIO* p) const { BIO_free(p); }
  void operator()(BIGNUM* p) const { BN_free(p); }
  void operator()(X509_EXTENSION* p) const { X509_EXTENSION_free(p); }
};
template <typename T>
using Owned = std::unique_ptr<T, Free>;

absl::Status OpensslError(const std::string& what) {
  char buf[256] = "no reason given";
  if (const unsigned long e = ERR_get_error(); e != 0) ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return absl::InternalError(absl::StrCat("local PKI: ", what, ": ", buf));
}

// One X.509 v3 extension by its OpenSSL configuration text, with ctx naming issuer and subject.
absl::Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const std::string& value) {
  Owned<X509_EXTENSION> ext(X509V3_EXT_conf_nid(nullptr, ctx, nid, value.c_str()));
  if (ext == nullptr || X509_add_ext(cert, ext.get(), -1) != 1) {
    return OpensslError(absl::StrCat("extension ", OBJ_nid2sn(nid), " = ", value));
  }
  return absl::OkStatus();
}

// A certificate for key, issued by issuer (null: self-issued), with a random 127-bit serial,
// valid from an hour ago for `days`; unsigned (Sign, after its extensions).
absl::StatusOr<Owned<X509>> NewCertificate(EVP_PKEY* key, const std::string& common_name,
                                           X509* issuer, int days) {
  Owned<X509> cert(X509_new());
  Owned<BIGNUM> serial(BN_new());
  if (cert == nullptr || serial == nullptr || X509_set_version(cert.get(), 2) != 1 ||
      BN_rand(serial.get(), 127, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) == nullptr ||
      X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) == nullptr ||
      X509_gmtime_adj(X509_getm_notAfter(cert.get()), 86400L * days) == nullptr ||
      X509_set_pubkey(cert.get(), key) != 1) {
    return OpensslError("a new certificate");
  }
  X509_NAME* subject = X509_get_subject_name(cert.get());
  if (X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()), -1,
                                 -1, 0) != 1 ||
      X509_set_issuer_name(cert.get(),
                           issuer != nullptr ? X509_get_subject_name(issuer) : subject) != 1) {
    return OpensslError("the certificate's names");
  }
  return cert;
}

absl::Status Sign(X509* cert, EVP_PKEY* issuer_key) {
  if (X509_sign(cert, issuer_key, EVP_sha256()) <= 0) return OpensslError("signing");
  return absl::OkStatus();
}

absl::StatusOr<std::string> Pem(X509* cert, EVP_PKEY* key) {
  Owned<BIO> bio(BIO_new(BIO_s_mem()));
  const int ok = cert != nullptr ? PEM_write_bio_X509(bio.get(), cert)
                                 : PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0,
                                                            nullptr, nullptr);
  if (bio == nullptr || ok != 1) return OpensslError("PEM encoding");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// A certificate others may read (0644), written whole before it replaces an older one.
absl::Status WritePublicFile(const std::string& path, const std::string& text) {
  MOE_RETURN_IF_ERROR(WritePrivateFile(path, text));
  if (::chmod(path.c_str(), 0644) != 0) {
    return absl::InternalError(absl::StrCat("chmod 644 ", path));
  }
  return absl::OkStatus();
}

absl::Status WriteKeyAndCertificate(const std::string& stem, EVP_PKEY* key, X509* cert) {
  MOE_ASSIGN_OR_RETURN(std::string key_pem, Pem(nullptr, key));
  MOE_ASSIGN_OR_RETURN(std::string cert_pem, Pem(cert, nullptr));
  MOE_RETURN_IF_ERROR(WritePrivateFile(stem + ".key", key_pem));
  return WritePublicFile(stem + ".pem", cert_pem);
}

}  // namespace

absl::Status MakeLocalPki(const std::string& dir, const std::vector<PkiMember>& members,
                          const std::string& trust_domain, int days) {
  for (const PkiMember& m : members) {
    if (!IsMemberName(m.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("local PKI: '", m.name.substr(0, kMaxMemberNameBytes),
                       "' is no member name (1 to 128 letters, digits, - . _)"));
    }
    if (m.role != "expert" && m.role != "attention" && m.role != "router" && m.role != "client") {
      return absl::InvalidArgumentError(absl::StrCat("local PKI: role '", m.role, "' of ", m.name,
                                                     " (expert, attention, router or client)"));
    }
  }
  // The trust domain goes into OpenSSL's configuration text of the SAN: a member name's
  // alphabet keeps a comma or a colon from adding a name.
  if (!IsMemberName(trust_domain)) {
    return absl::InvalidArgumentError(absl::StrCat("local PKI: trust domain '",
                                                   trust_domain.substr(0, kMaxMemberNameBytes),
                                                   "' (letters, digits, - . _)"));
  }
  if (days < 1) return absl::InvalidArgumentError("local PKI: validity of less than a day");
  ::mkdir(dir.c_str(), 0700);
  Owned<EVP_PKEY> ca_key(EVP_EC_gen("P-256"));
  if (ca_key == nullptr) return OpensslError("the CA's key");
  MOE_ASSIGN_OR_RETURN(Owned<X509> ca, NewCertificate(ca_key.get(), "moe local CA", nullptr, days));
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, ca.get(), ca.get(), nullptr, nullptr, 0);
  MOE_RETURN_IF_ERROR(AddExtension(ca.get(), &ctx, NID_basic_constraints, "critical,CA:TRUE"));
  MOE_RETURN_IF_ERROR(AddExtension(ca.get(), &ctx, NID_key_usage, "critical,keyCertSign,cRLSign"));
  MOE_RETURN_IF_ERROR(AddExtension(ca.get(), &ctx, NID_subject_key_identifier, "hash"));
  MOE_RETURN_IF_ERROR(Sign(ca.get(), ca_key.get()));
  MOE_RETURN_IF_ERROR(WriteKeyAndCertificate(dir + "/ca", ca_key.get(), ca.get()));
  for (const PkiMember& m : members) {
    Owned<EVP_PKEY> key(EVP_EC_gen("P-256"));
    if (key == nullptr) return OpensslError("a member's key");
    MOE_ASSIGN_OR_RETURN(Owned<X509> cert, NewCertificate(key.get(), "moe-member", ca.get(), days));
    X509V3_set_ctx(&ctx, ca.get(), cert.get(), nullptr, nullptr, 0);
    MOE_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_basic_constraints, "CA:FALSE"));
    MOE_RETURN_IF_ERROR(
        AddExtension(cert.get(), &ctx, NID_key_usage, "digitalSignature,keyEncipherment"));
    MOE_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_ext_key_usage, "serverAuth,clientAuth"));
    MOE_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_authority_key_identifier, "keyid"));
    MOE_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, NID_subject_alt_name,
                                     absl::StrCat("DNS:localhost,IP:127.0.0.1,IP:::1,URI:spiffe://",
                                                  trust_domain, "/", m.role, "/", m.name)));
    MOE_RETURN_IF_ERROR(Sign(cert.get(), ca_key.get()));
    MOE_RETURN_IF_ERROR(WriteKeyAndCertificate(dir + "/" + m.name, key.get(), cert.get()));
  }
  return absl::OkStatus();
}

}  // namespace moe::transport
