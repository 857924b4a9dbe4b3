// AVX-512 kernels (F, BW, DQ, VL; the BF16 table also AVX512_BF16): the dense GEMM, the MXFP4
// rows and panels, and the tables (SiTU, the peak probes and the MXFP8 round trip are in
// kernels_avx512_elementwise.cc). Only these two files are compiled with -mavx512*; they hold
// no inline code shared with other files (everything has internal linkage but the tables and
// the helpers kernels.h declares for the AVX-512 kernels alone), so no AVX-512 instruction can
// leak into code that runs before the CPUID check.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {
namespace {

// ---------------------------------------------------------------- dense bf16 GEMM

inline __m512 LoadBf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// A strip of 16*OV columns at `col` of one 128-column tile, for TT tokens. w: the tile, [in, 128].
template <int TT, int OV>
void GemmStrip(const float* x, int64_t in, const uint16_t* w, int64_t col, float* y, int64_t ld_y) {
  __m512 acc[TT][OV];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) acc[t][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    __m512 wv[OV];
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) wv[j] = LoadBf16x16(w + k * kGemmColumnTile + col + 16 * j);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * in + k]);
#pragma GCC unroll 16
      for (int j = 0; j < OV; ++j) acc[t][j] = _mm512_fmadd_ps(xb, wv[j], acc[t][j]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 16
    for (int j = 0; j < OV; ++j) _mm512_storeu_ps(y + t * ld_y + col + 16 * j, acc[t][j]);
  }
}

template <int TT, int OV>
void GemmTile(const float* x, int64_t in, const uint16_t* w, float* y, int64_t ld_y) {
  for (int64_t col = 0; col < kGemmColumnTile; col += 16 * OV) {
    GemmStrip<TT, OV>(x, in, w, col, y, ld_y);
  }
}

// Many tokens: the weights of a 32-column strip are converted to fp32 once per block of
// kGemmKBlock reduction steps (a 32 KB panel in L1) and reused by every group of 12 tokens;
// the 12 x 32 microkernel holds 24 accumulators, 2 weight vectors and a broadcast in the 32 zmm
// registers (converting per use had capped T = 256 at 0.37 of the FMA peak: cpu_layer_bench).
// Accumulators go through y between blocks (exact), so each output is still summed over k in
// ascending order from 0.
constexpr int64_t kGemmKBlock = 256;
constexpr int64_t kGemmPackTokens = 48;  // from here the panel conversion pays for itself

template <int TT>
void GemmPanelTile(const float* x, int64_t in, const float* panel, int64_t kn, bool first, float* y,
                   int64_t ld_y) {
  __m512 acc[TT][2];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    acc[t][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + t * ld_y);
    acc[t][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + t * ld_y + 16);
  }
  for (int64_t k = 0; k < kn; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + k * 32), w1 = _mm512_load_ps(panel + k * 32 + 16);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * in + k]);
      acc[t][0] = _mm512_fmadd_ps(xb, w0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(xb, w1, acc[t][1]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    _mm512_storeu_ps(y + t * ld_y, acc[t][0]);
    _mm512_storeu_ps(y + t * ld_y + 16, acc[t][1]);
  }
}

