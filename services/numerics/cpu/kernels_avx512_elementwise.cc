// The AVX-512 tables' elementwise kernels (SiTU, the MXFP8 round trip of W4A8's h) and their
// multiply-add peak probes, compiled with -mavx512* like kernels_avx512.cc and called only
// through the AVX-512 tables (kernels.h declares the entry points for that file alone).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {
namespace {

// ---------------------------------------------------------------- SiTU

inline __m512 RoundBf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// exp(x): n = round(x log2 e), r = x - n ln 2 (two-part ln 2), Taylor to r^7 (|r| <= 0.35:
// truncation below 1e-8 relative), times 2^n with vscalefps. Inputs clamped to [-104, 89], so
// results underflow to 0 (through subnormals) and overflow to +Inf where fp32 exp does: a tiny
// nonzero where the reference has 0 would be hundreds of bf16 ulps away.
inline __m512 Exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// tanh: odd Taylor polynomial to y^13 for |y| < 0.3 (error < 1e-10), else
// sign(y) (1 - 2 / (exp(2|y|) + 1)).
inline __m512 Tanh(__m512 y) {
  const __m512 a = _mm512_abs_ps(y);
  const __m512 y2 = _mm512_mul_ps(y, y);
  __m512 p = _mm512_set1_ps(21844.0f / 6081075.0f);
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-1382.0f / 155925.0f));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(62.0f / 2835.0f));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-17.0f / 315.0f));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(2.0f / 15.0f));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-1.0f / 3.0f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, y2), y, y);
  const __m512 e = Exp(_mm512_add_ps(a, a));
  __m512 big =
      _mm512_sub_ps(_mm512_set1_ps(1.0f),
                    _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  big = _mm512_or_ps(big, _mm512_and_ps(y, _mm512_set1_ps(-0.0f)));  // copy the sign of y
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.3f), _CMP_LT_OQ), big, small);
}

// kRound: the result rounded to bf16 (situ), else left in fp32 (situ_f32).
template <bool kRound>
void SituT(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* h) {
  const __m512 b1 = _mm512_set1_ps(beta), b2 = _mm512_set1_ps(linear_beta);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gv = RoundBf16(_mm512_maskz_loadu_ps(m, g + i));
    const __m512 uv = RoundBf16(_mm512_maskz_loadu_ps(m, u + i));
    const __m512 sig =
        _mm512_div_ps(one, _mm512_add_ps(one, Exp(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    const __m512 gate = _mm512_mul_ps(_mm512_mul_ps(b1, Tanh(_mm512_div_ps(gv, b1))), sig);
    const __m512 up = _mm512_mul_ps(b2, Tanh(_mm512_div_ps(uv, b2)));
    const __m512 hv = _mm512_mul_ps(gate, up);
    _mm512_mask_storeu_ps(h + i, m, kRound ? RoundBf16(hv) : hv);
  }
}

// 12 independent register-resident chains (2 ports x 4-6 cycles of latency) of vfmadd (16
// multiply-adds each) or, kDot, of vdpbf16ps (32 each); returns the flops done.
template <bool kDot>
double ChainProbe(int64_t iters) {
  __m512 acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  const __m512bh ha = (__m512bh)_mm512_set1_epi16(0x3f80), hb = (__m512bh)_mm512_set1_epi16(0x3a80);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12  // the accumulators must live in registers
    for (int i = 0; i < 12; ++i) {
      if constexpr (kDot) {
        acc[i] = _mm512_dpbf16_ps(acc[i], ha, hb);
      } else {
        acc[i] = _mm512_fmadd_ps(acc[i], a, b);
      }
    }
  }
  __m512 sum = acc[0];
#pragma GCC unroll 12
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return 2.0 * (kDot ? 32 : 16) * 12 * static_cast<double>(iters);
}

// ---------------------------------------------------------------- MXFP8 round trip (W4A8's h)

// The MXFP8 block exponent e of amax (finite, >= 0): the smallest e with amax <= 448 x 2^e,
// clamped to [-127, 127], from the bits (as in kernels_avx2.cc; each ISA file keeps its own
// copy: no inline code is shared across differently compiled files).
inline int Mxfp8Exponent(float amax) {
  uint32_t u;
  std::memcpy(&u, &amax, sizeof(u));
  const int biased = static_cast<int>(u >> 23);
  if (biased == 0) return -127;
  const int e = biased - 127 - 8 + ((u & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

inline float Pow2(int k) {
  const uint32_t u = k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// E4M3 rounding of 16 values already divided by the block scale (see kernels_avx2.cc).
inline __m512 RoundE4M3(__m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFFF)), lsb),
                       _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512 sub =
      _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(512.0f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                    _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 small =
      _mm512_cmp_ps_mask(_mm512_abs_ps(y), _mm512_set1_ps(1.0f / 64.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(small, _mm512_castsi512_ps(r), sub);
}

void RoundTripMxfp8(float* v, int64_t n) {
  for (int64_t b = 0; b < n; b += 32) {
    const __m512 x0 = _mm512_loadu_ps(v + b), x1 = _mm512_loadu_ps(v + b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const int e = amax > 0.0f ? Mxfp8Exponent(amax) : -127;
    const __m512 inv = _mm512_set1_ps(Pow2(-e)), scale = _mm512_set1_ps(Pow2(e));
    _mm512_storeu_ps(v + b, _mm512_mul_ps(RoundE4M3(_mm512_mul_ps(x0, inv)), scale));
    _mm512_storeu_ps(v + b + 16, _mm512_mul_ps(RoundE4M3(_mm512_mul_ps(x1, inv)), scale));
  }
}

}  // namespace

void Avx512Situ(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                float* h) {
  SituT<true>(g, u, n, beta, linear_beta, h);
}

void Avx512SituF32(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                   float* h) {
  SituT<false>(g, u, n, beta, linear_beta, h);
}

double Avx512FmaProbe(int64_t iters) { return ChainProbe<false>(iters); }

double Avx512Bf16DotProbe(int64_t iters) { return ChainProbe<true>(iters); }

void Avx512RoundTripMxfp8(float* values, int64_t n) { RoundTripMxfp8(values, n); }

}  // namespace moe::numerics::cpu
