#include "planner/plan_builder.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

// A broken REQUIRES of the constructor is a programming error, not input.
void CheckSource(int32_t source_block_size, int32_t num_blocks) {
  if (source_block_size <= 0 || num_blocks <= 0) {
    std::fprintf(stderr,
                 "BlockLoadPlanBuilder: source_block_size = %d and "
                 "num_blocks = %d must be positive\n",
                 source_block_size, num_blocks);
    std::abort();
  }
}

absl::Status BadRange(absl::string_view what, int32_t t0, int32_t t1) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, " [", t0, ", ", t1, ") is not a range with 0 <= ", "begin <= end"));
}

}  // namespace

BlockLoadPlanBuilder::BlockLoadPlanBuilder(int32_t source_block_size,
                                           int32_t num_blocks)
    : block_size_(source_block_size),
      num_blocks_(num_blocks),
      total_k_(0),
      finished_(false) {
  CheckSource(source_block_size, num_blocks);
}

void BlockLoadPlanBuilder::Reset() {
  segments_.clear();
  total_k_ = 0;
  finished_ = false;
}

void BlockLoadPlanBuilder::Reset(int32_t source_block_size,
                                 int32_t num_blocks) {
  CheckSource(source_block_size, num_blocks);
  block_size_ = source_block_size;
  num_blocks_ = num_blocks;
  Reset();
}

void BlockLoadPlanBuilder::Reserve(int64_t num_segments) {
  if (num_segments <= 0) return;
  segments_.reserve(static_cast<size_t>(num_segments) * kSegmentFields);
}

int32_t* BlockLoadPlanBuilder::Grow(int64_t num_segments) {
  const size_t old_size = segments_.size();
  segments_.resize(old_size + num_segments * kSegmentFields);
  return segments_.data() + old_size;
}

void BlockLoadPlanBuilder::Push(int32_t block, int32_t begin, int32_t end) {
  int32_t* s = Grow(1);
  s[0] = block;
  s[1] = begin;
  s[2] = end;
  s[3] = total_k_;
  total_k_ += end - begin;
}

absl::Status BlockLoadPlanBuilder::CheckRoom(int64_t rows) const {
  if (finished_) {
    return absl::FailedPreconditionError(
        "BlockLoadPlanBuilder: append after Finish() without Reset()");
  }
  if (total_k_ + rows > kMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan would hold ", total_k_ + rows,
                     " rows, more than the int32 limit ", kMaxRows));
  }
  return absl::OkStatus();
}

absl::Status BlockLoadPlanBuilder::AppendSegment(int32_t block, int32_t begin,
                                                 int32_t end) {
  if (block < -1 || block >= num_blocks_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "src_block_id = ", block, " is outside [-1, ", num_blocks_, ")"));
  }
  if (begin < 0 || begin > end || end > block_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment [", begin, ", ", end,
                     ") is not inside a block of ", block_size_, " tokens"));
  }
  absl::Status room = CheckRoom(end - begin);
  if (!room.ok()) return room;
  Push(block, begin, end);
  return absl::OkStatus();
}

absl::Status BlockLoadPlanBuilder::AppendZeroFill(int32_t num_tokens) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("zero fill of ", num_tokens, " tokens is negative"));
  }
  absl::Status room = CheckRoom(num_tokens);
  if (!room.ok()) return room;
  while (num_tokens > 0) {
    const int32_t len = std::min(num_tokens, block_size_);
    Push(-1, 0, len);
    num_tokens -= len;
  }
  return absl::OkStatus();
}

absl::Status BlockLoadPlanBuilder::AppendPagedRange(
    absl::Span<const int32_t> block_table, int32_t t0, int32_t t1) {
  if (t0 < 0 || t0 > t1) return BadRange("paged range", t0, t1);
  const int64_t capacity =
      static_cast<int64_t>(block_table.size()) * block_size_;
  if (t1 > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged range ends at token ", t1, " but the block table holds ",
        block_table.size(), " blocks of ", block_size_, " tokens"));
  }
  absl::Status room = CheckRoom(t1 - t0);
  if (!room.ok()) return room;
  if (t0 == t1) return absl::OkStatus();
  const int32_t first = t0 / block_size_;
  const int32_t last = (t1 - 1) / block_size_;
  // Written in place (first block from t0 % B, full blocks, last block up
  // to t1), checking each entry; a bad one undoes the whole range.
  const size_t old_size = segments_.size();
  int32_t* s = Grow(last - first + 1);
  int32_t dst = total_k_;
  int32_t begin = t0 - first * block_size_;
  for (int32_t i = first; i <= last; ++i, s += kSegmentFields) {
    const int32_t id = block_table[i];
    if (id < 0 || id >= num_blocks_) {
      segments_.resize(old_size);
      return absl::InvalidArgumentError(absl::StrCat(
          "block_table[", i, "] = ", id, " is outside [0, ", num_blocks_, ")"));
    }
    const int32_t end = i == last ? t1 - i * block_size_ : block_size_;
    s[0] = id;
    s[1] = begin;
    s[2] = end;
    s[3] = dst;
    dst += end - begin;
    begin = 0;
  }
  total_k_ = dst;
  return absl::OkStatus();
}

absl::Status BlockLoadPlanBuilder::AppendRingRange(int32_t state_id, int32_t t0,
                                                   int32_t t1) {
  if (state_id < 0 || state_id >= num_blocks_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state_id = ", state_id, " is outside [0, ", num_blocks_, ")"));
  }
  if (t0 < 0 || t0 > t1) return BadRange("ring range", t0, t1);
  const int32_t len = t1 - t0;
  if (len > block_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring range [", t0, ", ", t1, ") holds ", len,
                     " positions, more than the ring size ", block_size_));
  }
  absl::Status room = CheckRoom(len);
  if (!room.ok()) return room;
  if (len == 0) return absl::OkStatus();
  const int32_t begin = t0 % block_size_;
  const int32_t first_len = std::min(len, block_size_ - begin);
  Push(state_id, begin, begin + first_len);
  if (first_len < len) Push(state_id, 0, len - first_len);
  return absl::OkStatus();
}

absl::Span<const int32_t> BlockLoadPlanBuilder::Finish() {
  finished_ = true;
  return segments_;
}

}  // namespace kvdepot
