// The daemon's default listen address, shared by the daemon and its clients
// so both sides agree without configuration.
//
//   $XDG_RUNTIME_DIR/kvcached.sock   when XDG_RUNTIME_DIR is set and absolute
//   /tmp/kvcached-<uid>.sock         otherwise
#ifndef KVCACHED_CLIENT_DEFAULT_ADDRESS_H_
#define KVCACHED_CLIENT_DEFAULT_ADDRESS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvcache {

// The default Unix socket path (see above).
std::string DefaultSocketPath();

// A gRPC target for `address`:
//   ""               -> "unix:" + DefaultSocketPath()
//   "/abs/path.sock" -> "unix:/abs/path.sock"
//   "unix:..."       -> unchanged
//   "host:port"      -> unchanged (TCP)
std::string ResolveTarget(absl::string_view address);

// The socket path of a "unix:" target, or "" for any other target.
std::string UnixSocketPathOf(absl::string_view target);

}  // namespace kvcache

#endif  // KVCACHED_CLIENT_DEFAULT_ADDRESS_H_
