// The precision modes of the routed experts (docs/math.md section 6): W4A16, latent activations
// in bf16; W4A8, the expert inputs z and h quantized to MXFP8 (per token, blocks of 32 along the
// row) before the FC that reads them. A mode, not a format: a W4A8 batch may arrive with bf16
// rows (the server quantizes them) or MXFP8 rows (tensor/activations.h says which). Parsing a
// mode's name: precision.h (Abseil); this header stays Abseil-free for the standalone GPU check.
//
//   if (precision == Precision::kW4A8) ...;  PrecisionName(p) == "w4a8"
#ifndef MOE_SERVICES_NUMERICS_PRECISION_MODE_H_
#define MOE_SERVICES_NUMERICS_PRECISION_MODE_H_

namespace moe::numerics {

enum class Precision { kW4A16, kW4A8 };
// Each mode's name, indexed by the enum: the one place they are spelled (precision.h's
// kPrecisions table parses and lists them from here).
inline constexpr const char* kPrecisionNames[] = {"w4a16", "w4a8"};
inline const char* PrecisionName(Precision p) { return kPrecisionNames[static_cast<int>(p)]; }

// Where W4A8 quantizes h (docs/math.md section 6): from the fp32 SiTU output, as the deployed
// K3 stacks do (FlashInfer's MXFP8 reference, the fused SiTU + MXFP8 epilogues), the default; or
// after rounding it to bf16 first, this project's order before (expert-svc
// --w4a8_h_via_bf16). W4A16 always rounds h to bf16.
enum class W4A8H { kFromFp32, kViaBf16 };

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_PRECISION_MODE_H_
