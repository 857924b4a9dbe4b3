// The payload MAC's oracle for tests: OpenSSL's AES-256-GCM over prefix || data as additional
// data, in one pass with a fresh context, written from the nonce layout payload_mac.h documents
// (direction, three zero bytes, the sequence big-endian).
#ifndef MOE_TESTS_DATAPLANE_GMAC_ORACLE_H_
#define MOE_TESTS_DATAPLANE_GMAC_ORACLE_H_

#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <cstdint>
#include <string>

#include "services/dataplane/payload_mac.h"

namespace moe::dataplane {

inline std::string OnePass(const std::string& key, Direction direction, uint64_t sequence,
                           const std::string& prefix, const uint8_t* data, size_t n) {
  unsigned char iv[12] = {static_cast<unsigned char>(direction)};
  for (int i = 0; i < 8; ++i) iv[4 + i] = static_cast<unsigned char>(sequence >> (56 - 8 * i));
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int outl = 0;
  EXPECT_EQ(EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                               reinterpret_cast<const unsigned char*>(key.data()), iv),
            1);
  if (!prefix.empty()) {
    EVP_EncryptUpdate(ctx, nullptr, &outl, reinterpret_cast<const unsigned char*>(prefix.data()),
                      static_cast<int>(prefix.size()));
  }
  if (n > 0) EVP_EncryptUpdate(ctx, nullptr, &outl, data, static_cast<int>(n));
  unsigned char final_block[16];
  EVP_EncryptFinal_ex(ctx, final_block, &outl);
  std::string tag(kMacBytes, '\0');
  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, tag.data());
  EVP_CIPHER_CTX_free(ctx);
  return tag;
}

}  // namespace moe::dataplane

#endif  // MOE_TESTS_DATAPLANE_GMAC_ORACLE_H_
