// The named tolerances between an optimized backend and the scalar reference, and the one way
// outputs are compared against them: bf16 ulp distances counted over rows, with the hard bound
// stated at the scale of each row. The CPU consistency test and expert-svc's production check
// (expert-svc/batch_verifier.h) share them, so "within tolerance" means the same in both.
// Standard C++ only (no Abseil), so that code built by other compilers can include it.
//
//   UlpStats stats;
//   stats.AddRows(got.data(), want.data(), rows, width);
//   if (!stats.Within(kExpertFfnTolerance)) ...  // stats.Str() says by how much
#ifndef MOE_SERVICES_NUMERICS_TOLERANCE_H_
#define MOE_SERVICES_NUMERICS_TOLERANCE_H_

#include <cstdint>
#include <string>

#include "services/tensor/bf16.h"

namespace moe::numerics {

// Dense projections keep the reference's per-output order with exact products: bit-exact (no
// tolerance). MXFP4 rows: the same exact products summed in vector lanes then across lanes. Any
// two fp32 summation orders of n terms differ by at most about 2 n eps sum|w x| (eps = 2^-24).
inline constexpr double kMxfp4SumRelBound = 2.0 * 0x1p-24;

struct Tolerance {
  double max_row_ulps;        // every |got - want| <= this many bf16 ulps of its row's scale
  double over1_fraction;      // at most this fraction of outputs more than 1 ulp apart
  double differing_fraction;  // at most this fraction of outputs differing at all
  int max_ulp;                // every output within this many of its own ulps (-1: no bound)
};

// SiTU with vectorized exp/tanh (a few fp32 ulp from the correctly rounded reference) flips the
// final bf16 rounding only when the exact value sits within those ulps of a rounding midpoint:
// at most one bf16 ulp, on a small fraction of inputs.
inline constexpr Tolerance kSituTolerance = {1.0, 0.0, 2e-3, 1};
// Expert FFN: the lane-order sums move g, u and y by fp32 noise. Now and then that flips the
// bf16 rounding of one h element, which nudges every output of that (token, expert) by a
// fraction of an ulp and flips a few of their roundings. Outputs near zero (cancellation in the
// FC2 sum) can then differ by several of their own ulps, so the hard bound is stated at the
// scale of the row: |got - want| <= 2 bf16 ulps of the row's RMS (measured: 2).
inline constexpr Tolerance kExpertFfnTolerance = {2.0, 1e-3, 0.01, -1};
// Expert FFN in W4A8: the same fp32 noise, but an h that lands on the other side of an MXFP8
// rounding midpoint moves by a whole E4M3 step (2^-3 of its binade), and its block's scale can
// change with its amax: twice the W4A16 bound (measured on mid, every ISA here: 0 of 79,872
// outputs differ).
inline constexpr Tolerance kExpertFfnW4A8Tolerance = {4.0, 0.01, 0.05, -1};
// Whole layer: identical routing (the router is bit-exact). An h flip in one (token, expert)
// shifts that token's latent r by an ulp here and there, which RMSNorm and the up-projection
// spread over the token's whole output row as changes of about one ulp of the up-projection's
// terms; an output that is a small difference of large terms (inside o, or o + sh) then moves by
// several of its own ulps. Stated: at most 1% of the outputs more than 1 ulp apart, and every
// output within 8 ulps of its row scale (the larger RMS of out and sh): 8 ulps = 2^-5 of the
// RMS, hit only by those few outputs (measured: 4).
inline constexpr Tolerance kLayerTolerance = {8.0, 0.01, 0.05, -1};

// A tolerance's hard bound alone (every output within max_row_ulps of its row's scale), for
// checks of a few rows: the fractions above are stated over whole batches of the consistency
// suite, at its shapes (they grow with k x intermediate: at K3's 16 x 3072 the optimized layer
// puts 1.6-1.7% of its outputs more than 1 ulp from the scalar reference, 4.6% differing, and
// still within 4 ulps of the row scale; docs/math.md). The readiness canary and the twin audits
// judge with it: what they look for (other weights, a broken path) is off by the row's scale.
inline Tolerance HardBound(const Tolerance& t) { return {t.max_row_ulps, 1.0, 1.0, -1}; }

// |a - b| in bf16 ulps (ordered bit patterns; +0 and -0 are 0 apart).
int UlpDistance(tensor::Bf16 a, tensor::Bf16 b);
// The bf16 ulp at the magnitude of v: 2^(floor(log2 |v|) - 7).
double Bf16UlpAt(double v);

struct UlpStats {
  int64_t total = 0, differing = 0, over1 = 0;
  int max_ulp = 0;
  double max_row_ulps = 0;   // max |got - want| in bf16 ulps of the row scale
  int64_t worst_index = -1;  // the element where max_row_ulps was reached

  // got, want: `rows` rows of `width` values. The scale of a row is the RMS of want's row, or of
  // `scale_rows` (same shape; e.g. the layer's shared-expert output sh, since out = o + sh can be
  // much smaller than its summands) when that is larger.
  void AddRows(const tensor::Bf16* got, const tensor::Bf16* want, int64_t rows, int64_t width,
               const tensor::Bf16* scale_rows = nullptr);
  bool Within(const Tolerance& t) const;
  std::string Str() const;
};

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_TOLERANCE_H_
