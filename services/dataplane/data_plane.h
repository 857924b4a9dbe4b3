// Which data plane a service uses for the expert payloads (docs/data-plane.md), and the small
// formats of the out-of-band path that are parsed from peer bytes: the UCX hello and the lanes
// UCX reports for an endpoint. Pure code (no UCX), so the fuzzers and the stub build have it.
//
//   auto: the backends of kAutoBackends this build has. A shard offers each (UCX first: what it
//   registers and what callers that name none get); a node uses, per shard, the first the
//   shard offers that it can reach (shm where both share a host and network namespace, UCX
//   otherwise), else in-band gRPC.
//   grpc: in band only; a backend's name ("ucx", "shm", "fake"): that one or fail (the
//   attention node names the shard). Each service's registry (expert-svc/dataplane,
//   attention-svc/dataplane) says which names exist.
//
//   std::string h = EncodeHello({.client_id = id, .secret = opened.hello()});
//   MOE_ASSIGN_OR_RETURN(Hello got, ParseHello(bytes_from_a_peer));  // exact size, magic
//   UcxLanes lanes = ParseUcxLanes(text_of_ucp_ep_print_info);         // lanes.kind: "shm"
#ifndef MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
#define MOE_SERVICES_DATAPLANE_DATA_PLANE_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "services/dataplane/payload_mac.h"

namespace moe::dataplane {

// The --data_plane choice of a service.
// The longest a backend's progress thread may be asked to keep polling after its last activity
// (--ucx_progress_spin_us), microseconds: a spin is for the gaps inside a transfer.
inline constexpr int kMaxProgressSpinUs = 10000;
// --ucx_progress_spin_us as both services hand it to their backend: within [0, the maximum].
inline std::chrono::microseconds ProgressSpin(int us) {
  return std::chrono::microseconds(std::clamp(us, 0, kMaxProgressSpinUs));
}

struct DataPlane {
  // What a shard registers under auto, and what an OpenDataPlane naming no backend gets (the
  // callers of before OpenDataPlaneRequest.transport speak only it).
  static constexpr const char* kDefaultBackend = "ucx";
  std::string name = "auto";  // "auto", "grpc" or a backend's name
  bool automatic() const { return name == "auto"; }
  bool in_band() const { return name == "grpc"; }
  // The backends to start, in the order an attention node prefers them: the named one; under
  // auto shm (one host and network namespace: T = 16 in a third of UCX's time,
  // docs/data-plane.md) then UCX; none for grpc.
  std::vector<std::string> backends() const {
    if (in_band()) return {};
    if (automatic()) return {"shm", kDefaultBackend};
    return {name};
  }
};

inline std::string DataPlaneName(const DataPlane& d) { return d.name; }
// auto, grpc or one of `backends` (a service's registry); INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<DataPlane> ParseDataPlane(const std::string& name,
                                         const std::vector<std::string>& backends);

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

// A batch as one UCX active message (the data plane's third version): this frame is the active
// message's header; the payload is the request's (or reply's) protobuf header (header_bytes of
// it) followed by the tensor bytes. The MAC is the connection's AES-256-GMAC (payload_mac.h)
// over the frame's first kBatchFrameMacOffset bytes and the whole payload, nonce (direction,
// sequence). A request's token is random per batch; its reply carries the same token (an
// attention node matches replies by it), the same client id and sequence. Layout, little-endian:
// token (8), "MOEB", version 1, kind (1: request, 2: reply, 3: reply tag), flags (1), a zero
// byte, client id (8), sequence (8), header_bytes (4), 4 zero bytes, MAC (16): 56 bytes exactly.
//
// A detached tag (kDetachTag, servers that say detached_reply_tags in OpenDataPlaneReply): a
// request with the flag asks for its reply's MAC in a message of its own. The reply then goes
// out as soon as it is written, with the flag and a MAC field of zeros, and a reply-tag message
// follows once the shard has computed the MAC (the same GMAC, over the reply frame's prefix,
// flag included, and payload): token ReplyTagToken(token), the reply's client id and sequence,
// header_bytes 0, no payload, the MAC in its MAC field. The attention node hashes the reply while
// the shard does and compares when both are there: the two hashes run at once instead of one
// after the other (and the transfer under the shard's: the shard hashes in pieces and
// progresses its transport between them, which posix shared memory and TCP need to move the
// bytes). Nothing of the payload is read before the comparison passes, as with an attached MAC.
constexpr size_t kBatchFrameBytes = 56;
// A reply's protobuf header fits this (the attention node's reply buffer has this room).
constexpr size_t kMaxReplyHeaderBytes = 16384;
constexpr size_t kBatchFrameMacOffset = 40;
enum class BatchKind : uint8_t { kRequest = 1, kReply = 2, kReplyTag = 3 };
// Frame flags (byte 14); any other bit set is refused.
constexpr uint8_t kDetachTag = 1;
// An attention node asks for a detached tag from this reply size by default (below it the
// second message costs about what the overlap saves: a 256 KiB hash takes ~20 us here).
constexpr size_t kDetachTagFromBytes = size_t{256} << 10;
// The ceiling of a waiting thread's learned poll window by default (--ucx_poll_max_us of both
// services; services/common/poll_window.h). 3 ms covers a local cluster's T = 1 gaps (a shard's
// compute thread waits ~1.5 ms between batches there, past the 1 ms of before: 0.10-0.15 ms per
// batch of sleeping hand-off; cluster_bench's +poll3000 ahead at T = 1 and 4 in 10 of 10
// alternated pairs, 2-20% behind at T = 16 where the shards' polls took the attention node's
// cores on one 2-vCPU host; docs/data-plane.md).
constexpr int kPollMaxUs = 3000;
struct BatchFrame {
  uint64_t token = 0;
  BatchKind kind = BatchKind::kRequest;
  uint64_t client_id = 0;
  uint64_t sequence = 0;
  uint32_t header_bytes = 0;
  std::string mac;    // kMacBytes (16); empty while the frame is being sealed
  uint8_t flags = 0;  // kDetachTag (requests and replies)
};
// The frame's bytes; the MAC's 16 bytes are zero when `mac` is empty (MacPrefix is what the MAC
// covers, so a frame is encoded once, sealed, then encoded again with its MAC).
std::string EncodeBatchFrame(const BatchFrame& f);
inline std::string_view MacPrefix(std::string_view frame) {
  return frame.substr(0, kBatchFrameMacOffset);
}
// INVALID_ARGUMENT for anything but a well-formed frame of `kind`, or one whose header_bytes
// exceed the payload's `payload_bytes`.
absl::StatusOr<BatchFrame> ParseBatchFrame(std::string_view bytes, BatchKind kind,
                                           size_t payload_bytes);
