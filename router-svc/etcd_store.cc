#include "router-svc/etcd_store.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "etcd/v3_subset.grpc.pb.h"
#include "moe/v1/router.pb.h"
#include "router-svc/router_proto.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/transport/channel.h"
#include "services/transport/status_convert.h"

namespace moe::router_svc {

namespace epb = etcdserverpb;

namespace {

constexpr auto kCallTimeout = std::chrono::seconds(5);

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  return c;
}

absl::Status Etcd(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  const absl::Status a = transport::FromGrpc(s);
  return absl::Status(a.code(), absl::StrCat("etcd ", what, ": ", a.message()));
}

// The smallest key after every key that starts with prefix (etcd's range_end for a prefix).
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

}  // namespace

class EtcdStore::Impl {
 public:
  Impl(const std::string& endpoint, std::string prefix)
      : prefix_(std::move(prefix)),
        channel_(transport::MakeChannel(endpoint, transport::kDefaultMaxMessageBytes,
                                        grpc::InsecureChannelCredentials())),
        kv_(epb::KV::NewStub(channel_)),
        lease_(epb::Lease::NewStub(channel_)) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    if (keepalive_.joinable()) keepalive_.join();
  }

  std::string Key(const std::string& rest) const { return prefix_ + "/" + rest; }

  absl::StatusOr<std::vector<epb::KeyValue>> Range(const std::string& prefix) {
    epb::RangeRequest req;
    req.set_key(prefix);
    req.set_range_end(PrefixEnd(prefix));
    epb::RangeResponse resp;
    MOE_RETURN_IF_ERROR(Etcd(kv_->Range(Ctx().get(), req, &resp), "Range " + prefix));
    return std::vector<epb::KeyValue>(resp.kvs().begin(), resp.kvs().end());
  }

  // A put, or a delete (value null), of one key that applies only while this process leads
  // (its lease on the leader key).
  absl::Status FencedWrite(const std::string& key, const std::string* value) {
    const int64_t lease = lease_id_.load();
    if (lease == 0) {
      return absl::FailedPreconditionError("router-svc writes to etcd only while it leads");
    }
    epb::TxnRequest txn;
    epb::Compare* c = txn.add_compare();
    c->set_result(epb::Compare::EQUAL);
    c->set_target(epb::Compare::LEASE);
    c->set_key(Key("leader"));
    c->set_lease(lease);
    epb::RequestOp* op = txn.add_success();
    if (value != nullptr) {
      op->mutable_request_put()->set_key(key);
      op->mutable_request_put()->set_value(*value);
    } else {
      op->mutable_request_delete_range()->set_key(key);
    }
    epb::TxnResponse resp;
    MOE_RETURN_IF_ERROR(Etcd(kv_->Txn(Ctx().get(), txn, &resp), "Txn " + key));
    if (!resp.succeeded()) {
      return absl::FailedPreconditionError(
          absl::StrCat("this router no longer leads (", Key("leader"), " is not on its lease)"));
    }
    return absl::OkStatus();
  }
  absl::Status FencedPut(const std::string& key, const std::string& value) {
    return FencedWrite(key, &value);
  }

  absl::StatusOr<bool> Campaign(const std::string& name, int64_t ttl,
                                const std::function<bool()>& stopping,
                                std::function<void()> on_lost) {
    epb::LeaseGrantRequest g;
    g.set_ttl(ttl);
    epb::LeaseGrantResponse granted;
    MOE_RETURN_IF_ERROR(Etcd(lease_->LeaseGrant(Ctx().get(), g, &granted), "LeaseGrant"));
    const int64_t lease = granted.id();
    // The lease must live while we wait: keep it alive from now on.
    keepalive_ = std::thread([this, lease, ttl, on_lost = std::move(on_lost)] {
      if (KeepAlive(lease, ttl) && lease_id_.load() != 0 && on_lost) on_lost();
    });
    for (;;) {
      if (stopping()) return false;
      epb::TxnRequest txn;
      epb::Compare* c = txn.add_compare();
      c->set_result(epb::Compare::EQUAL);
      c->set_target(epb::Compare::CREATE);
      c->set_key(Key("leader"));
      c->set_create_revision(0);  // absent
      epb::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key(Key("leader"));
      put->set_value(name);
      put->set_lease(lease);
      epb::TxnResponse resp;
      const grpc::Status s = kv_->Txn(Ctx().get(), txn, &resp);
      if (s.ok() && resp.succeeded()) {
        lease_id_ = lease;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  // Returns true when the lease was lost, false when stopping.
  bool KeepAlive(int64_t lease, int64_t ttl) {
    const auto period = std::chrono::milliseconds(std::max<int64_t>(200, ttl * 1000 / 3));
    while (true) {
      grpc::ClientContext ctx;
      auto stream = lease_->LeaseKeepAlive(&ctx);
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mu_);
          if (cv_.wait_for(lock, period, [&] { return stopping_; })) {
            ctx.TryCancel();
            return false;
          }
        }
        epb::LeaseKeepAliveRequest req;
        req.set_id(lease);
        epb::LeaseKeepAliveResponse resp;
        if (!stream->Write(req) || !stream->Read(&resp)) break;  // reconnect below
        if (resp.ttl() <= 0) {
          MOE_LOG_ERROR("etcd lease {:x} expired", lease);
          ctx.TryCancel();
          return true;
        }
      }
      ctx.TryCancel();
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stopping_; })) {
        return false;
      }
    }
  }

  absl::StatusOr<std::string> Leader() {
    MOE_ASSIGN_OR_RETURN(std::vector<epb::KeyValue> kvs, Range(Key("leader")));
    for (const epb::KeyValue& kv : kvs) {
      if (kv.key() == Key("leader")) return kv.value();
    }
    return std::string();
  }

  const std::string prefix_;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<epb::KV::Stub> kv_;
  std::unique_ptr<epb::Lease::Stub> lease_;
  std::atomic<int64_t> lease_id_{0};
  std::thread keepalive_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

