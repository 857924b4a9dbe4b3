// AMX kernels (AMX-TILE, AMX-BF16 on top of AVX-512 F/BW/DQ/VL/BF16): the prefill panel of the
// MXFP4 experts on the tile unit. This file alone is compiled with -mamx-*; everything here has
// internal linkage except the table, so no AMX instruction runs before DetectIsa() found the
// unit usable (CPUID, the OS's XTILEDATA state, and the process's permission to use it).
//
// The panel: weights decoded from MXFP4 to bf16 once per 32-row block (exact: an E2M1 value
// times a power of two is a bf16 value; the block scale is added to the exponent), activations
// token-major as bf16 pairs (kBf16PairsTm: column pair p of token t in one 32-bit slot, so a
// 16 x 16 block of slots is a TDPBF16PS B tile read in place), and 2 x 2 tiles of 16 rows x 16
// tokens accumulated in fp32 over the columns, 32 per TDPBF16PS. Products are exact; sums are
// the unit's fp32 sums in pairs, so results differ from the reference by fp32 rounding (the
// consistency test's tolerances). Block scales outside [2^-63, 2^63] (never in a trained
// checkpoint) take a plain fp32 path.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "services/numerics/cpu/kernels.h"

namespace moe::numerics::cpu {
namespace {

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 rows x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 pair rows x 16
// tokens). Tile state is per thread: configured on a thread's first panel.
void ConfigureTiles() {
  thread_local bool configured = false;
  if (configured) return;
  alignas(64) TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
  configured = true;
}

// Rows [r, r + 16) of the block (rows past `valid` zero) decoded to bf16 A tiles, one per
// 32-column chunk: a[(kc * 16 + row) * 32 + column].
void DecodeTiles(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r,
                 int64_t valid, uint16_t* a) {
  const int64_t chunks = cols / 32;
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= valid) {
      for (int64_t kc = 0; kc < chunks; ++kc) {
        _mm512_store_si512(a + (kc * 16 + i) * 32, _mm512_setzero_si512());
      }
      continue;
    }
    DecodeBf16Pairs(packed + (r + i) * (cols / 2), scales + (r + i) * (cols / 32), 0, chunks,
                    a + i * 32, 16 * 32);
  }
}

void AmxPanel(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1,
              const float* xt, int64_t ld_t, int64_t tokens, float* out, int64_t ld_out) {
  if (!PairPanelFits(scales, cols, r0, r1)) {
    PairPanelExact(packed, scales, cols, r0, r1, xt, ld_t, tokens, out, ld_out);
    return;
  }
  ConfigureTiles();
  const int64_t chunks = cols / 32, rows = r1 - r0;
  const int64_t stride = ld_t * 4;  // bytes between pair rows of the activations
  uint16_t* a = static_cast<uint16_t*>(
      std::aligned_alloc(64, static_cast<size_t>(2 * chunks * 16 * 32 * sizeof(uint16_t))));
  uint16_t* a1 = a + chunks * 16 * 32;
  alignas(64) float c[16 * 16];
  auto store = [&](int64_t rb, int64_t tb) {
    for (int64_t i = 0; i < 16 && rb + i < rows; ++i) {
      for (int64_t t = 0; t < 16 && tb + t < tokens; ++t)
        out[(tb + t) * ld_out + rb + i] = c[i * 16 + t];
    }
  };
  for (int64_t rb = 0; rb < rows; rb += 32) {
    DecodeTiles(packed, scales, cols, r0 + rb, rows - rb, a);
    DecodeTiles(packed, scales, cols, r0 + rb + 16, rows - rb - 16, a1);
    for (int64_t tb = 0; tb < tokens; tb += 32) {
      const bool two = tb + 16 < tokens;  // ld_t is a multiple of 16: the second tile is there
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kc = 0; kc < chunks; ++kc) {
        const char* b = reinterpret_cast<const char*>(xt + kc * 16 * ld_t + tb);
        _tile_loadd(4, a + kc * 16 * 32, 64);
        _tile_loadd(5, a1 + kc * 16 * 32, 64);
        _tile_loadd(6, b, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
          _tile_loadd(7, b + 64, stride);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, 64);
      store(rb, tb);
      _tile_stored(2, c, 64);
      store(rb + 16, tb);
      if (two) {
        _tile_stored(1, c, 64);
        store(rb, tb + 16);
        _tile_stored(3, c, 64);
        store(rb + 16, tb + 16);
      }
    }
  }
  std::free(a);
}

}  // namespace

namespace {

// The table is built at run time from the BF16 set's, and this file is compiled for AMX: without
// the attribute the copy is made with AVX-512 moves, and KernelsFor(kAvx512Amx) stopped a process
// on a CPU without AVX-512 (SIGILL; AMD Zen 3). A table is data that any CPU may read (the kernel
// choice and the tests list every set); only its kernels need the ISA.
__attribute__((target("no-avx"))) KernelTable MakeAmxTable() {
  KernelTable t = Avx512Bf16Kernels();  // decode rows, GEMM, SiTU: the BF16 set's
  t.isa = Isa::kAvx512Amx;
  t.name = "avx512amx";
  t.mxfp4_rows_tm = AmxPanel;
  t.tm_layout = MxLayout::kBf16PairsTm;
  t.tm_chunk = 32;
  return t;
}

}  // namespace

__attribute__((target("no-avx"))) const KernelTable& AmxKernels() {
  static const KernelTable table = MakeAmxTable();
  return table;
}

}  // namespace moe::numerics::cpu
