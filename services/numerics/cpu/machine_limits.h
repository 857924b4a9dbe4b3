// This machine's limits, measured where the kernels run: the streaming read bandwidth of main
// memory and the fp32 multiply-add peak of one instruction set, both with every thread of a
// pool. tests/bench/cpu_layer_bench prints its figures next to them; expert-svc measures them
// once at start (bounded, well under a second) and exports what its kernels achieve as
// fractions of them.
//
//   ThreadPool pool(2);
//   const cpu::MachineLimits lim = cpu::MeasureMachineLimits(cpu::KernelsFor(isa), &pool, {});
//   // lim.read_bytes_per_second, lim.fma_flops_per_second
#ifndef MOE_SERVICES_NUMERICS_CPU_MACHINE_LIMITS_H_
#define MOE_SERVICES_NUMERICS_CPU_MACHINE_LIMITS_H_

#include <cstdint>

#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {

struct LimitsOptions {
  // The read probe's buffer: larger than the last-level cache, or it measures the cache.
  int64_t read_bytes = int64_t{1} << 30;
  int read_passes = 5;       // the best of these
  double fma_seconds = 0.1;  // per FMA pass (the best of 3)
};

struct MachineLimits {
  double read_bytes_per_second = 0;
  double fma_flops_per_second = 0;  // of the table's ISA, 2 flops per multiply-add lane
  Isa isa = Isa::kScalar;
  int threads = 0;
  double seconds = 0;  // time the measurement took
};

// Streaming read of options.read_bytes (first touched by the reading threads) and the table's
// fma_probe, each on all of pool's threads at once.
MachineLimits MeasureMachineLimits(const KernelTable& k, ThreadPool* pool,
                                   const LimitsOptions& options);

// The parts alone (the benchmark reports them separately).
double MeasureReadBandwidth(ThreadPool* pool, int64_t bytes, int passes);
double MeasureFmaPeak(const KernelTable& k, ThreadPool* pool, double seconds);
// The vdpbf16ps peak (KernelTable::dot_probe of the AVX512-BF16 set) on all of pool's threads;
// 0 where the CPU has no AVX512-BF16.
double MeasureBf16DotPeak(ThreadPool* pool, double seconds);

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_MACHINE_LIMITS_H_
