// UcxWorkerImpl (ucx_worker_impl.h): the progress loop (the thread that progresses the worker
// when no waiter polls it, sleeping on UCX's event fd and the wake fd), the posted commands,
// and the deadlines of transfers.
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/dataplane/ucx_worker_impl.h"

namespace moe::dataplane {

absl::Duration UcxWorkerImpl::CheckDeadlines() {
  const absl::Time now = absl::Now();
  absl::Duration next = absl::Milliseconds(200);
  std::vector<uint64_t> to_close;
  std::vector<void*> to_cancel;
  std::vector<std::shared_ptr<UcxTransfer>> to_abandon;
  for (auto& [key, p] : inflight_) {
    UcxTransfer& t = *p.t;
    if (!t.cancelled_for_deadline_ && now >= t.deadline_) {
      t.cancelled_for_deadline_ = true;
      to_cancel.push_back(key);
    } else if (t.cancelled_for_deadline_ && now >= t.deadline_ + kCancelGrace) {
      auto ep = eps_.find(p.ep);
      if (ep != eps_.end() && ep->second->peer_mode) {
        to_close.push_back(p.ep);
      } else if (!t.finished_) {
        to_abandon.push_back(p.t);
      }
    } else if (!t.cancelled_for_deadline_) {
      next = std::min(next, t.deadline_ - now);
    }
  }
  // Replies expected past their deadline.
  for (auto it = expected_.begin(); it != expected_.end();) {
    if (now >= it->second->deadline_) {
      to_abandon.push_back(std::move(it->second));
      it = expected_.erase(it);
    } else {
      next = std::min(next, it->second->deadline_ - now);
      ++it;
    }
  }
  // Chunks still waiting for their window past the deadline.
  for (auto& [id, e] : eps_) {
    for (Chunk& c : e->waiting) {
      if (!c.t->finished_ && now >= c.t->deadline_) to_abandon.push_back(c.t);
    }
  }
  // ucp_request_cancel may complete the request at once (its callback edits inflight_).
  for (void* r : to_cancel) {
    if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
  }
  for (uint64_t ep : to_close) CloseEp(ep);
  for (auto& t : to_abandon) {
    if (t->finished_) continue;
    t->cancelled_for_deadline_ = true;
    Finish(t,
           absl::DeadlineExceededError(absl::StrCat(t->what_, " did not complete by its deadline")),
           0);
  }
  for (auto& [id, e] : eps_) Pump(*e);
  return std::max(next, absl::Milliseconds(1));
}

bool UcxWorkerImpl::RunCommands(bool drain_fd) {
  if (drain_fd) {
    uint64_t n;
    (void)!read(wake_fd_, &n, sizeof(n));
  }
  if (!has_commands_.load(std::memory_order_acquire)) return false;
  std::deque<std::function<void()>> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    todo.swap(commands_);
    has_commands_.store(false, std::memory_order_relaxed);
  }
  for (auto& f : todo) f();
  return !todo.empty();
}

std::chrono::steady_clock::time_point UcxWorkerImpl::LastPollEnd() const {
  return std::chrono::steady_clock::time_point(
      std::chrono::steady_clock::duration(last_poll_end_ns_.load(std::memory_order_relaxed)));
}

