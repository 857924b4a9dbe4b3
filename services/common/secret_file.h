// Secrets (tokens) read from files, never from the command line where `ps` shows them: the
// file's content with surrounding whitespace removed. A file that others (not owner, not group)
// can read is refused.
//
//   MOE_ASSIGN_OR_RETURN(std::string token, ReadSecretFile("/etc/moe/admin/token"));
#ifndef MOE_SERVICES_COMMON_SECRET_FILE_H_
#define MOE_SERVICES_COMMON_SECRET_FILE_H_

#include <string>

#include "absl/status/statusor.h"

namespace moe {

// NOT_FOUND when unreadable, INVALID_ARGUMENT when empty, PERMISSION_DENIED when others may read
// it (chmod 600).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// Whether two secrets are equal, in time independent of where they differ.
bool SecretEquals(const std::string& a, const std::string& b);

// Writes text to path readable by this user only (0600), atomically (a temporary file renamed
// over it): for token files and for what holds tokens (cluster.json).
absl::Status WritePrivateFile(const std::string& path, const std::string& text);

// A fresh token: 32 hex digits from the kernel's CSPRNG.
absl::StatusOr<std::string> RandomSecret();

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_SECRET_FILE_H_
