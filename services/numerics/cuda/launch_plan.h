// The launch geometry of the CUDA expert kernels, computed on the host (plain C++, no CUDA and
// no Abseil, so kernels.cu includes it and the CPU tests check it at the grid's limits). The
// expert FFN's grid is (column tiles, row tiles): gridDim.y is at most 65,535 on every CUDA
// device, so a batch with more 16-row tiles is launched in chunks of row tiles (each tile names
// its own rows, so a chunk is a sub-array of the tile table; no kernel change).
//
//   for (auto [first, count] : TileChunks(num_tiles)) {
//     GridDims g = ExpertFfnGrid(count, intermediate, kTileCols);  // g.ok: launch
//   }
#ifndef MOE_SERVICES_NUMERICS_CUDA_LAUNCH_PLAN_H_
#define MOE_SERVICES_NUMERICS_CUDA_LAUNCH_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace moe::numerics::cuda {

inline constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1
inline constexpr int64_t kMaxGridY = 65535;

struct GridDims {
  int64_t x = 0, y = 0;
  bool ok = false;  // within the device limits and non-empty
};

// One launch of the expert FFN over `num_tiles` row tiles and `cols` output columns in tiles
// of `tile_cols`: x = cols / tile_cols, y = num_tiles. Not ok for zero tiles, more than
// kMaxGridY row tiles, or cols not a positive multiple of tile_cols.
inline GridDims ExpertFfnGrid(int64_t num_tiles, int64_t cols, int64_t tile_cols) {
  GridDims g;
  if (num_tiles <= 0 || num_tiles > kMaxGridY || tile_cols <= 0 || cols <= 0 ||
      cols % tile_cols != 0 || cols / tile_cols > kMaxGridX) {
    return g;
  }
  g.x = cols / tile_cols;
  g.y = num_tiles;
  g.ok = true;
  return g;
}

// The row-tile chunks of one batch, {first tile, count}, each at most max_per_launch tiles.
inline std::vector<std::pair<int64_t, int64_t>> TileChunks(int64_t num_tiles,
                                                           int64_t max_per_launch = kMaxGridY) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (max_per_launch <= 0) return out;
  for (int64_t first = 0; first < num_tiles; first += max_per_launch) {
    out.emplace_back(first, std::min(max_per_launch, num_tiles - first));
  }
  return out;
}

// The oldest GPU generation the kernels are built and checked for: Ampere (sm_80), whose bf16
// tensor-core WMMA the expert kernel uses. The backend choice refuses older devices by name.
inline constexpr int kMinComputeMajor = 8;

}  // namespace moe::numerics::cuda

#endif  // MOE_SERVICES_NUMERICS_CUDA_LAUNCH_PLAN_H_