EtcdStore::EtcdStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdStore::~EtcdStore() = default;

absl::StatusOr<std::unique_ptr<EtcdStore>> EtcdStore::Connect(const std::string& endpoint,
                                                              const std::string& prefix) {
  if (prefix.empty() || prefix.back() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd prefix '", prefix, "' must be non-empty without a trailing /"));
  }
  auto impl = std::make_unique<Impl>(endpoint, prefix);
  // Reachable now, or a clear error (not a hang at the first write).
  MOE_RETURN_IF_ERROR(impl->Range(impl->Key("leader")).status());
  return std::unique_ptr<EtcdStore>(new EtcdStore(std::move(impl)));
}

absl::StatusOr<StoredState> EtcdStore::Load() {
  StoredState state;
  MOE_ASSIGN_OR_RETURN(std::vector<etcdserverpb::KeyValue> kvs, impl_->Range(impl_->Key("")));
  for (const etcdserverpb::KeyValue& kv : kvs) {
    const std::string rest = kv.key().substr(impl_->prefix_.size() + 1);
    if (absl::StartsWith(rest, "bias/")) {
      v1::LayerBias b;
      absl::StatusOr<BiasMode> mode = absl::UnknownError("");
      if (!b.ParseFromString(kv.value()) || !(mode = FromProto(b.mode())).ok()) {
        return absl::DataLossError(absl::StrCat("router state (etcd): ", kv.key(), " malformed"));
      }
      BiasVersion v{b.layer(),
                    b.version(),
                    *mode,
                    {b.bias().begin(), b.bias().end()},
                    b.reason(),
                    b.created_unix_ms(),
                    FromProto(b.budget())};
      state.layers[v.layer].history.push_back(std::move(v));
    } else if (absl::StartsWith(rest, "mode/")) {
      v1::SetBiasModeRequest m;
      absl::StatusOr<BiasMode> mode = absl::UnknownError("");
      if (!m.ParseFromString(kv.value()) || !(mode = FromProto(m.mode())).ok()) {
        return absl::DataLossError(absl::StrCat("router state (etcd): ", kv.key(), " malformed"));
      }
      state.layers[m.layer()].mode = *mode;
      state.layers[m.layer()].continuous_tokens = m.continuous_tokens();
    } else if (rest == "initialized") {
      if (!absl::SimpleAtoi(kv.value(), &state.initialized_unix_ms)) {
        return absl::DataLossError(absl::StrCat("router state (etcd): ", kv.key(), " malformed"));
      }
    } else if (absl::StartsWith(rest, "shard/")) {
      const size_t nl = kv.value().find('\n');
      StoredShard s;
      v1::RegisterExpertServerRequest r;
      if (nl == std::string::npos || !absl::SimpleAtoi(kv.value().substr(0, nl), &s.lease) ||
          !r.ParseFromString(kv.value().substr(nl + 1))) {
        return absl::DataLossError(absl::StrCat("router state (etcd): ", kv.key(), " malformed"));
      }
      s.name = r.shard();
      s.endpoint = r.endpoint();
      s.data_plane = r.data_plane();
      s.ranges = FromProto(r.ranges());
      state.shards.push_back(std::move(s));
    }
  }
  // Keys sort as text: order each history by version and check it has no gap.
  for (auto& [layer, l] : state.layers) {
    std::sort(l.history.begin(), l.history.end(),
              [](const BiasVersion& a, const BiasVersion& b) { return a.version < b.version; });
    for (size_t i = 0; i < l.history.size(); ++i) {
      if (l.history[i].version != i) {
        return absl::DataLossError(absl::StrCat("router state (etcd): layer ", layer,
                                                " has a gap before version ",
                                                l.history[i].version));
      }
    }
    if (l.history.empty()) {
      return absl::DataLossError(
          absl::StrCat("router state (etcd): layer ", layer, " has no bias"));
    }
  }
  return state;
}

