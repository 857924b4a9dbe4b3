#include "services/common/secret_file.h"

#include <sys/stat.h>

#include <fstream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot read the secret file ", path));
  }
  // Others must not read it. The group may (a Kubernetes Secret mounted with defaultMode 0440
  // for the pod's fsGroup, as the chart does).
  if ((st.st_mode & S_IROTH) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("the secret file ", path, " is readable by others (chmod 600 it)"));
  }
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read the secret file ", path));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::string secret(absl::StripAsciiWhitespace(text));
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the secret file ", path, " is empty"));
  }
  return secret;
}

bool SecretEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::string& longer = a.size() >= b.size() ? a : b;
  for (size_t i = 0; i < longer.size(); ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace moe
