// The device-side checks of library mode (SPEC §9) behind a host-only
// header: inputs that live in device memory are copied into the caller's
// workspace with every out-of-range entry replaced by a harmless value and
// counted into *invalid (device; may be null). The daemon's kernels then
// run on the copies. Every function only enqueues one kernel on `stream`
// (a cudaStream_t) and returns its launch's cudaError_t (0 = success);
// n = 0 launches nothing.
#ifndef KVDEPOT_LIBKVDEPOT_DEVICE_CHECKS_H_
#define KVDEPOT_LIBKVDEPOT_DEVICE_CHECKS_H_

#include <cstdint>

namespace kvdepot::capi::device {

// out[i] = in[i] when in[i] is in [-1, hi), else -1 (counted).
//   in, out: [n] int32
int CheckIndices(const int32_t* in, int64_t n, int64_t hi, int32_t* out,
                 unsigned long long* invalid, void* stream);

// Segments {block, begin, end, dst} (SPEC §5): a segment with block outside
// [-1, num_blocks), not 0 <= begin <= end <= block_size, dst < 0 or
// dst + end - begin > total_k becomes {-1, 0, 0, 0} (writes nothing).
//   in, out: [num_segments][4] int32
int CheckSegments(const int32_t* in, int64_t num_segments, int64_t num_blocks,
                  int64_t block_size, int64_t total_k, int32_t* out,
                  unsigned long long* invalid, void* stream);

// Fused store inputs: slots_out[i] = slots[i] when in [-1, num_slots) and,
// with positions (may be null: no RoPE), positions[i] is in
// [0, max_position); otherwise slots_out[i] = -1 and positions_out[i] = 0
// (counted once per token). positions_out is written when positions is.
int CheckFusedInputs(const int32_t* slots, const int64_t* positions, int64_t n,
                     int64_t num_slots, int64_t max_position,
                     int32_t* slots_out, int64_t* positions_out,
                     unsigned long long* invalid, void* stream);

// SWA decode queries: a query with state outside [0, num_states), start < 0
// or valid_len outside [0, window] becomes {0, 0, 0} (an all -1 row).
//   state_ids, starts, valid_lens: [n]; out: three arrays of [n] back to
//   back (states, starts, valid_lens)
int CheckSwaQueries(const int32_t* state_ids, const int32_t* starts,
                    const int32_t* valid_lens, int64_t n, int64_t num_states,
                    int32_t window, int32_t* out, unsigned long long* invalid,
                    void* stream);

// Prefill pivots {off1, len1, off2, len2}: a row with a negative length,
// len1 + len2 > width, or a range outside [0, num_kv_rows) becomes
// {0, 0, 0, 0} (an all -1 row).
//   in, out: [rows][4] int32
int CheckPivots(const int32_t* in, int64_t rows, int32_t width,
                int32_t num_kv_rows, int32_t* out, unsigned long long* invalid,
                void* stream);

}  // namespace kvdepot::capi::device

#endif  // KVDEPOT_LIBKVDEPOT_DEVICE_CHECKS_H_
