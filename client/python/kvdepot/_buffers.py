"""Memory the daemon hands over: buffers of a session, and pools.

On the CPU backend the daemon sends a sealed memfd over the companion
socket (SPEC §11): it is mapped with mmap and offered as a writable
memoryview, and the descriptor closed. On the CUDA backend it sends a CUDA
VMM export (a POSIX descriptor of `fd_size` bytes on `fd_device`): it is
kept open here (`vmm_fd`) for kvdepot.torch (or any other importer) to map
on the device; nothing is mapped on the host. A daemon on the CUDA backend
started with --legacy_cuda_ipc describes memory by the 64-byte
cudaIpcMemHandle_t of the allocation base instead (docs/PYTHON.md).
"""

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ._errors import KVCacheError, invalid_argument


class _Inline:
    """Marker: ask for an output inline in the reply."""

    def __repr__(self) -> str:
        return "INLINE"


INLINE = _Inline()


class SessionToken:
    """Identifies one session of a client; `alive` turns False when it
    ends."""

    def __init__(self) -> None:
        self.alive = True


@dataclass(frozen=True)
class Slice:
    """Bytes [offset, offset + length) of a buffer, for a request's DataRef.

    `session` is the client session the buffer belongs to (Buffer.slice()
    sets it); a client refuses a slice of a session it lost. None: not
    checked (a buffer id another session granted)."""

    buffer_id: int
    offset: int
    length: int
    session: Optional[SessionToken] = field(default=None, compare=False,
                                            repr=False)


_SEALS = 0x0002 | 0x0004  # F_SEAL_SHRINK | F_SEAL_GROW
_F_GET_SEALS = 1034


def _map_memfd(fd: int, length: int) -> mmap.mmap:
    """Maps a received memfd after checking it cannot shrink under us and
    holds `length` bytes; closes `fd` in every case."""
    try:
        import fcntl

        seals = fcntl.fcntl(fd, _F_GET_SEALS)
        size = os.fstat(fd).st_size
        if seals & _SEALS != _SEALS or size != length:
            raise invalid_argument(
                f"the daemon's descriptor is not a sealed memfd of {length} "
                f"bytes (seals {seals:#x}, size {size})")
        return mmap.mmap(fd, length)
    finally:
        os.close(fd)


def _cuda_ordinal(fd_device: str) -> Optional[int]:
    """"cuda:N" -> N; anything else (``"cpu"``, ``""``) -> None."""
    if fd_device.startswith("cuda:") and fd_device[5:].isdigit():
        return int(fd_device[5:])
    if fd_device == "cuda":
        return 0
    return None


class _Mapping:
    """An mmap of a memfd (CPU), a CUDA VMM descriptor kept open (CUDA), or
    the IPC handle bytes of a legacy SharedHandle (CUDA)."""

    def __init__(self, fd: Optional[int], length: int,
                 handle: Any = None, fd_size: int = 0,
                 fd_device: str = ""):
        self.handle = handle
        self.device_ordinal = handle.device_ordinal if handle else -1
        self.ipc_handle: Optional[bytes] = None
        # CUDA backend: the VMM export (owned here until close()), the bytes
        # to map from it and its device.
        self.vmm_fd: Optional[int] = None
        self.fd_size = fd_size
        self._mmap: Optional[mmap.mmap] = None
        self._view: Optional[memoryview] = None
        self._invalid: Optional[KVCacheError] = None
        ordinal = _cuda_ordinal(fd_device)
        if fd is not None and ordinal is not None:
            if fd_size < length:
                os.close(fd)
                raise invalid_argument(
                    f"the daemon's CUDA descriptor covers {fd_size} bytes, "
                    f"fewer than the {length} it describes")
            self.vmm_fd = fd
            self.device_ordinal = ordinal
            return
        if fd is None:
            if handle is not None and \
                    handle.WhichOneof("kind") == "cuda_ipc_handle":
                self.ipc_handle = bytes(handle.cuda_ipc_handle)
                return
            raise invalid_argument("no descriptor and no CUDA IPC handle")
        self._mmap = _map_memfd(fd, length)
        self._view = memoryview(self._mmap)

    @property
    def view(self) -> Optional[memoryview]:
        """The mapping (CPU backend); None after close() or on CUDA. Raises
        the client's SessionLost or ClientClosed once the session that
        handed it over has ended: the memory is no longer the daemon's."""
        if self._invalid is not None:
            raise self._invalid
        return self._view

    def invalidate(self, error: KVCacheError) -> None:
        """Unmaps and makes every later use raise `error` (the client calls
        it when its session ends)."""
        self.close()
        self._invalid = error

    def close(self) -> None:
        if self.vmm_fd is not None:
            os.close(self.vmm_fd)
            self.vmm_fd = None
        # Views or NumPy arrays made from `view` may still exist (BufferError):
        # the mapping then goes away with the last of them.
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:
                pass
            self._view = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None

    def numpy(self, dtype: Any, offset: int = 0, count: int = -1) -> Any:
        import numpy  # optional dependency, only for this method

        view = self.view
        if view is None:
            raise invalid_argument("not mapped on the host (CUDA handle)")
        return numpy.frombuffer(view, dtype=dtype, count=count,
                                offset=offset)