void GemmPacked(const float* x, int64_t tokens, int64_t in, const uint16_t* w, float* y,
                int64_t ld_y) {
  alignas(64) float panel[kGemmKBlock * 32];
  // k blocks outermost: the activations of a block (tokens x kGemmKBlock floats, 96 KB for the
  // 96-token items of PackedLinear) stay in L2 while every strip of the tile runs over them.
  for (int64_t k0 = 0; k0 < in; k0 += kGemmKBlock) {
    const int64_t kn = in - k0 < kGemmKBlock ? in - k0 : kGemmKBlock;
    for (int64_t col = 0; col < kGemmColumnTile; col += 32) {
      for (int64_t k = 0; k < kn; ++k) {
        const uint16_t* src = w + (k0 + k) * kGemmColumnTile + col;
        _mm512_store_ps(panel + k * 32, LoadBf16x16(src));
        _mm512_store_ps(panel + k * 32 + 16, LoadBf16x16(src + 16));
      }
      const bool first = k0 == 0;
      const float* xk = x + k0;
      float* yc = y + col;
      int64_t t = 0;
      for (; t + 12 <= tokens; t += 12) {
        GemmPanelTile<12>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
      }
      if (tokens - t >= 8) {
        GemmPanelTile<8>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
        t += 8;
      }
      if (tokens - t >= 4) {
        GemmPanelTile<4>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
        t += 4;
      }
      if (tokens - t >= 2) {
        GemmPanelTile<2>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
        t += 2;
      }
      if (tokens - t >= 1) GemmPanelTile<1>(xk + t * in, in, panel, kn, first, yc + t * ld_y, ld_y);
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
    for (; t + 12 <= tokens; t += 12) GemmTile<12, 2>(x + t * in, in, w, y + t * ld_y + o, ld_y);
    if (tokens - t >= 8) {
      GemmTile<8, 2>(x + t * in, in, w, y + t * ld_y + o, ld_y);
      t += 8;
    }
    if (tokens - t >= 4) {
      GemmTile<4, 4>(x + t * in, in, w, y + t * ld_y + o, ld_y);
      t += 4;
    }
    if (tokens - t >= 2) {
      GemmTile<2, 8>(x + t * in, in, w, y + t * ld_y + o, ld_y);
      t += 2;
    }
    if (tokens - t >= 1) GemmTile<1, 8>(x + t * in, in, w, y + t * ld_y + o, ld_y);
  }
}

// ---------------------------------------------------------------- MXFP4 rows

// The E8M0 scales of one 128-column chunk (4 bytes, fewer in a partial chunk) as 16 fp32
// lanes: lane l belongs to block l / 4. Byte s becomes float bits s << 23 = 2^(s - 127) (s = 0,
// 2^-127, reads as 0; 0xFF never gets here: the loader rejects it).
inline __m512 ChunkScales(const uint8_t* s, __mmask16 mask) {
  const __m128i repeat4 = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m128i s4 = _mm_maskz_loadu_epi8(mask, s);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(s4, repeat4)), 23));
}

// The 64 packed bytes of a 128-column chunk, `width` columns of it (a multiple of 8) and zeros
// past them: whole chunks with a plain load (a masked one cost 0.9 of the BF16 decode's 8
// cycles per 128 weights on Zen 4), only a partial last chunk masked.
inline __m512i LoadChunk(const uint8_t* p, int64_t width) {
  return width == 128
             ? _mm512_loadu_si512(p)
             : _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (width / 8)) - 1), p);
}

// R rows x TT tokens. Each 128-column chunk is 64 packed bytes = 16 u32 lanes; lane i holds
// columns 8i..8i+7, nibble n of the lane is column 8i+n, and vpermps reads only the low 4
// bits of each index, so (lanes >> 4n) indexes the E2M1 table directly. The block scales
// (lane i belongs to block i / 4 of the chunk) are applied once per chunk when few tokens share
// the decoded weights (kScaleLate: one FMA per chunk and token instead of a multiply per
// decoded vector), and to the decoded weights when many do.
template <int R, int TT>
void MxBlock(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r, const float* xp,
             int64_t ld_xp, float* out_r, int64_t ld_out) {
  constexpr bool kScaleLate = TT <= 4;
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                    -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const int64_t row_bytes = cols / 2, scale_bytes = cols / 32;
  __m512 acc[R][TT];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c * 128 < cols; ++c) {
    const int64_t width = cols - c * 128 < 128 ? cols - c * 128 : 128;
    const __mmask16 scale_mask = static_cast<__mmask16>((1u << (width / 32)) - 1);
    __m512i lanes[R];
    __m512 scale[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = packed + (r + i) * row_bytes + c * 64;
      // The same chunk of the rows two blocks down while this block computes, so later blocks
      // stream in whole and ahead of time (the hardware prefetcher alone left the loop waiting
      // on memory at the start of every row: decode 10 -> 13 GB/s in cpu_layer_bench). Into
      // L1 (T0), as the AVX2 rows do: into L2 (T1) the 1-token BF16 decode took 1.12x the time
      // from DRAM on Zen 5 (docs/benchmarks.md). A prefetch never faults, also past the end.
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * row_bytes), _MM_HINT_T0);
      lanes[i] = LoadChunk(row, width);
      scale[i] = ChunkScales(scales + (r + i) * scale_bytes + c * 4, scale_mask);
    }
    const float* x = xp + c * 128;
    __m512 part[R][kScaleLate ? TT : 1];
    if constexpr (kScaleLate) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) part[i][t] = _mm512_setzero_ps();
      }
    }
