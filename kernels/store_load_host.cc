// The store and load contract on the host (SPEC §4, §5): output row sizes
// and the validation of every untrusted input, before anything is written.
// Duplicate slots and overlapping destinations are found in O(n) (a bitmap
// when the pool is small relative to n; destinations already in ascending
// order) or O(n log n) (a sort), with at most one scratch vector per call.
#include "kernels/store_load_host.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/store_load.h"

namespace kvdepot {
namespace {

// A pool this many times larger than the slot count (in bits) is checked by
// sorting instead of with a bitmap.
constexpr int64_t kBitmapSlotsPerToken = 64;
constexpr int64_t kMinBitmapSlots = int64_t{1} << 18;

absl::Status DuplicateError(absl::Span<const int32_t> slots, int64_t i) {
  int64_t first = 0;
  while (slots[first] != slots[i]) ++first;
  return absl::InvalidArgumentError(
      absl::StrCat("slot_mapping[", i, "] = ", slots[i],
                   " duplicates slot_mapping[", first, "]"));
}

// The quantized_dtype / sf_format pairs SPEC §3 (and §2.1, pow2_ceil)
// define math for.
bool HasQuantizationMath(const KVCacheFormat& f) {
  using Q = QuantDtype;
  using S = ScaleFormat;
  if (f.scale_rounding == ScaleRounding::kPow2Ceil) {
    return f.quantized_dtype == Q::kE4M3 && f.sf_format == S::kFP32;
  }
  return (f.quantized_dtype == Q::kE4M3 && f.sf_format == S::kUE8M0) ||
         (f.quantized_dtype == Q::kE2M1 && f.sf_format == S::kUE8M0) ||
         (f.quantized_dtype == Q::kE2M1 && f.sf_format == S::kE4M3) ||
         (f.quantized_dtype == Q::kE4M3 && f.sf_format == S::kFP32);
}

}  // namespace

int64_t LoadDataRowBytes(const KVCacheFormat& format) {
  return format.do_cast && format.quantized() ? 2 * int64_t{format.elements()}
                                              : format.data_bytes();
}

int64_t LoadScaleRowBytes(const KVCacheFormat& format) {
  return format.do_cast ? 0 : RoundUp(format.sf_bytes(), 4);
}

absl::Status ValidateQuantization(const KVCacheFormat& f) {
  RETURN_IF_ERROR(ValidateFormat(f));
  if (f.quantized() && !HasQuantizationMath(f)) {
    return absl::UnimplementedError(absl::StrCat(
        "no quantization math for ", QuantDtypeName(f.quantized_dtype),
        " data with ", ScaleFormatName(f.sf_format),
        " scales (SPEC §3 defines e4m3+ue8m0, e2m1+ue8m0, e2m1+e4m3, "
        "e4m3+fp32; SPEC §2.1 e4m3+fp32 pow2_ceil)"));
  }
  if (f.quantized() && f.bf16_elements > 0 &&
      f.scale_rounding != ScaleRounding::kPow2Ceil) {
    return absl::UnimplementedError(absl::StrCat(
        "a BF16 tail is implemented only for e4m3+fp32 pow2_ceil records "
        "(SPEC §2.1), not for ",
        QuantDtypeName(f.quantized_dtype), "+", ScaleFormatName(f.sf_format),
        " with scale_rounding none"));
  }
  return absl::OkStatus();
}

bool TakesBf16InputOnly(const KVCacheFormat& f) {
  return f.quantized() &&
         (f.scale_rounding == ScaleRounding::kPow2Ceil || f.bf16_elements > 0);
}

absl::Status ValidateInputDtype(const KVCacheFormat& f, InputDtype dtype) {
  if (dtype != InputDtype::kBF16 && dtype != InputDtype::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype = ", static_cast<int>(dtype),
                     " is neither BF16 (0) nor FP32 (1)"));
  }
  if (dtype == InputDtype::kFP32 && TakesBf16InputOnly(f)) {
    const absl::StatusOr<std::string> name = FormatName(f);
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype = FP32: format ", name.ok() ? *name : std::string("(custom)"),
        " takes BF16 input only (SPEC §2.1: its math and its BF16 tail are "
        "defined on BF16 values)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSlotMapping(const PoolLayout& layout,
                                 absl::Span<const int32_t> slots) {
  const int64_t num_slots = layout.num_slots();
  const int64_t n = static_cast<int64_t>(slots.size());
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < -1 || slots[i] >= num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot_mapping[", i, "] = ", slots[i],
                       " is outside [-1, ", num_slots, ")"));
    }
  }
  if (n < 2) return absl::OkStatus();
  if (num_slots <= std::max(kMinBitmapSlots, kBitmapSlotsPerToken * n)) {
    std::vector<uint64_t> seen((num_slots + 63) / 64, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (slots[i] < 0) continue;
      const uint64_t bit = uint64_t{1} << (slots[i] & 63);
      uint64_t& word = seen[slots[i] >> 6];
      if (word & bit) return DuplicateError(slots, i);
      word |= bit;
    }
    return absl::OkStatus();
  }
  // key = slot << 32 | index: sorted, equal slots are adjacent and in index
  // order. Report the smallest index that repeats an earlier slot.
  std::vector<uint64_t> keys;
  keys.reserve(slots.size());
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) {
      keys.push_back(static_cast<uint64_t>(slots[i]) << 32 |
                     static_cast<uint64_t>(i));
    }
  }
  std::sort(keys.begin(), keys.end());
  int64_t worst = -1;
  for (size_t k = 1; k < keys.size(); ++k) {
    if ((keys[k] >> 32) != (keys[k - 1] >> 32)) continue;
    const int64_t i = static_cast<int64_t>(keys[k] & 0xFFFFFFFFu);
    if (worst < 0 || i < worst) worst = i;
  }
  if (worst >= 0) return DuplicateError(slots, worst);
  return absl::OkStatus();
}

