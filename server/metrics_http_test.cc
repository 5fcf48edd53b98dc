// The /metrics endpoint's limits: idle connections are bounded by a read
// timeout and a fixed thread pool, so they cannot stall a scraper.
#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

int ConnectIdle(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(MetricsServerTest, IdleConnectionsDoNotStallAScrape) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
      "127.0.0.1:0", [] { return std::string("kvdepot_up 1\n"); },
      [] { return true; });
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = (*m)->address();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port));
  // 128 connections that never send a byte (twice the thread pool).
  std::vector<int> idle;
  for (int i = 0; i < 2 * kHttpThreads; ++i) {
    const int fd = ConnectIdle(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));  // let them take the threads
  const absl::Time start = absl::Now();
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(10, 0);
  httplib::Result res = client.Get("/metrics");
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "kvdepot_up 1\n");
  // Two rounds of idle timeouts at most (each connection's thread is freed
  // after kHttpIdleTimeoutSeconds), plus slack for a busy machine.
  EXPECT_LT(took, absl::Seconds(2 * kHttpIdleTimeoutSeconds + 1.5))
      << "a scrape waited " << took << " behind idle connections";
  for (int fd : idle) close(fd);
}

}  // namespace
}  // namespace kvdepot
