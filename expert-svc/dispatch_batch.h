// A Dispatch batch checked against what a shard hosts, before anything the request implies is
// allocated or computed: its rows and its reply bounded by --max_message_bytes, row_source and
// partial-sum sizes by the rows it carries, the compute by the activations it carries (each
// distinct row used at most once per expert and at most top-k times): the codes and messages
// of expert.proto. Apart from the server so that the
// fuzzer (tests/fuzz/dispatch_fuzz.cc) runs it without a server.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<Batch> b, ValidateDispatch(req, nullptr, limits, layers));
#ifndef MOE_EXPERT_SVC_DISPATCH_BATCH_H_
#define MOE_EXPERT_SVC_DISPATCH_BATCH_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/v1/expert.pb.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/tensor/activations.h"
#include "services/tensor/bf16.h"

namespace moe::expert_svc {

using Clock = std::chrono::steady_clock;

// A validated batch, ready to compute.
struct Batch {
  uint64_t batch_id = 0;
  const numerics::MoeLayerWeights* layer = nullptr;
  v1::ReplyMode mode = v1::REPLY_MODE_PER_PAIR;
  int64_t rows = 0;
  int64_t experts = 0;        // distinct experts (the request's groups, strictly ascending)
  numerics::Routing routing;  // one row per (token, expert) pair: tokens = rows, top_k = 1
  numerics::Precision precision = numerics::Precision::kW4A16;
  // The activations as they arrived: bf16 (W4A16) or MXFP8 (W4A8), [rows, D], or with z_rows
  // the distinct rows (tokens) the batch's rows read, z_rows[r] for row r (read in place: no
  // gathered [rows, D] copy on the data plane's receive path).
  tensor::Activations z;
  std::vector<int32_t> z_rows;
  std::vector<int32_t> token_index;
  std::vector<float> weights;
  int32_t num_tokens = 0;
  Clock::time_point arrived;
  Clock::time_point expires = Clock::time_point::max();
};

struct DispatchLimits {
  std::string shard;  // for messages
  int64_t num_experts = 0;
  int64_t latent = 0;
  int64_t max_message_bytes = 0;  // rows x latent bf16 of one batch, at most
  // The precision modes served, the default (for PRECISION_UNSPECIFIED) first; empty: W4A16.
  std::vector<numerics::Precision> precisions;
  // The model's top-k: a distinct activations row may feed at most this many (token, expert)
  // rows of a batch, as a token routes to at most k experts (0: not checked; each row still at
  // most once per expert).
  int64_t top_k = 0;
};

// What a reply needs beyond its tensor's bytes (ids, shard name, message, MAC, framing): a
// batch whose reply would not fit in max_message_bytes with this much to spare is refused
// before compute, not computed and then unsendable.
inline constexpr int64_t kReplyOverheadBytes = 64 << 10;

// "w4a16", "w4a16,w4a8", ... (messages, logs, --precision); "" for none (the flag's default:
// every mode of the backend).
std::string PrecisionList(const std::vector<numerics::Precision>& p);
// "w4a8" or "w4a16,w4a8" (the first the default); "" is empty (every mode of the backend).
absl::StatusOr<std::vector<numerics::Precision>> ParsePrecisionList(const std::string& s);

// A time budget in milliseconds from now (0: none, then this long).
inline constexpr std::chrono::seconds kNoBudget(30);

// A batch's timeout_ms as a duration: kNoBudget when not positive, at most 24 h (a clock plus
// INT64_MAX ms overflows into the past).
std::chrono::milliseconds BatchBudget(int64_t timeout_ms);

// layers: the hosted layers (each with its expert range). oob: the activations' bytes when
// they came out of band (else the request's activations.data). oob_owner: keeps *oob alive and
// unchanged (the buffer it landed in); with it, bf16 activations are read where they are
// (Activations::ViewBf16) instead of copied, when they are 2-byte aligned.
absl::StatusOr<std::unique_ptr<Batch>> ValidateDispatch(
    const v1::DispatchRequest& req, const std::string_view* oob, const DispatchLimits& limits,
    const std::map<int64_t, numerics::MoeLayerWeights>& layers,
    std::shared_ptr<const void> oob_owner = nullptr);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DISPATCH_BATCH_H_
