"""Keeping freed memory for reuse in glibc's malloc, for a scheduler
process that sends a Step every engine step (common/malloc_tuning.h and
docs/STEP_PATH.md say why: without it, glibc hands the memory of each
request back to the kernel and faults it in again for the next)."""

import ctypes

from ._errors import invalid_argument

# glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(limit_mb: int = 64) -> bool:
    """Lets each glibc malloc arena of this process keep up to `limit_mb`
    MiB of freed memory for reuse, and serves blocks under
    min(limit_mb / 2, 32) MiB from the arenas: what kvdepotd does with
    --malloc_keep_freed_mb. Process-wide; call it once, early. False where
    the C library has no mallopt or refuses (another C library, a
    sanitizer's allocator): nothing else changes then."""
    if (isinstance(limit_mb, bool) or not isinstance(limit_mb, int)
            or not 1 <= limit_mb <= 2047):
        raise invalid_argument(
            f"limit_mb = {limit_mb!r} is not an integer in [1, 2047]")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    limit = limit_mb << 20
    return (mallopt(_M_MMAP_THRESHOLD, min(limit // 2, 32 << 20)) == 1
            and mallopt(_M_TRIM_THRESHOLD, limit) == 1)
