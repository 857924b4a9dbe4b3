#include "services/dataplane/net_interface.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::dataplane {

absl::StatusOr<std::string> InterfaceOf(const std::string& host_in) {
  std::string host = host_in;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0" || host == "::") return std::string();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("host '", host, "' does not resolve"));
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) {
    freeaddrinfo(found);
    return absl::InternalError("getifaddrs failed");
  }
  std::string name;
  for (addrinfo* a = found; a != nullptr && name.empty(); a = a->ai_next) {
    for (ifaddrs* i = ifs; i != nullptr && name.empty(); i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != a->ai_family) continue;
      const bool same =
          a->ai_family == AF_INET
              ? reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                    reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr
              : std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                            &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr,
                            sizeof(in6_addr)) == 0;
      if (same) name = i->ifa_name;
    }
  }
  // Not an interface's own address but inside a loopback interface's network (127.0.0.2 on
  // lo's 127.0.0.0/8): that interface.
  for (addrinfo* a = found; a != nullptr && name.empty(); a = a->ai_next) {
    if (a->ai_family != AF_INET) continue;
    const uint32_t want = reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr;
    for (ifaddrs* i = ifs; i != nullptr && name.empty(); i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_netmask == nullptr ||
          i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) == 0) {
        continue;
      }
      const uint32_t net = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
      const uint32_t mask = reinterpret_cast<const sockaddr_in*>(i->ifa_netmask)->sin_addr.s_addr;
      if ((want & mask) == (net & mask)) name = i->ifa_name;
    }
  }
  freeifaddrs(ifs);
  freeaddrinfo(found);
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("host '", host, "' is not an address of any interface of this machine"));
  }
  return name;
}

}  // namespace moe::dataplane
