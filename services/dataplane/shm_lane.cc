#include "services/dataplane/shm_lane.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "services/dataplane/payload_mac.h"

namespace moe::dataplane {

namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the rings' positions are shared between processes: they must be lock-free");

constexpr uint32_t kKindRecord = 1, kKindPad = 2;
// A record's protobuf header is small (a Dispatch request or reply without payload).
constexpr uint32_t kMaxHeaderBytes = 1 << 20;

// A record's first 64 bytes as they lie in the ring.
struct RecordHead {
  uint64_t record_bytes;
  uint32_t kind;
  uint32_t header_bytes;
  uint64_t payload_bytes;
  uint64_t token;
  uint64_t sequence;
  uint8_t unused[24];
};
static_assert(sizeof(RecordHead) == kShmRecordHeadBytes);

uint64_t RoundUp(uint64_t n) {
  return (n + kShmRecordAlign - 1) / kShmRecordAlign * kShmRecordAlign;
}

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::Status Corrupt(const std::string& what) {
  return absl::DataLossError(absl::StrCat("the shared-memory ring broke its protocol: ", what));
}

}  // namespace

OwnedFd& OwnedFd::operator=(OwnedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t ShmRing::RecordBytes(size_t header_bytes, uint64_t payload_bytes) {
  return kShmRecordHeadBytes + RoundUp(header_bytes) + RoundUp(payload_bytes);
}

absl::StatusOr<ShmRing::Slot> ShmRing::Reserve(size_t header_bytes, uint64_t payload_bytes) {
  if (header_bytes > kMaxHeaderBytes || payload_bytes > capacity_ ||
      RecordBytes(header_bytes, payload_bytes) > capacity_ / 2) {
    return absl::OutOfRangeError(absl::StrCat("a record of ", header_bytes, " + ", payload_bytes,
                                              " bytes does not fit a ring of ", capacity_));
  }
  const uint64_t rec = RecordBytes(header_bytes, payload_bytes);
  const uint64_t tail = tail_->load(std::memory_order_acquire);
  // The reader can have freed only what was published.
  if (mine_ - tail > capacity_ || tail % kShmRecordAlign != 0) {
    return Corrupt(absl::StrCat("the reader's position ", tail, " against the writer's ", mine_));
  }
  const uint64_t used = read_ - tail;
  const uint64_t off = read_ % capacity_;
  const bool reuse = used == 0 && off >= kShmReuseFrom && rec <= off;
  const uint64_t pad = off + rec > capacity_ || reuse ? capacity_ - off : 0;
  if (used + pad + rec > capacity_) return absl::ResourceExhaustedError("the ring is full");
  Slot s;
  s.start = read_;
  s.header = data_ + (off + pad) % capacity_ + kShmRecordHeadBytes;
  s.payload = s.header + RoundUp(header_bytes);
  s.header_bytes = static_cast<uint32_t>(header_bytes);
  s.payload_bytes = payload_bytes;
  s.pad = pad;
  s.record_bytes = rec;
  read_ = s.end();
  open_.emplace_back(read_, false);
  return s;
}

uint8_t* ShmRing::HeaderAt(const Slot& s, size_t header_bytes) {
  return s.payload - RoundUp(header_bytes);
}

void ShmRing::WriteFiller(uint64_t at, uint64_t bytes) {
  RecordHead pad{};
  pad.record_bytes = bytes;
  pad.kind = kKindPad;
  std::memcpy(data_ + at % capacity_, &pad, sizeof pad);
}

bool ShmRing::Complete(uint64_t end) {
  for (auto& [e, done] : open_) {
    if (e == end) done = true;
  }
  const uint64_t before = mine_;
  while (!open_.empty() && open_.front().second) {
    mine_ = open_.front().first;
    open_.pop_front();
  }
  return mine_ != before;
}

void ShmRing::Publish(const Slot& s, const ShmRecordHead& h) { Publish(s, h, s.header_bytes); }

void ShmRing::Publish(const Slot& s, const ShmRecordHead& h, size_t header_bytes) {
  if (s.pad != 0) WriteFiller(s.start, s.pad);
  header_bytes = std::min<size_t>(header_bytes, s.header_bytes);
  const uint64_t gap = RoundUp(s.header_bytes) - RoundUp(header_bytes);
  const uint64_t at = s.start + s.pad;
  if (gap != 0) WriteFiller(at, gap);
  RecordHead head{};
  head.record_bytes = s.record_bytes - gap;
  head.kind = kKindRecord;
  head.header_bytes = static_cast<uint32_t>(header_bytes);
  head.payload_bytes = s.payload_bytes;
  head.token = h.token;
  head.sequence = h.sequence;
  std::memcpy(data_ + (at + gap) % capacity_, &head, sizeof head);
  if (Complete(s.end())) Advertise();  // else an earlier slot is still being filled
}

void ShmRing::Abandon(const Slot& s) {
  if (s.pad != 0) WriteFiller(s.start, s.pad);
  WriteFiller(s.start + s.pad, s.record_bytes);
  if (Complete(s.end())) Advertise();
}

void ShmRing::Advertise() {
  head_->store(mine_, std::memory_order_release);
  // Either the consumer sees the new position when it looks again after saying it sleeps, or
  // this sees that it sleeps (both sides fence between their store and their load).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping_->load(std::memory_order_relaxed) != 0) dataplane::Ring(doorbell_);
}

absl::StatusOr<std::optional<ShmRecord>> ShmRing::Peek() {
  // Fillers are skipped as they come; each is at least 64 bytes, so this ends within a ring.
  for (;;) {
    const uint64_t head = head_->load(std::memory_order_acquire);
    const uint64_t avail = head - read_;
    if (avail == 0) return std::nullopt;
    if (avail > capacity_ - (read_ - mine_) || avail % kShmRecordAlign != 0) {
      return Corrupt(absl::StrCat("the writer's position ", head, " against the reader's ", read_));
    }
    const uint64_t off = read_ % capacity_;
    RecordHead h;
    std::memcpy(&h, data_ + off, sizeof h);  // read once; checked on this copy only
    if (h.record_bytes < kShmRecordHeadBytes || h.record_bytes % kShmRecordAlign != 0 ||
        h.record_bytes > avail || off + h.record_bytes > capacity_) {
      return Corrupt(absl::StrCat("a record of ", h.record_bytes, " bytes at ", off));
    }
    if (h.kind == kKindPad) {
      read_ += h.record_bytes;
      open_.emplace_back(read_, true);
      if (Complete(read_)) tail_->store(mine_, std::memory_order_release);
      continue;
    }
    if (h.kind != kKindRecord || h.header_bytes > kMaxHeaderBytes || h.payload_bytes > capacity_ ||
        RecordBytes(h.header_bytes, h.payload_bytes) != h.record_bytes) {
      return Corrupt(absl::StrCat("a record of kind ", h.kind, " with ", h.header_bytes, " + ",
                                  h.payload_bytes, " bytes in ", h.record_bytes));
    }
    ShmRecord r;
    r.token = h.token;
    r.sequence = h.sequence;
    r.header = data_ + off + kShmRecordHeadBytes;
    r.header_bytes = h.header_bytes;
    r.payload = r.header + RoundUp(h.header_bytes);
    r.payload_bytes = h.payload_bytes;
    r.record_bytes = h.record_bytes;
    read_ += h.record_bytes;
    r.end = read_;
    open_.emplace_back(read_, false);
    return r;
  }
}

void ShmRing::Release(const ShmRecord& r) {
  if (Complete(r.end)) tail_->store(mine_, std::memory_order_release);
}

bool ShmRing::MaybeReady() const { return head_->load(std::memory_order_acquire) != read_; }

void ShmRing::SetSleeping(bool sleeping) {
  sleeping_->store(sleeping ? 1 : 0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

ShmRegion::ShmRegion(ShmRegion&& o) noexcept
    : fd_(std::move(o.fd_)), base_(o.base_), ring_bytes_(o.ring_bytes_) {
  o.base_ = nullptr;
}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) ::munmap(base_, bytes());
    fd_ = std::move(o.fd_);
    base_ = o.base_;
    ring_bytes_ = o.ring_bytes_;
    o.base_ = nullptr;
  }
  return *this;
}

