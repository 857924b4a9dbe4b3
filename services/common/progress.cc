#include "services/common/progress.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "services/common/logging.h"

namespace moe {
namespace {

std::string Bytes(int64_t b) {
  if (b >= int64_t{1} << 30 || b >= 1000000000) return absl::StrFormat("%.1f GB", b / 1e9);
  if (b >= 1000000) return absl::StrFormat("%.1f MB", b / 1e6);
  return absl::StrFormat("%.1f KB", b / 1e3);
}

}  // namespace

std::string FormatProgress(const std::string& what, int64_t done, int64_t total, double seconds) {
  const double rate = seconds > 0 ? done / seconds : 0;
  std::string s = absl::StrFormat("%s: %s of %s (%d%%)", what, Bytes(done), Bytes(total),
                                  total > 0 ? static_cast<int>(100 * done / total) : 100);
  if (rate > 0) {
    absl::StrAppendFormat(&s, ", %.0f MB/s", rate / 1e6);
    if (done < total) {
      absl::StrAppendFormat(&s, ", %.0f s left", static_cast<double>(total - done) / rate);
    }
  }
  return s;
}

Progress::Progress(std::string what, int64_t total_bytes, std::chrono::seconds log_every)
    : what_(std::move(what)),
      total_(total_bytes),
      log_every_(log_every),
      terminal_(StderrIsTerminal()) {}

Progress::~Progress() { Done(); }

void Progress::Add(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Advance(done_ + bytes);
}

void Progress::Update(int64_t done, int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  total_ = total;
  Advance(std::max(done_, done));
}

void Progress::Advance(int64_t done) {
  done_ = std::min(total_, done);
  const auto now = Clock::now();
  const auto every = terminal_ ? std::chrono::milliseconds(200)
                               : std::chrono::duration_cast<std::chrono::milliseconds>(log_every_);
  if (now - last_report_ >= every) {
    last_report_ = now;
    ReportLocked(false);
  }
}

void Progress::Done() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  ReportLocked(true);
}

void Progress::ReportLocked(bool final) {
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  if (final) {
    if (terminal_) std::fputs("\r\033[K", stderr);
    MOE_LOG_INFO("{}: {} in {:.1f} s ({:.0f} MB/s)", what_, Bytes(done_), seconds,
                 seconds > 0 ? done_ / seconds / 1e6 : 0.0);
    return;
  }
  const std::string line = FormatProgress(what_, done_, total_, seconds);
  if (terminal_) {
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
    std::fflush(stderr);
  } else {
    MOE_LOG_INFO("{}", line);
  }
}

}  // namespace moe
