#include "services/numerics/cpu/packed_linear.h"

namespace moe::numerics::cpu {

namespace {
// Token rows per work item: enough to keep a tile's weights hot in L2 across the rows.
constexpr int64_t kTokenBlock = 96;
}  // namespace

PackedLinear PackedLinear::Pack(const tensor::Bf16* w, int64_t out, int64_t in) {
  PackedLinear p;
  p.in_ = in;
  p.out_ = out;
  p.padded_out_ = (out + kGemmColumnTile - 1) / kGemmColumnTile * kGemmColumnTile;
  p.tiles_.assign(static_cast<size_t>(p.padded_out_ * in), 0);
  for (int64_t o = 0; o < out; ++o) {
    uint16_t* tile = p.tiles_.data() + (o / kGemmColumnTile) * in * kGemmColumnTile;
    const int64_t c = o % kGemmColumnTile;
    for (int64_t k = 0; k < in; ++k) tile[k * kGemmColumnTile + c] = w[o * in + k].bits;
  }
  return p;
}

void PackedLinear::Apply(const KernelTable& k, ThreadPool* pool, const float* x, int64_t tokens,
                         float* y) const {
  const int64_t tiles = padded_out_ / kGemmColumnTile;
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  pool->ParallelFor(tiles * blocks, [&](int64_t item) {
    const int64_t tile = item % tiles, block = item / tiles;
    const int64_t t0 = block * kTokenBlock;
    const int64_t rows = std::min(kTokenBlock, tokens - t0);
    k.gemm(x + t0 * in_, rows, in_, tiles_.data(), tile * kGemmColumnTile,
           (tile + 1) * kGemmColumnTile, y + t0 * padded_out_, padded_out_);
  });
}

}  // namespace moe::numerics::cpu
