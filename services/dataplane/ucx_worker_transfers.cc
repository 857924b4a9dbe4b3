// UcxWorkerImpl (ucx_worker_impl.h): tagged sends and receives in chunks under each endpoint's
// window, their completions, cancellation at deadlines, and closing endpoints.
#include <ucp/api/ucp.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/dataplane/ucx_worker_impl.h"

namespace moe::dataplane {

std::shared_ptr<UcxTransfer> UcxWorkerImpl::Start(Kind kind, uint64_t ep, uint64_t tag,
                                                  std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                                  absl::Time deadline, UcxWorker::Done done,
                                                  size_t chunk, std::string hello, size_t offset) {
  auto t = std::make_shared<UcxTransfer>();
  t->buffer_ = std::move(buffer);
  t->offset_ = offset;
  t->on_done_ = std::move(done);
  t->deadline_ = deadline;
  t->ep_ = ep;
  t->tag_ = tag;
  t->what_ = kind == Kind::kHello     ? std::string("UCX hello")
             : kind == Kind::kRequest ? std::string("UCX request message")
             : kind == Kind::kReply
                 ? std::string("UCX reply message")
                 : absl::StrCat("UCX ", kind == Kind::kSend ? "send" : "receive", " of tag ", tag);
  if (chunk == 0) chunk = options_.chunk_bytes;
  if ((kind == Kind::kRequest || kind == Kind::kReply) &&
      hello.size() > UcxWorker::kMaxMessageHeader) {
    t->finished_ = true;
    t->Complete(absl::InvalidArgumentError(absl::StrCat(t->what_, ": a header of ", hello.size(),
                                                        " bytes (at most ",
                                                        UcxWorker::kMaxMessageHeader, ")")),
                0);
    return t;
  }
  if (kind != Kind::kHello && (t->buffer_ == nullptr || offset > t->buffer_->capacity() ||
                               bytes > t->buffer_->capacity() - offset)) {
    t->finished_ = true;
    t->Complete(absl::InvalidArgumentError(absl::StrCat(t->what_, ": ", bytes, " bytes at ", offset,
                                                        " do not fit the buffer")),
                0);
    return t;
  }
  in_flight_.fetch_add(1);
  auto op = [this, t, kind, bytes, chunk, hello = std::move(hello)] {
    switch (kind) {
      case Kind::kSend:
        StartSend(t, bytes, chunk);
        break;
      case Kind::kRecv:
        StartRecv(t, bytes, chunk);
        break;
      case Kind::kRecvAny:
        StartRecvAny(t, bytes);
        break;
      case Kind::kHello:
        StartHello(t, hello);
        break;
      case Kind::kRequest:
      case Kind::kReply:
        StartMessage(t, kind == Kind::kRequest ? kRequestAmId : kReplyAmId, hello, bytes);
        break;
    }
  };
  // On this thread when nobody holds the worker (no wake-up of the progress thread), after
  // what was posted before; else queued for the holder.
  if (t_holder != this && progress_mu_.try_lock()) {
    Hold hold(this, /*locked=*/true);
    hold.wake_if_pending = kind != Kind::kRequest && kind != Kind::kReply;
    RunCommands(/*drain_fd=*/false);
    op();
  } else {
    Post(std::move(op));
  }
  return t;
}

void UcxWorkerImpl::Finish(const std::shared_ptr<UcxTransfer>& t, absl::Status s, size_t length) {
  if (t->finished_) return;
  t->finished_ = true;
  if (!s.ok() && t->cancelled_for_deadline_ &&
      (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kCancelled)) {
    s = absl::DeadlineExceededError(absl::StrCat(t->what_, " did not complete by its deadline"));
  }
  in_flight_.fetch_sub(1);
  t->Complete(std::move(s), length, /*release_buffer=*/t->parts_left_ == 0);
}

void UcxWorkerImpl::PartsGone(UcxTransfer& t, int n) {
  t.parts_left_ -= n;
  if (t.parts_left_ == 0) {
    std::lock_guard<std::mutex> lock(t.mu_);
    t.buffer_.reset();
  }
}

void UcxWorkerImpl::PartDone(const Part& p, absl::Status s, size_t n) {
  UcxTransfer& t = *p.t;
  if (p.ep != 0) {
    auto it = eps_.find(p.ep);
    if (it != eps_.end()) {
      it->second->bytes_in_flight -= std::min(it->second->bytes_in_flight, p.length);
      Pump(*it->second);
    }
  }
  --t.parts_left_;
  if (s.ok() && p.exact && n != p.length) {
    s = absl::InvalidArgumentError(
        absl::StrCat(t.what_, ": a chunk of ", n, " bytes where ", p.length, " were due"));
  }
  if (!s.ok() && t.first_error_.ok()) t.first_error_ = s;
  t.bytes_done_ += n;
  if (!t.first_error_.ok() && !t.finished_) {
    // Fail at once; the buffer stays held until UCX is done with every chunk.
    CancelParts(p.t);
    Finish(p.t, t.first_error_, 0);
  }
  if (t.parts_left_ == 0) {
    if (!t.finished_) {
      Finish(p.t, absl::OkStatus(), t.bytes_done_);
    } else {
      std::lock_guard<std::mutex> lock(t.mu_);
      t.buffer_.reset();  // UCX is done with the memory now
    }
  }
}

void UcxWorkerImpl::AdoptRequest(const Part& p, ucs_status_ptr_t r) {
  const bool already = !starting_;
  starting_ = false;
  if (already) return;
  if (r == nullptr) {
    PartDone(p, absl::OkStatus(), p.length);
  } else if (UCS_PTR_IS_ERR(r)) {
    PartDone(p, FromUcs(UCS_PTR_STATUS(r), p.t->what_), 0);
  } else {
    inflight_[r] = p;
  }
}

std::vector<std::pair<size_t, size_t>> UcxWorkerImpl::Chunks(size_t bytes, size_t chunk) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t off = 0; off < bytes || out.empty(); off += chunk) {
    out.emplace_back(off, std::min(chunk, bytes - off));
    if (bytes == 0) break;
  }
  return out;
}

