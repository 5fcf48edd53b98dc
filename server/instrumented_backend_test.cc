// InstrumentedBackend forwards the calls a backend may override beyond the
// required ones: a default left in the decorator would quietly send the
// daemon's GPU work down the host path (the index operations once did).
#include "server/instrumented_backend.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/backend/backend.h"
#include "server/metrics.h"

namespace kvdepot {
namespace {

// Answers every index call with its own code and marks what it saw.
class MarkingBackend final : public Backend {
 public:
  absl::string_view name() const override { return "marking"; }
  absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const override {
    return std::string(requested);
  }
  absl::StatusOr<std::unique_ptr<Memory>> Allocate(int64_t,
                                                   absl::string_view) override {
    return absl::UnimplementedError("no memory");
  }
  absl::Status Store(const PoolLayout&, const Memory&, int64_t, const void*,
                     InputDtype, absl::Span<const int32_t>) override {
    return absl::OkStatus();
  }
  absl::Status Load(const PoolLayout&, const Memory&, int64_t,
                    absl::Span<const int32_t>, int64_t, void*, void*) override {
    return absl::OkStatus();
  }
  absl::Status ConvertTopkOrdered(const Memory&, const ConvertTopkCall& call,
                                  const GpuOrdering&, absl::Time,
                                  int64_t* invalid,
                                  std::string* recorded) override {
    *invalid = call.batch;
    *recorded = "topk";
    return absl::AbortedError("convert_topk reached the backend");
  }
  absl::Status SwaDecodeOrdered(const Memory&, const SwaDecodeCall&,
                                const GpuOrdering&, absl::Time,
                                std::string* recorded) override {
    *recorded = "swa";
    return absl::DataLossError("swa_decode reached the backend");
  }
  absl::Status PrefillIndexOrdered(const Memory&, const PrefillIndexCall&,
                                   const GpuOrdering&, absl::Time,
                                   int64_t* invalid,
                                   std::string* recorded) override {
    *invalid = 7;
    *recorded = "prefill";
    return absl::OutOfRangeError("prefill_index reached the backend");
  }
};

class NoMemory final : public Memory {
 public:
  uint8_t* data() const override { return nullptr; }
  int64_t size() const override { return 0; }
};

TEST(InstrumentedBackendTest, IndexOperationsReachTheInnerBackend) {
  ServerMetrics metrics({"Store", "Load"});
  InstrumentedBackend backend(std::make_unique<MarkingBackend>(), &metrics);
  const NoMemory memory;
  const GpuOrdering ordering;
  std::string recorded;
  int64_t invalid = 0;

  ConvertTopkCall topk;
  topk.batch = 5;
  EXPECT_TRUE(absl::IsAborted(backend.ConvertTopkOrdered(
      memory, topk, ordering, absl::InfiniteFuture(), &invalid, &recorded)));
  EXPECT_EQ(invalid, 5);
  EXPECT_EQ(recorded, "topk");

  EXPECT_TRUE(absl::IsDataLoss(backend.SwaDecodeOrdered(
      memory, SwaDecodeCall{}, ordering, absl::InfiniteFuture(), &recorded)));
  EXPECT_EQ(recorded, "swa");

  EXPECT_TRUE(absl::IsOutOfRange(backend.PrefillIndexOrdered(
      memory, PrefillIndexCall{}, ordering, absl::InfiniteFuture(), &invalid,
      &recorded)));
  EXPECT_EQ(invalid, 7);
  EXPECT_EQ(recorded, "prefill");
}

}  // namespace
}  // namespace kvdepot
