// The production check of expert-svc's kernels: a sampled fraction of the batches the server
// computed is recomputed off the hot path with the scalar reference (ref::ExpertFfn), on weights
// from a source independent of the serving copy where one exists, and compared with the
// consistency test's named tolerance (numerics/tolerance.h, kExpertFfnTolerance). A mismatch is
// logged with the batch, layer, expert and shape and counted; a sample that could not be checked
// is counted as skipped or error, never dropped silently.
//
// Sampling is deterministic (exactly `fraction` of the batches, by an accumulator); one expert of
// a sampled batch (chosen by the sample count) and at most max_rows of its rows are copied and
// queued for one background thread, with at most max_pending samples waiting (a full queue
// counts the sample as skipped). So the cost stays bounded whatever the traffic, and the compute
// thread only pays for a copy of a few rows.
//
//   BatchVerifierOptions o;  // o.fraction: 1e-3 by default
//   BatchVerifier v(cfg, o, reference_weights, sink);
//   v.OnBatch(batch_id, layer, routing, z, y);  // after every computed batch
#ifndef MOE_EXPERT_SVC_BATCH_VERIFIER_H_
#define MOE_EXPERT_SVC_BATCH_VERIFIER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/tensor/activations.h"
#include "services/tensor/bf16.h"

namespace moe::expert_svc {

enum class VerifyResult { kMatch, kMismatch, kSkipped, kError };
const char* VerifyResultName(VerifyResult r);  // "match", "mismatch", "skipped", "error"

struct BatchVerifierOptions {
  double fraction = 1e-3;  // of the batches; 0 off, 1 every batch
  int64_t max_rows = 16;   // rows of the chosen expert recomputed per sample
  int max_pending = 2;     // samples waiting for the background thread
  numerics::W4A8H w4a8_h = numerics::W4A8H::kFromFp32;  // as the shard's backend computes W4A8
};

class BatchVerifier {
 public:
  // The reference weights of one routed expert: an independent copy (regenerated from the
  // synthetic seed), or the checkpoint's read-only mapping.
  using ReferenceWeights =
      std::function<absl::StatusOr<numerics::MoeLayerWeights>(int64_t layer, int64_t expert)>;
  // Called on the background thread with each result; detail says what was checked and, for a
  // mismatch or error, what was wrong.
  using Sink = std::function<void(VerifyResult, const std::string& detail)>;

  BatchVerifier(const ModelConfig& cfg, const BatchVerifierOptions& options,
                ReferenceWeights reference, Sink sink);
  ~BatchVerifier();  // finishes the sample in progress, counts the rest as skipped
  BatchVerifier(const BatchVerifier&) = delete;
  BatchVerifier& operator=(const BatchVerifier&) = delete;

  // After a computed batch. routing: one row per (token, expert) pair (top_k 1, rows grouped by
  // expert); z, y: [rows, D] the batch's inputs and the backend's outputs (with z_rows: row r's
  // input is z's row z_rows[r], as Batch holds them). MXFP8 inputs (W4A8) are checked against
  // the reference's W4A8 within kExpertFfnW4A8Tolerance.
  void OnBatch(uint64_t batch_id, int64_t layer, const numerics::Routing& routing,
               const tensor::Activations& z, const tensor::Bf16* y,
               absl::Span<const int32_t> z_rows = {});
  // Waits until every queued sample has been checked (tests, shutdown).
  void Drain();

  struct Counts {
    int64_t sampled = 0, match = 0, mismatch = 0, skipped = 0, error = 0;
  };
  Counts counts() const;

 private:
  struct Sample {
    uint64_t batch_id = 0;
    int64_t layer = 0, expert = 0, batch_rows = 0, rows = 0;
    tensor::Activations z;        // [rows, D]
    std::vector<tensor::Bf16> y;  // [rows, D]
  };
  void Loop();
  void Check(const Sample& s);
  void Record(VerifyResult r, const std::string& detail);

  const ModelConfig cfg_;
  const BatchVerifierOptions options_;
  const ReferenceWeights reference_;
  const Sink sink_;

  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Sample> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  double credit_ ABSL_GUARDED_BY(mu_) = 0;  // sampling accumulator
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_BATCH_VERIFIER_H_
