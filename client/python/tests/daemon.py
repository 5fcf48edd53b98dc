"""Test helpers: a kvdepotd child process on a temporary socket, and the
kvcachectl format encoder/decoder, located through environment variables
the sh_test runner sets (KVDEPOT_BIN, KVCACHECTL_BIN)."""

import os
import random
import signal
import struct
import subprocess
import tempfile
from typing import List, Optional, Tuple

import kvdepot


class Daemon:
    """kvdepotd --listen=<tmp>/kv.sock; stop() drains it with SIGTERM."""

    def __init__(self, *extra_flags: str):
        self.dir = tempfile.mkdtemp(prefix="kvpy")
        self.socket = os.path.join(self.dir, "kv.sock")
        self.log = open(os.path.join(self.dir, "kvdepotd.log"), "wb")
        self.flags = extra_flags
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [os.environ["KVDEPOT_BIN"], f"--listen={self.socket}",
             *self.flags], stdout=self.log, stderr=subprocess.STDOUT)

    def kill_and_restart(self) -> None:
        """SIGKILL (no drain: the sessions die with the process), then a new
        kvdepotd on the same socket path."""
        self.proc.kill()
        self.proc.wait()
        self.proc = self._start()

    def connect(self, **options) -> kvdepot.Client:
        options.setdefault("connect_timeout", 20.0)
        return kvdepot.connect(self.socket, **options)

    def stop(self) -> int:
        """SIGTERM, then the exit code (0 = drained cleanly)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # did not drain: a failure
            self.proc.kill()
            self.proc.wait()
            rc = -signal.SIGKILL
        self.log.close()
        return rc

    def log_text(self) -> str:
        with open(os.path.join(self.dir, "kvdepotd.log"), "rb") as f:
            return f.read().decode(errors="replace")


def _ctl(*args: str) -> None:
    r = subprocess.run([os.environ["KVCACHECTL_BIN"], "format", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise AssertionError(f"kvcachectl format {' '.join(args)} exited "
                             f"{r.returncode}: {r.stdout.decode()}")


def ctl_encode(fmt: str, bf16: bytes) -> bytes:
    """kvcachectl format encode: BF16 rows -> records [data | scales]."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        with open(src, "wb") as f:
            f.write(bf16)
        _ctl("encode", fmt, "--in", src, "--out", dst)
        with open(dst, "rb") as f:
            return f.read()


def ctl_decode(fmt: str, records: bytes,
               with_scales: bool) -> Tuple[bytes, Optional[bytes]]:
    """kvcachectl format decode: records -> what a segment load returns."""
    with tempfile.TemporaryDirectory() as d:
        src, dst, sc = (os.path.join(d, n) for n in ("in", "out", "scales"))
        with open(src, "wb") as f:
            f.write(records)
        args = ["decode", fmt, "--in", src, "--out", dst]
        if with_scales:
            args += ["--scales_out", sc]
        _ctl(*args)
        with open(dst, "rb") as f:
            data = f.read()
        if not with_scales:
            return data, None
        with open(sc, "rb") as f:
            return data, f.read()


def random_bf16(rng: random.Random, count: int) -> bytes:
    """`count` BF16 values (top halves of float32 normals), little-endian."""
    out = bytearray()
    for _ in range(count):
        bits = struct.unpack("<I", struct.pack("<f", rng.gauss(0.0, 2.0)))[0]
        out += struct.pack("<H", bits >> 16)
    return bytes(out)


def record_bytes(pool_view: memoryview, layout, layer: int,
                 slot: int) -> bytes:
    """The stored record of `slot` in a mapped pool, as [data | scales]
    (PoolLayout's two arrangements)."""
    b, t = divmod(slot, layout.block_size)
    base = layer * layout.layer_stride + b * layout.block_stride
    if layout.token_interleaved:
        start = base + t * layout.bytes_per_token
        return bytes(pool_view[start:start + layout.bytes_per_token])
    data = base + t * layout.data_bytes
    sf = base + layout.block_size * layout.data_bytes + t * layout.sf_bytes
    return bytes(pool_view[data:data + layout.data_bytes]) + bytes(
        pool_view[sf:sf + layout.sf_bytes])


def segments_for(slots: List[int], block_size: int) -> List[List[int]]:
    """One-row segments loading the non-padding slots in order."""
    rows = [s for s in slots if s >= 0]
    return [[s // block_size, s % block_size, s % block_size + 1, r]
            for r, s in enumerate(rows)]
