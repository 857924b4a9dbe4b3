#include "services/transport/health_check.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "services/transport/channel.h"
#include "services/transport/status_convert.h"

namespace moe::transport {

namespace {

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Reads a protobuf varint at bytes[*pos]; false at the end or when malformed.
bool Varint(const std::string& bytes, size_t* pos, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64 && *pos < bytes.size(); shift += 7) {
    const uint8_t b = static_cast<uint8_t>(bytes[(*pos)++]);
    *v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;
}

// One bidi exchange: write `request`, close, read one response.
class OneShotBidi final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit OneShotBidi(std::string request) : request_(Buffer(request)) {}
  void Start() {
    StartWrite(&request_);
    StartRead(&response_);
    StartCall();
  }
  void OnWriteDone(bool) override { StartWritesDone(); }
  void OnReadDone(bool ok) override { got_ = ok; }
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  grpc::Status Await() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }
  bool got() const { return got_; }
  const grpc::ByteBuffer& response() const { return response_; }

 private:
  grpc::ByteBuffer request_, response_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, got_ = false;
  grpc::Status status_;
};

}  // namespace

absl::StatusOr<bool> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                 absl::Duration timeout, const std::string& service) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // HealthCheckRequest{service = 1}: empty for "" (an empty ByteBuffer means "no message", so
  // it carries one empty slice), else tag 0x0a, length, bytes.
  std::string req;
  if (!service.empty() && service.size() < 128) {
    req = std::string(1, '\x0a') + static_cast<char>(service.size()) + service;
  }
  grpc::ByteBuffer request = Buffer(req), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = std::move(s);
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return FromGrpc(status);
  // HealthCheckResponse{status = 1 (SERVING)}: field 1 varint -> bytes 0x08 0x01.
  const std::string bytes = Flatten(response);
  return bytes.size() == 2 && bytes[0] == 0x08 && bytes[1] == 0x01;
}

absl::StatusOr<bool> CheckHealth(const std::string& endpoint, absl::Duration timeout,
                                 const std::string& service) {
  return CheckHealth(MakeChannel(endpoint), timeout, service);
}

absl::StatusOr<std::vector<std::string>> ListServices(const std::string& endpoint,
                                                      absl::Duration timeout) {
  grpc::GenericStub generic(MakeChannel(endpoint));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  OneShotBidi call(std::string("\x3a\x00", 2));
  generic.PrepareBidiStreamingCall(&ctx,
                                   "/grpc.reflection.v1alpha.ServerReflection/"
                                   "ServerReflectionInfo",
                                   grpc::StubOptions(), &call);
  call.Start();
  const grpc::Status s = call.Await();
  if (!s.ok()) return FromGrpc(s);
  if (!call.got()) return absl::UnavailableError("no reflection response");
  // ServerReflectionResponse: field 6 list_services_response { repeated ServiceResponse
  // service = 1 { string name = 1 } }.
  const std::string bytes = Flatten(call.response());
  std::vector<std::string> names;
  size_t pos = 0;
  uint64_t tag, len;
  while (pos < bytes.size() && Varint(bytes, &pos, &tag)) {
    if ((tag & 7) != 2) {  // only length-delimited fields matter here; skip varints
      if ((tag & 7) == 0 && Varint(bytes, &pos, &len)) continue;
      break;
    }
    if (!Varint(bytes, &pos, &len) || pos + len > bytes.size()) break;
    const std::string field = bytes.substr(pos, len);
    pos += len;
    if ((tag >> 3) != 6) continue;
    size_t p2 = 0;
    while (p2 < field.size() && Varint(field, &p2, &tag) && Varint(field, &p2, &len) &&
           p2 + len <= field.size()) {
      const std::string service = field.substr(p2, len);
      p2 += len;
      size_t p3 = 0;
      uint64_t t3, l3;
      if (Varint(service, &p3, &t3) && (t3 >> 3) == 1 && Varint(service, &p3, &l3) &&
          p3 + l3 <= service.size()) {
        names.push_back(service.substr(p3, l3));
      }
    }
  }
  return names;
}

}  // namespace moe::transport
