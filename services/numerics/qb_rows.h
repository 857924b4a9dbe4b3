// The per-token row loops of Quantile Balancing (qb.cc): the biased scores with a finiteness
// check, the finiteness scan, the exact step's margin filter and the histogram's binning. Each has
// a hand-written AVX-512 form (mask registers, compress) and a portable form compiled for
// AVX-512, AVX2 and baseline (simd_clones.h); both compute the same IEEE results, and
// SimdAvx512() picks (MOE_CPU_ISA=avx2 runs the portable ones). Internal to qb.cc.
//
//   if (!qb_rows::AddRowChecked(s, bias, n, biased)) { /* a score is NaN or Inf */ }
#ifndef MOE_SERVICES_NUMERICS_QB_ROWS_H_
#define MOE_SERVICES_NUMERICS_QB_ROWS_H_

#include <cstdint>
#include <memory>

namespace moe::numerics::qb_rows {

// Margins kept by the exact step's filter, as (column, value) pairs in token order: one flat
// buffer per thread (no allocation per column), grouped by column at the end.
struct KeptMargins {
  std::unique_ptr<int32_t[]> column;
  std::unique_ptr<float[]> value;
  int64_t size = 0, capacity = 0;
  // Room for `more` pairs past size.
  void Reserve(int64_t more);
};

// out = a + b (elementwise), and whether every a is finite.
bool AddRowChecked(const float* a, const float* b, int64_t n, float* out);
// Whether all of p[0, count) is finite.
bool Finite(const float* p, int64_t count);
// The margins s_j - cutoff of one token above threshold_j, appended to kept as (j, margin).
void KeepAbove(const float* s, float cutoff, const float* threshold, int64_t n, KeptMargins* kept);
// The histogram bin of each expert's required bias alpha - s_j of one token:
// floor((r - lo) * inv_w) in double, clamped to [0, bins - 1].
void BinRow(const float* s, float alpha, double lo, double inv_w, int64_t bins, int64_t n,
            int32_t* out);

}  // namespace moe::numerics::qb_rows

#endif  // MOE_SERVICES_NUMERICS_QB_ROWS_H_
