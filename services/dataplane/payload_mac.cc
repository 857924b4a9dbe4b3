#include "services/dataplane/payload_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/cpus.h"
#include "services/common/thread_pool.h"

namespace moe::dataplane {

namespace {

struct CtxFree {
  void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
};

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fatal: OpenSSL %s failed\n", what);
  std::abort();
}

const unsigned char* Bytes(const std::string& s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

// The calling thread's AES-256-GCM context, keyed with the key whose id it was last given: a
// tag then costs a nonce set-up, not a key schedule and a GHASH table (0.4 us a call here).
class ThreadGcm {
 public:
  EVP_CIPHER_CTX* For(uint64_t id, const std::string& key) {
    if (ctx_ == nullptr) {
      ctx_.reset(EVP_CIPHER_CTX_new());
      if (ctx_ == nullptr) Die("EVP_CIPHER_CTX_new");
    }
    if (id_ != id) {
      id_ = 0;
      if (EVP_EncryptInit_ex(ctx_.get(), EVP_aes_256_gcm(), nullptr, Bytes(key), nullptr) != 1) {
        Die("EVP_EncryptInit_ex");
      }
      id_ = id;
    }
    return ctx_.get();
  }

 private:
  std::unique_ptr<EVP_CIPHER_CTX, CtxFree> ctx_;
  uint64_t id_ = 0;
};

thread_local ThreadGcm thread_gcm;

// nonce: direction, 3 zero bytes, the sequence big-endian.
struct Nonce {
  Nonce(Direction direction, uint64_t sequence) {
    iv[0] = static_cast<unsigned char>(direction);
    for (int i = 0; i < 8; ++i) iv[4 + i] = static_cast<unsigned char>(sequence >> (56 - 8 * i));
  }
  unsigned char iv[12] = {};
};

// GMAC of prefix || data[0, n) under `ctx`'s key and the IV.
Gf128 Gmac(EVP_CIPHER_CTX* ctx, const unsigned char iv[12], std::string_view prefix,
           const uint8_t* data, size_t n) {
  if (EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) != 1) Die("EVP_EncryptInit_ex");
  int outl = 0;
  if (!prefix.empty() &&
      EVP_EncryptUpdate(ctx, nullptr, &outl, reinterpret_cast<const unsigned char*>(prefix.data()),
                        static_cast<int>(prefix.size())) != 1) {
    Die("EVP_EncryptUpdate");
  }
  // The payload as additional authenticated data, fed in pieces below INT_MAX.
  constexpr size_t kPiece = size_t{1} << 30;
  for (size_t off = 0; off < n; off += kPiece) {
    const int len = static_cast<int>(std::min(kPiece, n - off));
    if (EVP_EncryptUpdate(ctx, nullptr, &outl, data + off, len) != 1) Die("EVP_EncryptUpdate");
  }
  unsigned char final_block[16];
  if (EVP_EncryptFinal_ex(ctx, final_block, &outl) != 1) Die("EVP_EncryptFinal_ex");
  uint8_t tag[kMacBytes];
  if (EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kMacBytes), tag) != 1) {
    Die("EVP_CTRL_GCM_GET_TAG");
  }
  return Gf128::Load(tag);
}

