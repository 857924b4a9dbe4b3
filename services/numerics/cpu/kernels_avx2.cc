// AVX2 + FMA kernels. This file alone is compiled with -mavx2 -mfma; everything here has
// internal linkage (see kernels_avx512.cc).
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

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

// ---------------------------------------------------------------- dense bf16 GEMM

// Few tokens: a strip of 8*OV columns of one 128-column tile for TT tokens over reduction
// steps [k0, k1), weights converted from bf16 as they stream (each weight is used TT times, so
// the conversion is not amortized and the loop runs at memory bandwidth). The strips of a tile
// walk the reduction in blocks of kGemmKBlock (accumulators through y between blocks, exact), so
// the tile streams from memory once and the other strips find its block in L2.
template <int TT, int OV>
void GemmStrip(const float* x, int64_t in, const uint16_t* w, int64_t col, int64_t k0, int64_t k1,
               float* y, int64_t ld_y) {
  __m256 acc[TT][OV];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) {
      acc[t][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + t * ld_y + col + 8 * j);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
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

// Many tokens: the weights of a 16-column strip are converted to fp32 once per block of
// kGemmKBlock reduction steps (an L1-resident panel) and reused by every group of 6 tokens; the
// 6 x 16 microkernel holds 12 accumulators, 2 weight vectors and a broadcast in the 16 ymm
// registers. Accumulators go through y between blocks (an fp32 store and reload is exact), so
// every output is still summed over k in ascending order from 0.
constexpr int64_t kGemmKBlock = 256;
constexpr int64_t kGemmPackTokens = 24;  // from here the panel conversion pays for itself

template <int TT, int OV>
void GemmTile(const float* x, int64_t in, const uint16_t* w, float* y, int64_t ld_y) {
  for (int64_t k0 = 0; k0 < in; k0 += kGemmKBlock) {
    const int64_t k1 = in - k0 < kGemmKBlock ? in : k0 + kGemmKBlock;
    for (int64_t col = 0; col < kGemmColumnTile; col += 8 * OV) {
      GemmStrip<TT, OV>(x, in, w, col, k0, k1, y, ld_y);
    }
  }
}

template <int TT>
void GemmPanelTile(const float* x, int64_t in, const float* panel, int64_t kn, bool first, float* y,
                   int64_t ld_y) {
  __m256 acc[TT][2];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    acc[t][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + t * ld_y);
    acc[t][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + t * ld_y + 8);
  }
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(x + t * in + k);
      acc[t][0] = _mm256_fmadd_ps(xb, w0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(xb, w1, acc[t][1]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    _mm256_storeu_ps(y + t * ld_y, acc[t][0]);
    _mm256_storeu_ps(y + t * ld_y + 8, acc[t][1]);
  }
}

void GemmPacked(const float* x, int64_t tokens, int64_t in, const uint16_t* w, float* y,
                int64_t ld_y) {
  alignas(32) float panel[kGemmKBlock * 16];
  // k blocks outermost: the activations of a block (tokens x kGemmKBlock floats, 96 KB for the
  // 96-token items of PackedLinear) stay in L2 while every strip of the tile runs over them.
  for (int64_t k0 = 0; k0 < in; k0 += kGemmKBlock) {
    const int64_t kn = in - k0 < kGemmKBlock ? in - k0 : kGemmKBlock;
    for (int64_t col = 0; col < kGemmColumnTile; col += 16) {
      for (int64_t k = 0; k < kn; ++k) {
        const uint16_t* src = w + (k0 + k) * kGemmColumnTile + col;
        _mm256_store_ps(panel + k * 16, LoadBf16x8(src));
        _mm256_store_ps(panel + k * 16 + 8, LoadBf16x8(src + 8));
      }
      const bool first = k0 == 0;
      const float* xk = x + k0;
      float* yc = y + col;
      int64_t t = 0;
      for (; t + 6 <= tokens; t += 6) {
        GemmPanelTile<6>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
      }
      switch (tokens - t) {
        case 5:
          GemmPanelTile<5>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
          break;
        case 4:
          GemmPanelTile<4>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
          break;
        case 3:
          GemmPanelTile<3>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
          break;
        case 2:
          GemmPanelTile<2>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
          break;
        case 1:
          GemmPanelTile<1>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
          break;
        default:
          break;
      }
    }
  }
}

void Gemm(const float* x, int64_t tokens, int64_t in, const uint16_t* wt, int64_t o0, int64_t o1,
          float* y, int64_t ld_y) {
  for (int64_t o = o0; o < o1; o += kGemmColumnTile) {
    const uint16_t* w = wt + (o / kGemmColumnTile) * in * kGemmColumnTile;
    if (tokens >= kGemmPackTokens) {
      GemmPacked(x, tokens, in, w, y + o, ld_y);
      continue;
    }
    int64_t t = 0;
    for (; t + 6 <= tokens; t += 6) GemmTile<6, 2>(x + t * in, in, w, y + t * ld_y + o, ld_y);
    for (; t + 2 <= tokens; t += 2) GemmTile<2, 4>(x + t * in, in, w, y + t * ld_y + o, ld_y);
    if (tokens - t >= 1) GemmTile<1, 8>(x + t * in, in, w, y + t * ld_y + o, ld_y);
  }
}

// ---------------------------------------------------------------- MXFP4 decode (byte shuffles)

// A 64-column chunk is 32 packed bytes, one ymm load. The nibbles are split into two byte
// vectors (low nibbles: even columns, high nibbles: odd columns); two vpshufb lookups give the
// high and the low byte of each weight's bf16 value (E2M1 is exact in bf16), one unpack pairs
// them into bf16 words, and a shift (even words) or a mask (odd words) widens each word to fp32.
// That is 19 instructions per 64 weights, about half of the vpermps decode with a separate sign
// (the AVX2 vpermps reads only 3 index bits). The resulting column order is MxLayout::kByteLut;
// the activations are stored in that order, so no shuffle is spent on them.
struct ByteLut {
  __m256i hi, lo, nibble;
};

inline ByteLut MakeByteLut() {
  // bf16 of E2M1 code c: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x3F00 .. 0x40C0), codes 8..15 negated.
  const __m256i hi = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, -128, -65,
                                      -65, -65, -64, -64, -64, -64, 0x00, 0x3F, 0x3F, 0x3F, 0x40,
                                      0x40, 0x40, 0x40, -128, -65, -65, -65, -64, -64, -64, -64);
  const __m256i lo =
      _mm256_setr_epi8(0, 0, -128, -64, 0, 0x40, -128, -64, 0, 0, -128, -64, 0, 0x40, -128, -64, 0,
                       0, -128, -64, 0, 0x40, -128, -64, 0, 0, -128, -64, 0, 0x40, -128, -64);
  return {hi, lo, _mm256_set1_epi8(0x0F)};
}

