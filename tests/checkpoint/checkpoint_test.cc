// Synthetic checkpoints written to disk, read back through the index, loaded by layer and by
// expert range; and the loader's errors for missing, mis-shaped and NaN-scaled tensors.
#include "services/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/checkpoint/k3_names.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/tools/layer_runner.h"

namespace moe::checkpoint {
namespace {

using numerics::MoeLayerWeights;

std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = ::testing::TempDir() + "/moe_" + tag + "_XXXXXX";
  char* dir = ::mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr);
  return tmpl;
}

void ExpectSameExperts(const ModelConfig& cfg, const MoeLayerWeights& a, const MoeLayerWeights& b,
                       int64_t lo, int64_t hi) {
  for (int64_t e = lo; e < hi; ++e) {
    const numerics::ExpertWeights* x = a.Expert(e);
    const numerics::ExpertWeights* y = b.Expert(e);
    ASSERT_NE(x, nullptr);
    ASSERT_NE(y, nullptr);
    const numerics::Mxfp4Matrix* mx[] = {&x->w1, &x->w3, &x->w2};
    const numerics::Mxfp4Matrix* my[] = {&y->w1, &y->w3, &y->w2};
    for (int m = 0; m < 3; ++m) {
      ASSERT_EQ(mx[m]->rows, my[m]->rows);
      ASSERT_EQ(mx[m]->cols, my[m]->cols);
      ASSERT_EQ(0, std::memcmp(mx[m]->packed, my[m]->packed, mx[m]->rows * mx[m]->cols / 2))
          << "expert " << e << " matrix " << m;
      ASSERT_EQ(0, std::memcmp(mx[m]->scales, my[m]->scales, mx[m]->rows * mx[m]->cols / 32));
    }
  }
}

class SyntheticCheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cfg_ = new ModelConfig(*PresetConfig("tiny"));
    dir_ = new std::string(MakeTempDir("sharded"));
    SyntheticOptions opt;
    opt.seed = 3;
    opt.router_skew = 1.0;
    opt.layers = {1, 2};
    opt.shard_bytes = 8 * cfg_->ExpertBytes();  // forces several shards
    ASSERT_TRUE(WriteSyntheticCheckpoint(*cfg_, *dir_, opt).ok());
  }
  static void TearDownTestSuite() {
    std::system(("rm -rf '" + *dir_ + "'").c_str());
    delete dir_;
    delete cfg_;
  }
  static SyntheticOptions Options() {
    SyntheticOptions opt;
    opt.seed = 3;
    opt.router_skew = 1.0;
    return opt;
  }

  static ModelConfig* cfg_;
  static std::string* dir_;
};
ModelConfig* SyntheticCheckpointTest::cfg_ = nullptr;
std::string* SyntheticCheckpointTest::dir_ = nullptr;

TEST_F(SyntheticCheckpointTest, IndexNamesEveryTensorAndShardsAreSeveral) {
  std::ifstream in(*dir_ + "/" + kIndexFileName);
  const auto index = nlohmann::json::parse(in);
  const auto& wm = index.at("weight_map");
  // 2 layers x (8 dense + 16 experts x 6 tensors).
  EXPECT_EQ(wm.size(), 2u * (8 + 16 * 6));
  std::set<std::string> files;
  for (auto it = wm.begin(); it != wm.end(); ++it) files.insert(it.value().get<std::string>());
  EXPECT_GE(files.size(), 4u);
  EXPECT_TRUE(wm.contains(ExpertTensorName(2, 15, "w2", "weight_scale")));
  EXPECT_TRUE(
      wm.contains("language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"));
}

TEST_F(SyntheticCheckpointTest, ConfigJsonReadsBack) {
  auto ckpt = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto cfg = (*ckpt)->LoadConfig();
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->hidden, cfg_->hidden);
  EXPECT_EQ(cfg->num_experts, cfg_->num_experts);
  EXPECT_EQ(cfg->name, "tiny");
}

