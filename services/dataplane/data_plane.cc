#include "services/dataplane/data_plane.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe::dataplane {

const char* DataPlaneName(DataPlane d) {
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

absl::StatusOr<DataPlane> ParseDataPlane(const std::string& name) {
  if (name == "auto") return DataPlane::kAuto;
  if (name == "grpc") return DataPlane::kGrpc;
  if (name == "ucx") return DataPlane::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("data plane '", name, "' is not one of auto, grpc, ucx"));
}

namespace {
constexpr char kHelloMagic[4] = {'M', 'O', 'E', 'H'};
constexpr uint8_t kHelloVersion = 1;
}  // namespace

std::string EncodeHello(const Hello& h) {
  std::string out(kHelloMagic, 4);
  out.push_back(static_cast<char>(kHelloVersion));
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h.client_id >> (8 * i)) & 0xff));
  std::string secret = h.secret;
  secret.resize(kHelloSecretBytes, '\0');
  out += secret;
  return out;
}

absl::StatusOr<Hello> ParseHello(std::string_view bytes) {
  if (bytes.size() != kHelloBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX hello of ", bytes.size(), " bytes (a hello has ", kHelloBytes, ")"));
  }
  if (std::memcmp(bytes.data(), kHelloMagic, 4) != 0 ||
      static_cast<uint8_t>(bytes[4]) != kHelloVersion) {
    return absl::InvalidArgumentError("UCX hello without the MOEH v1 magic");
  }
  Hello h;
  for (int i = 0; i < 8; ++i) {
    h.client_id |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[5 + i])) << (8 * i);
  }
  h.secret.assign(bytes.data() + 13, kHelloSecretBytes);
  return h;
}

const char* TransportClass(std::string_view t) {
  static constexpr const char* kShm[] = {"posix", "sysv", "cma", "xpmem", "knem", "self"};
  for (const char* s : kShm) {
    if (t == s) return "shm";
  }
  if (t == "tcp") return "tcp";
  // Verbs: rc_verbs, rc_mlx5, ud_verbs, ud_mlx5, dc_mlx5 (and plain rc, ud, dc).
  for (const char* p : {"rc", "ud", "dc"}) {
    const size_t n = std::strlen(p);
    if (t.size() >= n && t.compare(0, n, p) == 0 && (t.size() == n || t[n] == '_')) return "rdma";
  }
  return "other";
}

UcxLanes ParseUcxLanes(std::string_view text) {
  // Lines like "#  lane[0]:  2:posix/memory.0 md[1]  -> md[1]/posix/sysdev[255] am am_bw#0".
  UcxLanes lanes;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t lane = line.find("lane[");
    if (lane == std::string_view::npos) continue;
    const size_t colon = line.find("]:", lane);
    if (colon == std::string_view::npos) continue;
    size_t i = colon + 2;
    while (i < line.size() && line[i] == ' ') ++i;
    // The resource index ("2:") before the transport name.
    size_t j = i;
    while (j < line.size() && line[j] >= '0' && line[j] <= '9') ++j;
    if (j == i || j >= line.size() || line[j] != ':') continue;
    const size_t name_start = j + 1;
    const size_t slash = line.find('/', name_start);
    if (slash == std::string_view::npos || slash == name_start || slash - name_start > 32) continue;
    const std::string name(line.substr(name_start, slash - name_start));
    if (std::find(lanes.transports.begin(), lanes.transports.end(), name) ==
        lanes.transports.end()) {
      lanes.transports.push_back(name);
    }
  }
  if (lanes.transports.empty()) return lanes;
  const std::string first = TransportClass(lanes.transports[0]);
  bool same = first != "other";
  for (const std::string& t : lanes.transports) same = same && first == TransportClass(t);
  lanes.kind = same ? first : "mixed";
  return lanes;
}

std::string UcxLanes::Describe() const {
  if (transports.empty()) return kind;
  if (kind == "tcp") return "tcp";
  return absl::StrCat(kind, " (", absl::StrJoin(transports, ", "), ")");
}

}  // namespace moe::dataplane
