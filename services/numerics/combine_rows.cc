// numerics::CombineRows (combine.h), apart from combine.cc: that file is in the GPU check's
// standalone build (tests/gpu: the reference sources only, no thread pool).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "services/common/thread_pool.h"
#include "services/numerics/combine.h"

namespace moe::numerics {
namespace {

// One token: its slots in ascending expert id (ref::Combine's order), each product rounded to
// fp32 before it is added (no FMA: -ffp-contract=off), from 0.0f. Columns in blocks of 16 with a
// fixed inner count so that the compiler vectorizes them (lanes are columns: the order of each
// column's sum is unchanged).
void CombineToken(const int32_t* ids, const float* weights, const tensor::Bf16* const* rows,
                  int64_t k, int64_t latent, int64_t* slots, float* acc, tensor::Bf16* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;  // dropped by the budget (dynamic_k.h)
    int64_t at = n++;
    for (; at > 0 && ids[slots[at - 1]] > ids[j]; --at) slots[at] = slots[at - 1];
    slots[at] = j;
  }
  std::fill(acc, acc + latent, 0.0f);
  constexpr int64_t kBlock = 16;
  const int64_t whole = latent - latent % kBlock;
  for (int64_t i = 0; i < n; ++i) {
    const float w = weights[slots[i]];
    const tensor::Bf16* y = rows[slots[i]];
    if (y == nullptr) {  // a row no one sent: zeros, as in a zeroed [T, k, D] gather
      for (int64_t c = 0; c < latent; ++c) acc[c] = acc[c] + 0.0f * w;
      continue;
    }
    for (int64_t c = 0; c < whole; c += kBlock) {
      for (int64_t b = 0; b < kBlock; ++b) {
        const float product = y[c + b].ToFloat() * w;
        acc[c + b] = acc[c + b] + product;
      }
    }
    for (int64_t c = whole; c < latent; ++c) {
      const float product = y[c].ToFloat() * w;
      acc[c] = acc[c] + product;
    }
  }
  for (int64_t c = 0; c < latent; ++c) out[c] = tensor::Bf16::FromFloat(acc[c]);
}

}  // namespace

void CombineRows(const Routing& routing, const tensor::Bf16* const* rows, int64_t latent,
                 tensor::Bf16* r, ThreadPool* pool) {
  const int64_t k = routing.top_k, tokens = routing.tokens;
  // Blocks of tokens worth a hand-off: ~64K products each (a wake-up here costs ~10-20 us).
  const int64_t per_block =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, k * latent));
  const int64_t blocks = (tokens + per_block - 1) / per_block;
  auto block = [&](int64_t b) {
    std::vector<float> acc(static_cast<size_t>(latent));
    std::vector<int64_t> slots(static_cast<size_t>(k));
    const int64_t end = std::min(tokens, (b + 1) * per_block);
    for (int64_t t = b * per_block; t < end; ++t) {
      CombineToken(routing.expert_ids.data() + t * k, routing.weights.data() + t * k, rows + t * k,
                   k, latent, slots.data(), acc.data(), r + t * latent);
    }
  };
  if (pool == nullptr || blocks < 2 || !pool->TryParallelFor(blocks, block)) {
    for (int64_t b = 0; b < blocks; ++b) block(b);
  }
}

}  // namespace moe::numerics