#pragma GCC unroll 8
    for (int n = 0; n < 8; ++n) {
      __m512 v[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        v[i] = _mm512_permutexvar_ps(_mm512_srl_epi32(lanes[i], _mm_cvtsi32_si128(4 * n)), lut);
        if constexpr (!kScaleLate) v[i] = _mm512_mul_ps(v[i], scale[i]);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const __m512 xv = _mm512_loadu_ps(x + t * ld_xp + n * 16);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          if constexpr (kScaleLate) {
            part[i][t] = _mm512_fmadd_ps(v[i], xv, part[i][t]);
          } else {
            acc[i][t] = _mm512_fmadd_ps(v[i], xv, acc[i][t]);
          }
        }
      }
    }
    if constexpr (kScaleLate) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_fmadd_ps(part[i][t], scale[i], acc[i][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out_r[t * ld_out + i] = _mm512_reduce_add_ps(acc[i][t]);
  }
}

// Rows [r0, r1) through Block<R, TT> (whole groups of R) and Block<1, TT> (the rest).
template <int R, int TT,
          void (*Block)(const uint8_t*, const uint8_t*, int64_t, int64_t, const float*, int64_t,
                        float*, int64_t),
          void (*Single)(const uint8_t*, const uint8_t*, int64_t, int64_t, const float*, int64_t,
                         float*, int64_t)>
void MxRows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
            const float* xp, int64_t ld_xp, float* out, int64_t ld_out) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) Block(packed, scales, cols, r, xp, ld_xp, out + (r - r0), ld_out);
  for (; r < r1; ++r) Single(packed, scales, cols, r, xp, ld_xp, out + (r - r0), ld_out);
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
               const float* xp, int64_t ld_xp, int64_t tokens, float* out, int64_t ld_out) {
  // Tiles sized to stay in the 32 vector registers (lanes, scales, accumulators).
  int64_t t = 0;
  for (; t + 8 <= tokens; t += 8) {
    MxRows<2, 8, MxBlock<2, 8>, MxBlock<1, 8>>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp,
                                               out + t * ld_out, ld_out);
  }
  if (tokens - t >= 4) {
    MxRows<2, 4, MxBlock<2, 4>, MxBlock<1, 4>>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp,
                                               out + t * ld_out, ld_out);
    t += 4;
  }
  if (tokens - t >= 2) {
    MxRows<4, 2, MxBlock<4, 2>, MxBlock<1, 2>>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp,
                                               out + t * ld_out, ld_out);
    t += 2;
  }
  if (tokens - t >= 1) {
    MxRows<4, 1, MxBlock<4, 1>, MxBlock<1, 1>>(packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp,
                                               out + t * ld_out, ld_out);
  }
}

// ---------------------------------------------------------------- MXFP4 prefill (panel)

