"""Python client of kvdepot, the KV-cache daemon. See docs/PYTHON.md.

The generated gRPC stubs are the subpackage kvdepot.v1 (committed, checked
fresh against the .proto by //client/python:stubs_fresh_test). Installable
as a wheel: client/python/README.md.
"""

from ._address import default_socket_path, resolve_target
from ._arrays import pack_int32, unpack_int32
from ._buffers import INLINE, Buffer, PoolMapping, Slice
from ._errors import ClientClosed, KVCacheError, SessionLost
from ._malloc import keep_freed_memory
from .client import (TLS, Client, FusedStore, IndexResult, LoadResult, Plan,
                     PrefillIndexResult, PrefillLoadResult, StoreResult,
                     connect)

# The daemon's version (common/version.h); client_test compares them, and
# the wheel takes its version from here (pyproject.toml).
__version__ = "0.1.0"



def __getattr__(name: str) -> object:
    """kvdepot.torch (needs PyTorch) and kvdepot.step are imported on first
    use, so that `import kvdepot` works without torch."""
    if name in ("torch", "step"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Buffer", "Client", "ClientClosed", "FusedStore", "INLINE", "IndexResult",
    "KVCacheError", "LoadResult", "Plan", "PoolMapping",
    "PrefillIndexResult", "PrefillLoadResult", "SessionLost", "Slice",
    "StoreResult", "TLS",
    "__version__", "connect", "default_socket_path", "keep_freed_memory",
    "pack_int32",
    "resolve_target", "unpack_int32",
]
