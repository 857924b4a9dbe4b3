#include "services/numerics/router.h"

// GCC 12 flags its own AVX-512 headers (_mm512_undefined_*: "may be used uninitialized").
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <functional>
#include <limits>

#include "services/numerics/linear.h"
#include "services/numerics/simd_clones.h"
#include "services/numerics/situ.h"

namespace moe::numerics {

namespace {

// The insertion form: out[0, filled) is sorted in rank order. Candidates come in ascending
// index, so a candidate equal to an entry ranks below it: it enters only above strictly smaller
// values.
MOE_SIMD_CLONES void TopKInsert(const float* values, int64_t n, int64_t k, int32_t* out) {
  int64_t filled = 0;
  auto insert = [&](int64_t j) {
    const float v = values[j];
    int64_t p = filled < k ? filled : k - 1;
    while (p > 0 && values[out[p - 1]] < v) {
      out[p] = out[p - 1];
      --p;
    }
    out[p] = static_cast<int32_t>(j);
    if (filled < k) ++filled;
  };
  int64_t j = 0;
  for (; j < n && filled < k; ++j) insert(j);
  // Full: most values do not beat the k-th. Blocks of 16 are tested branch-free (the compiler
  // vectorizes the fixed-length compare); only a block holding a value above the k-th as it was
  // at the block's start is walked in order, each value against the k-th as it is then. The
  // k-th only grows, so a value the block test passes over would fail the walk too: the result
  // is the scalar loop's, ties included.
  constexpr int64_t kBlock = 16;
  for (; j + kBlock <= n; j += kBlock) {
    const float kth = values[out[k - 1]];
    int any = 0;
    for (int64_t x = 0; x < kBlock; ++x) any |= values[j + x] > kth;
    if (any == 0) continue;
    for (int64_t x = j; x < j + kBlock; ++x) {
      if (values[x] > values[out[k - 1]]) insert(x);
    }
  }
  for (; j < n; ++j) {
    if (values[j] > values[out[k - 1]]) insert(j);
  }
}

constexpr int64_t kGroups = 64;  // 4 interleaved blocks x 16 lanes

// The maxima of 64 disjoint groups of a row's first `blocks` blocks of 16 (blocks >= 4): value j
// belongs to group (block % 4) * 16 + lane, block = j / 16, lane = j % 16.
void GroupMaximaScalar(const float* values, int64_t blocks, float* maxima) {
  float m[kGroups];
  for (int64_t g = 0; g < kGroups; ++g) m[g] = values[g];
  for (int64_t b = 4; b < blocks; ++b) {
    for (int64_t x = 0; x < 16; ++x) {
      const float v = values[b * 16 + x];
      float& dst = m[(b % 4) * 16 + x];
      dst = v > dst ? v : dst;
    }
  }
  std::copy(m, m + kGroups, maxima);
}

// The indices j in [0, n) with values[j] >= floor, ascending.
int64_t AtLeastScalar(const float* values, int64_t n, float floor, int32_t* out) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    out[count] = static_cast<int32_t>(j);
    count += values[j] >= floor;
  }
  return count;
}

#if defined(__x86_64__)
// AVX-512: four running maxima (vmaxps keeps either operand on equal values; maxima are values
// either way), and the indices by compress-store of the mask.
__attribute__((target("avx512f"))) void GroupMaximaAvx512(const float* values, int64_t blocks,
                                                          float* maxima) {
  __m512 m[4];
  for (int a = 0; a < 4; ++a) m[a] = _mm512_loadu_ps(values + a * 16);
  int64_t b = 4;
  for (; b + 4 <= blocks; b += 4) {
    for (int a = 0; a < 4; ++a) m[a] = _mm512_max_ps(m[a], _mm512_loadu_ps(values + (b + a) * 16));
  }
  for (; b < blocks; ++b) m[b % 4] = _mm512_max_ps(m[b % 4], _mm512_loadu_ps(values + b * 16));
  for (int a = 0; a < 4; ++a) _mm512_storeu_ps(maxima + a * 16, m[a]);
}

__attribute__((target("avx512f"))) int64_t AtLeastAvx512(const float* values, int64_t n,
                                                         float floor, int32_t* out) {
  const __m512 f = _mm512_set1_ps(floor);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0, j = 0;
  for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) {
    const __mmask16 mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(values + j), f, _CMP_GE_OQ);
    if (mask == 0) continue;
    // Compressed in registers and stored whole (a compress to memory is microcoded on Intel):
    // out has room for n + 16 (TopK's buffer).
    _mm512_storeu_si512(out + count, _mm512_maskz_compress_epi32(mask, idx));
    count += __builtin_popcount(mask);
  }
  for (; j < n; ++j) {
    out[count] = static_cast<int32_t>(j);
    count += values[j] >= floor;
  }
  return count;
}

