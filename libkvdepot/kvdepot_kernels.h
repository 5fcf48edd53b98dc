/* Library mode (docs/LIBRARY_MODE.md): kvdepot's own kernels in the
 * caller's process, on the caller's memory and stream, as a stable C ABI:
 * libkvdepot_kernels.so for C, C++ and Python (ctypes). The bytes written
 * are the daemon's bytes: the CPU entry points (*_cpu) run the CPU
 * reference the daemon's CPU backend runs (kernels/reference, planner/),
 * the CUDA entry points (*_cuda) the launchers of the daemon's CUDA
 * backend (kernels/cuda).
 *
 * Layouts. A kvdk_layout is a validated format plus pool geometry, built
 * exactly as the daemon builds a pool (SPEC §2): kvdk_layout_get_info
 * returns the strides and sizes, which a caller can compare field by field
 * with the daemon's PoolInfo.layout. A pool is num_layers regions of
 * layer_stride bytes; every data entry point takes the pool's base, the
 * number of bytes the caller owns from there (pool_bytes, checked to cover
 * the layer), and the layer index. A per-layer allocation is a layout with
 * num_layers = 1 and layer 0.
 *
 * Checks. Every argument is checked before anything is written or
 * launched; on failure nothing is written and the call returns a negative
 * KVDK_ERR_*, with kvdk_last_error() naming the argument and index, e.g.
 * "slot_mapping[17] = 9000 is outside [-1, 8192)". Nothing throws or
 * aborts.
 *   CPU: every array is host memory and is checked in full (slots in
 *     [-1, num_slots) and distinct, plan segments per SPEC §5, positions,
 *     index ranges), the same checks the daemon runs.
 *   CUDA: arrays are device memory and cannot be read on the host. Sizes,
 *     ranges, null pointers and alignment are checked on the host; the
 *     device arrays are checked on the device (SPEC §9) by a pass that
 *     copies them into the caller's workspace: an out-of-range entry
 *     becomes -1 (a slot, a top-k or index entry), an empty segment (a plan
 *     segment), an empty window (SWA decode) or a skipped token (a fused
 *     store position; that token's cast_back row is then unspecified), and
 *     is added to *invalid_count (device unsigned long long; may be NULL).
 *     Never an out-of-bounds access. Not detectable on the device:
 *     duplicate slots in one store and overlapping plan destinations (the
 *     bytes written there are then those of one of the writers).
 *
 * Streams. stream is a cudaStream_t (NULL = the legacy default stream;
 * torch: torch.cuda.current_stream().cuda_stream). Every CUDA entry point
 * only enqueues work (one checking pass, then the daemon's kernel) and
 * returns: no host synchronization, no allocation, capturable into a CUDA
 * graph. The workspace (kvdk_cuda_workspace_bytes bytes of 16-byte
 * aligned device memory) and the inputs must stay untouched until the
 * stream has run the work; one workspace per call in flight. *invalid_count
 * is only added to: zero it when you want a per-call count. Pointer
 * alignment (16 bytes for pools, K/V, load data, cast_back, norm weights;
 * 8 for positions; 4 for int32 arrays) is checked before anything is
 * enqueued; KVDK_ERR_CUDA (a launch failed) is the one error after which
 * the workspace and *invalid_count may have been written.
 *
 * Threads. Layouts are immutable: share them freely. Every entry point is
 * reentrant; kvdk_last_error() is per thread.
 *
 * Build. The CUDA runtime is linked statically and the driver is never
 * linked (no -lcuda): the library loads on machines without a GPU, where
 * every *_cuda call returns KVDK_ERR_CUDA (or KVDK_ERR_UNSUPPORTED when the
 * library was built without CUDA: kvdk_has_cuda() says which). Run with
 * CUDA_MODULE_LOADING=EAGER when kvdepot's step path shares the process.
 */
#ifndef KVDEPOT_LIBKVDEPOT_KVDEPOT_KERNELS_H_
#define KVDEPOT_LIBKVDEPOT_KVDEPOT_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVDK_ABI_VERSION 1

