// Decoding and sanity checks of one stored token record, for the Inspect
// and Verify RPCs. Pure functions over host bytes (a block copied out of
// the pool), so they are unit-tested without a daemon.
#ifndef KVDEPOT_SERVER_RECORD_CHECK_H_
#define KVDEPOT_SERVER_RECORD_CHECK_H_

#include <cstdint>
#include <string>

#include "kernels/format.h"

namespace kvdepot {

struct RecordHealth {
  int64_t bad_scales = 0;  // UE8M0 255, NaN or negative E4M3 / FP32
  int64_t nan_values = 0;  // among the dequantized elements
  int64_t inf_values = 0;
  int first_bad_scale = -1;  // index of the first bad scale, -1 = none
  bool all_zero = true;      // every data and scale byte is 0
  bool ok() const {
    return bad_scales == 0 && nan_values == 0 && inf_values == 0;
  }
};

// Whether scale byte(s) `sf` (ScaleBytes(format) bytes) can come out of an
// encoder: UE8M0 255 cannot (Inf), nor a NaN or negative E4M3 or FP32
// scale (nor an FP32 infinity).
bool ScaleIsPossible(ScaleFormat format, const uint8_t* sf);

// A DS_MLA_FP8 (pow2_ceil) scale: 2^e with e in [-13, 121] (SPEC §2.1
// floors amax / 448 at 1e-4), or the NaN / Inf tile markers.
bool Pow2ScaleIsPossible(const uint8_t* sf);

// The fp32 value of one scale.
float ScaleValue(ScaleFormat format, const uint8_t* sf);

// Checks token `t` of a block whose block_stride bytes are at `block`
// (layout offsets relative to the block start). `values` is scratch of
// layout.format.elements() floats and receives the dequantized values
// (BF16 records: the BF16 values).
RecordHealth CheckRecord(const PoolLayout& layout, const uint8_t* block,
                         int64_t t, float* values);

// "slot 17: UE8M0 scale[0] = 255 (no encoder writes it)" style text of
// the first problem of a record.
std::string DescribeProblem(const PoolLayout& layout, const uint8_t* block,
                            int64_t t, int64_t slot, const RecordHealth& h);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_RECORD_CHECK_H_
