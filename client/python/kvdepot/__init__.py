"""Python client of kvdepot, the KV-cache daemon. See docs/PYTHON.md.

Needs the generated stubs (module kvdepot.v1.kvdepot_pb2 and _pb2_grpc,
built by //client/python:stubs): either inside this package's folder
(kvdepot/v1/) or in a folder named kvdepot under another sys.path entry
(Bazel's gen/kvdepot/v1/), which the __path__ extension below finds.
"""

import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

from ._address import default_socket_path, resolve_target
from ._arrays import pack_int32, unpack_int32
from ._buffers import INLINE, Buffer, PoolMapping, Slice
from ._errors import ClientClosed, KVCacheError, SessionLost
from .client import (Client, IndexResult, LoadResult, Plan,
                     PrefillIndexResult, PrefillLoadResult, connect)

# The daemon's version (common/version.h); client_test compares them.
__version__ = "0.1.0"

__all__ = [
    "Buffer", "Client", "ClientClosed", "INLINE", "IndexResult",
    "KVCacheError", "LoadResult", "Plan", "PoolMapping",
    "PrefillIndexResult", "PrefillLoadResult", "SessionLost", "Slice",
    "__version__", "connect", "default_socket_path", "pack_int32",
    "resolve_target", "unpack_int32",
]
