"""ctypes binding of libkvdepot_kernels.so (library mode, kvdepot_kernels.h).

Plain ctypes, no torch and no NumPy: pointers are ints (a torch tensor's
data_ptr(), a NumPy array's ctypes.data, ctypes.addressof of a buffer) and
streams are ints (torch.cuda.current_stream().cuda_stream). Every function
returns 0 (KVDK_OK) or a negative KVDK_ERR_*; last_error() says why.

    lib = load("/path/to/libkvdepot_kernels.so")
    layout = ctypes.c_void_p()
    check(lib, lib.kvdk_layout_create(b"DS_MLA_FP8", 0, 64, 1024, 61,
                                      ctypes.byref(layout)))
"""

import ctypes

KVDK_ABI_VERSION = 1

KVDK_OK = 0
KVDK_ERR_INVALID = -1
KVDK_ERR_CUDA = -3
KVDK_ERR_UNSUPPORTED = -5
KVDK_ERR_CAPACITY = -6

KVDK_DTYPE_BF16 = 0
KVDK_DTYPE_FP32 = 1

KVDK_ROPE_NONE = 0
KVDK_ROPE_NEOX = 1
KVDK_ROPE_INTERLEAVED = 2

KVDK_QUANT_NONE, KVDK_QUANT_E4M3, KVDK_QUANT_E2M1 = 0, 1, 2
KVDK_SF_NONE, KVDK_SF_UE8M0, KVDK_SF_E4M3, KVDK_SF_FP32 = 0, 1, 2, 3
KVDK_ROUNDING_NONE, KVDK_ROUNDING_POW2_CEIL = 0, 1

KVDK_OP_STORE = 0
KVDK_OP_LOAD = 1
KVDK_OP_FUSED_STORE = 2
KVDK_OP_SWA_DECODE_INDEX = 3
KVDK_OP_EXPAND_SWA_INDEX = 4
KVDK_OP_KV_INDEX_CAT = 5


class FormatDesc(ctypes.Structure):
    """kvdk_format_desc."""

    _fields_ = [
        ("quantized_dtype", ctypes.c_int32),
        ("quantized_elements", ctypes.c_int32),
        ("elements_per_sf", ctypes.c_int32),
        ("bf16_elements", ctypes.c_int32),
        ("do_cast", ctypes.c_int32),
        ("sf_format", ctypes.c_int32),
        ("token_interleaved", ctypes.c_int32),
        ("scale_rounding", ctypes.c_int32),
    ]


