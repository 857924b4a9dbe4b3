// The checkpoint a cluster benchmark runs on: the one given, or a synthetic one of `preset`
// (router skew 1.0) written to /tmp/<prefix><preset> first.
#ifndef MOE_TESTS_BENCH_BENCH_CHECKPOINT_H_
#define MOE_TESTS_BENCH_BENCH_CHECKPOINT_H_

#include <string>

#include "absl/status/statusor.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/model_config.h"
#include "services/common/status_macros.h"

namespace moe::bench {

inline absl::StatusOr<std::string> BenchCheckpoint(const std::string& given,
                                                   const std::string& preset,
                                                   const std::string& prefix) {
  if (!given.empty()) return given;
  const std::string dir = "/tmp/" + prefix + preset;
  MOE_ASSIGN_OR_RETURN(const ModelConfig cfg, PresetConfig(preset));
  checkpoint::SyntheticOptions so;
  so.router_skew = 1.0;
  MOE_RETURN_IF_ERROR(checkpoint::WriteSyntheticCheckpoint(cfg, dir, so));
  return dir;
}

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_BENCH_CHECKPOINT_H_
