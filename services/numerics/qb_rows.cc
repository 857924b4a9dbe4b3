#include "services/numerics/qb_rows.h"

// GCC 12 flags its own AVX-512 headers (_mm512_undefined_*: "may be used uninitialized").
#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "services/numerics/simd_clones.h"

namespace moe::numerics::qb_rows {
namespace {

constexpr int64_t kBlock = 16;

// The portable forms (compiled for AVX-512, AVX2 and baseline; MOE_SIMD_CLONES).

// KeepAbove's values [j, n) one at a time (a row's tail past its last block of 16); the new size.
inline int64_t KeepTail(const float* s, float cutoff, const float* threshold, int64_t j, int64_t n,
                        int32_t* col, float* val, int64_t size) {
  for (; j < n; ++j) {
    const float v = s[j] - cutoff;
    col[size] = static_cast<int32_t>(j);
    val[size] = v;
    size += v > threshold[j];
  }
  return size;
}

// out = a + b, and whether every a is finite (a NaN or Inf in a lane's sum of a - a).
MOE_SIMD_CLONES bool AddRowCheckedPortable(const float* a, const float* b, int64_t n, float* out) {
  float lanes[kBlock] = {};
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    for (int64_t x = 0; x < kBlock; ++x) {
      out[j + x] = a[j + x] + b[j + x];
      lanes[x] += a[j + x] - a[j + x];
    }
  }
  uint32_t bad = 0;
  for (int64_t x = 0; x < kBlock; ++x) bad |= static_cast<uint32_t>(lanes[x] != 0.0f);
  for (; j < n; ++j) {
    out[j] = a[j] + b[j];
    bad |= static_cast<uint32_t>(!std::isfinite(a[j]));
  }
  return bad == 0;
}

// Whether all of p[0, count) is finite: x - x is 0 for a finite x and NaN for NaN or Inf, and
// a NaN stays in its lane's sum (16 independent lanes: it vectorizes).
MOE_SIMD_CLONES bool FinitePortable(const float* p, int64_t count) {
  float lanes[kBlock] = {};
  int64_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    for (int64_t x = 0; x < kBlock; ++x) lanes[x] += p[i + x] - p[i + x];
  }
  uint32_t bad = 0;
  for (int64_t x = 0; x < kBlock; ++x) bad |= static_cast<uint32_t>(lanes[x] != 0.0f);
  for (; i < count; ++i) bad |= static_cast<uint32_t>(!std::isfinite(p[i]));
  return bad == 0;
}

// The margins s_j - cutoff of one token above their column's threshold, appended to kept;
// blocks of 16 tested branch-free first (few pass).
MOE_SIMD_CLONES void KeepAbovePortable(const float* s, float cutoff, const float* threshold,
                                       int64_t n, KeptMargins* kept) {
  kept->Reserve(n);
  int32_t* col = kept->column.get();
  float* val = kept->value.get();
  int64_t size = kept->size, j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    float margin[kBlock];
    int any = 0;
    for (int64_t x = 0; x < kBlock; ++x) {
      margin[x] = s[j + x] - cutoff;
      any |= margin[x] > threshold[j + x];
    }
    if (any == 0) continue;
    for (int64_t x = 0; x < kBlock; ++x) {
      col[size] = static_cast<int32_t>(j + x);
      val[size] = margin[x];
      size += margin[x] > threshold[j + x];
    }
  }
  kept->size = KeepTail(s, cutoff, threshold, j, n, col, val, size);
}

// The histogram bin of each expert's required bias alpha - s_j of one token:
// floor((r - lo) * inv_w) in double, clamped to [0, bins - 1].
MOE_SIMD_CLONES void BinRowPortable(const float* s, float alpha, double lo, double inv_w,
                                    int64_t bins, int64_t n, int32_t* out) {
  const double top = static_cast<double>(bins - 1);
  auto bin = [&](float v) {
    const float r = alpha - v;  // required bias; exactly -(s - alpha)
    double pos = std::floor((static_cast<double>(r) - lo) * inv_w);
    pos = pos < 0.0 ? 0.0 : pos;
    pos = pos > top ? top : pos;
    return static_cast<int32_t>(pos);
  };
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    for (int64_t x = 0; x < kBlock; ++x) out[j + x] = bin(s[j + x]);
  }
  for (; j < n; ++j) out[j] = bin(s[j]);
}

#if defined(__x86_64__)
// The AVX-512 forms: the same operations in the same precision (separate subtract and multiply,
// no contraction), so the same results; mask registers and compress stores where the portable
// forms walk a block.
#define MOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

MOE_AVX512 bool AddRowCheckedAvx512(const float* a, const float* b, int64_t n, float* out) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    // The token two rows on (a prefetch never faults, also past the end).
    _mm_prefetch(reinterpret_cast<const char*>(a + j + 2 * n), _MM_HINT_T0);
    const __m512 v = _mm512_loadu_ps(a + j);
    _mm512_storeu_ps(out + j, _mm512_add_ps(v, _mm512_loadu_ps(b + j)));
    acc = _mm512_add_ps(acc, _mm512_sub_ps(v, v));
  }
  bool ok = _mm512_cmp_ps_mask(acc, _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0;
  for (; j < n; ++j) {
    out[j] = a[j] + b[j];
    ok &= std::isfinite(a[j]);
  }
  return ok;
}

