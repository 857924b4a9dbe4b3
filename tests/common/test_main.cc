// The main of every gtest binary. Each test process works in a directory of its own,
// $TMPDIR/moe-test-XXXXXX, given to the tests as ::testing::TempDir() (TEST_TMPDIR) and to every
// process they start as $TMPDIR (services, clusters, Python and Node clients): checkpoints,
// etcd data, cluster work dirs, certificates. It is removed when every test passed and kept, with
// its path printed, when one failed (the services' logs are in it). Without this, each full run
// left about 4 GB under /tmp (synthetic checkpoints, etcd's preallocated WAL) and a machine's
// disk filled after a dozen runs.
#include <stdlib.h>

#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "services/common/temp_dir.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const absl::StatusOr<std::string> dir = moe::MakeTempDir("moe-test");
  if (!dir.ok()) {
    std::fprintf(stderr, "test main: %s\n", std::string(dir.status().message()).c_str());
    return 2;
  }
  ::setenv("TEST_TMPDIR", dir->c_str(), 1);
  ::setenv("TMPDIR", dir->c_str(), 1);
  const int rc = RUN_ALL_TESTS();
  if (rc == 0) {
    moe::RemoveTree(*dir);
  } else {
    std::fprintf(stderr, "test main: a test failed; its files are kept in %s\n", dir->c_str());
  }
  return rc;
}