// Decodes half h of a chunk (h = 0: the low nibbles, even columns; h = 1: the high nibbles)
// into v[0..3]: v[n] holds slots 8 (4 h + n) .. 8 (4 h + n) + 7 of the chunk (kByteLut). The
// even bf16 words are widened with a shift, or, with kShuffleWiden, with a vpshufb that puts
// them in the upper half of their dword (the same result on the shuffle port, which leaves the
// two FMA ports to the multiply-adds when several tokens share the decoded weights).
template <bool kShuffleWiden>
inline void DecodeHalf(const ByteLut& lut, __m256i packed, int h, __m256 v[4]) {
  const __m256i idx = h == 0 ? _mm256_and_si256(packed, lut.nibble)
                             : _mm256_and_si256(_mm256_srli_epi16(packed, 4), lut.nibble);
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i hb = _mm256_shuffle_epi8(lut.hi, idx);
  const __m256i lb = _mm256_shuffle_epi8(lut.lo, idx);
  const __m256i w0 = _mm256_unpacklo_epi8(lb, hb), w1 = _mm256_unpackhi_epi8(lb, hb);
  if constexpr (kShuffleWiden) {
    // Byte 4q + 2, 4q + 3 of the result <- bytes 4q, 4q + 1; the low bytes zeroed (index bit 7).
    const __m256i even_high =
        _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13, -1, -1, 0, 1, -1,
                         -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13);
    v[0] = _mm256_castsi256_ps(_mm256_shuffle_epi8(w0, even_high));
    v[2] = _mm256_castsi256_ps(_mm256_shuffle_epi8(w1, even_high));
  } else {
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
  }
  v[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, mask));
  v[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, mask));
}

