// Helper process of e2e_lifecycle_test: connects to the daemon at argv[1]
// (argv[2], a lease in ms, is ignored on a Unix socket: the session lives
// as long as the companion connection), allocates two buffers, prints their
// ids (one per line, then "ready"), and waits to be killed.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "client/kvdepot_client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: lease_client SOCKET LEASE_MS\n");
    return 2;
  }
  kvdepot::ClientOptions options;
  options.address = argv[1];
  options.client_name = "lease_client";
  options.lease = absl::Milliseconds(std::atol(argv[2]));
  absl::StatusOr<std::unique_ptr<kvdepot::KVCacheClient>> c =
      kvdepot::KVCacheClient::Connect(options);
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  std::vector<kvdepot::BufferMapping> buffers;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<kvdepot::BufferMapping> b =
        (*c)->AllocateBuffer(4096 * (i + 1));
    if (!b.ok()) {
      std::fprintf(stderr, "AllocateBuffer: %s\n",
                   b.status().ToString().c_str());
      return 1;
    }
    std::printf("%llu\n", static_cast<unsigned long long>(b->id()));
    buffers.push_back(*std::move(b));
  }
  std::printf("ready\n");
  std::fflush(stdout);
  while (true) pause();
}
