// The daemon's --config file: textproto DaemonConfig parsed as
// Daemon::ApplyConfig (server/daemon.cc) parses it, then each pool created
// through PoolRegistry::Create, the validation the daemon applies, on the
// CPU backend with a 64 MiB pool limit (large pools are refused by the same
// check as --max_pool_bytes). ApplyConfig itself is private to the daemon,
// which also starts a gRPC server: its two steps are repeated here.
// Properties: no crash or sanitizer report; a refused pool is
// INVALID_ARGUMENT, ALREADY_EXISTS or RESOURCE_EXHAUSTED, never UNKNOWN or
// INTERNAL; a created pool is found by its name.
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "google/protobuf/text_format.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/backend/backend.h"
#include "server/cpu/cpu_backend.h"
#include "server/pools.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // TextFormat logs every parse error through protobuf's log handler.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvdepot::v1::DaemonConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(text, &config)) return 0;
  std::unique_ptr<kvdepot::Backend> backend =
      kvdepot::MakeCpuBackend(kvdepot::BackendOptions{});
  kvdepot::PoolRegistry pools(backend.get(), int64_t{64} << 20);
  for (int i = 0; i < config.pools_size() && i < 16; ++i) {
    absl::StatusOr<std::shared_ptr<kvdepot::Pool>> p =
        pools.Create(config.pools(i), getuid());
    if (p.ok()) {
      FUZZ_CHECK(pools.Get("name", config.pools(i).name()).ok(),
                 "pools[%d] created but not found", i);
      continue;
    }
    const absl::StatusCode c = p.status().code();
    FUZZ_CHECK(c == absl::StatusCode::kInvalidArgument ||
                   c == absl::StatusCode::kAlreadyExists ||
                   c == absl::StatusCode::kResourceExhausted ||
                   c == absl::StatusCode::kUnimplemented,
               "pools[%d]: %s", i, p.status().ToString().c_str());
  }
  pools.Clear();
  return 0;
}
