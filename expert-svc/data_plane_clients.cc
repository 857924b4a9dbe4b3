#include "expert-svc/data_plane_clients.h"

#include "absl/strings/str_cat.h"
#include "services/dataplane/data_plane.h"

namespace moe::expert_svc {

absl::Status ValidateOutOfBand(const OutOfBandHeader& h, int64_t max_message_bytes,
                               const std::string& where) {
  if (h.activation_bytes < 1 || h.activation_bytes > max_message_bytes || h.reply_bytes < 0 ||
      h.reply_bytes > max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": out-of-band sizes (activations ", h.activation_bytes, " bytes, reply ",
        h.reply_bytes, ") must lie in [1, ", max_message_bytes, "]"));
  }
  if (h.activation_mac.size() != dataplane::kMacBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": activation_mac of ",
                                                   h.activation_mac.size(), " bytes (need ",
                                                   dataplane::kMacBytes, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneClient> DataPlaneClients::Open(const std::string& node,
                                                       uint64_t* replaced_endpoint,
                                                       absl::Time now) {
  *replaced_endpoint = 0;
  if (node.size() > kMaxNodeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("node name of ", node.size(), " bytes (at most ", kMaxNodeBytes, ")"));
  }
  DataPlaneClient c;
  c.node = node;
  c.hello_secret = dataplane::RandomBytes(dataplane::kHelloSecretBytes);
  c.mac_key = dataplane::RandomBytes(dataplane::kMacKeyBytes);
  c.ack_tag = dataplane::RandomU64();
  auto mac = dataplane::PayloadMac::Create(c.mac_key);
  if (!mac.ok()) return mac.status();
  c.mac = std::make_shared<const dataplane::PayloadMac>(std::move(*mac));
  std::lock_guard<std::mutex> lock(mu_);
  if (!node.empty()) {
    for (auto it = clients_.begin(); it != clients_.end(); ++it) {
      if (it->second.node == node) {
        *replaced_endpoint = it->second.endpoint;
        seen_.erase(it->first);
        last_used_.erase(it->first);
        clients_.erase(it);
        break;
      }
    }
    // UCX hands a new peer an endpoint it freed and reused (the old peer's worker died): the
    // replaced client's endpoint may be another live client's now, which must keep it.
    for (const auto& [id, other] : clients_) {
      if (*replaced_endpoint != 0 && other.endpoint == *replaced_endpoint) {
        *replaced_endpoint = 0;
      }
    }
  }
  if (static_cast<int>(clients_.size()) >= max_clients_ && *replaced_endpoint == 0) {
    // Full: the least recently used client idle for kIdleEviction makes room.
    auto lru = clients_.end();
    for (auto it = clients_.begin(); it != clients_.end(); ++it) {
      if (lru == clients_.end() || last_used_[it->first] < last_used_[lru->first]) lru = it;
    }
    if (lru != clients_.end() && now - last_used_[lru->first] >= kIdleEviction) {
      *replaced_endpoint = lru->second.endpoint;
      for (const auto& [id, other] : clients_) {
        if (id != lru->first && other.endpoint == *replaced_endpoint) *replaced_endpoint = 0;
      }
      seen_.erase(lru->first);
      last_used_.erase(lru->first);
      clients_.erase(lru);
    }
  }
  if (static_cast<int>(clients_.size()) >= max_clients_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(max_clients_, " data-plane clients already, none idle for ",
                     absl::FormatDuration(kIdleEviction), " (--max_data_plane_clients)"));
  }
  c.id = next_++;
  clients_[c.id] = c;
  last_used_[c.id] = now;
  return c;
}

absl::StatusOr<DataPlaneClient> DataPlaneClients::Bind(std::string_view hello, uint64_t endpoint) {
  absl::StatusOr<dataplane::Hello> h = dataplane::ParseHello(hello);
  if (!h.ok()) return h.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(h->client_id);
  if (it == clients_.end()) {
    return absl::NotFoundError(absl::StrCat("UCX hello for unknown client ", h->client_id));
  }
  DataPlaneClient& c = it->second;
  if (!dataplane::ConstantTimeEqual(c.hello_secret, h->secret)) {
    return absl::PermissionDeniedError(
        absl::StrCat("UCX hello for client ", h->client_id, " with a wrong secret"));
  }
  if (c.endpoint != 0 && c.endpoint != endpoint) {
    return absl::AlreadyExistsError(
        absl::StrCat("client ", h->client_id, " already said hello on another endpoint"));
  }
  c.endpoint = endpoint;
  return c;
}

absl::StatusOr<DataPlaneClient> DataPlaneClients::Get(uint64_t id, absl::Time now) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(id);
  if (it == clients_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown data-plane client ", id, " (call OpenDataPlane again)"));
  }
  if (it->second.endpoint == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("data-plane client ", id, " has not sent its UCX hello"));
  }
  last_used_[id] = now;
  return it->second;
}

bool DataPlaneClients::ClaimSequence(uint64_t id, uint64_t sequence) {
  std::lock_guard<std::mutex> lock(mu_);
  if (clients_.count(id) == 0 || sequence == 0) return false;
  Seen& s = seen_[id];
  if (sequence > s.highest) {
    const uint64_t shift = sequence - s.highest;
    s.used = shift >= kReplayWindow ? std::bitset<kReplayWindow>() : s.used << shift;
    s.highest = sequence;
    s.used.set(0);
    return true;
  }
  const uint64_t back = s.highest - sequence;
  if (back >= kReplayWindow || s.used.test(back)) return false;
  s.used.set(back);
  return true;
}

int DataPlaneClients::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(clients_.size());
}

}  // namespace moe::expert_svc
