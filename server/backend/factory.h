// The one place that knows every backend: the daemon asks it for one by
// name. Backends depend on the interface (backend.h) only, never on this.
#ifndef KVDEPOT_SERVER_BACKEND_FACTORY_H_
#define KVDEPOT_SERVER_BACKEND_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend/backend.h"

namespace kvdepot {

// Builds a backend: kind "auto" (CUDA when a GPU is visible, else CPU),
// "cpu" or "cuda". A build without CUDA (no toolkit, or
// KVDEPOT_DISABLE_CUDA=1) picks CPU for "auto" and fails "cuda" with
// UNIMPLEMENTED; with CUDA, "cuda" fails with FAILED_PRECONDITION when no
// device is visible.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(
    absl::string_view kind, const BackendOptions& options);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BACKEND_FACTORY_H_
