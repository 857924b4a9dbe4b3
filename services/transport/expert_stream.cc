#include "services/transport/expert_stream.h"

#include <grpcpp/grpcpp.h>

#include <deque>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/common/status_macros.h"
#include "services/transport/channel.h"
#include "services/transport/status_convert.h"

namespace moe::transport {

class ExpertStream::Session {
 public:
  Session(std::shared_ptr<grpc::Channel> channel, std::string describe,
          const std::string& cluster_token)
      : stub_(v1::ExpertService::NewStub(channel)), describe_(std::move(describe)) {
    if (!cluster_token.empty()) ctx_.AddMetadata(kClusterTokenMetadata, cluster_token);
    writer_ = std::thread([this] { WriterLoop(); });
  }

  ~Session() {
    Close();
    if (writer_.joinable()) writer_.join();
    if (reader_.joinable()) reader_.join();
  }

  // False when the session is broken (the caller opens a new one).
  // Takes req only on success.
  bool Enqueue(std::unique_ptr<v1::DispatchRequest>& req, const std::shared_ptr<PendingReply>& p) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_ || closing_) return false;
    pending_[req->batch_id()] = p;
    queue_.push_back(std::move(req));
    cv_.notify_all();
    return true;
  }

  void Forget(uint64_t batch_id) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(batch_id);
  }

  bool broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      cv_.notify_all();
    }
    ctx_.TryCancel();
  }

 private:
  void WriterLoop() {
    // Opening the stream may wait for a connection: done here, never on a caller's thread.
    rw_ = stub_->Dispatch(&ctx_);
    reader_ = std::thread([this] { ReaderLoop(); });
    for (;;) {
      std::unique_ptr<v1::DispatchRequest> req;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closing_ || broken_ || !queue_.empty(); });
        if (closing_ || broken_) return;
        req = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!rw_->Write(*req)) {
        // The stream is gone; the reader sees it too and fails every waiter with the status.
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = true;
        return;
      }
    }
  }

  void ReaderLoop() {
    v1::DispatchReply reply;
    while (rw_->Read(&reply)) {
      std::shared_ptr<PendingReply> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(reply.batch_id());
        if (it == pending_.end()) continue;  // its waiter gave up (deadline)
        p = std::move(it->second);
        pending_.erase(it);
      }
      std::lock_guard<std::mutex> lock(p->mu);
      p->reply = std::move(reply);
      p->done = true;
      p->cv.notify_all();
    }
    const grpc::Status status = rw_->Finish();
    std::map<uint64_t, std::shared_ptr<PendingReply>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = true;
      failed.swap(pending_);
      queue_.clear();
      cv_.notify_all();
    }
    const absl::Status s = absl::UnavailableError(absl::StrCat(
        describe_, " unavailable: stream ended with ",
        grpc::StatusCode(status.error_code()) == grpc::StatusCode::OK
            ? std::string("OK")
            : absl::StrCat("code ", status.error_code(), ": ", status.error_message())));
    for (auto& [id, p] : failed) {
      std::lock_guard<std::mutex> lock(p->mu);
      p->status = s;
      p->done = true;
      p->cv.notify_all();
    }
  }

  std::unique_ptr<v1::ExpertService::Stub> stub_;
  const std::string describe_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DispatchRequest, v1::DispatchReply>> rw_;
  std::thread writer_, reader_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<v1::DispatchRequest>> queue_;
  std::map<uint64_t, std::shared_ptr<PendingReply>> pending_;
  bool closing_ = false;
  bool broken_ = false;
};

ExpertStream::ExpertStream(std::string shard, std::string endpoint, int max_message_bytes,
                           std::string cluster_token)
    : shard_(std::move(shard)),
      endpoint_(std::move(endpoint)),
      max_message_bytes_(max_message_bytes),
      cluster_token_(std::move(cluster_token)) {}

ExpertStream::~ExpertStream() {
  std::lock_guard<std::mutex> lock(mu_);
  current_.reset();
  retired_.clear();
}

std::string ExpertStream::Describe() const {
  return absl::StrCat("expert shard ", shard_, " (", endpoint_, ")");
}

int64_t ExpertStream::streams_opened() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_opened_;
}

std::shared_ptr<PendingReply> ExpertStream::Send(v1::DispatchRequest request) {
  auto p = std::make_shared<PendingReply>();
  p->layer = request.layer();
  std::lock_guard<std::mutex> lock(mu_);
  p->batch_id = next_batch_id_++;
  request.set_batch_id(p->batch_id);
  auto req = std::make_unique<v1::DispatchRequest>(std::move(request));
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (current_ == nullptr || current_->broken()) {
      if (current_ != nullptr) {
        current_->Close();
        retired_.push_back(std::move(current_));
      }
      // Joins sessions whose threads have ended (closed above or earlier).
      if (retired_.size() > 4) retired_.erase(retired_.begin());
      current_ = std::make_shared<Session>(MakeChannel(endpoint_, max_message_bytes_), Describe(),
                                           cluster_token_);
      ++streams_opened_;
    }
    if (current_->Enqueue(req, p)) return p;  // else it broke between the check and here
  }
  p->status =
      absl::UnavailableError(absl::StrCat(Describe(), " unavailable: cannot open a stream"));
  p->done = true;
  return p;
}

bool ExpertStream::WaitAnswered(PendingReply& p, absl::Time until) {
  std::unique_lock<std::mutex> lock(p.mu);
  return p.cv.wait_until(lock, absl::ToChronoTime(until), [&] { return p.done; });
}

absl::StatusOr<v1::DispatchReply> ExpertStream::Wait(PendingReply& p, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(p.mu);
  const auto until = absl::ToChronoTime(deadline);
  if (!p.cv.wait_until(lock, until, [&] { return p.done; })) {
    lock.unlock();
    std::shared_ptr<Session> s;
    {
      std::lock_guard<std::mutex> l(mu_);
      s = current_;
    }
    if (s != nullptr) s->Forget(p.batch_id);
    return absl::DeadlineExceededError(absl::StrCat(Describe(), " did not answer batch ",
                                                    p.batch_id, " of layer ", p.layer,
                                                    " before the deadline"));
  }
  if (!p.status.ok()) return p.status;
  MOE_RETURN_IF_ERROR(BatchStatus(p.reply, Describe()));
  return std::move(p.reply);
}

}  // namespace moe::transport
