// The expert server's end of the batch messages (expert-svc/dataplane/ucx/ucx_data_plane.h),
// driven by a client written here from the format alone (services/dataplane/data_plane.h: the
// frame, the MAC over its prefix and the payload): an honest batch reaches the handler once with
// its header and activations and its answer comes back sealed; a replay of that same message, a
// forged MAC, an unknown client and a malformed frame never reach the handler, are counted by
// kind and are never answered. A request that asks for a detached tag gets its reply first,
// with the flag and no MAC, then a tag message that authenticates it.
#include "expert-svc/dataplane/ucx/ucx_data_plane.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "services/dataplane/data_plane.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {
namespace {

using dataplane::BatchFrame;
using dataplane::BatchKind;
using dataplane::UcxWorker;

class BatchMessages : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
    UcxDataPlaneOptions o;
    o.shard = "shard-t";
    o.tls = "posix";
    o.max_message_bytes = 1 << 20;
    o.on_event = [this](const std::string& e) {
      std::lock_guard<std::mutex> l(mu_);
      ++events_[e];
    };
    o.on_batch = [this](const BatchSource& from, std::string_view header,
                        std::string_view activations) {
      std::lock_guard<std::mutex> l(mu_);
      ++batches_;
      last_header_ = std::string(header);
      last_activations_ = std::string(activations);
      last_from_ = from;
      views_.emplace_back(activations, from.activations_owner);
    };
    auto dp = UcxDataPlane::Start(o);
    ASSERT_TRUE(dp.ok()) << dp.status();
    dp_ = std::move(*dp);
    dataplane::UcxOptions co;
    co.tls = "posix";
    co.name = "client";
    auto w = UcxWorker::Create(co);
    ASSERT_TRUE(w.ok()) << w.status();
    client_ = std::move(*w);
    // OpenDataPlane, then the hello on our endpoint, acknowledged.
    auto c = dp_->Open("attention-t");
    ASSERT_TRUE(c.ok()) << c.status();
    me_ = *c;
    auto ep = client_->Connect(dp_->address(), nullptr);
    ASSERT_TRUE(ep.ok()) << ep.status();
    ep_ = *ep;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto ack_buf = client_->Buffer(256);
    ASSERT_TRUE(ack_buf.ok());
    auto ack = client_->RecvAny(me_.ack_tag, *ack_buf, deadline);
    (void)client_->SendHello(ep_, dataplane::EncodeHello({me_.id, me_.hello_secret}), deadline);
    ASSERT_TRUE(ack->Wait(deadline).ok());
    auto mac = dataplane::PayloadMac::Create(me_.mac_key);
    ASSERT_TRUE(mac.ok());
    mac_ = std::make_unique<dataplane::PayloadMac>(std::move(*mac));
  }

  // A request message: header then activations, framed and sealed (or not) as a client would.
  std::shared_ptr<dataplane::UcxTransfer> Send(uint64_t client, uint64_t sequence, uint64_t token,
                                               const std::string& header,
                                               const std::string& activations, bool seal = true,
                                               std::string frame_bytes = {}, uint8_t flags = 0) {
    const std::string payload = header + activations;
    auto buf = client_->Buffer(std::max<size_t>(payload.size(), 1));
    EXPECT_TRUE(buf.ok());
    std::memcpy((*buf)->data(), payload.data(), payload.size());
    BatchFrame f;
    f.token = token;
    f.kind = BatchKind::kRequest;
    f.client_id = client;
    f.sequence = sequence;
    f.header_bytes = static_cast<uint32_t>(header.size());
    f.flags = flags;
    const std::string prefix = std::string(dataplane::MacPrefix(dataplane::EncodeBatchFrame(f)));
    f.mac = seal ? mac_->Compute(dataplane::Direction::kToExpert, sequence, (*buf)->data(),
                                 payload.size(), prefix)
                 : std::string(16, 'f');
    if (frame_bytes.empty()) frame_bytes = dataplane::EncodeBatchFrame(f);
    return client_->SendMessage(ep_, UcxWorker::Message::kRequest, frame_bytes, *buf,
                                payload.size(), absl::Now() + absl::Seconds(10));
  }

  // Waits (bounded) until the handler and the counters settle at what is expected.
  void Settle(int batches, const std::map<std::string, int>& events) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard<std::mutex> l(mu_);
        if (batches_ == batches && events_ == events) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  std::unique_ptr<UcxDataPlane> dp_;
  std::unique_ptr<UcxWorker> client_;
  DataPlaneClient me_;
  uint64_t ep_ = 0;
  std::unique_ptr<dataplane::PayloadMac> mac_;
  std::mutex mu_;
  std::map<std::string, int> events_;
  int batches_ = 0;
  std::string last_header_, last_activations_;
  BatchSource last_from_;
  // Each batch's activations as the handler saw them, with what keeps them alive.
  std::vector<std::pair<std::string_view, std::shared_ptr<const void>>> views_;
};