MOE_AVX512 bool FiniteAvx512(const float* p, int64_t count) {
  __m512 acc[4];
  for (int x = 0; x < 4; ++x) acc[x] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= count; i += 64) {
    for (int x = 0; x < 4; ++x) {
      const __m512 v = _mm512_loadu_ps(p + i + 16 * x);
      acc[x] = _mm512_add_ps(acc[x], _mm512_sub_ps(v, v));
    }
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  bool ok = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0;
  for (; i < count; ++i) ok &= std::isfinite(p[i]);
  return ok;
}

MOE_AVX512 void KeepAboveAvx512(const float* s, float cutoff, const float* threshold, int64_t n,
                                KeptMargins* kept) {
  kept->Reserve(n + 16);  // whole-vector stores past the kept ones
  int32_t* col = kept->column.get();
  float* val = kept->value.get();
  int64_t size = kept->size, j = 0;
  const __m512 c = _mm512_set1_ps(cutoff);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 margin = _mm512_sub_ps(_mm512_loadu_ps(s + j), c);
    const __mmask16 mask = _mm512_cmp_ps_mask(margin, _mm512_loadu_ps(threshold + j), _CMP_GT_OQ);
    if (mask == 0) continue;
    // Compressed in registers and stored whole (a compress to memory is microcoded on Intel):
    // the lanes past the count are overwritten by the next store or lie past size.
    _mm512_storeu_si512(col + size, _mm512_maskz_compress_epi32(mask, idx));
    _mm512_storeu_ps(val + size, _mm512_maskz_compress_ps(mask, margin));
    size += __builtin_popcount(mask);
  }
  kept->size = KeepTail(s, cutoff, threshold, j, n, col, val, size);
}

// 8 bins from 8 required biases r (as in BinRowPortable).
MOE_AVX512 inline void Bin8Avx512(__m256 r, __m512d lo, __m512d inv_w, __m512d top, int32_t* out) {
  __m512d pos = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(r), lo), inv_w);
  pos = _mm512_roundscale_pd(pos, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  pos = _mm512_min_pd(_mm512_max_pd(pos, _mm512_setzero_pd()), top);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvttpd_epi32(pos));
}

MOE_AVX512 void BinRowAvx512(const float* s, float alpha, double lo, double inv_w, int64_t bins,
                             int64_t n, int32_t* out) {
  const __m512 a = _mm512_set1_ps(alpha);
  const __m512d l = _mm512_set1_pd(lo), w = _mm512_set1_pd(inv_w);
  const __m512d top = _mm512_set1_pd(static_cast<double>(bins - 1));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 r = _mm512_sub_ps(a, _mm512_loadu_ps(s + j));
    Bin8Avx512(_mm512_castps512_ps256(r), l, w, top, out + j);
    Bin8Avx512(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)), l, w, top,
               out + j + 8);
  }
  if (j < n) BinRowPortable(s + j, alpha, lo, inv_w, bins, n - j, out + j);
}
#endif

}  // namespace

void KeptMargins::Reserve(int64_t more) {
  if (size + more <= capacity) return;
  const int64_t cap = std::max(2 * capacity, size + more + 4096);
  std::unique_ptr<int32_t[]> c(new int32_t[static_cast<size_t>(cap)]);
  std::unique_ptr<float[]> v(new float[static_cast<size_t>(cap)]);
  if (size > 0) {
    std::memcpy(c.get(), column.get(), sizeof(int32_t) * size);
    std::memcpy(v.get(), value.get(), sizeof(float) * size);
  }
  column = std::move(c);
  value = std::move(v);
  capacity = cap;
}

bool AddRowChecked(const float* a, const float* b, int64_t n, float* out) {
#if defined(__x86_64__)
  if (SimdAvx512()) return AddRowCheckedAvx512(a, b, n, out);
#endif
  return AddRowCheckedPortable(a, b, n, out);
}

bool Finite(const float* p, int64_t count) {
#if defined(__x86_64__)
  if (SimdAvx512()) return FiniteAvx512(p, count);
#endif
  return FinitePortable(p, count);
}

void KeepAbove(const float* s, float cutoff, const float* threshold, int64_t n, KeptMargins* kept) {
#if defined(__x86_64__)
  if (SimdAvx512()) return KeepAboveAvx512(s, cutoff, threshold, n, kept);
#endif
  KeepAbovePortable(s, cutoff, threshold, n, kept);
}

void BinRow(const float* s, float alpha, double lo, double inv_w, int64_t bins, int64_t n,
            int32_t* out) {
#if defined(__x86_64__)
  if (SimdAvx512()) return BinRowAvx512(s, alpha, lo, inv_w, bins, n, out);
#endif
  BinRowPortable(s, alpha, lo, inv_w, bins, n, out);
}

}  // namespace moe::numerics::qb_rows
