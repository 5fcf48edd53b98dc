"""kvdepot against a real kvdepotd child process (CPU backend)."""

import array
import ctypes
import os
import random
import struct
import threading
import time
import unittest
from concurrent import futures
from unittest import mock

import grpc

import kvdepot
import kvdepot.step
from kvdepot import INLINE, KVCacheError
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import step_pb2, step_pb2_grpc
from daemon import (Daemon, ctl_decode, ctl_encode, random_bf16,
                    record_bytes, segments_for)

try:
    import numpy
except ImportError:
    numpy = None

# (format, block size): awkward block sizes, every format once.
FORMATS = [("V41", 7), ("V41_FP4", 3), ("FP4_INDEX", 17),
           ("FP8_FP32SF_INDEX", 1), ("MXFP8_INDEX", 133), ("BF16(6)", 64)]
NUM_BLOCKS = 4


def store_calls(kv) -> int:
    return sum(r.calls for r in kv.stats().rpcs if r.rpc == "Store")


def index_calls(kv) -> int:
    """Calls of the three index RPCs the daemon has seen."""
    names = ("ConvertTopk", "SwaDecodeIndex", "PrefillIndex")
    return sum(r.calls for r in kv.stats().rpcs if r.rpc in names)


def i32(values) -> bytes:
    """Packed little-endian int32, as a buffer holds them."""
    return struct.pack(f"<{len(values)}i", *values)


def read_i32(buf, offset, count) -> list:
    return list(struct.unpack(f"<{count}i", buf.read(offset, 4 * count)))


def read_i64(buf, offset) -> int:
    return struct.unpack("<q", buf.read(offset, 8))[0]


class ClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        try:
            cls.kv = cls.daemon.connect(client_name="client_test")
        except BaseException:
            cls.daemon.stop()
            print(cls.daemon.log_text())
            raise

    @classmethod
    def tearDownClass(cls):
        cls.kv.close()
        rc = cls.daemon.stop()
        assert rc == 0, f"kvdepotd exited {rc}:\n{cls.daemon.log_text()}"

    def assertFails(self, code, text, fn, *args, **kwargs):
        with self.assertRaises(KVCacheError) as cm:
            fn(*args, **kwargs)
        self.assertEqual(cm.exception.code, code, str(cm.exception))
        self.assertIn(text, cm.exception.message)
        return cm.exception

    # ------------------------------------------------------------ store/load

    def test_round_trip_matches_kvcachectl_for_every_format(self):
        rng = random.Random(301)
        for fmt, bs in FORMATS:
            with self.subTest(format=fmt, block_size=bs):
                self._round_trip(rng, fmt, bs)

    def _round_trip(self, rng, fmt, bs):
        name = "rt_" + fmt.replace("(", "").replace(")", "")
        info = self.kv.create_pool(name, fmt, block_size=bs,
                                   num_blocks=NUM_BLOCKS, num_layers=2)
        layout = info.layout
        self.assertEqual(layout.block_size, bs)
        elems = layout.elements
        n = min(NUM_BLOCKS * bs, 2 * bs + 1)
        slots = rng.sample(range(NUM_BLOCKS * bs), n - 1)
        slots.insert(rng.randrange(n), -1)  # one padding token
        kv = random_bf16(rng, n * elems)
        self.assertNotEqual(kv, bytes(len(kv)))
        row = elems * 2
        half = n // 2
        # First half through a shared buffer, the rest inline.
        with self.kv.allocate_buffer(half * row + 5) as buf:
            buf.write(kv[:half * row], offset=5)
            written = self.kv.store(name, 1, slots[:half],
                                    buf.slice(5, half * row))
        written += self.kv.store(name, 1, array.array("i", slots[half:]),
                                 kv[half * row:])
        self.assertEqual(written, n - 1)

        # The pool holds exactly the records kvcachectl encodes.
        records = ctl_encode(fmt, kv)
        rec = layout.bytes_per_token
        self.assertEqual(len(records), n * rec)
        pool = self.kv.map_pool(name)
        try:
            for i, s in enumerate(slots):
                if s < 0:
                    continue
                self.assertEqual(record_bytes(pool.view, layout, 1, s),
                                 records[i * rec:(i + 1) * rec],
                                 f"token {i} slot {s}")
            self.assertEqual(bytes(pool.view[:layout.layer_bytes]),
                             bytes(layout.layer_bytes), "layer 0 untouched")
        finally:
            pool.close()

        # A load returns what kvcachectl decodes, inline and into a buffer.
        kept = b"".join(records[i * rec:(i + 1) * rec]
                        for i, s in enumerate(slots) if s >= 0)
        index_format = not layout.do_cast
        want, want_scales = ctl_decode(fmt, kept, index_format)
        self.assertNotEqual(want, bytes(len(want)))
        segs = segments_for(slots, bs)
        got = self.kv.load(name, 1, segments=segs, total_k=n - 1,
                           scales=INLINE if index_format else None)
        self.assertEqual(got.total_k, n - 1)
        self.assertEqual(got.data, want)
        self.assertEqual(got.scales, want_scales)
        rows = (n - 1) * layout.load_data_row_bytes
        srows = (n - 1) * layout.load_scale_row_bytes
        with self.kv.allocate_buffer(rows + srows + 3) as out:
            got = self.kv.load(
                name, 1, segments=segs, total_k=n - 1, out=out.slice(3, rows),
                scales=out.slice(3 + rows, srows) if index_format else None)
            self.assertIsNone(got.data)
            self.assertEqual(out.read(3, rows), want)
            if index_format:
                self.assertEqual(out.read(3 + rows, srows), want_scales)
        if fmt.startswith("BF16"):  # exact: the rows are the input
            self.assertEqual(
                want, b"".join(kv[i * row:(i + 1) * row]
                               for i, s in enumerate(slots) if s >= 0))
        self.kv.delete_pool(name)

    def test_plan_and_sequence_load(self):
        kv = self.kv
        kv.create_pool("plan", "BF16", elements=4, block_size=4, num_blocks=8,
                       num_layers=1)
        rows = random_bf16(random.Random(302), 32 * 4)
        kv.store("plan", 0, range(32), rows)
        plan = kv.build_plan("plan", [6, 3], [[7, 2], [5, -1]])
        self.assertEqual(list(plan.segments),
                         [7, 0, 4, 0, 2, 0, 2, 4, 5, 0, 3, 6])
        self.assertEqual(plan.num_segments, 3)
        self.assertEqual(plan.total_k, 9)
        self.assertEqual(list(plan.cu_rows), [0, 6, 9])
        by_plan = kv.load("plan", 0, segments=plan.segments,
                          total_k=plan.total_k)
        by_seq = kv.load("plan", 0, seqlen_k=[6, 3],
                         block_table=[7, 2, 5, 0])
        self.assertEqual(list(by_seq.cu_rows), [0, 6, 9])
        want = b"".join(rows[t * 8:(t + 1) * 8]
                        for t in [28, 29, 30, 31, 8, 9, 20, 21, 22])
        self.assertEqual(by_plan.data, want)
        self.assertEqual(by_seq.data, want)
        # Compression ratio 2: a block covers 8 tokens, 10 tokens -> 5 rows.
        plan2 = kv.build_plan("plan", [10], [[7, 2]], compress_ratio=2)
        self.assertEqual(list(plan2.segments), [7, 0, 4, 0, 2, 0, 1, 4])
        self.assertEqual(plan2.total_k, 5)

    def test_prefill_load_and_indices(self):
        kv = self.kv
        kv.create_pool("pswa", "BF16(4)", block_size=8, num_blocks=2,
                       num_layers=1)
        kv.create_pool("pmain", "BF16(4)", block_size=4, num_blocks=4,
                       num_layers=1)
        rng = random.Random(303)
        ring = random_bf16(rng, 8 * 4)   # state 1: ring positions 0..7
        comp = random_bf16(rng, 5 * 4)   # compressed tokens 0..4
        chunk = random_bf16(rng, 3 * 4)
        kv.store("pswa", 0, range(8, 16), ring)
        kv.store("pmain", 0, [12, 13, 14, 15, 0], comp)  # blocks [3, 0]
        r = kv.prefill_load("pswa", 0, "pmain", 0, seqlen_k=[10],
                            seqlen_q=[3], swa_state_id=[1], window=4,
                            compress_ratio=2, block_table=[[3, 0]],
                            chunk_kv=chunk)
        self.assertEqual((r.total_k_swa, r.chunk_offset, r.main_kv_offset,
                          r.total_rows), (4, 4, 7, 12))
        self.assertEqual(list(r.cu_compressed), [0, 5])
        # [history: positions 3..6 | chunk (positions 7..9) | compressed].
        self.assertEqual(r.output, ring[3 * 8:7 * 8] + chunk + comp)
        # The chunk went into ring positions 7, 0, 1 after the load.
        after = kv.load("pswa", 0, segments=[[1, 7, 8, 0], [1, 0, 2, 1]],
                        total_k=3)
        self.assertEqual(after.data, chunk)
        # A wait event reaches the daemon, which has no GPU events here:
        # refused by name, the rings untouched.
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "wait_event_ipc_handle: GPU ordering needs the "
                         "cuda backend", kv.prefill_load, "pswa", 0, "pmain",
                         0, seqlen_k=[10], seqlen_q=[3], swa_state_id=[1],
                         window=4, compress_ratio=2, block_table=[[3, 0]],
                         chunk_kv=random_bf16(rng, 3 * 4),
                         wait_event=bytes(64))
        self.assertEqual(kv.load("pswa", 0, segments=[[1, 7, 8, 0],
                                                      [1, 0, 2, 1]],
                                 total_k=3).data, chunk)
        # record_event reaches the daemon on all three calls: refused by
        # name by the CPU backend, nothing written. A plain store's result
        # is still an int, with no event.
        before = kv.load("pswa", 0, segments=[[0, 0, 8, 0], [1, 0, 8, 8]],
                         total_k=16).data
        args = dict(seqlen_k=[10], seqlen_q=[3], swa_state_id=[1], window=4,
                    compress_ratio=2, block_table=[[3, 0]],
                    chunk_kv=random_bf16(rng, 3 * 4))
        needs = "record_event: GPU ordering needs the cuda backend"
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, needs,
                         kv.prefill_load, "pswa", 0, "pmain", 0,
                         record_event=True, **args)
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, needs, kv.store,
                         "pswa", 0, [0], random_bf16(rng, 4),
                         record_event=True)
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, needs, kv.load,
                         "pswa", 0, segments=[[0, 0, 1, 0]], total_k=1,
                         record_event=True)
        self.assertEqual(kv.load("pswa", 0, segments=[[0, 0, 8, 0],
                                                      [1, 0, 8, 8]],
                                 total_k=16).data, before)
        n = kv.store("pmain", 0, [1], random_bf16(rng, 4))
        self.assertIsInstance(n, kvdepot.StoreResult)
        self.assertEqual((n, n + 1, n.recorded_event), (1, 2, b""))
        self.assertEqual(kv.load("pmain", 0, segments=[[0, 0, 1, 0]],
                                 total_k=1).recorded_event, b"")

        pi = kv.prefill_index([10], [3], window=4, compress_ratio=2,
                              compressed_index=[[0, -1], [4, 2], [-1, 1]])
        self.assertEqual((pi.row_width, pi.main_kv_offset, pi.total_rows),
                         (6, 7, 12))
        self.assertEqual(list(pi.index), [1, 2, 3, 4, 7, -1,
                                          2, 3, 4, 5, 11, 9,
                                          3, 4, 5, 6, -1, 8])

        swa = kv.swa_decode_index("pswa", 5, [[1, 6, 5], [0, 3, 2]])
        self.assertEqual((swa.rows, swa.cols), (2, 5))
        self.assertEqual(list(swa.slots), [14, 15, 8, 9, 10,
                                           3, 4, -1, -1, -1])

        t = kv.convert_topk("pmain", [[0, 5, 2, 4]], valid_count=[3],
                            num_tokens=[5], block_table=[[3, 0]])
        self.assertEqual(list(t.slots), [12, -1, 14, -1])
        self.assertEqual((t.rows, t.cols, t.invalid_count), (1, 4, 1))

    # ------------------------------------------------------------ index
    # buffer forms

    def _topk_case(self):
        """A convert_topk batch on pool "tkbuf" (B = 4, 6 blocks) with
        entries out of range: index >= num_tokens, beyond the table, and
        a table entry outside [0, 6)."""
        self.kv.create_or_get_pool("tkbuf", "BF16(4)", block_size=4,
                                   num_blocks=6, num_layers=1)
        rng = random.Random(311)
        batch, k, cols = 3, 5, 3
        num_tokens = [12, rng.randrange(1, 13), rng.randrange(1, 13)]
        valid = [k, rng.randrange(0, k + 1), rng.randrange(0, k + 1)]
        table = [rng.randrange(0, 6) for _ in range(batch * cols)]
        table[1] = 9                      # block 1 of sequence 0
        topk = [rng.randrange(-1, 14) for _ in range(batch * k)]
        topk[0], topk[1] = 13, 5          # >= num_tokens; names table[1]
        return dict(batch=batch, k=k, cols=cols, num_tokens=num_tokens,
                    valid=valid, table=table, topk=topk)

    def test_convert_topk_buffer_forms_match_inline(self):
        """topk, block_table, the slots and the count in buffers: the same
        slots and invalid_count as the inline form; out-of-range entries
        read from a buffer are counted, and the count is set (not added)
        in invalid_count_out as a little-endian int64."""
        kv = self.kv
        c = self._topk_case()
        batch, k, cols = c["batch"], c["k"], c["cols"]
        want = kv.convert_topk("tkbuf", [c["topk"][i * k:(i + 1) * k]
                                         for i in range(batch)],
                               c["valid"], c["num_tokens"],
                               [c["table"][i * cols:(i + 1) * cols]
                                for i in range(batch)])
        self.assertGreaterEqual(want.invalid_count, 2)
        self.assertEqual((want.rows, want.cols, want.recorded_event),
                         (batch, k, b""))
        nk, nt = batch * k * 4, batch * cols * 4
        TOPK, TABLE, SLOTS, WORD = 0, 64, 128, 192
        with kv.allocate_buffer(256) as buf:
            topk_s = buf.slice(TOPK, nk)
            table_s = buf.slice(TABLE, nt)
            slots_s = buf.slice(SLOTS, nk)
            word_s = buf.slice(WORD, 8)
            forms = [
                ("topk", dict(topk=topk_s, k=k)),
                ("table+out", dict(block_table=table_s,
                                   max_blocks_per_seq=cols, out=slots_s)),
                ("all", dict(topk=topk_s, k=k, block_table=table_s,
                             max_blocks_per_seq=cols, out=slots_s,
                             invalid_count_out=word_s)),
                ("in place", dict(topk=topk_s, k=k, out=topk_s,
                                  invalid_count_out=word_s)),
            ]
            for name, kw in forms:
                with self.subTest(form=name):
                    buf.write(b"\xab" * 256)
                    buf.write(i32(c["topk"]), TOPK)
                    buf.write(i32(c["table"]), TABLE)
                    buf.write(b"\xff" * 8, WORD)
                    args = dict(topk=c["topk"], block_table=c["table"],
                                k=k, max_blocks_per_seq=cols)
                    args.update(kw)
                    got = kv.convert_topk(
                        "tkbuf", args.pop("topk"), c["valid"],
                        c["num_tokens"], args.pop("block_table"), **args)
                    self.assertEqual((got.rows, got.cols, got.invalid_count,
                                      got.recorded_event),
                                     (batch, k, want.invalid_count, b""))
                    out = kw.get("out")
                    if out is None:
                        self.assertEqual(list(got.slots), list(want.slots))
                        self.assertEqual(buf.read(SLOTS, nk), b"\xab" * nk)
                    else:
                        self.assertIsNone(got.slots)
                        self.assertEqual(read_i32(buf, out.offset,
                                                  batch * k),
                                         list(want.slots))
                    if "invalid_count_out" in kw:
                        self.assertEqual(read_i64(buf, WORD),
                                         want.invalid_count)
                    else:
                        self.assertEqual(buf.read(WORD, 8), b"\xff" * 8)
                    if out is not topk_s:   # inputs are only read
                        self.assertEqual(read_i32(buf, TOPK, batch * k),
                                         c["topk"])
                    self.assertEqual(read_i32(buf, TABLE, batch * cols),
                                     c["table"])

    def _swa_pool(self):
        """SWA pool "swbuf": rings of 8 slots, 3 states."""
        self.kv.create_or_get_pool("swbuf", "BF16(4)", block_size=8,
                                   num_blocks=3, num_layers=1)

    def test_swa_decode_index_buffer_form_matches_inline(self):
        """out=Buffer.slice(): the slots inline calls return, written into
        exactly the slice."""
        kv = self.kv
        self._swa_pool()
        rng = random.Random(312)
        window, n = 5, 4
        queries = [[rng.randrange(3), rng.randrange(20),
                    rng.randrange(window + 1)] for _ in range(n)]
        queries[0][2] = window
        want = kv.swa_decode_index("swbuf", window, queries)
        self.assertIn(-1, list(want.slots))
        nbytes = n * window * 4
        with kv.allocate_buffer(nbytes + 32) as buf:
            buf.write(b"\xab" * (nbytes + 32))
            got = kv.swa_decode_index("swbuf", window, queries,
                                      out=buf.slice(16, nbytes))
            self.assertIsNone(got.slots)
            self.assertEqual((got.rows, got.cols, got.recorded_event),
                             (n, window, b""))
            self.assertEqual(read_i32(buf, 16, n * window), list(want.slots))
            self.assertEqual(buf.read(0, 16), b"\xab" * 16)
            self.assertEqual(buf.read(16 + nbytes, 16), b"\xab" * 16)

    def _prefill_case(self):
        """Two sequences, W = 4, R = 2: 5 + 3 compressed rows, 5 query
        rows of topk_k = 3."""
        rng = random.Random(313)
        rows, topk_k = 5, 3
        ci = [rng.randrange(-1, 8) for _ in range(rows * topk_k)]
        return dict(seqlen_k=[10, 7], seqlen_q=[3, 2], window=4,
                    compress_ratio=2, swa_valid_start=[0, 3], rows=rows,
                    topk_k=topk_k, ci=ci)

    def test_prefill_index_buffer_forms_match_inline(self):
        """compressed_index, the index and the count in buffers: the same
        index as inline; entries outside [-1, compressed rows) read from a
        buffer become -1 and are counted (inline they are refused)."""
        kv = self.kv
        c = self._prefill_case()
        rows, topk_k = c["rows"], c["topk_k"]
        common = dict(window=c["window"], compress_ratio=c["compress_ratio"],
                      swa_valid_start=c["swa_valid_start"])
        want = kv.prefill_index(c["seqlen_k"], c["seqlen_q"],
                                compressed_index=c["ci"], topk_k=topk_k,
                                **common)
        width = c["window"] + topk_k
        self.assertEqual(want.row_width, width)
        self.assertEqual((want.invalid_count, want.recorded_event), (0, b""))
        shape = (want.row_width, want.main_kv_offset, want.total_rows)
        ni, no = rows * topk_k * 4, rows * width * 4
        CI, INDEX, WORD = 0, 128, 512
        with kv.allocate_buffer(528) as buf:
            ci_s = buf.slice(CI, ni)
            index_s = buf.slice(INDEX, no)
            word_s = buf.slice(WORD, 8)
            forms = [("compressed_index", dict(compressed_index=ci_s)),
                     ("out", dict(out=index_s)),
                     ("all", dict(compressed_index=ci_s, out=index_s,
                                  invalid_count_out=word_s))]
            for name, kw in forms:
                with self.subTest(form=name):
                    buf.write(b"\xab" * 528)
                    buf.write(i32(c["ci"]), CI)
                    buf.write(b"\xff" * 8, WORD)
                    args = dict(compressed_index=c["ci"], topk_k=topk_k,
                                **common)
                    args.update(kw)
                    got = kv.prefill_index(c["seqlen_k"], c["seqlen_q"],
                                           **args)
                    self.assertEqual((got.row_width, got.main_kv_offset,
                                      got.total_rows), shape)
                    self.assertEqual((got.invalid_count,
                                      got.recorded_event), (0, b""))
                    if "out" in kw:
                        self.assertIsNone(got.index)
                        self.assertEqual(read_i32(buf, INDEX, rows * width),
                                         list(want.index))
                    else:
                        self.assertEqual(list(got.index), list(want.index))
                        self.assertEqual(buf.read(INDEX, no), b"\xab" * no)
                    if "invalid_count_out" in kw:
                        self.assertEqual(read_i64(buf, WORD), 0)
                    self.assertEqual(read_i32(buf, CI, rows * topk_k),
                                     c["ci"])

            # Out of range in a buffer: -1 and counted; inline: refused.
            bad = list(c["ci"])
            bad[1], bad[7] = 8, -2
            masked = list(c["ci"])
            masked[1] = masked[7] = -1
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "compressed_index[1] = 8 is outside [-1, 8)",
                             kv.prefill_index, c["seqlen_k"], c["seqlen_q"],
                             compressed_index=bad, topk_k=topk_k, **common)
            ref = kv.prefill_index(c["seqlen_k"], c["seqlen_q"],
                                   compressed_index=masked, topk_k=topk_k,
                                   **common)
            buf.write(i32(bad), CI)
            buf.write(b"\xff" * 8, WORD)
            got = kv.prefill_index(c["seqlen_k"], c["seqlen_q"],
                                   compressed_index=ci_s, topk_k=topk_k,
                                   out=index_s, invalid_count_out=word_s,
                                   **common)
            self.assertEqual(got.invalid_count, 2)
            self.assertEqual(read_i64(buf, WORD), 2)
            self.assertEqual(read_i32(buf, INDEX, rows * width),
                             list(ref.index))

    def test_index_buffer_forms_client_checks(self):
        """A slice whose columns the client cannot know without k,
        max_blocks_per_seq or topk_k, an out that is neither INLINE nor a
        slice, an invalid_count_out that is not a slice: INVALID_ARGUMENT
        naming the parameter, nothing sent. Every call sends the
        session."""
        kv = self.kv
        c = self._topk_case()
        p = self._prefill_case()
        self._swa_pool()
        I = grpc.StatusCode.INVALID_ARGUMENT
        with kv.allocate_buffer(256) as buf:
            s = buf.slice(0, 64)
            topk = dict(valid_count=c["valid"], num_tokens=c["num_tokens"])
            table = [c["table"][i * 3:(i + 1) * 3] for i in range(3)]
            rows = [c["topk"][i * 5:(i + 1) * 5] for i in range(3)]
            pre = dict(window=p["window"], compress_ratio=2)
            calls = index_calls(kv)
            cases = [
                ("k: topk is a Buffer.slice()", kv.convert_topk,
                 ("tkbuf", s), dict(block_table=table, **topk)),
                ("k: topk is a Buffer.slice()", kv.convert_topk,
                 ("tkbuf", s), dict(block_table=s, max_blocks_per_seq=3,
                                    **topk)),
                ("max_blocks_per_seq: block_table is a Buffer.slice()",
                 kv.convert_topk, ("tkbuf", rows),
                 dict(block_table=s, **topk)),
                ("max_blocks_per_seq: block_table is a Buffer.slice()",
                 kv.convert_topk, ("tkbuf", s),
                 dict(block_table=s, k=5, **topk)),
                ("out: pass INLINE or a Buffer.slice()", kv.convert_topk,
                 ("tkbuf", rows), dict(block_table=table, out=bytearray(60),
                                       **topk)),
                ("invalid_count_out: pass None or a Buffer.slice()",
                 kv.convert_topk, ("tkbuf", rows),
                 dict(block_table=table, invalid_count_out=bytearray(8),
                      **topk)),
                ("out: pass INLINE or a Buffer.slice()",
                 kv.swa_decode_index, ("swbuf", 5, [[0, 0, 1]]),
                 dict(out=b"")),
                ("topk_k: compressed_index is a Buffer.slice()",
                 kv.prefill_index, (p["seqlen_k"], p["seqlen_q"]),
                 dict(compressed_index=s, **pre)),
                ("out: pass INLINE or a Buffer.slice()", kv.prefill_index,
                 (p["seqlen_k"], p["seqlen_q"]),
                 dict(compressed_index=p["ci"], topk_k=3, out=None, **pre)),
                ("invalid_count_out: pass None or a Buffer.slice()",
                 kv.prefill_index, (p["seqlen_k"], p["seqlen_q"]),
                 dict(compressed_index=s, topk_k=3, invalid_count_out=0,
                      **pre)),
            ]
            for i, (message, fn, args, kw) in enumerate(cases):
                with self.subTest(case=i, message=message):
                    self.assertFails(I, message, fn, *args, **kw)
            self.assertEqual(index_calls(kv), calls)

        # The session travels in each request, inline forms too.
        sent = []
        real = kv._call

        def spy(method, request, stub=None):
            sent.append((method, request.session_id))
            return real(method, request, stub)

        with mock.patch.object(kv, "_call", spy):
            kv.convert_topk("tkbuf", rows, c["valid"], c["num_tokens"],
                            table)
            kv.swa_decode_index("swbuf", 5, [[0, 0, 1]])
            kv.prefill_index(p["seqlen_k"], p["seqlen_q"],
                             compressed_index=p["ci"], topk_k=3, **pre)
        self.assertTrue(kv.session_id)
        self.assertEqual(sent, [("ConvertTopk", kv.session_id),
                                ("SwaDecodeIndex", kv.session_id),
                                ("PrefillIndex", kv.session_id)])

    def test_index_gpu_ordering_refused_on_cpu(self):
        """record_event and wait_event reach the daemon on all three index
        calls: the CPU backend refuses them by name, and the output
        buffer (and count word) stay as they were."""
        kv = self.kv
        c = self._topk_case()
        p = self._prefill_case()
        self._swa_pool()
        k, cols, batch = c["k"], c["cols"], c["batch"]
        I = grpc.StatusCode.INVALID_ARGUMENT
        with kv.allocate_buffer(1024) as buf:
            topk_s = buf.slice(0, batch * k * 4)
            out_s = buf.slice(128, batch * k * 4)
            word_s = buf.slice(256, 8)
            ci_s = buf.slice(512, p["rows"] * p["topk_k"] * 4)
            index_s = buf.slice(640, p["rows"] * 7 * 4)
            calls = [
                ("convert_topk", lambda **o: kv.convert_topk(
                    "tkbuf", topk_s, c["valid"], c["num_tokens"],
                    c["table"], k=k, max_blocks_per_seq=cols, out=out_s,
                    invalid_count_out=word_s, **o)),
                ("swa_decode_index", lambda **o: kv.swa_decode_index(
                    "swbuf", 3, [[1, 2, 3], [0, 7, 2]],
                    out=buf.slice(128, 24), **o)),
                ("prefill_index", lambda **o: kv.prefill_index(
                    p["seqlen_k"], p["seqlen_q"], window=p["window"],
                    compress_ratio=2, compressed_index=ci_s,
                    topk_k=p["topk_k"], out=index_s,
                    invalid_count_out=word_s, **o)),
            ]
            for name, call in calls:
                for field, kw in (("record_event", dict(record_event=True)),
                                  ("wait_event_ipc_handle",
                                   dict(wait_event=bytes(64)))):
                    with self.subTest(call=name, field=field):
                        buf.write(b"\xab" * 1024)
                        buf.write(i32(c["topk"]), 0)
                        buf.write(i32(p["ci"]), 512)
                        before = buf.read()
                        self.assertFails(
                            I, f"{field}: GPU ordering needs the cuda "
                            "backend", call, **kw)
                        self.assertEqual(buf.read(), before)
                # Without them the same call goes through.
                buf.write(b"\xab" * 1024)
                buf.write(i32(c["topk"]), 0)
                buf.write(i32(p["ci"]), 512)
                before = buf.read()
                self.assertEqual(call().recorded_event, b"")
                self.assertNotEqual(buf.read(), before)

    # ------------------------------------------------------------ errors

    def test_invalid_input_raises_and_changes_nothing(self):
        kv = self.kv
        info = kv.create_pool("bad", "V41", block_size=5, num_blocks=7,
                              num_layers=1)
        elems = info.layout.elements
        kv.store("bad", 0, [0, 1], random_bf16(random.Random(304), 2 * elems))
        pool = kv.map_pool("bad")
        try:
            before = bytes(pool.view)
            self.assertNotEqual(before, bytes(len(before)))
            e = self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                                 "slot_mapping[1] = 35 is outside [-1, 35)",
                                 kv.store, "bad", 0, [2, 35],
                                 bytes(2 * elems * 2))
            self.assertTrue(str(e).startswith("INVALID_ARGUMENT: "))
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, "kv",
                             kv.store, "bad", 0, [2, 3], bytes(10))
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "block_table[0][1] = 9",
                             kv.load, "bad", 0, seqlen_k=[10],
                             block_table=[[0, 9]])
            self.assertFails(grpc.StatusCode.NOT_FOUND, "nope",
                             kv.get_pool, "nope")
            self.assertFails(grpc.StatusCode.ALREADY_EXISTS, "bad",
                             kv.create_pool, "bad", "V41", block_size=5,
                             num_blocks=7, num_layers=1)
            self.assertFails(grpc.StatusCode.FAILED_PRECONDITION,
                             "another layout", kv.create_or_get_pool, "bad",
                             "V41", block_size=6, num_blocks=7, num_layers=1)
            self.assertEqual(
                kv.create_or_get_pool("bad", "V41", block_size=5,
                                      num_blocks=7, num_layers=1).name, "bad")
            # Caught in the client: nothing reaches the daemon.
            calls = store_calls(kv)
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "slot_mapping[2] = 2147483648 does not fit int32",
                             kv.store, "bad", 0, [0, 1, 2**31], b"")
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "slot_mapping[1] = 1.5 is not an integer",
                             kv.store, "bad", 0, [0, 1.5], b"")
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "block_table has 3 values, not a multiple of 2",
                             kv.load, "bad", 0, seqlen_k=[1, 2],
                             block_table=[0, 1, 2])
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "dtype \"fp16\"", kv.store, "bad", 0, [0],
                             b"", dtype="fp16")
            self.assertEqual(store_calls(kv), calls)
            self.assertEqual(bytes(pool.view), before)
        finally:
            pool.close()

    def test_unreachable_daemon_is_unavailable(self):
        self.assertFails(grpc.StatusCode.UNAVAILABLE, "did not answer",
                         kvdepot.connect,
                         self.daemon.dir + "/missing.sock",
                         connect_timeout=0.3)

    # ------------------------------------------------------------ sessions

    def test_sessions_buffers_and_leases(self):
        kv = self.kv
        pools = [p.name for p in kv.list_pools()]
        self.assertEqual(pools, sorted(pools))
        self.assertGreater(kv.stats().sessions, 0)
        # A companion session needs no lease: its buffers live as long as
        # the connection does.
        buffers = kv.stats().buffers
        with self.daemon.connect() as held:
            self.assertGreater(held.session_number, 0)
            self.assertEqual(held.keep_alive(), 0)  # no lease to renew
            buf = held.allocate_buffer(4096)
            buf.write(b"\x01" * 16)
            self.assertEqual(buf.read(0, 16), b"\x01" * 16)
            buf.release()
            self.assertFails(grpc.StatusCode.NOT_FOUND, "buffer",
                             held.release_buffer, buf.id)
        # Dropping the connection releases the session and its buffers.
        gone = self.daemon.connect()
        sid = gone.session_id
        gone.allocate_buffer(1024)
        self.assertEqual(kv.stats().buffers, buffers + 1)
        gone._companion.close()
        deadline = time.monotonic() + 10
        while kv.stats().buffers > buffers and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(kv.stats().buffers, buffers)
        # The session went with the connection: the daemon refuses its id,
        # and the client knows without asking.
        with self.assertRaises(grpc.RpcError) as cm:
            kv.stub.KeepAlive(pb.KeepAliveRequest(session_id=sid),
                              timeout=10)
        self.assertEqual(cm.exception.code(),
                         grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(kvdepot.SessionLost):
            gone.keep_alive()
        gone.close()
        self.assertNotIn(sid, self.daemon.log_text())  # never logged
        # A view still held does not stop release().
        with self.daemon.connect() as c:
            b = c.allocate_buffer(64)
            sub = (ctypes.c_char * 8).from_buffer(b.view, 8)  # an export
            sub[:] = b"\x07" * 8
            self.assertEqual(b.read(8, 8), b"\x07" * 8)
            self.assertEqual(kv.stats().buffers, buffers + 1)
            b.release()
            self.assertIsNone(b.view)
            self.assertEqual(kv.stats().buffers, buffers)
            del sub
        # close() releases what a session still holds.
        with self.daemon.connect() as c:
            c.allocate_buffer(1024)
            self.assertEqual(kv.stats().buffers, buffers + 1)
        self.assertEqual(kv.stats().buffers, buffers)

    # ------------------------------------------------------------ NumPy

    @unittest.skipIf(numpy is None, "NumPy is not installed")
    def test_numpy_inputs(self):
        kv = self.kv
        kv.create_pool("np", "BF16(4)", block_size=3, num_blocks=4,
                       num_layers=1)
        rng = numpy.random.default_rng(301)
        # Float32 values exact in BF16, so the round trip is exact.
        values = (rng.integers(-64, 64, size=(5, 4)) / 8).astype("float32")
        self.assertTrue(values.any())
        slots = numpy.array([4, 0, -1, 11, 7], dtype=numpy.int64)
        self.assertEqual(kv.store("np", 0, slots, values), 4)
        got = kv.load("np", 0, seqlen_k=numpy.array([12], dtype=numpy.int32),
                      block_table=numpy.array([[0, 1, 2, 3]]))
        rows = numpy.frombuffer(got.data, dtype="<u2").reshape(12, 4)
        as_f32 = (rows.astype(numpy.uint32) << 16).view(numpy.float32)
        for token, slot in enumerate(slots):
            if slot >= 0:
                numpy.testing.assert_array_equal(as_f32[slot], values[token])
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "slot_mapping[1] = 4294967296 does not fit int32",
                         kv.store, "np", 0,
                         numpy.array([0, 2**32], dtype=numpy.int64), values)
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "float64", kv.store, "np", 0, slots,
                         values.astype(numpy.float64))
        # A buffer written through buf.numpy(), released while the array
        # lives.
        buffers = kv.stats().buffers
        buf = kv.allocate_buffer(values.nbytes)
        view = buf.numpy(numpy.float32).reshape(values.shape)
        view[:] = values
        self.assertEqual(kv.store("np", 0, [1, 2, 3, 5, 6],
                                  buf.slice(), dtype="fp32"), 5)
        buf.release()
        self.assertEqual(kv.stats().buffers, buffers)
        del view
        again = kv.load("np", 0, segments=[[0, 1, 3, 0], [1, 2, 3, 2]],
                        total_k=3)
        got = (numpy.frombuffer(again.data, dtype="<u2").astype(numpy.uint32)
               << 16).view(numpy.float32).reshape(3, 4)
        numpy.testing.assert_array_equal(got, values[[0, 1, 3]])


