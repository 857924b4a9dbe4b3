#include "services/numerics/cpu/cpu_isa.h"

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace moe::numerics::cpu {

namespace {

// AMX-TILE and AMX-BF16 in CPUID, the tile state enabled by the OS (XCR0 bits 17 and 18), and
// the process's permission to use it (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM).
bool AmxUsable() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool bf16 = (d >> 22) & 1, tile = (d >> 24) & 1;
  if (!bf16 || !tile) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
  uint32_t xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if (((xcr0_lo >> 17) & 3) != 3) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

Isa DetectIsa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
    static const bool amx = AmxUsable();
    return amx ? Isa::kAvx512Amx : Isa::kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

Isa CapIsa(Isa wanted) {
  const Isa best = DetectIsa();
  return static_cast<int>(wanted) < static_cast<int>(best) ? wanted : best;
}

}  // namespace moe::numerics::cpu