// Decodes chunks [c0, c1) of one MXFP4 row to fp32 (scales applied) in the permuted slot order
// of chunk 128; dst receives (c1 - c0) * 128 floats.
void DecodeChunks(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t c0,
                  int64_t c1, float* dst) {
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                    -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t width = cols - c * 128 < 128 ? cols - c * 128 : 128;
    const __m512i lanes = LoadChunk(packed + c * 64, width);
    const __m512 scale =
        ChunkScales(scales + c * 4, static_cast<__mmask16>((1u << (width / 32)) - 1));
#pragma GCC unroll 8
    for (int n = 0; n < 8; ++n) {
      const __m512 v =
          _mm512_permutexvar_ps(_mm512_srl_epi32(lanes, _mm_cvtsi32_si128(4 * n)), lut);
      _mm512_storeu_ps(dst + (c - c0) * 128 + n * 16, _mm512_mul_ps(v, scale));
    }
  }
}

// RB rows x TV vectors of 16 tokens over kn slots: acc[r][j] += panel[r][k] * xt[k][16 j ...],
// accumulating into acc_buf[r][token] (row stride ld_t). RB broadcasts + TV loads feed
// RB x TV FMAs per k. kPairs: every slot holds two bf16 (a column pair: kBf16PairsTm, and the
// pair panel's weights), and one vdpbf16ps adds both products per token.
template <int RB, int TV, bool kPairs>
void PanelTile(const float* panel, int64_t kn, const float* xt, int64_t ld_t, int64_t t0,
               float* acc_buf) {
  __m512 acc[RB][TV];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) acc[i][j] = _mm512_loadu_ps(acc_buf + i * ld_t + t0 + 16 * j);
  }
  for (int64_t k = 0; k < kn; ++k) {
    __m512 xv[TV];
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) xv[j] = _mm512_loadu_ps(xt + k * ld_t + t0 + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i) {
      const __m512 w = _mm512_set1_ps(panel[i * kn + k]);
#pragma GCC unroll 16
      for (int j = 0; j < TV; ++j) {
        if constexpr (kPairs) {
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_castps_si512(w),
                                       (__m512bh)_mm512_castps_si512(xv[j]));
        } else {
          acc[i][j] = _mm512_fmadd_ps(w, xv[j], acc[i][j]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < TV; ++j) _mm512_storeu_ps(acc_buf + i * ld_t + t0 + 16 * j, acc[i][j]);
  }
}

// Tokens in tiles of 3 vectors, the rest in tiles of 2 (a remainder of one vector after threes
// becomes two tiles of two): a 1-vector tile loads a broadcast per FMA and ran at half the
// speed (35% of the panel's time at 256 tokens, all of it at 16-32, in perf). Each (row, token)
// sums over k in the same order whatever its tile: the results are the same.
template <int RB, bool kPairs>
void PanelRows(const float* panel, int64_t kn, const float* xt, int64_t ld_t, int64_t t_begin,
               int64_t t_end, float* acc_buf) {
  const int64_t vectors = (t_end - t_begin) / 16;
  int64_t threes = vectors / 3, rest = vectors % 3;
  if (rest == 1 && threes > 0) {
    --threes;
    rest = 4;
  }
  int64_t t0 = t_begin;
  for (int64_t i = 0; i < threes; ++i, t0 += 48) {
    PanelTile<RB, 3, kPairs>(panel, kn, xt, ld_t, t0, acc_buf);
  }
  for (; rest >= 2; rest -= 2, t0 += 32) {
    PanelTile<RB, 2, kPairs>(panel, kn, xt, ld_t, t0, acc_buf);
  }
  if (rest == 1) PanelTile<RB, 1, kPairs>(panel, kn, xt, ld_t, t0, acc_buf);
}

// Tokens per pass over a block of panels: 512 slots x 192 tokens of activations (384 KB) plus
// the block's decoded panels (2 KB a row) and its accumulators stay in a 1 MB L2. Walking all
// tokens per panel instead let the activations of a block (2 MB at 1,024 tokens) fall out of
// L2 for every panel of 8 rows (services/numerics/cpu/README.md, "Token passes").
constexpr int64_t kPanelTokens = 192;