absl::Status EtcdStore::PutBiasVersion(const BiasVersion& v) {
  return impl_->FencedPut(impl_->Key(absl::StrFormat("bias/%d/%012d", v.layer, v.version)),
                          ToProto(v).SerializeAsString());
}

absl::Status EtcdStore::PutMode(int32_t layer, BiasMode mode, int64_t continuous_tokens) {
  v1::SetBiasModeRequest m;
  m.set_layer(layer);
  m.set_mode(ToProto(mode));
  m.set_continuous_tokens(continuous_tokens);
  return impl_->FencedPut(impl_->Key(absl::StrCat("mode/", layer)), m.SerializeAsString());
}

absl::Status EtcdStore::PutShard(const StoredShard& s) {
  v1::RegisterExpertServerRequest r;
  r.set_shard(s.name);
  r.set_endpoint(s.endpoint);
  r.set_data_plane(s.data_plane);
  for (const LayerRange& x : s.ranges) {
    v1::ExpertRange* e = r.add_ranges();
    e->set_layer(x.layer);
    e->set_expert_lo(x.lo);
    e->set_expert_hi(x.hi);
  }
  return impl_->FencedPut(impl_->Key("shard/" + s.name),
                          absl::StrCat(s.lease, "\n", r.SerializeAsString()));
}

absl::Status EtcdStore::DeleteShard(const std::string& name) {
  return impl_->FencedWrite(impl_->Key("shard/" + name), nullptr);
}

absl::Status EtcdStore::MarkInitialized(int64_t unix_ms) {
  return impl_->FencedPut(impl_->Key("initialized"), absl::StrCat(unix_ms));
}

absl::StatusOr<bool> EtcdStore::Campaign(const std::string& name, int64_t ttl_seconds,
                                         const std::function<bool()>& stopping,
                                         std::function<void()> on_lost) {
  return impl_->Campaign(name, ttl_seconds, stopping, std::move(on_lost));
}

absl::StatusOr<std::string> EtcdStore::Leader() { return impl_->Leader(); }

}  // namespace moe::router_svc
