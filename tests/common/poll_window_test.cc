// The learned poll window (services/common/poll_window.h) against its rule worked by hand: the
// floor until 4 waits are known; then, where at least 3 in 4 of the last 16 waits ended within
// the ceiling, the longest of those plus a quarter, clamped to [floor, ceiling]; else the floor.
#include "services/common/poll_window.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace moe {
namespace {

using std::chrono::microseconds;

void RecordUs(PollWindow& w, int64_t us, int times = 1) {
  for (int i = 0; i < times; ++i) w.Record(microseconds(us));
}

TEST(PollWindow, FloorUntilFourWaitsAreKnown) {
  PollWindow w(microseconds(100), microseconds(1000));
  EXPECT_EQ(w.Window(), microseconds(100));
  RecordUs(w, 300, 3);
  EXPECT_EQ(w.Window(), microseconds(100));
  RecordUs(w, 300);
  EXPECT_EQ(w.Window(), microseconds(375));  // 300 + 300 / 4
}

TEST(PollWindow, CoversTheLongestWaitWithinTheCeiling) {
  PollWindow w(microseconds(100), microseconds(1000));
  for (int64_t us : {50, 400, 120, 260, 90, 310}) RecordUs(w, us);
  EXPECT_EQ(w.Window(), microseconds(500));  // 400 + 100
  RecordUs(w, 900);
  EXPECT_EQ(w.Window(), microseconds(1000));  // 1,125 clamped to the ceiling
}

TEST(PollWindow, ShortWaitsKeepTheFloor) {
  PollWindow w(microseconds(100), microseconds(1000));
  RecordUs(w, 20, 16);
  EXPECT_EQ(w.Window(), microseconds(100));  // 25 raised to the floor
}

TEST(PollWindow, MostlyLongWaitsAreSleptThrough) {
  PollWindow w(microseconds(100), microseconds(1000));
  RecordUs(w, 300, 12);
  RecordUs(w, 5000, 4);  // 12 of 16 within the ceiling: polled for
  EXPECT_EQ(w.Window(), microseconds(375));
  RecordUs(w, 5000);  // 11 of 16 (the oldest 300 replaced): not
  EXPECT_EQ(w.Window(), microseconds(100));
  RecordUs(w, 1001, 16);  // just past the ceiling
  EXPECT_EQ(w.Window(), microseconds(100));
  RecordUs(w, 1000, 16);  // at it
  EXPECT_EQ(w.Window(), microseconds(1000));
}

TEST(PollWindow, OnlyTheLastSixteenWaitsCount) {
  PollWindow w(microseconds(100), microseconds(1000));
  RecordUs(w, 800, 16);
  EXPECT_EQ(w.Window(), microseconds(1000));
  RecordUs(w, 160, 15);  // one 800 left
  EXPECT_EQ(w.Window(), microseconds(1000));
  RecordUs(w, 160);
  EXPECT_EQ(w.Window(), microseconds(200));
}

TEST(PollWindow, ZeroFloorNeverPolls) {
  PollWindow w(microseconds(0), microseconds(1000));
  RecordUs(w, 300, 16);
  EXPECT_EQ(w.Window(), microseconds(0));
  EXPECT_EQ(w.ceiling(), microseconds(0));
}

TEST(PollWindow, CeilingBelowTheFloorIsAFixedWindow) {
  PollWindow w(microseconds(200), microseconds(50));
  EXPECT_EQ(w.ceiling(), microseconds(200));
  RecordUs(w, 180, 16);
  EXPECT_EQ(w.Window(), microseconds(200));
  RecordUs(w, 100, 16);
  EXPECT_EQ(w.Window(), microseconds(200));
}

TEST(PollWindow, NegativeWaitsCountAsZero) {
  PollWindow w(microseconds(100), microseconds(1000));
  w.Record(std::chrono::steady_clock::duration(-5000));
  RecordUs(w, 500, 3);
  EXPECT_EQ(w.Window(), microseconds(625));
}

// Callers of one channel share its window: concurrent records and reads stay within bounds.
TEST(PollWindow, ConcurrentCallersStayWithinBounds) {
  PollWindow w(microseconds(100), microseconds(1000));
  std::vector<std::thread> threads;
  std::atomic<int> out_of_bounds{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        w.Record(microseconds((t * 977 + i * 131) % 1500));
        const microseconds win = w.Window();
        if (win < w.floor() || win > w.ceiling()) out_of_bounds.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(out_of_bounds.load(), 0);
}

}  // namespace
}  // namespace moe
