"""The memory of a step ring (common/step_ring.h, docs/STEP_PATH.md "Step
ring"): the daemon's sealed memfd, mapped shared, its counter words and the
futex both processes sleep on. kvdepot.step.StepRing drives it.

Python has no memory fences: after publishing a request this side always
wakes the daemon's ring thread (one futex system call, which also orders
the store before anything later), instead of reading the daemon's
"sleeping" word first as the C++ client does. Waiting for a reply relies
on the kernel comparing the counter inside FUTEX_WAIT, as in C++."""

import ctypes
import mmap
import platform
import struct
from typing import Dict

MAGIC = 0x5253564B
VERSION = 1
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 8
REPLY_BYTES = 4096

SUBMITTED = 64
DAEMON_SLEEPING = 128
DONE = 192
CLIENT_SLEEPING = 256
STATE = 320
MESSAGE = 384
MAX_MESSAGE_BYTES = 1024

OPEN, CLOSED, FAILED = 0, 1, 2

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def ring_bytes(slots: int, request_bytes: int) -> int:
    n = HEADER_BYTES + slots * (request_bytes + REPLY_BYTES)
    return (n + 4095) // 4096 * 4096


class RingMemory:
    """A mapped ring: the words each side owns, the slots, the futex."""

    def __init__(self, fd: int, size: int, slots: int, request_bytes: int):
        if _SYS_FUTEX is None:
            raise OSError(f"step rings need futex(2); no syscall number "
                          f"known for {platform.machine()}")
        self.mm = mmap.mmap(fd, size)   # MAP_SHARED, read-write
        self.slots = slots
        self.request_bytes = request_bytes
        self._words: Dict[int, ctypes.c_uint32] = {
            off: ctypes.c_uint32.from_buffer(self.mm, off)
            for off in (SUBMITTED, DAEMON_SLEEPING, DONE, CLIENT_SLEEPING,
                        STATE, MESSAGE)}

    def header(self) -> tuple:
        """(magic, version, slots, request_bytes, reply_bytes)."""
        return struct.unpack_from("<5I", self.mm, 0)

    def load(self, off: int) -> int:
        return self._words[off].value   # one aligned 4-byte load

    def store(self, off: int, value: int) -> None:
        self._words[off].value = value & 0xFFFFFFFF

    def request_slot(self, n: int) -> int:
        return HEADER_BYTES + (n % self.slots) * self.request_bytes

    def reply_slot(self, n: int) -> int:
        return (HEADER_BYTES + self.slots * self.request_bytes +
                (n % self.slots) * REPLY_BYTES)

    def message(self) -> str:
        n = min(self.load(MESSAGE), MAX_MESSAGE_BYTES)
        return bytes(self.mm[MESSAGE + 4:MESSAGE + 4 + n]).decode(
            "utf-8", "replace")

    def wait(self, off: int, expected: int, timeout_s: float) -> None:
        """Sleeps while the word is `expected`, at most timeout_s."""
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        _libc.syscall(ctypes.c_long(_SYS_FUTEX),
                      ctypes.c_void_p(ctypes.addressof(self._words[off])),
                      ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(expected),
                      ctypes.byref(ts), None, ctypes.c_int(0))

    def wake(self, off: int) -> None:
        _libc.syscall(ctypes.c_long(_SYS_FUTEX),
                      ctypes.c_void_p(ctypes.addressof(self._words[off])),
                      ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF),
                      None, None, ctypes.c_int(0))

    def close(self) -> None:
        self._words.clear()   # ctypes views pin the mapping
        self.mm.close()