// Prefill. Slots are walked in blocks of 512: every row of [r0, r1) is decoded once per block
// (to fp32, or to bf16 pairs with kPairs: 2 KB a row), then the tokens (rounded up to 16) in
// passes of kPanelTokens, each running every panel of 8 rows over that pass's activations while
// they stay in L2; sums accumulate per (row, token) in k order in acc_buf (token passes do not
// change any sum's order). kPairs needs PairPanelFits (PairPanel checks).
template <bool kPairs>
void MxPanel(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
             const float* xt, int64_t ld_t, int64_t tokens, float* out, int64_t ld_out) {
  constexpr int kRows = 8;
  constexpr int64_t kSlotsPerChunk = kPairs ? 64 : 128;  // per 128 columns
  constexpr int64_t kChunksPerBlock = 512 / kSlotsPerChunk;
  const int64_t rows = r1 - r0, chunks = (cols + 127) / 128;
  const int64_t extent = (tokens + 15) / 16 * 16;  // padding tokens past it are never read
  // malloc, not std::vector (see the top of the file).
  float* acc_buf =
      static_cast<float*>(std::calloc(static_cast<size_t>(rows * ld_t), sizeof(float)));
  float* panels = static_cast<float*>(std::malloc(sizeof(float) * static_cast<size_t>(rows * 512)));
  for (int64_t c0 = 0; c0 < chunks; c0 += kChunksPerBlock) {
    const int64_t c1 = c0 + kChunksPerBlock < chunks ? c0 + kChunksPerBlock : chunks;
    // kPairs: 32-column chunks [k0, k1), 16 pair slots each.
    const int64_t k0 = c0 * 4, k1 = c1 * 4 < cols / 32 ? c1 * 4 : cols / 32;
    const int64_t kn = kPairs ? (k1 - k0) * 16 : (c1 - c0) * 128;
    const float* xb = xt + c0 * kSlotsPerChunk * ld_t;
    for (int64_t row = 0; row < rows; ++row) {
      const uint8_t* p = packed + (r0 + row) * (cols / 2);
      const uint8_t* s = scales + (r0 + row) * (cols / 32);
      // This block of the row kPanelAhead rows down (at most 8 lines and its scales) on its way
      // while this row decodes: from DRAM the decode waited on every row's block.
      if (row + kPanelAhead < rows) {
        const uint8_t* ahead = p + kPanelAhead * (cols / 2);
        for (int64_t c = c0; c < c1; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + c * 64), _MM_HINT_T0);
        }
        _mm_prefetch(reinterpret_cast<const char*>(s + kPanelAhead * (cols / 32) + c0 * 4),
                     _MM_HINT_T0);
      }
      float* dst = panels + row * kn;
      if constexpr (kPairs) {
        DecodeBf16Pairs(p, s, k0, k1, reinterpret_cast<uint16_t*>(dst), 32);
      } else {
        DecodeChunks(p, s, cols, c0, c1, dst);
      }
    }
    for (int64_t t0 = 0; t0 < extent; t0 += kPanelTokens) {
      const int64_t t1 = t0 + kPanelTokens < extent ? t0 + kPanelTokens : extent;
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) {
        PanelRows<kRows, kPairs>(panels + r * kn, kn, xb, ld_t, t0, t1, acc_buf + r * ld_t);
      }
      for (; r < rows; ++r) {
        PanelRows<1, kPairs>(panels + r * kn, kn, xb, ld_t, t0, t1, acc_buf + r * ld_t);
      }
      // The last block's pass has its sums final: out while they are still in L2.
      if (c1 == chunks && t0 < tokens) {
        StoreTokenRows(acc_buf + t0, ld_t, rows, (t1 < tokens ? t1 : tokens) - t0,
                       out + t0 * ld_out, ld_out);
      }
    }
  }
  std::free(panels);
  std::free(acc_buf);
}