absl::Status ValidateSegments(const PoolLayout& layout,
                              absl::Span<const int32_t> segments,
                              int64_t total_k) {
  if (segments.size() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("segments.size() = ", segments.size(),
                     " is not a multiple of 4 ({src_block_id, src_begin, "
                     "src_end, dst_offset} per segment)"));
  }
  if (total_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("total_k = ", total_k, " is negative"));
  }
  const int64_t num_segments = static_cast<int64_t>(segments.size() / 4);
  if (num_segments > int64_t{1} << 31) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segments holds ", num_segments, " segments, more than 2^31"));
  }
  // Whether the non-empty segments come with ascending dst_offsets (ties
  // in index order), as the daemon's plans and decode steps do: then index
  // order is the sorted order the overlap check needs, with no sort.
  bool ascending = true;
  int64_t last_dst = -1;
  for (int64_t s = 0; s < num_segments; ++s) {
    const Segment seg = SegmentAt(segments.data(), s);
    const int64_t block = seg.block, begin = seg.begin, end = seg.end,
                  dst = seg.dst;
    if (block < -1 || block >= layout.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments[", s, "].src_block_id = ", block,
                       " is outside [-1, ", layout.num_blocks, ")"));
    }
    if (begin < 0 || begin > layout.block_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments[", s, "].src_begin = ", begin,
                       " is outside [0, ", layout.block_size, "]"));
    }
    if (end < begin || end > layout.block_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segments[", s, "].src_end = ", end,
          " is outside [src_begin = ", begin, ", ", layout.block_size, "]"));
    }
    if (dst < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments[", s, "].dst_offset = ", dst, " is negative"));
    }
    if (dst + (end - begin) > total_k) {
      return absl::InvalidArgumentError(
          absl::StrCat("segments[", s, "] writes rows [", dst, ", ",
                       dst + (end - begin), ") beyond total_k = ", total_k));
    }
    if (end > begin) {
      ascending = ascending && dst >= last_dst;
      last_dst = dst;
    }
  }
  // Overlap: visit the non-empty destination ranges by start (key = dst <<
  // 32 | segment index) and compare each with the furthest reach so far.
  int64_t reach = -1;     // end of the furthest-reaching range so far
  int64_t reach_by = -1;  // the segment that reaches it
  auto visit = [&](int64_t s) -> absl::Status {
    const Segment seg = SegmentAt(segments.data(), s);
    const int64_t dst = seg.dst, end = dst + seg.len();
    if (dst < reach) {
      const Segment other = SegmentAt(segments.data(), reach_by);
      return absl::InvalidArgumentError(absl::StrCat(
          "segments[", s, "] writes rows [", dst, ", ", end,
          ") that overlap rows [", other.dst, ", ",
          int64_t{other.dst} + other.len(), ") of segments[", reach_by, "]"));
    }
    reach = end;
    reach_by = s;
    return absl::OkStatus();
  };
  if (ascending) {
    // Already in key order: one pass, no scratch vector, no sort (a
    // request-sized allocation and an O(n log n) sort saved per Load).
    for (int64_t s = 0; s < num_segments; ++s) {
      const Segment seg = SegmentAt(segments.data(), s);
      if (seg.end > seg.begin) RETURN_IF_ERROR(visit(s));
    }
    return absl::OkStatus();
  }
  std::vector<uint64_t> keys;
  keys.reserve(num_segments);
  for (int64_t s = 0; s < num_segments; ++s) {
    const Segment seg = SegmentAt(segments.data(), s);
    if (seg.end > seg.begin) {
      keys.push_back(static_cast<uint64_t>(seg.dst) << 32 |
                     static_cast<uint64_t>(s));
    }
  }
  std::sort(keys.begin(), keys.end());
  for (uint64_t key : keys) {
    RETURN_IF_ERROR(visit(static_cast<int64_t>(key & 0xFFFFFFFFu)));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
