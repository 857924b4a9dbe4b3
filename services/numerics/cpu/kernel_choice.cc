#include "services/numerics/cpu/kernel_choice.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "services/common/logging.h"
#include "services/numerics/cpu/machine_limits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace moe::numerics::cpu {

namespace {

using Clock = std::chrono::steady_clock;

// Tokens per expert the probes run at: decode sizes, the crossover region, prefill.
constexpr int64_t kProbeTokens[] = {1, 2, 4, 8, 16, 32, 64, 128};
// Work per probe: the T = 1 probe streams this many weight bytes (more than a core's L2, so the
// row kernels are timed reading memory as they do at one token per expert); larger T run the
// rows that make about kProbeFlops (at least two work items per thread), at a new offset each
// repetition.
constexpr int64_t kDecodeBytes = int64_t{24} << 20;
constexpr double kProbeFlops = 48e6;
constexpr int kProbeReps = 5;
constexpr int64_t kBlockRows = 128;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct ProbeMatrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed, scales;
};

// Random E2M1 bytes and block scales near 2^-5 (trained weights' range): speed does not depend on
// the values, but denormals or infinities would.
ProbeMatrix RandomMatrix(int64_t rows, int64_t cols, uint64_t seed) {
  ProbeMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 32));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= m.packed.size(); i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(m.packed.data() + i, &x, 8);
  }
  for (size_t i = 0; i < m.scales.size(); ++i)
    m.scales[i] = static_cast<uint8_t>(120 + (i * 7) % 4);
  return m;
}

std::vector<Isa> Candidates(KernelSets sets) {
  if (!sets.automatic) return {CapIsa(sets.only)};
  std::vector<Isa> v;
  for (Isa isa : kSimdIsas) {
    if (CapIsa(isa) == isa) v.push_back(isa);
  }
  if (v.empty()) v.push_back(Isa::kScalar);
  return v;
}

// Seconds of one kernel at `tokens` tokens per expert over `rows` rows of m from `first`, in
// kBlockRows work items on the pool (as expert_ffn runs them).
double TimeKernel(const KernelTable& k, bool panel, const ProbeMatrix& m, int64_t first,
                  int64_t rows, int64_t tokens, ThreadPool* pool) {
  const int64_t ld_t = (tokens + 15) / 16 * 16;
  const int64_t slots =
      panel ? TokenMajorSlots(k, m.cols) * ld_t : ActivationSlots(k, m.cols) * tokens;
  // Activations: bf16 values in [-1, 1) (pairs of them in the BF16 layout's slots).
  std::vector<float> x(static_cast<size_t>(slots));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(static_cast<int>((i * 2654435761u) % 255) - 127) / 128.0f;
  }
  if (!panel && k.mx_layout == MxLayout::kBf16Pairs) {
    for (float& v : x) {
      const uint32_t pair = 0x3F003F00u | (static_cast<uint32_t>(std::abs(v) * 100) & 0x7F);
      std::memcpy(&v, &pair, 4);
    }
  }
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t ld_x = panel ? ld_t : ActivationSlots(k, m.cols);
  const auto start = Clock::now();
  pool->ParallelFor(blocks, [&](int64_t b) {
    const int64_t r0 = first + b * kBlockRows;
    const int64_t r1 = std::min(first + rows, r0 + kBlockRows);
    std::unique_ptr<float[]> out(new float[static_cast<size_t>(tokens * (r1 - r0))]);
    if (panel) {
      k.mxfp4_rows_tm(m.packed.data(), m.scales.data(), m.cols, r0, r1, x.data(), ld_x, tokens,
                      out.get(), r1 - r0);
    } else {
      k.mxfp4_rows(m.packed.data(), m.scales.data(), m.cols, r0, r1, x.data(), ld_x, tokens,
                   out.get(), r1 - r0);
    }
    volatile float sink = out[0];
    (void)sink;
  });
  return Since(start);
}

std::string Lower(const std::string& s) { return absl::AsciiStrToLower(s); }

