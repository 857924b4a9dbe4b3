// The wire of the fake data plane (expert-svc/dataplane/fake, attention-svc/dataplane/fake): a
// transport that never leaves the process, for tests of everything above the wire without UCX,
// and the smallest example of a backend (docs/data-plane.md, "Adding a transport"). Halves listen
// at an address the wire makes ("fake:" and 16 hex digits) and send messages (a frame and a
// payload, copied) to addresses; each message is delivered on the wire's own thread, never inline
// in the sender, in the order sent. Addresses of one process mean nothing in another: a fake
// attention node reaches only shards in its own process.
//
//   std::string me = FakeWire::Listen([](std::string frame, std::string payload) { ... });
//   MOE_RETURN_IF_ERROR(FakeWire::Send(peer, std::move(frame), std::move(payload)));
//   FakeWire::Close(me);  // after it returns, the handler never runs again
#ifndef MOE_SERVICES_DATAPLANE_FAKE_WIRE_H_
#define MOE_SERVICES_DATAPLANE_FAKE_WIRE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace moe::dataplane {

class FakeWire {
 public:
  using Handler = std::function<void(std::string frame, std::string payload)>;
  static std::string Listen(Handler handler);
  // Waits for a delivery in progress to this address; messages still queued are dropped.
  static void Close(const std::string& address);
  // UNAVAILABLE when nobody listens at `address` (checked now; a listener that closes before
  // delivery drops the message, as a peer that dies would).
  static absl::Status Send(const std::string& address, std::string frame, std::string payload);
  // Messages delivered since the process started (tests: the wire really carried them).
  static int64_t delivered();
};

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_FAKE_WIRE_H_
