#include "services/common/temp_dir.h"

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<std::string> MakeTempDir(const std::string& prefix) {
  const char* env = std::getenv("TMPDIR");
  const std::string root = env != nullptr && env[0] != '\0' ? env : "/tmp";
  std::string tmpl = absl::StrCat(root, "/", prefix, "-XXXXXX");
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, " failed"));
  }
  return tmpl;
}

bool RemoveTree(const std::string& path) {
  if (path.empty()) return false;
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  return !ec;
}

namespace {

std::mutex at_exit_mu;
std::vector<std::string>* at_exit_paths = nullptr;  // never freed: read at exit

void RemoveAtExit() {
  std::lock_guard<std::mutex> lock(at_exit_mu);
  for (const std::string& p : *at_exit_paths) RemoveTree(p);
}

}  // namespace

void RemoveTreeAtExit(const std::string& path) {
  std::lock_guard<std::mutex> lock(at_exit_mu);
  if (at_exit_paths == nullptr) {
    at_exit_paths = new std::vector<std::string>();
    std::atexit(RemoveAtExit);
  }
  at_exit_paths->push_back(path);
}

}  // namespace moe
