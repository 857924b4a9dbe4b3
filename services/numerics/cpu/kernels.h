// The raw CPU kernels behind the optimized ops, one table per instruction set. Kernels take raw
// pointers and never allocate; the op layer (packed_linear.h, expert_ffn.h, moe_layer.h) owns
// buffers, threads and validation.
//
// Layouts:
//  * gemm: x fp32 [tokens, in] row-major; wt: the Linear weight [out, in] repacked as column
//    tiles of 128 outputs, tile j = bf16 bits [in, 128] at wt + j * in * 128 (zero-padded past
//    `out`), so a tile streams sequentially; y fp32 [tokens, ld_y]. Computes columns [o0, o1)
//    (multiples of 128). Each output is summed over `in` in ascending order from 0 with exact
//    bf16 x bf16 products (FMA == multiply + add here), so every ISA agrees bit for bit with
//    ref::LinearF32.
//  * mxfp4_rows: rows [r0, r1) of an MXFP4 matrix in its checkpoint layout (never unpacked in
//    memory) times activations in the table's layout (PrepareActivations, ld_xp 32-bit slots
//    per token) -> out fp32 [tokens, ld_out], row r of the matrix in column r - r0. The
//    products are exact, but the sums are split over vector lanes (and, with AVX512-BF16,
//    over bf16 pairs), so results differ from the reference by fp32 rounding.
//  * mxfp8_roundtrip: values through MXFP8 and back (numerics/mxfp8.h): the block scale from the
//    block's amax by its exponent bits, the E4M3 rounding as integer rounding of the fp32
//    mantissa (vroundps below 2^-6), no codes materialized.
//  * situ: h = bf16(SiTU(bf16(g), bf16(u))) elementwise, fp32 in and out, with vectorized exp
//    and tanh (a few fp32 ulp from the reference's correctly rounded ones); situ_f32 the same
//    without the final bf16 rounding (W4A8's h, quantized to MXFP8 from fp32 as deployed
//    stacks do: docs/math.md section 6).
#ifndef MOE_SERVICES_NUMERICS_CPU_KERNELS_H_
#define MOE_SERVICES_NUMERICS_CPU_KERNELS_H_

#include <cstdint>

#include "services/numerics/cpu/cpu_isa.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cpu {

inline constexpr int64_t kGemmColumnTile = 128;
// The per-ISA tables' switch to the panel kernel (tokens per expert); services use a measured one.
inline constexpr int64_t kPrefillTokens = 16;

// How mxfp4_rows wants its activations (one token = a run of 32-bit slots):
//  kFloat:     fp32, column i of chunk c at slot c * chunk + (i % 8) * (chunk / 8) + (i % chunk) /
//  8
//              (identity when chunk == 8);
//  kBf16Pairs: bf16 pairs for vdpbf16ps, 128-column chunks of 64 slots: column 8l + m of a chunk
//              in slot (m % 4) * 16 + l, low half for m < 4, high half otherwise;
//  kByteLut:   fp32 in the order the AVX2 byte-shuffle decode produces, 64-column chunks (32
//              packed bytes, one ymm load): column i = 32 L + 2 j + h of a chunk (L: 128-bit
//              half, j: byte in that half, h: high nibble) in slot 8 n + 4 L + q, with
//              n = 4 h + 2 (j / 8) + j % 2 and q = (j % 8) / 2 (kernels_avx2.cc).
//  kBf16PairsTm (token-major only, mxfp4_rows_tm of the AVX512-BF16 and AMX sets): columns 2p
//              and 2p + 1 of a token as bf16 in slot p (low half the even column), so that one
//              slot of 16 tokens is a vdpbf16ps operand and 16 slots x 16 tokens one AMX B tile,
//              in place; 32-column chunks.
enum class MxLayout { kFloat, kBf16Pairs, kByteLut, kBf16PairsTm };

struct KernelTable {
  Isa isa;
  const char* name;
  MxLayout mx_layout;
  int64_t mx_chunk;  // columns per chunk (kFloat)
  void (*gemm)(const float* x, int64_t tokens, int64_t in, const uint16_t* wt, int64_t o0,
               int64_t o1, float* y, int64_t ld_y);
  void (*mxfp4_rows)(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                     int64_t r1, const float* xp, int64_t ld_xp, int64_t tokens, float* out,
                     int64_t ld_out);
  void (*situ)(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* h);
  // Prefill variant of mxfp4_rows (null where the ISA has none): activations token-major,
  // xt[slot * ld_t + token] in the slot order of tm_layout (TokenMajorSlot) and ld_t a
  // multiple of 16 (padding tokens zero). Dequantizes a panel of rows once (to fp32, or to bf16
  // with the block scales in the exponents) and runs an FMA, vdpbf16ps or AMX tile microkernel
  // over it, so the decode cost is shared by all tokens.
  void (*mxfp4_rows_tm)(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                        int64_t r1, const float* xt, int64_t ld_t, int64_t tokens, float* out,
                        int64_t ld_out);
  // The slot order of mxfp4_rows_tm's token-major activations (kFloat with tm_chunk columns per
  // chunk, kByteLut, or kBf16PairsTm).
  MxLayout tm_layout;
  int64_t tm_chunk;
  // The fp32 multiply-add peak probe of this ISA: `iters` iterations of independent
  // register-resident FMA chains (more chains than latency x ports); returns the flops done.
  double (*fma_probe)(int64_t iters);
  // W4A8's h: n values (n a multiple of 32, blocks of 32 consecutive values) rounded through
  // MXFP8 in place, bit for bit numerics::RoundTripMxfp8Rows (the scalar table calls it). Finite
  // input only.
  void (*mxfp8_roundtrip)(float* values, int64_t n);
  void (*situ_f32)(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                   float* h);
  // Tokens per expert from which expert_ffn runs mxfp4_rows_tm (where the table has one): the
  // per-ISA tables say kPrefillTokens, a measured choice (kernel_choice.h) its own crossover.
  int64_t panel_from = kPrefillTokens;
  // The vdpbf16ps peak probe (the instruction the BF16 rows and pair panel multiply with), as
  // fma_probe: `iters` iterations of independent register-resident chains, returns the flops.
  // Null in sets without AVX512-BF16.
  double (*dot_probe)(int64_t iters) = nullptr;
};