TEST_F(BatchMessages, AnHonestBatchArrivesOnceAndItsAnswerComesBackSealed) {
  const std::string header = "header-bytes", z(100000, 'z');  // past the eager size
  auto reply_buf = client_->Buffer(4096);
  ASSERT_TRUE(reply_buf.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto expected = client_->ExpectMessage(0xabcdef, *reply_buf, deadline);
  ASSERT_TRUE(Send(me_.id, 7, 0xabcdef, header, z)->Wait(deadline).ok());
  Settle(1, {});
  {
    std::lock_guard<std::mutex> l(mu_);
    ASSERT_EQ(batches_, 1);
    EXPECT_EQ(last_header_, header);
    EXPECT_EQ(last_activations_, z);
    EXPECT_EQ(last_from_.client_id, me_.id);
    EXPECT_EQ(last_from_.sequence, 7u);
    EXPECT_EQ(last_from_.token, 0xabcdefu);
    EXPECT_TRUE(events_.empty());
  }
  // The answer: one message to our endpoint with the request's token, sealed for sequence 7.
  ASSERT_TRUE(dp_->ReplyBatch(last_from_, "reply-header", "outputs", deadline, nullptr).ok());
  auto n = client_->Await(*expected, deadline, std::chrono::microseconds(100));
  ASSERT_TRUE(n.ok()) << n.status();
  const std::string frame_bytes = expected->header();
  auto f = dataplane::ParseBatchFrame(frame_bytes, BatchKind::kReply, *n);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->client_id, me_.id);
  EXPECT_EQ(f->sequence, 7u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*reply_buf)->data()), *n),
            "reply-headeroutputs");
  EXPECT_TRUE(mac_->Verify(dataplane::Direction::kToAttention, 7, (*reply_buf)->data(), *n, f->mac,
                           dataplane::MacPrefix(frame_bytes)));
  EXPECT_FALSE(mac_->Verify(dataplane::Direction::kToAttention, 8, (*reply_buf)->data(), *n, f->mac,
                            dataplane::MacPrefix(frame_bytes)));
}

// The core computes a batch from the buffer its message landed in (BatchSource::
// activations_owner, tensor::Activations::ViewBf16): whatever the header's length, eager or
// rendezvous, the activations start 64-byte aligned, and they stay intact after the handler
// returned and later batches landed, for as long as the owner is held.
TEST_F(BatchMessages, TheActivationsLandAlignedAndStayPastTheHandler) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<std::string> sent;
  uint64_t sequence = 1;
  for (size_t header_bytes : {1, 12, 63, 64, 65, 100}) {
    for (size_t z_bytes : {3000, 100000}) {
      std::string z(z_bytes, '\0');
      for (size_t i = 0; i < z.size(); ++i) z[i] = static_cast<char>(i * 7 + sequence);
      ASSERT_TRUE(Send(me_.id, sequence, 2 * sequence, std::string(header_bytes, 'h'), z)
                      ->Wait(deadline)
                      .ok());
      sent.push_back(z);
      ++sequence;
    }
  }
  Settle(static_cast<int>(sent.size()), {});
  std::lock_guard<std::mutex> l(mu_);
  ASSERT_EQ(views_.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    const auto& [view, owner] = views_[i];
    ASSERT_NE(owner, nullptr) << i;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(view.data()) % UcxDataPlane::kActivationAlignment, 0u)
        << i;
    EXPECT_EQ(view, sent[i]) << i;  // after the handler, and after the later batches
  }
}

