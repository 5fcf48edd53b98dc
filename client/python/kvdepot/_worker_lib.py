"""ctypes bindings of libkvdepot_worker.so (worker/kvdepot_worker.h): the
step path's worker side and the mapping of CUDA VMM descriptors. No torch
here; kvdepot.torch builds on it.

The library is found, in this order, at $KVDEPOT_WORKER_LIB (a path), next
to this package (kvdepot/libkvdepot_worker.so, where a wheel built with
KVDEPOT_WORKER_LIB set at build time may carry it), or by the dynamic
loader's own search (LD_LIBRARY_PATH, e.g. the GPU bundle's lib/).
"""

import ctypes
import os
import threading
from typing import Optional, Tuple

import grpc

from ._errors import KVCacheError

LIBRARY_NAME = "libkvdepot_worker.so"

# worker/kvdepot_worker.h
KVD_OK = 0
KVD_ERR_INVALID = -1
KVD_ERR_ENVIRONMENT = -2
KVD_ERR_CUDA = -3
KVD_ERR_RELEASED = -4

STATUS_STEP_MISMATCH = 1
STATUS_CANCELLED = 2
STATUS_OUT_OF_RANGE = 4
STATUS_WORKER_WATCHDOG = 8
STATUS_DAEMON_ERROR = 16

_CODES = {
    KVD_ERR_INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    KVD_ERR_ENVIRONMENT: grpc.StatusCode.FAILED_PRECONDITION,
    KVD_ERR_CUDA: grpc.StatusCode.INTERNAL,
    KVD_ERR_RELEASED: grpc.StatusCode.ABORTED,
}


class WorkerReleased(KVCacheError):
    """The worker library's watchdog released this worker's waits (the
    daemon died or a begun step never came): ABORTED. Every later call on
    the worker raises it; close it, register again."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.ABORTED, message)


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def library_candidates() -> Tuple[str, ...]:
    """Where load_library() looks, in order."""
    env = os.environ.get("KVDEPOT_WORKER_LIB", "")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        LIBRARY_NAME)
    return tuple(p for p in (env, here, LIBRARY_NAME) if p)


def load_library() -> ctypes.CDLL:
    """libkvdepot_worker.so with its prototypes set; FAILED_PRECONDITION
    naming every place tried when it is not found."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in library_candidates():
            if os.sep in path and not os.path.exists(path):
                errors.append(f"{path}: no such file")
                continue
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise KVCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{LIBRARY_NAME} (worker/, built with CUDA) was not found: "
                + "; ".join(errors) + ". Set KVDEPOT_WORKER_LIB to its path "
                "or put its directory on LD_LIBRARY_PATH")
        _set_prototypes(lib)
        _lib = lib
        return lib


def _set_prototypes(lib: ctypes.CDLL) -> None:
    vp, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.kvd_worker_open.argtypes = [c_int, i64, c_int, c_int, i64,
                                    ctypes.POINTER(vp)]
    lib.kvd_worker_open.restype = c_int
    lib.kvd_worker_close.argtypes = [vp]
    lib.kvd_worker_close.restype = None
    for name in ("kvd_step_begin",):
        getattr(lib, name).argtypes = [vp, vp]
        getattr(lib, name).restype = c_int
    for name in ("kvd_mark", "kvd_wait"):
        getattr(lib, name).argtypes = [vp, vp, c_int]
        getattr(lib, name).restype = c_int
    lib.kvd_status.argtypes = [vp, u64p, u64p, u64p, u64p]
    lib.kvd_status.restype = c_int
    lib.kvd_doorbell_ptr.argtypes = [vp]
    lib.kvd_doorbell_ptr.restype = vp
    lib.kvd_map_vmm_fd.argtypes = [c_int, i64, c_int, ctypes.POINTER(vp),
                                   ctypes.POINTER(vp)]
    lib.kvd_map_vmm_fd.restype = c_int
    lib.kvd_unmap.argtypes = [vp]
    lib.kvd_unmap.restype = None
    lib.kvd_last_error.argtypes = []
    lib.kvd_last_error.restype = ctypes.c_char_p


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """Raises the KVCacheError for a KVD_ERR_* return value."""
    if rc == KVD_OK:
        return
    text = (lib.kvd_last_error() or b"").decode(errors="replace")
    message = f"{what}: {text or f'error {rc}'}"
    if rc == KVD_ERR_RELEASED:
        raise WorkerReleased(message)
    raise KVCacheError(_CODES.get(rc, grpc.StatusCode.UNKNOWN), message)


def check_environment() -> None:
    """The hazards of GPU_HOST.md, checked before the library is asked:
    CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS unset or
    >= 8, both set before CUDA is initialized in this process."""
    loading = os.environ.get("CUDA_MODULE_LOADING", "")
    if loading != "EAGER":
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"CUDA_MODULE_LOADING is \"{loading}\", not \"EAGER\": a lazily "
            "loaded kernel launched while a stream waits on the doorbell "
            "hangs the process (GPU_HOST.md). Set CUDA_MODULE_LOADING=EAGER "
            "in the environment before CUDA starts (before importing torch)")
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    if conns and (not conns.isdigit() or int(conns) < 8):
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"CUDA_DEVICE_MAX_CONNECTIONS = \"{conns}\": the step path needs "
            "at least 8 hardware connections (fewer deadlock a parked "
            "stream's release, GPU_HOST.md); unset it or set 8 or more")


class VmmMapping:
    """A CUDA VMM descriptor mapped on a device by kvd_map_vmm_fd; unmapped
    by close() or when the object is collected. The descriptor is borrowed
    (the caller keeps and closes it)."""

    def __init__(self, fd: int, size: int, device: int):
        self._handle: Optional[ctypes.c_void_p] = None
        self._lib = load_library()
        ptr, handle = ctypes.c_void_p(), ctypes.c_void_p()
        check(self._lib, self._lib.kvd_map_vmm_fd(
            fd, size, device, ctypes.byref(ptr), ctypes.byref(handle)),
            f"kvd_map_vmm_fd(fd {fd}, {size} bytes, device {device})")
        self.ptr: int = ptr.value or 0
        self.size = size
        self.device = device
        self._handle = handle

    def close(self) -> None:
        if self._handle is not None:
            h, self._handle = self._handle, None
            self._lib.kvd_unmap(h)

    def __del__(self) -> None:
        self.close()
