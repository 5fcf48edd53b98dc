// BlockLoadPlanBuilder: accumulates a segment-load plan (SPEC §5, §6).
//
// A plan is segments[S][4] int32, flattened row-major (an array of the
// contract's Segment, kernels/store_load.h):
//
//   +--------------+-----------+---------+------------+
//   | src_block_id | src_begin | src_end | dst_offset |   one segment
//   +--------------+-----------+---------+------------+
//
// Segment s copies tokens [src_begin, src_end) of physical block src_block_id
// to output rows [dst_offset, dst_offset + src_end - src_begin);
// src_block_id = -1 writes zero rows. The builder places segments back to
// back: each one starts at the current total_k, so the plan covers rows
// [0, total_k) exactly once and in order.
//
// Every Append* validates its arguments and is all-or-nothing: on error the
// builder is unchanged. The segment vector keeps its capacity across Reset(),
// so a reused builder does not allocate once it has grown to the batch size.
#ifndef KVDEPOT_PLANNER_PLAN_BUILDER_H_
#define KVDEPOT_PLANNER_PLAN_BUILDER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/store_load.h"  // Segment, kSegmentFields

namespace kvdepot {

class BlockLoadPlanBuilder {
 public:
  // REQUIRES: source_block_size > 0 (tokens per physical block, or the ring
  // size for SWA); num_blocks > 0 (pool blocks, or ring states).
  BlockLoadPlanBuilder(int32_t source_block_size, int32_t num_blocks);

  BlockLoadPlanBuilder(const BlockLoadPlanBuilder&) = delete;
  BlockLoadPlanBuilder& operator=(const BlockLoadPlanBuilder&) = delete;

  // Forgets all segments (keeping the allocated capacity) so the builder can
  // start a new plan; the second form also switches the source pool.
  // REQUIRES (second form): as for the constructor.
  void Reset();
  void Reset(int32_t source_block_size, int32_t num_blocks);

  // Ensures room for `num_segments` segments without reallocating.
  void Reserve(int64_t num_segments);

  // Appends tokens [begin, end) of `block` (-1 = zeros).
  // REQUIRES: Finish() not called since the last Reset().
  // Errors: block outside [-1, num_blocks), 0 <= begin <= end <= block size
  // violated, or total_k would exceed INT32_MAX.
  absl::Status AppendSegment(int32_t block, int32_t begin, int32_t end);

  // Appends `num_tokens` zero rows as -1 segments of at most one block each.
  // Errors: num_tokens < 0, or total_k overflow.
  absl::Status AppendZeroFill(int32_t num_tokens);

  // Appends logical tokens [t0, t1) of a paged sequence, cutting a segment
  // at every block boundary; token t lives in block_table[t / B] at t % B.
  //   block_table: [num_entries] physical block ids of the sequence.
  // Errors: t0 < 0, t0 > t1, t1 > block_table.size() * B, an entry read that
  // is outside [0, num_blocks), or total_k overflow.
  absl::Status AppendPagedRange(absl::Span<const int32_t> block_table,
                                int32_t t0, int32_t t1);

  // Appends positions [t0, t1) of the ring `state_id` (one block of B
  // slots; position t lives at t % B): at most two segments, cut at the wrap.
  // Errors: state_id outside [0, num_blocks), t0 < 0, t0 > t1,
  // t1 - t0 > B, or total_k overflow.
  absl::Status AppendRingRange(int32_t state_id, int32_t t0, int32_t t1);

  // Marks the plan complete and returns it: [num_segments][4] flattened.
  // The span stays valid until the next Reset() or destruction.
  absl::Span<const int32_t> Finish();

  // The segments so far ([num_segments][4] flattened), Finish() or not.
  absl::Span<const int32_t> segments() const { return segments_; }
  int64_t num_segments() const {
    return static_cast<int64_t>(segments_.size()) / kSegmentFields;
  }
  // Rows covered so far: the dst_offset of the next segment.
  int32_t total_k() const { return total_k_; }
  int32_t source_block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  bool finished() const { return finished_; }
  // The bytes the segment vector holds allocated (it keeps them across
  // Reset()).
  int64_t capacity_bytes() const {
    return static_cast<int64_t>(segments_.capacity() * sizeof(int32_t));
  }

 private:
  // Appends one segment; the caller has validated it.
  void Push(int32_t block, int32_t begin, int32_t end);
  // Adds room for `num_segments` segments at the end; returns the first.
  int32_t* Grow(int64_t num_segments);
  // OK when `rows` more rows keep total_k within int32 and Finish() has not
  // been called.
  absl::Status CheckRoom(int64_t rows) const;

  int32_t block_size_;             // tokens per source block (B)
  int32_t num_blocks_;             // source block ids are < num_blocks_
  std::vector<int32_t> segments_;  // [num_segments][4] flattened
  int32_t total_k_;                // rows covered; next dst_offset
  bool finished_;                  // Finish() called since the last Reset()
};

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_PLAN_BUILDER_H_
