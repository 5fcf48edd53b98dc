#include "common/default_address.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvdepot {

std::string DefaultSocketDir() {
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] == '/') {
    return absl::StrCat(runtime_dir, "/kvdepot");
  }
  return absl::StrCat("/tmp/kvdepot-", getuid());
}

std::string DefaultSocketPath() {
  return absl::StrCat(DefaultSocketDir(), "/kvdepotd.sock");
}

std::string ResolveTarget(absl::string_view address) {
  if (address.empty()) return absl::StrCat("unix:", DefaultSocketPath());
  if (absl::StartsWith(address, "/")) return absl::StrCat("unix:", address);
  return std::string(address);
}

std::string UnixSocketPathOf(absl::string_view target) {
  constexpr absl::string_view kPrefix = "unix:";
  if (!absl::StartsWith(target, kPrefix)) return "";
  absl::string_view path = target.substr(kPrefix.size());
  // "unix:///path" is the URI form of "unix:/path".
  if (absl::StartsWith(path, "//")) path.remove_prefix(2);
  return std::string(path);
}

std::string CompanionSocketPathOf(absl::string_view socket_path) {
  if (absl::EndsWith(socket_path, ".sock")) {
    return absl::StrCat(socket_path.substr(0, socket_path.size() - 5), ".ctl");
  }
  return absl::StrCat(socket_path, ".ctl");
}

}  // namespace kvdepot
