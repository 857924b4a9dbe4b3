// What the moe-tool subcommands do, as a library the tests link: generate a synthetic
// checkpoint, run one layer forward from a checkpoint and write its outputs.
//
//   ForwardRequest req; req.checkpoint = "/tmp/ckpt"; req.tokens = 64;
//   MOE_ASSIGN_OR_RETURN(ForwardReport rep, RunLayerForward(req));
#ifndef MOE_SERVICES_TOOLS_LAYER_RUNNER_H_
#define MOE_SERVICES_TOOLS_LAYER_RUNNER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "services/numerics/moe_layer.h"

namespace moe::tools {

struct ForwardRequest {
  std::string checkpoint;  // directory or file
  int64_t layer = -1;      // -1: the first MoE layer in the checkpoint's config
  int64_t tokens = 64;     // synthetic input size when input is empty
  uint64_t input_seed = 7;
  std::string input;            // optional safetensors file with tensor "x" [T, H] (BF16 or F32)
  std::string output;           // optional safetensors file for x, out, expert_ids, weights
  int repeat = 1;               // forwards to time; the report keeps the fastest
  std::string backend = "cpu";  // "cpu" (optimized, numerics/cpu) or "ref" (scalar reference)
  std::string precision = "w4a16";  // or "w4a8"
  bool w4a8_h_via_bf16 = false;     // W4A8's h rounded to bf16 before MXFP8 (precision_mode.h)
  // Dynamic k (docs/math.md section 4.1): 1..k-1 serves this budget with thresholds solved
  // exactly (k_min 1) from budget_calibration_tokens synthetic tokens of seed input_seed + 1000,
  // written to the output as "thresholds" [k - 1, E] and "calibration_x"; 0: the full top-k.
  int64_t budget = 0;
  // 0: the fewest tokens whose window floor at this budget and the preset's experts is at most
  // budget_window_floor (numerics::BudgetWindowTokens; at 0.2: 1,110 for tiny at b = 2, 10,351
  // for mid at b = 3, 38,069 for K3 at b = 8).
  int64_t budget_calibration_tokens = 0;
  double budget_window_floor = 0.2;
  // Dynamic k's second mode instead (docs/math.md 4.1, "Top-p"): keep the fewest experts, largest
  // router score first, whose share of the token's top-k scores reaches top_p (k_min 1); 0: off.
  double top_p = 0;
};

struct ForwardReport {
  ModelConfig config;
  int64_t layer = 0;
  int64_t tokens = 0;
  double load_seconds = 0;
  numerics::LayerTimings timings;  // of the fastest run
  std::string backend;             // what ran: "ref" or "cpu/<isa>"
  uint64_t checksum = 0;           // FNV-1a 64 over the output's bf16 bytes
  double output_abs_sum = 0;
  // Dynamic k: the calibration window and the kept-load noise floor it leaves at the budget.
  int64_t budget_calibration_tokens = 0;
  double budget_window_floor = 0;
};

absl::StatusOr<ForwardReport> RunLayerForward(const ForwardRequest& request);

// FNV-1a 64-bit hash.
uint64_t Fnv1a64(const void* data, size_t size);

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_LAYER_RUNNER_H_
