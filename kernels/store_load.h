// The store and load contract types (SPEC §4, §5) that the CUDA kernels
// compile too: the input element type of a store and one segment of a load
// plan. Like format.h this header is constexpr only and usable from device
// code; the row sizes and the validators are in store_load_host.h.
//
// A load plan is segments[S][4] int32, on the wire and in memory an array of
// Segment (16 bytes each):
//
//   +--------------+-----------+---------+------------+
//   | src_block_id | src_begin | src_end | dst_offset |   int32 x 4
//   +--------------+-----------+---------+------------+
//
// tokens [src_begin, src_end) of the block go to output rows dst_offset...;
// block -1 writes zero rows.
#ifndef KVDEPOT_KERNELS_STORE_LOAD_H_
#define KVDEPOT_KERNELS_STORE_LOAD_H_

#include <cstdint>
#include <type_traits>

#include "kernels/host_device.h"

namespace kvdepot {

// Element type of the K/V handed to a store.
enum class InputDtype : uint8_t {
  kBF16 = 0,  // uint16_t bit patterns
  kFP32 = 1,  // float (tests, tools)
};

// One segment of a load plan. Not validated: see ValidateSegments.
struct Segment {
  int32_t block;  // src_block_id; -1 = write zero rows
  int32_t begin;  // src_begin: first token in the block
  int32_t end;    // src_end: one past the last token
  int32_t dst;    // dst_offset: output row of token `begin`

  // Tokens (output rows) of the segment.
  KV_HD constexpr int32_t len() const { return end - begin; }
};

// Int32 fields per segment in a flattened plan.
inline constexpr int kSegmentFields = 4;
static_assert(sizeof(Segment) == kSegmentFields * sizeof(int32_t) &&
                  std::is_standard_layout_v<Segment>,
              "segments[S][4] int32 is an array of Segment");

// Segment `index` of a flattened plan [S][4].
KV_HD constexpr Segment SegmentAt(const int32_t* segments, int64_t index) {
  const int32_t* s = segments + kSegmentFields * index;
  return {s[0], s[1], s[2], s[3]};
}

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_STORE_LOAD_H_