class LifecycleTest(unittest.TestCase):
    """close(), a daemon killed and restarted under a client, __version__."""

    def setUp(self):
        self.daemon = Daemon()
        self.addCleanup(self._stop)

    def _stop(self):
        self.daemon.stop()

    def test_closed_client_raises_client_closed_on_every_call(self):
        kv = self.daemon.connect()
        buf = kv.allocate_buffer(64)
        kv.close()
        kv.close()  # twice is fine
        calls = [kv.ping, kv.stats, kv.list_pools, kv.keep_alive,
                 lambda: kv.get_pool("p"), lambda: kv.allocate_buffer(8),
                 lambda: kv.map_pool("p"), lambda: kv.store("p", 0, [0], b""),
                 lambda: kv.load("p", 0, seqlen_k=[1], block_table=[[0]]),
                 lambda: kv.stub, kv.reconnect, lambda: buf.view,
                 lambda: buf.write(b"x"), lambda: buf.slice()]
        for i, call in enumerate(calls):
            with self.subTest(call=i):
                with self.assertRaises(kvdepot.ClientClosed) as cm:
                    call()
                self.assertIsInstance(cm.exception, KVCacheError)
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("closed", cm.exception.message)
        buf.release()  # only unmaps: the daemon released it with the session

    def test_daemon_restart_loses_the_session_until_reconnect(self):
        kv = self.daemon.connect(client_name="restart")
        self.addCleanup(kv.close)
        kv.create_pool("p", "BF16(4)", block_size=4, num_blocks=2,
                       num_layers=1)
        pool = kv.map_pool("p")
        buf = kv.allocate_buffer(32)
        old_slice = buf.slice(0, 32)
        buf.write(random_bf16(random.Random(305), 16))
        kv.store("p", 0, range(4), old_slice)
        old_sid = kv.session_id

        self.daemon.kill_and_restart()
        for i in range(3):  # the next call and every one after it
            with self.subTest(call=i):
                with self.assertRaises(kvdepot.SessionLost) as cm:
                    kv.ping()
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("reconnect()", cm.exception.message)
        self.assertRaises(kvdepot.SessionLost, kv.list_pools)
        self.assertRaises(kvdepot.SessionLost, kv.allocate_buffer, 8)
        # Memory of the dead daemon raises instead of going stale.
        for use in (lambda: pool.view, lambda: buf.view,
                    lambda: buf.read(0, 4), lambda: buf.write(b"x"),
                    buf.slice):
            self.assertRaises(kvdepot.SessionLost, use)
        buf.release()   # nothing to give back: only unmaps
        pool.close()

        kv.reconnect(timeout=20)
        self.assertNotEqual(kv.session_id, old_sid)
        self.assertGreater(kv.session_number, 0)
        kv.ping()
        self.assertEqual(kv.list_pools(), [])  # the new daemon has none
        kv.create_pool("p", "BF16(4)", block_size=4, num_blocks=2,
                       num_layers=1)
        with kv.allocate_buffer(32) as fresh:
            # A slice taken before the restart names a buffer id the new
            # daemon may have given to another buffer: refused in the client.
            with self.assertRaises(kvdepot.SessionLost) as cm:
                kv.store("p", 0, range(4), old_slice)
            self.assertIn(f"buffer {old_slice.buffer_id}",
                          cm.exception.message)
            fresh.write(random_bf16(random.Random(306), 16))
            self.assertEqual(kv.store("p", 0, range(4), fresh.slice(0, 32)),
                             4)

    def test_unauthenticated_session_is_lost(self):
        kv = self.daemon.connect()
        self.addCleanup(kv.close)
        kv.session_id += "0"  # a session the daemon does not know
        kv._metadata = (("kvdepot-session-id", kv.session_id),)
        with self.assertRaises(kvdepot.SessionLost) as cm:
            kv.keep_alive()
        self.assertIn("no longer knows the session", cm.exception.message)
        self.assertRaises(kvdepot.SessionLost, kv.ping)
        kv.reconnect()
        kv.ping()

    def test_version_and_py_typed(self):
        with self.daemon.connect() as kv:
            self.assertEqual(kvdepot.__version__, kv.stats().version)
        self.assertRegex(kvdepot.__version__, r"^\d+\.\d+\.\d+")
        pkg = os.path.dirname(kvdepot.__file__)
        self.assertTrue(os.path.isfile(os.path.join(pkg, "py.typed")),
                        f"no py.typed in {pkg}")