TEST_F(BatchMessages, ReplaysForgeriesAndStrangersNeverReachTheHandler) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_TRUE(Send(me_.id, 1, 1, "h", "activations")->Wait(deadline).ok());
  Settle(1, {});
  // The same message again (a replay: same sequence, same MAC), and once more with a new token.
  ASSERT_TRUE(Send(me_.id, 1, 1, "h", "activations")->Wait(deadline).ok());
  ASSERT_TRUE(Send(me_.id, 1, 2, "h", "activations")->Wait(deadline).ok());
  // A wrong MAC (eager and rendezvous), a MAC of another sequence, an unknown client, a frame
  // that is not one, a header longer than the payload.
  ASSERT_TRUE(Send(me_.id, 2, 3, "h", "x", /*seal=*/false)->Wait(deadline).ok());
  ASSERT_TRUE(Send(me_.id, 3, 4, "h", std::string(100000, 'x'), false)->Wait(deadline).ok());
  {
    BatchFrame f;
    f.kind = BatchKind::kRequest;
    f.client_id = me_.id;
    f.sequence = 4;
    f.header_bytes = 1;
    const std::string payload = "hz";
    f.mac = mac_->Compute(dataplane::Direction::kToExpert, 5,
                          reinterpret_cast<const uint8_t*>(payload.data()), payload.size(),
                          dataplane::MacPrefix(dataplane::EncodeBatchFrame(f)));
    ASSERT_TRUE(
        Send(me_.id, 4, 0, "h", "z", true, dataplane::EncodeBatchFrame(f))->Wait(deadline).ok());
  }
  ASSERT_TRUE(Send(me_.id + 1000, 5, 5, "h", "z")->Wait(deadline).ok());
  ASSERT_TRUE(Send(me_.id, 6, 6, "h", "z", true, std::string(56, 'j'))->Wait(deadline).ok());
  {
    BatchFrame f;
    f.kind = BatchKind::kRequest;
    f.client_id = me_.id;
    f.sequence = 7;
    f.header_bytes = 1000;
    ASSERT_TRUE(
        Send(me_.id, 7, 7, "h", "z", true, dataplane::EncodeBatchFrame(f))->Wait(deadline).ok());
  }
  Settle(1, {{"replayed", 2}, {"integrity_failed", 3}, {"message_rejected", 3}});
  std::lock_guard<std::mutex> l(mu_);
  EXPECT_EQ(batches_, 1);
  EXPECT_EQ(events_, (std::map<std::string, int>{
                         {"replayed", 2}, {"integrity_failed", 3}, {"message_rejected", 3}}));
  // Nothing was answered: no reply ever reached the client (it expects none, so any would be
  // dropped and counted there).
  EXPECT_EQ(client_->messages_dropped(), 0);
}

TEST_F(BatchMessages, ARequestThatAsksForADetachedTagGetsTheTagAfterItsReply) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const uint64_t token = 0x5a5a00;
  auto reply_buf = client_->Buffer(600000);
  auto tag_buf = client_->Buffer(1);
  ASSERT_TRUE(reply_buf.ok() && tag_buf.ok());
  auto reply = client_->ExpectMessage(token, *reply_buf, deadline);
  auto tag = client_->ExpectMessage(dataplane::ReplyTagToken(token), *tag_buf, deadline);
  ASSERT_TRUE(
      Send(me_.id, 11, token, "h", "z", true, {}, dataplane::kDetachTag)->Wait(deadline).ok());
  Settle(1, {});
  BatchSource from;
  {
    std::lock_guard<std::mutex> l(mu_);
    from = last_from_;
  }
  EXPECT_TRUE(from.detach_tag);
  std::string outputs(500000, '\0');  // a rendezvous-sized reply
  for (size_t i = 0; i < outputs.size(); ++i) outputs[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(dp_->ReplyBatch(from, "reply-header", outputs, deadline, nullptr).ok());
  auto n = client_->Await(*reply, deadline, std::chrono::microseconds(100));
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_TRUE(tag->Wait(deadline).ok());
  // The reply: the flag, a MAC field of zeros, the bytes; then its tag, which authenticates it.
  auto f = dataplane::ParseBatchFrame(reply->header(), BatchKind::kReply, *n);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->flags, dataplane::kDetachTag);
  EXPECT_EQ(f->mac, std::string(dataplane::kMacBytes, '\0'));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*reply_buf)->data()), *n),
            "reply-header" + outputs);
  auto hashed =
      dataplane::HashDetachedReply(*mac_, reply->header(), (*reply_buf)->data(), *n, me_.id, 11);
  ASSERT_TRUE(hashed.ok()) << hashed.status();
  EXPECT_TRUE(dataplane::CheckReplyTag(*hashed, tag->header()).ok());
  // A request without the flag is answered with the MAC attached, as before.
  ASSERT_TRUE(Send(me_.id, 12, token + 2, "h", "z")->Wait(deadline).ok());
  Settle(2, {});
  {
    std::lock_guard<std::mutex> l(mu_);
    EXPECT_FALSE(last_from_.detach_tag);
  }
  EXPECT_EQ(client_->messages_dropped(), 0);
}

}  // namespace
}  // namespace moe::expert_svc
