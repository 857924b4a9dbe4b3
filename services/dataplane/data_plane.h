// Which data plane a service uses for the expert payloads (docs/data-plane.md), and the small
// formats of the out-of-band path that are parsed from peer bytes: the UCX hello and the lanes
// UCX reports for an endpoint. Pure code (no UCX), so the fuzzers and the stub build have it.
//
//   auto: UCX when this build and the peer have it, else in-band gRPC (the default)
//   grpc: in band only; ucx: UCX or fail (the attention node names the shard)
//
//   std::string h = EncodeHello({.client_id = id, .secret = opened.hello()});
//   MOE_ASSIGN_OR_RETURN(Hello got, ParseHello(bytes_from_a_peer));  // exact size, magic
//   UcxLanes lanes = ParseUcxLanes(text_of_ucp_ep_print_info);         // lanes.kind: "shm"
#ifndef MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
#define MOE_SERVICES_DATAPLANE_DATA_PLANE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::dataplane {

enum class DataPlane { kAuto, kGrpc, kUcx };

const char* DataPlaneName(DataPlane d);
absl::StatusOr<DataPlane> ParseDataPlane(const std::string& name);

// The first UCX message of an attention node to an expert server, an active message sent with
// UCP_AM_SEND_FLAG_REPLY on the endpoint the node made from the address OpenDataPlane returned:
// the server binds the client to the endpoint that message arrived on (UCX hands it over), so it
// never parses an address a peer supplied. secret: the 16 random bytes OpenDataPlane gave only
// to that client over the authenticated gRPC call. Layout: "MOEH", version 1, client id (8
// bytes little-endian), secret: 29 bytes exactly.
constexpr size_t kHelloSecretBytes = 16;
constexpr size_t kHelloBytes = 4 + 1 + 8 + kHelloSecretBytes;
struct Hello {
  uint64_t client_id = 0;
  std::string secret;  // kHelloSecretBytes
};
std::string EncodeHello(const Hello& h);
// INVALID_ARGUMENT for anything but a well-formed hello.
absl::StatusOr<Hello> ParseHello(std::string_view bytes);

// The lanes UCX selected for an endpoint, read from ucp_ep_print_info's text (UCX 1.13 has no
// query for them). kind: "shm" when every lane is a shared-memory transport (posix, sysv, cma,
// xpmem, knem, self), "tcp" when every lane is tcp, "rdma" when every lane is verbs (rc, ud, dc,
// their mlx5 variants), "mixed" otherwise, "none" for text without lanes.
struct UcxLanes {
  std::vector<std::string> transports;  // distinct, in lane order: {"posix"}, {"posix", "tcp"}
  std::string kind = "none";
  // "shm (posix)", "tcp", "mixed (posix, tcp)": for logs, metrics and the ack a server sends.
  std::string Describe() const;
};
UcxLanes ParseUcxLanes(std::string_view print_info);
// The class of one UCX transport name: "shm", "tcp", "rdma" or "other".
const char* TransportClass(std::string_view transport);

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
