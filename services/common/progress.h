// Progress of long work (checkpoint generation, weight loading): bytes, percent, MB/s and ETA,
// redrawn in place on a terminal (at most 5 times a second) and logged as a line every
// `log_every` otherwise (a pod's log, CI), with a last line when done. Thread-safe.
//
//   Progress p("writing k3 checkpoint", total_bytes);
//   ... p.Add(n) from any thread ...
//   p.Done();  // "writing k3 checkpoint: 15.8 GB in 51 s (310 MB/s)"
#ifndef MOE_SERVICES_COMMON_PROGRESS_H_
#define MOE_SERVICES_COMMON_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace moe {

// "writing k3: 4.2 GB of 15.8 GB (26%), 310 MB/s, 37 s left" (pure: for tests and both outputs).
std::string FormatProgress(const std::string& what, int64_t done, int64_t total, double seconds);

class Progress {
 public:
  Progress(std::string what, int64_t total_bytes,
           std::chrono::seconds log_every = std::chrono::seconds(10));
  ~Progress();  // Done() if not yet
  void Add(int64_t bytes);
  // Absolute: `done` of `total` (the larger done wins when threads race).
  void Update(int64_t done, int64_t total);
  void Done();

 private:
  using Clock = std::chrono::steady_clock;
  void Advance(int64_t done);  // mu_ held
  void ReportLocked(bool final);

  const std::string what_;
  int64_t total_;
  const std::chrono::seconds log_every_;
  const bool terminal_;
  const Clock::time_point start_ = Clock::now();
  std::mutex mu_;
  int64_t done_ = 0;
  Clock::time_point last_report_ = start_;
  bool finished_ = false;
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_PROGRESS_H_