bool HasPanel(Isa isa) { return KernelsFor(isa).mxfp4_rows_tm != nullptr; }

struct Key {
  bool automatic;
  int only;
  int64_t latent, intermediate;
  std::string dir;
  bool operator<(const Key& o) const {
    return std::tie(automatic, only, latent, intermediate, dir) <
           std::tie(o.automatic, o.only, o.latent, o.intermediate, o.dir);
  }
};

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("create ", tmp, ": ", std::strerror(errno)));
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = write(fd, p, left);
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat("write ", tmp, ": ", std::strerror(err)));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("sync ", tmp, ": ", std::strerror(errno)));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("rename to ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// The file's text, at most 1 MiB (a cache file is about 2 KB).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  }
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("read ", path, ": ", std::strerror(err)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1u << 20)) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": larger than 1 MiB"));
    }
  }
  close(fd);
  return text;
}

// The load average over the last minute (/proc/loadavg), -1 where unknown.
double LoadAverage() {
  auto text = ReadSmallFile("/proc/loadavg");
  double v = -1;
  if (!text.ok() || !absl::SimpleAtod(text->substr(0, text->find(' ')), &v)) return -1;
  return v;
}

bool SaysPinned(absl::string_view text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    if (kv.size() == 2 && absl::StripAsciiWhitespace(kv[0]) == "pinned" &&
        absl::StripAsciiWhitespace(kv[1]) == "true") {
      return true;
    }
  }
  return false;
}

}  // namespace

std::string KernelSetsName(KernelSets sets) { return sets.automatic ? "auto" : IsaName(sets.only); }

absl::StatusOr<KernelSets> ParseKernelSets(absl::string_view text) {
  if (text == "auto") return KernelSets{};
  auto isa = ParseIsa(text);
  if (!isa.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown CPU kernel set \"", text, "\"; use auto, ", kIsaNames.Choices(", ")));
  }
  return KernelSets{false, *isa};
}

KernelSets DefaultKernelSets() {
  if (const char* env = std::getenv("MOE_CPU_ISA"); env != nullptr && *env != '\0') {
    auto parsed = ParseKernelSets(env);
    if (parsed.ok()) return *parsed;
  }
  return KernelSets{};
}

std::string DefaultKernelCacheDir() {
  if (const char* env = std::getenv("MOE_KERNEL_CACHE"); env != nullptr && *env != '\0') {
    return std::string(env) == "off" ? "" : env;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg == '/') {
    return absl::StrCat(xdg, "/moe-serving");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home == '/') {
    return absl::StrCat(home, "/.cache/moe-serving");
  }
  return "";
}

std::string CpuModel() {
  std::string brand = "unknown CPU";
  int family = 0, model = 0;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000004u) {
    char text[49] = {};
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      unsigned r[4];
      __get_cpuid(0x80000002u + leaf, &r[0], &r[1], &r[2], &r[3]);
      std::memcpy(text + 16 * leaf, r, 16);
    }
    brand = std::string(absl::StripAsciiWhitespace(text));
  }
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    const int base_family = static_cast<int>((a >> 8) & 0xF);
    family = base_family + (base_family == 0xF ? static_cast<int>((a >> 20) & 0xFF) : 0);
    model = static_cast<int>((a >> 4) & 0xF);
    if (base_family == 0x6 || base_family == 0xF) model |= static_cast<int>((a >> 16) & 0xF) << 4;
  }
#endif
  return absl::StrCat(brand, " (family ", family, " model ", model, ")");
}

KernelTable ComposeKernels(Isa decode, Isa prefill, int64_t panel_from) {
  KernelTable t = KernelsFor(decode);
  const KernelTable& p = KernelsFor(prefill);
  t.mxfp4_rows_tm = p.mxfp4_rows_tm;
  t.tm_layout = p.tm_layout;
  t.tm_chunk = p.tm_chunk;
  t.panel_from = p.mxfp4_rows_tm != nullptr ? panel_from : kNoPanel;
  return t;
}

