#include "services/dataplane/payload_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/strings/str_cat.h"

namespace moe::dataplane {

namespace {

struct CtxFree {
  void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
};

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fatal: OpenSSL %s failed\n", what);
  std::abort();
}

}  // namespace

absl::StatusOr<PayloadMac> PayloadMac::Create(const std::string& key) {
  if (key.size() != kMacKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload MAC key of ", key.size(), " bytes (need ", kMacKeyBytes, ")"));
  }
  return PayloadMac(key);
}

std::string PayloadMac::Compute(Direction direction, uint64_t sequence, const uint8_t* data,
                                size_t n, std::string_view prefix) const {
  // nonce: direction, 3 zero bytes, the sequence big-endian.
  unsigned char iv[12] = {static_cast<unsigned char>(direction), 0, 0, 0};
  for (int i = 0; i < 8; ++i) iv[4 + i] = static_cast<unsigned char>(sequence >> (56 - 8 * i));
  std::unique_ptr<EVP_CIPHER_CTX, CtxFree> ctx(EVP_CIPHER_CTX_new());
  if (ctx == nullptr) Die("EVP_CIPHER_CTX_new");
  if (EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key_.data()), iv) != 1) {
    Die("EVP_EncryptInit_ex");
  }
  int outl = 0;
  if (!prefix.empty() && EVP_EncryptUpdate(ctx.get(), nullptr, &outl,
                                           reinterpret_cast<const unsigned char*>(prefix.data()),
                                           static_cast<int>(prefix.size())) != 1) {
    Die("EVP_EncryptUpdate");
  }
  // The payload as additional authenticated data, fed in pieces below INT_MAX.
  constexpr size_t kPiece = size_t{1} << 30;
  for (size_t off = 0; off < n; off += kPiece) {
    const int len = static_cast<int>(std::min(kPiece, n - off));
    if (EVP_EncryptUpdate(ctx.get(), nullptr, &outl, data + off, len) != 1) {
      Die("EVP_EncryptUpdate");
    }
  }
  unsigned char final_block[16];
  if (EVP_EncryptFinal_ex(ctx.get(), final_block, &outl) != 1) Die("EVP_EncryptFinal_ex");
  std::string tag(kMacBytes, '\0');
  if (EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, static_cast<int>(kMacBytes),
                          tag.data()) != 1) {
    Die("EVP_CTRL_GCM_GET_TAG");
  }
  return tag;
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