class FakeStep(step_pb2_grpc.StepServicer):
    """A Step service answering from a script: each Step takes the next
    code (OK when the script is empty), after `gate` is set."""

    def __init__(self):
        self.codes = []
        self.requests = []
        self.gate = threading.Event()
        self.gate.set()

    def Step(self, request, context):
        self.requests.append(request.SerializeToString())
        self.gate.wait(10)
        code = self.codes.pop(0) if self.codes else grpc.StatusCode.OK
        if code != grpc.StatusCode.OK:
            context.abort(code, f"scripted {code.name}")
        return step_pb2.StepResponse(queued=len(self.requests))

    def PlanStep(self, request, context):
        """Echoes the request's slot_mapping as the metadata's first
        section (up to 4 tokens) and seq_lens as its second (offset 4);
        names offset 8 as ratio 4's slots."""
        self.requests.append(request.SerializeToString())
        code = self.codes.pop(0) if self.codes else grpc.StatusCode.OK
        if code != grpc.StatusCode.OK:
            context.abort(code, f"scripted {code.name}")
        r = step_pb2.PlanStepResponse(
            metadata=(request.slot_mapping + b"\0" * 16)[:16]
            + request.seq_lens,
            num_tokens=request.num_tokens, slots=0, seq_lens=4)
        r.compressed.add(ratio=4, slots=8)
        r.topk_inputs.add(ratio=1, valid_count=0, num_tokens=4)
        return r

    def StepStream(self, request_iterator, context):
        """The same script as replies: a refusal is the message's answer
        (error_field = "field_of_<code>") and the stream goes on."""
        for request in request_iterator:
            self.requests.append(request.SerializeToString())
            code = self.codes.pop(0) if self.codes else grpc.StatusCode.OK
            if code == grpc.StatusCode.OK:
                yield step_pb2.StepResponse(step_id=request.step_id,
                                            queued=len(self.requests))
            else:
                yield step_pb2.StepResponse(
                    step_id=request.step_id, error_code=code.value[0],
                    error_message=f"scripted {code.name}",
                    error_field=f"field_of_{code.name}")


