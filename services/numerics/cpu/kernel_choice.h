// Which CPU kernels a process runs, chosen by measurement on the CPU at hand (the kernel set
// that is fastest on one CPU is not on another: fp32 AVX-512 beats AVX512-BF16 on the Xeon of
// this project, the reverse on AMD Zen 4). For the expert shape it serves, a process times every
// kernel set the CPU has, the row (decode) kernels and the panel (prefill) kernels at 1 to 128
// tokens per expert, and picks
//  * the decode set: the fastest row kernels at 1-8 tokens per expert;
//  * the prefill set: the fastest panel kernel at 64-128 tokens per expert;
//  * panel_from: the fewest tokens per expert from which that panel kernel is faster than the
//    decode set's rows at every measured count above (no cliff where the switch happens).
// Each probe runs several times and keeps its median; a probe whose repetitions disagree beyond
// a bound, or a count far below both of its neighbours, makes the measurement unsteady (a
// neighbour's burst, not the kernel): it is measured again (up to 3 attempts, the steadiest
// kept), and a choice still unsteady is written marked so and measured again by the first
// process that starts an hour later. The file records the load average and the read
// bandwidth at measurement time.
// The choice is written to a cache file per CPU model and shape (MOE_KERNEL_CACHE, default
// $XDG_CACHE_HOME/moe-serving or ~/.cache/moe-serving), under a lock: every later process on
// this machine reads it instead of measuring, so all of them (the services and an in-process
// oracle alike) run the same kernels and agree bit for bit. An operator pins a choice by writing
// `pinned = true` in the file (then it is never re-measured, even by a newer build); a file of
// another CPU, another kernel version or a malformed one is measured again and replaced.
// MOE_CPU_ISA (or a service's --isa) restricts the choice to one set; its crossover is still
// measured.
//
//   KernelChoiceOptions o;
//   o.latent = cfg.latent;
//   o.intermediate = cfg.intermediate;
//   const KernelChoice& c = ChooseKernels(o);  // 0.6-1.8 s the first time (K3, 2 cores)
//   RunExperts(c.table, &pool, cfg, w, routing, z);
#ifndef MOE_SERVICES_NUMERICS_CPU_KERNEL_CHOICE_H_
#define MOE_SERVICES_NUMERICS_CPU_KERNEL_CHOICE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/cpu_isa.h"
#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {

// "auto" (every set the CPU has) or one set.
struct KernelSets {
  bool automatic = true;
  Isa only = Isa::kScalar;  // when !automatic (capped at what the CPU supports)
  bool operator==(const KernelSets& o) const {
    return automatic == o.automatic && (automatic || only == o.only);
  }
};
std::string KernelSetsName(KernelSets sets);
// auto | scalar | avx2 | avx512 | avx512bf16 | avx512amx
absl::StatusOr<KernelSets> ParseKernelSets(absl::string_view text);
// MOE_CPU_ISA when set (one set), else auto.
KernelSets DefaultKernelSets();

// Bumped whenever a kernel changes speed or results: files of another version are measured again.
// 2: the AMX set; 3: the AVX512-BF16 set's prefill on vdpbf16ps (the bf16 pair panel); 4: the
// panels' token passes, medians and steadiness; 5: the AVX512-BF16 decode rows' scales per 4
// chunks, plain loads of whole chunks in the AVX-512 rows (faster rows move the switch); 6: the
// rows prefetch into L1 and the panels the rows ahead (faster panels from DRAM at 32-64 tokens);
// 7: the AVX2 rows at 1-4 tokens scale partial sums once per chunk (faster AVX2 decode); 8: the
// AVX2 block scales from a 4-copy table (one shuffle instead of three per chunk).
inline constexpr int kKernelChoiceVersion = 8;
// A probe's repetitions may spread this much (second fastest minus second slowest of 5, over the
// median) before the measurement counts as unsteady. Measured on an idle 2-core Zen 4: 0.01-0.12.
inline constexpr double kProbeSpreadBound = 0.25;
// An unsteady choice on disk is used by processes that start within this many seconds of its
// measurement (every process of one start agrees), and measured again after.
inline constexpr int64_t kUnsteadyKeepSeconds = 3600;
inline constexpr int64_t kNoPanel = int64_t{1} << 40;  // panel_from when no panel kernel runs

// One probe: a kernel of one set at `tokens` tokens per expert on the served shape.
struct KernelTiming {
  Isa isa = Isa::kScalar;
  bool panel = false;  // mxfp4_rows_tm (prefill) or mxfp4_rows (decode)
  int64_t tokens = 0;
  double flops_per_second = 0;  // 2 per multiply-add, FC1 and FC2 shapes together: the median
  double spread = 0;            // of the repetitions (kProbeSpreadBound); 0 when not recorded
};

struct KernelChoice {
  KernelTable table;  // the decode set's table, the prefill set's panel kernel, panel_from
  Isa decode = Isa::kScalar;
  Isa prefill = Isa::kScalar;
  int64_t panel_from = kNoPanel;
  KernelSets sets;
  std::string cpu;     // the CPU model it was measured on (CpuModel())
  std::string source;  // "measured", "cache" or "pinned"
  std::string path;    // the cache file ("" without one)
  std::string note;    // why the cache was not used or written, when it was not
  bool pinned = false;
  std::vector<KernelTiming> timings;
  double seconds = 0;  // the measurement's time (0 when read from a file)
  // Steadiness: "" when the probes agreed with themselves, else the worst disagreement (then
  // `steady` is false); the attempts it took; the machine at measurement time (load average
  // over a minute, -1 unknown; streaming read bandwidth, 0 unknown); when (Unix seconds).
  bool steady = true;
  std::string unsteady;
  int attempts = 1;
  double load_average = -1;
  double read_bytes_per_second = 0;
  int64_t measured_at = 0;
  // One line for logs: "decode avx512, prefill avx512 from 16 tokens per expert (cache FILE)".
  std::string Summary() const;
};

// MOE_KERNEL_CACHE when set ("off": none), else $XDG_CACHE_HOME/moe-serving, else
// $HOME/.cache/moe-serving, else none.
std::string DefaultKernelCacheDir();

struct KernelChoiceOptions {
  KernelSets sets = DefaultKernelSets();
  int64_t latent = 0;                               // FC1 columns (the served model's latent width)
  int64_t intermediate = 0;                         // FC2 columns
  std::string cache_dir = DefaultKernelCacheDir();  // "": measure, no file
  ThreadPool* pool = nullptr;                       // probe threads (null: a pool of all cores)
  double spread_bound = kProbeSpreadBound;          // tests set 0 to see the unsteady path
  int max_attempts = 3;
};

// The choice for these options, measured or read once per process (later calls with the same
// sets, shape and directory return the same object). Never fails: a cache that cannot be read or
// written is logged and the measured choice is used.
const KernelChoice& ChooseKernels(const KernelChoiceOptions& options);

// The parts, for tests and tools.
// Times every candidate set at the shape (bounded: under a second on 2 cores at the K3 shape).
std::vector<KernelTiming> MeasureKernels(KernelSets sets, int64_t latent, int64_t intermediate,
                                         ThreadPool* pool);
// The choice a set of timings implies (decode, prefill, panel_from; table filled in).
KernelChoice DecideKernels(KernelSets sets, std::vector<KernelTiming> timings);
// "" when the timings agree with themselves, else the worst disagreement in words: a probe whose
// repetitions spread more than `bound`, or a count under half of both neighbours of its curve
// (a set's rows or panel over tokens per expert).
std::string ProbeDisagreement(const std::vector<KernelTiming>& timings, double bound);
// The cache file's text and its strict parser (`cpu` and `shape` must match unless pinned; a set
// the CPU lacks, an unknown key or a malformed line is an error naming the line).
std::string FormatKernelChoice(const KernelChoice& c, int64_t latent, int64_t intermediate,
                               bool pinned);
absl::StatusOr<KernelChoice> ParseKernelChoice(absl::string_view text, KernelSets sets,
                                               int64_t latent, int64_t intermediate);
// The file of a choice inside a cache directory.
std::string KernelChoicePath(const std::string& dir, KernelSets sets, int64_t latent,
                             int64_t intermediate);
// "Intel(R) Xeon(R) Processor (family 6 model 167)", from CPUID.
std::string CpuModel();
// The composite table: `decode`'s kernels with `prefill`'s panel kernel from panel_from tokens.
KernelTable ComposeKernels(Isa decode, Isa prefill, int64_t panel_from);
// "avx512", or "avx512bf16+avx512" when the panel kernel is another set's (backend names).
std::string KernelsName(const KernelTable& k);
// The kernels every process of this machine runs for an expert shape (ChooseKernels with the
// default sets and cache): what an in-process oracle compares a service with.
const KernelTable& ChosenKernels(int64_t latent, int64_t intermediate);

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_KERNEL_CHOICE_H_
