// ValidateDispatch's whole-batch admission: the compute a batch asks for is bounded by the
// activations it carries (a distinct row feeds an expert once and the batch at most top-k
// times), and a batch whose reply could not be sent is refused before compute. The limits are
// ones a good batch (what dispatch_plan.cc builds) never passes: the last case builds one.
#include "expert-svc/dispatch_batch.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "services/tensor/bf16.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {
namespace {

constexpr int64_t kLatent = 64;
constexpr int64_t kTopK = 4;

const std::map<int64_t, numerics::MoeLayerWeights>& Layers() {
  static auto* layers = [] {
    auto* m = new std::map<int64_t, numerics::MoeLayerWeights>();
    numerics::MoeLayerWeights w;
    w.layer = 1;
    w.expert_lo = 0;
    w.expert_hi = 16;
    (*m)[1] = std::move(w);
    return m;
  }();
  return *layers;
}

DispatchLimits Limits(int64_t max_message_bytes = 1 << 20) {
  return DispatchLimits{"shard-t", 16, kLatent, max_message_bytes, {}, kTopK};
}

// `distinct` activation rows; groups[i] = (expert, its row_source entries).
v1::DispatchRequest MakeBatch(int64_t distinct,
                              const std::vector<std::pair<int32_t, std::vector<int32_t>>>& groups,
                              v1::ReplyMode mode = v1::REPLY_MODE_PER_PAIR) {
  v1::DispatchRequest r;
  r.set_batch_id(7);
  r.set_layer(1);
  r.set_reply_mode(mode);
  std::vector<tensor::Bf16> z(static_cast<size_t>(distinct * kLatent),
                              tensor::Bf16::FromFloat(0.25f));
  *r.mutable_activations() = transport::EncodeBf16(z, distinct, kLatent);
  for (const auto& [e, rows] : groups) {
    v1::ExpertGroup* g = r.add_groups();
    g->set_expert_id(e);
    g->set_token_count(static_cast<int32_t>(rows.size()));
    for (int32_t s : rows) {
      r.add_row_source(s);
      r.add_token_index(s);
      r.add_weights(0.5f);
    }
  }
  r.set_num_tokens(static_cast<int32_t>(distinct));
  return r;
}

TEST(DispatchAdmission, OneRowCannotFeedOneExpertTwice) {
  // The finding: one activations row, 262,144 row_source entries of 0 in one group (1 MB on
  // the wire) was admitted and cost 29 s of compute and 2.1 GB.
  const std::vector<int32_t> zeros(262144, 0);
  absl::StatusOr<std::unique_ptr<Batch>> b =
      ValidateDispatch(MakeBatch(1, {{3, zeros}}), nullptr, Limits(int64_t{1} << 30), Layers());
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("row_source[1] = 0 appears twice for expert 3"),
            std::string::npos)
      << b.status();
}

TEST(DispatchAdmission, OneRowFeedsAtMostTopKExperts) {
  std::vector<std::pair<int32_t, std::vector<int32_t>>> groups;
  for (int32_t e = 0; e < kTopK; ++e) groups.push_back({e, {0, 1}});
  EXPECT_TRUE(ValidateDispatch(MakeBatch(2, groups), nullptr, Limits(), Layers()).ok());
  groups.push_back({kTopK, {1}});
  absl::StatusOr<std::unique_ptr<Batch>> b =
      ValidateDispatch(MakeBatch(2, groups), nullptr, Limits(), Layers());
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("activations row 1 feeds more than 4 rows"),
            std::string::npos)
      << b.status();
}

