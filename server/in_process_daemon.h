// Tests that run kvdepotd in their own process (to read its state or set
// options no flag reaches): a CPU daemon on a Unix socket in a fresh
// private directory, and clients of it.
#ifndef KVDEPOT_SERVER_IN_PROCESS_DAEMON_H_
#define KVDEPOT_SERVER_IN_PROCESS_DAEMON_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/kvdepot_client.h"
#include "server/daemon.h"

namespace kvdepot {

// Options for a CPU daemon listening on kv.sock in a new directory
// /tmp/kvdepot-<tag>-XXXXXX, with no drain grace; the caller adjusts them
// before Daemon::Start. The listen address is empty (Start fails) when the
// directory cannot be made.
DaemonOptions InProcessDaemonOptions(absl::string_view tag);

// A client of `daemon` with its own session.
absl::StatusOr<std::unique_ptr<KVCacheClient>> ConnectInProcess(
    const Daemon& daemon);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_IN_PROCESS_DAEMON_H_