void UcxWorkerImpl::StartSend(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk) {
  auto it = eps_.find(t->ep_);
  if (stopping_ || it == eps_.end() || it->second->failed) {
    Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
    return;
  }
  const auto chunks = Chunks(bytes, chunk);
  t->parts_left_ = static_cast<int>(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    it->second->waiting.push_back(
        Chunk{t, chunks[i].first, chunks[i].second, t->tag_ + static_cast<uint64_t>(i)});
  }
  Pump(*it->second);
}

void UcxWorkerImpl::Pump(Endpoint& e) {
  while (!e.waiting.empty() && !stopping_) {
    Chunk c = e.waiting.front();
    if (c.t->finished_) {  // failed or abandoned meanwhile: never started
      e.waiting.pop_front();
      PartsGone(*c.t, 1);
      continue;
    }
    if (e.bytes_in_flight > 0 && e.bytes_in_flight + c.length > options_.max_bytes_in_flight) {
      return;
    }
    e.waiting.pop_front();
    e.bytes_in_flight += c.length;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.send = &UcxWorkerImpl::OnSend;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(c.t->buffer_->memh_);
    const Part part{c.t, c.length, e.id};
    starting_ = true;
    starting_part_ = part;
    AdoptRequest(part,
                 ucp_tag_send_nbx(e.ep, c.t->buffer_->data() + c.offset, c.length, c.tag, &p));
  }
}

void UcxWorkerImpl::PostRecv(const Part& part, size_t offset, size_t room, uint64_t tag) {
  ucp_request_param_t p{};
  // Always through the callback, which carries the received length (UCX 1.13 leaves
  // recv_info unset on immediate completion).
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = &UcxWorkerImpl::OnRecv;
  p.user_data = this;
  p.memh = static_cast<ucp_mem_h>(part.t->buffer_->memh_);
  starting_ = true;
  starting_part_ = part;
  AdoptRequest(part, ucp_tag_recv_nbx(worker_, part.t->buffer_->data() + offset, room, tag,
                                      ~ucp_tag_t{0}, &p));
}

void UcxWorkerImpl::StartRecv(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk) {
  if (stopping_) {
    Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker is stopping")), 0);
    return;
  }
  const auto chunks = Chunks(bytes, chunk);
  t->parts_left_ = static_cast<int>(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    // The last chunk may take one byte more than due, so a longer message shows as a
    // length error instead of being cut to fit.
    const size_t room = std::min(chunks[i].second + (i + 1 == chunks.size() ? 1 : 0),
                                 t->buffer_->capacity() - chunks[i].first);
    PostRecv(Part{t, chunks[i].second, 0}, chunks[i].first, room,
             t->tag_ + static_cast<uint64_t>(i));
    if (t->finished_) {  // failed at once: the rest are never posted, nor awaited
      PartsGone(*t, static_cast<int>(chunks.size() - i - 1));
      return;
    }
  }
}