ShmRegion::~ShmRegion() {
  if (base_ != nullptr) ::munmap(base_, bytes());
}

namespace {
absl::Status CheckRingBytes(uint64_t ring_bytes) {
  if (ring_bytes < kShmMinRing || ring_bytes > kShmMaxRing || ring_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a ring of ", ring_bytes, " bytes (",
                                                   kShmMinRing, " to ", kShmMaxRing,
                                                   ", a multiple of 4096)"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<ShmRegion> ShmRegion::Create(uint64_t ring_bytes) {
  if (absl::Status s = CheckRingBytes(ring_bytes); !s.ok()) return s;
  ShmRegion r;
  r.fd_ = OwnedFd(::memfd_create("moe-shm-data-plane", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!r.fd_.valid()) return Errno("memfd_create");
  r.ring_bytes_ = ring_bytes;
  if (::ftruncate(r.fd_.get(), static_cast<off_t>(r.bytes())) != 0) return Errno("ftruncate");
  if (::fcntl(r.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno("sealing the memfd");
  }
  void* p = ::mmap(nullptr, r.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_.get(), 0);
  if (p == MAP_FAILED) return Errno("mmap");
  r.base_ = static_cast<uint8_t*>(p);
  return r;
}

absl::StatusOr<ShmRegion> ShmRegion::Map(OwnedFd fd, uint64_t ring_bytes) {
  if (absl::Status s = CheckRingBytes(ring_bytes); !s.ok()) return s;
  // The seals first: once they hold, the size below cannot change.
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) return absl::InvalidArgumentError("the region is not a sealable memfd");
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    return absl::InvalidArgumentError("the region is not sealed against shrinking and growing");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("the region is not a memfd");
  }
  ShmRegion r;
  r.ring_bytes_ = ring_bytes;
  if (static_cast<uint64_t>(st.st_size) != r.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the region has ", st.st_size, " bytes, two rings of ", ring_bytes, " take ", r.bytes()));
  }
  void* p = ::mmap(nullptr, r.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("mapping the region: ", std::strerror(errno)));
  }
  r.base_ = static_cast<uint8_t*>(p);
  r.fd_ = std::move(fd);
  return r;
}

ShmRing ShmRegion::Ring(ShmDirection direction, int doorbell) const {
  ShmRing r;
  r.capacity_ = ring_bytes_;
  const bool to_shard = direction == ShmDirection::kToShard;
  r.data_ = base_ + kShmControlBytes + (to_shard ? 0 : ring_bytes_);
  auto at = [this](size_t off) { return base_ + off; };
  r.head_ =
      reinterpret_cast<std::atomic<uint64_t>*>(at(to_shard ? kShmToShardHead : kShmToNodeHead));
  r.tail_ =
      reinterpret_cast<std::atomic<uint64_t>*>(at(to_shard ? kShmToShardTail : kShmToNodeTail));
  r.sleeping_ = reinterpret_cast<std::atomic<uint32_t>*>(
      at(to_shard ? kShmToShardSleeping : kShmToNodeSleeping));
  r.doorbell_ = doorbell;
  return r;
}

absl::StatusOr<ShmRing::Slot> ReserveWithin(ShmRing& ring, size_t header_bytes,
                                            uint64_t payload_bytes, absl::Time deadline) {
  for (int tries = 0;; ++tries) {
    absl::StatusOr<ShmRing::Slot> s = ring.Reserve(header_bytes, payload_bytes);
    if (s.ok() || !absl::IsResourceExhausted(s.status()) || absl::Now() >= deadline) return s;
    std::this_thread::sleep_for(std::chrono::microseconds(tries < 100 ? 10 : 200));
  }
}

std::shared_ptr<void> CopyAligned(const uint8_t* src, uint64_t bytes) {
  std::shared_ptr<void> copy(std::aligned_alloc(64, std::max<uint64_t>(RoundUp(bytes), 64)),
                             std::free);
  if (copy != nullptr) std::memcpy(copy.get(), src, bytes);
  return copy;
}

absl::StatusOr<OwnedFd> NewEventFd() {
  OwnedFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!fd.valid()) return Errno("eventfd");
  return fd;
}

bool IsEventFd(int fd) {
  char link[64] = {};
  const std::string path = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = ::readlink(path.c_str(), link, sizeof link - 1);
  return n > 0 && std::string_view(link, static_cast<size_t>(n)) == "anon_inode:[eventfd]";
}

void Ring(int doorbell) {
  if (doorbell < 0) return;
  const uint64_t one = 1;
  // Non-blocking: a full counter (EAGAIN) already means "wake up".
  (void)!::write(doorbell, &one, sizeof one);
}

void Drain(int doorbell) {
  uint64_t n = 0;
  (void)!::read(doorbell, &n, sizeof n);
}

absl::Status SendWithFds(int socket, std::string_view bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  if (n != static_cast<ssize_t>(bytes.size())) return Errno("sendmsg");
  return absl::OkStatus();
}

absl::StatusOr<Datagram> ReceiveWithFds(int socket, size_t max_bytes, size_t max_fds) {
  Datagram d;
  d.bytes.resize(max_bytes + 1);
  iovec iov{d.bytes.data(), d.bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(max_fds, 1)));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  const ssize_t n = ::recvmsg(socket, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::UnavailableError("nothing yet");
    return Errno("recvmsg");
  }
  // Every descriptor that arrived is owned (and closed on any error) before anything is checked.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      d.fds.emplace_back(fd);
    }
  }
  if (n == 0 && d.fds.empty()) return absl::AbortedError("the peer closed the socket");
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || static_cast<size_t>(n) > max_bytes ||
      d.fds.size() > max_fds) {
    return absl::InvalidArgumentError(
        absl::StrCat("a message over ", max_bytes, " bytes or ", max_fds, " descriptors"));
  }
  d.bytes.resize(static_cast<size_t>(n));
  return d;
}

