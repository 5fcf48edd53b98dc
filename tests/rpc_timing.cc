#include "tests/rpc_timing.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvdepot::testing {

Timing MeasureCalls(const std::string& name, int warmup, int iterations,
                    const std::function<absl::Status()>& call) {
  auto must = [&](const absl::Status& s) {
    if (s.ok()) return;
    std::fprintf(stderr, "%s failed: %s\n", name.c_str(), s.ToString().c_str());
    std::exit(1);
  };
  for (int i = 0; i < warmup; ++i) must(call());
  std::vector<double> us(static_cast<size_t>(std::max(iterations, 1)));
  for (double& u : us) {
    const absl::Time t0 = absl::Now();
    const absl::Status s = call();
    u = absl::ToDoubleMicroseconds(absl::Now() - t0);
    must(s);
  }
  std::sort(us.begin(), us.end());
  const double mean = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  return {name, us[us.size() / 2], us[us.size() * 99 / 100], mean};
}

namespace {

// Reads one byte from `fd`, spinning with non-blocking reads when `spin`.
bool ReadByte(int fd, char* b, bool spin) {
  if (!spin) return read(fd, b, 1) == 1;
  for (;;) {
    const ssize_t n = recv(fd, b, 1, MSG_DONTWAIT);
    if (n == 1) return true;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return false;
  }
}

Timing PingPong(const std::string& name, bool spin, int warmup,
                int iterations) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
    std::perror("socketpair");
    std::exit(1);
  }
  std::thread echo([fd = fds[1]] {
    char b;
    while (read(fd, &b, 1) == 1) {
      if (write(fd, &b, 1) != 1) break;
    }
  });
  char b = 'x';
  const Timing t =
      MeasureCalls(name, warmup, iterations, [&]() -> absl::Status {
        if (write(fds[0], &b, 1) != 1 || !ReadByte(fds[0], &b, spin)) {
          return absl::InternalError("ping-pong failed");
        }
        return absl::OkStatus();
      });
  shutdown(fds[0], SHUT_RDWR);
  close(fds[0]);
  echo.join();
  close(fds[1]);
  return t;
}

}  // namespace

Timing SocketPingPong(int warmup, int iterations) {
  return PingPong("Unix socket ping-pong (1 byte)", false, warmup, iterations);
}

Timing SocketPingPongSpinning(int warmup, int iterations) {
  return PingPong("Unix socket ping-pong (1 byte), client spinning", true,
                  warmup, iterations);
}

}  // namespace kvdepot::testing