#define KVDK_OK 0
#define KVDK_ERR_INVALID (-1)     /* a bad argument; nothing written */
#define KVDK_ERR_CUDA (-3)        /* a CUDA call failed */
#define KVDK_ERR_UNSUPPORTED (-5) /* a format without math, or no CUDA */
#define KVDK_ERR_CAPACITY (-6)    /* an output array is too small */

/* kv element type of a store. */
#define KVDK_DTYPE_BF16 0 /* uint16 bit patterns */
#define KVDK_DTYPE_FP32 1 /* float (not for DS_MLA_FP8) */

/* Fused store RoPE styles (SPEC §8). */
#define KVDK_ROPE_NONE 0
#define KVDK_ROPE_NEOX 1        /* rotates (i, i + rope_dim / 2) */
#define KVDK_ROPE_INTERLEAVED 2 /* rotates (2i, 2i + 1) (DeepSeek MLA) */

/* Descriptor enums (SPEC §2), also reported by kvdk_layout_get_info. */
#define KVDK_QUANT_NONE 0
#define KVDK_QUANT_E4M3 1
#define KVDK_QUANT_E2M1 2
#define KVDK_SF_NONE 0
#define KVDK_SF_UE8M0 1
#define KVDK_SF_E4M3 2
#define KVDK_SF_FP32 3
#define KVDK_ROUNDING_NONE 0
#define KVDK_ROUNDING_POW2_CEIL 1

/* Operations, for kvdk_cuda_workspace_bytes. */
#define KVDK_OP_STORE 0            /* count = num_tokens */
#define KVDK_OP_LOAD 1             /* count = num_segments */
#define KVDK_OP_FUSED_STORE 2      /* count = num_tokens */
#define KVDK_OP_SWA_DECODE_INDEX 3 /* count = n (queries) */
#define KVDK_OP_EXPAND_SWA_INDEX 4 /* count = rows */
#define KVDK_OP_KV_INDEX_CAT 5     /* count = rows * (swa_w + compressed_w) */

typedef struct kvdk_layout kvdk_layout;

/* A format descriptor by fields (SPEC §2); enums as above, booleans 0/1. */
typedef struct kvdk_format_desc {
  int32_t quantized_dtype;    /* KVDK_QUANT_* */
  int32_t quantized_elements; /* logical elements */
  int32_t elements_per_sf;    /* group size */
  int32_t bf16_elements;      /* BF16 record, or the tail of DS_MLA_FP8 */
  int32_t do_cast;            /* load dequantizes to BF16 */
  int32_t sf_format;          /* KVDK_SF_* */
  int32_t token_interleaved;  /* [data | scales] per token */
  int32_t scale_rounding;     /* KVDK_ROUNDING_* */
} kvdk_format_desc;

/* Everything the daemon's PoolInfo.layout reports, and more; all int64. */
typedef struct kvdk_layout_info {
  int64_t quantized_dtype; /* KVDK_QUANT_* */
  int64_t quantized_elements;
  int64_t elements_per_sf;
  int64_t bf16_elements;
  int64_t elements; /* quantized_elements + bf16_elements */
  int64_t do_cast;
  int64_t sf_format; /* KVDK_SF_* */
  int64_t token_interleaved;
  int64_t scale_rounding; /* KVDK_ROUNDING_* */
  int64_t data_bytes;
  int64_t sf_bytes;
  int64_t bytes_per_token;
  int64_t block_size;
  int64_t num_blocks;
  int64_t num_layers;
  int64_t block_stride;
  int64_t layer_bytes;  /* num_blocks * block_stride */
  int64_t layer_stride; /* layer_bytes rounded up to 256 */
  int64_t total_bytes;  /* num_layers * layer_stride */
  int64_t load_data_row_bytes;
  int64_t load_scale_row_bytes; /* 0 for do_cast formats */
  int64_t num_slots;            /* num_blocks * block_size */
  /* Appended after ABI 1's first release; a caller built against the
   * shorter struct passes KVDK_LAYOUT_INFO_V1_BYTES and gets the fields
   * above only. */
  int64_t tail_bytes; /* a quantized record's BF16 tail (DS_MLA_FP8: 128) */
} kvdk_layout_info;

/* The size of kvdk_layout_info before tail_bytes: the least info_size. */
#define KVDK_LAYOUT_INFO_V1_BYTES 176

