// Built without UCX (libucx-dev not found): the data plane is in-band gRPC only.
#include "services/dataplane/ucx_worker.h"

namespace moe::dataplane {

bool UcxBuilt() { return false; }
std::string UcxVersion() { return ""; }
absl::Status CheckUcxVersion() { return absl::OkStatus(); }
std::string SharedMemoryFifoShape(const std::string&) { return ""; }

class UcxWorkerImpl {};
class UcxBufferPool {};

UcxBuffer::~UcxBuffer() = default;

absl::StatusOr<size_t> UcxTransfer::Wait(absl::Time) {
  return absl::UnimplementedError("built without UCX");
}
bool UcxTransfer::done() const { return true; }
std::string UcxTransfer::header() const { return ""; }

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxOptions&) {
  return absl::UnimplementedError("this build has no UCX data plane (libucx-dev was not found)");
}
UcxWorker::UcxWorker(std::unique_ptr<UcxWorkerImpl> impl) : impl_(std::move(impl)) {}
UcxWorker::~UcxWorker() = default;
absl::StatusOr<uint64_t> UcxWorker::Connect(const std::string&,
                                            std::function<void(const absl::Status&)>) {
  return absl::UnimplementedError("built without UCX");
}
absl::StatusOr<UcxLanes> UcxWorker::Lanes(uint64_t) {
  return absl::UnimplementedError("built without UCX");
}
void UcxWorker::Disconnect(uint64_t) {}
void UcxWorker::OnHello(HelloFn) {}
void UcxWorker::OnHelloDropped(HelloDroppedFn) {}
std::shared_ptr<UcxTransfer> UcxWorker::SendHello(uint64_t, std::string, absl::Time) {
  return std::make_shared<UcxTransfer>();
}
int64_t UcxWorker::hellos_dropped() const { return 0; }
int64_t UcxWorker::stray_messages_dropped() const { return 0; }
int64_t UcxWorker::reply_endpoints_reused() const { return 0; }
absl::StatusOr<std::shared_ptr<UcxBuffer>> UcxWorker::Buffer(size_t) {
  return absl::UnimplementedError("built without UCX");
}
std::shared_ptr<UcxTransfer> UcxWorker::Send(uint64_t, uint64_t, std::shared_ptr<UcxBuffer>, size_t,
                                             absl::Time, Done, size_t) {
  return std::make_shared<UcxTransfer>();
}
std::shared_ptr<UcxTransfer> UcxWorker::Recv(uint64_t, std::shared_ptr<UcxBuffer>, size_t,
                                             absl::Time, Done, size_t) {
  return std::make_shared<UcxTransfer>();
}
std::shared_ptr<UcxTransfer> UcxWorker::RecvAny(uint64_t, std::shared_ptr<UcxBuffer>, absl::Time,
                                                Done) {
  return std::make_shared<UcxTransfer>();
}
std::shared_ptr<UcxTransfer> UcxWorker::SendMessage(uint64_t, Message, std::string,
                                                    std::shared_ptr<UcxBuffer>, size_t, absl::Time,
                                                    Done, size_t) {
  return std::make_shared<UcxTransfer>();
}
void UcxWorker::OnMessage(MessageFn) {}
std::shared_ptr<UcxTransfer> UcxWorker::ExpectMessage(uint64_t, std::shared_ptr<UcxBuffer>,
                                                      absl::Time) {
  return std::make_shared<UcxTransfer>();
}
int64_t UcxWorker::messages_dropped() const { return 0; }
bool UcxWorker::Progress() { return false; }
bool UcxWorker::PollUntil(std::chrono::steady_clock::time_point, const std::function<bool()>&) {
  return false;
}
absl::StatusOr<size_t> UcxWorker::Await(UcxTransfer&, absl::Time, std::chrono::microseconds,
                                        const std::function<bool()>&) {
  return absl::UnimplementedError("built without UCX");
}
absl::StatusOr<size_t> UcxWorker::Await(UcxTransfer&, absl::Time, PollWindow&,
                                        std::chrono::steady_clock::time_point,
                                        const std::function<bool()>&) {
  return absl::UnimplementedError("built without UCX");
}
int64_t UcxWorker::transfers_in_flight() const { return 0; }
int64_t UcxWorker::buffers_registered() const { return 0; }

}  // namespace moe::dataplane
