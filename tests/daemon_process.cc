#include "tests/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace kvdepot::testing {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(5);

bool Connectable(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(),
              std::min(path.size(), sizeof(addr.sun_path) - 1));
  const bool ok =
      connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

std::string FreshSocketPath() {
  // A private (0700) directory of its own: clients refuse sockets in
  // directories others can write, like /tmp itself.
  char dir[] = "/tmp/kvdepot-test-XXXXXX";
  if (mkdtemp(dir) == nullptr) return "/nonexistent/kv.sock";
  return absl::StrCat(dir, "/kv.sock");
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            int* stdout_fd, bool with_stderr) {
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int pipe_fds[2] = {-1, -1};
  if (stdout_fd != nullptr) {
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    }
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
    if (with_stderr) {
      posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
    }
  }
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (stdout_fd != nullptr) {
    close(pipe_fds[1]);
    *stdout_fd = pipe_fds[0];
  }
  if (rc != 0) {
    if (stdout_fd != nullptr) close(pipe_fds[0]);
    return absl::InternalError(
        absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
  }
  return pid;
}

absl::StatusOr<int> WaitForExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return ExitCode(status);
    if (r < 0) {
      return absl::InternalError(
          absl::StrCat("waitpid: ", std::strerror(errno)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "pid ", pid, " did not exit within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPoll);
  }
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    std::vector<std::string> extra_args, const std::string& binary,
    absl::Duration timeout) {
  const std::string socket = FreshSocketPath();
  std::vector<std::string> argv = {binary, absl::StrCat("--listen=", socket)};
  for (std::string& a : extra_args) argv.push_back(std::move(a));
  absl::StatusOr<pid_t> pid = Spawn(argv, nullptr);
  if (!pid.ok()) return pid.status();
  std::unique_ptr<DaemonProcess> d(new DaemonProcess(*pid, socket));
  const absl::Time deadline = absl::Now() + timeout;
  while (!Connectable(socket)) {
    int status = 0;
    if (waitpid(*pid, &status, WNOHANG) == *pid) {
      d->reaped_ = true;
      return absl::InternalError(absl::StrCat(
          "kvdepotd exited with code ", ExitCode(status), " before serving"));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("kvdepot did not start in time");
    }
    absl::SleepFor(kPoll);
  }
  return d;
}

absl::StatusOr<int> DaemonProcess::Signal(int sig, absl::Duration timeout) {
  if (reaped_) return absl::FailedPreconditionError("already exited");
  kill(pid_, sig);
  absl::StatusOr<int> code = WaitForExit(pid_, timeout);
  if (code.ok()) reaped_ = true;
  return code;
}

DaemonProcess::~DaemonProcess() {
  if (reaped_) return;
  // Drain (the daemon unlinks its shared memory); SIGKILL would leave the
  // pools and buffers in /dev/shm.
  if (Signal(SIGTERM, absl::Seconds(30)).ok()) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  unlink(socket_path_.c_str());
  unlink(absl::StrCat(socket_path_.substr(0, socket_path_.size() - 5), ".ctl")
             .c_str());
  rmdir(socket_path_.substr(0, socket_path_.rfind('/')).c_str());
}

}  // namespace kvdepot::testing
