// Helpers of the UCX worker's tests (ucx_worker_test.cc, ucx_worker_peers_test.cc).
#ifndef MOE_TESTS_DATAPLANE_UCX_TEST_UTIL_H_
#define MOE_TESTS_DATAPLANE_UCX_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "services/dataplane/ucx_worker.h"

namespace moe::dataplane::testing {

inline std::unique_ptr<UcxWorker> MakeWorker(const std::string& tls, const std::string& name) {
  UcxOptions o;
  o.name = name;
  o.tls = tls;
  auto w = UcxWorker::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

inline std::shared_ptr<UcxBuffer> Filled(UcxWorker& w, size_t bytes, uint8_t seed) {
  auto b = w.Buffer(bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  for (size_t i = 0; i < bytes; ++i) (*b)->data()[i] = static_cast<uint8_t>(seed + i * 7);
  return *b;
}

// A batch message's header as the worker reads it: the reply's token first, 8 bytes LE.
inline std::string TokenHeader(uint64_t token) {
  std::string h(8, '\0');
  for (int i = 0; i < 8; ++i) h[i] = static_cast<char>((token >> (8 * i)) & 0xff);
  return h;
}

}  // namespace moe::dataplane::testing

#endif  // MOE_TESTS_DATAPLANE_UCX_TEST_UTIL_H_
