#include "server/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvdepot {
namespace {

// httplib's ThreadPool queues every accepted connection without bound: a
// flood of idle connections would pile up descriptors (one per queued
// connection) until the daemon has none left, and gRPC 1.51 stops
// accepting for good after an EMFILE (server/descriptors.h). This queue
// holds at most kHttpQueuedConnections; when it is full, enqueue (called
// by httplib's acceptor) waits for a thread to take one.
class BoundedTaskQueue final : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(int threads, int max_queued) : max_queued_(max_queued) {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] { Work(); });
    }
  }
  ~BoundedTaskQueue() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](BoundedTaskQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
          return static_cast<int>(q->jobs_.size()) < q->max_queued_ ||
                 q->stopping_;
        },
        this));
    jobs_.push_back(std::move(fn));  // after shutdown too: it closes the fd
  }

  void shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    // Jobs enqueued after the threads left: each closes its connection.
    std::deque<std::function<void()>> left;
    {
      absl::MutexLock lock(&mu_);
      left.swap(jobs_);
    }
    for (std::function<void()>& job : left) job();
  }

 private:
  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](BoundedTaskQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
              return !q->jobs_.empty() || q->stopping_;
            },
            this));
        if (jobs_.empty()) return;  // stopping, nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  const int max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // touched by the owner only
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    absl::string_view address, std::function<std::string()> render,
    std::function<bool()> serving) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_address = \"", address,
                     "\" is not host:port with a port in [0, 65535]"));
  }
  absl::string_view host = address.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->http_ = std::make_unique<httplib::Server>();
  // httplib's default options add SO_REUSEPORT, which lets a second process
  // bind the same port and take half the scrapes. SO_REUSEADDR alone still
  // allows a restart while old connections sit in TIME_WAIT.
  m->http_->set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Bounded whatever clients do: a fixed pool of kHttpThreads connection
  // threads with at most kHttpQueuedConnections waiting for one (beyond
  // them, in the kernel's listen queue), and a connection that sends
  // nothing for kHttpIdleTimeout (or stalls mid-request as long) is
  // closed, so idle connections cannot hold every thread for long and a
  // scraper waits at most about queued / kHttpThreads timeouts
  // (docs/DAEMON.md "Limits").
  m->http_->new_task_queue = [] {
    return new BoundedTaskQueue(kHttpThreads, kHttpQueuedConnections);
  };
  m->http_->set_keep_alive_timeout(kHttpIdleTimeoutSeconds);
  m->http_->set_read_timeout(kHttpIdleTimeoutSeconds, 0);
  m->http_->set_write_timeout(kHttpWriteTimeoutSeconds, 0);
  m->http_->set_keep_alive_max_count(kHttpRequestsPerConnection);
  m->http_->set_payload_max_length(kHttpMaxPayloadBytes);
  m->http_->Get(
      "/metrics", [render](const httplib::Request&, httplib::Response& res) {
        res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
      });
  m->http_->Get(
      "/healthz", [serving](const httplib::Request&, httplib::Response& res) {
        const bool ok = serving();
        res.status = ok ? 200 : 503;
        res.set_content(ok ? "SERVING\n" : "NOT_SERVING\n", "text/plain");
      });
  m->http_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("kvdepot: metrics at /metrics, health at /healthz\n",
                    "text/plain");
  });
  const std::string h(host);
  int bound = port;
  if (port == 0) {
    bound = m->http_->bind_to_any_port(h);
    if (bound < 0) bound = -1;
  } else if (!m->http_->bind_to_port(h, port)) {
    bound = -1;
  }
  const int e = errno;  // from the failed bind or listen
  if (bound <= 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_address: cannot listen on \"", address, "\": ",
                     e == EADDRINUSE ? "the port is in use (another daemon?)"
                                     : std::strerror(e)));
  }
  m->address_ = absl::StrCat(address.substr(0, colon), ":", bound);
  httplib::Server* http = m->http_.get();
  m->thread_ = std::thread([http] { http->listen_after_bind(); });
  // stop() before the loop runs would be lost: wait until it runs.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!http->is_running() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return m;
}

MetricsServer::~MetricsServer() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvdepot
