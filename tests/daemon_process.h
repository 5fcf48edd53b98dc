// Test harness: the kvdepotd binary as a child process on a fresh Unix
// socket, waited on with a deadline (never a fixed sleep).
#ifndef KVDEPOT_TESTS_DAEMON_PROCESS_H_
#define KVDEPOT_TESTS_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvdepot::testing {

// Runfiles path of the daemon (tests list //server:kvdepotd in `data`).
inline constexpr char kDaemonBinary[] = "server/kvdepotd";

class DaemonProcess {
 public:
  // Spawns `binary` with --listen=<fresh socket> plus `extra_args` and waits
  // until the socket accepts connections (or the child dies).
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      std::vector<std::string> extra_args = {},
      const std::string& binary = kDaemonBinary,
      absl::Duration timeout = absl::Seconds(60));

  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  // SIGTERM (drain) and reap when still running; SIGKILL if it does not exit
  // within 30 s.
  ~DaemonProcess();

  const std::string& socket_path() const { return socket_path_; }
  pid_t pid() const { return pid_; }

  // Sends `sig` and waits for the exit; returns the exit code (128 + signal
  // when killed by one). DEADLINE_EXCEEDED if it does not exit in time.
  absl::StatusOr<int> Signal(int sig, absl::Duration timeout);

 private:
  DaemonProcess(pid_t pid, std::string socket_path)
      : pid_(pid), socket_path_(std::move(socket_path)) {}

  pid_t pid_;
  std::string socket_path_;
  bool reaped_ = false;
};

// Waits for `pid` with a deadline; exit code as for Signal.
absl::StatusOr<int> WaitForExit(pid_t pid, absl::Duration timeout);

// Spawns argv[0] with argv; stdout (and stderr too with `with_stderr`: the
// daemon logs there) goes to *stdout_fd (a pipe) when not null. Returns the
// pid.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            int* stdout_fd, bool with_stderr = false);

// A socket path that no other test uses, "kv.sock" in a fresh 0700
// directory under /tmp (short: sun_path holds 107 bytes).
std::string FreshSocketPath();

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_DAEMON_PROCESS_H_