def serve_fake_step(test, workers):
    """A FakeStep on a local gRPC server and a client of it, both stopped
    when `test` ends."""
    fake = FakeStep()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    step_pb2_grpc.add_StepServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    test.addCleanup(server.stop, None)
    kv = kvdepot.Client(f"127.0.0.1:{port}", open_session=False)
    test.addCleanup(kv.close)
    return fake, kv


class StepAsyncTest(unittest.TestCase):
    """kvdepot.step.step_async against a fake Step service (what the CPU
    daemon cannot do: accept steps) and the real CPU daemon (its refusal
    comes back through the future)."""

    def setUp(self):
        self.fake, self.kv = serve_fake_step(self, workers=2)

    def send(self, step_id=1, **kw):
        return kvdepot.step.step_async(
            self.kv, 7, step_id=step_id, slot_mapping=[3, -1],
            seq_lens=[2], query_lens=[2], positions=[5, 6], **kw)

    def test_returns_before_the_reply(self):
        self.fake.gate.clear()
        t = time.monotonic()
        f = self.send()
        self.assertLess(time.monotonic() - t, 5.0)
        self.assertFalse(f.done())
        self.assertEqual(f.step_id, 1)
        self.fake.gate.set()
        self.assertEqual(f.result().queued, 1)
        self.assertTrue(f.done())
        self.assertEqual(f.result().queued, 1)   # kept
        self.assertEqual(f.retries, 0)
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertEqual((sent.registration_id, sent.step_id,
                          sent.num_tokens, sent.num_seqs), (7, 1, 2, 1))
        self.assertEqual(sent, kvdepot.step.step_request(
            self.kv, 7, step_id=1, slot_mapping=[3, -1], seq_lens=[2],
            query_lens=[2], positions=[5, 6]))

    def test_compressed_slot_mappings_one_entry_per_ratio(self):
        """{ratio: mapping}: one `compressed` entry per ratio, ascending,
        packed like the other arrays; the single-ratio field stays
        unset, and both forms at once or a mis-sized mapping raise before
        anything is sent."""
        self.send(compressed_slot_mappings={128: [-1, 63], 4: [9, -1]}
                  ).result()
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertEqual([e.ratio for e in sent.compressed], [4, 128])
        self.assertEqual(sent.compressed[0].slot_mapping,
                         struct.pack("<2i", 9, -1))
        self.assertEqual(sent.compressed[1].slot_mapping,
                         struct.pack("<2i", -1, 63))
        self.assertEqual(sent.compressed_slot_mapping, b"")
        self.send(step_id=2, compressed_slot_mapping=[-1, 5]).result()
        old = step_pb2.StepRequest.FromString(self.fake.requests[1])
        self.assertEqual(len(old.compressed), 0)
        self.assertEqual(old.compressed_slot_mapping,
                         struct.pack("<2i", -1, 5))
        for bad, what in (
                ({"compressed_slot_mapping": [1, 2],
                  "compressed_slot_mappings": {4: [1, 2]}}, "not both"),
                ({"compressed_slot_mappings": {4: [1, 2, 3]}},
                 "compressed_slot_mappings[4]: 3 entries"),
                ({"compressed_slot_mappings": {1: [1, 2]}},
                 "a layer ratio > 1")):
            with self.assertRaises(KVCacheError) as cm:
                self.send(step_id=3, **bad)
            self.assertIn(what, str(cm.exception))
        self.assertEqual(len(self.fake.requests), 2)

    def test_resource_exhausted_is_sent_again(self):
        """A third step in flight: the same request again, with backoff,
        inside result()."""
        R = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.fake.codes = [R, R, R]
        f = self.send(step_id=4)
        self.assertEqual(f.result().queued, 4)
        self.assertEqual(f.retries, 3)
        self.assertEqual(len(set(self.fake.requests)), 1)   # identical
        self.assertEqual(len(self.fake.requests), 4)

    def test_other_errors_are_raised_not_retried(self):
        self.fake.codes = [grpc.StatusCode.FAILED_PRECONDITION]
        f = self.send()
        for _ in range(2):   # and again on a second result()
            with self.assertRaises(KVCacheError) as cm:
                f.result()
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("scripted", cm.exception.message)
        self.assertEqual((f.retries, len(self.fake.requests)), (0, 1))

    def test_retry_budget(self):
        self.fake.codes = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 1000
        f = self.send(in_flight_retry_s=0.05)
        with self.assertRaises(KVCacheError) as cm:
            f.result()
        self.assertEqual(cm.exception.code,
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("still refused after", cm.exception.message)
        self.assertGreater(f.retries, 0)
        self.fake.codes = [grpc.StatusCode.RESOURCE_EXHAUSTED]
        f = self.send(step_id=2, in_flight_retry_s=0)   # 0: at once
        self.assertRaises(KVCacheError, f.result)
        self.assertEqual(f.retries, 0)

    def test_bad_arguments_raise_before_sending(self):
        with self.assertRaises(KVCacheError) as cm:
            kvdepot.step.step_async(self.kv, 7, step_id=1,
                                    slot_mapping=[2**31], seq_lens=[1],
                                    query_lens=[1])
        self.assertIn("slot_mapping[0] = 2147483648", cm.exception.message)
        self.assertEqual(self.fake.requests, [])

    def test_block_tables_in_buffer(self):
        """Device-resident block tables: the flag and the step's columns
        are sent, no tables; the argument rules raise before sending."""
        f = self.send(top_k=8, block_tables_in_buffer=True,
                      block_table_cols=3)
        f.result()
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertTrue(sent.block_tables_in_buffer)
        self.assertEqual((sent.block_table_cols, sent.block_tables,
                          sent.top_k), (3, b"", 8))
        # Inline tables: no flag, the columns from the rows.
        f = self.send(step_id=2, block_tables=[[4, -1]], top_k=8)
        f.result()
        sent = step_pb2.StepRequest.FromString(self.fake.requests[1])
        self.assertFalse(sent.block_tables_in_buffer)
        self.assertEqual(sent.block_table_cols, 2)
        self.assertEqual(len(sent.block_tables), 8)
        for kw, message in (
                (dict(block_tables_in_buffer=True, block_table_cols=2,
                      block_tables=[[4, -1]]), "not both"),
                (dict(block_tables_in_buffer=True), "block_table_cols = 0"),
                (dict(block_table_cols=2), "only with block_tables_in_"
                 "buffer=True")):
            with self.subTest(kw=kw):
                with self.assertRaises(KVCacheError) as cm:
                    self.send(step_id=3, **kw)
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(message, cm.exception.message)
        self.assertEqual(len(self.fake.requests), 2)

    def test_slot_mappings_in_buffer(self):
        """Device-resident slot mappings: the flag and num_tokens are sent,
        no mapping; the argument rules raise before sending."""
        def send(step_id, **kw):
            return kvdepot.step.step_async(
                self.kv, 7, step_id=step_id, seq_lens=[3], query_lens=[3],
                **kw)
        send(1, slot_mappings_in_buffer=True, num_tokens=3).result()
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertTrue(sent.slot_mappings_in_buffer)
        self.assertEqual((sent.num_tokens, sent.slot_mapping,
                          sent.compressed_slot_mapping, len(sent.compressed)),
                         (3, b"", b"", 0))
        send(2, slot_mapping=[1, 2, -1]).result()
        sent = step_pb2.StepRequest.FromString(self.fake.requests[1])
        self.assertFalse(sent.slot_mappings_in_buffer)
        self.assertEqual(sent.num_tokens, 3)
        for kw, message in (
                (dict(slot_mappings_in_buffer=True, num_tokens=3,
                      slot_mapping=[1, 2, 3]), "slot_mapping: pass it or"),
                (dict(slot_mappings_in_buffer=True, num_tokens=3,
                      compressed_slot_mapping=[-1, -1, 4]),
                 "compressed_slot_mapping: pass it or"),
                (dict(slot_mappings_in_buffer=True, num_tokens=3,
                      compressed_slot_mappings={4: [-1, -1, 4]}),
                 "compressed_slot_mappings: pass it or"),
                (dict(slot_mappings_in_buffer=True), "num_tokens = 0"),
                (dict(), "slot_mapping: needed unless"),
                (dict(slot_mapping=[1, 2], num_tokens=3),
                 "num_tokens = 3: slot_mapping has 2")):
            with self.subTest(kw=kw):
                with self.assertRaises(KVCacheError) as cm:
                    send(3, **kw)
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(message, cm.exception.message)
        self.assertEqual(len(self.fake.requests), 2)

    def _check_buffer_reaches_the_daemon(self, name, layer_kw, kw, arg,
                                         bad_ref, message, good_ref):
        """register_worker(arg=bad_ref) is refused by the CPU daemon's
        check naming `message`; arg=good_ref passes it and reaches the
        CPU backend's refusal of the step path; a Buffer is refused by the
        client."""
        d = Daemon()
        try:
            with d.connect(client_name=name) as kv:
                kv.create_or_get_pool(name, "FP4_INDEX", block_size=4,
                                      num_blocks=2, num_layers=1)
                with kv.allocate_buffer(kvdepot.step.doorbell_bytes(1)) as db, \
                        kv.allocate_buffer(64 * 1024) as io:
                    layer = kvdepot.step.layer(
                        index=kvdepot.step.cache(name, 0, io, row_stride=256),
                        **{k: kvdepot.step.buffer_ref(io, *v)
                           for k, v in layer_kw.items()})
                    kw = dict(kw, doorbell=db, layers=[layer])

                    def register(ref):
                        with self.assertRaises(KVCacheError) as cm:
                            kvdepot.step.register_worker(kv, **kw,
                                                         **{arg: ref})
                        return cm.exception

                    e = register(kvdepot.step.buffer_ref(io, *bad_ref))
                    self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn(message, e.message)
                    e = register(kvdepot.step.buffer_ref(io, *good_ref))
                    self.assertEqual(e.code,
                                     grpc.StatusCode.FAILED_PRECONDITION)
                    self.assertIn("buffer_ref", register(io).message)
        finally:
            d.stop()

    def test_slot_mapping_buffer_reaches_the_daemon(self):
        """register_worker(slot_mappings=...) is sent: the CPU daemon checks
        it before it refuses the step path (a misaligned row stride
        named)."""
        self._check_buffer_reaches_the_daemon(
            "smidx", {}, dict(max_tokens=8, max_seqs=2), "slot_mappings",
            (32768, 34), "slot_mappings.row_stride: 34", (32768, 32))

    def test_block_table_buffer_reaches_the_daemon(self):
        """register_worker(block_tables=...) is sent: the CPU daemon checks
        it before it refuses the step path (a misaligned offset named)."""
        self._check_buffer_reaches_the_daemon(
            "btidx", dict(topk=(8192, 16), index_out=(16384, 16)),
            dict(max_tokens=8, max_seqs=2, max_top_k=4,
                 max_blocks_per_seq=2),
            "block_tables", (32768 + 2, 8),
            "block_tables.offset: 32770 is not a multiple of 4", (32768, 8))

    def test_cpu_daemon_refusal_through_the_future(self):
        d = Daemon()
        try:
            with d.connect(client_name="step_async") as kv:
                f = kvdepot.step.step_async(
                    kv, 12345, step_id=1, slot_mapping=[0], seq_lens=[1],
                    query_lens=[1])
                with self.assertRaises(KVCacheError) as cm:
                    f.result()
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.NOT_FOUND)
                self.assertIn("no registration 12345", cm.exception.message)
        finally:
            d.stop()


