#include "services/transport/channel.h"

#include <grpcpp/grpcpp.h>

#include <climits>

#include "services/transport/security.h"

namespace moe::transport {

namespace {
grpc::ChannelArguments BaseArguments(int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2FrameBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2LookaheadBytes);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Each peer gets its own connection (an attention node's shard streams must not share one
  // TCP connection with unrelated calls).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}
}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& endpoint, int max_message_bytes,
                                           std::shared_ptr<grpc::ChannelCredentials> credentials) {
  if (credentials == nullptr) credentials = ProcessChannelCredentials();
  return grpc::CreateCustomChannel(endpoint, credentials, BaseArguments(max_message_bytes));
}

std::shared_ptr<grpc::Channel> MakeControlChannel(const std::string& endpoint,
                                                  int max_message_bytes) {
  grpc::ChannelArguments args = BaseArguments(max_message_bytes);
  args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, INT_MAX);
  return grpc::CreateCustomChannel(endpoint, ProcessChannelCredentials(), args);
}

}  // namespace moe::transport
