// Helper process of e2e_lifecycle_test: connects to the daemon at argv[1]
// with a lease of argv[2] ms, allocates two buffers, prints their shm names
// (one per line, then "ready"), and waits to be killed. Its keep-alive
// thread renews the lease until the process dies.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

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
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<kvdepot::v1::BufferInfo> info;
    kvdepot::v1::AllocateBufferRequest r;
    r.set_session_id((*c)->session_id());
    r.set_size(4096 * (i + 1));
    grpc::ClientContext ctx;
    kvdepot::v1::BufferInfo out;
    grpc::Status s = (*c)->stub()->AllocateBuffer(&ctx, r, &out);
    if (!s.ok()) {
      std::fprintf(stderr, "AllocateBuffer: %s\n", s.error_message().c_str());
      return 1;
    }
    std::printf("%s\n", out.handle().shm_name().c_str());
  }
  std::printf("ready\n");
  std::fflush(stdout);
  while (true) pause();
}
