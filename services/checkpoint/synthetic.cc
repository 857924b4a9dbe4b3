#include "services/checkpoint/synthetic.h"

#include <sys/stat.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/k3_names.h"
#include "services/checkpoint/safetensors.h"
#include "services/common/random.h"
#include "services/common/status_macros.h"
#include "services/numerics/mxfp4.h"

namespace moe::checkpoint {
namespace {

using tensor::Bf16;

// Stream ids, one per tensor kind, for MixSeed.
constexpr uint64_t kDenseStream = 1;
constexpr uint64_t kExpertStream = 100;
constexpr uint64_t kPopularityStream = 200;
constexpr uint64_t kHiddenStream = 300;
constexpr uint64_t kShuffleStream = 400;

// Fills dense tensor `index` of DenseTensorSpecs(cfg, layer) as raw little-endian bytes.
std::vector<uint8_t> DenseBytes(const ModelConfig& cfg, int64_t layer, size_t index,
                                const SyntheticOptions& opt) {
  const TensorSpec spec = DenseTensorSpecs(cfg, layer)[index];
  std::vector<uint8_t> bytes(static_cast<size_t>(spec.NumBytes()));
  Rng rng(MixSeed(opt.seed, {kDenseStream, static_cast<uint64_t>(layer), index}));
  const int64_t n = spec.NumBytes() / static_cast<int64_t>(tensor::DTypeSize(spec.dtype));
  if (spec.dtype == tensor::DType::kF32) {  // the selection bias: small, as after balancing
    for (int64_t i = 0; i < n; ++i) {
      const float v = 1e-3f * rng.Normal();
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
    return bytes;
  }
  Bf16* out = reinterpret_cast<Bf16*>(bytes.data());
  const int64_t fan_in = spec.shape.size() == 2 ? spec.shape[1] : 1;
  const float std_dev = 1.0f / std::sqrt(static_cast<float>(fan_in));
  if (index == 0) {  // gate: per-expert row width carries the router skew
    const std::vector<float> pop = ExpertPopularity(cfg, layer, opt.seed);
    for (int64_t e = 0; e < spec.shape[0]; ++e) {
      const float row_std = std_dev * (1.0f + static_cast<float>(opt.router_skew) * pop[e]);
      for (int64_t i = 0; i < fan_in; ++i) {
        out[e * fan_in + i] = Bf16::FromFloat(row_std * rng.Normal());
      }
    }
  } else if (index == 3) {  // latent norm gamma around 1
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16::FromFloat(1.0f + 0.1f * rng.Normal());
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16::FromFloat(std_dev * rng.Normal());
  }
  return bytes;
}

// The six tensors of one expert (ExpertTensorSpecs order): packed, scales for w1, w3, w2.
void ExpertBytes(const ModelConfig& cfg, int64_t layer, int64_t expert, const SyntheticOptions& opt,
                 std::vector<uint8_t> (&out)[6]) {
  const int64_t d = cfg.latent, inter = cfg.intermediate;
  std::vector<float> row(static_cast<size_t>(std::max(d, inter)));
  for (int m = 0; m < 3; ++m) {
    const int64_t rows = m == 2 ? d : inter, cols = m == 2 ? inter : d;
    out[2 * m].resize(static_cast<size_t>(rows * numerics::Mxfp4PackedBytes(cols)));
    out[2 * m + 1].resize(static_cast<size_t>(rows * numerics::Mxfp4ScaleBytes(cols)));
    Rng rng(MixSeed(opt.seed, {kExpertStream + m, static_cast<uint64_t>(layer),
                               static_cast<uint64_t>(expert)}));
    const float std_dev = 1.0f / std::sqrt(static_cast<float>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) row[c] = std_dev * rng.Normal();
      numerics::QuantizeMxfp4Row(row.data(), cols,
                                 out[2 * m].data() + r * numerics::Mxfp4PackedBytes(cols),
                                 out[2 * m + 1].data() + r * numerics::Mxfp4ScaleBytes(cols));
    }
  }
}

std::vector<int64_t> LayersOf(const ModelConfig& cfg, const SyntheticOptions& opt) {
  if (!opt.layers.empty()) return opt.layers;
  return {cfg.first_moe_layer};
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

struct ExpertSlot {
  int64_t layer;
  int64_t expert;
};

struct ShardPlan {
  std::string file;
  bool dense = false;
  std::vector<ExpertSlot> experts;  // storage order (shuffled)
  int64_t bytes = 0;
};

}  // namespace

std::vector<float> ExpertPopularity(const ModelConfig& cfg, int64_t layer, uint64_t seed) {
  Rng rng(MixSeed(seed, {kPopularityStream, static_cast<uint64_t>(layer)}));
  std::vector<float> p(static_cast<size_t>(cfg.num_experts));
  for (float& v : p) {
    const double u = rng.Uniform();
    v = static_cast<float>(u * u * u);
  }
  return p;
}

std::vector<Bf16> SyntheticHiddenStates(const ModelConfig& cfg, int64_t tokens, uint64_t seed) {
  Rng rng(MixSeed(seed, {kHiddenStream}));
  std::vector<Bf16> x(static_cast<size_t>(tokens * cfg.hidden));
  for (Bf16& v : x) v = Bf16::FromFloat(rng.Normal());
  return x;
}

numerics::MoeLayerWeights SyntheticLayer(const ModelConfig& cfg, int64_t layer,
                                         const SyntheticOptions& opt) {
  numerics::MoeLayerWeights w;
  w.layer = layer;
  w.has_dense = true;
  std::vector<Bf16>* targets[] = {&w.gate,    nullptr,        &w.down_proj, &w.norm,
                                  &w.up_proj, &w.shared_gate, &w.shared_up, &w.shared_down};
  for (size_t i = 0; i < 8; ++i) {
    const std::vector<uint8_t> bytes = DenseBytes(cfg, layer, i, opt);
    if (targets[i] == nullptr) {
      w.bias.resize(bytes.size() / 4);
      std::memcpy(w.bias.data(), bytes.data(), bytes.size());
    } else {
      targets[i]->resize(bytes.size() / 2);
      std::memcpy(targets[i]->data(), bytes.data(), bytes.size());
    }
  }
  numerics::MoeLayerWeights experts = SyntheticExperts(cfg, layer, 0, cfg.num_experts, opt);
  w.expert_lo = experts.expert_lo;
  w.expert_hi = experts.expert_hi;
  w.experts = std::move(experts.experts);
  w.backing = std::move(experts.backing);
  return w;
}

numerics::MoeLayerWeights SyntheticExperts(const ModelConfig& cfg, int64_t layer, int64_t lo,
                                           int64_t hi, const SyntheticOptions& opt) {
  numerics::MoeLayerWeights w;
  w.layer = layer;
  w.expert_lo = lo;
  w.expert_hi = hi;
  w.experts.resize(static_cast<size_t>(hi - lo));
  for (int64_t e = lo; e < hi; ++e) {
    auto parts = std::make_shared<std::array<std::vector<uint8_t>, 6>>();
    std::vector<uint8_t> tmp[6];
    ExpertBytes(cfg, layer, e, opt, tmp);
    for (int i = 0; i < 6; ++i) (*parts)[i] = std::move(tmp[i]);
    numerics::ExpertWeights& ew = w.experts[e - lo];
    numerics::Mxfp4Matrix* mats[] = {&ew.w1, &ew.w3, &ew.w2};
    for (int m = 0; m < 3; ++m) {
      mats[m]->rows = m == 2 ? cfg.latent : cfg.intermediate;
      mats[m]->cols = m == 2 ? cfg.intermediate : cfg.latent;
      mats[m]->packed = (*parts)[2 * m].data();
      mats[m]->scales = (*parts)[2 * m + 1].data();
    }
    w.backing.push_back(std::shared_ptr<const void>(parts, parts.get()));
  }
  return w;
}

absl::Status WriteSyntheticCheckpoint(const ModelConfig& cfg, const std::string& dir,
                                      const SyntheticOptions& opt, SyntheticReport* report) {
  const auto start = std::chrono::steady_clock::now();
  MOE_RETURN_IF_ERROR(ValidateConfig(cfg));
  const std::vector<int64_t> layers = LayersOf(cfg, opt);
  for (int64_t layer : layers) {
    if (!cfg.IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer,
                                                     " is not a MoE layer (MoE "
                                                     "layers are [",
                                                     cfg.first_moe_layer, ", ", cfg.num_layers,
                                                     "))"));
    }
  }
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create directory ", dir));
  }
  MOE_RETURN_IF_ERROR(WriteText(dir + "/" + kConfigFileName, ToHfConfigJson(cfg)));

  // Plan: shard 0 holds every dense tensor; experts fill shards in (layer, id) order.
  std::vector<ShardPlan> plan(1);
  plan[0].dense = true;
  for (int64_t layer : layers) {
    for (const TensorSpec& s : DenseTensorSpecs(cfg, layer)) plan[0].bytes += s.NumBytes();
  }
  const int64_t expert_hi = opt.expert_hi < 0 ? cfg.num_experts : opt.expert_hi;
  if (opt.expert_lo < 0 || opt.expert_lo >= expert_hi || expert_hi > cfg.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert range [", opt.expert_lo, ", ", expert_hi,
                                                   ") outside [0, ", cfg.num_experts, ")"));
  }
  for (int64_t layer : layers) {
    for (int64_t e = opt.expert_lo; opt.experts && e < expert_hi; ++e) {
      if (!opt.single_file && !plan.back().experts.empty() &&
          plan.back().bytes + cfg.ExpertBytes() > opt.shard_bytes) {
        plan.emplace_back();
      }
      plan.back().experts.push_back({layer, e});
      plan.back().bytes += cfg.ExpertBytes();
    }
  }
  Rng shuffle(MixSeed(opt.seed, {kShuffleStream}));
  for (size_t s = 0; s < plan.size(); ++s) {
    auto& ex = plan[s].experts;
    for (size_t i = ex.size(); i > 1; --i) std::swap(ex[i - 1], ex[shuffle.Next() % i]);
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, plan.size());
    plan[s].file = opt.single_file ? kSingleFileName : name;
  }

  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  int64_t planned = 0;
  for (const ShardPlan& shard : plan) planned += shard.bytes;
  std::atomic<int64_t> written{0};
  auto progress = [&](int64_t bytes) {
    const int64_t now = written += bytes;
    if (opt.on_progress) opt.on_progress(now, planned);
  };
  for (const ShardPlan& shard : plan) {
    std::vector<TensorSpec> specs;
    if (shard.dense) {
      for (int64_t layer : layers) {
        for (const TensorSpec& s : DenseTensorSpecs(cfg, layer)) specs.push_back(s);
      }
    }
    for (const ExpertSlot& slot : shard.experts) {
      for (const TensorSpec& s : ExpertTensorSpecs(cfg, slot.layer, slot.expert)) {
        specs.push_back(s);
      }
    }
    for (const TensorSpec& s : specs) weight_map[s.name] = shard.file;
    MOE_ASSIGN_OR_RETURN(
        auto writer, SafetensorsWriter::Create(dir + "/" + shard.file, specs,
                                               {{"format", "pt"},
                                                {"generator", "moe synthetic checkpoint"},
                                                {"seed", std::to_string(opt.seed)},
                                                {"router_skew", std::to_string(opt.router_skew)}}));
    if (shard.dense) {
      for (int64_t layer : layers) {
        const std::vector<TensorSpec> dense = DenseTensorSpecs(cfg, layer);
        for (size_t i = 0; i < dense.size(); ++i) {
          const std::vector<uint8_t> bytes = DenseBytes(cfg, layer, i, opt);
          MOE_RETURN_IF_ERROR(writer->Write(dense[i].name, bytes));
          progress(static_cast<int64_t>(bytes.size()));
        }
      }
    }
    std::atomic<size_t> next{0};
    std::mutex mu;
    absl::Status first_error;
    auto work = [&]() {
      std::vector<uint8_t> bytes[6];
      for (size_t i = next++; i < shard.experts.size(); i = next++) {
        const ExpertSlot slot = shard.experts[i];
        ExpertBytes(cfg, slot.layer, slot.expert, opt, bytes);
        const std::vector<TensorSpec> es = ExpertTensorSpecs(cfg, slot.layer, slot.expert);
        for (int t = 0; t < 6; ++t) {
          absl::Status st = writer->Write(es[t].name, bytes[t]);
          if (!st.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            if (first_error.ok()) first_error = st;
            next = shard.experts.size();
            return;
          }
        }
        progress(cfg.ExpertBytes());
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::max(1, opt.threads); ++t) pool.emplace_back(work);
    work();
    for (std::thread& th : pool) th.join();
    MOE_RETURN_IF_ERROR(first_error);
    MOE_RETURN_IF_ERROR(writer->Finish());
    total += static_cast<int64_t>(writer->file_bytes());
  }
  if (!opt.single_file) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    MOE_RETURN_IF_ERROR(WriteText(dir + "/" + kIndexFileName, index.dump(1) + "\n"));
  }
  if (report != nullptr) {
    report->bytes = total;
    report->shards = static_cast<int>(plan.size());
    report->seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return absl::OkStatus();
}

}  // namespace moe::checkpoint
