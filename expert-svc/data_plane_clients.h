// The attention nodes that opened the out-of-band data plane of an expert server
// (ExpertService.OpenDataPlane, docs/data-plane.md): per client an id, a hello secret and a
// payload MAC key drawn from a CSPRNG, and, once its UCX hello arrived, the endpoint UCX made
// for it. No UCX here (a pure registry, tested without processes): the server never parses an
// address a client supplied; it binds a client to the endpoint its hello came on.
//
//   DataPlaneClients clients(256);
//   MOE_ASSIGN_OR_RETURN(DataPlaneClient c, clients.Open("attention-0", &replaced));
//   ... reply c.id, c.hello_secret, c.mac_key over the authenticated gRPC call ...
//   MOE_ASSIGN_OR_RETURN(DataPlaneClient bound, clients.Bind(hello_bytes, reply_endpoint));
//   MOE_ASSIGN_OR_RETURN(DataPlaneClient c, clients.Get(oob.client_id()));  // bound ones only
#ifndef MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_
#define MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_

#include <bitset>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/dataplane/payload_mac.h"

namespace moe::expert_svc {

struct DataPlaneClient {
  uint64_t id = 0;
  std::string node;
  std::string hello_secret;  // dataplane::kHelloSecretBytes
  std::string mac_key;       // dataplane::kMacKeyBytes
  uint64_t ack_tag = 0;      // the hello's acknowledgement goes out on this tag
  uint64_t endpoint = 0;     // the UCX endpoint of its hello; 0 until then
  std::shared_ptr<const dataplane::PayloadMac> mac;
};

// The out-of-band part of one batch's header (expert.proto OutOfBand), as a member sent it.
struct OutOfBandHeader {
  uint64_t batch_id = 0;
  uint64_t client_id = 0;
  uint64_t tag = 0;
  int64_t activation_bytes = 0;
  uint64_t reply_tag = 0;
  int64_t reply_bytes = 0;
  uint64_t sequence = 0;
  std::string activation_mac;
};

// What may reach UCX from a header: both sizes in [1, max_message_bytes] (the reply in [0, ...]),
// a 16-byte MAC. INVALID_ARGUMENT naming `where` and the field otherwise (fuzzed:
// tests/fuzz/data_plane_fuzz.cc).
absl::Status ValidateOutOfBand(const OutOfBandHeader& h, int64_t max_message_bytes,
                               const std::string& where);

class DataPlaneClients {
 public:
  static constexpr size_t kMaxNodeBytes = 128;

  explicit DataPlaneClients(int max_clients) : max_clients_(max_clients) {}

  // A new client for `node`, with fresh secrets. A node that opens again (a reconnect)
  // replaces its old client: *replaced_endpoint is then that client's endpoint (0 if none, or
  // when another client is bound to the same endpoint: UCX reuses the endpoint of a peer that
  // died for a new one), for the caller to forget. INVALID_ARGUMENT for a node name over
  // kMaxNodeBytes. Past max_clients the least recently used client idle for kIdleEviction is
  // evicted (attention nodes that are gone, e.g. pods replaced under new names, never
  // reconnect; *replaced_endpoint is then its endpoint); RESOURCE_EXHAUSTED when none is.
  static constexpr absl::Duration kIdleEviction = absl::Seconds(60);
  absl::StatusOr<DataPlaneClient> Open(const std::string& node, uint64_t* replaced_endpoint,
                                       absl::Time now = absl::Now());
  // Binds the client a hello names to the endpoint the hello came on. INVALID_ARGUMENT for a
  // malformed hello, NOT_FOUND for an unknown client, PERMISSION_DENIED for a wrong secret
  // (compared in constant time), ALREADY_EXISTS when that client is bound to another endpoint.
  // The same hello again on the same endpoint is fine (UCX may deliver a retry).
  absl::StatusOr<DataPlaneClient> Bind(std::string_view hello, uint64_t endpoint);
  // A bound client; NOT_FOUND for an unknown or replaced one, FAILED_PRECONDITION for one whose
  // hello has not arrived.
  // Counts as a use of the client (idle eviction).
  absl::StatusOr<DataPlaneClient> Get(uint64_t id, absl::Time now = absl::Now()) const;
  // Claims a batch sequence of a client once (a batch message's MAC nonce): true for a sequence
  // this client has not used, within kReplayWindow of its highest; false for a replay, one too
  // old to tell, or an unknown client. A replayed message is never answered, so a peer cannot
  // make this server seal two replies under one nonce.
  static constexpr uint64_t kReplayWindow = 1024;
  bool ClaimSequence(uint64_t id, uint64_t sequence);
  int size() const;

 private:
  const int max_clients_;
  mutable std::mutex mu_;
  std::map<uint64_t, DataPlaneClient> clients_ ABSL_GUARDED_BY(mu_);
  mutable std::map<uint64_t, absl::Time> last_used_ ABSL_GUARDED_BY(mu_);
  // Per client: the highest sequence claimed and which of the kReplayWindow below it were.
  struct Seen {
    uint64_t highest = 0;
    std::bitset<kReplayWindow> used;
  };
  std::map<uint64_t, Seen> seen_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_
