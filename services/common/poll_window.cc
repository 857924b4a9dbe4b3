#include "services/common/poll_window.h"

#include <algorithm>
#include <thread>

namespace moe {

PollWindow::PollWindow(std::chrono::microseconds floor, std::chrono::microseconds ceiling)
    : floor_(std::max(floor, std::chrono::microseconds(0))),
      ceiling_(floor_.count() == 0 ? floor_ : std::max(floor_, ceiling)) {}

std::chrono::microseconds PollWindow::Window() const {
  std::array<int64_t, kSamples> w;
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = static_cast<int>(std::min<int64_t>(recorded_, kSamples));
    std::copy(waits_us_.begin(), waits_us_.begin() + n, w.begin());
  }
  if (n < kMinSamples) return floor_;
  // Polled for only where at least three in four recent waits ended within the ceiling; then
  // the longest of those is covered (a poll ends at its event, so the extra length costs only
  // the waits longer than the window).
  int64_t longest = -1;
  int within = 0;
  for (int i = 0; i < n; ++i) {
    if (w[i] <= ceiling_.count()) {
      ++within;
      longest = std::max(longest, w[i]);
    }
  }
  if (4 * within < 3 * n) return floor_;  // mostly too long to be worth a core: sleep
  return std::clamp(std::chrono::microseconds(longest + longest / 4), floor_, ceiling_);
}

void PollWindow::Record(std::chrono::steady_clock::duration waited) {
  const int64_t us =
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(waited).count());
  std::lock_guard<std::mutex> lock(mu_);
  waits_us_[static_cast<size_t>(recorded_ % kSamples)] = us;
  ++recorded_;
}

void PollPause(int* empty_looks) {
  if (++*empty_looks % 8 == 0) {
    std::this_thread::yield();
  } else {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

}  // namespace moe
