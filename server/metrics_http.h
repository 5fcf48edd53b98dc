// The daemon's optional Prometheus endpoint: GET /metrics over plain HTTP
// (cpp-httplib) on --metrics_address=host:port, rendered on each scrape,
// and GET /healthz for HTTP probes. The port is bound exclusively (no
// SO_REUSEPORT): a second daemon on the same port fails to start.
#ifndef KVDEPOT_SERVER_METRICS_HTTP_H_
#define KVDEPOT_SERVER_METRICS_HTTP_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace httplib {
class Server;
}

namespace kvdepot {

// The endpoint's limits (docs/DAEMON.md "Limits").
inline constexpr int kHttpThreads = 64;            // connection threads
inline constexpr int kHttpIdleTimeoutSeconds = 1;  // idle / read timeout
inline constexpr int kHttpWriteTimeoutSeconds = 5;
inline constexpr int kHttpRequestsPerConnection = 100;
inline constexpr int kHttpMaxPayloadBytes = 4096;  // request bodies
// Accepted connections waiting for a thread; beyond them the acceptor
// waits and new connections wait in the kernel's listen queue, holding no
// descriptor of the daemon.
inline constexpr int kHttpQueuedConnections = 64;

class MetricsServer {
 public:
  // Serves GET /metrics (the text `render` returns), GET /healthz (200
  // "SERVING" while `serving` returns true, else 503 "NOT_SERVING") and
  // GET / (a pointer to both) on `address` = "host:port"; port 0 picks a
  // free one. INVALID_ARGUMENT for a malformed address, UNAVAILABLE when
  // it cannot bind (the message names the port and the reason).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      absl::string_view address, std::function<std::string()> render,
      std::function<bool()> serving);

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  ~MetricsServer();  // stops and joins

  // "host:port" with the bound port.
  const std::string& address() const { return address_; }

 private:
  MetricsServer() = default;

  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::string address_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_METRICS_HTTP_H_
