#include "services/checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "services/common/status_macros.h"

namespace moe::checkpoint {
namespace {

bool IsDirectory(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseIndexJson(absl::string_view text,
                                                                  const std::string& label) {
  auto root = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::DataLossError(absl::StrCat(label, ": not a JSON object"));
  }
  auto wm = root.find("weight_map");
  if (wm == root.end() || !wm->is_object()) {
    return absl::DataLossError(absl::StrCat(label, ": missing \"weight_map\" object"));
  }
  std::map<std::string, std::string> out;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(
          absl::StrCat(label, ": weight_map entry for \"", it.key(), "\" is not a file name"));
    }
    const std::string file = it.value().get<std::string>();
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      return absl::DataLossError(
          absl::StrCat(label, ": weight_map entry for \"", it.key(), "\" names \"", file,
                       "\", which is not a file in the checkpoint directory"));
    }
    out[it.key()] = file;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path) {
  std::unique_ptr<Checkpoint> c(new Checkpoint());
  if (!IsDirectory(path)) {
    if (!Exists(path)) return absl::NotFoundError(absl::StrCat("checkpoint ", path, " not found"));
    const size_t slash = path.rfind('/');
    c->dir_ = slash == std::string::npos ? "." : path.substr(0, slash);
    c->single_file_ = slash == std::string::npos ? path : path.substr(slash + 1);
    MOE_RETURN_IF_ERROR(c->Shard(c->single_file_).status());
    return c;
  }
  c->dir_ = path;
  const std::string index = path + "/" + kIndexFileName;
  if (Exists(index)) {
    MOE_ASSIGN_OR_RETURN(std::string text, ReadText(index));
    MOE_ASSIGN_OR_RETURN(c->weight_map_, ParseIndexJson(text, index));
    return c;
  }
  if (Exists(path + "/" + kSingleFileName)) {
    c->single_file_ = kSingleFileName;
    MOE_RETURN_IF_ERROR(c->Shard(c->single_file_).status());
    return c;
  }
  return absl::NotFoundError(absl::StrCat("checkpoint directory ", path, " has neither ",
                                          kIndexFileName, " nor ", kSingleFileName));
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Checkpoint::Shard(const std::string& file) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second;
  MOE_ASSIGN_OR_RETURN(auto opened, SafetensorsFile::Open(dir_ + "/" + file));
  shards_[file] = opened;
  return opened;
}

bool Checkpoint::Contains(const std::string& name) const {
  if (!single_file_.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = shards_.find(single_file_);
    return it != shards_.end() && it->second->Find(name) != nullptr;
  }
  return weight_map_.count(name) != 0;
}

absl::StatusOr<TensorRef> Checkpoint::Get(const std::string& name) {
  std::string file = single_file_;
  if (file.empty()) {
    auto it = weight_map_.find(name);
    if (it == weight_map_.end()) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor \"", name,
                                              "\" (not in ", kIndexFileName, ")"));
    }
    file = it->second;
  }
  MOE_ASSIGN_OR_RETURN(auto shard, Shard(file));
  const TensorInfo* info = shard->Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir_, " has no tensor \"", name, "\" (looked in ", file, ")"));
  }
  return TensorRef{info, shard->Data(*info), shard};
}

absl::StatusOr<ModelConfig> Checkpoint::LoadConfig() const {
  return LoadHfConfigFile(dir_ + "/" + kConfigFileName);
}

int Checkpoint::OpenShardCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(shards_.size());
}

}  // namespace moe::checkpoint
