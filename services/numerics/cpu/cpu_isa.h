// Runtime CPU dispatch: which instruction set the optimized CPU kernels use. Detected once from
// CPUID; MOE_CPU_ISA in the environment picks another (tests run every path on one machine). The
// shipped binary is built for baseline x86-64; only the kernel files are compiled for AVX2 /
// AVX-512 and they run only after this check.
//
//   const cpu::Isa isa = cpu::ActiveIsa();  // kAvx512 on this project's machines
#ifndef MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_
#define MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::numerics::cpu {

// Ordered: each level includes the ones below it. kAvx512Bf16 adds vdpbf16ps (AVX512_BF16).
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* IsaName(Isa isa);
absl::StatusOr<Isa> ParseIsa(absl::string_view name);
// The best the CPU supports (AVX2 needs FMA too; AVX-512 needs F, BW, DQ, VL).
Isa DetectIsa();
// `wanted`, lowered to DetectIsa() when the CPU lacks it.
Isa CapIsa(Isa wanted);
// The kernels to use: MOE_CPU_ISA (scalar, avx2, avx512, avx512bf16) when set, else the
// fastest measured here, which is kAvx512 even where AVX512_BF16 exists (vdpbf16ps issues at
// half the multiply-add rate of two FMA units: cpu_layer_bench); never above DetectIsa().
Isa ActiveIsa();

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_
