// How long a thread that waits anyway (an attention node's caller for a shard's reply, an expert
// server's compute thread for the next batch) polls before it sleeps, learned from its recent
// waits. A poll that ends before its event adds a sleeping wake-up (in the 2-vCPU guests here a
// T = 1 round trip took ~200 us when its threads slept, 13-23 us polled; a T = 64 one 390-450 us
// with a 100 us poll, 170-250 with a window that covered it: tests/bench/dispatch_bench.cc); a
// poll ends at its event, so a longer window costs only the waits that outlast it. So the
// window is the floor (--ucx_poll_us) until 4 waits are known; then, where at least three in four
// of the last 16 waits ended within the ceiling (--ucx_poll_max_us), it covers the longest of
// those with a quarter to spare (at most the ceiling); where more were longer (large batches, an
// idle shard) it stays at the floor and the thread sleeps, as with a fixed window. No thread
// polls past the ceiling. Thread-safe (the callers of one channel share its window).
//
//   PollWindow w(std::chrono::microseconds(100), std::chrono::microseconds(1000));
//   const auto start = std::chrono::steady_clock::now();            // the request is sent
//   poll until std::max(now + w.floor(), start + w.Window()), then sleep until the reply;
//   w.Record(std::chrono::steady_clock::now() - start);               // the reply is here
#ifndef MOE_SERVICES_COMMON_POLL_WINDOW_H_
#define MOE_SERVICES_COMMON_POLL_WINDOW_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace moe {

class PollWindow {
 public:
  static constexpr int kSamples = 16;  // the recent waits the window is learned from
  static constexpr int kMinSamples = 4;

  // A ceiling below the floor is raised to it (a fixed window: the floor); a floor of 0 means
  // no polling at all (the ceiling is 0 too).
  PollWindow(std::chrono::microseconds floor, std::chrono::microseconds ceiling);

  // How long after a wait's start to poll: at least floor(), at most ceiling().
  std::chrono::microseconds Window() const;
  // A wait that ended: from its start to its event (whether polled or slept for).
  void Record(std::chrono::steady_clock::duration waited);

  std::chrono::microseconds floor() const { return floor_; }
  std::chrono::microseconds ceiling() const { return ceiling_; }

 private:
  const std::chrono::microseconds floor_, ceiling_;
  mutable std::mutex mu_;
  std::array<int64_t, kSamples> waits_us_ ABSL_GUARDED_BY(mu_){};
  int64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
};

// Between two empty looks of a poller: a pause, and every 8th time the CPU to whoever else is
// runnable on it (where processes share cores, the peer computing the answer). A yield after
// every empty look spent most of a poller's time in sched_yield (a syscall: in a VM guest the
// paravirtual interrupt enable of every return was the top symbol of a T = 1 round trip in
// perf); one in 8 took a UCX T = 1 round trip's p50 from 30-34 to 25-30 us, and without any the
// shm lane's T = 1 in a local cluster on 2 vCPUs took 1.2 ms a batch against 0.6-0.7
// (docs/data-plane.md). The UCX worker's and the shm lane's pollers use it.
//
//   for (int empty = 0; until_not_reached;) { if (!LookOnce()) PollPause(&empty); }
void PollPause(int* empty_looks);

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_POLL_WINDOW_H_