// 32 packed bytes of chunk c of a row; a 32-column tail chunk fills the upper half with zeros
// (code 0 decodes to +0, and the activation padding is zero too).
inline __m256i LoadChunk(const uint8_t* row, int64_t c, int64_t cols) {
  if (cols - c * 64 >= 64)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
  return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32)));
}

// 2^(s - 127) as float bits s << 23, four copies (one 128-bit lane) for every E8M0 byte s (s = 0
// reads as 0; 0xFF never gets here: the loader rejects it). Built at compile time: this file may
// run no code of its own before the CPUID check, and a global constructor compiled with -mavx2
// would. 4 KB, L1-resident while a row streams.
struct E8M0Lanes {
  uint32_t v[256][4];
};
constexpr E8M0Lanes MakeE8M0Lanes() {
  E8M0Lanes t{};
  for (uint32_t s = 0; s < 256; ++s) {
    for (int k = 0; k < 4; ++k) t.v[s][k] = s << 23;
  }
  return t;
}
alignas(64) constexpr E8M0Lanes kE8M0 = MakeE8M0Lanes();

// The scales of chunk c as 8 fp32 lanes: the lower 128 bits (columns 0..31) belong to block
// 2c, the upper to block 2c+1: a 128-bit load and one insert from memory (one shuffle-port
// operation; two broadcasts and an insert were three, of the ~36 vector operations of a
// 1-token chunk: 7% less time on Zen 3).
inline __m256 ChunkScale(const uint8_t* s, int64_t c, int64_t cols) {
  const __m128i s0 = _mm_load_si128(reinterpret_cast<const __m128i*>(kE8M0.v[s[2 * c]]));
  const __m128i s1 = _mm_load_si128(
      reinterpret_cast<const __m128i*>(kE8M0.v[cols - c * 64 > 32 ? s[2 * c + 1] : 0]));
  return _mm256_castsi256_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(s0), s1, 1));
}

