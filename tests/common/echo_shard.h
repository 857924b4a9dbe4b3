// An expert server with the echo backend (each row answered with its activations: the data
// plane without expert compute) in this process, the attention side's channel to it, and the
// message that sends it T tokens each routed to every one of its k experts: T x D activations
// out, T x k x D bf16 rows back, as one shard of a layer sees. Shared by the data plane's
// benchmark (tests/bench/dispatch_bench.cc) and its scaling test
// (tests/services/large_batch_test.cc).
//
//   auto shard = EchoShard::Start("mid", /*ucx_tls=*/"posix");   // "" : gRPC in band
//   EchoBatch b = MakeEchoBatch(cfg, /*tokens=*/64);
//   auto reply = (*shard)->channel().Send(b.header, b.message)->Wait(deadline);
#ifndef MOE_TESTS_COMMON_ECHO_SHARD_H_
#define MOE_TESTS_COMMON_ECHO_SHARD_H_

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/registry.h"
#include "attention-svc/dataplane/ucx/expert_channel_ucx.h"
#include "attention-svc/expert_channel_grpc.h"
#include "expert-svc/expert_server.h"
#include "services/common/model_config.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::testing {

struct EchoBatch {
  attention_svc::DispatchHeader header;
  attention_svc::DispatchMessage message;
  size_t reply_bytes = 0;
};

// T tokens, each routed to experts 0..k-1 (per-pair replies); z deterministic.
inline EchoBatch MakeEchoBatch(const ModelConfig& cfg, int64_t t) {
  const int64_t d = cfg.latent, k = cfg.top_k;
  EchoBatch b;
  std::vector<tensor::Bf16> z(static_cast<size_t>(t * d));
  for (size_t i = 0; i < z.size(); ++i) z[i] = tensor::Bf16::FromFloat((i % 997) / 997.0f);
  b.message.shard = 0;
  b.message.z = tensor::Activations::FromBf16(std::move(z), t, d);
  for (int64_t i = 0; i < t; ++i) b.message.tokens.push_back(i);
  for (int64_t e = 0; e < k; ++e) {
    b.message.groups.emplace_back(static_cast<int32_t>(e), static_cast<int32_t>(t));
    for (int64_t i = 0; i < t; ++i) {
      b.message.pairs.push_back(i * k + e);
      b.message.row_source.push_back(static_cast<int32_t>(i));
    }
  }
  b.header.layer = static_cast<int32_t>(cfg.first_moe_layer);
  b.header.mode = attention_svc::ReplyMode::kPerPair;
  b.header.num_tokens = t;
  b.header.latent = d;
  b.header.timeout_ms = 30000;
  b.reply_bytes = static_cast<size_t>(t * k * d * 2);
  return b;
}

// An expert server with the echo backend hosting experts [0, k) of the preset's first MoE layer
// on 127.0.0.1 (any port), with UCX over ucx_tls (empty: in band only).
inline expert_svc::ExpertServerOptions EchoServerOptions(const std::string& preset, int64_t top_k,
                                                         const std::string& ucx_tls,
                                                         const std::string& shard = "echo-0") {
  expert_svc::ExpertServerOptions o;
  o.host = "127.0.0.1";
  o.preset = preset;
  o.expert_lo = 0;
  o.expert_hi = top_k;  // every token's k experts on this server
  o.shard = shard;
  o.threads = 1;
  o.backend = expert_svc::Backend::kEcho;
  o.measure_limits = false;
  o.verify_fraction = 0;
  o.data_plane = dataplane::DataPlane{ucx_tls.empty() ? "grpc" : "ucx"};
  o.ucx_tls = ucx_tls;
  return o;
}

// An attention node's end of the UCX data plane to the echo shard at `endpoint`: a worker of its
// own (UCX_TLS `tls`) and a channel on it under the node name `node` (OpenDataPlane's).
struct UcxNode {
  std::unique_ptr<dataplane::UcxWorker> worker;  // outlives the channel (declared first)
  std::unique_ptr<attention_svc::UcxExpertChannel> channel;
};
inline absl::StatusOr<UcxNode> MakeUcxNode(
    const std::string& endpoint, const std::string& tls, const std::string& node,
    attention_svc::DataPlaneLanesFn on_lanes = {}, std::chrono::microseconds progress_spin = {},
    std::chrono::microseconds poll_max = dataplane::UcxOptions{}.poll_spin_max,
    size_t detach_reply_tag_from = attention_svc::ChannelOptions{}.detach_reply_tag_from) {
  dataplane::UcxOptions uo;
  uo.tls = tls;
  uo.spin = progress_spin;
  uo.poll_spin_max = poll_max;
  auto w = dataplane::UcxWorker::Create(uo);
  if (!w.ok()) return w.status();
  UcxNode n;
  n.worker = std::move(*w);
  attention_svc::ChannelOptions co;
  co.shard = "echo-0";
  co.endpoint = endpoint;
  co.max_message_bytes = 1 << 30;
  co.node = node;
  co.fallback_in_band = false;
  co.on_lanes = std::move(on_lanes);
  co.detach_reply_tag_from = detach_reply_tag_from;
  n.channel = std::make_unique<attention_svc::UcxExpertChannel>(std::move(co), n.worker.get());
  return n;
}

