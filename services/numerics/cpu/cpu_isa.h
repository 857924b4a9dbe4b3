// Runtime CPU dispatch: which instruction sets the CPU has (CPUID). Which of them the kernels
// use is measured (kernel_choice.h); MOE_CPU_ISA restricts that to one. The shipped binary is
// built for baseline x86-64; only the kernel files are compiled for AVX2 / AVX-512 and they run
// only after this check.
//
//   const cpu::Isa best = cpu::DetectIsa();  // kAvx512Bf16 on this project's Xeon
#ifndef MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_
#define MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/common/enum_names.h"

namespace moe::numerics::cpu {

// Ordered: each level includes the ones below it. kAvx512Bf16 adds vdpbf16ps (AVX512_BF16),
// kAvx512Amx the AMX tile unit with bf16 (AMX-TILE, AMX-BF16: Intel Sapphire Rapids and later).
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAvx512Amx = 4 };

// The SIMD sets, lowest first (every set above scalar; DetectIsa() says which this CPU has).
inline constexpr Isa kSimdIsas[] = {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx};

inline constexpr EnumNames<Isa, 5> kIsaNames{"CPU ISA",
                                             {{{Isa::kScalar, "scalar"},
                                               {Isa::kAvx2, "avx2"},
                                               {Isa::kAvx512, "avx512"},
                                               {Isa::kAvx512Bf16, "avx512bf16"},
                                               {Isa::kAvx512Amx, "avx512amx"}}}};
inline const char* IsaName(Isa isa) { return kIsaNames.Name(isa); }
inline absl::StatusOr<Isa> ParseIsa(absl::string_view name) { return kIsaNames.Parse(name); }
// The best the CPU supports (AVX2 needs FMA too; AVX-512 needs F, BW, DQ, VL; AMX needs the
// OS to keep the tile state and to grant this process its use, which DetectIsa asks for once).
Isa DetectIsa();
// `wanted`, lowered to DetectIsa() when the CPU lacks it.
Isa CapIsa(Isa wanted);

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_CPU_ISA_H_