// Decode: R rows x TT tokens. The chunk is decoded in halves so that only 4 decoded vectors
// are live next to the accumulators. Two ways to apply the block scales, chosen so that there
// are enough independent FMA chains (4-cycle latency, 2 ports) in the 16 registers:
//  * 1-4 tokens (kLate): the 8 products of a row, token and chunk go into partial sums that
//    the scales multiply once (one FMA per chunk and token instead of 8 multiplies per chunk):
//    for one token two sums (one per half: chains of 4 FMAs, not 8), added; R = 4 rows give 8
//    chains (10% less time than one sum per chunk, cache-resident, on Zen 3); for two tokens
//    one sum each, R = 2 rows (4 chains), for four R = 1 (4 chains): 10% and 7% less time than
//    scaling the decoded weights (Zen 3, alternated runs);
//  * 8 tokens: the decoded weights are scaled (8 multiplies per chunk, shared by the tokens)
//    and each (row, token) sums both halves in one chain (8 chains, and 8 accumulators leave
//    room for the decoded vectors).
template <int R, int TT>
void MxBlock(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r, int64_t c0,
             int64_t c1, const float* xp, int64_t ld_xp, float* acc_io, bool first, bool last,
             float* out_r, int64_t ld_out) {
  constexpr bool kLate = TT <= 4;
  constexpr int kParts = TT == 1 ? 2 : 1;  // partial sums per token, row and chunk (kLate)
  const ByteLut lut = MakeByteLut();
  const int64_t row_bytes = cols / 2, scale_bytes = cols / 32;
  __m256 acc[R][TT];  // one chain per (row, token)
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      acc[i][t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_io + (i * TT + t) * 8);
    }
  }
  for (int64_t c = c0; c < c1; ++c) {
    const float* x = xp + c * 64;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = packed + (r + i) * row_bytes;
      // The same chunk two blocks of rows down, so later rows stream in ahead of time; a
      // prefetch never faults, also past the end of the matrix.
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * row_bytes + c * 32), _MM_HINT_T0);
      const __m256i bytes = LoadChunk(row, c, cols);
      const __m256 scale = ChunkScale(scales + (r + i) * scale_bytes, c, cols);
      __m256 part[TT][kParts];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 v[4];
        DecodeHalf<(TT > 1)>(lut, bytes, h, v);
        if constexpr (!kLate) {
#pragma GCC unroll 4
          for (int n = 0; n < 4; ++n) v[n] = _mm256_mul_ps(v[n], scale);
        }
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) {
          const float* xt = x + t * ld_xp + 32 * h;
          if constexpr (kLate) {
            const int p = kParts == 2 ? h : 0;
            const bool begin = kParts == 2 || h == 0;
            if (begin) part[t][p] = _mm256_mul_ps(v[0], _mm256_loadu_ps(xt));
#pragma GCC unroll 4
            for (int n = begin ? 1 : 0; n < 4; ++n) {
              part[t][p] = _mm256_fmadd_ps(v[n], _mm256_loadu_ps(xt + 8 * n), part[t][p]);
            }
          } else {
#pragma GCC unroll 4
            for (int n = 0; n < 4; ++n) {
              acc[i][t] = _mm256_fmadd_ps(v[n], _mm256_loadu_ps(xt + 8 * n), acc[i][t]);
            }
          }
        }
      }
      if constexpr (kLate) {
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) {
          const __m256 sum =
              kParts == 2 ? _mm256_add_ps(part[t][0], part[t][kParts - 1]) : part[t][0];
          acc[i][t] = _mm256_fmadd_ps(sum, scale, acc[i][t]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      if (last) {
        out_r[t * ld_out + i] = ReduceAdd(acc[i][t]);
      } else {
        _mm256_storeu_ps(acc_io + (i * TT + t) * 8, acc[i][t]);
      }
    }
  }
}