// ---------------------------------------------------------------- MXFP4 rows, AVX512-BF16

// The same 64 packed bytes read as 32 words: word j holds columns 4j..4j+3, so (words >> 4n)
// puts column 4j+n in the low bits and one vpermw (5 index bits; the table repeats after 16)
// decodes 32 weights to bf16 at once. vdpbf16ps then multiplies word pairs (columns 8l+n and
// 8l+4+n: the kBf16Pairs activation layout) and adds both products to fp32 lane l: 32
// multiply-adds per instruction, three instructions per 32 weights in decode (shift, vpermw,
// vdpbf16ps) where the fp32 path needs three per 16. Block scales are applied per chunk.
// vdpbf16ps treats bf16 subnormal activations as zero (below 2^-126: no effect at bf16
// precision of the sums).
// The 16 E2M1 values as bf16 bits, twice (vpermw reads 5 index bits).
alignas(64) constexpr uint16_t kE2M1Bf16x2[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80,
    0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0, 0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040,
    0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

template <int R, int TT>
void MxBlockBf16(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r,
                 const float* xp, int64_t ld_xp, float* out_r, int64_t ld_out) {
  const __m512i lut = _mm512_loadu_si512(kE2M1Bf16x2);
  const int64_t row_bytes = cols / 2, scale_bytes = cols / 32;
  __m512 acc[R][TT];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c * 128 < cols; ++c) {
    const int64_t width = cols - c * 128 < 128 ? cols - c * 128 : 128;
    const __mmask16 scale_mask = static_cast<__mmask16>((1u << (width / 32)) - 1);
    __m512i words[R];
    __m512 scale[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = packed + (r + i) * row_bytes + c * 64;
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * row_bytes), _MM_HINT_T0);
      words[i] = LoadChunk(row, width);
      scale[i] = ChunkScales(scales + (r + i) * scale_bytes + c * 4, scale_mask);
    }
    const float* x = xp + c * 64;
    __m512 part[R][TT];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) part[i][t] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int n = 0; n < 4; ++n) {
      __m512i w[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512i idx =
            n == 0 ? words[i] : _mm512_srl_epi16(words[i], _mm_cvtsi32_si128(4 * n));
        w[i] = _mm512_permutexvar_epi16(idx, lut);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * ld_xp + n * 16);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) part[i][t] = _mm512_dpbf16_ps(part[i][t], (__m512bh)w[i], xv);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_fmadd_ps(part[i][t], scale[i], acc[i][t]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out_r[t * ld_out + i] = _mm512_reduce_add_ps(acc[i][t]);
  }
}

// One 128-column chunk c (kFull: all 128 columns, so LoadChunk's test folds away) of R rows x TT
// tokens, its sums scaled by the chunk's lanes of row_scales (spread: lane l of the chunk -> its
// block among those 16) into acc.
template <int R, int TT, bool kFull>
inline __attribute__((always_inline)) void DecodeChunk(const uint8_t* packed, int64_t row_bytes,
                                                       int64_t cols, int64_t r, int64_t c,
                                                       const float* xp, int64_t ld_xp,
                                                       const __m512i& lut, const __m512* row_scales,
                                                       const __m512i& spread,
                                                       __m512 (&acc)[R][TT]) {
  const int64_t width = cols - c * 128 < 128 ? cols - c * 128 : 128;
  __m512i words[R];
  __m512 part[R][TT];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const uint8_t* row = packed + (r + i) * row_bytes + c * 64;
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * row_bytes),
                 _MM_HINT_T0);  // as in MxBlock
    words[i] = LoadChunk(row, kFull ? 128 : width);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) part[i][t] = _mm512_setzero_ps();
  }
  const float* x = xp + c * 64;
