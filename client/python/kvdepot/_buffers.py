"""Shared memory the daemon exports: buffers of a session, and pools.

On the CPU backend a handle names a POSIX shm object ("/kvdepot-<hex>"),
which Linux exposes as /dev/shm/kvdepot-<hex>: it is mapped with mmap and
offered as a writable memoryview. On the CUDA backend the handle is the
64-byte cudaIpcMemHandle_t of the allocation base (see docs/PYTHON.md for
opening it in PyTorch); nothing is mapped here.
"""

import mmap
import os
from dataclasses import dataclass
from typing import Any, Optional

from ._errors import invalid_argument


class _Inline:
    """Marker: ask for an output inline in the reply."""

    def __repr__(self) -> str:
        return "INLINE"


INLINE = _Inline()


@dataclass(frozen=True)
class Slice:
    """Bytes [offset, offset + length) of a buffer, for a request's DataRef."""

    buffer_id: int
    offset: int
    length: int


class _Mapping:
    """An mmap of a SharedHandle (CPU) or its IPC handle bytes (CUDA)."""

    def __init__(self, handle: Any, length: int):
        self.handle = handle
        self.device_ordinal = handle.device_ordinal
        self.ipc_handle: Optional[bytes] = None
        self._mmap: Optional[mmap.mmap] = None
        self.view: Optional[memoryview] = None
        kind = handle.WhichOneof("kind")
        if kind == "cuda_ipc_handle":
            self.ipc_handle = bytes(handle.cuda_ipc_handle)
            return
        if kind != "shm_name":
            raise invalid_argument("handle has neither shm_name nor "
                                   "cuda_ipc_handle")
        path = "/dev/shm/" + handle.shm_name.lstrip("/")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, handle.size)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)[handle.offset:handle.offset +
                                           length]

    def close(self) -> None:
        # Views or NumPy arrays made from `view` may still exist (BufferError):
        # the mapping then goes away with the last of them.
        if self.view is not None:
            try:
                self.view.release()
            except BufferError:
                pass
            self.view = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None

    def numpy(self, dtype: Any, offset: int = 0, count: int = -1) -> Any:
        import numpy  # optional dependency, only for this method

        if self.view is None:
            raise invalid_argument("not mapped on the host (CUDA handle)")
        return numpy.frombuffer(self.view, dtype=dtype, count=count,
                                offset=offset)


class Buffer(_Mapping):
    """A buffer of the session (AllocateBuffer), mapped into this process.

    view:       writable memoryview of its `size` bytes (CPU backend), or None
    ipc_handle: cudaIpcMemHandle_t bytes of the allocation base (CUDA
                backend; the buffer starts `handle.offset` bytes into it)
    """

    def __init__(self, info: Any, release_fn: Any):
        super().__init__(info.handle, info.size)
        self.id = info.buffer_id
        self.size = info.size
        self.info = info
        self._release_fn = release_fn

    def slice(self, offset: int = 0, length: Optional[int] = None) -> Slice:
        """A DataRef slice of this buffer; length defaults to the rest."""
        if length is None:
            length = self.size - offset
        return Slice(self.id, offset, length)

    def write(self, data: Any, offset: int = 0) -> int:
        """Copies bytes-like `data` into the buffer at `offset`."""
        from ._arrays import data_bytes

        raw = data_bytes(data, "data")
        if self.view is None:
            raise invalid_argument("buffer is not mapped on the host")
        if offset < 0 or offset + len(raw) > self.size:
            raise invalid_argument(
                f"write [offset {offset}, +{len(raw)}) is outside buffer "
                f"{self.id} of {self.size} bytes")
        self.view[offset:offset + len(raw)] = raw
        return len(raw)

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        if self.view is None:
            raise invalid_argument("buffer is not mapped on the host")
        if length is None:
            length = self.size - offset
        if offset < 0 or length < 0 or offset + length > self.size:
            raise invalid_argument(
                f"read [offset {offset}, +{length}) is outside buffer "
                f"{self.id} of {self.size} bytes")
        return bytes(self.view[offset:offset + length])

    def release(self) -> None:
        """Unmaps the buffer and releases it in the daemon."""
        self.close()
        if self._release_fn is not None:
            fn, self._release_fn = self._release_fn, None
            fn(self.id)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class PoolMapping(_Mapping):
    """A pool mapped into this process: `view` covers layout.total_bytes.

    Layer l starts at l * layout.layer_stride; see PoolLayout in the proto
    for the byte positions of a token.
    """

    def __init__(self, info: Any):
        super().__init__(info.handle, info.layout.total_bytes)
        self.info = info
        self.layout = info.layout