/* SPEC §8 parameters. Arrays are host memory for *_cpu, device memory for
 * *_cuda (norm_weight and cos_sin 16-byte aligned there). */
typedef struct kvdk_fused_params {
  int32_t norm_begin; /* RMSNorm over [norm_begin, norm_end); off if equal */
  int32_t norm_end;
  const uint16_t* norm_weight; /* BF16 [norm_end - norm_begin] */
  float eps;                   /* finite, >= 0 */
  int32_t rope_style;          /* KVDK_ROPE_* */
  int32_t rope_offset;         /* RoPE over [rope_offset, +rope_dim) */
  int32_t rope_dim;            /* even */
  const int64_t* positions;    /* [num_tokens] in [0, max_position) */
  const float* cos_sin;        /* fp32 [max_position][rope_dim]: cos|sin */
  int64_t max_position;
  int32_t hadamard_begin; /* Hadamard over [begin, begin + len) */
  int32_t hadamard_len;   /* 0 (off), 64, 128, 256 or 512 */
} kvdk_fused_params;

int kvdk_abi_version(void);
/* 1 when the library was built with the CUDA entry points. */
int kvdk_has_cuda(void);
/* The calling thread's last failure ("" if none). Valid until its next
 * call into the library. */
const char* kvdk_last_error(void);

/* A layout from a format name: "V41", "V41_FP4", "FP4_INDEX",
 * "FP8_FP32SF_INDEX", "MXFP8_INDEX", "DS_MLA_FP8", "BF16(N)", or "BF16"
 * with bf16_elements = N (0 otherwise), as CreatePool takes them. */
int kvdk_layout_create(const char* format_name, int32_t bf16_elements,
                       int64_t block_size, int64_t num_blocks,
                       int64_t num_layers, kvdk_layout** out);
/* The same from a descriptor; a descriptor without SPEC §3 math is
 * KVDK_ERR_UNSUPPORTED. */
int kvdk_layout_create_desc(const kvdk_format_desc* desc, int64_t block_size,
                            int64_t num_blocks, int64_t num_layers,
                            kvdk_layout** out);
void kvdk_layout_destroy(kvdk_layout* layout); /* NULL is fine */
/* info_size >= KVDK_LAYOUT_INFO_V1_BYTES: the first min(info_size,
 * sizeof(kvdk_layout_info)) bytes are written, nothing past them. */
int kvdk_layout_get_info(const kvdk_layout* layout, kvdk_layout_info* info,
                         int64_t info_size);
/* The canonical format name ("BF16(512)"), NUL-terminated; capacity >= 32
 * is always enough. */
int kvdk_layout_format_name(const kvdk_layout* layout, char* buf,
                            int64_t capacity);

/* ---- Store (SPEC §4) ----------------------------------------------------
 *   kv:           [num_tokens][elements] of dtype (BF16 or FP32)
 *   slot_mapping: [num_tokens] int32; slot = block * block_size + offset,
 *                 -1 = padding, skip
 * num_tokens = 0 is a no-op. CUDA: pool and kv 16-byte aligned. */
int kvdk_store_cpu(const kvdk_layout* layout, void* pool, int64_t pool_bytes,
                   int64_t layer, const void* kv, int32_t dtype,
                   const int32_t* slot_mapping, int64_t num_tokens);
int kvdk_store_cuda(const kvdk_layout* layout, void* pool, int64_t pool_bytes,
                    int64_t layer, const void* kv, int32_t dtype,
                    const int32_t* slot_mapping, int64_t num_tokens,
                    void* workspace, int64_t workspace_bytes,
                    unsigned long long* invalid_count, void* stream);

/* ---- Segment load (SPEC §5) ---------------------------------------------
 *   segments: [num_segments][4] int32 {src_block_id, src_begin, src_end,
 *             dst_offset}; block -1 = zero rows
 *   data:     [total_k][load_data_row_bytes]: BF16 [elements] for do_cast
 *             formats, raw [quantized_bytes] for index formats
 *   scales:   index formats: [total_k][load_scale_row_bytes] (UE8M0 bytes
 *             packed four per int32, or fp32); NULL for do_cast formats
 * Rows no segment covers keep their contents. data_bytes / scales_bytes:
 * the sizes of the caller's buffers, checked against total_k.
 * CUDA: data and pool 16-byte aligned. */
