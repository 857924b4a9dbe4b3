// Row loops compiled for several x86 levels in one binary: MOE_SIMD_CLONES on a function makes
// GCC emit an AVX-512 (x86-64-v4), an AVX2 and a baseline copy and pick one when the program
// loads, by the CPU (ifunc). For the short elementwise loops of routing and Quantile Balancing
// (adds, subtracts, compares, float -> double, floor), written in fixed blocks of 16 so that -O2
// vectorizes them; every copy computes the same IEEE results (no contraction: -ffp-contract=off).
// The CPU backend's kernels (numerics/cpu) are hand-written per ISA instead: their instructions
// were chosen by measurement.
//
//   MOE_SIMD_CLONES void AddRow(const float* a, const float* b, int64_t n, float* out);
//   if (SimdAvx512()) { ... } else { ... }
#ifndef MOE_SERVICES_NUMERICS_SIMD_CLONES_H_
#define MOE_SERVICES_NUMERICS_SIMD_CLONES_H_

#include <cstdlib>
#include <cstring>

#include "services/tensor/simd_clones.h"  // MOE_SIMD_CLONES

namespace moe::numerics {

// Whether the hand-written AVX-512 paths of routing and QB (compress stores, mask registers) may
// run: the CPU has AVX-512 F, BW, DQ and VL, and MOE_CPU_ISA, when set, names an AVX-512 set (the
// benchmark measures the portable paths on this machine with MOE_CPU_ISA=avx2).
inline bool SimdAvx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl")) {
      return false;
    }
    const char* env = std::getenv("MOE_CPU_ISA");
    return env == nullptr || *env == '\0' || std::strncmp(env, "avx512", 6) == 0 ||
           std::strcmp(env, "auto") == 0;
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_SIMD_CLONES_H_
