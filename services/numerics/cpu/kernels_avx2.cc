// AVX2 + FMA kernels. This file alone is compiled with -mavx2 -mfma; everything here has
// internal linkage (see kernels_avx512.cc).
#include <immintrin.h>

#include <cstdint>

#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {
namespace {

inline __m256 LoadBf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float ReduceAdd(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

template <int TT, int OV>
void GemmStrip(const float* x, int64_t in, const uint16_t* w, int64_t col, float* y, int64_t ld_y) {
  __m256 acc[TT][OV];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) acc[t][j] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    __m256 wv[OV];
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) wv[j] = LoadBf16x8(w + k * kGemmColumnTile + col + 8 * j);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(x + t * in + k);
#pragma GCC unroll 16
      for (int j = 0; j < OV; ++j) acc[t][j] = _mm256_fmadd_ps(xb, wv[j], acc[t][j]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) _mm256_storeu_ps(y + t * ld_y + col + 8 * j, acc[t][j]);
  }
}

template <int TT, int OV>
void GemmTile(const float* x, int64_t in, const uint16_t* w, float* y, int64_t ld_y) {
  for (int64_t col = 0; col < kGemmColumnTile; col += 8 * OV) {
    GemmStrip<TT, OV>(x, in, w, col, y, ld_y);
  }
}

void Gemm(const float* x, int64_t tokens, int64_t in, const uint16_t* wt, int64_t o0, int64_t o1,
          float* y, int64_t ld_y) {
  for (int64_t o = o0; o < o1; o += kGemmColumnTile) {
    const uint16_t* w = wt + (o / kGemmColumnTile) * in * kGemmColumnTile;
    int64_t t = 0;
    for (; t + 6 <= tokens; t += 6) GemmTile<6, 2>(x + t * in, in, w, y + t * ld_y + o, ld_y);
    for (; t + 2 <= tokens; t += 2) GemmTile<2, 4>(x + t * in, in, w, y + t * ld_y + o, ld_y);
    if (tokens - t >= 1) GemmTile<1, 4>(x + t * in, in, w, y + t * ld_y + o, ld_y);
  }
}

// 64-column chunks: 32 packed bytes = 8 u32 lanes, lane i = columns 8i..8i+7. vpermps reads 3
// index bits, so the table holds magnitudes and the sign (nibble bit 3) is moved to bit 31.
template <int R, int TT>
void MxBlock(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r, const float* xp,
             int64_t ld_xp, float* out_r, int64_t ld_out) {
  const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const int64_t row_bytes = cols / 2, scale_bytes = cols / 32;
  __m256 acc[R][TT];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c * 64 < cols; ++c) {
    const bool full = cols - c * 64 >= 64;
    const __m256i lane_mask =
        full ? _mm256_set1_epi32(-1) : _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0);
    __m256i lanes[R];
    __m256 scale[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      lanes[i] = _mm256_maskload_epi32(
          reinterpret_cast<const int*>(packed + (r + i) * row_bytes + c * 32), lane_mask);
      const uint8_t* s = scales + (r + i) * scale_bytes + c * 2;
      const int s0 = s[0], s1 = full ? s[1] : 0;
      scale[i] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1), 23));
    }
    const float* x = xp + c * 64;
#pragma GCC unroll 8
    for (int n = 0; n < 8; ++n) {
      const __m128i shift = _mm_cvtsi32_si128(4 * n);
      const __m128i sign_shift = _mm_cvtsi32_si128(28 - 4 * n);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256 mag = _mm256_permutevar8x32_ps(lut, _mm256_srl_epi32(lanes[i], shift));
        const __m256i sign = _mm256_and_si256(_mm256_sll_epi32(lanes[i], sign_shift), sign_bit);
        const __m256 v = _mm256_mul_ps(_mm256_xor_ps(mag, _mm256_castsi256_ps(sign)), scale[i]);
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) {
          acc[i][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * ld_xp + n * 8), acc[i][t]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out_r[t * ld_out + i] = ReduceAdd(acc[i][t]);
  }
}

template <int R, int TT>
void MxRows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
            const float* xp, int64_t ld_xp, float* out, int64_t ld_out) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    MxBlock<R, TT>(packed, scales, cols, r, xp, ld_xp, out + (r - r0), ld_out);
  }
  for (; r < r1; ++r) MxBlock<1, TT>(packed, scales, cols, r, xp, ld_xp, out + (r - r0), ld_out);
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
               const float* xp, int64_t ld_xp, int64_t tokens, float* out, int64_t ld_out) {
  int64_t t = 0;
  for (; t + 4 <= tokens; t += 4) {
    MxRows<2, 4>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
  for (; t + 2 <= tokens; t += 2) {
    MxRows<2, 2>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
  if (t < tokens) {
    MxRows<4, 1>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
}

inline __m256 RoundBf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// exp as in kernels_avx512.cc; 2^n built in the exponent field (n in [-150, 128] after the
// clamp, split in two factors so that each is a normal float and the result rounds once).
inline __m256 Exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 f1 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

inline __m256 Tanh(__m256 y) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign_mask, y);
  const __m256 y2 = _mm256_mul_ps(y, y);
  __m256 p = _mm256_set1_ps(21844.0f / 6081075.0f);
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1382.0f / 155925.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(62.0f / 2835.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, y2), y, y);
  const __m256 e = Exp(_mm256_add_ps(a, a));
  __m256 big =
      _mm256_sub_ps(_mm256_set1_ps(1.0f),
                    _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  big = _mm256_or_ps(big, _mm256_and_ps(y, sign_mask));
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.3f), _CMP_LT_OQ));
}

void Situ(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* h) {
  const __m256 b1 = _mm256_set1_ps(beta), b2 = _mm256_set1_ps(linear_beta);
  const __m256 one = _mm256_set1_ps(1.0f);
  float gb[8], ub[8], hb[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = n - i < 8 ? n - i : 8;
    for (int j = 0; j < 8; ++j) {
      gb[j] = j < m ? g[i + j] : 0.0f;
      ub[j] = j < m ? u[i + j] : 0.0f;
    }
    const __m256 gv = RoundBf16(_mm256_loadu_ps(gb));
    const __m256 uv = RoundBf16(_mm256_loadu_ps(ub));
    const __m256 sig =
        _mm256_div_ps(one, _mm256_add_ps(one, Exp(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    const __m256 gate = _mm256_mul_ps(_mm256_mul_ps(b1, Tanh(_mm256_div_ps(gv, b1))), sig);
    const __m256 up = _mm256_mul_ps(b2, Tanh(_mm256_div_ps(uv, b2)));
    _mm256_storeu_ps(hb, RoundBf16(_mm256_mul_ps(gate, up)));
    for (int j = 0; j < m; ++j) h[i + j] = hb[j];
  }
}

}  // namespace

const KernelTable& Avx2Kernels() {
  static const KernelTable table = {Isa::kAvx2, "avx2", MxLayout::kFloat, 64, Gemm,
                                    Mxfp4Rows,  Situ,   nullptr};
  return table;
}

}  // namespace moe::numerics::cpu