int kvdk_load_cpu(const kvdk_layout* layout, const void* pool,
                  int64_t pool_bytes, int64_t layer, const int32_t* segments,
                  int64_t num_segments, int64_t total_k, void* data,
                  int64_t data_bytes, void* scales, int64_t scales_bytes);
int kvdk_load_cuda(const kvdk_layout* layout, const void* pool,
                   int64_t pool_bytes, int64_t layer, const int32_t* segments,
                   int64_t num_segments, int64_t total_k, void* data,
                   int64_t data_bytes, void* scales, int64_t scales_bytes,
                   void* workspace, int64_t workspace_bytes,
                   unsigned long long* invalid_count, void* stream);

/* ---- Plans (SPEC §6), host only, as the daemon builds them ---------------
 * Compressed plan of a Load with sequences (SequencePlan): ratio R >= 1
 * (the daemon also reads 0 as 1; here 0 is refused); each block table
 * entry is a pool block of block_size compressed tokens (= block_size * R
 * logical tokens); sequence b gets seqlen_k[b] / R rows, or one zero row
 * when that is 0.
 *   seqlen_k:    [num_seqs] >= 0
 *   block_table: [num_seqs][max_blocks_per_seq] int32
 *   segments:    out [max_segments][4]; *num_segments receives the count
 *                (also on KVDK_ERR_CAPACITY: call again with that many)
 *   cu_rows:     out [num_seqs + 1] or NULL; rows of sequence b are
 *                [cu_rows[b], cu_rows[b + 1])
 *   total_k:     out, rows of the plan */
int kvdk_build_compressed_plan(const kvdk_layout* layout, int32_t ratio,
                               const int32_t* seqlen_k, int64_t num_seqs,
                               const int32_t* block_table,
                               int32_t max_blocks_per_seq, int32_t* segments,
                               int64_t max_segments, int64_t* num_segments,
                               int64_t* total_k, int32_t* cu_rows);
/* SWA plan over a ring pool (ring size = block_size, states = num_blocks):
 * the `window` positions before each chunk (seqlen_k - seqlen_q), zero rows
 * before swa_valid_start; total_k = num_seqs * window.
 *   seqlen_k, seqlen_q, state_ids: [num_seqs]
 *   swa_valid_start: [num_seqs] or NULL (= 0) */
int kvdk_build_swa_plan(const kvdk_layout* ring, int32_t window,
                        const int32_t* seqlen_k, const int32_t* seqlen_q,
                        const int32_t* state_ids,
                        const int32_t* swa_valid_start, int64_t num_seqs,
                        int32_t* segments, int64_t max_segments,
                        int64_t* num_segments, int64_t* total_k);

/* ---- Index operations (SPEC §7) -----------------------------------------
 * convert_topk, in place, over the index pool `layout` (B = block_size):
 *   topk:        [num_seqs][k] logical compressed-token indices -> slots
 *   valid_count: [num_seqs] in [0, k]; columns past it become -1
 *   num_tokens:  [num_seqs] >= 0 compressed tokens of each sequence
 *   block_table: [num_seqs][row_stride] int32, max_blocks_per_seq used
 *   invalid_count: out (CPU: host int64, may be NULL; CUDA: device u64
 *                  added to, may be NULL): entries that became -1 because
 *                  x < 0, x >= num_tokens, x / B past the row, or a table
 *                  entry outside [0, num_blocks). */
int kvdk_convert_topk_cpu(const kvdk_layout* layout, int32_t* topk,
                          int64_t num_seqs, int32_t k,
                          const int32_t* valid_count, const int32_t* num_tokens,
                          const int32_t* block_table,
                          int32_t max_blocks_per_seq, int64_t row_stride,
                          int64_t* invalid_count);
int kvdk_convert_topk_cuda(const kvdk_layout* layout, int32_t* topk,
                           int64_t num_seqs, int32_t k,
                           const int32_t* valid_count,
                           const int32_t* num_tokens,
                           const int32_t* block_table,
                           int32_t max_blocks_per_seq, int64_t row_stride,
                           unsigned long long* invalid_count, void* stream);

