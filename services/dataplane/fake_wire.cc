#include "services/dataplane/fake_wire.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/dataplane/payload_mac.h"

namespace moe::dataplane {

namespace {

struct Listener {
  std::mutex call_mu;  // held while the handler runs: Close waits for it
  bool closed = false;
  FakeWire::Handler handler;
};

struct Message {
  std::shared_ptr<Listener> to;
  std::string frame, payload;
};

// One per process, never destroyed (its thread may run while statics are torn down).
class Wire {
 public:
  Wire() {
    std::thread([this] { Run(); }).detach();
  }

  std::string Listen(FakeWire::Handler h) {
    auto l = std::make_shared<Listener>();
    l->handler = std::move(h);
    std::lock_guard<std::mutex> lock(mu_);
    std::string address;
    do {
      address = absl::StrFormat("fake:%016x", RandomU64());
    } while (listeners_.count(address) != 0);
    listeners_[address] = std::move(l);
    return address;
  }

  void Close(const std::string& address) {
    std::shared_ptr<Listener> l;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = listeners_.find(address);
      if (it == listeners_.end()) return;
      l = std::move(it->second);
      listeners_.erase(it);
    }
    std::lock_guard<std::mutex> call(l->call_mu);
    l->closed = true;
    l->handler = nullptr;
  }

  absl::Status Send(const std::string& address, std::string frame, std::string payload) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = listeners_.find(address);
    if (it == listeners_.end()) {
      return absl::UnavailableError(absl::StrCat("nobody listens at ", address.substr(0, 64)));
    }
    queue_.push_back({it->second, std::move(frame), std::move(payload)});
    cv_.notify_one();
    return absl::OkStatus();
  }

  int64_t delivered() const { return delivered_.load(); }

 private:
  void Run() {
    for (;;) {
      Message m;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        m = std::move(queue_.front());
        queue_.pop_front();
      }
      std::lock_guard<std::mutex> call(m.to->call_mu);
      if (m.to->closed) continue;
      delivered_.fetch_add(1);  // before the handler: what it wakes sees the count
      m.to->handler(std::move(m.frame), std::move(m.payload));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::shared_ptr<Listener>> listeners_;
  std::deque<Message> queue_;
  std::atomic<int64_t> delivered_{0};
};

Wire& TheWire() {
  static Wire* wire = new Wire;
  return *wire;
}

}  // namespace

std::string FakeWire::Listen(Handler handler) { return TheWire().Listen(std::move(handler)); }
void FakeWire::Close(const std::string& address) { TheWire().Close(address); }
absl::Status FakeWire::Send(const std::string& address, std::string frame, std::string payload) {
  return TheWire().Send(address, std::move(frame), std::move(payload));
}
int64_t FakeWire::delivered() { return TheWire().delivered(); }

}  // namespace moe::dataplane