std::string KernelsName(const KernelTable& k) {
  if (k.mxfp4_rows_tm == nullptr || k.panel_from >= kNoPanel) return k.name;
  for (Isa isa : kSimdIsas) {
    const KernelTable& p = KernelsFor(isa);
    if (p.mxfp4_rows_tm == k.mxfp4_rows_tm && p.tm_layout == k.tm_layout &&
        p.tm_chunk == k.tm_chunk && p.mxfp4_rows_tm != KernelsFor(k.isa).mxfp4_rows_tm) {
      return absl::StrCat(k.name, "+", p.name);
    }
  }
  return k.name;
}

const KernelTable& ChosenKernels(int64_t latent, int64_t intermediate) {
  KernelChoiceOptions o;
  o.latent = latent;
  o.intermediate = intermediate;
  return ChooseKernels(o).table;
}

std::vector<KernelTiming> MeasureKernels(KernelSets sets, int64_t latent, int64_t intermediate,
                                         ThreadPool* pool) {
  std::unique_ptr<ThreadPool> own;
  if (pool == nullptr) {
    own = std::make_unique<ThreadPool>(0);
    pool = own.get();
  }
  // The served FC1 (cols = latent) and FC2 (cols = intermediate) shapes, each with enough rows
  // for half of the decode probe's bytes.
  std::vector<ProbeMatrix> mats;
  for (int64_t cols : {latent, intermediate}) {
    const int64_t padded = std::max<int64_t>(32, (cols + 31) / 32 * 32);
    const int64_t rows = std::max<int64_t>(kBlockRows, kDecodeBytes / 2 / (padded / 2));
    mats.push_back(RandomMatrix(rows / kBlockRows * kBlockRows, padded, mats.size() + 1));
  }
  std::vector<KernelTiming> out;
  int64_t offset = 0;
  for (Isa isa : Candidates(sets)) {
    const KernelTable& k = KernelsFor(isa);
    for (bool panel : {false, true}) {
      if (panel && k.mxfp4_rows_tm == nullptr) continue;
      for (int64_t tokens : kProbeTokens) {
        if (panel && tokens < 2) continue;
        std::vector<double> rates;
        for (int rep = 0; rep < kProbeReps; ++rep) {
          double seconds = 0, f = 0;
          for (const ProbeMatrix& m : mats) {
            const int64_t want =
                tokens == 1 ? m.rows
                            : static_cast<int64_t>(kProbeFlops / 2 / (2.0 * tokens * m.cols));
            // At least two work items per thread, so that every thread works as in serving.
            const int64_t least = 2 * kBlockRows * pool->size();
            const int64_t rows =
                std::min(m.rows, std::max<int64_t>(least, want / kBlockRows * kBlockRows));
            // A new offset each time, so that the weights come from memory, not the cache.
            offset = (offset + rows) % m.rows;
            const int64_t first = std::min(offset, m.rows - rows) / kBlockRows * kBlockRows;
            seconds += TimeKernel(k, panel, m, first, rows, tokens, pool);
            f += 2.0 * tokens * rows * m.cols;
          }
          rates.push_back(f / std::max(seconds, 1e-12));
        }
        // The median, and how far the repetitions around it spread (the fastest and the slowest
        // left out: one burst either way is not a disagreement).
        std::sort(rates.begin(), rates.end());
        const double median = rates[rates.size() / 2];
        const double spread = (rates[rates.size() - 2] - rates[1]) / median;
        out.push_back({isa, panel, tokens, median, spread});
      }
    }
  }
  return out;
}

