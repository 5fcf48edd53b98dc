// The operations RPCs: Inspect (decoded records of a slot or block), Verify
// (scan for impossible scales and NaN/Inf, per-block XXH3 checksums,
// streamed progress) and Drain (stop accepting new work). Pool bytes are
// read on the host through Backend::CopyBytes under the pool's reader lock,
// at most ServiceOptions::scan_chunk_bytes (or one record) at a time, so a
// pool of huge blocks costs neither a copy of a whole block per call nor
// long waits for stores. Inspect's reply is bounded before it is built: by
// --max_message_bytes, and by the reply budget (server/reply_scope.h).
#include <xxhash.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/log_limiter.h"
#include "server/record_check.h"
#include "server/reply_scope.h"
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

// Copies records [first, first + count) of block `block` of layer `layer`
// into `host`, laid out as block 0 of `*view` (the pool's layout with
// block_size = count): CheckRecord(*view, host, t - first) reads record t.
absl::Status ReadRecords(Backend* backend, Pool& pool, int64_t layer,
                         int64_t block, int64_t first, int64_t count,
                         std::vector<uint8_t>* host, PoolLayout* view) {
  const PoolLayout& l = pool.layout;
  const KVCacheFormat& f = l.format;
  *view = l;
  view->block_size = count;
  host->resize(static_cast<size_t>(count * f.bytes_per_token()));
  const uint8_t* base = pool.memory->data() + l.layer_offset(layer);
  absl::ReaderMutexLock lock(&pool.mu);
  if (f.token_interleaved) {
    return backend->CopyBytes(host->data(), base + l.data_offset(block, first),
                              count * f.bytes_per_token());
  }
  RETURN_IF_ERROR(backend->CopyBytes(host->data(),
                                     base + l.data_offset(block, first),
                                     count * f.data_bytes()));
  return backend->CopyBytes(host->data() + view->scale_offset(0, 0),
                            base + l.scale_offset(block, first),
                            count * f.sf_bytes());
}

// Blocks one Verify progress message may cover.
constexpr int64_t kMaxBlocksPerProgress = 16384;

// Records per copy: as many as fit in `chunk_bytes`, at least one.
int64_t RecordsPerChunk(const PoolLayout& l, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / l.format.bytes_per_token());
}

// A streaming XXH3_64bits state, reset.
using Xxh3 = std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)>;
absl::StatusOr<Xxh3> NewXxh3() {
  Xxh3 state(XXH3_createState(), &XXH3_freeState);
  if (state == nullptr || XXH3_64bits_reset(state.get()) != XXH_OK) {
    return absl::ResourceExhaustedError("XXH3 state: out of memory");
  }
  return state;
}

// XXH3_64bits of block `block` of layer `layer`, copied `chunk_bytes` at a
// time into `scratch` (the same value as hashing the whole block at once).
absl::StatusOr<uint64_t> ChecksumBlock(Backend* backend, Pool& pool,
                                       int64_t layer, int64_t block,
                                       int64_t chunk_bytes,
                                       std::vector<uint8_t>* scratch) {
  const PoolLayout& l = pool.layout;
  ASSIGN_OR_RETURN(Xxh3 state, NewXxh3());
  const uint8_t* src =
      pool.memory->data() + l.layer_offset(layer) + l.block_offset(block);
  for (int64_t at = 0; at < l.block_stride; at += chunk_bytes) {
    const int64_t n = std::min(chunk_bytes, l.block_stride - at);
    scratch->resize(static_cast<size_t>(n));
    {
      absl::ReaderMutexLock lock(&pool.mu);
      RETURN_IF_ERROR(backend->CopyBytes(scratch->data(), src + at, n));
    }
    XXH3_64bits_update(state.get(), scratch->data(), static_cast<size_t>(n));
  }
  return XXH3_64bits_digest(state.get());
}