// Rows [r0, r1) for TT tokens. The columns are walked in blocks whose activations (TT x block
// x 4 bytes <= 16 KB) stay in L1 while every row of the range runs over them: without it each
// weight row re-read all its activations from L2 (57 KB for 4 tokens of a K3 row), and the
// L2 bandwidth, not the FMA ports, set the speed (4 tokens: 32 cycles per 64-weight chunk, 16
// with blocks). Vector accumulators go through acc_io between blocks (exact).
template <int R, int TT>
void MxRows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
            const float* xp, int64_t ld_xp, float* out, int64_t ld_out) {
  constexpr int64_t kBlockChunks = 16384 / (TT * 64 * 4) < 1 ? 1 : 16384 / (TT * 64 * 4);
  const int64_t chunks = (cols + 63) / 64;
  // malloc, not std::vector: no inline code shared with other files (see kernels_avx512.cc).
  float* acc_io = chunks > kBlockChunks
                      ? static_cast<float*>(
                            std::malloc(sizeof(float) * static_cast<size_t>((r1 - r0) * TT * 8)))
                      : nullptr;
  for (int64_t c0 = 0; c0 < chunks; c0 += kBlockChunks) {
    const int64_t c1 = c0 + kBlockChunks < chunks ? c0 + kBlockChunks : chunks;
    const bool first = c0 == 0, last = c1 == chunks;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      MxBlock<R, TT>(packed, scales, cols, r, c0, c1, xp, ld_xp, acc_io + (r - r0) * TT * 8, first,
                     last, out + (r - r0), ld_out);
    }
    for (; r < r1; ++r) {
      MxBlock<1, TT>(packed, scales, cols, r, c0, c1, xp, ld_xp, acc_io + (r - r0) * TT * 8, first,
                     last, out + (r - r0), ld_out);
    }
  }
  std::free(acc_io);
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
               const float* xp, int64_t ld_xp, int64_t tokens, float* out, int64_t ld_out) {
  int64_t t = 0;
  for (; t + 8 <= tokens; t += 8) {
    MxRows<1, 8>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
  for (; t + 4 <= tokens; t += 4) {
    MxRows<1, 4>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
  if (tokens - t >= 2) {
    MxRows<2, 2>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
    t += 2;
  }
  if (t < tokens) {
    MxRows<4, 1>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
  }
}

// ---------------------------------------------------------------- MXFP4 prefill (panel)

// Chunks [c0, c1) of one row decoded to fp32 with the scales applied, in kByteLut slot order;
// dst receives (c1 - c0) * 64 floats.
void DecodeChunks(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t c0,
                  int64_t c1, float* dst) {
  const ByteLut lut = MakeByteLut();
  for (int64_t c = c0; c < c1; ++c) {
    const __m256i bytes = LoadChunk(packed, c, cols);
    const __m256 scale = ChunkScale(scales, c, cols);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 v[4];
      DecodeHalf<false>(lut, bytes, h, v);
#pragma GCC unroll 4
      for (int n = 0; n < 4; ++n) {
        _mm256_storeu_ps(dst + (c - c0) * 64 + 8 * (4 * h + n), _mm256_mul_ps(v[n], scale));
      }
    }
  }
}

// RB rows x TV vectors of 8 tokens over kn slots, accumulating into acc_buf[row][token]:
// RB broadcasts and TV loads feed RB x TV FMAs per slot (4 x 3: 12 accumulators, 3 token
// vectors and a broadcast in the 16 ymm registers). xg: a pass's activations (from token tg) in
// groups of 8 tokens, token t's group at xg + ((t - tg) / 8) * kn * 8, [kn][8] (each token
// vector streams sequentially).
template <int RB, int TV>
void PanelTile(const float* panel, int64_t kn, const float* xg, int64_t tg, int64_t ld_t,
               int64_t t0, float* acc_buf) {
  __m256 acc[RB][TV];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) acc[i][j] = _mm256_loadu_ps(acc_buf + i * ld_t + t0 + 8 * j);
  }
  const float* xj = xg + ((t0 - tg) / 8) * kn * 8;
  for (int64_t k = 0; k < kn; ++k) {
    __m256 xv[TV];
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) xv[j] = _mm256_load_ps(xj + (j * kn + k) * 8);
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i) {
      const __m256 w = _mm256_broadcast_ss(panel + i * kn + k);
#pragma GCC unroll 16
      for (int j = 0; j < TV; ++j) acc[i][j] = _mm256_fmadd_ps(w, xv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) _mm256_storeu_ps(acc_buf + i * ld_t + t0 + 8 * j, acc[i][j]);
  }
}

// Tokens [t_begin, t_end) (multiples of 8) of one panel; xg holds the pass from t_begin.
template <int RB>
void PanelRows(const float* panel, int64_t kn, const float* xg, int64_t ld_t, int64_t t_begin,
               int64_t t_end, float* acc_buf) {
  int64_t t0 = t_begin;
  for (; t0 + 24 <= t_end; t0 += 24) PanelTile<RB, 3>(panel, kn, xg, t_begin, ld_t, t0, acc_buf);
  for (; t0 + 16 <= t_end; t0 += 16) PanelTile<RB, 2>(panel, kn, xg, t_begin, ld_t, t0, acc_buf);
  for (; t0 < t_end; t0 += 8) PanelTile<RB, 1>(panel, kn, xg, t_begin, ld_t, t0, acc_buf);
}

