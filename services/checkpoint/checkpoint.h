// A checkpoint on disk: one model.safetensors, or shards named by model.safetensors.index.json
// (its "weight_map" maps each tensor name to a shard file in the same directory). Shards are
// opened (mapped) only when a tensor in them is first asked for, so an expert server that loads
// one expert range maps only the shards holding it.
//
//   MOE_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open("ckpt/"));
//   MOE_ASSIGN_OR_RETURN(TensorRef t, ckpt->Get(GateWeightName(1)));
#ifndef MOE_SERVICES_CHECKPOINT_CHECKPOINT_H_
#define MOE_SERVICES_CHECKPOINT_CHECKPOINT_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/checkpoint/safetensors.h"
#include "services/common/model_config.h"

namespace moe::checkpoint {

inline constexpr char kIndexFileName[] = "model.safetensors.index.json";
inline constexpr char kSingleFileName[] = "model.safetensors";
inline constexpr char kConfigFileName[] = "config.json";

struct TensorRef {
  const TensorInfo* info = nullptr;
  absl::Span<const uint8_t> data;
  std::shared_ptr<const SafetensorsFile> file;  // keeps the mapping alive
};

class Checkpoint {
 public:
  // path: a directory (with an index or model.safetensors) or a single .safetensors file.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& path);

  // NOT_FOUND names the tensor and where it was looked for.
  absl::StatusOr<TensorRef> Get(const std::string& name);
  bool Contains(const std::string& name) const;
  // The directory's config.json.
  absl::StatusOr<ModelConfig> LoadConfig() const;
  const std::string& dir() const { return dir_; }
  // Shard files mapped so far.
  int OpenShardCount() const;

 private:
  Checkpoint() = default;
  absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Shard(const std::string& file);

  std::string dir_;
  std::string single_file_;                        // set when there is no index
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const SafetensorsFile>> shards_;
};

// Parses an index file's text; rejects shard names that leave the directory.
absl::StatusOr<std::map<std::string, std::string>> ParseIndexJson(absl::string_view text,
                                                                  const std::string& label);

}  // namespace moe::checkpoint

#endif  // MOE_SERVICES_CHECKPOINT_CHECKPOINT_H_
