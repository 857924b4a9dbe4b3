#include "services/dataplane/data_plane.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"

namespace moe::dataplane {

absl::StatusOr<DataPlane> ParseDataPlane(const std::string& name,
                                         const std::vector<std::string>& backends) {
  if (name == "auto" || name == "grpc" ||
      std::find(backends.begin(), backends.end(), name) != backends.end()) {
    return DataPlane{name};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "data plane '", name, "' is not one of auto, grpc, ", absl::StrJoin(backends, ", ")));
}

std::string SealBatchFrame(const PayloadMac& mac, Direction direction, BatchFrame f,
                           const uint8_t* payload, size_t n) {
  f.mac.clear();
  f.mac = mac.Compute(direction, f.sequence, payload, n, MacPrefix(EncodeBatchFrame(f)));
  return EncodeBatchFrame(f);
}

namespace {
absl::Status ReplyIntegrityFailed() {
  return absl::DataLossError(
      "the reply message failed its integrity check (AES-GMAC of the connection)");
}
// The frame of a reply to this client's batch `sequence` over n payload bytes, with kDetachTag
// set or not as `detached` says; DATA_LOSS otherwise.
absl::StatusOr<BatchFrame> ReplyFrameFor(std::string_view frame, size_t n, uint64_t client_id,
                                         uint64_t sequence, bool detached) {
  absl::StatusOr<BatchFrame> f = ParseBatchFrame(frame, BatchKind::kReply, n);
  if (!f.ok() || f->client_id != client_id || f->sequence != sequence ||
      ((f->flags & kDetachTag) != 0) != detached) {
    return ReplyIntegrityFailed();
  }
  return f;
}
}  // namespace

absl::StatusOr<BatchFrame> OpenReplyFrame(const PayloadMac& mac, std::string_view frame,
                                          const uint8_t* payload, size_t n, uint64_t client_id,
                                          uint64_t sequence) {
  absl::StatusOr<BatchFrame> f = ReplyFrameFor(frame, n, client_id, sequence, false);
  if (!f.ok() ||
      !mac.Verify(Direction::kToAttention, sequence, payload, n, f->mac, MacPrefix(frame))) {
    return ReplyIntegrityFailed();
  }
  return f;
}

std::string ReplyTagFrame(const PayloadMac& mac, const BatchFrame& reply, const uint8_t* payload,
                          size_t n, const std::function<void()>& between) {
  BatchFrame t;
  t.token = ReplyTagToken(reply.token);
  t.kind = BatchKind::kReplyTag;
  t.client_id = reply.client_id;
  t.sequence = reply.sequence;
  // On this thread, without the MAC pool even past its threshold: the pieces leave room for
  // `between`, and this hash runs under the transfer and the attention node's own hash of the
  // same bytes (which may use its pool), the longer of the two.
  t.mac = mac.ComputeInPieces(Direction::kToAttention, reply.sequence, payload, n,
                              MacPrefix(EncodeBatchFrame(reply)), kMacPieceBytes, nullptr, between);
  return EncodeBatchFrame(t);
}

absl::StatusOr<DetachedReply> HashDetachedReply(const PayloadMac& mac, std::string_view frame,
                                                const uint8_t* payload, size_t n,
                                                uint64_t client_id, uint64_t sequence) {
  MOE_ASSIGN_OR_RETURN(BatchFrame f, ReplyFrameFor(frame, n, client_id, sequence, true));
  return DetachedReply{
      f, mac.Compute(Direction::kToAttention, sequence, payload, n, MacPrefix(frame))};
}

absl::Status CheckReplyTag(const DetachedReply& reply, std::string_view tag_frame) {
  absl::StatusOr<BatchFrame> t = ParseBatchFrame(tag_frame, BatchKind::kReplyTag, 0);
  if (!t.ok() || t->token != ReplyTagToken(reply.frame.token) ||
      t->client_id != reply.frame.client_id || t->sequence != reply.frame.sequence ||
      t->header_bytes != 0 || t->flags != 0 || !ConstantTimeEqual(t->mac, reply.want)) {
    return ReplyIntegrityFailed();
  }
  return absl::OkStatus();
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

namespace {
constexpr char kBatchMagic[4] = {'M', 'O', 'E', 'B'};
constexpr uint8_t kBatchVersion = 1;

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(std::string_view b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}
}  // namespace

std::string EncodeBatchFrame(const BatchFrame& f) {
  std::string out;
  out.reserve(kBatchFrameBytes);
  PutLe(out, f.token, 8);
  out.append(kBatchMagic, 4);
  out.push_back(static_cast<char>(kBatchVersion));
  out.push_back(static_cast<char>(f.kind));
  out.push_back(static_cast<char>(f.flags));
  out.push_back('\0');
  PutLe(out, f.client_id, 8);
  PutLe(out, f.sequence, 8);
  PutLe(out, f.header_bytes, 4);
  PutLe(out, 0, 4);
  std::string mac = f.mac;
  mac.resize(kBatchFrameBytes - kBatchFrameMacOffset, '\0');
  out += mac;
  return out;
}

absl::StatusOr<BatchFrame> ParseBatchFrame(std::string_view b, BatchKind kind,
                                           size_t payload_bytes) {
  if (b.size() != kBatchFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch frame of ", b.size(), " bytes (a frame has ", kBatchFrameBytes, ")"));
  }
  if (std::memcmp(b.data() + 8, kBatchMagic, 4) != 0 ||
      static_cast<uint8_t>(b[12]) != kBatchVersion) {
    return absl::InvalidArgumentError("batch frame without the MOEB v1 magic");
  }
  const uint8_t flags = static_cast<uint8_t>(b[14]);
  if (static_cast<uint8_t>(b[13]) != static_cast<uint8_t>(kind) || (flags & ~kDetachTag) != 0 ||
      (flags != 0 && kind == BatchKind::kReplyTag) || b[15] != 0 || GetLe(b, 36, 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch frame of kind ", static_cast<int>(static_cast<uint8_t>(b[13])),
                     " (expected ", static_cast<int>(kind), "), with unknown flags ",
                     static_cast<int>(flags), " or with reserved bytes set"));
  }
  BatchFrame f;
  f.flags = flags;
  f.token = GetLe(b, 0, 8);
  f.kind = kind;
  f.client_id = GetLe(b, 16, 8);
  f.sequence = GetLe(b, 24, 8);
  f.header_bytes = static_cast<uint32_t>(GetLe(b, 32, 4));
  if (f.header_bytes > payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("batch frame with a ", f.header_bytes,
                                                   "-byte header in a ", payload_bytes,
                                                   "-byte payload"));
  }
  f.mac.assign(b.data() + kBatchFrameMacOffset, kBatchFrameBytes - kBatchFrameMacOffset);
  return f;
}

bool UsesSharedMemoryFifo(const UcxLanes& lanes) {
  for (const std::string& t : lanes.transports) {
    if (t == "posix" || t == "sysv" || t == "xpmem") return true;
  }
  return false;
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