// Tokens per pass: 256 slots x 192 tokens repacked (192 KB) stay in L2 next to the block's
// decoded panels (1 KB a row); repacking every token of a block at once (1 MB at 1,024 tokens,
// 4 MB at 4,096) let them fall out of L2 for every panel of 4 rows.
constexpr int64_t kPanelTokens = 192;

// Prefill. Slots are walked in blocks of 256: every row of [r0, r1) is decoded to fp32 once per
// block, then the tokens (rounded up to 8) in passes of kPanelTokens: a pass's activations are
// repacked into groups of 8 tokens (each token vector then streams sequentially; read in
// place, the token-major rows are 1 KB apart at 256 tokens: 0.65 -> 0.7 of the FMA peak in
// cpu_layer_bench) and every panel of 4 rows runs over them; sums accumulate per (row, token)
// in slot order in acc_buf (passes do not change any sum's order).
void MxPanel(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
             const float* xt, int64_t ld_t, int64_t tokens, float* out, int64_t ld_out) {
  constexpr int kRows = 4;
  constexpr int64_t kChunksPerBlock = 4;  // 256 slots
  const int64_t rows = r1 - r0, chunks = (cols + 63) / 64;
  const int64_t extent = (tokens + 7) / 8 * 8;
  // malloc, not std::vector: no inline code shared with other files (see kernels_avx512.cc).
  float* acc_buf =
      static_cast<float*>(std::calloc(static_cast<size_t>(rows * ld_t), sizeof(float)));
  float* panels = static_cast<float*>(
      std::malloc(sizeof(float) * static_cast<size_t>(rows * kChunksPerBlock * 64)));
  const int64_t pass = extent < kPanelTokens ? extent : kPanelTokens;
  float* xg = static_cast<float*>(
      std::aligned_alloc(32, sizeof(float) * static_cast<size_t>(kChunksPerBlock * 64 * pass)));
  for (int64_t c0 = 0; c0 < chunks; c0 += kChunksPerBlock) {
    const int64_t c1 = c0 + kChunksPerBlock < chunks ? c0 + kChunksPerBlock : chunks;
    const int64_t kn = (c1 - c0) * 64;
    const float* xb = xt + c0 * 64 * ld_t;
    for (int64_t r = 0; r < rows; ++r) {
      // The block of the row kPanelAhead rows down on its way (2 lines and its scales).
      if (r + kPanelAhead < rows) {
        const int64_t ahead = r0 + r + kPanelAhead;
        for (int64_t c = c0; c < c1; c += 2) {
          _mm_prefetch(reinterpret_cast<const char*>(packed + ahead * (cols / 2) + c * 32),
                       _MM_HINT_T0);
        }
        _mm_prefetch(reinterpret_cast<const char*>(scales + ahead * (cols / 32) + c0 * 2),
                     _MM_HINT_T0);
      }
      DecodeChunks(packed + (r0 + r) * (cols / 2), scales + (r0 + r) * (cols / 32), cols, c0, c1,
                   panels + r * kn);
    }
    for (int64_t t0 = 0; t0 < extent; t0 += kPanelTokens) {
      const int64_t t1 = t0 + kPanelTokens < extent ? t0 + kPanelTokens : extent;
      for (int64_t g = t0 / 8; g < t1 / 8; ++g) {
        for (int64_t k = 0; k < kn; ++k) {
          _mm256_store_ps(xg + ((g - t0 / 8) * kn + k) * 8, _mm256_loadu_ps(xb + k * ld_t + 8 * g));
        }
      }
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) {
        PanelRows<kRows>(panels + r * kn, kn, xg, ld_t, t0, t1, acc_buf + r * ld_t);
      }
      for (; r < rows; ++r) {
        PanelRows<1>(panels + r * kn, kn, xg, ld_t, t0, t1, acc_buf + r * ld_t);
      }
      // The last block's pass has its sums final: out while they are still in L2.
      if (c1 == chunks && t0 < tokens) {
        StoreTokenRows(acc_buf + t0, ld_t, rows, (t1 < tokens ? t1 : tokens) - t0,
                       out + t0 * ld_out, ld_out);
      }
    }
  }
  std::free(xg);
  std::free(panels);
  std::free(acc_buf);
}

