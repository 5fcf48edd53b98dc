"""Packing of the proto's array fields.

Integer arrays (slot mappings, block tables, segments, indices) travel as
packed little-endian int32 `bytes`. Accepted inputs:
  - bytes / bytearray / a byte memoryview: already packed, taken as is
    (the length must be a multiple of 4);
  - array.array of an integer typecode;
  - a NumPy integer array (any shape; C order), when NumPy is installed;
  - a list / tuple / range of ints, or (2-D fields) a list of such rows.
Every value is checked to fit int32 before anything is sent; an error names
the field and the flat index, e.g. "slot_mapping[3] = 4294967296 does not
fit int32".

Bulk K/V data (DataRef inputs) is bytes-like: bytes, bytearray, memoryview,
array.array, or a C-contiguous NumPy array (its raw bytes).
"""

import array
import struct
import sys
from typing import Any, List, Optional, Sequence, Tuple

from ._errors import invalid_argument

try:  # NumPy is optional.
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the host
    _np = None

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
_INT_TYPECODES = "bBhHiIlLqQ"
_LITTLE = sys.byteorder == "little"


def is_numpy(value: Any) -> bool:
    return _np is not None and isinstance(value, _np.ndarray)


def _check_ints(values: Sequence[Any], field: str) -> None:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid_argument(
                f"{field}[{i}] = {v!r} is not an integer")
        if v < INT32_MIN or v > INT32_MAX:
            raise invalid_argument(f"{field}[{i}] = {v} does not fit int32")


def _from_ints(values: Sequence[int], field: str) -> bytes:
    _check_ints(values, field)
    return struct.pack(f"<{len(values)}i", *values)


def _flatten_rows(value: Sequence[Any], field: str) -> Tuple[List[Any], Optional[int]]:
    """A list of rows -> (flat values, columns); a flat list -> (list, None)."""
    if not value or not isinstance(value[0], (list, tuple, range)):
        return list(value), None
    cols = len(value[0])
    flat: List[Any] = []
    for r, row in enumerate(value):
        if not isinstance(row, (list, tuple, range)) or len(row) != cols:
            got = len(row) if isinstance(row, (list, tuple, range)) else "not a row"
            raise invalid_argument(
                f"{field}[{r}] has {got} columns, {field}[0] has {cols}")
        flat.extend(row)
    return flat, cols


def pack_int32(value: Any, field: str) -> Tuple[bytes, int, Optional[int]]:
    """Packs `value` as little-endian int32.

    Returns (packed bytes, element count, columns), where columns is the
    second dimension of a 2-D NumPy array or list of rows, else None.
    """
    if isinstance(value, (bytes, bytearray)) or (
            isinstance(value, memoryview) and value.itemsize == 1):
        data = bytes(value)
        if len(data) % 4:
            raise invalid_argument(
                f"{field}: {len(data)} bytes is not a whole number of "
                "packed int32 values")
        return data, len(data) // 4, None
    if isinstance(value, memoryview):
        value = value.tolist()
    if isinstance(value, array.array):
        if value.typecode not in _INT_TYPECODES:
            raise invalid_argument(
                f"{field}: array typecode '{value.typecode}' is not an "
                "integer type")
        if value.typecode in "il" and value.itemsize == 4:
            copy = array.array(value.typecode, value)
            if not _LITTLE:
                copy.byteswap()
            return copy.tobytes(), len(copy), None
        return _from_ints(value.tolist(), field), len(value), None
    if is_numpy(value):
        if value.dtype.kind not in "iu":
            raise invalid_argument(
                f"{field}: NumPy dtype {value.dtype} is not an integer type")
        flat = value.reshape(-1)
        if flat.size and (flat.dtype.itemsize > 4 or flat.dtype.kind == "u"):
            bad = _np.nonzero((flat < INT32_MIN) | (flat > INT32_MAX))[0]
            if bad.size:
                i = int(bad[0])
                raise invalid_argument(
                    f"{field}[{i}] = {int(flat[i])} does not fit int32")
        cols = int(value.shape[1]) if value.ndim == 2 else None
        return flat.astype("<i4").tobytes(), int(flat.size), cols
    if isinstance(value, (list, tuple, range)):
        flat, cols = _flatten_rows(value, field)
        return _from_ints(flat, field), len(flat), cols
    raise invalid_argument(
        f"{field}: {type(value).__name__} is not an int32 array "
        "(bytes, array.array, list, or NumPy integer array)")


def pack_int32_2d(value: Any, field: str, rows: Optional[int] = None,
                  cols: Optional[int] = None) -> Tuple[bytes, int, int]:
    """Packs a [rows][cols] int32 array; returns (bytes, rows, cols).

    The shape comes from the value (2-D NumPy array, list of rows) or from
    `cols` / `rows` for flat input; they must agree.
    """
    data, count, own_cols = pack_int32(value, field)
    if own_cols is not None:
        if cols is not None and cols != own_cols:
            raise invalid_argument(
                f"{field} has {own_cols} columns, expected {cols}")
        cols = own_cols
    if cols is None:
        if rows is None or rows <= 0:
            raise invalid_argument(
                f"{field}: pass a 2-D array (or a list of rows) or give its "
                "number of columns")
        if count % rows:
            raise invalid_argument(
                f"{field} has {count} values, not a multiple of {rows} rows")
        cols = count // rows
    if cols <= 0:
        if count:
            raise invalid_argument(f"{field} has {count} values but 0 columns")
        return data, rows or 0, cols
    if count % cols:
        raise invalid_argument(
            f"{field} has {count} values, not a multiple of {cols} columns")
    if rows is not None and count // cols != rows:
        raise invalid_argument(
            f"{field} has {count // cols} rows of {cols}, expected {rows}")
    return data, count // cols, cols


def unpack_int32(data: bytes) -> array.array:
    """Packed little-endian int32 -> array.array('i') (native order).

    numpy.asarray(result) views it as int32 without a copy.
    """
    out = array.array("i")
    out.frombytes(data)
    if not _LITTLE:
        out.byteswap()
    return out


def data_bytes(value: Any, field: str) -> bytes:
    """The raw bytes of a bulk data input."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, array.array):
        return value.tobytes()
    if is_numpy(value):
        if not value.flags.c_contiguous:
            value = _np.ascontiguousarray(value)
        if value.dtype.byteorder == ">":
            value = value.astype(value.dtype.newbyteorder("<"))
        return value.tobytes()
    raise invalid_argument(
        f"{field}: {type(value).__name__} is not bytes-like (bytes, "
        "bytearray, memoryview, array.array or a NumPy array)")


def infer_dtype(value: Any, field: str) -> str:
    """"bf16" or "fp32" from a NumPy or array.array input; "bf16" otherwise."""
    if is_numpy(value):
        name = value.dtype.name
        if name == "float32":
            return "fp32"
        if name in ("uint16", "int16", "bfloat16"):
            return "bf16"
        raise invalid_argument(
            f"{field}: NumPy dtype {name} is neither float32 nor BF16 bit "
            "patterns (uint16); convert it or pass dtype=")
    if isinstance(value, array.array):
        if value.typecode == "f":
            return "fp32"
        if value.typecode in "hH":
            return "bf16"
        raise invalid_argument(
            f"{field}: array typecode '{value.typecode}' is neither 'f' "
            "(float32) nor 'H' (BF16 bit patterns); pass dtype=")
    return "bf16"