namespace {
absl::StatusOr<sockaddr_un> AbstractAddress(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof a.sun_path) {
    return absl::InvalidArgumentError(absl::StrCat("abstract socket name '", name, "'"));
  }
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}
}  // namespace

absl::StatusOr<UnixListener> ListenAbstract(const std::string& prefix) {
  UnixListener l;
  l.fd = OwnedFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!l.fd.valid()) return Errno("socket");
  const std::string name = absl::StrCat(prefix, "-", absl::BytesToHexString(RandomBytes(12)));
  socklen_t len = 0;
  absl::StatusOr<sockaddr_un> a = AbstractAddress(name, &len);
  if (!a.ok()) return a.status();
  if (::bind(l.fd.get(), reinterpret_cast<const sockaddr*>(&*a), len) != 0) return Errno("bind");
  if (::listen(l.fd.get(), 64) != 0) return Errno("listen");
  l.address = "@" + name;
  return l;
}

absl::StatusOr<OwnedFd> ConnectAbstract(const std::string& address) {
  if (address.size() < 2 || address[0] != '@') {
    return absl::InvalidArgumentError(
        absl::StrCat("not an abstract socket address: '", address, "'"));
  }
  socklen_t len = 0;
  absl::StatusOr<sockaddr_un> a = AbstractAddress(address.substr(1), &len);
  if (!a.ok()) return a.status();
  OwnedFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*a), len) != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", address, ": ", std::strerror(errno)));
  }
  if (::fcntl(fd.get(), F_SETFL, O_NONBLOCK) != 0) return Errno("fcntl");
  return fd;
}

absl::StatusOr<uint32_t> PeerUid(int socket) {
  ucred c{};
  socklen_t len = sizeof c;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0) return Errno("SO_PEERCRED");
  return c.uid;
}

void WaitReadable(int fd, int hangup, std::chrono::steady_clock::time_point until) {
  const auto left = until - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  pollfd p[2] = {{fd, POLLIN, 0}, {hangup, POLLRDHUP, 0}};
  (void)::ppoll(p, hangup >= 0 ? 2 : 1, &ts, nullptr);
}

}  // namespace moe::dataplane