// The k-th largest of the 64 maxima without branches (nth_element's comparisons mispredict on
// random data, about half of them): the largest value with at least k values at or above it.
__attribute__((target("avx512f"))) float KthOfMaximaAvx512(const float* maxima, int64_t k) {
  const __m512 m0 = _mm512_loadu_ps(maxima), m1 = _mm512_loadu_ps(maxima + 16);
  const __m512 m2 = _mm512_loadu_ps(maxima + 32), m3 = _mm512_loadu_ps(maxima + 48);
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < kGroups; ++i) {
    const __m512 v = _mm512_set1_ps(maxima[i]);
    const int count = __builtin_popcount(_mm512_cmp_ps_mask(m0, v, _CMP_GE_OQ)) +
                      __builtin_popcount(_mm512_cmp_ps_mask(m1, v, _CMP_GE_OQ)) +
                      __builtin_popcount(_mm512_cmp_ps_mask(m2, v, _CMP_GE_OQ)) +
                      __builtin_popcount(_mm512_cmp_ps_mask(m3, v, _CMP_GE_OQ));
    best = count >= k && maxima[i] > best ? maxima[i] : best;
  }
  return best;
}
#endif

}  // namespace

void TopK(const float* values, int64_t n, int64_t k, int32_t* out) {
  if (k <= 0) return;
  // Wide rows (a K3 router row: n 896, k 16 or 17): a floor first. The k-th largest of the 64
  // group maxima (disjoint groups, each non-empty) has k values at or above it, so every value of
  // the top k is at or above it too; the values at or above it (a few dozen) are then inserted in
  // ascending index as the insertion form would, the same rule (value descending, then index
  // ascending), so the same result, ties included.
  const int64_t blocks = n / 16;
  if (blocks < 8 || k > kGroups / 2) {
    TopKInsert(values, n, k, out);
    return;
  }
  float maxima[kGroups];
  const bool avx512 = SimdAvx512();
  float floor;
#if defined(__x86_64__)
  if (avx512) {
    GroupMaximaAvx512(values, blocks, maxima);
    floor = KthOfMaximaAvx512(maxima, k);
  } else {
    GroupMaximaScalar(values, blocks, maxima);
    std::nth_element(maxima, maxima + (k - 1), maxima + kGroups, std::greater<float>());
    floor = maxima[k - 1];
  }
#else
  GroupMaximaScalar(values, blocks, maxima);
  std::nth_element(maxima, maxima + (k - 1), maxima + kGroups, std::greater<float>());
  floor = maxima[k - 1];
#endif
  thread_local std::vector<int32_t> cand;
  if (static_cast<int64_t>(cand.size()) < n + 16) cand.resize(static_cast<size_t>(n + 16));
#if defined(__x86_64__)
  const int64_t count = avx512 ? AtLeastAvx512(values, n, floor, cand.data())
                               : AtLeastScalar(values, n, floor, cand.data());
#else
  const int64_t count = AtLeastScalar(values, n, floor, cand.data());
#endif
  int64_t filled = 0;
  for (int64_t c = 0; c < count; ++c) {
    const int32_t j = cand[c];
    const float v = values[j];
    if (filled == k && !(v > values[out[k - 1]])) continue;
    int64_t p = filled < k ? filled : k - 1;
    while (p > 0 && values[out[p - 1]] < v) {
      out[p] = out[p - 1];
      --p;
    }
    out[p] = j;
    if (filled < k) ++filled;
  }
}

Routing SelectExperts(const float* scores, const float* bias, int64_t tokens, int64_t num_experts,
                      int64_t top_k, bool renormalize, float scaling_factor) {
  Routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.expert_ids.resize(static_cast<size_t>(tokens * top_k));
  r.weights.resize(static_cast<size_t>(tokens * top_k));
  std::vector<int32_t> order(static_cast<size_t>(top_k));
  std::vector<float> biased(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores + t * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) biased[e] = s[e] + (bias ? bias[e] : 0.0f);
    TopK(biased.data(), num_experts, top_k, order.data());
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += s[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = order[j];
      r.expert_ids[t * top_k + j] = e;
      r.weights[t * top_k + j] = RouterWeight(s[e], sum, renormalize, scaling_factor);
    }
  }
  return r;
}

std::vector<std::vector<int64_t>> PairsByExpert(const Routing& routing, int64_t num_experts) {
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(num_experts));
  for (int64_t p = 0; p < routing.tokens * routing.top_k; ++p) {
    const int32_t e = routing.expert_ids[p];
    if (e >= 0) pairs[e].push_back(p);  // a negative id: a slot the budget dropped (dynamic_k.h)
  }
  return pairs;
}

namespace ref {

void RouterScores(const tensor::Bf16* x, int64_t tokens, int64_t hidden, const tensor::Bf16* gate,
                  int64_t num_experts, float* scores) {
  LinearF32(x, tokens, hidden, gate, num_experts, scores);
  for (int64_t i = 0; i < tokens * num_experts; ++i) scores[i] = Sigmoid(scores[i]);
}

}  // namespace ref
}  // namespace moe::numerics
