// A throwaway certificate authority for a cluster on one host: a fresh CA and one certificate per
// process, each naming the SPIFFE identity the services bind members to
// (spiffe://<trust domain>/<role>/<name>, security.h) and the loopback names a local peer dials
// (localhost, 127.0.0.1, ::1). What `moe-cli up` makes by default, so that a local cluster runs
// with mutual TLS and every member acts only as itself without anyone running openssl.
//
//   MOE_RETURN_IF_ERROR(MakeLocalPki(dir, {{"shard-0", "expert"}, {"client", "client"}}, "moe"));
//   // dir/ca.pem, dir/ca.key, dir/shard-0.pem, dir/shard-0.key, dir/client.pem, dir/client.key
//
// Keys are EC P-256, written 0600 (ValidateTlsOptions refuses keys others may read);
// certificates are valid from an hour ago (clock skew) for `days`. The CA's key stays in dir so
// that an operator can issue one more member by the same rules; nothing else reads it.
#ifndef MOE_SERVICES_TRANSPORT_LOCAL_PKI_H_
#define MOE_SERVICES_TRANSPORT_LOCAL_PKI_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moe::transport {

struct PkiMember {
  std::string name;  // a member name (IsMemberName): the file stem and the SPIFFE ID's last part
  std::string role;  // expert, attention, router or client
};

// INVALID_ARGUMENT for a name that is no member name or a role outside the four; INTERNAL when
// OpenSSL fails (its reason appended); the files of a failed call may be partly written.
absl::Status MakeLocalPki(const std::string& dir, const std::vector<PkiMember>& members,
                          const std::string& trust_domain, int days = 30);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_LOCAL_PKI_H_
