// Client channels with the settings every peer here uses (the client side of transport: no
// server, no reflection).
//
//   auto stub = v1::AttentionService::NewStub(MakeChannel("127.0.0.1:50051"));
#ifndef MOE_SERVICES_TRANSPORT_CHANNEL_H_
#define MOE_SERVICES_TRANSPORT_CHANNEL_H_

#include <memory>
#include <string>

namespace grpc {
class Channel;
class ChannelCredentials;
}  // namespace grpc

namespace moe::transport {

inline constexpr int kDefaultMaxMessageBytes = 256 << 20;
// The metadata key of the cluster (membership) token: on registration, heartbeats and reports to
// router-svc, and on the attention node's Dispatch and OpenDataPlane calls to expert shards.
inline constexpr char kClusterTokenMetadata[] = "x-moe-cluster-token";
// The admin token's: on Rebalance, RollbackBias and SetBiasMode.
inline constexpr char kAdminTokenMetadata[] = "x-moe-admin-token";
// HTTP/2 frames and flow-control window of every channel and server (large tensors).
inline constexpr int kHttp2FrameBytes = 1 << 20;
inline constexpr int kHttp2LookaheadBytes = 16 << 20;

// A channel to host:port with fast reconnects (100 ms .. 1 s backoff) and the given limits, over
// the given credentials (null: the process's, security.h: plaintext unless TLS is configured).
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& endpoint, int max_message_bytes = kDefaultMaxMessageBytes,
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

// The same, for a connection whose state says whether the peer is alive (an attention node's
// control connection to a shard whose batches travel on UCX): never idled by the client, so it
// leaves READY only when the connection broke (the peer died, the network failed).
std::shared_ptr<grpc::Channel> MakeControlChannel(const std::string& endpoint,
                                                  int max_message_bytes = kDefaultMaxMessageBytes);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_CHANNEL_H_