std::string TagBytes(Gf128 tag) {
  std::string out(kMacBytes, '\0');
  tag.Store(reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

// The pool large payloads are hashed on: one thread per CPU the process may use (the caller is
// one of them). Never destroyed: a payload may still be hashed while the process exits.
ThreadPool& MacPool() {
  static ThreadPool* pool = new ThreadPool(std::min(UsableCpus(), 8), "payload-mac");
  return *pool;
}

}  // namespace

absl::StatusOr<PayloadMac> PayloadMac::Create(const std::string& key) {
  if (key.size() != kMacKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload MAC key of ", key.size(), " bytes (need ", kMacKeyBytes, ")"));
  }
  // GHASH's key H = AES_key(0^128), for joining pieces (SP 800-38D, 7.1 step 1).
  std::unique_ptr<EVP_CIPHER_CTX, CtxFree> ecb(EVP_CIPHER_CTX_new());
  if (ecb == nullptr) Die("EVP_CIPHER_CTX_new");
  const unsigned char zero[16] = {};
  unsigned char h[32];
  int outl = 0;
  if (EVP_EncryptInit_ex(ecb.get(), EVP_aes_256_ecb(), nullptr, Bytes(key), nullptr) != 1 ||
      EVP_CIPHER_CTX_set_padding(ecb.get(), 0) != 1 ||
      EVP_EncryptUpdate(ecb.get(), h, &outl, zero, 16) != 1 || outl != 16) {
    Die("AES-256-ECB");
  }
  static std::atomic<uint64_t> next_id{1};
  const Gf128 hash_key = Gf128::Load(h);
  OPENSSL_cleanse(h, sizeof(h));
  return PayloadMac(key, next_id.fetch_add(1), hash_key);
}

std::string PayloadMac::Compute(Direction direction, uint64_t sequence, const uint8_t* data,
                                size_t n, std::string_view prefix) const {
  const size_t parallel_from = WideGhash() ? kParallelWideMacBytes : kParallelMacBytes;
  if (prefix.size() + n >= parallel_from && MacPool().size() > 1) {
    return ComputeInPieces(direction, sequence, data, n, prefix, kMacPieceBytes, &MacPool());
  }
  return TagBytes(Tag(Nonce(direction, sequence).iv, prefix, data, n));
}

Gf128 PayloadMac::Tag(const unsigned char iv[12], std::string_view prefix, const uint8_t* data,
                      size_t n) const {
  EVP_CIPHER_CTX* ctx = thread_gcm.For(id_, key_);
  if (!WideGhash()) return Gmac(ctx, iv, prefix, data, n);
  // GHASH over prefix || data, zero-padded to whole blocks, then the length block: the tag is
  // GHASH ^ AES_key(IV || 1), which is the tag of nothing (whose GHASH is 0).
  const auto* pre = reinterpret_cast<const uint8_t*>(prefix.data());
  const size_t pre_blocks = prefix.size() / 16;
  Gf128 y = GhashBlocks(ghash_, Gf128(), pre, pre_blocks);
  size_t used = 0;  // bytes of data absorbed
  if (const size_t rest = prefix.size() % 16; rest != 0) {
    uint8_t block[16] = {};
    std::memcpy(block, pre + 16 * pre_blocks, rest);
    used = std::min(n, 16 - rest);
    if (used > 0) std::memcpy(block + rest, data, used);
    y = GhashBlocks(ghash_, y, block, 1);
  }
  const size_t blocks = (n - used) / 16;
  y = GhashBlocks(ghash_, y, data + used, blocks);
  used += 16 * blocks;
  if (used < n) {
    uint8_t block[16] = {};
    std::memcpy(block, data + used, n - used);
    y = GhashBlocks(ghash_, y, block, 1);
  }
  return Mul(y ^ LengthBlock(prefix.size() + n, 0), h_) ^ Gmac(ctx, iv, {}, nullptr, 0);
}

std::string PayloadMac::ComputeInPieces(Direction direction, uint64_t sequence, const uint8_t* data,
                                        size_t n, std::string_view prefix, size_t piece_bytes,
                                        ThreadPool* pool,
                                        const std::function<void()>& between) const {
  const Nonce nonce(direction, sequence);
  const size_t total = prefix.size() + n;
  auto one_pass = [&] { return TagBytes(Tag(nonce.iv, prefix, data, n)); };
  if (piece_bytes % 16 != 0 || piece_bytes <= prefix.size() || total <= piece_bytes) {
    return one_pass();
  }
  // Piece i is bytes [i * piece_bytes, ...) of prefix || data: the prefix lies in piece 0.
  const size_t pieces = (total + piece_bytes - 1) / piece_bytes;
  std::vector<Gf128> tags(pieces);
  auto hash_piece = [&](int64_t i) {
    const size_t begin = static_cast<size_t>(i) * piece_bytes;
    const size_t end = std::min(total, begin + piece_bytes);
    const size_t data_begin = i == 0 ? 0 : begin - prefix.size();
    tags[i] = Tag(nonce.iv, i == 0 ? prefix : std::string_view(), data + data_begin,
                  end - prefix.size() - data_begin);
  };
  if (pool == nullptr) {
    for (size_t i = 0; i < pieces; ++i) {
      hash_piece(static_cast<int64_t>(i));
      if (between && i + 1 < pieces) between();
    }
  } else if (!pool->TryParallelFor(static_cast<int64_t>(pieces), hash_piece)) {
    return one_pass();  // the pool is hashing another payload: no waiting for it
  }
  // Each piece's tag is T_i = (Y_i ^ L_i) H ^ E: Y_i its GHASH before the length block L_i, E =
  // AES_key(nonce || 1) (the tag of nothing: L = 0). The whole message's Y = sum_i Y_i
  // H^(blocks after piece i), so its tag (Y ^ L) H ^ E = sum_i (T_i ^ E ^ L_i H) H^(blocks
  // after i) ^ L H ^ E, summed by Horner's rule (every piece but the last has piece_bytes).
  const Gf128 mask = Gmac(thread_gcm.For(id_, key_), nonce.iv, {}, nullptr, 0);
  const Gf128 h_piece = Pow(h_, piece_bytes / 16);
  const Gf128 piece_length = Mul(LengthBlock(piece_bytes, 0), h_);
  Gf128 sum;
  for (size_t i = 0; i + 1 < pieces; ++i) sum = Mul(sum, h_piece) ^ tags[i] ^ mask ^ piece_length;
  const size_t last = total - (pieces - 1) * piece_bytes;
  sum =
      Mul(sum, Pow(h_, (last + 15) / 16)) ^ tags[pieces - 1] ^ mask ^ Mul(LengthBlock(last, 0), h_);
  return TagBytes(sum ^ Mul(LengthBlock(total, 0), h_) ^ mask);
}

bool PayloadMac::Verify(Direction direction, uint64_t sequence, const uint8_t* data, size_t n,
                        const std::string& tag, std::string_view prefix) const {
  if (tag.size() != kMacBytes) return false;
  const std::string want = Compute(direction, sequence, data, n, prefix);
  return CRYPTO_memcmp(want.data(), tag.data(), kMacBytes) == 0;
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0 && RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    Die("RAND_bytes");
  }
  return out;
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

uint64_t RandomU64() {
  uint64_t v = 0;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof(v)) != 1) Die("RAND_bytes");
  return v;
}

}  // namespace moe::dataplane