KernelChoice DecideKernels(KernelSets sets, std::vector<KernelTiming> timings) {
  KernelChoice c;
  c.sets = sets;
  auto fps = [&](Isa isa, bool panel, int64_t tokens) {
    for (const KernelTiming& t : timings) {
      if (t.isa == isa && t.panel == panel && t.tokens == tokens) return t.flops_per_second;
    }
    return 0.0;
  };
  // Decode: least time per flop summed over 1-8 tokens (one token, the slowest, weighs most).
  const std::vector<Isa> candidates = Candidates(sets);
  double best = -1;
  for (Isa isa : candidates) {
    double cost = 0;
    for (int64_t t : {1, 2, 4, 8}) {
      const double f = fps(isa, false, t);
      cost += f > 0 ? 1.0 / f : 1e30;
    }
    if (best < 0 || cost < best) {
      best = cost;
      c.decode = isa;
    }
  }
  // Prefill: the fastest panel kernel at 64 and 128 tokens.
  best = -1;
  c.prefill = c.decode;
  for (Isa isa : candidates) {
    if (!HasPanel(isa)) continue;
    double cost = 0;
    for (int64_t t : {64, 128}) {
      const double f = fps(isa, true, t);
      cost += f > 0 ? 1.0 / f : 1e30;
    }
    if (best < 0 || cost < best) {
      best = cost;
      c.prefill = isa;
    }
  }
  // Sets that share one panel kernel (AVX-512 and AVX512-BF16 do) are one candidate: the decode
  // set's name is kept, whichever of them measured faster by noise.
  if (KernelsFor(c.prefill).mxfp4_rows_tm == KernelsFor(c.decode).mxfp4_rows_tm) {
    c.prefill = c.decode;
  }
  // The switch: the fewest tokens from which the panel beats the decode rows at every count.
  c.panel_from = kNoPanel;
  if (HasPanel(c.prefill)) {
    for (auto it = std::rbegin(kProbeTokens); it != std::rend(kProbeTokens); ++it) {
      if (*it < 2) break;
      const double panel = fps(c.prefill, true, *it), rows = fps(c.decode, false, *it);
      if (panel <= 0 || panel < rows) break;
      c.panel_from = *it;
    }
  }
  c.table = ComposeKernels(c.decode, c.prefill, c.panel_from);
  c.panel_from = c.table.panel_from;
  c.timings = std::move(timings);
  c.cpu = CpuModel();
  return c;
}

namespace {

// A measurement's steadiness: the worst disagreement in words ("" when none passes its bound)
// and how unsteady it is overall (the largest spread of any probe; infinite with an outlier
// count), by which the steadiest of several attempts is kept.
struct Disagreement {
  std::string why;
  double badness = 0;
};

Disagreement Judge(const std::vector<KernelTiming>& timings, double bound) {
  Disagreement d;
  double worst_by = 0;  // how far past its bound the worst spread is
  for (const KernelTiming& t : timings) {
    d.badness = std::max(d.badness, t.spread);
    if (t.spread > bound && t.spread / std::max(bound, 1e-9) > worst_by) {
      worst_by = t.spread / std::max(bound, 1e-9);
      d.why =
          absl::StrFormat("%s %s at %d tokens per expert: repetitions spread %.2f (bound %.2f)",
                          IsaName(t.isa), t.panel ? "panel" : "rows", t.tokens, t.spread, bound);
    }
  }
  // A count under half of both neighbours on its own curve: the kernel does not do that, a
  // neighbour's burst over the whole probe does. The first such count outranks every spread.
  for (const KernelTiming& t : timings) {
    const KernelTiming* left = nullptr;
    const KernelTiming* right = nullptr;
    for (const KernelTiming& u : timings) {
      if (u.isa != t.isa || u.panel != t.panel) continue;
      if (u.tokens < t.tokens && (left == nullptr || u.tokens > left->tokens)) left = &u;
      if (u.tokens > t.tokens && (right == nullptr || u.tokens < right->tokens)) right = &u;
    }
    if (left == nullptr || right == nullptr) continue;
    const double low = std::min(left->flops_per_second, right->flops_per_second);
    if (t.flops_per_second < 0.5 * low && !std::isinf(d.badness)) {
      d.badness = std::numeric_limits<double>::infinity();
      d.why = absl::StrFormat(
          "%s %s at %d tokens per expert: %.1f GFLOP/s, under half of both neighbours (%.1f, "
          "%.1f)",
          IsaName(t.isa), t.panel ? "panel" : "rows", t.tokens, t.flops_per_second / 1e9,
          left->flops_per_second / 1e9, right->flops_per_second / 1e9);
    }
  }
  return d;
}

}  // namespace

