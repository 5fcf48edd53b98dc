#include "server/prefill_sources.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

bool Overlaps(int64_t a, int64_t a_bytes, int64_t b, int64_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

int32_t At(absl::Span<const int32_t> v, size_t i) {
  return v.empty() ? 0 : v[i];  // an empty swa_valid_start is all zeros
}

absl::Status Differs(absl::string_view field, const std::string& got,
                     const std::string& source, const PrefillSource& s) {
  return absl::FailedPreconditionError(absl::StrCat(
      "shared_compressed: ", field, " = ", got, " differs from the source's ",
      source, " (the last full PrefillLoad into output buffer ", s.buffer_id,
      " at offset ", s.offset,
      "): a consumer layer must share the source layer's main_pool, "
      "main_layer, window, compress_ratio and sequences"));
}

absl::Status CompareArray(absl::string_view field,
                          absl::Span<const int32_t> got,
                          absl::Span<const int32_t> source,
                          const PrefillSource& s) {
  for (size_t i = 0; i < source.size(); ++i) {
    if (At(got, i) != source[i]) {
      return Differs(absl::StrCat(field, "[", i, "]"), absl::StrCat(At(got, i)),
                     absl::StrCat(source[i]), s);
    }
  }
  return absl::OkStatus();
}

}  // namespace

void PrefillSources::Forget(uint64_t buffer_id, int64_t offset, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  ForgetLocked(buffer_id, offset, bytes);
}

void PrefillSources::ForgetLocked(uint64_t buffer_id, int64_t offset,
                                  int64_t bytes) {
  auto it = entries_.find(buffer_id);
  if (it == entries_.end()) return;
  auto& v = it->second.sources;
  for (auto s = v.begin(); s != v.end();) {
    if (Overlaps((*s)->offset, (*s)->bytes, offset, bytes)) {
      bytes_ -= (*s)->array_bytes();
      s = v.erase(s);
    } else {
      ++s;
    }
  }
  if (v.empty()) entries_.erase(it);
}

void PrefillSources::MakeRoomLocked(int64_t incoming) {
  // Records of released buffers first.
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.buffer.expired()) {
      for (const auto& s : it->second.sources) bytes_ -= s->array_bytes();
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
  // Then the oldest, until the new record fits.
  while (!entries_.empty() && bytes_ + incoming > kMaxSourceBytes) {
    auto oldest = entries_.end();
    size_t oldest_i = 0;
    uint64_t oldest_seq = UINT64_MAX;
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      for (size_t i = 0; i < it->second.sources.size(); ++i) {
        if (it->second.sources[i]->sequence < oldest_seq) {
          oldest_seq = it->second.sources[i]->sequence;
          oldest = it;
          oldest_i = i;
        }
      }
    }
    auto& v = oldest->second.sources;
    bytes_ -= v[oldest_i]->array_bytes();
    v.erase(v.begin() + static_cast<std::ptrdiff_t>(oldest_i));
    if (v.empty()) entries_.erase(oldest);
  }
}

void PrefillSources::Record(const std::shared_ptr<Buffer>& buffer,
                            int64_t offset, int64_t bytes,
                            PrefillSourceKey key) {
  auto s = std::make_shared<PrefillSource>();
  s->buffer_id = buffer->id;
  s->offset = offset;
  s->bytes = bytes;
  s->key = std::move(key);
  const int64_t incoming = s->array_bytes();
  absl::MutexLock lock(&mu_);
  ForgetLocked(buffer->id, offset, bytes);
  if (incoming > kMaxSourceBytes) return;  // never recorded: full loads only
  MakeRoomLocked(incoming);
  Entry& e = entries_[buffer->id];
  e.buffer = buffer;
  if (static_cast<int>(e.sources.size()) >= kMaxSourcesPerBuffer) {
    bytes_ -= e.sources.front()->array_bytes();
    e.sources.erase(e.sources.begin());  // kept in insertion order
  }
  s->sequence = next_sequence_++;
  bytes_ += incoming;
  e.sources.push_back(std::move(s));
}

absl::StatusOr<std::shared_ptr<const PrefillSource>> PrefillSources::Find(
    uint64_t buffer_id, int64_t offset) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(buffer_id);
  if (it != entries_.end() && !it->second.buffer.expired()) {
    for (const auto& s : it->second.sources) {
      if (s->offset == offset) return s;
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "shared_compressed: no full PrefillLoad into output buffer ", buffer_id,
      " at offset ", offset,
      " is recorded (the source layer's load must complete first, into "
      "exactly this slice; records are kept for the last ",
      kMaxSourcesPerBuffer,
      " loads of a buffer and forgotten when another load overwrites the "
      "slice); run a full PrefillLoad instead"));
}

int64_t PrefillSources::size() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : entries_) {
    n += static_cast<int64_t>(e.sources.size());
  }
  return n;
}

int64_t PrefillSources::array_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::Status CheckConsumer(const PrefillSource& s,
                           const std::shared_ptr<Pool>& main_pool,
                           int64_t main_layer, int32_t window, int32_t ratio,
                           absl::Span<const int32_t> seqlen_k,
                           absl::Span<const int32_t> seqlen_q,
                           absl::Span<const int32_t> swa_valid_start,
                           const PrefillLayout& layout) {
  const PrefillSourceKey& k = s.key;
  const std::shared_ptr<Pool> source_pool = k.main_pool.lock();
  if (source_pool == nullptr || source_pool != main_pool) {
    return Differs("main_pool", absl::StrCat("\"", main_pool->name, "\""),
                   source_pool == nullptr
                       ? std::string("pool, since deleted")
                       : absl::StrCat("\"", source_pool->name, "\""),
                   s);
  }
  if (main_layer != k.main_layer) {
    return Differs("main_layer", absl::StrCat(main_layer),
                   absl::StrCat(k.main_layer), s);
  }
  if (window != k.window) {
    return Differs("window", absl::StrCat(window), absl::StrCat(k.window), s);
  }
  if (ratio != k.ratio) {
    return Differs("compress_ratio", absl::StrCat(ratio), absl::StrCat(k.ratio),
                   s);
  }
  if (seqlen_k.size() != k.seqlen_k.size()) {
    return Differs("num_seqs", absl::StrCat(seqlen_k.size()),
                   absl::StrCat(k.seqlen_k.size()), s);
  }
  if (absl::Status st = CompareArray("seqlen_k", seqlen_k, k.seqlen_k, s);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CompareArray("seqlen_q", seqlen_q, k.seqlen_q, s);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CompareArray("swa_valid_start", swa_valid_start,
                                     k.swa_valid_start, s);
      !st.ok()) {
    return st;
  }
  // Implied by the above; checked so that a planner change cannot make a
  // consumer write past the source's rows.
  if (layout.main_kv_offset != k.layout.main_kv_offset ||
      layout.total_rows != k.layout.total_rows) {
    return Differs(
        "main_kv_offset/total_rows",
        absl::StrCat(layout.main_kv_offset, "/", layout.total_rows),
        absl::StrCat(k.layout.main_kv_offset, "/", k.layout.total_rows), s);
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
