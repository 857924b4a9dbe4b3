#include "services/numerics/cpu/cpu_isa.h"

#include "absl/strings/str_cat.h"

namespace moe::numerics::cpu {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kScalar:
      break;
  }
  return "scalar";
}

absl::StatusOr<Isa> ParseIsa(absl::string_view name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx512bf16") return Isa::kAvx512Bf16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown CPU ISA \"", name, "\"; use scalar, avx2, avx512 or avx512bf16"));
}

Isa DetectIsa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
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
