// What a batch that got no reply by its deadline says about its data-plane connection.
//
// A shard that no longer knows the client (evicted as idle, or another process opened the data
// plane under the node's name) drops its batches unread: nothing comes back on the connection,
// and the next batch should open the data plane again rather than wait out its deadline too. A
// shard that is only busy (its compute thread behind a long prefill) still answers, in turn: a
// short-deadline batch (the readiness canary) queued behind a long one times out while the long
// one is still coming, and opening again then would make the shard drop the client with every
// reply it still owes. So a batch that timed out means "gone" only when no reply came on the
// connection after it was sent and no batch sent before it is still waiting for its own.
//
//   auto live = std::make_shared<ReplyLiveness>();   // one per opened connection
//   uint64_t t = live->Sent();                       // the batch left
//   ... live->Replied();                              // its reply arrived
//   ... if (live->TimedOutMeansGone(t)) broken = true;  // it did not, by its deadline
//   live->Finished(t);                                // its waiter is done with it
#ifndef MOE_ATTENTION_SVC_DATAPLANE_REPLY_LIVENESS_H_
#define MOE_ATTENTION_SVC_DATAPLANE_REPLY_LIVENESS_H_

#include <cstdint>
#include <mutex>
#include <set>

namespace moe::attention_svc {

class ReplyLiveness {
 public:
  // A batch left on the connection: its ticket.
  uint64_t Sent() {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_.insert(next_);
    return next_++;
  }
  // A reply arrived on the connection (any batch's).
  void Replied() {
    std::lock_guard<std::mutex> lock(mu_);
    sent_before_last_reply_ = next_;
  }
  // The waiter of batch `ticket` is done with it (answered, failed or dropped).
  void Finished(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_.erase(ticket);
  }
  // Batch `ticket` got no reply by its deadline: whether that says the shard dropped the client.
  bool TimedOutMeansGone(uint64_t ticket) const {
    std::lock_guard<std::mutex> lock(mu_);
    const bool replied_since = sent_before_last_reply_ > ticket;
    const bool older_waiting = !waiting_.empty() && *waiting_.begin() < ticket;
    return !replied_since && !older_waiting;
  }

 private:
  mutable std::mutex mu_;
  uint64_t next_ = 0;
  uint64_t sent_before_last_reply_ = 0;  // batches sent when the latest reply arrived
  std::set<uint64_t> waiting_;           // tickets whose waiter is not done
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_REPLY_LIVENESS_H_