TEST(DispatchAdmission, AReplyThatCannotBeSentIsRefusedBeforeCompute) {
  // Per pair: rows x D x 2 bytes back. 64 rows of 64 bf16 = 8 KiB of outputs.
  std::vector<std::pair<int32_t, std::vector<int32_t>>> groups;
  std::vector<int32_t> all(64);
  for (int32_t i = 0; i < 64; ++i) all[i] = i;
  groups.push_back({5, all});
  const int64_t fits = 64 * kLatent * 2 + kReplyOverheadBytes;
  EXPECT_TRUE(ValidateDispatch(MakeBatch(64, groups), nullptr, Limits(fits), Layers()).ok());
  absl::StatusOr<std::unique_ptr<Batch>> b =
      ValidateDispatch(MakeBatch(64, groups), nullptr, Limits(fits - 1), Layers());
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_NE(b.status().message().find("the reply would carry 8192 bytes of outputs"),
            std::string::npos)
      << b.status();
  // Partial sums: distinct tokens x D x 4 (f32), twice the bytes per row.
  const int64_t fits_f32 = 64 * kLatent * 4 + kReplyOverheadBytes;
  EXPECT_TRUE(ValidateDispatch(MakeBatch(64, groups, v1::REPLY_MODE_PARTIAL_SUM), nullptr,
                               Limits(fits_f32), Layers())
                  .ok());
  EXPECT_EQ(ValidateDispatch(MakeBatch(64, groups, v1::REPLY_MODE_PARTIAL_SUM), nullptr,
                             Limits(fits_f32 - 1), Layers())
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(DispatchAdmission, AGoodBatchPassesEveryBound) {
  // What an attention node sends: 32 tokens, each to kTopK distinct experts, rows grouped by
  // expert (a token's row once per expert).
  std::vector<std::pair<int32_t, std::vector<int32_t>>> groups(16);
  for (int32_t e = 0; e < 16; ++e) groups[e].first = e;
  for (int32_t t = 0; t < 32; ++t) {
    for (int32_t j = 0; j < kTopK; ++j) groups[(t + 5 * j) % 16].second.push_back(t);
  }
  absl::StatusOr<std::unique_ptr<Batch>> b =
      ValidateDispatch(MakeBatch(32, groups), nullptr, Limits(), Layers());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->rows, int64_t{32} * kTopK);
}

// Out-of-band bf16 activations with an owner are read where they landed (no copy): the batch's
// rows are the payload's bytes themselves, kept alive by the owner after the caller let go;
// without an owner, or at an odd address, they are copied; a non-finite value is refused
// either way, naming its row and column.
TEST(DispatchInPlace, ActivationsWithAnOwnerAreReadWhereTheyLanded) {
  const int64_t rows = 3;
  v1::DispatchRequest req = MakeBatch(rows, {{2, {0, 1, 2}}});
  const std::string wire = req.activations().data();
  req.mutable_activations()->clear_data();  // out of band, as a batch message
  // The payload at offset 0 (aligned) and at offset 1 (odd) of an owned buffer.
  auto landed = [&](size_t at) {
    auto buf = std::make_shared<std::vector<char>>(wire.size() + 2);
    std::memcpy(buf->data() + at, wire.data(), wire.size());
    return buf;
  };
  {
    auto owned = landed(0);
    const std::string_view oob(owned->data(), wire.size());
    const std::weak_ptr<const void> alive = owned;
    auto b = ValidateDispatch(req, &oob, Limits(), Layers(), owned);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE((*b)->z.viewed());
    EXPECT_EQ(static_cast<const void*>((*b)->z.bf16().data()),
              static_cast<const void*>(oob.data()));
    owned.reset();
    EXPECT_FALSE(alive.expired()) << "the batch keeps its activations' buffer";
    EXPECT_EQ(std::memcmp((*b)->z.bf16().data(), wire.data(), wire.size()), 0);
    b->reset();
    EXPECT_TRUE(alive.expired()) << "and lets it go with the batch";
  }
  for (const bool with_owner : {false, true}) {
    auto owned = landed(with_owner ? 1 : 0);  // no owner, or an odd address: a copy
    const std::string_view oob(owned->data() + (with_owner ? 1 : 0), wire.size());
    auto b = ValidateDispatch(req, &oob, Limits(), Layers(), with_owner ? owned : nullptr);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_FALSE((*b)->z.viewed());
    EXPECT_EQ(std::memcmp((*b)->z.bf16().data(), wire.data(), wire.size()), 0);
  }
  {
    auto owned = landed(0);
    const tensor::Bf16 inf = tensor::Bf16::FromBits(0x7f80);
    std::memcpy(owned->data() + (2 * kLatent + 5) * sizeof(tensor::Bf16), &inf, sizeof(inf));
    const std::string_view oob(owned->data(), wire.size());
    auto b = ValidateDispatch(req, &oob, Limits(), Layers(), owned);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
    EXPECT_NE(b.status().message().find("activations row 2 column 5 is not finite"),
              std::string::npos)
        << b.status();
  }
}

}  // namespace
}  // namespace moe::expert_svc
