// The operations RPCs: Inspect (decoded records of a slot or block), Verify
// (scan for impossible scales and NaN/Inf, per-block XXH3 checksums,
// streamed progress) and Drain (stop accepting new work). Pool bytes are
// read on the host through Backend::CopyBytes, one block at a time under
// the pool's reader lock, so stores wait at most one block copy.
#include <xxhash.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/record_check.h"
#include "server/service.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

// Copies block `block` of layer `layer` (block_stride bytes) into `host`.
absl::Status ReadBlock(Backend* backend, Pool& pool, int64_t layer,
                       int64_t block, std::vector<uint8_t>* host) {
  const PoolLayout& l = pool.layout;
  host->resize(static_cast<size_t>(l.block_stride));
  absl::ReaderMutexLock lock(&pool.mu);
  const uint8_t* src =
      pool.memory->data() + l.layer_offset(layer) + l.block_offset(block);
  return backend->CopyBytes(host->data(), src, l.block_stride);
}

absl::Status CheckRange(absl::string_view field, int64_t v, int64_t end) {
  if (v >= 0 && v < end) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = ", v, " is outside [0, ", end, ")"));
}

}  // namespace

absl::Status KVCacheService::DoInspect(const Caller& caller,
                                       const v1::InspectRequest& r,
                                       v1::InspectResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  const PoolLayout& l = (*pool)->layout;
  RETURN_IF_ERROR(CheckRange("layer", r.layer(), l.num_layers));
  int64_t block = 0, first = 0, count = l.block_size;
  switch (r.target_case()) {
    case v1::InspectRequest::kSlot:
      RETURN_IF_ERROR(CheckRange("slot", r.slot(), l.num_slots()));
      block = r.slot() / l.block_size;
      first = r.slot() % l.block_size;
      count = 1;
      break;
    case v1::InspectRequest::kBlock:
      RETURN_IF_ERROR(CheckRange("block", r.block(), l.num_blocks));
      block = r.block();
      break;
    default:
      return absl::InvalidArgumentError(
          "slot or block: one of them is required");
  }
  if (r.max_values() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_values = ", r.max_values(), " must be >= 0"));
  }
  std::vector<uint8_t> host;
  RETURN_IF_ERROR(ReadBlock(backend_, **pool, r.layer(), block, &host));
  const KVCacheFormat& f = l.format;
  const int n_values =
      r.all_values() ? f.elements() : std::min(r.max_values(), f.elements());
  const int sb = ScaleBytes(f.sf_format);
  std::vector<float> values(static_cast<size_t>(f.elements()));
  LayoutToProto(l, out->mutable_layout());
  out->set_layer(r.layer());
  for (int64_t t = first; t < first + count; ++t) {
    const RecordHealth h = CheckRecord(l, host.data(), t, values.data());
    v1::InspectRecord* rec = out->add_records();
    rec->set_slot(block * l.block_size + t);
    rec->set_block(block);
    rec->set_offset(t);
    rec->set_data_offset(l.layer_offset(r.layer()) + l.data_offset(block, t));
    const uint8_t* sf = host.data() + l.scale_offset(0, t);
    std::string hex;
    for (int s = 0; s < f.num_scales(); ++s) {
      rec->add_scales(ScaleValue(f.sf_format, sf + s * sb));
    }
    for (int i = 0; i < f.sf_bytes(); ++i)
      absl::StrAppendFormat(&hex, "%02x", sf[i]);
    rec->set_scale_hex(hex);
    for (int i = 0; i < n_values; ++i) rec->add_values(values[i]);
    rec->set_nan_count(h.nan_values);
    rec->set_inf_count(h.inf_values);
    rec->set_bad_scales(h.bad_scales);
    rec->set_all_zero(h.all_zero);
  }
  return absl::OkStatus();
}