class PlanStepTest(unittest.TestCase):
    """kvdepot.step.plan_step against the fake Step service (the request
    sent, the reply's sections read back) and the real CPU daemon (its
    refusal raised)."""

    def setUp(self):
        self.fake, self.kv = serve_fake_step(self, workers=2)

    def test_sends_a_step_request_without_step_id(self):
        p = kvdepot.step.plan_step(self.kv, 7, slot_mapping=[3, -1, 9],
                                   seq_lens=[2, 1, 5], query_lens=[1, 1, 1],
                                   positions=[5, 6, 7])
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertEqual(sent, kvdepot.step.step_request(
            self.kv, 7, step_id=0, slot_mapping=[3, -1, 9],
            seq_lens=[2, 1, 5], query_lens=[1, 1, 1], positions=[5, 6, 7]))
        self.assertEqual(p.num_tokens, 3)
        self.assertEqual(p.array(p.slots(), 3), [3, -1, 9])
        self.assertEqual(p.array(p.reply.seq_lens, 3), [2, 1, 5])
        self.assertEqual(p.slots(4), 8)
        self.assertEqual(p.topk_inputs(1), (0, 4))
        for bad in (lambda: p.slots(16), lambda: p.topk_inputs(4),
                    lambda: p.array(5, 3), lambda: p.array(-1, 1)):
            with self.assertRaises(KVCacheError) as cm:
                bad()
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.INVALID_ARGUMENT)

    def test_device_resident_forms_are_sent(self):
        kvdepot.step.plan_step(self.kv, 7, seq_lens=[3, 4], query_lens=[1, 1],
                               top_k=4, block_tables_in_buffer=True,
                               block_table_cols=2,
                               slot_mappings_in_buffer=True, num_tokens=2)
        sent = step_pb2.StepRequest.FromString(self.fake.requests[0])
        self.assertTrue(sent.block_tables_in_buffer)
        self.assertTrue(sent.slot_mappings_in_buffer)
        self.assertEqual((sent.num_tokens, sent.block_table_cols,
                          sent.slot_mapping, sent.block_tables),
                         (2, 2, b"", b""))

    def test_refusal_raises(self):
        self.fake.codes = [grpc.StatusCode.PERMISSION_DENIED]
        with self.assertRaises(KVCacheError) as cm:
            kvdepot.step.plan_step(self.kv, 7, slot_mapping=[1],
                                   seq_lens=[1], query_lens=[1])
        self.assertEqual(cm.exception.code,
                         grpc.StatusCode.PERMISSION_DENIED)

    def test_cpu_daemon_has_no_registration_to_plan(self):
        d = Daemon()
        try:
            with d.connect(client_name="plan_step") as kv:
                with self.assertRaises(KVCacheError) as cm:
                    kvdepot.step.plan_step(kv, 12345, slot_mapping=[0],
                                           seq_lens=[1], query_lens=[1])
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.NOT_FOUND)
                self.assertIn("no registration 12345", cm.exception.message)
        finally:
            d.stop()