TEST_F(SyntheticCheckpointTest, LoadedLayerEqualsTheInMemoryGenerator) {
  auto ckpt = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ckpt.ok());
  for (int64_t layer : {1, 2}) {
    auto w = LoadMoeLayer(**ckpt, *cfg_, layer, {});
    ASSERT_TRUE(w.ok()) << w.status();
    const MoeLayerWeights mem = SyntheticLayer(*cfg_, layer, Options());
    EXPECT_EQ(0, std::memcmp(w->gate.data(), mem.gate.data(), mem.gate.size() * 2));
    EXPECT_EQ(w->bias, mem.bias);
    EXPECT_EQ(
        0, std::memcmp(w->shared_down.data(), mem.shared_down.data(), mem.shared_down.size() * 2));
    ExpectSameExperts(*cfg_, *w, mem, 0, cfg_->num_experts);
  }
  // Different layers get different weights.
  const MoeLayerWeights l1 = SyntheticLayer(*cfg_, 1, Options());
  const MoeLayerWeights l2 = SyntheticLayer(*cfg_, 2, Options());
  EXPECT_NE(0, std::memcmp(l1.gate.data(), l2.gate.data(), l1.gate.size() * 2));
}

TEST_F(SyntheticCheckpointTest, ExpertRangeLoadsOnlyItsShards) {
  auto ckpt = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ckpt.ok());
  LoadOptions opt;
  opt.dense = false;
  opt.expert_lo = 3;
  opt.expert_hi = 7;
  auto w = LoadMoeLayer(**ckpt, *cfg_, 2, opt);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->has_dense);
  EXPECT_EQ(w->experts.size(), 4u);
  EXPECT_EQ(w->Expert(2), nullptr);
  EXPECT_EQ(w->Expert(7), nullptr);
  EXPECT_LE((*ckpt)->OpenShardCount(), 2);  // 4 experts of 8-expert shards span at most 2
  ExpectSameExperts(*cfg_, *w, SyntheticLayer(*cfg_, 2, Options()), 3, 7);
  EXPECT_TRUE(numerics::ValidateLayerWeights(*cfg_, *w, false, false).ok());
}

TEST_F(SyntheticCheckpointTest, ExpertsAreNotStoredInIdOrderInsideAShard) {
  auto ckpt = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ckpt.ok());
  auto ref = (*ckpt)->Get(ExpertTensorName(1, 4, "w1", "weight_packed"));  // a shard of 8
  ASSERT_TRUE(ref.ok());
  std::vector<std::pair<uint64_t, int>> by_offset;
  for (const TensorInfo& t : ref->file->tensors()) {
    const std::string suffix = ".w1.weight_packed";
    if (t.name.size() > suffix.size() &&
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const size_t at = t.name.find(".experts.") + 9;
      by_offset.push_back({t.begin, std::stoi(t.name.substr(at))});
    }
  }
  std::sort(by_offset.begin(), by_offset.end());
  ASSERT_GE(by_offset.size(), 4u);
  bool ascending = true;
  for (size_t i = 1; i < by_offset.size(); ++i) {
    ascending = ascending && by_offset[i].second > by_offset[i - 1].second;
  }
  EXPECT_FALSE(ascending);
}

TEST_F(SyntheticCheckpointTest, BadRequestsAreClearErrors) {
  auto ckpt = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ckpt.ok());
  auto not_moe = LoadMoeLayer(**ckpt, *cfg_, 0, {});
  EXPECT_EQ(not_moe.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(not_moe.status().message()).find("not a MoE layer"), std::string::npos);
  // A range outside the experts, and a config that disagrees with the tensors' shapes.
  LoadOptions bad_range;
  bad_range.expert_lo = 10;
  bad_range.expert_hi = 20;
  EXPECT_EQ(LoadMoeLayer(**ckpt, *cfg_, 1, bad_range).status().code(),
            absl::StatusCode::kInvalidArgument);
  ModelConfig wider = *cfg_;
  wider.hidden = 256;
  wider.latent = 128;
  auto mismatch = LoadMoeLayer(**ckpt, wider, 1, {});
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(mismatch.status().message()).find("gate.weight"), std::string::npos)
      << mismatch.status();
  EXPECT_NE(std::string(mismatch.status().message()).find("[16, 128]"), std::string::npos);
  ModelConfig more_layers = *cfg_;
  more_layers.num_layers = 5;
  auto missing = LoadMoeLayer(**ckpt, more_layers, 4, {});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("layers.4.block_sparse_moe.gate.weight"),
            std::string::npos)
      << missing.status();
}

