// One layer's routing bias over time: every bias the layer has served, as numbered versions
// with a reason and a time (version 0 is the checkpoint's e_score_correction_bias), the mode
// (frozen, rebalance, continuous) and rollback. It owns that history and nothing else; the
// gRPC adapter publishes every new current version to the WatchBias streams.
//
//   BiasLedger l(/*layer=*/1, checkpoint_bias, BiasMode::kRebalance, 16384, now_ms);
//   l.Append(qb_bias, "rebalance from 65536 tokens", now_ms);  // version 1
//   MOE_RETURN_IF_ERROR(l.Rollback(0, now_ms).status());          // version 2 = version 0's
#ifndef MOE_ROUTER_SVC_BIAS_LEDGER_H_
#define MOE_ROUTER_SVC_BIAS_LEDGER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/common/enum_names.h"
#include "services/common/model_config.h"

namespace moe::router_svc {

enum class BiasMode { kFrozen, kRebalance, kContinuous };
inline constexpr EnumNames<BiasMode, 3> kBiasModes{"bias mode",
                                                   {{{BiasMode::kFrozen, "frozen"},
                                                     {BiasMode::kRebalance, "rebalance"},
                                                     {BiasMode::kContinuous, "continuous"}}}};
inline const char* BiasModeName(BiasMode m) { return kBiasModes.Name(m); }
inline absl::StatusOr<BiasMode> ParseBiasMode(const std::string& s) { return kBiasModes.Parse(s); }

// Dynamic k's parameters of a version (proto ExpertBudget; docs/math.md section 4.1).
struct ExpertBudget {
  int32_t k_avg = 0;  // 0 or k: every token keeps its top-k
  int32_t k_min = 1;
  std::vector<float> thresholds;  // [k - 1, E], empty: never solved
  int64_t solved_from_tokens = 0;
  uint64_t solved_from_version = 0;
  bool stale = false;         // ExpertBudget.stale (router.proto)
  double window_floor = 0.0;  // ExpertBudget.window_floor
};

struct BiasVersion {
  int32_t layer = 0;
  uint64_t version = 0;
  BiasMode mode = BiasMode::kRebalance;
  std::vector<float> bias;  // [E]
  std::string reason;
  int64_t created_unix_ms = 0;
  ExpertBudget budget;
};

class BiasLedger {
 public:
  BiasLedger(int32_t layer, std::vector<float> checkpoint_bias, BiasMode mode,
             int64_t continuous_tokens, int64_t now_unix_ms, ExpertBudget budget = {});
  // A ledger as stored before a restart (state_store.h): its history (version == index, from
  // the checkpoint's at 0) and mode.
  BiasLedger(int32_t layer, std::vector<BiasVersion> history, BiasMode mode,
             int64_t continuous_tokens);

  int32_t layer() const { return layer_; }
  BiasMode mode() const { return mode_; }
  int64_t continuous_tokens() const { return continuous_tokens_; }
  const BiasVersion& current() const { return history_.back(); }
  const std::vector<BiasVersion>& history() const { return history_; }  // version == index
  // The current version's budget, for the router to mark before it publishes the version.
  ExpertBudget* mutable_current_budget() { return &history_.back().budget; }

  // A new current version with the current version's budget.
  const BiasVersion& Append(std::vector<float> bias, const std::string& reason,
                            int64_t now_unix_ms);
  // A new current version with its own budget.
  const BiasVersion& Append(std::vector<float> bias, ExpertBudget budget, const std::string& reason,
                            int64_t now_unix_ms);
  // A new version with version `to`'s bias and budget. FAILED_PRECONDITION when frozen,
  // NOT_FOUND for a version that does not exist.
  absl::StatusOr<const BiasVersion*> Rollback(uint64_t to, int64_t now_unix_ms);
  // Switching to frozen restores the checkpoint's bias as a new version when another is
  // current (returns true: a new version); otherwise only the mode (and continuous_tokens when
  // > 0) changes in place. INVALID_ARGUMENT for continuous_tokens < 0.
  absl::StatusOr<bool> SetMode(BiasMode mode, int64_t continuous_tokens, int64_t now_unix_ms);

 private:
  int32_t layer_;
  BiasMode mode_;
  int64_t continuous_tokens_;
  std::vector<BiasVersion> history_;
};

// The checkpoint's e_score_correction_bias of each layer (every MoE layer that has one when
// `layers` is empty), checked for shape and finiteness; *cfg receives the checkpoint's config.
absl::StatusOr<std::map<int32_t, std::vector<float>>> CheckpointBiases(
    const std::string& checkpoint, const std::vector<int64_t>& layers, ModelConfig* cfg);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_BIAS_LEDGER_H_
