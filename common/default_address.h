// The daemon's default listen address, shared by the daemon and its clients
// so both sides agree without configuration.
//
//   $XDG_RUNTIME_DIR/kvdepot/kvdepotd.sock  when XDG_RUNTIME_DIR is set and
//                                           absolute
//   /tmp/kvdepot-<uid>/kvdepotd.sock        otherwise
//
// The directory is private to the daemon's user: the daemon creates it with
// mode 0700 and refuses to serve from one that already exists with other
// owners or with group/other permissions (SPEC §11).
#ifndef KVDEPOT_COMMON_DEFAULT_ADDRESS_H_
#define KVDEPOT_COMMON_DEFAULT_ADDRESS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvdepot {

// The default socket's directory and path (see above).
std::string DefaultSocketDir();
std::string DefaultSocketPath();

// A gRPC target for `address`:
//   ""               -> "unix:" + DefaultSocketPath()
//   "/abs/path.sock" -> "unix:/abs/path.sock"
//   "unix:..."       -> unchanged
//   "host:port"      -> unchanged (TCP)
std::string ResolveTarget(absl::string_view address);

// The socket path of a "unix:" target, or "" for any other target.
std::string UnixSocketPathOf(absl::string_view target);

// The companion socket (SOCK_SEQPACKET: sessions and descriptors, SPEC §11)
// next to a gRPC socket: "<dir>/x.sock" -> "<dir>/x.ctl", any other path ->
// path + ".ctl".
std::string CompanionSocketPathOf(absl::string_view socket_path);

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_DEFAULT_ADDRESS_H_