class StepStreamTest(unittest.TestCase):
    """kvdepot.step.StepStream against the fake Step service (accepted
    steps, retries) and the CPU daemon (refusals per message, the stream
    staying open, the binding to the client's session, the per-session
    limit and the slot given back by close())."""

    def setUp(self):
        self.fake, self.kv = serve_fake_step(self, workers=4)

    def send(self, s, step_id):
        return s.send(7, step_id=step_id, slot_mapping=[3, -1],
                      seq_lens=[2], query_lens=[2])

    def test_refusals_raise_and_the_stream_goes_on(self):
        I = grpc.StatusCode.INVALID_ARGUMENT
        R = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.fake.codes = [I, R, R, grpc.StatusCode.OK,
                           grpc.StatusCode.FAILED_PRECONDITION]
        with kvdepot.step.StepStream(self.kv) as s:
            with self.assertRaises(KVCacheError) as cm:
                self.send(s, 1)
            self.assertEqual(cm.exception.code, I)
            self.assertEqual(cm.exception.field, "field_of_INVALID_ARGUMENT")
            # Two refusals for depth: sent again on the same stream.
            self.assertEqual(self.send(s, 1).step_id, 1)
            self.assertEqual(s.retries, 2)
            self.assertRaises(KVCacheError, self.send, s, 2)
            self.assertEqual(self.send(s, 2).step_id, 2)
            self.assertEqual(len(self.fake.requests), 6)
        self.assertRaises(kvdepot.ClientClosed, self.send, s, 3)

    def test_cpu_daemon_refuses_per_message_and_caps_streams(self):
        d = Daemon("--max_step_streams_per_session=1")
        try:
            kv = d.connect(client_name="step_stream")
            other = d.connect(client_name="other")
            s = kvdepot.step.StepStream(kv)
            for _ in range(2):   # refused, and the stream stays open
                with self.assertRaises(KVCacheError) as cm:
                    s.send(12345, step_id=1, slot_mapping=[0],
                           seq_lens=[1], query_lens=[1])
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.NOT_FOUND)
                self.assertIn("no registration 12345", cm.exception.message)
            # A request of another session on this client's stream.
            with self.assertRaises(KVCacheError) as cm:
                s.step(kvdepot.step.step_request(
                    other, 12345, step_id=1, slot_mapping=[0],
                    seq_lens=[1], query_lens=[1]))
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.PERMISSION_DENIED)
            self.assertIn("bound to session", cm.exception.message)
            # A second stream of the session: over its limit.
            extra = kvdepot.step.StepStream(kv)
            with self.assertRaises(KVCacheError) as cm:
                extra.send(12345, step_id=1, slot_mapping=[0],
                           seq_lens=[1], query_lens=[1])
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("--max_step_streams_per_session = 1",
                          cm.exception.message)
            # Another session is not limited by it.
            with kvdepot.step.StepStream(other) as o:
                self.assertRaises(KVCacheError, o.send, 1, step_id=1,
                                  slot_mapping=[0], seq_lens=[1],
                                  query_lens=[1])
            # close() gives the slot back (the daemon sees the cancel
            # shortly after).
            s.close()
            deadline = time.monotonic() + 10
            while True:
                again = kvdepot.step.StepStream(kv)
                try:
                    again.send(12345, step_id=1, slot_mapping=[0],
                               seq_lens=[1], query_lens=[1])
                except KVCacheError as e:
                    again.close()
                    if e.code == grpc.StatusCode.NOT_FOUND:
                        break
                    self.assertEqual(e.code,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.01)
            kv.close()
            other.close()
        finally:
            d.stop()


