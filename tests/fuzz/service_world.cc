#include "tests/fuzz/service_world.h"

#include <grpcpp/grpcpp.h>

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
  absl::StatusOr<std::shared_ptr<Pool>> p = pools.Create(r);
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
  grpc::ServerContext ctx;
  v1::OpenSessionRequest open;
  v1::OpenSessionResponse opened;
  FUZZ_CHECK(service.OpenSession(&ctx, &open, &opened).ok(), "session");
  session = opened.session_id();
  v1::AllocateBufferRequest alloc;
  alloc.set_session_id(session);
  alloc.set_size(int64_t{1} << 20);
  v1::BufferInfo info;
  grpc::ServerContext ctx2;
  FUZZ_CHECK(service.AllocateBuffer(&ctx2, &alloc, &info).ok() &&
                 info.buffer_id() == 1,
             "buffer 1");
}

ServiceWorld::~ServiceWorld() {
  sessions.Clear();
  pools.Clear();
}

}  // namespace kvdepot::fuzz
