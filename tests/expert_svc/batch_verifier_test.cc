// The production check against the CPU kernels on a synthetic mid expert range: a clean batch
// matches, a batch computed on weights with one corrupted byte is counted as a mismatch naming
// the expert (the reference regenerates the expert from the seed), and the sampling, the queue
// bound and reference errors are counted exactly.
#include "expert-svc/batch_verifier.h"

#include <algorithm>
#include <atomic>
#include <future>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"

namespace moe::expert_svc {
namespace {

using tensor::Bf16;

constexpr int64_t kLo = 10, kHi = 20;  // the served range

struct Fixture {
  ModelConfig cfg = *PresetConfig("mid");
  checkpoint::SyntheticOptions so;
  numerics::MoeLayerWeights serving;  // the server's copy (writable memory in synthetic mode)
  ThreadPool pool{2};

  Fixture() {
    so.seed = 3;
    serving = checkpoint::SyntheticExperts(cfg, 1, kLo, kHi, so);
  }
  // The reference source expert-svc uses in synthetic mode.
  BatchVerifier::ReferenceWeights Regenerate() const {
    return [cfg = cfg, so = so](int64_t layer,
                                int64_t e) -> absl::StatusOr<numerics::MoeLayerWeights> {
      return checkpoint::SyntheticExperts(cfg, layer, e, e + 1, so);
    };
  }
  // A batch of rows: `per_expert` rows for each expert in `experts` (ascending), one row per
  // pair, computed by the CPU kernels on the serving copy.
  struct Batch {
    numerics::Routing routing;
    std::vector<Bf16> z, y;
  };
  Batch Run(const std::vector<int32_t>& experts, int64_t per_expert) {
    Batch b;
    for (int32_t e : experts) {
      for (int64_t i = 0; i < per_expert; ++i) {
        b.routing.expert_ids.push_back(e);
        b.routing.weights.push_back(1.0f);
      }
    }
    b.routing.tokens = static_cast<int64_t>(b.routing.expert_ids.size());
    b.routing.top_k = 1;
    ModelConfig zc = cfg;
    zc.hidden = cfg.latent;
    b.z = checkpoint::SyntheticHiddenStates(zc, b.routing.tokens, 9);
    b.y = numerics::cpu::RunExperts(numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate),
                                    &pool, cfg, serving, b.routing, b.z.data());
    return b;
  }
};

struct Results {
  std::mutex mu;
  std::vector<std::pair<VerifyResult, std::string>> all;
  BatchVerifier::Sink Sink() {
    return [this](VerifyResult r, const std::string& d) {
      std::lock_guard<std::mutex> lock(mu);
      all.emplace_back(r, d);
    };
  }
};

// Every batch sampled.
BatchVerifierOptions EveryBatch() {
  BatchVerifierOptions o;
  o.fraction = 1.0;
  return o;
}

TEST(BatchVerifier, CleanBatchesMatchTheReference) {
  Fixture f;
  Results res;
  BatchVerifier v(f.cfg, EveryBatch(), f.Regenerate(), res.Sink());
  for (uint64_t id = 0; id < 3; ++id) {
    const auto b = f.Run({11, 14, 19}, 5);
    v.OnBatch(id, 1, b.routing, tensor::Activations::FromBf16(b.z, b.routing.tokens, f.cfg.latent),
              b.y.data());
    v.Drain();
  }
  const auto c = v.counts();
  EXPECT_EQ(c.sampled, 3);
  EXPECT_EQ(c.match, 3);
  EXPECT_EQ(c.mismatch + c.skipped + c.error, 0);
  // The three samples took the batch's experts in turn.
  ASSERT_EQ(res.all.size(), 3u);
  EXPECT_NE(res.all[0].second.find("expert 11"), std::string::npos) << res.all[0].second;
  EXPECT_NE(res.all[1].second.find("expert 14"), std::string::npos) << res.all[1].second;
  EXPECT_NE(res.all[2].second.find("expert 19"), std::string::npos) << res.all[2].second;
}

// A shard's batch keeps the activations as they arrived (distinct rows) and reads each batch
// row through z_rows: the check samples the same inputs as from a gathered copy. Here the rows
// are stored in reverse order; read through the map they match, read as if in order they do not.
TEST(BatchVerifier, RowsReadThroughZRowsAreTheBatchRows) {
  Fixture f;
  Results res;
  BatchVerifier v(f.cfg, EveryBatch(), f.Regenerate(), res.Sink());
  const auto b = f.Run({11, 14, 19}, 5);
  const int64_t n = b.routing.tokens, d = f.cfg.latent;
  std::vector<Bf16> stored(b.z.size());
  std::vector<int32_t> z_rows(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    z_rows[r] = static_cast<int32_t>(n - 1 - r);
    std::copy_n(b.z.begin() + r * d, d, stored.begin() + (n - 1 - r) * d);
  }
  const tensor::Activations z = tensor::Activations::FromBf16(stored, n, d);
  for (uint64_t id = 0; id < 3; ++id) {
    v.OnBatch(id, 1, b.routing, z, b.y.data(), z_rows);
    v.Drain();
  }
  EXPECT_EQ(v.counts().match, 3);
  EXPECT_EQ(v.counts().mismatch, 0);
  v.OnBatch(3, 1, b.routing, z, b.y.data());  // the stored order taken for the batch's
  v.Drain();
  EXPECT_EQ(v.counts().mismatch, 1);
}

TEST(BatchVerifier, ACorruptedWeightByteIsCountedAsAMismatch) {
  Fixture f;
  // One byte of expert 14's down-projection scales in the serving copy: its block of 32 weights
  // of output row 5 becomes 16x larger.
  numerics::ExpertWeights& e14 = f.serving.experts[14 - kLo];
  const_cast<uint8_t*>(e14.w2.scales)[5 * (e14.w2.cols / 32)] += 4;
  Results res;
  BatchVerifier v(f.cfg, EveryBatch(), f.Regenerate(), res.Sink());
  const auto b = f.Run({14}, 6);
  v.OnBatch(42, 1, b.routing, tensor::Activations::FromBf16(b.z, b.routing.tokens, f.cfg.latent),
            b.y.data());
  v.Drain();
  const auto c = v.counts();
  EXPECT_EQ(c.mismatch, 1);
  EXPECT_EQ(c.match, 0);
  ASSERT_EQ(res.all.size(), 1u);
  const std::string& detail = res.all[0].second;
  EXPECT_EQ(res.all[0].first, VerifyResult::kMismatch);
  // Named: batch, layer, expert, shape, and the worst element (row 5 of the output).
  for (const char* part :
       {"batch 42", "layer 1", "expert 14", "6 of the batch's 6 rows x 512", "column 5:"}) {
    EXPECT_NE(detail.find(part), std::string::npos) << part << " in: " << detail;
  }
  // The other experts of the range are untouched and still match.
  const auto clean = f.Run({15}, 6);
  v.OnBatch(43, 1, clean.routing,
            tensor::Activations::FromBf16(clean.z, clean.routing.tokens, f.cfg.latent),
            clean.y.data());
  v.Drain();
  EXPECT_EQ(v.counts().match, 1);
}

TEST(BatchVerifier, SamplesExactlyTheFractionOfBatches) {
  Fixture f;
  for (auto [fraction, want] :
       std::vector<std::pair<double, int64_t>>{{0.0, 0}, {0.25, 10}, {1e-3, 0}}) {
    BatchVerifierOptions o;
    o.fraction = fraction;
    BatchVerifier v(f.cfg, o, f.Regenerate(), nullptr);
    const auto b = f.Run({12}, 1);
    for (uint64_t id = 0; id < 40; ++id) {
      v.OnBatch(id, 1, b.routing,
                tensor::Activations::FromBf16(b.z, b.routing.tokens, f.cfg.latent), b.y.data());
      v.Drain();
    }
    EXPECT_EQ(v.counts().sampled, want) << fraction;
    EXPECT_EQ(v.counts().match, want) << fraction;
  }
}

TEST(BatchVerifier, AFullQueueAndAMissingReferenceAreCounted) {
  Fixture f;
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  std::atomic<int> calls{0};
  Results res;
  BatchVerifierOptions o = EveryBatch();
  o.max_pending = 2;
  auto regen = f.Regenerate();
  BatchVerifier v(
      f.cfg, o,
      [&](int64_t layer, int64_t e) -> absl::StatusOr<numerics::MoeLayerWeights> {
        if (calls++ == 0) {
          entered.set_value();
          go.wait();  // holds the background thread on the first sample
          return absl::UnavailableError("checkpoint file gone");
        }
        return regen(layer, e);
      },
      res.Sink());
  const auto b = f.Run({13}, 2);
  v.OnBatch(1, 1, b.routing, tensor::Activations::FromBf16(b.z, b.routing.tokens, f.cfg.latent),
            b.y.data());
  entered.get_future().wait();
  for (uint64_t id = 2; id <= 5; ++id)
    v.OnBatch(id, 1, b.routing, tensor::Activations::FromBf16(b.z, b.routing.tokens, f.cfg.latent),
              b.y.data());
  release.set_value();
  v.Drain();
  const auto c = v.counts();
  EXPECT_EQ(c.sampled, 5);
  EXPECT_EQ(c.error, 1);    // the first: no reference weights
  EXPECT_EQ(c.match, 2);    // two waited in the queue
  EXPECT_EQ(c.skipped, 2);  // the queue was full for the last two
  bool named = false;
  for (const auto& [r, d] : res.all) {
    named |= r == VerifyResult::kError && d.find("checkpoint file gone") != std::string::npos;
  }
  EXPECT_TRUE(named);
}

}  // namespace
}  // namespace moe::expert_svc
