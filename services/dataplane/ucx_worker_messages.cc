// UcxWorkerImpl (ucx_worker_impl.h): endpoints made for peers, and active messages in: the
// handler on every AM id (a stray is dropped and counted), hellos with their reply endpoints,
// batch requests and replies landed in their buffers.
#include <ucp/api/ucp.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/dataplane/ucx_worker_impl.h"

namespace moe::dataplane {

absl::StatusOr<uint64_t> UcxWorkerImpl::Create(
    const std::string& peer, bool peer_mode,
    const std::function<void(const absl::Status&)>& on_error) {
  auto e = std::make_unique<Endpoint>();
  e->id = next_ep_++;
  e->on_error = on_error;
  e->owner = this;
  e->peer_mode = peer_mode;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer.data());
  ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_mode) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = &UcxWorkerImpl::OnEpError;
    ep.err_handler.arg = e.get();
  }
  if (ucs_status_t s = ucp_ep_create(worker_, &ep, &e->ep); s != UCS_OK) {
    return FromUcs(s, "ucp_ep_create");
  }
  const uint64_t id = e->id;
  by_handle_[e->ep] = id;
  eps_[id] = std::move(e);
  return id;
}

UcxLanes UcxWorkerImpl::LanesOf(uint64_t id) {
  auto it = eps_.find(id);
  if (it == eps_.end()) return UcxLanes{};
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return UcxLanes{};
  ucp_ep_print_info(it->second->ep, f);
  std::fclose(f);
  UcxLanes lanes = ParseUcxLanes(std::string_view(text, size));
  std::free(text);
  return lanes;
}

uint64_t UcxWorkerImpl::Adopt(ucp_ep_h h) {
  auto it = by_handle_.find(h);
  if (it != by_handle_.end()) {
    if (eps_.at(it->second)->owned) return it->second;  // one of ours, answered on
    reply_endpoints_reused_.fetch_add(1);
    CloseEp(it->second);
  }
  auto e = std::make_unique<Endpoint>();
  e->id = next_ep_++;
  e->ep = h;
  e->owned = false;
  e->owner = this;
  const uint64_t id = e->id;
  by_handle_[h] = id;
  eps_[id] = std::move(e);
  return id;
}

ucs_status_t UcxWorkerImpl::OnStrayAm(void* arg, const void*, size_t, void*, size_t,
                                      const ucp_am_recv_param_t*) {
  static_cast<UcxWorkerImpl*>(arg)->stray_dropped_.fetch_add(1);
  return UCS_OK;
}

ucs_status_t UcxWorkerImpl::OnAm(void* arg, const void* header, size_t header_length,
                                 void* /*data*/, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxWorkerImpl*>(arg);
  // A hello has a header and no data; a reply endpoint is what it is for. Anything else is
  // dropped (data, eager or rendezvous, is released by UCX when we return UCS_OK).
  const bool has_reply =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 && param->reply_ep != nullptr;
  if (length != 0 || !has_reply || header_length == 0 || header_length > kMaxHelloBytes ||
      !self->hello_ || self->stopping_) {
    self->hellos_dropped_.fetch_add(1);
    if (self->hello_dropped_ && !self->stopping_) {
      self->hello_dropped_(
          length != 0          ? absl::StrCat("a UCX hello carrying ", length, " bytes of data")
          : !has_reply         ? std::string("a UCX hello without a reply endpoint")
          : header_length == 0 ? std::string("an empty UCX hello")
                               : absl::StrCat("a UCX hello of ", header_length, " bytes (at most ",
                                              kMaxHelloBytes, ")"));
    }
    return UCS_OK;
  }
  const uint64_t ep = self->Adopt(param->reply_ep);
  self->hello_(std::string_view(static_cast<const char*>(header), header_length), ep,
               self->LanesOf(ep));
  return UCS_OK;
}