TEST(Checkpoint, SingleFileCheckpointLoadsAndRunsForward) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const std::string dir = MakeTempDir("single");
  SyntheticOptions opt;
  opt.single_file = true;
  ASSERT_TRUE(WriteSyntheticCheckpoint(cfg, dir, opt).ok());
  struct stat st;
  EXPECT_NE(::stat((dir + "/" + kIndexFileName).c_str(), &st), 0);
  tools::ForwardRequest req;
  req.checkpoint = dir;
  req.tokens = 8;
  req.output = dir + "/out.safetensors";
  auto rep = tools::RunLayerForward(req);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->tokens, 8);
  // The output file holds the routing too.
  auto out = SafetensorsFile::Open(req.output);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)->Find("expert_ids")->shape, (std::vector<int64_t>{8, cfg.top_k}));
  // The same checkpoint opened as a file path works too.
  auto as_file = Checkpoint::Open(dir + "/" + kSingleFileName);
  ASSERT_TRUE(as_file.ok()) << as_file.status();
  EXPECT_TRUE((*as_file)->Contains(GateWeightName(1)));
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Overwrites bytes of one tensor inside a written single-file checkpoint.
void Poke(const std::string& path, const std::string& tensor, std::vector<uint8_t> bytes) {
  uint64_t at = 0;
  {
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok());
    const TensorInfo* t = (*f)->Find(tensor);
    ASSERT_NE(t, nullptr);
    at = (*f)->data_offset() + t->begin;
  }
  std::fstream io(path, std::ios::binary | std::ios::in | std::ios::out);
  io.seekp(static_cast<std::streamoff>(at));
  io.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

TEST(Checkpoint, NaNScaleAndNonFiniteDenseWeightsAreRejected) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const std::string dir = MakeTempDir("poison");
  SyntheticOptions opt;
  opt.single_file = true;
  ASSERT_TRUE(WriteSyntheticCheckpoint(cfg, dir, opt).ok());
  const std::string file = dir + "/" + kSingleFileName;
  Poke(file, ExpertTensorName(1, 5, "w3", "weight_scale"), {0xFF});
  {
    auto ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok());
    auto w = LoadMoeLayer(**ckpt, cfg, 1, {});
    EXPECT_EQ(w.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(w.status().message()).find("experts.5.w3.weight_scale"),
              std::string::npos)
        << w.status();
    LoadOptions others;
    others.expert_lo = 6;  // a range without the poisoned expert still loads
    EXPECT_TRUE(LoadMoeLayer(**ckpt, cfg, 1, others).ok());
  }
  Poke(file, NormWeightName(1), {0xc0, 0x7f});  // bf16 0x7fc0 is NaN (little endian)
  {
    auto ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok());
    LoadOptions dense_only;
    dense_only.expert_hi = 0;
    auto w = LoadMoeLayer(**ckpt, cfg, 1, dense_only);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(w.status().message()).find("routed_expert_norm.weight"),
              std::string::npos)
        << w.status();
  }
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(Checkpoint, BadIndexAndMissingFilesAreClear) {
  EXPECT_EQ(Checkpoint::Open("/nonexistent/ckpt").status().code(), absl::StatusCode::kNotFound);
  const std::string dir = MakeTempDir("index");
  EXPECT_EQ(Checkpoint::Open(dir).status().code(), absl::StatusCode::kNotFound);  // empty dir
  EXPECT_FALSE(ParseIndexJson("{}", "idx").ok());
  EXPECT_FALSE(ParseIndexJson(R"({"weight_map": {"a": 3}})", "idx").ok());
  const auto escape = ParseIndexJson(R"({"weight_map": {"a": "../../etc/passwd"}})", "idx");
  EXPECT_FALSE(escape.ok());
  EXPECT_NE(std::string(escape.status().message()).find("\"a\""), std::string::npos);
  // An index naming a shard that is not there: NOT_FOUND when the tensor is asked for.
  std::ofstream(dir + "/" + kIndexFileName) << R"({"weight_map": {"t": "gone.safetensors"}})";
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto t = (*ckpt)->Get("t");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(t.status().message()).find("gone.safetensors"), std::string::npos);
  EXPECT_EQ((*ckpt)->Get("u").status().code(), absl::StatusCode::kNotFound);
  std::system(("rm -rf '" + dir + "'").c_str());
}

}  // namespace
}  // namespace moe::checkpoint

