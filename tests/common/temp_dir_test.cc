// Scratch directories: made under $TMPDIR, private, removed whole by their maker (at once or at
// process exit), never through a symbolic link and never "" as the current directory.
#include "services/common/temp_dir.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace moe {
namespace {

namespace fs = std::filesystem;

TEST(TempDir, MadeUnderTmpdirForItsOwnerOnly) {
  const std::string root = ::testing::TempDir() + "/root-a";
  fs::create_directories(root);
  const std::string saved = std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "";
  ::setenv("TMPDIR", root.c_str(), 1);
  const absl::StatusOr<std::string> a = MakeTempDir("moe-x"), b = MakeTempDir("moe-x");
  ::setenv("TMPDIR", saved.c_str(), 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(fs::path(*a).parent_path(), fs::path(root));
  EXPECT_EQ(fs::path(*a).filename().string().rfind("moe-x-", 0), 0u) << *a;
  struct stat st {};
  ASSERT_EQ(::stat(a->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ::setenv("TMPDIR", (root + "/missing").c_str(), 1);
  EXPECT_FALSE(MakeTempDir("moe-x").ok());  // named, not silently elsewhere
  ::setenv("TMPDIR", saved.c_str(), 1);
}

TEST(TempDir, RemoveTreeTakesEverythingButWhatALinkPointsAt) {
  const std::string outside = ::testing::TempDir() + "/kept.txt";
  std::ofstream(outside) << "kept";
  const absl::StatusOr<std::string> dir = MakeTempDir("moe-y");
  ASSERT_TRUE(dir.ok());
  fs::create_directories(*dir + "/a/b");
  std::ofstream(*dir + "/a/b/f") << "x";
  fs::create_symlink(outside, *dir + "/a/link");
  fs::create_directory_symlink(::testing::TempDir(), *dir + "/a/dirlink");
  EXPECT_TRUE(RemoveTree(*dir));
  EXPECT_FALSE(fs::exists(*dir));
  EXPECT_TRUE(fs::exists(outside));  // the link went, not its target
  EXPECT_FALSE(RemoveTree(""));      // never the current directory
  EXPECT_TRUE(fs::exists("."));
}

TEST(TempDir, RemovedAtNormalExitOfTheProcessThatAskedForIt) {
  const absl::StatusOr<std::string> dir = MakeTempDir("moe-z");
  ASSERT_TRUE(dir.ok());
  std::ofstream(*dir + "/tls.key") << "secret";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    RemoveTreeAtExit(*dir);
    std::exit(0);  // atexit handlers run
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(fs::exists(*dir));
}

}  // namespace
}  // namespace moe