class StepRingTest(unittest.TestCase):
    """kvdepot.step.StepRing against the CPU daemon (its step path refuses
    every registration, so every reply is a refusal): refusals raise and
    the ring goes on, submit()/collect() in order, another session's
    request refused, a request too large for its slot, a counter written
    out of range failing the ring, the stream limits and close()."""

    def setUp(self):
        self.d = Daemon("--max_step_streams_per_session=1")
        self.addCleanup(self.d.stop)
        self.kv = self.d.connect(client_name="step_ring")
        self.addCleanup(self.kv.close)

    def req(self, kv, step_id, registration=12345, **extra):
        return kvdepot.step.step_request(
            kv, registration, step_id=step_id, slot_mapping=[0],
            seq_lens=[1], query_lens=[1], **extra)

    def test_refusals_raise_and_the_ring_goes_on(self):
        with kvdepot.step.StepRing(self.kv, slots=2,
                                   request_bytes=4096) as r:
            self.assertEqual(r.slots, 2)
            for step_id in (1, 2, 3):
                with self.assertRaises(KVCacheError) as cm:
                    r.step(self.req(self.kv, step_id))
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.NOT_FOUND)
                self.assertIn("no registration 12345", cm.exception.message)
            # Both halves: two outstanding, a third refused here, the
            # replies in order.
            self.assertEqual(r.submit(self.req(self.kv, 7)), 3)
            self.assertEqual(r.submit(self.req(self.kv, 8)), 4)
            with self.assertRaises(KVCacheError) as cm:
                r.submit(self.req(self.kv, 9))
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertEqual(r.collect().step_id, 7)
            self.assertEqual(r.collect().step_id, 8)
            self.assertEqual(r.uncollected, 0)
            # Another session's request on this client's ring.
            other = self.d.connect(client_name="other")
            try:
                with self.assertRaises(KVCacheError) as cm:
                    r.step(self.req(other, 1))
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.PERMISSION_DENIED)
                self.assertIn("belongs to session", cm.exception.message)
            finally:
                other.close()
            # Too large for a 4096-byte slot: refused before it is written.
            with self.assertRaises(KVCacheError) as cm:
                r.step(kvdepot.step.step_request(
                    self.kv, 1, step_id=1, slot_mapping=list(range(2000)),
                    seq_lens=[1], query_lens=[1]))
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(r.uncollected, 0)
        self.assertRaises(kvdepot.ClientClosed, r.submit, self.req(self.kv, 1))

    def test_step_async_settles_in_result(self):
        with kvdepot.step.StepRing(self.kv) as r:
            f = r.step_async(self.req(self.kv, 5))
            self.assertEqual(f.step_id, 5)
            self.assertFalse(f.done())
            # Another step before result(): refused on this side, by
            # step_async() and by step() alike.
            for send in (r.step_async, r.step):
                with self.assertRaises(KVCacheError) as cm:
                    send(self.req(self.kv, 6))
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.FAILED_PRECONDITION)
            for _ in range(2):   # raised, and again on a later call
                with self.assertRaises(KVCacheError) as cm:
                    f.result()
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.NOT_FOUND)
            self.assertTrue(f.done())
            self.assertEqual(f.retries, 0)
            self.assertEqual(r.uncollected, 0)
            self.assertRaises(KVCacheError, r.step, self.req(self.kv, 7))

    def test_a_counter_out_of_range_fails_the_ring(self):
        r = kvdepot.step.StepRing(self.kv, slots=4, request_bytes=4096)
        try:
            mem = r._mem
            mem.store(kvdepot._step_ring.SUBMITTED, 100)
            mem.wake(kvdepot._step_ring.SUBMITTED)
            deadline = time.monotonic() + 10
            while mem.load(kvdepot._step_ring.STATE) == 0:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.005)
            with self.assertRaises(KVCacheError) as cm:
                r.submit(self.req(self.kv, 1))
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("step_ring.submitted", cm.exception.message)
        finally:
            r.close()

    def test_rings_share_the_stream_limit_and_close_gives_it_back(self):
        first = kvdepot.step.StepRing(self.kv)
        with self.assertRaises(KVCacheError) as cm:
            kvdepot.step.StepRing(self.kv)
        self.assertEqual(cm.exception.code,
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("--max_step_streams_per_session = 1",
                      cm.exception.message)
        first.close()
        first.close()   # idempotent
        with kvdepot.step.StepRing(self.kv) as again:
            self.assertRaises(KVCacheError, again.send, 12345, step_id=1,
                              slot_mapping=[0], seq_lens=[1],
                              query_lens=[1])
        with self.assertRaises(KVCacheError) as cm:
            kvdepot.step.StepRing(self.kv, slots=3)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("open_step_ring.slots", cm.exception.message)


if __name__ == "__main__":
    unittest.main()
