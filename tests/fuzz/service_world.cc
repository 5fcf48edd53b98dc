#include "tests/fuzz/service_world.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "common/memfd.h"
#include "server/cpu/cpu_backend.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvdepot::fuzz {
namespace {

void AddPool(PoolRegistry& pools, const char* name, const char* format,
             int32_t elements, int64_t block_size, int64_t num_blocks,
             int64_t num_layers) {
  v1::CreatePoolRequest r;
  r.set_name(name);
  r.set_format(format);
  r.set_elements(elements);
  r.set_block_size(block_size);
  r.set_num_blocks(num_blocks);
  r.set_num_layers(num_layers);
  absl::StatusOr<std::shared_ptr<Pool>> p = pools.Create(r, getuid());
  FUZZ_CHECK(p.ok(), "pool %s: %s", name, p.status().ToString().c_str());
}

}  // namespace

ServiceWorld::ServiceWorld()
    : backend(MakeCpuBackend(BackendOptions{})),
      pools(backend.get(), int64_t{64} << 20),
      sessions(SessionLimits{.max_sessions = 64,
                             .max_buffers_per_session = 16,
                             .max_buffer_bytes = int64_t{64} << 20}),
      service(backend.get(), &pools, &sessions,
              ServiceOptions{.max_inline_bytes = int64_t{16} << 20,
                             .max_buffer_bytes = int64_t{16} << 20}) {
  AddPool(pools, "p", "FP8_FP32SF_INDEX", 0, 16, 8, 2);
  AddPool(pools, "v", "V41", 0, 64, 4, 1);
  AddPool(pools, "b", "BF16", 8, 7, 5, 2);
  // A companion-socket peer's session (this process's credentials, so it
  // owns the pools above) holding buffer 1, as the companion socket would
  // set them up.
  absl::StatusOr<OpenedSession> opened =
      sessions.OpenPeer("fuzz", PeerCredentials{getpid(), getuid(), getgid()});
  FUZZ_CHECK(opened.ok(), "session: %s", opened.status().ToString().c_str());
  session = opened->id;
  absl::StatusOr<Caller> caller = sessions.Authenticate(session, absl::Now());
  FUZZ_CHECK(caller.ok(), "caller");
  absl::StatusOr<std::unique_ptr<Memory>> memory =
      backend->Allocate(int64_t{1} << 20, "");
  FUZZ_CHECK(memory.ok(), "memory");
  absl::StatusOr<std::shared_ptr<Buffer>> buffer =
      sessions.AddBuffer(*caller, *std::move(memory));
  FUZZ_CHECK(buffer.ok() && (*buffer)->id == 1, "buffer 1");
  // Buffer 2: a client's memfd, validated and mapped like an import_buffer
  // on the companion socket (the daemon keeps its own mapping).
  absl::StatusOr<MemfdRegion> own = MemfdRegion::Create("fuzz-client", 1 << 20);
  FUZZ_CHECK(own.ok(), "memfd: %s", own.status().ToString().c_str());
  absl::StatusOr<UniqueFd> fd = own->Dup();
  FUZZ_CHECK(fd.ok(), "dup");
  absl::StatusOr<std::unique_ptr<Memory>> imported =
      backend->ImportFd(*std::move(fd), int64_t{1} << 20);
  FUZZ_CHECK(imported.ok(), "import: %s", imported.status().ToString().c_str());
  buffer = sessions.AddBuffer(*caller, *std::move(imported));
  FUZZ_CHECK(buffer.ok() && (*buffer)->id == 2, "buffer 2");
}

ServiceWorld::~ServiceWorld() {
  sessions.Clear();
  pools.Clear();
}

}  // namespace kvdepot::fuzz