class LayoutInfo(ctypes.Structure):
    """kvdk_layout_info (all int64)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "quantized_dtype",
            "quantized_elements",
            "elements_per_sf",
            "bf16_elements",
            "elements",
            "do_cast",
            "sf_format",
            "token_interleaved",
            "scale_rounding",
            "data_bytes",
            "sf_bytes",
            "bytes_per_token",
            "block_size",
            "num_blocks",
            "num_layers",
            "block_stride",
            "layer_bytes",
            "layer_stride",
            "total_bytes",
            "load_data_row_bytes",
            "load_scale_row_bytes",
            "num_slots",
            "tail_bytes",  # after ABI 1's first release
        )
    ]


class FusedParams(ctypes.Structure):
    """kvdk_fused_params; pointer fields are addresses (ints)."""

    _fields_ = [
        ("norm_begin", ctypes.c_int32),
        ("norm_end", ctypes.c_int32),
        ("norm_weight", ctypes.c_void_p),  # BF16 [norm_end - norm_begin]
        ("eps", ctypes.c_float),
        ("rope_style", ctypes.c_int32),
        ("rope_offset", ctypes.c_int32),
        ("rope_dim", ctypes.c_int32),
        ("positions", ctypes.c_void_p),  # int64 [num_tokens]
        ("cos_sin", ctypes.c_void_p),  # fp32 [max_position][rope_dim]
        ("max_position", ctypes.c_int64),
        ("hadamard_begin", ctypes.c_int32),
        ("hadamard_len", ctypes.c_int32),
    ]


_P = ctypes.c_void_p  # any pointer (host or device address, or a stream)
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64

# name: (restype, argtypes). The exact ctypes signatures of the ABI.
SIGNATURES = {
    "kvdk_abi_version": (ctypes.c_int, []),
    "kvdk_has_cuda": (ctypes.c_int, []),
    "kvdk_last_error": (ctypes.c_char_p, []),
    "kvdk_layout_create": (
        ctypes.c_int,
        [ctypes.c_char_p, _I32, _I64, _I64, _I64, ctypes.POINTER(_P)],
    ),
    "kvdk_layout_create_desc": (
        ctypes.c_int,
        [ctypes.POINTER(FormatDesc), _I64, _I64, _I64, ctypes.POINTER(_P)],
    ),
    "kvdk_layout_destroy": (None, [_P]),
    "kvdk_layout_get_info": (
        ctypes.c_int,
        [_P, ctypes.POINTER(LayoutInfo), _I64],
    ),
    "kvdk_layout_format_name": (ctypes.c_int, [_P, ctypes.c_char_p, _I64]),
    # layout, pool, pool_bytes, layer, kv, dtype, slot_mapping, num_tokens
    "kvdk_store_cpu": (ctypes.c_int, [_P, _P, _I64, _I64, _P, _I32, _P, _I64]),
    # ... + workspace, workspace_bytes, invalid_count, stream
    "kvdk_store_cuda": (
        ctypes.c_int,
        [_P, _P, _I64, _I64, _P, _I32, _P, _I64, _P, _I64, _P, _P],
    ),
    # layout, pool, pool_bytes, layer, segments, num_segments, total_k,
    # data, data_bytes, scales, scales_bytes
    "kvdk_load_cpu": (
        ctypes.c_int,
        [_P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _I64],
    ),
    "kvdk_load_cuda": (
        ctypes.c_int,
        [_P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _P, _I64,
         _P, _P],
    ),
    # layout, ratio, seqlen_k, num_seqs, block_table, max_blocks_per_seq,
    # segments, max_segments, *num_segments, *total_k, cu_rows
    "kvdk_build_compressed_plan": (
        ctypes.c_int,
        [_P, _I32, _P, _I64, _P, _I32, _P, _I64, ctypes.POINTER(_I64),
         ctypes.POINTER(_I64), _P],
    ),
    # ring, window, seqlen_k, seqlen_q, state_ids, swa_valid_start,
    # num_seqs, segments, max_segments, *num_segments, *total_k
    "kvdk_build_swa_plan": (
        ctypes.c_int,
        [_P, _I32, _P, _P, _P, _P, _I64, _P, _I64, ctypes.POINTER(_I64),
         ctypes.POINTER(_I64)],
    ),
    # layout, topk, num_seqs, k, valid_count, num_tokens, block_table,
    # max_blocks_per_seq, row_stride, invalid_count (host int64* / NULL)
    "kvdk_convert_topk_cpu": (
        ctypes.c_int,
        [_P, _P, _I64, _I32, _P, _P, _P, _I32, _I64, _P],
    ),
    # ... invalid_count (device u64* / NULL), stream
    "kvdk_convert_topk_cuda": (
        ctypes.c_int,
        [_P, _P, _I64, _I32, _P, _P, _P, _I32, _I64, _P, _P],
    ),
    # ring, state_ids, starts, valid_lens, n, window, out
    "kvdk_swa_decode_index_cpu": (
        ctypes.c_int,
        [_P, _P, _P, _P, _I64, _I32, _P],
    ),
    "kvdk_swa_decode_index_cuda": (
        ctypes.c_int,
        [_P, _P, _P, _P, _I64, _I32, _P, _P, _I64, _P, _P],
    ),
    # pivots, rows, width, num_kv_rows, out
    "kvdk_expand_swa_index_cpu": (ctypes.c_int, [_P, _I64, _I32, _I32, _P]),
    "kvdk_expand_swa_index_cuda": (
        ctypes.c_int,
        [_P, _I64, _I32, _I32, _P, _P, _I64, _P, _P],
    ),
    # swa, swa_width, compressed, compressed_width, rows, main_kv_offset,
    # compressed_rows, out
    "kvdk_kv_index_cat_cpu": (
        ctypes.c_int,
        [_P, _I32, _P, _I32, _I64, _I32, _I32, _P],
    ),
    "kvdk_kv_index_cat_cuda": (
        ctypes.c_int,
        [_P, _I32, _P, _I32, _I64, _I32, _I32, _P, _P, _I64, _P, _P],
    ),
    # layout, pool, pool_bytes, layer, kv, params, slot_mapping, num_tokens,
    # cast_back
    "kvdk_fused_store_cpu": (
        ctypes.c_int,
        [_P, _P, _I64, _I64, _P, ctypes.POINTER(FusedParams), _P, _I64, _P],
    ),
    "kvdk_fused_store_cuda": (
        ctypes.c_int,
        [_P, _P, _I64, _I64, _P, ctypes.POINTER(FusedParams), _P, _I64, _P,
         _P, _I64, _P, _P],
    ),
    "kvdk_cuda_workspace_bytes": (_I64, [_I32, _I64]),
}


class KernelsError(RuntimeError):
    def __init__(self, code, message):
        super().__init__("%s (code %d)" % (message, code))
        self.code = code


def load(path):
    """Loads the library and declares every signature; checks the ABI."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if lib.kvdk_abi_version() != KVDK_ABI_VERSION:
        raise KernelsError(KVDK_ERR_UNSUPPORTED, "ABI version mismatch")
    return lib


def check(lib, code):
    """Raises KernelsError with kvdk_last_error() when code != KVDK_OK."""
    if code != KVDK_OK:
        raise KernelsError(code, lib.kvdk_last_error().decode())
    return code