std::string ProbeDisagreement(const std::vector<KernelTiming>& timings, double bound) {
  return Judge(timings, bound).why;
}

std::string KernelChoice::Summary() const {
  std::string s = absl::StrCat("decode ", IsaName(decode));
  if (panel_from >= kNoPanel) {
    absl::StrAppend(&s, ", no panel kernel");
  } else {
    absl::StrAppend(&s, ", prefill ", IsaName(prefill), " from ", panel_from, " tokens per expert");
  }
  absl::StrAppend(&s, " (", KernelSetsName(sets), "; ", source);
  if (!path.empty()) absl::StrAppend(&s, " ", path);
  if (seconds > 0) absl::StrAppendFormat(&s, ", measured in %.2f s", seconds);
  absl::StrAppend(&s, ")");
  if (!steady) absl::StrAppend(&s, "; unsteady after ", attempts, " attempts: ", unsteady);
  if (!note.empty()) absl::StrAppend(&s, "; ", note);
  return s;
}

std::string KernelChoicePath(const std::string& dir, KernelSets sets, int64_t latent,
                             int64_t intermediate) {
  // The CPU model in the name as [a-z0-9-]: one directory can serve several CPU models.
  std::string cpu;
  for (char ch : Lower(CpuModel())) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9');
    if (ok) {
      cpu.push_back(ch);
    } else if (!cpu.empty() && cpu.back() != '-') {
      cpu.push_back('-');
    }
  }
  while (!cpu.empty() && cpu.back() == '-') cpu.pop_back();
  return absl::StrCat(dir, "/kernels-", cpu, "-", KernelSetsName(sets), "-d", latent, "-i",
                      intermediate, ".txt");
}

std::string FormatKernelChoice(const KernelChoice& c, int64_t latent, int64_t intermediate,
                               bool pinned) {
  std::string s =
      "# moe-serving CPU kernel choice (services/numerics/cpu/kernel_choice.h). Every process of\n"
      "# this machine reads it instead of measuring. Delete it to measure again; set\n"
      "# pinned = true to keep it (then it is never measured again, by any build).\n";
  absl::StrAppend(&s, "version = ", kKernelChoiceVersion, "\n");
  absl::StrAppend(&s, "cpu = ", c.cpu, "\n");
  absl::StrAppend(&s, "sets = ", KernelSetsName(c.sets), "\n");
  absl::StrAppend(&s, "shape = ", latent, " ", intermediate, "\n");
  absl::StrAppend(&s, "decode = ", IsaName(c.decode), "\n");
  absl::StrAppend(&s, "prefill = ", IsaName(c.prefill), "\n");
  absl::StrAppend(&s, "panel_from = ",
                  c.panel_from >= kNoPanel ? std::string("never") : absl::StrCat(c.panel_from),
                  "\n");
  absl::StrAppend(&s, "pinned = ", pinned ? "true" : "false", "\n");
  absl::StrAppendFormat(&s, "measured_seconds = %.3f\n", c.seconds);
  absl::StrAppend(&s, "measured_at = ", c.measured_at, "\n");
  absl::StrAppend(&s, "attempts = ", c.attempts, "\n");
  absl::StrAppend(&s, "steady = ", c.steady ? "true" : "false", "\n");
  if (!c.steady) {
    std::string why = c.unsteady;
    for (char& ch : why) {
      if (ch == '\n' || ch == '\r') ch = ' ';
    }
    absl::StrAppend(&s, "unsteady = ", why, "\n");
  }
  absl::StrAppendFormat(&s, "load_average = %.2f\n", c.load_average);
  absl::StrAppendFormat(&s, "read_gbps = %.1f\n", c.read_bytes_per_second / 1e9);
  absl::StrAppend(&s,
                  "# timing = set kernel tokens_per_expert GFLOP/s spread (median of the "
                  "repetitions; spread: second fastest minus second slowest, over the median)\n");
  for (const KernelTiming& t : c.timings) {
    absl::StrAppendFormat(&s, "timing = %s %s %d %.2f %.3f\n", IsaName(t.isa),
                          t.panel ? "panel" : "rows", t.tokens, t.flops_per_second / 1e9, t.spread);
  }
  return s;
}

