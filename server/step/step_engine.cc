#include "server/step/step_engine.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvdepot::step {
namespace {

class UnavailableFactory : public StepEngineFactory {
 public:
  explicit UnavailableFactory(std::string backend)
      : backend_(std::move(backend)) {}
  absl::StatusOr<std::unique_ptr<StepEngine>> Create(const RegistrationConfig&,
                                                     CompletionFn) override {
    return absl::FailedPreconditionError(absl::StrCat(
        "RegisterWorker: the decode step path (SPEC §10) runs on the GPU; "
        "this daemon runs the ",
        backend_, " backend (start kvdepotd --backend=cuda on a GPU host)"));
  }

 private:
  const std::string backend_;
};

}  // namespace

std::unique_ptr<StepEngineFactory> MakeUnavailableEngineFactory(
    std::string backend_name) {
  return std::make_unique<UnavailableFactory>(std::move(backend_name));
}

}  // namespace kvdepot::step