namespace moe::checkpoint {
namespace {

TEST(SyntheticCheckpoint, DenseOnlyHoldsTheDensePartAndNoExperts) {
  const ModelConfig cfg = *PresetConfig("tiny");
  std::string tmpl = ::testing::TempDir() + "/moe_dense_only_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  SyntheticOptions opt;
  opt.seed = 4;
  opt.experts = false;
  ASSERT_TRUE(WriteSyntheticCheckpoint(cfg, dir, opt).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  LoadOptions dense;
  dense.expert_hi = 0;
  auto w = LoadMoeLayer(**ckpt, cfg, 1, dense);
  ASSERT_TRUE(w.ok()) << w.status();
  // The same dense bytes as the full checkpoint of that seed.
  opt.experts = true;
  const numerics::MoeLayerWeights full = SyntheticLayer(cfg, 1, opt);
  EXPECT_EQ(w->bias, full.bias);
  ASSERT_EQ(w->gate.size(), full.gate.size());
  EXPECT_EQ(std::memcmp(w->gate.data(), full.gate.data(), full.gate.size() * 2), 0);
  LoadOptions experts;
  experts.dense = false;
  auto missing = LoadMoeLayer(**ckpt, cfg, 1, experts);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

// An expert pod's synthetic checkpoint: only its range, bit-identical to the same experts of
// the whole layer, a fraction of its bytes; the others are not there.
TEST(SyntheticCheckpoint, AnExpertRangeHoldsOnlyThoseExperts) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const std::string dir = MakeTempDir("range_only");
  SyntheticOptions opt;
  opt.seed = 6;
  opt.expert_lo = 3;
  opt.expert_hi = 7;
  SyntheticReport part;
  ASSERT_TRUE(WriteSyntheticCheckpoint(cfg, dir, opt, &part).ok());
  SyntheticOptions all = opt;
  all.expert_lo = 0;
  all.expert_hi = -1;
  SyntheticReport whole;
  ASSERT_TRUE(WriteSyntheticCheckpoint(cfg, MakeTempDir("range_all"), all, &whole).ok());
  const int64_t expert_bytes = cfg.ExpertBytes();
  // 12 fewer experts: their bytes plus their entries in the safetensors header (< 1 KB each).
  EXPECT_GE(whole.bytes - part.bytes, (cfg.num_experts - 4) * expert_bytes);
  EXPECT_LT(whole.bytes - part.bytes, (cfg.num_experts - 4) * (expert_bytes + 1024));
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  LoadOptions range;
  range.expert_lo = 3;
  range.expert_hi = 7;
  auto w = LoadMoeLayer(**ckpt, cfg, 1, range);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectSameExperts(cfg, *w, SyntheticExperts(cfg, 1, 0, cfg.num_experts, all), 3, 7);
  LoadOptions outside;
  outside.expert_lo = 2;
  outside.expert_hi = 4;
  EXPECT_EQ(LoadMoeLayer(**ckpt, cfg, 1, outside).status().code(), absl::StatusCode::kNotFound);
  SyntheticOptions bad = opt;
  bad.expert_hi = cfg.num_experts + 1;
  EXPECT_EQ(WriteSyntheticCheckpoint(cfg, MakeTempDir("range_bad"), bad).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::checkpoint