void UcxWorkerImpl::StartRecvAny(const std::shared_ptr<UcxTransfer>& t, size_t capacity) {
  if (stopping_) {
    Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker is stopping")), 0);
    return;
  }
  t->parts_left_ = 1;
  PostRecv(Part{t, capacity, 0, /*exact=*/false}, 0, capacity, t->tag_);
}

void UcxWorkerImpl::StartHello(const std::shared_ptr<UcxTransfer>& t, const std::string& hello) {
  auto it = eps_.find(t->ep_);
  if (stopping_ || it == eps_.end() || it->second->failed) {
    Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
    return;
  }
  // UCX reads the header until the send completes: the transfer (held by its request) keeps it.
  t->header_ = hello;
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  p.cb.send = &UcxWorkerImpl::OnSend;
  p.user_data = this;
  t->parts_left_ = 1;
  const Part part{t, 0, 0};
  starting_ = true;
  starting_part_ = part;
  AdoptRequest(part, ucp_am_send_nbx(it->second->ep, kHelloAmId, t->header_.data(),
                                     t->header_.size(), nullptr, 0, &p));
}

void UcxWorkerImpl::Completed(void* request, ucs_status_t status, size_t length) {
  Part p;
  auto it = inflight_.find(request);
  if (it != inflight_.end()) {
    p = std::move(it->second);
    inflight_.erase(it);
  } else if (starting_) {  // inside the nbx call
    p = starting_part_;
    starting_ = false;
  }
  ucp_request_free(request);
  if (p.t == nullptr) return;
  PartDone(p, status == UCS_OK ? absl::OkStatus() : FromUcs(status, p.t->what_), length);
}

void UcxWorkerImpl::OnSend(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<UcxWorkerImpl*>(user_data);
  // A send's length is its chunk's (sends complete whole or fail).
  size_t n = 0;
  auto it = self->inflight_.find(request);
  if (it != self->inflight_.end()) {
    n = it->second.length;
  } else if (self->starting_) {
    n = self->starting_part_.length;
  }
  self->Completed(request, status, status == UCS_OK ? n : 0);
}

void UcxWorkerImpl::OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data) {
  static_cast<UcxWorkerImpl*>(user_data)->Completed(request, status,
                                                    status == UCS_OK ? info->length : 0);
}

void UcxWorkerImpl::OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* e = static_cast<Endpoint*>(arg);
  if (e->failed) return;
  e->failed = true;
  if (e->on_error) {
    e->on_error(absl::UnavailableError(
        absl::StrCat("UCX endpoint to the peer failed: ", ucs_status_string(status))));
  }
  e->owner->Post([owner = e->owner, id = e->id] { owner->CloseEp(id); });
}

void UcxWorkerImpl::CancelParts(const std::shared_ptr<UcxTransfer>& t) {
  std::vector<void*> mine;
  for (auto& [r, p] : inflight_) {
    if (p.t == t) mine.push_back(r);
  }
  for (void* r : mine) {
    if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
  }
}

void UcxWorkerImpl::CloseEp(uint64_t id) {
  auto it = eps_.find(id);
  if (it == eps_.end()) return;
  Endpoint& e = *it->second;
  // Chunks never started fail with the endpoint.
  std::deque<Chunk> waiting;
  waiting.swap(e.waiting);
  for (Chunk& c : waiting) {
    if (!c.t->finished_) {
      CancelParts(c.t);
      Finish(c.t, absl::UnavailableError(absl::StrCat(c.t->what_, ": the endpoint is closed")), 0);
    }
    PartsGone(*c.t, 1);
  }
  // An endpoint UCX made for a peer's hello is UCX's: forgotten here, released with the worker.
  if (e.owned) {
    ucp_request_param_t p{};
    // Forcibly only where both sides have peer error handling (UCX's rule); a flush otherwise.
    if (e.peer_mode) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(e.ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.push_back(r);
  }
  by_handle_.erase(e.ep);
  closed_.push_back(std::move(it->second));  // the error handler's arg stays valid
  eps_.erase(it);
}

void UcxWorkerImpl::ReapClosing() {
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
      ucp_request_free(*it);
      it = closing_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace moe::dataplane
