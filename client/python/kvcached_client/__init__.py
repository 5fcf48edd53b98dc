"""Python client of kvcached, the KV-cache daemon. See docs/PYTHON.md.

Needs the generated stubs (module kvcache.v1.kvcache_pb2 and _pb2_grpc,
built by //client/python:stubs) on sys.path next to this package.
"""

from ._address import default_socket_path, resolve_target
from ._arrays import pack_int32, unpack_int32
from ._buffers import INLINE, Buffer, PoolMapping, Slice
from ._errors import KVCacheError
from .client import (Client, IndexResult, LoadResult, Plan,
                     PrefillIndexResult, PrefillLoadResult, connect)

__all__ = [
    "Buffer", "Client", "INLINE", "IndexResult", "KVCacheError",
    "LoadResult", "Plan", "PoolMapping", "PrefillIndexResult",
    "PrefillLoadResult", "Slice", "connect", "default_socket_path",
    "pack_int32", "resolve_target", "unpack_int32",
]
