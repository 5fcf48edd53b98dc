// The daemon's gRPC Unix socket, accepted by the daemon itself.
//
// gRPC 1.51's own listener (tcp_server_posix) gives up for good when one
// accept4() fails for want of a descriptor: a client that opens enough
// connections, or anything else that fills the table for a moment, would
// leave the daemon unreachable until it is restarted (server/descriptors.h).
// So the daemon binds the socket, accepts on a thread of its own and hands
// every connection to the running grpc::Server as a channel
// (AddInsecureChannelFromFd: the same HTTP/2 transport, the server's own
// channel arguments). This loop never stops on an error:
// - out of descriptors (EMFILE, ENFILE): it closes a spare descriptor kept
//   for this, takes the waiting connection and closes it at once, reopens
//   the spare, and goes on;
// - a connection whose descriptor number is at or above the soft
//   RLIMIT_NOFILE (read per connection) less `headroom` is closed at once
//   (descriptors are numbered lowest free first, so the daemon then holds
//   at least that many descriptors; the rest are kept for its own work), so
//   connections alone cannot fill the table either.
// - a peer uid (SO_PEERCRED) that holds `max_connections_per_uid`
//   connections already has its next one closed at once, so one local
//   user cannot take every connection the descriptor headroom leaves and
//   lock everybody else out (measured before this: ~19,700 idle HTTP/2
//   connections from one uid, and nobody else could connect). A
//   connection counts from its accept until gRPC closes it: the listener
//   remembers each one's descriptor and inode and, before it admits a
//   peer, forgets those whose descriptor no longer names that socket.
// Each refusal is counted (limit "connections" or "connections_per_uid")
// and logged at most once a second.
#ifndef KVDEPOT_SERVER_UNIX_LISTENER_H_
#define KVDEPOT_SERVER_UNIX_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace grpc {
class Server;
}

namespace kvdepot {

struct UnixListenerOptions {
  // Descriptors kept free of connections below the soft RLIMIT_NOFILE.
  int64_t headroom = 256;
  int backlog = 1024;
  // Called once per refused connection (metrics); may be empty.
  std::function<void()> on_refused;
  // Connections one peer uid may hold at once; 0 = no limit.
  int64_t max_connections_per_uid = 0;
  // Called once per connection refused for that limit; may be empty.
  std::function<void()> on_refused_per_uid;
};

class UnixListener {
 public:
  // Binds and listens on `path` (which must not exist) and starts accepting
  // into `server`, which must be started and outlive the listener.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(
      const std::string& path, grpc::Server* server,
      UnixListenerOptions options);

  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  // Stop()s.
  ~UnixListener();

  // Stops accepting (connections already handed over are the server's)
  // and joins the thread. Idempotent.
  void Stop();

  int64_t refused() const { return refused_.load(); }

 private:
  UnixListener(UniqueFd listen_fd, UniqueFd wake_fd, grpc::Server* server,
               UnixListenerOptions options);
  // A connection handed to the server, as the accept thread saw it.
  struct Held {
    int fd;
    dev_t dev;
    ino_t ino;
  };

  void AcceptLoop();
  // Counts and logs a refused connection (per_uid: max_connections_per_uid,
  // else the descriptor limits).
  void Refuse(bool per_uid, const std::string& why, int64_t fd_number);
  // Whether the peer of `fd` may have one more connection (then it is
  // counted); forgets its connections gRPC has closed first. Sets *uid to
  // the peer's uid when it is refused.
  bool AdmitPeer(int fd, uid_t* uid);
  // Forgets every closed connection (every kSweepEvery accepts).
  void Sweep();

  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // an eventfd: written by Stop()
  UniqueFd spare_;    // /dev/null, given up to take a connection on EMFILE
  grpc::Server* const server_;
  const UnixListenerOptions options_;
  int64_t soft_limit_ = 0;  // the accept thread's; re-read per connection
  std::atomic<int64_t> refused_{0};
  int64_t last_log_ns_ = 0;  // the accept thread's
  // The accept thread's: connections by peer uid (max_connections_per_uid).
  absl::flat_hash_map<uid_t, std::vector<Held>> held_;
  int64_t accepts_since_sweep_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_UNIX_LISTENER_H_