absl::StatusOr<KernelChoice> ParseKernelChoice(absl::string_view text, KernelSets sets,
                                               int64_t latent, int64_t intermediate) {
  KernelChoice c;
  c.sets = sets;
  std::map<std::string, std::string> kv;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits('=', 1));
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": not key = value"));
    }
    const std::string key(absl::StripAsciiWhitespace(parts[0]));
    const std::string value(absl::StripAsciiWhitespace(parts[1]));
    if (key == "timing") {
      std::vector<std::string> f = absl::StrSplit(value, ' ', absl::SkipEmpty());
      KernelTiming t;
      absl::StatusOr<Isa> isa = absl::InvalidArgumentError("");
      const bool sized = f.size() == 4 || f.size() == 5;  // 4: files before the spread
      if (sized) isa = ParseIsa(f[0]);
      double gflops = 0;
      if (!sized || !isa.ok() || (f[1] != "rows" && f[1] != "panel") ||
          !absl::SimpleAtoi(f[2], &t.tokens) || t.tokens < 1 || t.tokens > 4096 ||
          !absl::SimpleAtod(f[3], &gflops) || !(gflops >= 0 && gflops < 1e7) ||
          (f.size() == 5 &&
           (!absl::SimpleAtod(f[4], &t.spread) || !(t.spread >= 0 && t.spread < 1e3)))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "line ", line_no, ": timing is \"set rows|panel tokens GFLOP/s [spread]\""));
      }
      t.isa = *isa;
      t.panel = f[1] == "panel";
      t.flops_per_second = gflops * 1e9;
      if (c.timings.size() >= 256) {
        return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": too many timings"));
      }
      c.timings.push_back(t);
      continue;
    }
    static const char* const kKeys[] = {
        "version",          "cpu",         "sets",     "shape",        "decode",
        "prefill",          "panel_from",  "pinned",   "steady",       "unsteady",
        "measured_seconds", "measured_at", "attempts", "load_average", "read_gbps"};
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": unknown key \"", key, "\""));
    }
    if (!kv.emplace(key, value).second) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": ", key, " twice"));
    }
  }
  for (const char* k : {"version", "cpu", "sets", "shape", "decode", "prefill", "panel_from"}) {
    if (kv.count(k) == 0) return absl::InvalidArgumentError(absl::StrCat("no ", k));
  }
  if (kv.count("pinned") != 0) {
    if (kv["pinned"] != "true" && kv["pinned"] != "false") {
      return absl::InvalidArgumentError("pinned is true or false");
    }
    c.pinned = kv["pinned"] == "true";
  }
  int version = 0;
  if (!absl::SimpleAtoi(kv["version"], &version)) {
    return absl::InvalidArgumentError("version is not a number");
  }
  if (version != kKernelChoiceVersion && !c.pinned) {
    return absl::FailedPreconditionError(
        absl::StrCat("kernel version ", version, ", this build's is ", kKernelChoiceVersion));
  }
  c.cpu = kv["cpu"];
  if (c.cpu != CpuModel() && !c.pinned) {
    return absl::FailedPreconditionError(absl::StrCat("measured on ", c.cpu));
  }
  if (kv["sets"] != KernelSetsName(sets)) {
    return absl::FailedPreconditionError(absl::StrCat("for sets ", kv["sets"]));
  }
  if (kv["shape"] != absl::StrCat(latent, " ", intermediate)) {
    return absl::FailedPreconditionError(absl::StrCat("for shape ", kv["shape"]));
  }
  auto decode = ParseIsa(kv["decode"]);
  auto prefill = ParseIsa(kv["prefill"]);
  if (!decode.ok() || !prefill.ok())
    return absl::InvalidArgumentError("decode or prefill: unknown set");
  for (Isa isa : {*decode, *prefill}) {
    if (CapIsa(isa) != isa) {
      return absl::FailedPreconditionError(
          absl::StrCat("set ", IsaName(isa), " is not on this CPU (", CpuModel(), ")"));
    }
    if (!sets.automatic && isa != CapIsa(sets.only)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "set ", IsaName(isa), " is not the one asked for (", KernelSetsName(sets), ")"));
    }
  }
  c.decode = *decode;
  c.prefill = *prefill;
  if (kv["panel_from"] == "never") {
    c.panel_from = kNoPanel;
  } else if (!absl::SimpleAtoi(kv["panel_from"], &c.panel_from) || c.panel_from < 1 ||
             c.panel_from > 4096) {
    return absl::InvalidArgumentError("panel_from is 1..4096 or never");
  }
  if (c.panel_from < kNoPanel && !HasPanel(c.prefill)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill set ", IsaName(c.prefill), " has no panel kernel"));
  }
  // What files before version 4 lack: steady, attempts, the machine at measurement time.
  if (kv.count("steady") != 0) {
    if (kv["steady"] != "true" && kv["steady"] != "false") {
      return absl::InvalidArgumentError("steady is true or false");
    }
    c.steady = kv["steady"] == "true";
    c.unsteady = kv["unsteady"];
  }
  if (kv.count("measured_at") != 0 &&
      (!absl::SimpleAtoi(kv["measured_at"], &c.measured_at) || c.measured_at < 0)) {
    return absl::InvalidArgumentError("measured_at is Unix seconds");
  }
  if (kv.count("attempts") != 0 &&
      (!absl::SimpleAtoi(kv["attempts"], &c.attempts) || c.attempts < 1 || c.attempts > 100)) {
    return absl::InvalidArgumentError("attempts is 1..100");
  }
  if (kv.count("load_average") != 0 && (!absl::SimpleAtod(kv["load_average"], &c.load_average) ||
                                        !(c.load_average >= -1 && c.load_average < 1e6))) {
    return absl::InvalidArgumentError("load_average is a number");
  }
  double gbps = 0;
  if (kv.count("read_gbps") != 0 &&
      (!absl::SimpleAtod(kv["read_gbps"], &gbps) || !(gbps >= 0 && gbps < 1e6))) {
    return absl::InvalidArgumentError("read_gbps is a number");
  }
  c.read_bytes_per_second = gbps * 1e9;
  c.table = ComposeKernels(c.decode, c.prefill, c.panel_from);
  return c;
}

