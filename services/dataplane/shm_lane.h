// The project's own shared-memory lane (docs/data-plane.md, "The shm data plane"): an attention
// node and an expert shard on one host share one sealed memfd of two rings, one per direction,
// and wake each other through eventfds only when the other side said it sleeps. The node makes
// the memfd and both eventfds and passes them to the shard over a Unix socket, in a hello that
// carries the client's secret from the authenticated OpenDataPlane call; nobody else holds the
// descriptors, so no byte in the rings is MACed, and each batch is one record each way. A
// writer reserves a slot, fills it (a shard computes a reply into it), and publishes it; slots
// appear in ring order. A reader frees records in any order (a node holds a reply's record
// while it reads the rows in place).
//
// Each side treats every byte of the region as hostile and changing under it: it keeps its own
// position privately (never reads it back), reads the peer's position once and bounds it, and
// copies a record's 64-byte head before checking it. A region not sealed against shrinking (a
// SIGBUS on the mapper's next touch) is refused before it is mapped.
//
//   MOE_ASSIGN_OR_RETURN(ShmRegion r, ShmRegion::Create(8 << 20));       // the node
//   ShmRing to_shard = r.Ring(ShmDirection::kToShard, doorbell_of_shard);
//   MOE_ASSIGN_OR_RETURN(ShmRing::Slot s, to_shard.Reserve(header.size(), payload_bytes));
//   ... write the header at s.header, the payload at s.payload ...
//   to_shard.Publish(s, {.token = t, .sequence = q});
//   MOE_ASSIGN_OR_RETURN(std::optional<ShmRecord> rec, from_node.Peek());  // the shard
#ifndef MOE_SERVICES_DATAPLANE_SHM_LANE_H_
#define MOE_SERVICES_DATAPLANE_SHM_LANE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe::dataplane {

