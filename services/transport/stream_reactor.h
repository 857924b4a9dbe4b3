// A server-side bidirectional stream whose replies are produced later, off the gRPC threads
// (a compute queue, a worker pool), in any order. Included only by service adapters (.cc files):
// it pulls in grpcpp.
//
// Reads run back to back; on_message(request, reactor) must not block: it answers at once with
// Reply(r, false), or calls BeginWork() and hands the request to a worker that later calls
// Reply(r, true) exactly once. Replies go out one write at a time. The stream finishes once the
// client has closed its side and no work is in flight, so a worker never touches a finished
// reactor; after a cancel, replies are dropped. Replies waiting for the client are bounded
// (max_outbox_bytes): a client that does not read past it is treated as gone (its replies
// dropped, cancelled() true, so queued work can be skipped), not buffered without end, and its
// stream ends with RESOURCE_EXHAUSTED (never OK: replies were lost) once no work is in flight.
//
//   return new StreamReactor<Req, Resp>([this](Req&& r, StreamReactor<Req, Resp>* s) {...});
#ifndef MOE_SERVICES_TRANSPORT_STREAM_REACTOR_H_
#define MOE_SERVICES_TRANSPORT_STREAM_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <utility>

namespace moe::transport {

template <typename Req, typename Resp>
class StreamReactor final : public grpc::ServerBidiReactor<Req, Resp> {
 public:
  using Handler = std::function<void(Req&&, StreamReactor*)>;

  explicit StreamReactor(Handler on_message, size_t max_outbox_bytes = kDefaultMaxOutboxBytes)
      : on_message_(std::move(on_message)), max_outbox_bytes_(max_outbox_bytes) {
    this->StartRead(&request_);
  }

  static constexpr size_t kDefaultMaxOutboxBytes = size_t{512} << 20;

  void BeginWork() {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
  }

  // Work begun and not yet replied to (a per-stream bound: one client cannot queue unbounded
  // work on one stream).
  int in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }
  // The client cancelled or went away: queued work can be skipped (its reply is dropped).
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  // ends_work: this reply completes one BeginWork().
  void Reply(Resp reply, bool ends_work) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ends_work) --in_flight_;
    if (!broken_) {
      outbox_bytes_ += reply.ByteSizeLong();
      if (outbox_bytes_ > max_outbox_bytes_ && !outbox_.empty()) {
        // The client does not read: keep only the write in progress, drop the rest.
        broken_ = true;
        end_status_ =
            grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                         "the client does not read its replies: more than " +
                             std::to_string(max_outbox_bytes_ >> 20) +
                             " MiB of them unread, so the stream is ended and the rest dropped");
        outbox_.erase(std::next(outbox_.begin()), outbox_.end());
        outbox_bytes_ = outbox_.front().ByteSizeLong();
        MaybeFinishLocked();
        return;
      }
      outbox_.push_back(std::move(reply));
      if (!writing_) {
        writing_ = true;
        this->StartWrite(&outbox_.front());
      }
    }
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // After an overflow the stream finishes without waiting for the client's half-close: a
      // request read after that is dropped (no work may begin on a finished reactor).
      if (!ok || finished_) {
        reads_done_ = true;
        MaybeFinishLocked();
        return;
      }
    }
    on_message_(std::move(request_), this);
    request_ = Req();
    this->StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_bytes_ -= std::min(outbox_bytes_, outbox_.front().ByteSizeLong());
    outbox_.pop_front();
    if (!ok) {
      broken_ = true;  // the client is gone: drop what is left
      outbox_.clear();
    }
    if (!outbox_.empty()) {
      this->StartWrite(&outbox_.front());
    } else {
      writing_ = false;
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
  }

  void OnDone() override { delete this; }

 private:
  void MaybeFinishLocked() {
    const bool overflowed = !end_status_.ok();
    if ((reads_done_ || overflowed) && in_flight_ == 0 && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(end_status_);
    }
  }

  Handler on_message_;
  Req request_;
  mutable std::mutex mu_;
  std::deque<Resp> outbox_;
  const size_t max_outbox_bytes_;
  size_t outbox_bytes_ = 0;
  int in_flight_ = 0;
  bool reads_done_ = false, writing_ = false, finished_ = false, broken_ = false;
  grpc::Status end_status_;  // OK, or why the server ended the stream
};

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_STREAM_REACTOR_H_