class Buffer(_Mapping):
    """A buffer of the session (AllocateBuffer), mapped into this process.

    view:       writable memoryview of its `size` bytes (CPU backend), or None
    vmm_fd:     the CUDA VMM export of `fd_size` bytes on `device_ordinal`
                (CUDA backend; kvdepot.torch.buffer_tensor maps it)
    ipc_handle: cudaIpcMemHandle_t bytes of the allocation base (CUDA
                backend; the buffer starts `handle.offset` bytes into it)
    """

    def __init__(self, info: Any, fd: Optional[int], release_fn: Any,
                 session: Optional[SessionToken] = None, fd_size: int = 0,
                 fd_device: str = ""):
        super().__init__(fd, info.size,
                         info.handle if info.HasField("handle") else None,
                         fd_size, fd_device)
        self.id = info.buffer_id
        self.size = info.size
        self.info = info
        self._release_fn = release_fn
        self._session = session

    def slice(self, offset: int = 0, length: Optional[int] = None) -> Slice:
        """A DataRef slice of this buffer; length defaults to the rest."""
        if self._invalid is not None:
            raise self._invalid
        if length is None:
            length = self.size - offset
        return Slice(self.id, offset, length, self._session)

    def write(self, data: Any, offset: int = 0) -> int:
        """Copies bytes-like `data` into the buffer at `offset`."""
        from ._arrays import data_bytes

        raw = data_bytes(data, "data")
        view = self.view
        if view is None:
            raise invalid_argument("buffer is not mapped on the host")
        if offset < 0 or offset + len(raw) > self.size:
            raise invalid_argument(
                f"write [offset {offset}, +{len(raw)}) is outside buffer "
                f"{self.id} of {self.size} bytes")
        view[offset:offset + len(raw)] = raw
        return len(raw)

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        view = self.view
        if view is None:
            raise invalid_argument("buffer is not mapped on the host")
        if length is None:
            length = self.size - offset
        if offset < 0 or length < 0 or offset + length > self.size:
            raise invalid_argument(
                f"read [offset {offset}, +{length}) is outside buffer "
                f"{self.id} of {self.size} bytes")
        return bytes(view[offset:offset + length])

    def release(self) -> None:
        """Unmaps the buffer and releases it in the daemon (only unmaps once
        its session ended: the daemon released it then)."""
        self.close()
        if self._invalid is not None:
            self._release_fn = None
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

    def __init__(self, info: Any, fd: Optional[int], fd_size: int = 0,
                 fd_device: str = ""):
        super().__init__(fd, info.layout.total_bytes,
                         info.handle if info.HasField("handle") else None,
                         fd_size, fd_device)
        self.info = info
        self.layout = info.layout
