// The CUDA backend's host side, on the CPU (no device needed): the launch geometry at the grid's
// limits, and what CudaExperts::Create accepts (shapes, NaN-coded MXFP4 scales refused by name
// before anything is uploaded).
#include <gtest/gtest.h>

#include <vector>

#include "services/checkpoint/synthetic.h"
#include "services/numerics/cuda/cuda_backend.h"
#include "services/numerics/cuda/expert_checks.h"
#include "services/numerics/cuda/launch_plan.h"
#include "services/numerics/mxfp4.h"

namespace moe::numerics::cuda {
namespace {

TEST(LaunchPlan, TheExpertGridStaysWithinTheDeviceLimits) {
  struct Case {
    int64_t tiles, cols, tile_cols;
    bool ok;
    int64_t x, y;
  };
  for (const Case& c : {Case{1, 7168, 64, true, 112, 1}, Case{65535, 3072, 64, true, 48, 65535},
                        Case{65536, 3072, 64, false, 0, 0}, Case{0, 3072, 64, false, 0, 0},
                        Case{-1, 3072, 64, false, 0, 0}, Case{16, 100, 64, false, 0, 0},
                        Case{16, 0, 64, false, 0, 0}, Case{16, 64, 0, false, 0, 0}}) {
    const GridDims g = ExpertFfnGrid(c.tiles, c.cols, c.tile_cols);
    EXPECT_EQ(g.ok, c.ok) << c.tiles << " tiles, " << c.cols << " cols";
    EXPECT_EQ(g.x, c.x);
    EXPECT_EQ(g.y, c.y);
  }
}

TEST(LaunchPlan, LargeBatchesAreLaunchedInChunksOfAtMost65535Tiles) {
  using Chunks = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(TileChunks(0), Chunks{});
  EXPECT_EQ(TileChunks(65535), (Chunks{{0, 65535}}));
  EXPECT_EQ(TileChunks(65536), (Chunks{{0, 65535}, {65535, 1}}));
  // K3 prefill: 16,384 tokens x 16 experts in 16-row tiles, plus one partial tile per expert.
  const int64_t tiles = 16384 * 16 / 16 + 896;
  int64_t covered = 0, next = 0;
  for (const auto& [first, count] : TileChunks(tiles)) {
    EXPECT_EQ(first, next);
    EXPECT_TRUE(ExpertFfnGrid(count, 3072, 64).ok);
    next = first + count;
    covered += count;
  }
  EXPECT_EQ(covered, tiles);
  EXPECT_EQ(TileChunks(10, 4), (Chunks{{0, 4}, {4, 4}, {8, 2}}));
}

TEST(ValidateCudaExperts, AcceptsGoodWeightsAndRefusesANanScaleByName) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 2, 6, {});
  ASSERT_TRUE(ValidateCudaExperts(cfg, w).ok()) << ValidateCudaExperts(cfg, w);
  // Expert 4's w3 with one scale byte 0xFF (NaN in E8M0): row 5, block 1.
  const int64_t blocks = Mxfp4ScaleBytes(cfg.latent);
  std::vector<uint8_t> scales(w.experts[2].w3.scales,
                              w.experts[2].w3.scales + cfg.intermediate * blocks);
  scales[static_cast<size_t>(5 * blocks + 1)] = kE8M0NaN;
  MoeLayerWeights bad = w;
  bad.experts[2].w3.scales = scales.data();
  const absl::Status s = ValidateCudaExperts(cfg, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expert 4 w3 scales: row 5 block 1 is 0xFF"), absl::string_view::npos)
      << s;
  // Create refuses it before it looks for a device (the message is the check's, not "no GPU").
  auto created = CudaExperts::Create(cfg, bad);
  ASSERT_FALSE(created.ok());
  EXPECT_NE(created.status().message().find("is 0xFF"), absl::string_view::npos);
  // Shapes the kernels are not written for.
  ModelConfig odd = cfg;
  odd.latent = 96;
  EXPECT_NE(ValidateCudaExperts(odd, w).message().find("multiples of 64"), absl::string_view::npos);
  MoeLayerWeights short_range = w;
  short_range.experts.pop_back();
  EXPECT_EQ(ValidateCudaExperts(cfg, short_range).code(), absl::StatusCode::kInvalidArgument);
  MoeLayerWeights missing = w;
  missing.experts[0].w2.packed = nullptr;
  EXPECT_NE(ValidateCudaExperts(cfg, missing).message().find("expert 2 w2"),
            absl::string_view::npos);
}

}  // namespace
}  // namespace moe::numerics::cuda