class EchoShard {
 public:
  // ucx_tls empty: the gRPC in-band lane; else UCX with that UCX_TLS on both ends.
  // batch_messages false: the shard answers like one of the previous release (the header on the
  // Dispatch stream, the payloads as tagged messages). progress_spin_us: both ends' UCX progress
  // threads (the server's through its --ucx_progress_spin_us). poll_max_us: both ends' poll
  // window ceiling (--ucx_poll_max_us; 100, the floor: the fixed window of before).
  // detach_reply_tag_from: the channel's ChannelOptions::detach_reply_tag_from (0: never).
  static absl::StatusOr<std::unique_ptr<EchoShard>> Start(
      const std::string& preset, const std::string& ucx_tls, bool batch_messages = true,
      int progress_spin_us = 0, int poll_max_us = expert_svc::ExpertServerOptions{}.ucx_poll_max_us,
      size_t detach_reply_tag_from = attention_svc::ChannelOptions{}.detach_reply_tag_from) {
    auto cfg = PresetConfig(preset);
    if (!cfg.ok()) return cfg.status();
    auto s = std::unique_ptr<EchoShard>(new EchoShard);
    const bool ucx = !ucx_tls.empty();
    expert_svc::ExpertServerOptions o = EchoServerOptions(preset, cfg->top_k, ucx_tls);
    o.ucx_batch_messages = batch_messages;
    o.ucx_progress_spin_us = progress_spin_us;
    o.ucx_poll_max_us = poll_max_us;
    auto server = expert_svc::ExpertServer::Start(o);
    if (!server.ok()) return server.status();
    s->server_ = std::move(*server);
    s->endpoint_ = absl::StrCat("127.0.0.1:", s->server_->port());
    if (!ucx) {
      s->channel_ =
          std::make_unique<attention_svc::GrpcExpertChannel>("echo-0", s->endpoint_, 1 << 30, "");
      return s;
    }
    EchoShard* self = s.get();
    auto node = MakeUcxNode(
        s->endpoint_, ucx_tls, "echo",
        [self](const std::string&, const dataplane::UcxLanes& l, const std::string&) {
          self->lanes_ = l.Describe();
        },
        std::chrono::microseconds(progress_spin_us), std::chrono::microseconds(poll_max_us),
        detach_reply_tag_from);
    if (!node.ok()) return node.status();
    s->worker_ = std::move(node->worker);
    s->ucx_channel_ = node->channel.get();
    s->channel_ = std::move(node->channel);
    return s;
  }
  // The echo shard on a data-plane backend of the registries ("shm", "fake"), the node's end
  // through the backend's client half; the lanes are the backend's.
  static absl::StatusOr<std::unique_ptr<EchoShard>> StartBackend(const std::string& preset,
                                                                 const std::string& backend,
                                                                 int poll_max_us = 1000) {
    auto cfg = PresetConfig(preset);
    if (!cfg.ok()) return cfg.status();
    auto s = std::unique_ptr<EchoShard>(new EchoShard);
    expert_svc::ExpertServerOptions o = EchoServerOptions(preset, cfg->top_k, "");
    o.data_plane = dataplane::DataPlane{backend};
    o.ucx_poll_max_us = poll_max_us;
    auto server = expert_svc::ExpertServer::Start(o);
    if (!server.ok()) return server.status();
    s->server_ = std::move(*server);
    s->endpoint_ = absl::StrCat("127.0.0.1:", s->server_->port());
    attention_svc::ClientHalfOptions ho;
    ho.node = "echo";
    ho.poll_spin_max = std::chrono::microseconds(poll_max_us);
    auto half = attention_svc::StartClientHalf(backend, ho);
    if (!half.ok()) return half.status();
    s->half_ = std::move(*half);
    attention_svc::ChannelOptions co;
    co.shard = "echo-0";
    co.endpoint = s->endpoint_;
    co.max_message_bytes = 1 << 30;
    co.node = "echo";
    co.fallback_in_band = false;
    EchoShard* self = s.get();
    co.on_lanes = [self](const std::string&, const dataplane::Lanes& l, const std::string&) {
      self->lanes_ = l.Describe();
    };
    s->shared_channel_ = s->half_->MakeChannel(std::move(co));
    s->borrowed_ = s->shared_channel_.get();
    return s;
  }
  ~EchoShard() {
    shared_channel_.reset();
    channel_.reset();
    server_->Shutdown(absl::Seconds(1));
  }

  attention_svc::ExpertChannel& channel() { return borrowed_ != nullptr ? *borrowed_ : *channel_; }
  const std::string& endpoint() const { return endpoint_; }
  // The lanes UCX selected for the channel (read from UCX once the data plane opened).
  const std::string& lanes() const { return lanes_; }
  // The UCX channel (null on the gRPC lane) and its worker.
  attention_svc::UcxExpertChannel* ucx_channel() { return ucx_channel_; }
  dataplane::UcxWorker* worker() { return worker_.get(); }

 private:
  EchoShard() = default;
  std::unique_ptr<expert_svc::ExpertServer> server_;
  std::string endpoint_;
  std::unique_ptr<dataplane::UcxWorker> worker_;
  std::unique_ptr<attention_svc::ExpertChannel> channel_;
  attention_svc::UcxExpertChannel* ucx_channel_ = nullptr;
  std::unique_ptr<attention_svc::ClientHalf> half_;  // StartBackend's
  std::shared_ptr<attention_svc::ExpertChannel> shared_channel_;
  attention_svc::ExpertChannel* borrowed_ = nullptr;
  std::string lanes_ = "gRPC";
};

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_ECHO_SHARD_H_
