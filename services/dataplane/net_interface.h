// The network interface that holds an address: what a UCX worker restricts its TCP transport to
// (UcxOptions::bind_host), so it listens where the service was told to and not on every
// interface. Pure sockets code (no UCX).
//
//   MOE_ASSIGN_OR_RETURN(std::string iface, InterfaceOf("127.0.0.1"));  // "lo"
#ifndef MOE_SERVICES_DATAPLANE_NET_INTERFACE_H_
#define MOE_SERVICES_DATAPLANE_NET_INTERFACE_H_

#include <string>

#include "absl/status/statusor.h"

namespace moe::dataplane {

// The interface that holds `host` (an IP address, bracketed IPv6 too, or a name resolving to
// one), or whose loopback network contains it (127.0.0.2: "lo"). Empty for an empty or wildcard
// host (0.0.0.0, ::); INVALID_ARGUMENT when no interface holds it or it does not resolve.
absl::StatusOr<std::string> InterfaceOf(const std::string& host);

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_NET_INTERFACE_H_