const KernelTable& KernelsFor(Isa isa);

// Per-ISA tables (defined in kernels_<isa>.cc).
const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();
const KernelTable& Avx512Bf16Kernels();
const KernelTable& AmxKernels();

// 32-bit slots per token for `cols` columns (padding included).
int64_t ActivationSlots(const KernelTable& k, int64_t cols);
// Slot of column i in a float layout (kFloat, kByteLut; not kBf16Pairs, whose slots hold pairs).
int64_t ActivationSlot(const KernelTable& k, int64_t i);
// Stores column i of one token (v must be a bf16 value for kBf16Pairs: z and h are).
void StoreActivation(const KernelTable& k, float* slots, int64_t i, float v);
// x fp32 [tokens, cols] -> [tokens, ActivationSlots] in the table's layout, padding zeroed.
void PrepareActivations(const KernelTable& k, const float* x, int64_t tokens, int64_t cols,
                        float* slots);
// Token-major layout of mxfp4_rows_tm: slots per token column (padding included) and the slot
// of column i.
int64_t TokenMajorSlots(const KernelTable& k, int64_t cols);
int64_t TokenMajorSlot(const KernelTable& k, int64_t i);
// Column i of token t into token-major activations (xt[slot * ld_t + t]; v must be a bf16 value
// for kBf16PairsTm, which stores its half of a pair).
void StoreTokenMajor(const KernelTable& k, float* xt, int64_t ld_t, int64_t i, int64_t t, float v);
// Tokens per tile of the prefill's data movements (StoreTokenRows, and expert_ffn.cc's h and z
// into token-major activations): 16 fp32 values, one cache line of each row.
inline constexpr int64_t kTokenTile = 16;
// Rows ahead whose block a prefill panel prefetches while it decodes one (AVX-512 and AVX2): a
// row's block is too short a stream for the hardware prefetcher. 4 as good, 16 worse
// (services/numerics/cpu/README.md, "Panel rows prefetched ahead").
inline constexpr int64_t kPanelAhead = 8;
// The panels' sums [rows, ld_t] into mxfp4_rows_tm's output: out[t * ld_out + r] =
// acc[r * ld_t + t]. In tiles of 16 tokens (one cache line of each row's sums), so the lines of
// out that a tile writes stay in L1 across its rows: walking all tokens per row missed once
// per (row, token) when out exceeds L2 (from about 2,048 tokens per expert). The panels call
// it per token pass of their last column block, while that pass's sums are in L2.
void StoreTokenRows(const float* acc, int64_t ld_t, int64_t rows, int64_t tokens, float* out,
                    int64_t ld_out);
// The bf16 pair panels (mxfp4_rows_tm of the AVX512-BF16 set on vdpbf16ps and of the AMX set on
// tiles), called only from the BF16 and AMX kernels.
// 32-column chunks [k0, k1) of one MXFP4 row (packed bytes `row`, E8M0 scales `srow`) as bf16 in
// column order, chunk k at dst + (k - k0) * stride: each E2M1 value with its block scale added
// to the exponent (exact where PairPanelFits: an E2M1 value times a power of two is a bf16).
// Defined in kernels_avx512.cc.
void DecodeBf16Pairs(const uint8_t* row, const uint8_t* srow, int64_t k0, int64_t k1, uint16_t* dst,
                     int64_t stride);
// Whether a pair panel can take rows [r0, r1): cols a multiple of 32 and every block scale in
// [2^-63, 2^63], so each E2M1 value times it is a normal bf16 and products with activations stay
// far from fp32's subnormals and overflow (trained scales lie near 2^-10 .. 2^0).
bool PairPanelFits(const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1);
// The exact path where a pair panel does not fit: each row dequantized as the reference does
// (DequantizeMxfp4Row) and summed in column order over kBf16PairsTm activations;
// mxfp4_rows_tm's signature.
void PairPanelExact(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                    int64_t r1, const float* xt, int64_t ld_t, int64_t tokens, float* out,
                    int64_t ld_out);
// The AVX-512 tables' SiTU (rounded to bf16, and fp32), fp32 FMA and vdpbf16ps peak probes and
// MXFP8 round trip, with the tables' signatures (kernels_avx512_elementwise.cc; called only
// from kernels_avx512.cc's tables).
void Avx512Situ(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* h);
void Avx512SituF32(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                   float* h);
double Avx512FmaProbe(int64_t iters);
double Avx512Bf16DotProbe(int64_t iters);
void Avx512RoundTripMxfp8(float* values, int64_t n);
// A kBf16PairsTm slot from its two bf16 values (the even column's in the low half).
inline uint32_t Bf16PairBits(float even, float odd) {
  return (tensor::FloatBits(odd) & 0xFFFF0000u) | (tensor::FloatBits(even) >> 16);
}

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_KERNELS_H_