// The bytes of frame `f` sealed: its MAC over the frame's prefix and payload[0, n) under the
// connection's key, nonce (direction, f.sequence). Every backend's sender seals this way.
std::string SealBatchFrame(const PayloadMac& mac, Direction direction, BatchFrame f,
                           const uint8_t* payload, size_t n);
// A reply message that authenticated: its frame parses as a reply to this client's batch
// `sequence` over the n payload bytes, without kDetachTag, and its MAC matches; DATA_LOSS
// otherwise (nothing of the payload may be read then).
absl::StatusOr<BatchFrame> OpenReplyFrame(const PayloadMac& mac, std::string_view frame,
                                          const uint8_t* payload, size_t n, uint64_t client_id,
                                          uint64_t sequence);

// Detached tags. The token a reply's tag message carries (the attention node expects it there;
// its request tokens are even, so no batch's token is another's tag token).
inline uint64_t ReplyTagToken(uint64_t token) { return token ^ 1; }
// The tag message of the reply `reply` (kDetachTag set; its MAC field is not read) with payload
// payload[0, n): what the shard sends once the reply went out. The payload is hashed in pieces
// of kMacPieceBytes with `between` run between them: a sender whose transport needs its
// progress to move the reply (posix shared memory, TCP) progresses there.
std::string ReplyTagFrame(const PayloadMac& mac, const BatchFrame& reply, const uint8_t* payload,
                          size_t n, const std::function<void()>& between = {});
// The attention node's half, in two steps so that the hash runs while the tag is on its way:
// the reply frame parsed (a reply to this client's batch `sequence`, with kDetachTag, header
// within the n bytes) and the MAC its tag message must carry; then the tag message checked
// against it (kind 3, ReplyTagToken of the reply's token, the same client and sequence, the MAC
// equal in constant time). DATA_LOSS for anything else.
struct DetachedReply {
  BatchFrame frame;
  std::string want;  // the MAC computed here
};
absl::StatusOr<DetachedReply> HashDetachedReply(const PayloadMac& mac, std::string_view frame,
                                                const uint8_t* payload, size_t n,
                                                uint64_t client_id, uint64_t sequence);
absl::Status CheckReplyTag(const DetachedReply& reply, std::string_view tag_frame);

// The lanes UCX selected for an endpoint, read from ucp_ep_print_info's text (UCX 1.13 has no
// query for them). kind: "shm" when every lane is a shared-memory transport (posix, sysv, cma,
// xpmem, knem, self), "tcp" when every lane is tcp, "rdma" when every lane is verbs (rc, ud, dc,
// their mlx5 variants), "mixed" otherwise, "none" for text without lanes.
// UCX 1.13's own shared-memory FIFO shape (UcxWorker::shared_memory_fifo): a peer that does not
// say what it uses (an expert server before it did) uses this.
inline constexpr char kUcxDefaultFifo[] = "64x8256";
struct UcxLanes {
  std::vector<std::string> transports;  // distinct, in lane order: {"posix"}, {"posix", "tcp"}
  std::string kind = "none";
  // "shm (posix)", "tcp", "mixed (posix, tcp)": for logs, metrics and the ack a server sends.
  std::string Describe() const;
};
UcxLanes ParseUcxLanes(std::string_view print_info);
// Whether the lanes include a transport that writes into the peer's FIFO (posix, sysv, xpmem).
bool UsesSharedMemoryFifo(const UcxLanes& lanes);
// The lanes of any backend's connection (the fake's: {"fake"}, kind "fake").
using Lanes = UcxLanes;
// The class of one UCX transport name: "shm", "tcp", "rdma" or "other".
const char* TransportClass(std::string_view transport);

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
