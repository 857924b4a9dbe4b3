// A hostile UCX peer for tests: its own UCP context and worker (no project code), an endpoint to
// a victim's worker address, and raw active messages on any id, with or without the reply flag,
// header and data as given. What a stranger with a UCX library can send, with none of the
// checks the project's UcxWorker makes on its own messages.
//
//   RawUcpPeer peer("tcp");
//   ASSERT_TRUE(peer.Connect(victim_address));
//   for (int id = 0; id < 65536; ++id) peer.SendAm(id, /*reply=*/true, "hdr", "");
#ifndef MOE_TESTS_DATAPLANE_RAW_UCP_PEER_H_
#define MOE_TESTS_DATAPLANE_RAW_UCP_PEER_H_

#include <ucp/api/ucp.h>

#include <chrono>
#include <string>

namespace moe::testing {

class RawUcpPeer {
 public:
  // net_devices: UCX_NET_DEVICES ("lo": an address with loopback only); empty: UCX's choice.
  explicit RawUcpPeer(const std::string& tls, const std::string& net_devices = "") {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return;
    ucp_config_modify(config, "TLS", tls.c_str());
    if (!net_devices.empty()) ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_TAG;
    const ucs_status_t s = ucp_init(&p, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return;
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(context_, &wp, &worker_) != UCS_OK) worker_ = nullptr;
  }
  ~RawUcpPeer() {
    if (ep_ != nullptr) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      Wait(ucp_ep_close_nbx(ep_, &rp));
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  RawUcpPeer(const RawUcpPeer&) = delete;
  RawUcpPeer& operator=(const RawUcpPeer&) = delete;

  // This peer's own worker address (a template a stranger can edit: data_plane_test forges a
  // victim's address from it and the victim's listening port).
  std::string Address() const {
    if (worker_ == nullptr) return "";
    ucp_address_t* a = nullptr;
    size_t n = 0;
    if (ucp_worker_get_address(worker_, &a, &n) != UCS_OK) return "";
    std::string out(reinterpret_cast<const char*>(a), n);
    ucp_worker_release_address(worker_, a);
    return out;
  }

  bool Connect(const std::string& address) {
    if (worker_ == nullptr) return false;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    return ucp_ep_create(worker_, &ep, &ep_) == UCS_OK;
  }

  // One active message on `id`; true when UCX completed the send within a second.
  bool SendAm(unsigned id, bool reply, const std::string& header, const std::string& data) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = reply ? UCP_AM_SEND_FLAG_REPLY : 0;
    return Wait(
        ucp_am_send_nbx(ep_, id, header.data(), header.size(), data.data(), data.size(), &rp));
  }

  // Every active message id 0..65535, first without then with the reply flag, `data` on the ids
  // whose remainder by `data_every` is `data_at` (past the eager size: rendezvous), until `limit`
  // has passed; how many UCX completed.
  int SendEveryId(const std::string& header, const std::string& data, int data_every, int data_at,
                  std::chrono::seconds limit) {
    int sent = 0;
    const auto until = std::chrono::steady_clock::now() + limit;
    for (int reply = 0; reply < 2; ++reply) {
      for (int id = 0; id < 65536 && std::chrono::steady_clock::now() < until; ++id) {
        sent += SendAm(static_cast<unsigned>(id), reply == 1, header,
                       id % data_every == data_at ? data : std::string());
      }
    }
    return sent;
  }

  void Progress() {
    while (ucp_worker_progress(worker_) != 0) {
    }
  }

 private:
  // Completes a request by progressing this worker, for at most a second.
  bool Wait(ucs_status_ptr_t r) {
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    ucs_status_t s = UCS_INPROGRESS;
    while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < until) {
      ucp_worker_progress(worker_);
    }
    if (s == UCS_INPROGRESS) ucp_request_cancel(worker_, r);
    ucp_request_free(r);
    return s == UCS_OK;
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_DATAPLANE_RAW_UCP_PEER_H_
