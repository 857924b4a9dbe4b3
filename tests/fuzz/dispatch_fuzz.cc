// libFuzzer target: expert-svc's DispatchRequest validation (expert-svc/dispatch_batch.h) on
// any bytes: a request either parses and validates into a batch whose sizes agree with each
// other and with the limits, or is refused; nothing crashes, nothing is allocated past what
// the message carries (ASan's allocation limit, -malloc_limit_mb in scripts/fuzz.sh, would
// trip).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "expert-svc/dispatch_batch.h"
#include "moe/v1/expert.pb.h"
#include "services/numerics/precision_mode.h"

namespace {

const std::map<int64_t, moe::numerics::MoeLayerWeights>& Layers() {
  static auto* layers = [] {
    auto* m = new std::map<int64_t, moe::numerics::MoeLayerWeights>();
    moe::numerics::MoeLayerWeights w;
    w.layer = 1;
    w.expert_lo = 2;
    w.expert_hi = 9;
    (*m)[1] = std::move(w);
    return m;
  }();
  return *layers;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moe::v1::DispatchRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  // Latent 32: one MXFP8 block per row, so W4A8 batches (MXFP8 or BF16 rows) validate too.
  const moe::expert_svc::DispatchLimits limits{
      "fuzz",
      16,
      32,
      1 << 17,
      {moe::numerics::Precision::kW4A16, moe::numerics::Precision::kW4A8},
      /*top_k=*/4};
  auto b = moe::expert_svc::ValidateDispatch(req, nullptr, limits, Layers());
  {
    // The same batch with its activations out of band in a buffer it may keep (a batch
    // message's: read in place): the same verdict and the same rows.
    moe::v1::DispatchRequest oob_req = req;
    auto owned = std::make_shared<const std::string>(req.activations().data());
    oob_req.mutable_activations()->clear_data();
    const std::string_view oob(*owned);
    auto v = moe::expert_svc::ValidateDispatch(oob_req, &oob, limits, Layers(), owned);
    if (v.ok() != b.ok() || v.status().code() != b.status().code()) __builtin_trap();
    if (v.ok() && (*v)->z.format() == moe::tensor::ActivationFormat::kBf16) {
      const auto x = (*b)->z.bf16(), y = (*v)->z.bf16();
      if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * 2) != 0) {
        __builtin_trap();
      }
    }
  }
  if (!b.ok()) return 0;
  const moe::expert_svc::Batch& batch = **b;
  if (batch.rows < 1 || batch.rows * limits.latent * 2 >
                            limits.max_message_bytes - moe::expert_svc::kReplyOverheadBytes) {
    __builtin_trap();
  }
  // The compute is bounded by the rows carried: each distinct row at most top-k times.
  if (req.row_source_size() != 0) {
    std::map<int32_t, int64_t> uses;
    for (int32_t s : req.row_source()) {
      if (++uses[s] > limits.top_k) __builtin_trap();
    }
  }
  // z holds the rows as they arrived: one per batch row, or the distinct ones that z_rows (one
  // per batch row) points into.
  const int64_t z_count = batch.z.rows();
  if (batch.z_rows.empty() ? z_count != batch.rows
                           : static_cast<int64_t>(batch.z_rows.size()) != batch.rows) {
    __builtin_trap();
  }
  for (int32_t r : batch.z_rows) {
    if (r < 0 || r >= z_count) __builtin_trap();
  }
  if (batch.precision == moe::numerics::Precision::kW4A8) {
    const moe::tensor::Mxfp8Rows& z8 = batch.z.mxfp8();
    if (batch.z.format() != moe::tensor::ActivationFormat::kMxfp8 || z8.rows != z_count ||
        z8.cols != limits.latent ||
        static_cast<int64_t>(z8.codes.size()) != z_count * limits.latent ||
        static_cast<int64_t>(z8.scales.size()) != z_count * limits.latent / 32) {
      __builtin_trap();
    }
    for (uint8_t c : z8.codes) {
      if ((c & 0x7F) == 0x7F) __builtin_trap();  // NaN codes are refused
    }
  } else if (batch.z.format() != moe::tensor::ActivationFormat::kBf16 ||
             static_cast<int64_t>(batch.z.bf16().size()) != z_count * limits.latent) {
    __builtin_trap();
  }
  if (static_cast<int64_t>(batch.routing.expert_ids.size()) != batch.rows) __builtin_trap();
  for (int32_t e : batch.routing.expert_ids) {
    if (!batch.layer->HostsExpert(e)) __builtin_trap();
  }
  if (batch.mode == moe::v1::REPLY_MODE_PARTIAL_SUM) {
    if (static_cast<int64_t>(batch.token_index.size()) != batch.rows) __builtin_trap();
    for (int32_t t : batch.token_index) {
      if (t < 0 || t >= batch.num_tokens) __builtin_trap();
    }
  }
  (void)moe::expert_svc::BatchBudget(req.timeout_ms()).count();
  return 0;
}