absl::Status KVCacheService::DoVerify(Ctx* ctx, const Caller& caller,
                                      const v1::VerifyRequest& r,
                                      const ProgressWriter& write) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  // Each running Verify holds a thread: bounded per client.
  ASSIGN_OR_RETURN(ClientSlots::Slot slot,
                   verify_slots_.Acquire(BudgetClientOf(caller), "Verify"));
  const PoolLayout& l = (*pool)->layout;
  std::vector<int64_t> layers;
  for (int i = 0; i < r.layers_size(); ++i) {
    RETURN_IF_ERROR(
        CheckRange(absl::StrCat("layers[", i, "]"), r.layers(i), l.num_layers));
    for (int j = 0; j < i; ++j) {
      if (r.layers(j) == r.layers(i)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layers[", i, "] = ", r.layers(i), " repeats layers[", j, "]"));
      }
    }
    layers.push_back(r.layers(i));
  }
  if (layers.empty()) {
    for (int64_t i = 0; i < l.num_layers; ++i) layers.push_back(i);
  }
  if (r.progress_every() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress_every = ", r.progress_every(), " must be >= 0"));
  }
  const int64_t total = static_cast<int64_t>(layers.size()) * l.num_blocks;
  const int64_t every = r.progress_every() > 0
                            ? r.progress_every()
                            : std::max<int64_t>(1, total / 50);
  std::vector<uint8_t> host;
  std::vector<float> values(static_cast<size_t>(l.format.elements()));
  std::vector<uint64_t> sums;
  sums.reserve(static_cast<size_t>(total));
  v1::VerifyProgress progress;
  v1::VerifyProgress totals;
  int64_t done = 0;
  for (int64_t layer : layers) {
    for (int64_t block = 0; block < l.num_blocks; ++block) {
      absl::SleepFor(options_.verify_block_delay);  // tests only
      RETURN_IF_ERROR(CheckAlive(ctx));
      RETURN_IF_ERROR(ReadBlock(backend_, **pool, layer, block, &host));
      const uint64_t sum = XXH3_64bits(host.data(), host.size());
      sums.push_back(sum);
      v1::BlockChecksum* c = progress.add_checksums();
      c->set_layer(layer);
      c->set_block(block);
      c->set_xxh3(sum);
      v1::VerifyIssue issue;
      for (int64_t t = 0; t < l.block_size; ++t) {
        const RecordHealth h = CheckRecord(l, host.data(), t, values.data());
        if (h.ok()) continue;
        if (issue.detail().empty()) {
          issue.set_slot(block * l.block_size + t);
          issue.set_detail(DescribeProblem(l, host.data(), t, issue.slot(), h));
        }
        issue.set_bad_scales(issue.bad_scales() + h.bad_scales);
        issue.set_nan_values(issue.nan_values() + h.nan_values);
        issue.set_inf_values(issue.inf_values() + h.inf_values);
      }
      if (!issue.detail().empty()) {
        issue.set_layer(layer);
        issue.set_block(block);
        totals.set_blocks_with_issues(totals.blocks_with_issues() + 1);
        totals.set_bad_scales(totals.bad_scales() + issue.bad_scales());
        totals.set_nan_values(totals.nan_values() + issue.nan_values());
        totals.set_inf_values(totals.inf_values() + issue.inf_values());
        *progress.add_issues() = std::move(issue);
      }
      ++done;
      if (done % every == 0 && done < total) {
        progress.set_blocks_done(done);
        progress.set_blocks_total(total);
        if (!write(progress)) {
          return absl::CancelledError("the client went away");
        }
        progress.Clear();
      }
    }
  }
  totals.set_blocks_done(done);
  totals.set_blocks_total(total);
  totals.set_done(true);
  totals.set_pool_xxh3(
      XXH3_64bits(sums.data(), sums.size() * sizeof(uint64_t)));
  progress.MergeFrom(totals);
  if (!write(progress)) {
    return absl::CancelledError("the client went away");
  }
  spdlog::info("rpc=Verify pool={} blocks={} blocks_with_issues={}",
               (*pool)->name, done, totals.blocks_with_issues());
  return absl::OkStatus();
}

absl::Status KVCacheService::DoDrain(const Caller& caller,
                                     v1::DrainResponse* out) {
  RETURN_IF_ERROR(RequireAdmin(caller, "Drain"));
  const bool started = accepting_.exchange(false);
  out->set_started(started);
  out->set_in_flight(std::max<int64_t>(in_flight_.load() - 1, 0));
  const SessionStats s = sessions_->Stats();
  out->set_sessions(s.sessions);
  out->set_buffers(s.buffers);
  if (started) {
    spdlog::warn("kvdepot draining on request: no new work accepted");
    if (drain_hook_) drain_hook_();
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
