// A synthetic `tiny` checkpoint (single file, seed 3) written once per test binary into a
// temporary directory: what control-plane tests hand router-svc as --checkpoint.
//
//   RouterServerOptions o; o.checkpoint = moe::testing::TinyCheckpoint();
#ifndef MOE_TESTS_COMMON_TINY_CHECKPOINT_H_
#define MOE_TESTS_COMMON_TINY_CHECKPOINT_H_

#include <stdlib.h>

#include <string>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"

namespace moe::testing {

inline std::string TinyCheckpoint() {
  static std::string* dir = [] {
    std::string tmpl = ::testing::TempDir() + "/moe_tiny_ckpt_XXXXXX";
    auto* d = new std::string(::mkdtemp(tmpl.data()));
    checkpoint::SyntheticOptions so;
    so.seed = 3;
    so.single_file = true;
    EXPECT_TRUE(checkpoint::WriteSyntheticCheckpoint(*PresetConfig("tiny"), *d, so).ok());
    return d;
  }();
  return *dir;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_TINY_CHECKPOINT_H_