// ---------------------------------------------------------------- SiTU

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

// kRound: the result rounded to bf16 (situ), else left in fp32 (situ_f32).
template <bool kRound>
void SituT(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* h) {
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
    const __m256 hv = _mm256_mul_ps(gate, up);
    _mm256_storeu_ps(hb, kRound ? RoundBf16(hv) : hv);
    for (int j = 0; j < m; ++j) h[i + j] = hb[j];
  }
}

// 10 independent chains: 2 FMA ports x 4-5 cycles of latency.
double FmaProbe(int64_t iters) {
  __m256 acc[10];
#pragma GCC unroll 10
  for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(0.001f * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 10  // the accumulators must live in registers
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 sum = acc[0];
#pragma GCC unroll 10
  for (int i = 1; i < 10; ++i) sum = _mm256_add_ps(sum, acc[i]);
  volatile float sink = _mm256_cvtss_f32(sum);
  (void)sink;
  return 2.0 * 8 * 10 * static_cast<double>(iters);
}

// ---------------------------------------------------------------- MXFP8 round trip (W4A8's h)

// The MXFP8 block exponent e of amax (finite, >= 0): the smallest e with amax <= 448 x 2^e,
// clamped to [-127, 127], from the bits: amax = m x 2^E with m in [1, 2) needs e = E - 8, one
// more when m > 1.75 (448 = 1.75 x 2^8); subnormal amax clamps to -127.
inline int Mxfp8Exponent(float amax) {
  uint32_t u;
  std::memcpy(&u, &amax, sizeof(u));
  const int biased = static_cast<int>(u >> 23);
  if (biased == 0) return -127;
  const int e = biased - 127 - 8 + ((u & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// 2^k for k in [-127, 127] (2^-127 is subnormal).
inline float Pow2(int k) {
  const uint32_t u = k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// One E4M3 rounding of 8 values already divided by the block scale (|y| <= 448): the fp32
// mantissa rounded to 3 bits, half to even, from 2^-6 up; multiples of 2^-9 below (vroundps
// rounds half to even); the sign kept by both.
inline __m256 RoundE4M3(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFFF)), lsb),
                       _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m256 sub = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(512.0f)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256 a = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(1.0f / 64.0f), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), sub, small);
}

void RoundTripMxfp8(float* v, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < n; b += 32) {
    __m256 x[4];
    __m256 m = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_loadu_ps(v + b + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(x[i], abs_mask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    // An all-zero block takes the smallest scale (2^-127); its values stay +-0 either way.
    const int e = amax > 0.0f ? Mxfp8Exponent(amax) : -127;
    const __m256 inv = _mm256_set1_ps(Pow2(-e)), scale = _mm256_set1_ps(Pow2(e));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(v + b + 8 * i, _mm256_mul_ps(RoundE4M3(_mm256_mul_ps(x[i], inv)), scale));
    }
  }
}

}  // namespace

const KernelTable& Avx2Kernels() {
  static const KernelTable table = {
      Isa::kAvx2,  "avx2",  MxLayout::kByteLut, 64, Gemm,     Mxfp4Rows,
      SituT<true>, MxPanel, MxLayout::kByteLut, 64, FmaProbe, RoundTripMxfp8,
      SituT<false>};
  return table;
}

}  // namespace moe::numerics::cpu