ucs_status_t UcxWorkerImpl::OnRequestAm(void* arg, const void* header, size_t header_length,
                                        void* data, size_t length,
                                        const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxWorkerImpl*>(arg);
  if (!self->on_message_ || self->stopping_ || header_length > UcxWorker::kMaxMessageHeader) {
    self->messages_dropped_.fetch_add(1);
    return UCS_OK;
  }
  UcxWorker::MessageSink sink =
      self->on_message_(std::string_view(static_cast<const char*>(header), header_length), length);
  if (sink.buffer == nullptr) {
    self->messages_dropped_.fetch_add(1);
    return UCS_OK;
  }
  auto t = std::make_shared<UcxTransfer>();
  t->buffer_ = std::move(sink.buffer);
  t->offset_ = sink.offset;
  t->on_done_ = std::move(sink.done);
  t->deadline_ = absl::Now() + kMessageReceiveTimeout;
  t->what_ = "UCX request message";
  self->in_flight_.fetch_add(1);
  self->Land(t, data, length, param);
  return UCS_OK;
}

ucs_status_t UcxWorkerImpl::OnReplyAm(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxWorkerImpl*>(arg);
  uint64_t token = 0;
  if (header_length >= 8 && header_length <= UcxWorker::kMaxMessageHeader) {
    for (int i = 0; i < 8; ++i) {
      token |= static_cast<uint64_t>(static_cast<const uint8_t*>(header)[i]) << (8 * i);
    }
  }
  auto it = header_length >= 8 && header_length <= UcxWorker::kMaxMessageHeader
                ? self->expected_.find(token)
                : self->expected_.end();
  if (it == self->expected_.end() || self->stopping_) {
    self->messages_dropped_.fetch_add(1);
    return UCS_OK;
  }
  std::shared_ptr<UcxTransfer> t = std::move(it->second);
  self->expected_.erase(it);
  t->header_.assign(static_cast<const char*>(header), header_length);
  self->Land(t, data, length, param);
  return UCS_OK;
}

void UcxWorkerImpl::Land(const std::shared_ptr<UcxTransfer>& t, void* data, size_t length,
                         const ucp_am_recv_param_t* param) {
  const size_t room =
      t->offset_ <= t->buffer_->capacity() ? t->buffer_->capacity() - t->offset_ : 0;
  if (length > room) {
    Finish(t,
           absl::InternalError(absl::StrCat(t->what_, ": ", length, " bytes do not fit the ", room,
                                            " bytes of the buffer")),
           0);
    return;  // UCX releases the data (a rendezvous one unread)
  }
  uint8_t* to = t->buffer_->data() + t->offset_;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    if (length > 0) std::memcpy(to, data, length);
    Finish(t, absl::OkStatus(), length);
    return;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv_am = &UcxWorkerImpl::OnAmData;
  p.user_data = this;
  p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
  t->parts_left_ = 1;
  const Part part{t, length, 0};
  starting_ = true;
  starting_part_ = part;
  AdoptRequest(part, ucp_am_recv_data_nbx(worker_, data, to, length, &p));
}

void UcxWorkerImpl::OnAmData(void* request, ucs_status_t status, size_t length, void* user_data) {
  static_cast<UcxWorkerImpl*>(user_data)->Completed(request, status, status == UCS_OK ? length : 0);
}

void UcxWorkerImpl::StartMessage(const std::shared_ptr<UcxTransfer>& t, uint16_t id,
                                 const std::string& header, size_t bytes) {
  auto it = eps_.find(t->ep_);
  if (stopping_ || it == eps_.end() || it->second->failed) {
    Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
    return;
  }
  t->header_ = header;  // UCX reads it until the send completes
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  p.cb.send = &UcxWorkerImpl::OnSend;
  p.user_data = this;
  p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
  t->parts_left_ = 1;
  it->second->bytes_in_flight += bytes;
  const Part part{t, bytes, it->second->id};
  starting_ = true;
  starting_part_ = part;
  AdoptRequest(part, ucp_am_send_nbx(it->second->ep, id, t->header_.data(), t->header_.size(),
                                     t->buffer_->data() + t->offset_, bytes, &p));
}

}  // namespace moe::dataplane
