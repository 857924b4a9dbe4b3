#include "expert-svc/dispatch_batch.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "services/common/status_macros.h"
#include "services/numerics/precision.h"
#include "services/transport/precision_convert.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {
namespace {

using tensor::Bf16;

// The longest budget a batch may ask for: a clock plus INT64_MAX ms overflows (into the past).
constexpr std::chrono::hours kMaxBudget(24);

}  // namespace

std::chrono::milliseconds BatchBudget(int64_t timeout_ms) {
  if (timeout_ms <= 0) return kNoBudget;
  return std::min<std::chrono::milliseconds>(std::chrono::milliseconds(timeout_ms), kMaxBudget);
}

std::string PrecisionList(const std::vector<numerics::Precision>& p) {
  std::string out;
  for (numerics::Precision m : p) absl::StrAppend(&out, out.empty() ? "" : ",", PrecisionName(m));
  return out;
}

absl::StatusOr<std::vector<numerics::Precision>> ParsePrecisionList(const std::string& s) {
  std::vector<numerics::Precision> out;
  if (s.empty()) return out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    MOE_ASSIGN_OR_RETURN(numerics::Precision p,
                         numerics::ParsePrecision(std::string_view(part.data(), part.size())));
    if (std::find(out.begin(), out.end(), p) != out.end()) {
      return absl::InvalidArgumentError(absl::StrCat("precision ", part, " listed twice"));
    }
    out.push_back(p);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Batch>> ValidateDispatch(
    const v1::DispatchRequest& req, const std::string_view* oob, const DispatchLimits& limits,
    const std::map<int64_t, numerics::MoeLayerWeights>& layers,
    std::shared_ptr<const void> oob_owner) {
  const std::string where = absl::StrCat("shard ", limits.shard, ", batch ", req.batch_id());
  auto it = layers.find(req.layer());
  if (it == layers.end()) {
    std::vector<int64_t> hosted;
    for (const auto& [l, w] : layers) hosted.push_back(l);
    return absl::NotFoundError(absl::StrCat(where, ": layer ", req.layer(),
                                            " is not hosted here (layers ",
                                            absl::StrJoin(hosted, ","), ")"));
  }
  auto b = std::make_unique<Batch>();
  b->batch_id = req.batch_id();
  b->layer = &it->second;
  b->mode =
      req.reply_mode() == v1::REPLY_MODE_UNSPECIFIED ? v1::REPLY_MODE_PER_PAIR : req.reply_mode();
  if (b->mode != v1::REPLY_MODE_PER_PAIR && b->mode != v1::REPLY_MODE_PARTIAL_SUM) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unknown reply_mode ", static_cast<int>(req.reply_mode())));
  }
  // The precision: asked, or this server's default; one it does not serve is refused by name.
  const std::vector<numerics::Precision> served =
      limits.precisions.empty() ? std::vector<numerics::Precision>{numerics::Precision::kW4A16}
                                : limits.precisions;
  absl::StatusOr<numerics::Precision> asked =
      transport::PrecisionFromProto(req.precision(), served.front());
  if (!asked.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", asked.status().message()));
  }
  b->precision = *asked;
  if (std::find(served.begin(), served.end(), b->precision) == served.end()) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": this shard serves ", PrecisionList(served),
                     " only (--precision); the batch asks ", PrecisionName(b->precision)));
  }
  if (req.groups_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no expert groups"));
  }
  int64_t rows = 0;
  int64_t prev = -1;
  for (const v1::ExpertGroup& g : req.groups()) {
    if (g.expert_id() < 0 || g.expert_id() >= limits.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expert id ", g.expert_id(),
                                                     " outside [0, ", limits.num_experts, ")"));
    }
    if (!b->layer->HostsExpert(g.expert_id())) {
      return absl::NotFoundError(absl::StrCat(
          where, ": expert ", g.expert_id(), " of layer ", req.layer(),
          " is not hosted here (experts [", b->layer->expert_lo, ", ", b->layer->expert_hi, "))"));
    }
    if (g.expert_id() <= prev) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expert ids must be strictly ascending (", g.expert_id(), " after ", prev, ")"));
    }
    if (g.token_count() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expert ", g.expert_id(), " has token_count ", g.token_count()));
    }
    prev = g.expert_id();
    rows += g.token_count();
  }
  // The batch's expert inputs and per-pair outputs are rows x D bf16: bounded by what one
  // message may carry, before anything that size is allocated (a small request may claim
  // 2^26 rows).
  const int64_t pair_bytes = rows * limits.latent * static_cast<int64_t>(sizeof(Bf16));
  if (pair_bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(where, ": ", rows, " (token, expert) rows of ", limits.latent, " bf16 (",
                     pair_bytes, " bytes) exceed this server's limit of ", limits.max_message_bytes,
                     " bytes per batch (--max_message_bytes)"));
  }
  // Its reply must fit in one message too (per pair: the same rows x D bf16; partial sums: at
  // most min(rows, num_tokens) distinct tokens x D f32), with room for the reply's other fields.
  const int64_t reply_rows = b->mode == v1::REPLY_MODE_PER_PAIR
                                 ? rows
                                 : std::min<int64_t>(rows, std::max(req.num_tokens(), 1));
  const int64_t reply_bytes =
      reply_rows * limits.latent * (b->mode == v1::REPLY_MODE_PER_PAIR ? 2 : 4);
  if (reply_bytes > limits.max_message_bytes - kReplyOverheadBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where, ": the reply would carry ", reply_bytes, " bytes of outputs (", reply_rows,
        " rows of ", limits.latent, b->mode == v1::REPLY_MODE_PER_PAIR ? " bf16" : " f32",
        "), more than this server's limit of ", limits.max_message_bytes,
        " bytes per message (--max_message_bytes) less ", kReplyOverheadBytes,
        " for the reply's other fields: split the batch"));
  }
  const std::string_view data = oob != nullptr ? *oob : std::string_view(req.activations().data());
  const bool mxfp8 = req.activations().dtype() == v1::DTYPE_MXFP8;
  if (mxfp8 && b->precision != numerics::Precision::kW4A8) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": MXFP8 activations need precision W4A8 (the batch asks ",
                     PrecisionName(b->precision), ")"));
  }
  transport::Bf16Matrix z;
  tensor::Mxfp8Rows z8;
  // Bf16 rows read in place (out of band, kept alive by oob_owner), else z.values.
  const Bf16* in_place = nullptr;
  if (mxfp8) {
    MOE_ASSIGN_OR_RETURN(z8, transport::DecodeMxfp8Matrix(req.activations(), data,
                                                          where + ": activations", limits.latent));
    z.rows = z8.rows;
  } else if (oob_owner != nullptr && req.activations().dtype() == v1::DTYPE_BF16 &&
             reinterpret_cast<uintptr_t>(data.data()) % alignof(Bf16) == 0) {
    MOE_ASSIGN_OR_RETURN(z, transport::CheckBf16Matrix(req.activations(), data,
                                                       where + ": activations", limits.latent));
    in_place = reinterpret_cast<const Bf16*>(data.data());
  } else {
    MOE_ASSIGN_OR_RETURN(z, transport::DecodeBf16Matrix(req.activations(), data,
                                                        where + ": activations", limits.latent,
                                                        /*accept_f32=*/false));
  }
  if (req.row_source_size() == 0 && z.rows != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": activations have ", z.rows, " rows but the groups count ", rows));
  }
  if (req.row_source_size() != 0 && req.row_source_size() != rows) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", req.row_source_size(),
                                                   " row_source entries for ", rows, " rows"));
  }
  b->rows = rows;
  b->experts = req.groups_size();
  b->routing.tokens = rows;
  b->routing.top_k = 1;
  b->routing.expert_ids.reserve(static_cast<size_t>(rows));
  for (const v1::ExpertGroup& g : req.groups()) {
    b->routing.expert_ids.insert(b->routing.expert_ids.end(), g.token_count(), g.expert_id());
  }
  b->routing.weights.assign(static_cast<size_t>(rows), 1.0f);
  // NaN policy: non-finite activations are rejected (they would poison every partial sum;
  // MXFP8's NaN codes and scales are refused by its decoder).
  const int64_t d = limits.latent;
  const Bf16* values = in_place != nullptr ? in_place : z.values.data();
  const size_t count = mxfp8 ? 0 : static_cast<size_t>(z.rows * d);
  const size_t bad = tensor::FirstNonFinite(values, count);
  if (bad < count) {
    const int64_t r = static_cast<int64_t>(bad) / d, c = static_cast<int64_t>(bad) % d;
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": activations row ", r,
        req.row_source_size() == 0 ? absl::StrCat(" (expert ", b->routing.expert_ids[r], ")")
                                   : std::string(),
        " column ", c, " is not finite"));
  }
  // row_source: the activations row of each batch row (none: row r is row r).
  const bool gathered = req.row_source_size() != 0;
  const int32_t* source = req.row_source().data();
  for (int64_t r = 0; gathered && r < rows; ++r) {
    if (source[r] < 0 || source[r] >= z.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": row_source[", r, "] = ", source[r], " outside [0, ", z.rows, ")"));
    }
  }
  // The compute a batch asks for is bounded by the activations it carries: a token is routed
  // to an expert once and to at most k experts, so a distinct row feeds each group at most once
  // and the batch at most k times (a 1 KB request cannot ask for 2^18 rows of one token).
  if (gathered) {
    std::vector<int32_t> last_group(static_cast<size_t>(z.rows), -1);
    std::vector<int32_t> uses(static_cast<size_t>(z.rows), 0);
    int64_t r = 0;
    for (int32_t gi = 0; gi < req.groups_size(); ++gi) {
      const v1::ExpertGroup& g = req.groups(gi);
      for (int32_t i = 0; i < g.token_count(); ++i, ++r) {
        const int32_t src = source[r];
        if (last_group[src] == gi) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": row_source[", r, "] = ", src, " appears twice for expert ",
                           g.expert_id(), " (a token is routed to an expert once)"));
        }
        last_group[src] = gi;
        if (limits.top_k > 0 && ++uses[src] > limits.top_k) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": activations row ", src, " feeds more than ", limits.top_k,
                           " rows (row_source[", r,
                           "]): a token is routed to at most top-k = ", limits.top_k, " experts"));
        }
      }
    }
  }
  if (!mxfp8 && b->precision == numerics::Precision::kW4A8) {
    // BF16 rows in W4A8: each distinct row quantized here once, as an attention node does.
    z8 = numerics::QuantizeMxfp8Rows(values, z.rows, d);
  }
  tensor::Activations distinct =
      b->precision == numerics::Precision::kW4A8 ? tensor::Activations::FromMxfp8(std::move(z8))
      : in_place != nullptr
          ? tensor::Activations::ViewBf16(in_place, z.rows, d, std::move(oob_owner))
          : tensor::Activations::FromBf16(std::move(z.values), z.rows, d);
  b->z = std::move(distinct);
  if (gathered) b->z_rows.assign(source, source + rows);
  if (b->mode == v1::REPLY_MODE_PARTIAL_SUM) {
    if (req.token_index_size() != rows || req.weights_size() != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": partial sums need one token_index and one weight per row (", rows, " rows, ",
          req.token_index_size(), " token_index, ", req.weights_size(), " weights)"));
    }
    if (req.num_tokens() < 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": num_tokens must be >= 1"));
    }
    int64_t row = 0;
    for (const v1::ExpertGroup& g : req.groups()) {
      int32_t last = -1;
      for (int32_t i = 0; i < g.token_count(); ++i, ++row) {
        const int32_t t = req.token_index(static_cast<int>(row));
        const float w = req.weights(static_cast<int>(row));
        if (t < 0 || t >= req.num_tokens() || t <= last) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": row ", row, " token_index ", t, " must lie in [0, ",
                           req.num_tokens(), ") and ascend within expert ", g.expert_id()));
        }
        if (!std::isfinite(w)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": row ", row, " weight is not finite"));
        }
        last = t;
      }
    }
    b->token_index.assign(req.token_index().begin(), req.token_index().end());
    b->weights.assign(req.weights().begin(), req.weights().end());
    b->num_tokens = req.num_tokens();
  }
  b->arrived = Clock::now();
  if (req.timeout_ms() > 0) b->expires = b->arrived + BatchBudget(req.timeout_ms());
  return b;
}

}  // namespace moe::expert_svc