namespace {

// Measured until the probes agree with themselves (at most o.max_attempts times; the steadiest
// attempt is kept), with the machine's state at the time.
KernelChoice MeasureChoice(const KernelChoiceOptions& o, const KernelSets& sets) {
  const auto start = Clock::now();
  std::unique_ptr<ThreadPool> own;
  ThreadPool* pool = o.pool;
  if (pool == nullptr) {
    own = std::make_unique<ThreadPool>(0);
    pool = own.get();
  }
  std::vector<KernelTiming> best;
  Disagreement best_judged;
  int attempts = 1;
  for (;; ++attempts) {
    std::vector<KernelTiming> t = MeasureKernels(sets, o.latent, o.intermediate, pool);
    Disagreement judged = Judge(t, o.spread_bound);
    if (!judged.why.empty()) {
      MOE_LOG_WARN("CPU kernel probe {} of {} unsteady: {}", attempts, o.max_attempts, judged.why);
    }
    const bool steady = judged.why.empty();
    if (attempts == 1 || judged.badness < best_judged.badness) {
      best = std::move(t);
      best_judged = std::move(judged);
    }
    if (steady || attempts >= o.max_attempts) break;
  }
  KernelChoice c = DecideKernels(sets, std::move(best));
  c.steady = best_judged.why.empty();
  c.unsteady = best_judged.why;
  c.attempts = attempts;
  c.load_average = LoadAverage();
  // 128 MiB (4x the last-level cache of these machines), the better of 2 passes: ~0.05 s.
  c.read_bytes_per_second = MeasureReadBandwidth(pool, int64_t{128} << 20, 2);
  c.measured_at = static_cast<int64_t>(std::time(nullptr));
  c.seconds = Since(start);
  c.source = "measured";
  return c;
}

}  // namespace

