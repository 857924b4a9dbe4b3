// Which data plane a service uses for the expert payloads (docs/data-plane.md), and the tag
// layout of the out-of-band messages.
//
//   auto: UCX when this build and the peer have it, else in-band gRPC (the default)
//   grpc: in band only; ucx: UCX or fail (the attention node names the shard)
#ifndef MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
#define MOE_SERVICES_DATAPLANE_DATA_PLANE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace moe::dataplane {

enum class DataPlane { kAuto, kGrpc, kUcx };

inline const char* DataPlaneName(DataPlane d) {
  switch (d) {
    case DataPlane::kAuto:
      return "auto";
    case DataPlane::kGrpc:
      return "grpc";
    case DataPlane::kUcx:
      return "ucx";
  }
  return "?";
}

inline absl::StatusOr<DataPlane> ParseDataPlane(const std::string& name) {
  if (name == "auto") return DataPlane::kAuto;
  if (name == "grpc") return DataPlane::kGrpc;
  if (name == "ucx") return DataPlane::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("data plane '", name, "' is not one of auto, grpc, ucx"));
}

// Activation tags on an expert server's worker: the client id (given by that server) in the top
// 24 bits, the sender's sequence number below. Reply tags on an attention node's worker: its own
// sequence number, unique across all its shards.
constexpr int kClientIdBits = 24;
constexpr uint64_t kMaxClientId = (uint64_t{1} << (kClientIdBits - 1)) - 1;
constexpr uint64_t kSequenceMask = (uint64_t{1} << (64 - kClientIdBits)) - 1;
inline uint64_t ActivationTag(uint64_t client_id, uint64_t sequence) {
  return (client_id << (64 - kClientIdBits)) | (sequence & kSequenceMask);
}
inline uint64_t ClientOfTag(uint64_t tag) { return tag >> (64 - kClientIdBits); }

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_DATA_PLANE_H_
