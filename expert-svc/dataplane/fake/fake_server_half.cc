#include "expert-svc/dataplane/fake/fake_server_half.h"

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "expert-svc/data_plane_clients.h"
#include "services/common/logging.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/fake_wire.h"
#include "services/dataplane/payload_mac.h"

namespace moe::expert_svc {

namespace {

// The acknowledgement of a hello: this frame, then the lanes ("fake").
constexpr char kAckFrame[] = "MOEA";
constexpr size_t kMaxReplyAddressBytes = 64;

class FakeServerHalf final : public ServerHalf {
 public:
  explicit FakeServerHalf(ServerHalfOptions o)
      : options_(std::move(o)), clients_(options_.max_clients) {}
  ~FakeServerHalf() override { dataplane::FakeWire::Close(address_); }

  void Listen() {
    address_ = dataplane::FakeWire::Listen(
        [this](std::string frame, std::string payload) { OnMessage(frame, payload); });
  }

  const char* name() const override { return "fake"; }
  std::string Describe() const override { return absl::StrCat("in-process wire at ", address_); }
  std::string tls() const override { return ""; }
  const std::string& address() const override { return address_; }

  absl::Status Open(const std::string& node, v1::OpenDataPlaneReply* reply) override {
    uint64_t replaced = 0;
    absl::StatusOr<DataPlaneClient> c = clients_.Open(node, &replaced);
    if (!c.ok()) return c.status();
    if (replaced != 0) {
      std::lock_guard<std::mutex> lock(mu_);
      reply_addresses_.erase(replaced);
    }
    reply->set_transport(name());
    reply->set_client_id(c->id);
    reply->set_worker_address(address_);
    reply->set_hello_secret(c->hello_secret);
    reply->set_mac_key(c->mac_key);
    reply->set_batch_messages(true);
    return absl::OkStatus();
  }

  absl::Status ReplyBatch(const BatchSource& to, std::string_view header, std::string_view payload,
                          absl::Time) override {
    if (header.size() > dataplane::kMaxReplyHeaderBytes) {
      return absl::InternalError(absl::StrCat("a reply header of ", header.size(), " bytes"));
    }
    absl::StatusOr<DataPlaneClient> c = clients_.Get(to.client_id);
    if (!c.ok()) return absl::UnavailableError(c.status().message());
    std::string message;
    message.reserve(header.size() + payload.size());
    message.append(header).append(payload);
    const dataplane::BatchFrame f{to.token,    dataplane::BatchKind::kReply,         to.client_id,
                                  to.sequence, static_cast<uint32_t>(header.size()), {}};
    std::string frame =
        dataplane::SealBatchFrame(*c->mac, dataplane::Direction::kToAttention, f,
                                  reinterpret_cast<const uint8_t*>(message.data()), message.size());
    const absl::Status s =
        dataplane::FakeWire::Send(ReplyAddress(c->endpoint), std::move(frame), std::move(message));
    if (!s.ok() && options_.on_event) options_.on_event("reply_failed");
    return absl::OkStatus();
  }

  std::string lanes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return clients_.size() > 0 && !reply_addresses_.empty() ? "fake" : "";
  }

 private:
  // A hello (dataplane::kHelloBytes, the payload: where replies go) or a batch request.
  void OnMessage(const std::string& frame, const std::string& payload) {
    if (frame.size() == dataplane::kHelloBytes) return OnHello(frame, payload);
    absl::StatusOr<dataplane::BatchFrame> f =
        dataplane::ParseBatchFrame(frame, dataplane::BatchKind::kRequest, payload.size());
    absl::StatusOr<DataPlaneClient> c =
        f.ok() ? clients_.Get(f->client_id) : absl::StatusOr<DataPlaneClient>(f.status());
    if (!c.ok() || static_cast<int64_t>(payload.size()) > options_.max_message_bytes + (1 << 20)) {
      return Count("message_rejected");
    }
    // Nothing of it is read before it authenticated under the client's key.
    const auto* d = reinterpret_cast<const uint8_t*>(payload.data());
    if (!c->mac->Verify(dataplane::Direction::kToExpert, f->sequence, d, payload.size(), f->mac,
                        dataplane::MacPrefix(frame))) {
      return Count("integrity_failed");
    }
    if (!clients_.ClaimSequence(f->client_id, f->sequence)) return Count("replayed");
    const std::string_view all(payload);
    options_.on_batch(BatchSource{f->client_id, f->token, f->sequence, false, nullptr},
                      all.substr(0, f->header_bytes), all.substr(f->header_bytes));
  }

  void OnHello(const std::string& hello, const std::string& reply_address) {
    if (reply_address.empty() || reply_address.size() > kMaxReplyAddressBytes) {
      return Count("hello_rejected");
    }
    // Hellos come one at a time (the wire's thread): the address is kept only once bound.
    uint64_t endpoint = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [e, a] : reply_addresses_) {
        if (a == reply_address) endpoint = e;
      }
    }
    const bool known = endpoint != 0;
    if (!known) endpoint = next_endpoint_++;
    absl::StatusOr<DataPlaneClient> c = clients_.Bind(hello, endpoint);
    if (!c.ok()) return Count("hello_rejected");
    if (!known) {
      std::lock_guard<std::mutex> lock(mu_);
      reply_addresses_[endpoint] = reply_address;
    }
    (void)dataplane::FakeWire::Send(reply_address, kAckFrame, "fake");
    MOE_LOG_INFO("shard {}: data-plane client {} ({}) said hello over the fake wire",
                 options_.shard, c->id, c->node);
  }

  std::string ReplyAddress(uint64_t endpoint) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = reply_addresses_.find(endpoint);
    return it == reply_addresses_.end() ? "" : it->second;
  }

  void Count(const char* event) {
    if (options_.on_event) options_.on_event(event);
  }

  const ServerHalfOptions options_;
  DataPlaneClients clients_;
  std::string address_;
  mutable std::mutex mu_;
  // The reply address of each bound hello's "endpoint" (one per client that said hello).
  std::map<uint64_t, std::string> reply_addresses_;
  uint64_t next_endpoint_ = 1;  // the wire's thread only
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerHalf>> StartFakeServerHalf(ServerHalfOptions options) {
  if (!options.on_batch) {
    return absl::FailedPreconditionError("the fake data plane speaks batch messages only");
  }
  auto half = std::make_unique<FakeServerHalf>(std::move(options));
  half->Listen();
  return half;
}

}  // namespace moe::expert_svc
