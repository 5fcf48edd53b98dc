// The mutual-TLS TCP listener's byte relay (docs/SPEC.md §11).
//
// gRPC 1.51 takes over only insecure connections (AddInsecureChannelFromFd),
// and its own TCP listener stops accepting for good once one accept4() fails
// with EMFILE: anyone who reached the port could have opened enough
// connections to end TLS service until a restart. So the daemon accepts the
// TLS port itself (GrpcListener: its descriptor headroom, its bound on
// connections, its EMFILE handling) and relays each connection, bytes
// unchanged, to gRPC's TLS listener on a Unix socket in a private directory.
// TLS still runs end to end between the client and gRPC (certificates,
// their rotation, ALPN, the peer's subject in the auth context: all as
// before); gRPC's own listener only ever sees the relay's connections, at
// most as many as the daemon's listener admitted, and its handshake timeout
// still closes one that never finishes.
//
// One thread relays every connection: epoll, edge-triggered, each event
// pumps both directions of its connection until they would block, through a
// buffer per direction. An end-of-file is passed on as a shutdown of the
// other side's writing, and the upstream's end closes both (gRPC never
// half-closes); an error on either side closes both. A connection
// that keeps both ends busy yields after a few buffers, so one fast client
// cannot starve the others.
//
// Written here rather than taken from a library: the stack's libraries have
// no byte relay, and libevent's bufferevents (Debian has it) would bring a
// second event loop and dependency for some 200 lines of epoll. An external
// proxy (stunnel, haproxy) in front would need its own identity plumbing:
// here TLS stays gRPC's, so subjects reach the access checks unchanged.
#ifndef KVDEPOT_SERVER_SOCKET_RELAY_H_
#define KVDEPOT_SERVER_SOCKET_RELAY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"

namespace kvdepot {
namespace relay_internal {
struct Conn;  // socket_relay.cc
}  // namespace relay_internal

struct SocketRelayOptions {
  // Bytes buffered per direction per connection, held only while bytes
  // are in flight (an idle connection holds none). A TLS record is at most
  // 16 KiB of payload plus its header.
  int64_t buffer_bytes = 17 << 10;
};

class SocketRelay {
 public:
  // Starts the relay thread; connections go to the Unix socket `upstream`.
  static absl::StatusOr<std::unique_ptr<SocketRelay>> Start(
      std::string upstream, SocketRelayOptions options = {});

  SocketRelay(const SocketRelay&) = delete;
  SocketRelay& operator=(const SocketRelay&) = delete;
  ~SocketRelay();  // Stop()

  // Takes `client` (a connected stream socket) and relays it to a new
  // connection to the upstream socket. If that cannot be made (the upstream
  // refuses, or no descriptor is left), `client` is closed and false
  // returned. Thread-safe; after Stop() it closes `client`.
  bool Add(int client);

  // Closes every relayed connection and joins the thread. Idempotent.
  void Stop();

  // Connections being relayed (for tests and metrics).
  int64_t active() const { return active_.load(); }

 private:
  using Conn = relay_internal::Conn;

  SocketRelay(std::string upstream, SocketRelayOptions options, UniqueFd epoll,
              UniqueFd wake);
  void Loop();
  // Registers the connections Add() queued.
  void TakePending();
  enum class Pumped { kWaiting, kYielded, kFinished };
  // Moves bytes both ways until each would block (kWaiting), or a direction
  // moved `rounds` buffers (kYielded: pump it again without an event);
  // kFinished when the upstream has ended or either side failed.
  Pumped Pump(Conn& c, int rounds);
  void Close(uint64_t id);

  const std::string upstream_;
  const SocketRelayOptions options_;
  UniqueFd epoll_;
  UniqueFd wake_;  // an eventfd: Add() and Stop()
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> last_failure_log_ns_{0};  // once a second at most

  absl::Mutex mu_;
  std::vector<std::pair<UniqueFd, UniqueFd>> pending_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  // The relay thread's own.
  uint64_t next_id_ = 1;  // 0 is the wake-up eventfd's
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::vector<uint64_t> busy_;  // yielded with work left
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SOCKET_RELAY_H_
