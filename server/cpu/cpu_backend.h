// The CPU backend: pools and buffers in POSIX shared memory (mode 0600 by
// default) that clients on the same host map; store and load run the CPU
// reference (//kernels/reference).
#ifndef KVDEPOT_SERVER_CPU_CPU_BACKEND_H_
#define KVDEPOT_SERVER_CPU_CPU_BACKEND_H_

#include <memory>

#include "server/backend/backend.h"

namespace kvdepot {

std::unique_ptr<Backend> MakeCpuBackend(const BackendOptions& options);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CPU_CPU_BACKEND_H_
