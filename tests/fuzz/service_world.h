// A KVCacheService on the CPU backend in process, as the daemon builds it,
// with small limits: pools "p" (FP8_FP32SF_INDEX, block 16 x 8, 2 layers),
// "v" (V41, block 64 x 4, 1 layer) and "b" (BF16(8), block 7 x 5, 2
// layers), one open session (`session`) holding buffer 1 (1 MiB, allocated
// by the daemon) and buffer 2 (1 MiB, the world's own memfd, imported as
// the companion socket imports a client's). Fresh per
// fuzz input, so buffer ids and pools are the same on every replay.
#ifndef KVDEPOT_TESTS_FUZZ_SERVICE_WORLD_H_
#define KVDEPOT_TESTS_FUZZ_SERVICE_WORLD_H_

#include <cstdint>
#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/pools.h"
#include "server/service.h"
#include "server/sessions.h"

namespace kvdepot::fuzz {

struct ServiceWorld {
  ServiceWorld();  // aborts if the fixed pools or session cannot be made
  ~ServiceWorld();

  std::unique_ptr<Backend> backend;
  PoolRegistry pools;
  SessionManager sessions;
  KVCacheService service;
  std::string session;  // id of the open session
};

}  // namespace kvdepot::fuzz

#endif  // KVDEPOT_TESTS_FUZZ_SERVICE_WORLD_H_
