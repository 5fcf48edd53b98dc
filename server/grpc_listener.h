// The daemon's gRPC listeners, accepted by the daemon itself: the Unix
// socket, plain TCP on a loopback address, and mutual-TLS TCP (relayed).
//
// gRPC 1.51's own listener (tcp_server_posix) gives up for good when one
// accept4() fails for want of a descriptor: a client that opens enough
// connections, or anything else that fills the table for a moment, would
// leave the daemon unreachable until it is restarted (server/descriptors.h;
// seen with ~20,000 idle loopback TCP connections: after they closed,
// nobody could connect again). So the daemon binds the socket, accepts on
// a thread of its own and hands every connection to the running
// grpc::Server as a channel (AddInsecureChannelFromFd: the same HTTP/2
// transport, the server's own channel arguments). gRPC can take over only
// insecure connections this way, so on a mutual-TLS TCP port each
// connection goes to a byte relay instead (`hand_off`), which carries it to
// gRPC's TLS listener on a private Unix socket (server/socket_relay.h).
// This loop never stops on an error:
// - out of descriptors (EMFILE, ENFILE): it closes a spare descriptor kept
//   for this, takes the waiting connection and closes it at once, reopens
//   the spare, and goes on;
// - a connection whose descriptor number is at or above the soft
//   RLIMIT_NOFILE (read per connection) less `headroom` is closed at once
//   (descriptors are numbered lowest free first, so the daemon then holds
//   at least that many descriptors; the rest are kept for its own work), so
//   connections alone cannot fill the table either.
// - a peer that holds `max_connections_per_uid` connections already has its
//   next one closed at once, so one client cannot take every connection the
//   descriptor headroom leaves and lock everybody else out (measured before
//   this: ~19,700 idle HTTP/2 connections from one uid, and nobody else
//   could connect). On the Unix socket a peer is its uid (SO_PEERCRED);
//   TCP clients have no uid here (a TLS subject is known only to gRPC,
//   after the handshake), so they all count as one peer. A connection
//   counts from its accept until gRPC (or the relay) closes it: the listener
//   remembers each one's descriptor and inode and, before it admits a peer,
//   forgets those whose descriptor no longer names that socket.
// Each refusal is counted (limit "connections" or "connections_per_uid")
// and logged at most once a second.
#ifndef KVDEPOT_SERVER_GRPC_LISTENER_H_
#define KVDEPOT_SERVER_GRPC_LISTENER_H_

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

struct GrpcListenerOptions {
  // Descriptors kept free of connections below the soft RLIMIT_NOFILE.
  int64_t headroom = 256;
  int backlog = 1024;
  // Called once per refused connection (metrics); may be empty.
  std::function<void()> on_refused;
  // Connections one peer uid may hold at once; 0 = no limit.
  int64_t max_connections_per_uid = 0;
  // Called once per connection refused for that limit; may be empty.
  std::function<void()> on_refused_per_uid;
  // The refusal line is written at most once a second; called once per
  // refusal whose line was left out (the daemon counts it as a dropped
  // client log line); may be empty.
  std::function<void()> on_log_line_dropped;
  // Takes each admitted connection (and its descriptor) instead of the
  // server: the mutual-TLS port's relay (server/socket_relay.h). Empty:
  // AddInsecureChannelFromFd.
  std::function<void(int fd)> hand_off;
  // The Unix socket's mode and group (-1: the daemon's own), set before it
  // appears at its path.
  mode_t unix_mode = 0660;
  gid_t unix_group = static_cast<gid_t>(-1);
};

class GrpcListener {
 public:
  // Binds and listens on the Unix socket `path` (which must not exist) and
  // starts accepting into `server`, which must be started and outlive the
  // listener. The socket appears at `path` only once it listens, with
  // options.unix_mode and unix_group: a client that sees the path can
  // connect.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Start(
      const std::string& path, grpc::Server* server,
      GrpcListenerOptions options);

  // The same for TCP on `host` (an address or a name: every address it
  // resolves to; "": every address of the host) and `port` (0 = one the kernel
  // picks, the same for all of them; see port()). Connections get TCP_NODELAY.
  // With `options.hand_off`, `server` is not used (it may be null).
  static absl::StatusOr<std::unique_ptr<GrpcListener>> StartTcp(
      const std::string& host, int port, grpc::Server* server,
      GrpcListenerOptions options);

  // The TCP port listened on (0 for a Unix socket).
  int port() const { return port_; }

  GrpcListener(const GrpcListener&) = delete;
  GrpcListener& operator=(const GrpcListener&) = delete;
  // Stop()s.
  ~GrpcListener();

  // Stops accepting (connections already handed over are the server's)
  // and joins the thread. Idempotent.
  void Stop();

  int64_t refused() const { return refused_.load(); }

 private:
  GrpcListener(std::vector<UniqueFd> listen_fds, UniqueFd wake_fd,
               grpc::Server* server, GrpcListenerOptions options);
  // Starts the accept thread of a listener made by Start or StartTcp.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Run(
      std::vector<UniqueFd> listen_fds, grpc::Server* server,
      GrpcListenerOptions options, int port);
  // A connection handed to the server, as the accept thread saw it.
  struct Held {
    int fd;
    dev_t dev;
    ino_t ino;
  };

  void AcceptLoop();
  // Accepts what waits on `listen_fd` until it would block.
  void Drain(int listen_fd);
  // Counts and logs a refused connection (per_uid: max_connections_per_uid,
  // else the descriptor limits).
  void Refuse(bool per_uid, const std::string& why, int64_t fd_number);
  // Whether the peer of `fd` may have one more connection (then it is
  // counted); forgets its connections gRPC has closed first. Sets *uid to
  // the peer's uid (a key no uid has for TCP).
  bool AdmitPeer(int fd, uid_t* uid);
  // Forgets every closed connection (every kSweepEvery accepts).
  void Sweep();

  std::vector<UniqueFd> listen_fds_;
  int port_ = 0;      // 0: the Unix socket
  UniqueFd wake_fd_;  // an eventfd: written by Stop()
  UniqueFd spare_;    // /dev/null, given up to take a connection on EMFILE
  grpc::Server* const server_;
  const GrpcListenerOptions options_;
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

#endif  // KVDEPOT_SERVER_GRPC_LISTENER_H_