void UcxWorkerImpl::SleepWhilePolled(absl::Duration next) {
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(next);
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return;
    // While a thread polls, look again once per kGracesPerPolledLook graces (at least 1 ms);
    // once none does, when the grace ends: the worker is unarmed for at most a look and a grace
    // after the last poll.
    const std::chrono::steady_clock::duration slice = std::max<std::chrono::steady_clock::duration>(
        options_.handoff_grace * kGracesPerPolledLook, std::chrono::milliseconds(1));
    auto wait = std::min<std::chrono::steady_clock::duration>(until - now, slice);
    if (pollers_.load() == 0) {
      const auto grace_end = LastPollEnd() + options_.handoff_grace;
      if (now >= grace_end) return;
      wait = std::min<std::chrono::steady_clock::duration>(wait, grace_end - now);
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
    const timespec ts = {static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    pollfd fd = {wake_fd_, POLLIN, 0};
    // Woken (a command, a hand-off, Stop): back to the loop, which drains the wake fd.
    if (ppoll(&fd, 1, &ts, nullptr) != 0) return;
  }
}

void UcxWorkerImpl::Loop() {
  absl::Time stop_by = absl::InfiniteFuture();
  // After any activity the thread may keep polling for options_.spin before it sleeps: a round
  // trip is a chain of small steps (rendezvous fragments and handshakes, a reply right after a
  // request), and waking from poll() costs tens of microseconds per step in a VM. Off by
  // default: where processes share the cores (2 here) spinning cost 8 senders goodput
  // (docs/data-plane.md); bounded, so an idle data plane costs no CPU. A turn of the spin makes
  // no syscall: the wake fd is drained only after a sleep, and the deadlines (absl::Now, whose
  // lock two spinning threads contend) are looked at every kSpinCheckEvery.
  constexpr auto kSpinCheckEvery = std::chrono::microseconds(200);
  auto last_activity = std::chrono::steady_clock::now();
  auto next_check = last_activity;
  absl::Duration next = absl::Milliseconds(1);
  std::unique_lock<std::mutex> lock(progress_mu_, std::defer_lock);
  bool slept = true;
  for (;;) {
    if (!lock.owns_lock()) lock.lock();
    t_holder = this;
    bool active = RunCommands(/*drain_fd=*/slept);
    slept = false;
    while (ucp_worker_progress(worker_) != 0) active = true;
    const auto now = std::chrono::steady_clock::now();
    if (active) last_activity = now;
    const bool spinning = now - last_activity < options_.spin;
    if (!spinning || now >= next_check || stopping_) {
      next = CheckDeadlines();
      ReapClosing();
      next_check = now + kSpinCheckEvery;
    }
    if (stopping_) {
      if (stop_by == absl::InfiniteFuture()) {
        stop_by = absl::Now() + kShutdownGrace;
        // A cancel may complete its request at once (the callback edits inflight_).
        std::vector<void*> requests;
        for (auto& [request, p] : inflight_) {
          p.t->cancelled_for_deadline_ = false;
          requests.push_back(request);
        }
        for (void* r : requests) {
          if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
        }
        std::vector<uint64_t> ids;
        for (auto& [id, e] : eps_) ids.push_back(id);
        for (uint64_t id : ids) CloseEp(id);
        for (auto& [token, t] : expected_) {
          Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker stopped")), 0);
        }
        expected_.clear();
        pool_->Drain();
        continue;
      }
      if ((inflight_.empty() && closing_.empty()) || absl::Now() > stop_by) break;
    }
    if (spinning) continue;
    if (pollers_.load() > 0 ||
        std::chrono::steady_clock::now() - LastPollEnd() < options_.handoff_grace) {
      // A waiter polls the worker, or one did a moment ago and comes back: the progress thread
      // sleeps unarmed (no peer signals this worker per message) until the pollers are gone
      // for the grace or one hands the worker back (EndPolling wakes it).
      disarmed_ = true;
      t_holder = nullptr;
      lock.unlock();
      SleepWhilePolled(next);
      slept = true;
      continue;
    }
    disarmed_ = false;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    // Asleep without the worker: a waiter may poll it meanwhile.
    t_holder = nullptr;
    lock.unlock();
    // Requests in flight (a send whose caller did not poll on): back within a millisecond.
    const int timeout_ms =
        inflight_.empty() ? static_cast<int>(absl::ToInt64Milliseconds(next)) + 1 : 1;
    pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    (void)poll(fds, 2, timeout_ms);
    slept = true;
  }
  t_holder = nullptr;
  // Whatever UCX did not give back in time: failed here, never left waiting.
  for (auto& [key, p] : inflight_) {
    if (!p.t->finished_) {
      p.t->finished_ = true;
      in_flight_.fetch_sub(1);
      p.t->Complete(absl::UnavailableError(absl::StrCat(p.t->what_, ": the worker stopped")), 0);
    }
  }
  inflight_.clear();
}

}  // namespace moe::dataplane
