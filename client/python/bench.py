"""Median latency of kvdepot calls against a running daemon.

    /usr/bin/python3 client/python/bench.py [ADDRESS]

Creates (or reuses) a V41 pool "pybench" (block_size 64, 128 blocks, one
layer) and times ping, decode-sized stores and a 4096-row load, through a
shared buffer and inline. Figures for docs/PYTHON.md.
"""

import statistics
import sys
import time

import kvdepot as kc

ROW = 512 * 2  # one V41 token of BF16 input, and one BF16 output row


def median_us(fn, n=300, warmup=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    address = sys.argv[1] if len(sys.argv) > 1 else ""
    with kc.connect(address, client_name="bench") as kv:
        kv.create_or_get_pool("pybench", "V41", block_size=64,
                              num_blocks=128, num_layers=1)
        token = bytes(range(0, 128)) * 8  # finite BF16 values
        table = [list(range(64))]
        with kv.allocate_buffer(4096 * ROW) as buf:
            buf.write(token * 4096)
            kv.store("pybench", 0, range(4096), buf.slice())
            cases = [
                ("ping", kv.ping, 300),
                ("store 1 token, inline",
                 lambda: kv.store("pybench", 0, [5], token), 300),
                ("store 64 tokens, buffer",
                 lambda: kv.store("pybench", 0, range(64),
                                  buf.slice(0, 64 * ROW)), 300),
                ("store 64 tokens, inline",
                 lambda: kv.store("pybench", 0, range(64), token * 64), 300),
                ("load 4096 rows, buffer",
                 lambda: kv.load("pybench", 0, seqlen_k=[4096],
                                 block_table=table, out=buf.slice()), 50),
                ("load 4096 rows, inline",
                 lambda: kv.load("pybench", 0, seqlen_k=[4096],
                                 block_table=table), 50),
            ]
            for name, fn, n in cases:
                print(f"{name:28s} {median_us(fn, n):8.0f} us")
        kv.delete_pool("pybench")


if __name__ == "__main__":
    main()