// Checks records [t0, t0 + n) of `view` at `records` (slot of record t:
// first_slot + t - t0) into `issue`: the first problem's slot and detail,
// and the counts.
void CheckRecords(const PoolLayout& view, const uint8_t* records, int64_t t0,
                  int64_t n, int64_t first_slot, float* values,
                  v1::VerifyIssue* issue) {
  for (int64_t t = t0; t < t0 + n; ++t) {
    const RecordHealth h = CheckRecord(view, records, t, values);
    if (h.ok()) continue;
    if (issue->detail().empty()) {
      issue->set_slot(first_slot + t - t0);
      issue->set_detail(DescribeProblem(view, records, t, issue->slot(), h));
    }
    issue->set_bad_scales(issue->bad_scales() + h.bad_scales);
    issue->set_nan_values(issue->nan_values() + h.nan_values);
    issue->set_inf_values(issue->inf_values() + h.inf_values);
  }
}

// What one InspectRecord can take, in memory and on the wire, with
// `n_values` values: its fixed fields and object (256 bytes, generous),
// the scales, their hex text and the values.
int64_t InspectRecordBound(const KVCacheFormat& f, int64_t n_values) {
  return 256 + 4 * int64_t{f.num_scales()} + 2 * int64_t{f.sf_bytes()} +
         4 * n_values;
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
  const KVCacheFormat& f = l.format;
  const int n_values =
      r.all_values() ? f.elements() : std::min(r.max_values(), f.elements());
  // The reply, bounded before anything is read or built (compared by
  // division: no overflow whatever the pool).
  const int64_t per_record = InspectRecordBound(f, n_values);
  if (count > (options_.max_inline_bytes - 1024) / per_record) {
    return absl::InvalidArgumentError(absl::StrCat(
        r.target_case() == v1::InspectRequest::kSlot ? "slot" : "block", ": ",
        count, " records of ", n_values, " values each make a reply of up to ",
        count, " x ", per_record, " bytes, over the inline limit of ",
        options_.max_inline_bytes,
        " (--max_message_bytes); ask for fewer values (max_values) or one "
        "slot"));
  }
  const int64_t reply_bytes = 1024 + count * per_record;
  RETURN_IF_ERROR(ReplyScope::Reserve(BudgetClientOf(caller), reply_bytes,
                                      "Inspect reply"));
  const int sb = ScaleBytes(f.sf_format);
  std::vector<float> values(static_cast<size_t>(f.elements()));
  LayoutToProto(l, out->mutable_layout());
  out->set_layer(r.layer());
  out->mutable_records()->Reserve(static_cast<int>(count));
  std::vector<uint8_t> host;
  PoolLayout view;
  const int64_t per_chunk = RecordsPerChunk(l, options_.scan_chunk_bytes);
  for (int64_t t0 = first; t0 < first + count; t0 += per_chunk) {
    const int64_t n = std::min(per_chunk, first + count - t0);
    RETURN_IF_ERROR(
        ReadRecords(backend_, **pool, r.layer(), block, t0, n, &host, &view));
    for (int64_t t = t0; t < t0 + n; ++t) {
      const RecordHealth h =
          CheckRecord(view, host.data(), t - t0, values.data());
      v1::InspectRecord* rec = out->add_records();
      rec->set_slot(block * l.block_size + t);
      rec->set_block(block);
      rec->set_offset(t);
      rec->set_data_offset(l.layer_offset(r.layer()) + l.data_offset(block, t));
      const uint8_t* sf = host.data() + view.scale_offset(0, t - t0);
      rec->mutable_scales()->Reserve(f.num_scales());
      for (int s = 0; s < f.num_scales(); ++s) {
        rec->add_scales(ScaleValue(f.sf_format, sf + s * sb));
      }
      std::string hex;
      hex.reserve(static_cast<size_t>(2 * f.sf_bytes()));
      for (int i = 0; i < f.sf_bytes(); ++i)
        absl::StrAppendFormat(&hex, "%02x", sf[i]);
      rec->set_scale_hex(std::move(hex));
      rec->mutable_values()->Reserve(n_values);
      for (int i = 0; i < n_values; ++i) rec->add_values(values[i]);
      rec->set_nan_count(h.nan_values);
      rec->set_inf_count(h.inf_values);
      rec->set_bad_scales(h.bad_scales);
      rec->set_all_zero(h.all_zero);
    }
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
  // Where each layer was first named: linear in the request (the old
  // pairwise check was quadratic in a pool's layer count).
  absl::flat_hash_map<int64_t, int> first;
  for (int i = 0; i < r.layers_size(); ++i) {
    RETURN_IF_ERROR(
        CheckRange(absl::StrCat("layers[", i, "]"), r.layers(i), l.num_layers));
    auto [it, fresh] = first.emplace(r.layers(i), i);
    if (!fresh) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", i, "] = ", r.layers(i), " repeats layers[",
                       it->second, "]"));
    }
    layers.push_back(r.layers(i));
  }
  if (layers.empty()) {
    for (int64_t i = 0; i < l.num_layers; ++i) layers.push_back(i);
  }
  // A progress message holds its blocks' checksums and issues (each well
  // under 512 bytes, on the wire and in memory) until it is written.
  if (r.progress_every() < 0 || r.progress_every() > kMaxBlocksPerProgress) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress_every = ", r.progress_every(),
                     " must be in [0, ", kMaxBlocksPerProgress, "]"));
  }
  const int64_t total = static_cast<int64_t>(layers.size()) * l.num_blocks;
  const int64_t every =
      r.progress_every() > 0
          ? r.progress_every()
          : std::clamp<int64_t>(total / 50, 1, kMaxBlocksPerProgress);
  std::vector<uint8_t> host;
  std::vector<float> values(static_cast<size_t>(l.format.elements()));
  const int64_t chunk = options_.scan_chunk_bytes;
  const int64_t per_chunk = RecordsPerChunk(l, chunk);
  // pool_xxh3: XXH3 of the block checksums in scan order, streamed.
  ASSIGN_OR_RETURN(Xxh3 pool_sum, NewXxh3());
  v1::VerifyProgress progress;
  v1::VerifyProgress totals;
  int64_t done = 0;
  for (int64_t layer : layers) {
    for (int64_t block = 0; block < l.num_blocks; ++block) {
      absl::SleepFor(options_.verify_block_delay);  // tests only
      RETURN_IF_ERROR(CheckAlive(ctx));
      uint64_t sum = 0;
      v1::VerifyIssue issue;
      if (l.block_stride <= chunk) {
        // One copy: the checksum and the records see the same bytes.
        RETURN_IF_ERROR(ReadBlock(backend_, **pool, layer, block, &host));
        sum = XXH3_64bits(host.data(), host.size());
        CheckRecords(l, host.data(), 0, l.block_size, block * l.block_size,
                     values.data(), &issue);
      } else {
        // A block larger than a chunk is hashed, then checked, a chunk at a
        // time (a store racing the scan may show in one and not the other).
        ASSIGN_OR_RETURN(
            sum, ChecksumBlock(backend_, **pool, layer, block, chunk, &host));
        PoolLayout view;
        for (int64_t t0 = 0; t0 < l.block_size; t0 += per_chunk) {
          const int64_t n = std::min(per_chunk, l.block_size - t0);
          RETURN_IF_ERROR(
              ReadRecords(backend_, **pool, layer, block, t0, n, &host, &view));
          CheckRecords(view, host.data(), 0, n, block * l.block_size + t0,
                       values.data(), &issue);
        }
      }
      XXH3_64bits_update(pool_sum.get(), &sum, sizeof(sum));
      v1::BlockChecksum* c = progress.add_checksums();
      c->set_layer(layer);
      c->set_block(block);
      c->set_xxh3(sum);
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
  totals.set_pool_xxh3(XXH3_64bits_digest(pool_sum.get()));
  progress.MergeFrom(totals);
  if (!write(progress)) {
    return absl::CancelledError("the client went away");
  }
  if (AdmitClientLog(ClientLog::kClientEvent, caller.log_client())) {
    spdlog::info("rpc=Verify pool={} blocks={} blocks_with_issues={}",
                 (*pool)->name, done, totals.blocks_with_issues());
  }
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