/* SWA decode index over a ring pool (ring size B = block_size, states =
 * num_blocks):
 *   state_ids [n] in [0, num_blocks), starts [n] >= 0,
 *   valid_lens [n] in [0, window]; 0 < window <= B
 *   out: [n][window]: state * B + (start + i) % B for i < valid_len, -1
 *        after. */
int kvdk_swa_decode_index_cpu(const kvdk_layout* ring, const int32_t* state_ids,
                              const int32_t* starts, const int32_t* valid_lens,
                              int64_t n, int32_t window, int32_t* out);
int kvdk_swa_decode_index_cuda(const kvdk_layout* ring,
                               const int32_t* state_ids, const int32_t* starts,
                               const int32_t* valid_lens, int64_t n,
                               int32_t window, int32_t* out, void* workspace,
                               int64_t workspace_bytes,
                               unsigned long long* invalid_count, void* stream);

/* Prefill SWA index from pivots (the daemon's PrefillIndex steps):
 *   pivots: [rows][4] {off1, len1, off2, len2}: lengths >= 0,
 *           len1 + len2 <= width, each range inside [0, num_kv_rows)
 *   out:    [rows][width]: off1 + c (c < len1), off2 + c - len1
 *           (c < len1 + len2), -1 after. CUDA: pivots 16-byte aligned. */
int kvdk_expand_swa_index_cpu(const int32_t* pivots, int64_t rows,
                              int32_t width, int32_t num_kv_rows, int32_t* out);
int kvdk_expand_swa_index_cuda(const int32_t* pivots, int64_t rows,
                               int32_t width, int32_t num_kv_rows, int32_t* out,
                               void* workspace, int64_t workspace_bytes,
                               unsigned long long* invalid_count, void* stream);
/* [SWA index | compressed index + main_kv_offset] per row:
 *   swa:        [rows][swa_width], entries in [-1, main_kv_offset)
 *   compressed: [rows][compressed_width], entries in [-1, compressed_rows)
 *   out:        [rows][swa_width + compressed_width] */
int kvdk_kv_index_cat_cpu(const int32_t* swa, int32_t swa_width,
                          const int32_t* compressed, int32_t compressed_width,
                          int64_t rows, int32_t main_kv_offset,
                          int32_t compressed_rows, int32_t* out);
int kvdk_kv_index_cat_cuda(const int32_t* swa, int32_t swa_width,
                           const int32_t* compressed, int32_t compressed_width,
                           int64_t rows, int32_t main_kv_offset,
                           int32_t compressed_rows, int32_t* out,
                           void* workspace, int64_t workspace_bytes,
                           unsigned long long* invalid_count, void* stream);

/* ---- Fused norm -> RoPE -> Hadamard -> quantize -> store (SPEC §8) -------
 *   kv:        [num_tokens][elements] BF16
 *   params:    as kvdk_fused_params
 *   slot_mapping: [num_tokens]; -1 = skip (cast_back still written)
 *   cast_back: [num_tokens][elements] BF16 out, or NULL
 * CUDA: pool, kv and cast_back 16-byte aligned. */
int kvdk_fused_store_cpu(const kvdk_layout* layout, void* pool,
                         int64_t pool_bytes, int64_t layer, const uint16_t* kv,
                         const kvdk_fused_params* params,
                         const int32_t* slot_mapping, int64_t num_tokens,
                         uint16_t* cast_back);
int kvdk_fused_store_cuda(const kvdk_layout* layout, void* pool,
                          int64_t pool_bytes, int64_t layer, const uint16_t* kv,
                          const kvdk_fused_params* params,
                          const int32_t* slot_mapping, int64_t num_tokens,
                          uint16_t* cast_back, void* workspace,
                          int64_t workspace_bytes,
                          unsigned long long* invalid_count, void* stream);

/* Device workspace a *_cuda call needs for `count` items of `op`
 * (KVDK_OP_*); < 0 (and kvdk_last_error) for a bad op or count. 0 means
 * the workspace may be NULL. */
int64_t kvdk_cuda_workspace_bytes(int32_t op, int64_t count);

#ifdef __cplusplus
}
#endif

#endif /* KVDEPOT_LIBKVDEPOT_KVDEPOT_KERNELS_H_ */