const KernelChoice& ChooseKernels(const KernelChoiceOptions& o) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<KernelChoice>>* memo =
      new std::map<Key, std::unique_ptr<KernelChoice>>();
  KernelSets sets = o.sets;
  if (!sets.automatic) sets.only = CapIsa(sets.only);
  const Key key{sets.automatic, static_cast<int>(sets.only), o.latent, o.intermediate, o.cache_dir};
  std::lock_guard<std::mutex> lock(mu);
  auto it = memo->find(key);
  if (it != memo->end()) return *it->second;

  KernelChoice c;
  const bool single = !sets.automatic && !HasPanel(sets.only);
  if (single) {
    // One set without a panel kernel (scalar): nothing to choose.
    c = DecideKernels(sets, {});
    c.source = "only set";
  } else if (o.cache_dir.empty()) {
    c = MeasureChoice(o, sets);
    c.note = "no cache directory (MOE_KERNEL_CACHE=off or no HOME)";
  } else {
    const std::string path = KernelChoicePath(o.cache_dir, sets, o.latent, o.intermediate);
    // mkdir -p of the directory (each component; existing ones are fine).
    for (size_t pos = 1; pos != std::string::npos;) {
      pos = o.cache_dir.find('/', pos + 1);
      mkdir(o.cache_dir.substr(0, pos).c_str(), 0755);
    }
    // One process measures at a time; the others wait for its file (a pinned, read-only
    // directory has no lock: the file is read as it is).
    const int lock_fd =
        open((o.cache_dir + "/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    const int lock_errno = errno;
    if (lock_fd >= 0) flock(lock_fd, LOCK_EX);
    auto text = ReadSmallFile(path);
    absl::StatusOr<KernelChoice> cached = absl::NotFoundError("");
    if (text.ok()) cached = ParseKernelChoice(*text, sets, o.latent, o.intermediate);
    const int64_t now = static_cast<int64_t>(std::time(nullptr));
    if (cached.ok() && !cached->steady && !cached->pinned &&
        now - cached->measured_at > kUnsteadyKeepSeconds) {
      cached = absl::FailedPreconditionError(absl::StrCat("an unsteady measurement of ",
                                                          now - cached->measured_at, " s ago (",
                                                          cached->unsteady, ")"));
    }
    if (cached.ok()) {
      c = std::move(*cached);
      c.source = c.pinned ? "pinned" : "cache";
    } else {
      const bool pinned = text.ok() && SaysPinned(*text);
      c = MeasureChoice(o, sets);
      if (text.ok()) {
        c.note = absl::StrCat(pinned ? "pinned file not usable, kept: " : "replaced a file: ",
                              cached.status().message());
      } else if (!absl::IsNotFound(text.status())) {
        c.note = std::string(text.status().message());
      }
      if (!pinned) {
        const absl::Status w =
            lock_fd >= 0 ? WriteFileAtomically(path, FormatKernelChoice(c, o.latent, o.intermediate,
                                                                        /*pinned=*/false))
                         : absl::InternalError(absl::StrCat("cannot lock ", o.cache_dir, ": ",
                                                            std::strerror(lock_errno)));
        if (!w.ok()) {
          absl::StrAppend(&c.note, c.note.empty() ? "" : "; ", "not cached: ", w.message());
        }
      }
    }
    c.path = path;
    if (lock_fd >= 0) close(lock_fd);  // releases the lock
  }
  c.sets = sets;
  if (c.note.empty() && c.steady) {
    MOE_LOG_INFO("CPU kernels: {}", c.Summary());
  } else {
    MOE_LOG_WARN("CPU kernels: {}", c.Summary());
  }
  auto& slot = (*memo)[key];
  slot = std::make_unique<KernelChoice>(std::move(c));
  return *slot;
}

}  // namespace moe::numerics::cpu
