#include "planner/index_ops.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "planner/batch.h"

namespace kvdepot {
namespace {

// Checks one pivot range [off, off + len) of row `row`.
absl::Status CheckPivotRange(int64_t row, int which, int32_t off, int32_t len,
                             int32_t num_kv_rows) {
  if (len < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pivots[", row, "].len", which, " = ", len, " is negative"));
  }
  if (len > 0 && (off < 0 || static_cast<int64_t>(off) + len > num_kv_rows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pivots[", row, "] range ", which, " [", off, ", ",
                     static_cast<int64_t>(off) + len, ") is outside [0, ",
                     num_kv_rows, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ExpandSwaIndex(absl::Span<const int32_t> pivots, int32_t width,
                            int32_t num_kv_rows, absl::Span<int32_t> out) {
  if (width <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("width = ", width, " must be positive"));
  }
  if (num_kv_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_rows = ", num_kv_rows, " is negative"));
  }
  if (pivots.size() % kPivotFields != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pivots has ", pivots.size(), " entries, not a multiple of 4"));
  }
  const int64_t rows = pivots.size() / kPivotFields;
  absl::Status s = CheckSize("out", out.size(), rows * width);
  if (!s.ok()) return s;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* p = &pivots[r * kPivotFields];
    s = CheckPivotRange(r, 1, p[0], p[1], num_kv_rows);
    if (!s.ok()) return s;
    s = CheckPivotRange(r, 2, p[2], p[3], num_kv_rows);
    if (!s.ok()) return s;
    if (static_cast<int64_t>(p[1]) + p[3] > width) {
      return absl::InvalidArgumentError(
          absl::StrCat("pivots[", r, "] lengths ", p[1], " + ", p[3],
                       " exceed the width ", width));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* p = &pivots[r * kPivotFields];
    int32_t* row = &out[r * width];
    for (int32_t c = 0; c < p[1]; ++c) row[c] = p[0] + c;
    int32_t* second = row + p[1];
    for (int32_t c = 0; c < p[3]; ++c) second[c] = p[2] + c;
    std::fill(second + p[3], row + width, -1);
  }
  return absl::OkStatus();
}

absl::Status KvIndexCat(absl::Span<const int32_t> swa_index, int32_t swa_width,
                        absl::Span<const int32_t> compressed_index,
                        int32_t compressed_width, int64_t rows,
                        int32_t main_kv_offset, int32_t compressed_rows,
                        absl::Span<int32_t> out) {
  if (swa_width < 0 || compressed_width < 0 || rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swa_width = ", swa_width, ", compressed_width = ", compressed_width,
        " and rows = ", rows, " must not be negative"));
  }
  // Bounded before the size products below (rows * width fits int64).
  if (rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows = ", rows, " exceeds the int32 row range"));
  }
  if (main_kv_offset < 0 || compressed_rows < 0 ||
      static_cast<int64_t>(main_kv_offset) + compressed_rows >
          std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "main_kv_offset = ", main_kv_offset, " plus compressed_rows = ",
        compressed_rows, " is outside the int32 row range"));
  }
  absl::Status s = CheckSize("swa_index", swa_index.size(), rows * swa_width);
  if (!s.ok()) return s;
  s = CheckSize("compressed_index", compressed_index.size(),
                rows * compressed_width);
  if (!s.ok()) return s;
  const int64_t width = static_cast<int64_t>(swa_width) + compressed_width;
  s = CheckSize("out", out.size(), rows * width);
  if (!s.ok()) return s;
  // Nothing to write: do not spend O(rows) on empty rows (2^31 of them
  // took seconds; found by //tests/fuzz:index_fuzz as a timeout).
  if (width == 0) return absl::OkStatus();
  for (int64_t i = 0; i < static_cast<int64_t>(swa_index.size()); ++i) {
    const int32_t x = swa_index[i];
    if (x < -1 || x >= main_kv_offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("swa_index[", i / swa_width, "][", i % swa_width,
                       "] = ", x, " is outside [-1, ", main_kv_offset, ")"));
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(compressed_index.size()); ++i) {
    const int32_t x = compressed_index[i];
    if (x < -1 || x >= compressed_rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "compressed_index[", i / compressed_width, "][", i % compressed_width,
          "] = ", x, " is outside [-1, ", compressed_rows, ")"));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    // data() + offset: with width 0 the span is empty and has no element 0.
    int32_t* row = out.data() + r * width;
    const int32_t* swa = swa_index.data() + r * swa_width;
    std::copy(swa, swa + swa_width, row);
    const int32_t* comp = compressed_index.data() + r * compressed_width;
    int32_t* dst = row + swa_width;
    for (int32_t c = 0; c < compressed_width; ++c) {
      dst[c] = comp[c] == -1 ? -1 : comp[c] + main_kv_offset;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