// A file descriptor that closes itself.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& o) noexcept : fd_(o.release()) {}
  OwnedFd& operator=(OwnedFd&& o) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int get() const { return fd_; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

constexpr size_t kShmControlBytes = 4096;
constexpr size_t kShmRecordAlign = 64;
constexpr size_t kShmRecordHeadBytes = 64;
// Each ring's capacity lies in [kShmMinRing, kShmMaxRing], a multiple of 4096.
constexpr uint64_t kShmMinRing = uint64_t{1} << 20;
// A writer that finds its ring empty (the reader freed everything) once it is this far in
// starts the next record at the ring's start again, behind a filler to the end: the pages in
// use stay those of the batches in flight, warm in cache and few in each process's memory,
// instead of every page of the ring in turn.
constexpr uint64_t kShmReuseFrom = uint64_t{1} << 20;
constexpr uint64_t kShmMaxRing = uint64_t{1} << 32;

// The control page: each position on its own cache line; who writes it in the comment.
enum ShmControlOffset : size_t {
  kShmToShardHead = 64,       // the node
  kShmToShardTail = 128,      // the shard
  kShmToShardSleeping = 192,  // the shard
  kShmToNodeHead = 256,       // the shard
  kShmToNodeTail = 320,       // the node
  kShmToNodeSleeping = 384,   // the node
};

enum class ShmDirection { kToShard, kToNode };

// What a record's head says, and where its bytes are (in the mapped region: they may change
// under the reader, who copies what it keeps).
struct ShmRecord {
  uint64_t token = 0, sequence = 0;
  const uint8_t* header = nullptr;  // header_bytes
  uint32_t header_bytes = 0;
  const uint8_t* payload = nullptr;  // 64-byte aligned
  uint64_t payload_bytes = 0;
  uint64_t record_bytes = 0;  // what Release frees
  uint64_t end = 0;           // its end in the ring's stream (Release's key)
};

struct ShmRecordHead {
  uint64_t token = 0, sequence = 0;
};

// One direction's ring as one side sees it: the producer or the consumer.
class ShmRing {
 public:
  struct Slot {
    uint8_t* header = nullptr;
    uint8_t* payload = nullptr;  // 64-byte aligned
    uint32_t header_bytes = 0;   // the header's room (at `header` when it is all used)
    uint64_t payload_bytes = 0;
    uint64_t start = 0;                  // the slot's position in the ring's stream
    uint64_t pad = 0, record_bytes = 0;  // the wrap's filler before it, and its own size
    uint64_t end() const { return start + pad + record_bytes; }
  };
  ShmRing() = default;

  // The bytes a record of these sizes takes in the ring.
  static uint64_t RecordBytes(size_t header_bytes, uint64_t payload_bytes);

  // Producer. Slots are handed out in ring order and may be filled in any order; each becomes
  // visible once it and every slot before it are published or abandoned.
  // RESOURCE_EXHAUSTED while the ring lacks room (the consumer frees it as it reads);
  // OUT_OF_RANGE for a record larger than half the ring (it would never fit); DATA_LOSS when the
  // consumer's position is impossible (the peer broke the region).
  absl::StatusOr<Slot> Reserve(size_t header_bytes, uint64_t payload_bytes);
  // Where a header of `header_bytes` (at most the slot's room) goes so that it ends where the
  // payload starts.
  static uint8_t* HeaderAt(const Slot& slot, size_t header_bytes);
  // Publishes the record (its header of `header_bytes`, at most the room reserved, written at
  // HeaderAt; the room it did not use becomes a filler before it), then wakes the consumer if
  // it sleeps and the record became visible.
  void Publish(const Slot& slot, const ShmRecordHead& head);
  void Publish(const Slot& slot, const ShmRecordHead& head, size_t header_bytes);
  // A slot that will carry nothing: fillers, so that the slots after it are not held back.
  void Abandon(const Slot& slot);

  // Consumer. The next record after the last one returned (nullopt while there is none;
  // fillers are skipped), DATA_LOSS for anything a producer keeping the protocol cannot write
  // (the caller drops the connection).
  absl::StatusOr<std::optional<ShmRecord>> Peek();
  // Frees a record Peek returned, in any order: the ring's space is freed up to the oldest one
  // still held.
  void Release(const ShmRecord& record);
  // Bytes returned by Peek and not yet freed.
  uint64_t held() const { return read_ - mine_; }
  // Whether a record may be waiting (cheap: one load).
  bool MaybeReady() const;
  // The consumer says whether it sleeps (the producer then rings its doorbell).
  void SetSleeping(bool sleeping);

  uint64_t capacity() const { return capacity_; }

 private:
  friend class ShmRegion;
  // Marks the slot or record ending at `end` done, and moves `mine_` over the done ones.
  bool Complete(uint64_t end);
  // The producer's new position to the consumer, and its doorbell if it sleeps.
  void Advertise();
  void WriteFiller(uint64_t at, uint64_t bytes);

  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
  std::atomic<uint64_t>* head_ = nullptr;      // the producer's position (it writes)
  std::atomic<uint64_t>* tail_ = nullptr;      // the consumer's position (it writes)
  std::atomic<uint32_t>* sleeping_ = nullptr;  // the consumer sleeps on its doorbell
  int doorbell_ = -1;                          // the consumer's eventfd (the producer writes it)
  // This side's own positions, never read back from the region: published (producer) or freed
  // (consumer); reserved (producer) or read (consumer); and the slots or records in between.
  uint64_t mine_ = 0, read_ = 0;
  std::deque<std::pair<uint64_t, bool>> open_;  // (end, done), in ring order
};

// The mapped region: a control page, then the ring to the shard, then the ring to the node.
class ShmRegion {
 public:
  ShmRegion() = default;
  ShmRegion(ShmRegion&& o) noexcept;
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ~ShmRegion();

  // The node: a new memfd of two rings of `ring_bytes`, sealed against shrinking and growing.
  static absl::StatusOr<ShmRegion> Create(uint64_t ring_bytes);
  // The shard: the memfd a node sent, checked (a memfd, sealed, exactly the size two rings of
  // `ring_bytes` take) before it is mapped; INVALID_ARGUMENT naming what is wrong otherwise.
  static absl::StatusOr<ShmRegion> Map(OwnedFd fd, uint64_t ring_bytes);

  // A view of `direction`'s ring (the producer's or the consumer's: each uses its half, from
  // position 0 of the fresh region); `doorbell`: the consumer's eventfd (the producer writes
  // it; the consumer's own view may pass -1).
  ShmRing Ring(ShmDirection direction, int doorbell) const;
  int fd() const { return fd_.get(); }
  uint64_t ring_bytes() const { return ring_bytes_; }
  size_t bytes() const { return kShmControlBytes + 2 * ring_bytes_; }
  // For hostile tests: the mapped bytes.
  uint8_t* base() const { return base_; }

 private:
  OwnedFd fd_;
  uint8_t* base_ = nullptr;
  uint64_t ring_bytes_ = 0;
};

// Reserve, waiting for room (the consumer frees it as it reads) until `deadline`: short sleeps
// first, then longer ones. RESOURCE_EXHAUSTED at the deadline; Reserve's other errors at once.
absl::StatusOr<ShmRing::Slot> ReserveWithin(ShmRing& ring, size_t header_bytes,
                                            uint64_t payload_bytes, absl::Time deadline);

// `bytes` of `src` (in a ring: a peer may still write them) copied into memory of this process,
// 64-byte aligned; null if it cannot be had.
std::shared_ptr<void> CopyAligned(const uint8_t* src, uint64_t bytes);

// A new eventfd (non-blocking, close-on-exec).
absl::StatusOr<OwnedFd> NewEventFd();
// Whether `fd` is an eventfd (what a peer says is a doorbell must be one: a write to anything
// else could block or reach a file).
bool IsEventFd(int fd);
// Adds one to a doorbell; never blocks.
void Ring(int doorbell);
// Empties a doorbell.
void Drain(int doorbell);

// One datagram over a SOCK_SEQPACKET Unix socket with up to `fds.size()` descriptors.
absl::Status SendWithFds(int socket, std::string_view bytes, const std::vector<int>& fds);
// One datagram and the descriptors it carried (at most max_fds: more, or a truncated message,
// is INVALID_ARGUMENT, and every descriptor that arrived is closed). Non-blocking sockets:
// UNAVAILABLE when nothing is there.
struct Datagram {
  std::string bytes;
  std::vector<OwnedFd> fds;
};
absl::StatusOr<Datagram> ReceiveWithFds(int socket, size_t max_bytes, size_t max_fds);

// A listening SOCK_SEQPACKET socket in the abstract namespace (of this network namespace:
// nothing on disk), at a random name; its address for a peer is "@" + name.
struct UnixListener {
  OwnedFd fd;
  std::string address;
};
absl::StatusOr<UnixListener> ListenAbstract(const std::string& prefix);
// Connects to an address ListenAbstract gave (non-blocking after).
absl::StatusOr<OwnedFd> ConnectAbstract(const std::string& address);
// The uid of a connected Unix socket's peer (SO_PEERCRED).
absl::StatusOr<uint32_t> PeerUid(int socket);

// Waits until `fd` is readable, or the socket `hangup` closed, or `until`; spurious returns
// are fine (the caller looks again).
void WaitReadable(int fd, int hangup, std::chrono::steady_clock::time_point until);

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_SHM_LANE_H_
