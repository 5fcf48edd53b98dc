"""kvdepot.keep_freed_memory (no daemon): range checks, and that freed
memory is reused once it is called (the page faults of an allocation churn
in a fresh interpreter, with and without it)."""

import os
import subprocess
import sys
import unittest

import grpc

from kvdepot import KVCacheError, keep_freed_memory

# 50 rounds, in a thread of its own (so a malloc arena of its own), of
# three 4 MiB blocks from the C library's malloc, written and freed last
# first; prints the minor page faults of the rounds after two that let
# glibc settle. The C library's malloc, not Python objects: how CPython
# allocates is its own business. 4 MiB, not less: the interpreter's start
# has already raised glibc's dynamic thresholds past smaller blocks.
CHURN = """
import ctypes, resource, sys, threading
import kvdepot
if sys.argv[1] == "keep":
    assert kvdepot.keep_freed_memory(64)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 4 << 20
def round_():
    blocks = [libc.malloc(SIZE) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    for b in reversed(blocks):
        libc.free(b)
faults = []
def churn():
    round_(); round_()
    a = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(50):
        round_()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - a)
t = threading.Thread(target=churn)
t.start(); t.join()
print(faults[0])
"""


def churn_faults(mode):
    out = subprocess.run([sys.executable, "-c", CHURN, mode], check=True,
                         capture_output=True, text=True, env=os.environ)
    return int(out.stdout.strip())


class KeepFreedMemoryTest(unittest.TestCase):

    def test_rejects_limits_out_of_range(self):
        for bad in (0, -1, 2048, 1.5, "64", True, None):
            with self.assertRaises(KVCacheError) as cm:
                keep_freed_memory(bad)
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("limit_mb", cm.exception.message)

    def test_freed_memory_is_reused(self):
        untuned = churn_faults("default")
        tuned = churn_faults("keep")
        # Up to 50 x 3072 pages when each round goes back to the kernel
        # (152000 measured on the development VM).
        self.assertGreater(untuned, 50 * 1000, (untuned, tuned))
        self.assertLess(tuned, 50, (untuned, tuned))


if __name__ == "__main__":
    unittest.main()
