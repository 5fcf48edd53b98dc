// The daemon's own kernels of the step path (host-only header: no CUDA
// syntax; streams travel as opaque pointers). Everything they read from
// the worker (the doorbell's step-id word, top-k indices) is untrusted and
// checked in the kernel; host-built metadata comes validated.
#ifndef KVDEPOT_SERVER_STEP_STEP_KERNELS_H_
#define KVDEPOT_SERVER_STEP_STEP_KERNELS_H_

#include <cstdint>

namespace kvdepot::step::device {

// The phase gate, one block: open (gate[0] stays 1) when the doorbell's
// step-id word equals `expected_step` and its cancel word is 0 and the gate
// was open; else gate[0] = 0, the status word gets kStatusStepMismatch /
// kStatusCancelled and the step's slot arrays (slots0 and slots2 [n],
// slots1 [n1]: the compressed sections, contiguous; null = none) are
// filled with -1 so the stores that follow write nothing.
//   doorbell: the region's base (proto/step_doorbell.h words)
//   stamp:    null, or where the GPU's global timer (ns) is written as the
//             gate starts (a timed step's phase start)
// Returns the launch's cudaError_t as int.
int LaunchGate(uint64_t* doorbell, uint64_t expected_step, int32_t* gate,
               int32_t* slots0, int32_t* slots1, int32_t* slots2, int32_t n,
               int64_t n1, uint64_t* stamp, void* stream);

// One thread writes the GPU's global timer (ns) to *at once the work
// before it on the stream finished (a timed step's phase end).
int LaunchStamp(uint64_t* at, void* stream);

// convert_topk of one layer (SPEC §7, planner ConvertTopk semantics) from
// the worker's top-k rows into its index rows, when gate[0] is 1:
//   topk:       [rows] rows of k int32 logical indices, topk_stride apart
//   out:        [rows] rows of k int32 slots, out_stride apart (int32s)
//   row_seq:    [rows] sequence of each row; seq_lens: [seqs] seqlen_k
//   block_tables: [seqs] rows of >= cols int32 block ids, table_stride
//               int32s apart (the step's blob: cols; the worker's
//               device-resident tables: its registered row stride); only
//               columns [0, cols) are read. Untrusted when the worker's.
// Per row: n = seq_lens[seq] / ratio, valid = min(k, n); column c >= valid
// is -1; an entry x < 0, x >= n, x / block_size >= cols or a table entry
// outside [0, num_blocks) is -1 and counted into the doorbell's
// out-of-range word (and kStatusOutOfRange).
int LaunchConvertTopk(const int32_t* gate, const int32_t* topk,
                      int64_t topk_stride, int32_t* out, int64_t out_stride,
                      int32_t rows, int32_t k, const int32_t* row_seq,
                      const int32_t* seq_lens, int32_t ratio,
                      const int32_t* block_tables, int64_t table_stride,
                      int32_t cols, int32_t block_size, int32_t num_blocks,
                      uint64_t* doorbell, void* stream, bool pdl = false);

// Rows of a step's slot mappings: the main one and one per compressed
// ratio (at most 8, step_config.h's kMaxCompressedRatios).
inline constexpr int kMaxSlotRows = 9;

// Device-resident slot mappings (RegisterWorkerRequest.slot_mappings),
// imported into the step's blob once per step, after the daemon's stream
// passed the worker's A_0 flag and its gate. Shapes in int32 elements.
struct SlotImport {
  // [rows][>= n] the worker's rows, src_stride apart: row 0 = the main
  // mapping, row 1 + k = compressed ratio k's. Untrusted: -1 = no store.
  const int32_t* src = nullptr;
  int64_t src_stride = 0;
  int32_t* main = nullptr;        // [n] the blob's slots section
  int32_t* compressed = nullptr;  // [rows - 1][compressed_stride]; null
  int64_t compressed_stride = 0;  // when rows == 1
  int32_t rows = 0;               // 1 + compressed ratios, <= kMaxSlotRows
  int32_t n = 0;                  // the step's tokens
  // Per row: the smallest num_blocks * block_size of the pools it is
  // stored into; 0 = none (the row is not read, its section is -1).
  int64_t capacity[kMaxSlotRows] = {};
};

// Copies entries [0, n) of every row into its blob section when gate[0]
// is 1 (else writes -1, as the gate does): an entry outside [-1,
// capacity) becomes -1 and is counted into the doorbell's out-of-range
// word (and kStatusOutOfRange), as convert_topk counts its entries.
int LaunchSlotImport(const int32_t* gate, const SlotImport& import,
                     uint64_t* doorbell, void* stream, bool pdl = false);

// With pdl (the kernels below follow the gate kernel on the stream) the
// launch carries Programmatic Dependent Launch: the kernel may start while
// the gate drains and waits for it (griddepcontrol.wait) before reading.

// SWA decode index (SPEC §7) when gate[0] is 1: row r of out (out_stride
// int32s apart) = state[r] * ring + (start[r] + i) % ring for i <
// valid[r], -1 up to window.
int LaunchSwaIndex(const int32_t* gate, const int32_t* state,
                   const int32_t* start, const int32_t* valid, int32_t rows,
                   int32_t window, int32_t ring, int32_t* out,
                   int64_t out_stride, void* stream, bool pdl = false);

}  // namespace kvdepot::step::device

#endif  // KVDEPOT_SERVER_STEP_STEP_KERNELS_H_
