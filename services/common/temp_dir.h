// Temporary directories that honour $TMPDIR and are removed by whoever made them: a process that
// makes a scratch directory (a TLS pair copy, a local cluster's work dir, a test's files) leaves
// nothing behind when it ends normally.
//
//   // $TMPDIR/moe-cluster-XXXXXX
//   MOE_ASSIGN_OR_RETURN(std::string dir, MakeTempDir("moe-cluster"));
//   ...
//   RemoveTree(dir);
#ifndef MOE_SERVICES_COMMON_TEMP_DIR_H_
#define MOE_SERVICES_COMMON_TEMP_DIR_H_

#include <string>

#include "absl/status/statusor.h"

namespace moe {

// A fresh directory <$TMPDIR or /tmp>/<prefix>-XXXXXX, mode 0700 (mkdtemp).
absl::StatusOr<std::string> MakeTempDir(const std::string& prefix);

// Removes path and everything under it (without following symbolic links); false when something
// could not be removed. An empty path is refused (false), never taken as the current directory.
bool RemoveTree(const std::string& path);

// Removes the tree at normal process exit (std::atexit), for a directory that lives as long as
// the process (e.g. the TLS pair's copy, held by credentials until the end).
void RemoveTreeAtExit(const std::string& path);

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_TEMP_DIR_H_