#pragma GCC unroll 4
  for (int n = 0; n < 4; ++n) {
    __m512bh xv[TT];
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) xv[t] = (__m512bh)_mm512_loadu_si512(x + t * ld_xp + n * 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512i idx = n == 0 ? words[i] : _mm512_srli_epi16(words[i], 4 * n);
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, lut);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) part[i][t] = _mm512_dpbf16_ps(part[i][t], w, xv[t]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const __m512 scale = _mm512_permutexvar_ps(spread, row_scales[i]);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_fmadd_ps(part[i][t], scale, acc[i][t]);
  }
}

// Decode (one or two tokens): R x TT independent vdpbf16ps chains, decoded weights used at
// once. The block scales are read for 4 chunks at a time (16 scale bytes of a row zero-extended
// to 16 fp32 lanes, one per block) and spread to each chunk's lanes with one vpermps: building
// them per chunk (a byte shuffle, a widening and a shift) cost more, and the sums keep their
// order (the same part, scale and FMA per chunk as before). 6 rows x 1 token: 8.0 cycles per 128
// weights on Zen 4, L2-resident (9.1 before: per-chunk scales, masked loads, 8 rows).
template <int R, int TT>
void MxBlockBf16Decode(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r,
                       const float* xp, int64_t ld_xp, float* out_r, int64_t ld_out) {
  const __m512i lut = _mm512_loadu_si512(kE2M1Bf16x2);
  const __m512i spread[4] = {
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
      _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
      _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
  const int64_t row_bytes = cols / 2, scale_bytes = cols / 32;
  __m512 acc[R][TT];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t c4 = 0; c4 * 128 < cols; c4 += 4) {
    // The blocks of these (up to) 4 chunks (cols is a multiple of 32: Mxfp4Matrix).
    const int64_t blocks = scale_bytes - c4 * 4 < 16 ? scale_bytes - c4 * 4 : 16;
    const __mmask16 block_mask = static_cast<__mmask16>((1u << blocks) - 1);
    __m512 row_scales[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m128i s = _mm_maskz_loadu_epi8(block_mask, scales + (r + i) * scale_bytes + c4 * 4);
      row_scales[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(s), 23));
    }
    for (int64_t c = c4; c < c4 + 4 && c * 128 < cols; ++c) {
      if ((c + 1) * 128 <= cols) {
        DecodeChunk<R, TT, true>(packed, row_bytes, cols, r, c, xp, ld_xp, lut, row_scales,
                                 spread[c - c4], acc);
      } else {
        DecodeChunk<R, TT, false>(packed, row_bytes, cols, r, c, xp, ld_xp, lut, row_scales,
                                  spread[c - c4], acc);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) out_r[t * ld_out + i] = _mm512_reduce_add_ps(acc[i][t]);
  }
}

void Mxfp4RowsBf16(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                   int64_t r1, const float* xp, int64_t ld_xp, int64_t tokens, float* out,
                   int64_t ld_out) {
  // (2 rows x 4 tokens) measured best for every batch from 4 tokens up (bench/mxmicro:
  // 1 x 8 ran 25% slower per flop than 2 x 4).
  int64_t t = 0;
  for (; tokens - t >= 4; t += 4) {
    MxRows<2, 4, MxBlockBf16<2, 4>, MxBlockBf16<1, 4>>(packed, scales, cols, r0, r1, xp + t * ld_xp,
                                                       ld_xp, out + t * ld_out, ld_out);
  }
  if (tokens - t >= 2) {
    MxRows<4, 2, MxBlockBf16Decode<4, 2>, MxBlockBf16Decode<1, 2>>(
        packed, scales, cols, r0, r1, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
    t += 2;
  }
  if (tokens - t >= 1) {
    // 6 rows (7.9 cycles per 128 weights on Zen 4 against 8.4 for 8, which spill), the rest
    // of a work item (128 = 6 x 21 + 2) in pairs rather than one latency-bound row at a time.
    const int64_t r6 = r0 + (r1 - r0) / 6 * 6;
    MxRows<6, 1, MxBlockBf16Decode<6, 1>, MxBlockBf16Decode<1, 1>>(
        packed, scales, cols, r0, r6, xp + t * ld_xp, ld_xp, out + t * ld_out, ld_out);
    MxRows<2, 1, MxBlockBf16Decode<2, 1>, MxBlockBf16Decode<1, 1>>(
        packed, scales, cols, r6, r1, xp + t * ld_xp, ld_xp, out + t * ld_out + (r6 - r0), ld_out);
  }
}

}  // namespace

