#include "server/in_process_daemon.h"

#include <stdlib.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvdepot {

DaemonOptions InProcessDaemonOptions(absl::string_view tag) {
  DaemonOptions o;
  std::string dir = absl::StrCat("/tmp/kvdepot-", tag, "-XXXXXX");
  if (mkdtemp(dir.data()) != nullptr) o.listen = absl::StrCat(dir, "/kv.sock");
  o.backend = "cpu";
  o.drain_grace = absl::ZeroDuration();
  return o;
}

absl::StatusOr<std::unique_ptr<KVCacheClient>> ConnectInProcess(
    const Daemon& daemon) {
  ClientOptions co;
  co.address = daemon.target();
  return KVCacheClient::Connect(co);
}

}  // namespace kvdepot
