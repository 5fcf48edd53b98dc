#include "client/default_address.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcache {

std::string DefaultSocketPath() {
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] == '/') {
    return absl::StrCat(runtime_dir, "/kvcached.sock");
  }
  return absl::StrCat("/tmp/kvcached-", getuid(), ".sock");
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

}  // namespace kvcache
