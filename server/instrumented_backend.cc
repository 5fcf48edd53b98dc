#include "server/instrumented_backend.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/store_load_host.h"

namespace kvdepot {
namespace {

int64_t MicrosSince(absl::Time start) {
  return absl::ToInt64Microseconds(absl::Now() - start);
}

}  // namespace

void InstrumentedBackend::CountStore(const PoolLayout& layout,
                                     absl::Span<const int32_t> slot_mapping,
                                     int64_t us) {
  int64_t tokens = 0;
  for (int32_t slot : slot_mapping) tokens += slot >= 0 ? 1 : 0;
  metrics_->RecordStore(tokens, tokens * layout.format.bytes_per_token(), us);
}

void InstrumentedBackend::CountLoad(const PoolLayout& layout, int64_t total_k,
                                    int64_t us) {
  const int64_t row_bytes =
      LoadDataRowBytes(layout.format) + LoadScaleRowBytes(layout.format);
  metrics_->RecordLoad(total_k, total_k * row_bytes, us);
}

absl::Status InstrumentedBackend::Store(
    const PoolLayout& layout, const Memory& pool, int64_t layer, const void* kv,
    InputDtype dtype, absl::Span<const int32_t> slot_mapping) {
  const absl::Time start = absl::Now();
  absl::Status s = inner_->Store(layout, pool, layer, kv, dtype, slot_mapping);
  if (s.ok()) CountStore(layout, slot_mapping, MicrosSince(start));
  return s;
}

absl::Status InstrumentedBackend::Load(const PoolLayout& layout,
                                       const Memory& pool, int64_t layer,
                                       absl::Span<const int32_t> segments,
                                       int64_t total_k, void* data,
                                       void* scales) {
  const absl::Time start = absl::Now();
  absl::Status s =
      inner_->Load(layout, pool, layer, segments, total_k, data, scales);
  if (s.ok()) CountLoad(layout, total_k, MicrosSince(start));
  return s;
}

absl::Status InstrumentedBackend::StoreOrdered(
    const PoolLayout& layout, const Memory& pool, int64_t layer, const void* kv,
    InputDtype dtype, absl::Span<const int32_t> slot_mapping,
    const GpuOrdering& ordering, std::string* recorded_event) {
  const absl::Time start = absl::Now();
  absl::Status s = inner_->StoreOrdered(layout, pool, layer, kv, dtype,
                                        slot_mapping, ordering, recorded_event);
  if (s.ok()) CountStore(layout, slot_mapping, MicrosSince(start));
  return s;
}

absl::Status InstrumentedBackend::StoreFused(
    const PoolLayout& layout, const Memory& pool, int64_t layer,
    const uint16_t* kv, const FusedParams& params,
    absl::Span<const int32_t> slot_mapping, uint16_t* cast_back) {
  const absl::Time start = absl::Now();
  absl::Status s = inner_->StoreFused(layout, pool, layer, kv, params,
                                      slot_mapping, cast_back);
  if (s.ok()) CountStore(layout, slot_mapping, MicrosSince(start));
  return s;
}

absl::Status InstrumentedBackend::LoadOrdered(
    const PoolLayout& layout, const Memory& pool, int64_t layer,
    absl::Span<const int32_t> segments, int64_t total_k, void* data,
    void* scales, const GpuOrdering& ordering, std::string* recorded_event) {
  const absl::Time start = absl::Now();
  absl::Status s = inner_->LoadOrdered(layout, pool, layer, segments, total_k,
                                       data, scales, ordering, recorded_event);
  if (s.ok()) CountLoad(layout, total_k, MicrosSince(start));
  return s;
}

}  // namespace kvdepot
