"""Seeds of //tests/fuzz:step_fuzz: byte strings that decode (FuzzInput,
tests/fuzz/fuzz_input.h, in step_fuzz.cc's order) to a registration the
world accepts and steps it accepts or refuses for one reason, so that the
fuzzer starts next to the interesting checks. Run:
  python3 tests/fuzz/gen_step_seeds.py tests/fuzz/corpus/step_fuzz
and check with STEP_FUZZ_VERBOSE=1 bazel-bin/tests/fuzz/step_fuzz FILE.
"""
import os
import sys


class Enc:
    """Writes what FuzzInput's calls read."""

    def __init__(self):
        self.out = bytearray()

    def byte(self, b):
        self.out.append(b & 0xFF)

    def bool(self, v):
        self.byte(1 if v else 0)

    def range(self, lo, hi, v):
        span = hi - lo
        n = 0
        s = span
        while s:
            n += 1
            s >>= 8
        x = v - lo
        self.out += x.to_bytes(n, 'big') if n else b''

    def raw_bytes(self, max_len, data):
        self.range(0, max_len, len(data))
        self.out += data


# BufferId picks: 0-3 the worker's buffers, 4 a stranger's, 5 none.
def ref(e, buffer, offset_256):
    e.byte(buffer)
    e.bool(True)
    e.range(0, 1023, offset_256)
    e.bool(False)  # no row_stride


POOLS = {'m': 0, 's': 1, 'i': 2, 'x': 3, 'nope': 6, '': 7}


def cache(e, pool, layer, buffer, offset_256):
    e.byte(POOLS[pool])
    e.bool(True)
    e.range(0, 3, layer)
    ref(e, buffer, offset_256)
    e.byte(1)  # no fused parameters


def registration(e, layers, max_tokens=8, max_seqs=4, top_k=16, blocks=4,
                 swa_index=True, ratio=1, index_pool='i'):
    e.byte(0)  # doorbell: buffer 0
    e.range(0, 3, layers)
    off = 0
    for l in range(layers):
        e.bool(True)
        cache(e, 'm', l, 1, off)
        off += 64
        e.bool(True)
        cache(e, 's', l, 1, off)
        off += 64
        e.bool(True)
        cache(e, index_pool, l, 1, off)
        off += 64
        e.byte({0: 0, 1: 1, 4: 2, 16: 3}[ratio])
        e.bool(True)
        e.range(0, 8, 2)  # window
        e.bool(True)
        ref(e, 2, 64 * l)  # topk
        e.bool(True)
        ref(e, 2, 256 + 64 * l)  # index_out
    e.bool(swa_index)
    if swa_index:
        e.byte(POOLS['s'])
        e.bool(True)
        e.range(0, 8, 2)
        ref(e, 3, 0)
    e.bool(True)
    e.range(0, 64, max_tokens)
    e.bool(True)
    e.range(0, 16, max_seqs)
    e.bool(True)
    e.range(0, 64, top_k)
    e.bool(True)
    e.range(0, 16, blocks)
    e.raw_bytes(80, b'seed')
    e.bool(False)  # block_tables buffer
    e.bool(False)  # slot_mappings buffer
    e.byte(1)  # the owner registers


def packed(e, values, lo, hi):
    e.byte(2)  # the right count
    for v in values:
        e.bool(True)
        e.range(lo, hi, v)


def step(e, slots, query_lens, seq_lens, states, tables, cols, top_k,
         finish=True, compressed=None):
    e.byte(1)  # the owner steps
    e.byte(1)  # the registration
    e.byte(1)  # the next step id
    n, seqs = len(slots), len(query_lens)
    e.bool(True)
    e.range(0, 40, n)
    e.bool(True)
    e.range(0, 8, seqs)
    packed(e, slots, -1, 130)
    e.bool(compressed is not None)  # compressed_slot_mapping
    if compressed is not None:
        packed(e, compressed, -1, 130)
    e.range(0, 2, 0)  # compressed entries
    packed(e, seq_lens, 0, 200)
    packed(e, query_lens, 0, 8)
    packed(e, states, -1, 8)
    e.bool(False)  # swa_valid_starts
    e.bool(True)
    e.range(0, 16, cols)
    packed(e, tables, -1, 17)
    e.bool(True)
    e.range(0, 64, top_k)
    e.bool(False)  # deadline
    e.bool(False)  # positions
    e.byte(1)  # tables inline
    e.byte(1)  # mappings inline
    e.bool(finish)


def seed(registration_args, *steps):
    """A registration (keyword arguments of registration()) and its steps
    (argument tuples of step(), a dict of keywords last when any)."""
    e = Enc()
    registration(e, **registration_args)
    for args in steps:
        kw = args[-1] if isinstance(args[-1], dict) else {}
        step(e, *(args[:-1] if kw else args), **kw)
    return bytes(e.out)


TABLE8 = [0, 1, 2, 3, 4, 5, 6, 7]


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    seeds = {
        'register_only': seed({'layers': 2}),
        'two_steps': seed(
            {'layers': 2},
            ([0, 9, 17, 30], [2, 2], [5, 9], [0, 1], TABLE8, 4, 16),
            ([1, 10, 18, 31], [2, 2], [6, 10], [0, 1], TABLE8, 4, 16)),
        'ratio4': seed(
            {'layers': 1, 'ratio': 4},
            ([2, 3], [1, 1], [8, 12], [2, 3], [4, 5, 6, 7], 2, 8,
             {'compressed': [-1, 11]})),
        'depth': seed(
            {'layers': 3, 'index_pool': 'x'},
            ([0, 1, 2], [3], [3], [0], [0, 1, 2, 3], 4, 16,
             {'finish': False}),
            ([3, 4, 5], [3], [6], [0], [0, 1, 2, 3], 4, 16,
             {'finish': False}),
            ([6, 7, 8], [3], [9], [0], [0, 1, 2, 3], 4, 16)),
        # A slot exactly at the pools' capacity (8 x 16 = 128): refused; an
        # off-by-one in the range check is accepted and fails the plan check.
        'slot_at_capacity': seed(
            {'layers': 1},
            ([0, 128], [1, 1], [4, 4], [0, 1], TABLE8, 4, 16)),
        'compressed_slot_at_capacity': seed(
            {'layers': 1, 'ratio': 4},
            ([2, 3], [1, 1], [8, 12], [2, 3], [4, 5, 6, 7], 2, 8,
             {'compressed': [-1, 128]})),
    }
    for name, data in seeds.items():
        with open(os.path.join(out_dir, 'seed_' + name), 'wb') as f:
            f.write(data)


if __name__ == '__main__':
    main(sys.argv[1])