// ---------------------------------------------------------------- bf16 pair panels

void DecodeBf16Pairs(const uint8_t* row, const uint8_t* srow, int64_t k0, int64_t k1, uint16_t* dst,
                     int64_t stride) {
  const __m512i lut = _mm512_loadu_si512(kE2M1Bf16x2);
  const __m512i lo = _mm512_set1_epi32(0xF), hi = _mm512_set1_epi32(0xF0000);
  for (int64_t k = k0; k < k1; ++k) {
    // 16 bytes = 32 columns; byte j holds column 2j (low nibble) and 2j + 1 (high nibble).
    const __m512i d =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k * 16)));
    const __m512i idx =
        _mm512_or_si512(_mm512_and_si512(d, lo), _mm512_and_si512(_mm512_slli_epi32(d, 12), hi));
    __m512i v = _mm512_permutexvar_epi16(idx, lut);
    // Times 2^(s - 127): add to the exponent of every nonzero value (zeros stay zeros).
    const __mmask32 nonzero = _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF));
    v = _mm512_mask_add_epi16(v, nonzero, v,
                              _mm512_set1_epi16(static_cast<int16_t>((srow[k] - 127) << 7)));
    _mm512_storeu_si512(dst + (k - k0) * stride, v);
  }
}

namespace {

// Prefill of the AVX512-BF16 set: MxPanel on bf16 pairs (kBf16PairsTm activations, the AMX
// set's layout), weights decoded once per block of 8 rows x 1024 columns with the block scales
// in their exponents, so one broadcast pair feeds a vdpbf16ps per 16 tokens and no per-block
// scale multiply is left (the row kernels spend one FMA per 128 columns and token on it).
void PairPanel(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
               const float* xt, int64_t ld_t, int64_t tokens, float* out, int64_t ld_out) {
  if (!PairPanelFits(scales, cols, r0, r1)) {
    PairPanelExact(packed, scales, cols, r0, r1, xt, ld_t, tokens, out, ld_out);
    return;
  }
  MxPanel<true>(packed, scales, cols, r0, r1, xt, ld_t, tokens, out, ld_out);
}

}  // namespace

const KernelTable& Avx512Kernels() {
  static const KernelTable table = {
      Isa::kAvx512, "avx512",       MxLayout::kFloat, 128, Gemm,           Mxfp4Rows,
      Avx512Situ,   MxPanel<false>, MxLayout::kFloat, 128, Avx512FmaProbe, Avx512RoundTripMxfp8,
      Avx512SituF32};
  return table;
}

const KernelTable& Avx512Bf16Kernels() {
  static const KernelTable table = {Isa::kAvx512Bf16,
                                    "avx512bf16",
                                    MxLayout::kBf16Pairs,
                                    128,
                                    Gemm,
                                    Mxfp4RowsBf16,
                                    Avx512Situ,
                                    PairPanel,
                                    MxLayout::kBf16PairsTm,
                                    32,
                                    Avx512FmaProbe,
                                    Avx512RoundTripMxfp8,
                                    Avx512SituF32,
                                    kPrefillTokens,
                                    Avx512Bf16DotProbe};
  return table;
}

}  // namespace moe::numerics::cpu
