"""kvdepot.torch against a real kvdepotd (CPU backend) with CPU tensors
(Debian's python3-torch in CI): zero copy both ways, bit-identical round
trips against the NumPy / bytes path, the index RPCs, and every input check
(before anything is sent). Skipped where torch is not installed."""

import ctypes
import gc
import os
import random
import struct
import subprocess
import sys
import unittest

import grpc

import kvdepot
from daemon import Daemon, random_bf16, record_bytes

try:
    import torch

    import kvdepot.torch as kt
except ImportError:  # no torch: every test skips
    torch = None  # type: ignore[assignment]
    kt = None  # type: ignore[assignment]

NEEDS_TORCH = unittest.skipIf(torch is None, "PyTorch is not installed")


def bf16_tensor(seed: int, rows: int, cols: int) -> "torch.Tensor":
    """Random BF16 rows (from the same bytes the bytes path would send)."""
    raw = random_bf16(random.Random(seed), rows * cols)
    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(
        rows, cols)


def raw(t: "torch.Tensor") -> bytes:
    """The bytes of a contiguous CPU tensor."""
    import ctypes

    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


class ImportWithoutTorchTest(unittest.TestCase):
    def test_kvdepot_imports_without_torch(self):
        # torch made unimportable: kvdepot works, kvdepot.torch says why.
        code = ("import sys; sys.modules['torch'] = None\n"
                "import kvdepot, kvdepot.step\n"
                "print(kvdepot.step.doorbell_bytes(3))\n"
                "try:\n    import kvdepot.torch\n"
                "except ImportError as e:\n    print('ImportError')\n")
        r = subprocess.run([sys.executable, "-c", code],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=dict(os.environ))
        self.assertEqual(r.stdout.decode().split(), ["512", "ImportError"],
                         r.stdout.decode())


@NEEDS_TORCH
class TorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # The CPU backend here even on a GPU host (auto would pick CUDA,
        # whose pools are device memory: gpu_torch_test covers those).
        cls.daemon = Daemon("--backend=cpu")
        cls.kv = cls.daemon.connect(client_name="torch_test")

    @classmethod
    def tearDownClass(cls):
        cls.kv.close()
        assert cls.daemon.stop() == 0, cls.daemon.log_text()

    def assertFails(self, code, text, fn, *args, **kwargs):
        with self.assertRaises(kvdepot.KVCacheError) as cm:
            fn(*args, **kwargs)
        self.assertEqual(cm.exception.code, code, cm.exception.message)
        self.assertIn(text, cm.exception.message)

    # ------------------------------------------------------------ buffers

    def test_legacy_ipc_handle_formats(self):
        # storage._share_cuda_(): 64 bytes (older torch) or a version and
        # a kind byte before them (newer torch; b"c": cudaMalloc).
        h = bytes(range(64))
        self.assertEqual(kt._ipc_mem_handle(h), h)
        self.assertEqual(kt._ipc_mem_handle(b"\x01c" + h), h)
        for bad in (b"\x01e" + h, h[:10], h + b"xy" + h):
            with self.assertRaises(kvdepot.KVCacheError) as e:
                kt._ipc_mem_handle(bad)
            self.assertIn("register_tensor", e.exception.message)

    def test_buffer_tensor_is_the_buffer(self):
        kv = self.kv
        with kv.allocate_buffer(4096) as buf:
            t = kt.buffer_tensor(kv, buf)
            self.assertEqual((t.dtype, tuple(t.shape)), (torch.uint8, (4096,)))
            # Tensor -> buffer.
            t[10:14] = torch.tensor([1, 2, 3, 250], dtype=torch.uint8)
            self.assertEqual(buf.read(10, 4), bytes([1, 2, 3, 250]))
            # Buffer -> tensor, through a typed view at an offset.
            f = kt.buffer_tensor(kv, buf, torch.float32, (4, 8), offset=256)
            buf.write(bytes(range(128)), offset=256)
            self.assertEqual(raw(f), bytes(range(128)))
            f[3, 7] = 1.5
            self.assertEqual(buf.read(256 + 31 * 4, 4),
                             raw(torch.tensor([1.5], dtype=torch.float32)))
            self.assertEqual(f.data_ptr() - t.data_ptr(), 256)
            del t, f
        # The tensor keeps its Buffer alive: dropped by the caller, it is
        # still recognized (its slice) until released.
        buf = kv.allocate_buffer(64)
        ident = buf.id
        t = kt.buffer_tensor(kv, buf, torch.bfloat16, (4, 8))
        del buf
        gc.collect()
        s = kt._slice_of(kv, t)
        self.assertEqual((s.buffer_id, s.offset, s.length), (ident, 0, 64))
        kv.release_buffer(ident)
        # A released buffer's tensors still map the memory but are no
        # longer its buffer: they go inline.
        buf = kv.allocate_buffer(64)
        t = kt.buffer_tensor(kv, buf)
        buf.release()
        self.assertIsNone(kt._slice_of(kv, t))
        t[0] = 5   # still mapped: no crash

    def test_fused_store_equals_the_raw_request(self):
        """Client.store(fused=FusedStore) and kt.store(fused=...) send what
        a hand-built StoreRequest.fused does (pools byte-equal), and the
        daemon applied it (a plain store of the same rows differs)."""
        import struct

        from kvdepot.v1 import kvdepot_pb2 as pb
        kv = self.kv
        n, e, maxpos = 9, 24, 32
        for name in ("fz_raw", "fz_client", "fz_torch", "fz_plain"):
            kv.create_pool(name, "BF16", elements=e, block_size=4,
                           num_blocks=4, num_layers=2)
        x = bf16_tensor(17, n, e)
        self.assertTrue(bool((x != 0).any()))
        slots = [3, 0, -1, 5, 6, 7, 12, 13, 1]
        positions = [4, 0, 1, 9, 31, 2, 3, 5, 6]
        weight = bf16_tensor(5, 1, 16).reshape(16)
        g = torch.Generator().manual_seed(3)
        cos_sin = torch.randn(maxpos, 8, generator=g)
        fused = kvdepot.FusedStore(
            norm_end=16, norm_weight=raw(weight), positions=positions,
            cos_sin=raw(cos_sin), max_position=maxpos, rope_dim=8,
            rope_offset=16, eps=1e-5)
        req = pb.StoreRequest(
            session_id=kv.session_id, pool="fz_raw", layer=1, num_tokens=n,
            slot_mapping=struct.pack(f"<{n}i", *slots),
            dtype=pb.INPUT_DTYPE_BF16, kv=pb.DataRef(inline_data=raw(x)),
            fused=pb.FusedStoreOptions(
                norm_begin=0, norm_end=16,
                norm_weight=pb.DataRef(inline_data=raw(weight)), eps=1e-5,
                rope=pb.ROPE_STYLE_INTERLEAVED, rope_offset=16, rope_dim=8,
                positions=pb.DataRef(inline_data=struct.pack(
                    f"<{n}q", *positions)),
                cos_sin=pb.DataRef(inline_data=raw(cos_sin)),
                max_position=maxpos))
        self.assertEqual(kv._call("Store", req).tokens_written, 8)
        self.assertEqual(kv.store("fz_client", 1, slots, raw(x),
                                  dtype="bf16", fused=fused), 8)
        self.assertEqual(kt.store(kv, "fz_torch", 1, torch.tensor(
            slots, dtype=torch.int32), x, fused=fused), 8)
        kt.store(kv, "fz_plain", 1, torch.tensor(slots, dtype=torch.int32),
                 x)
        pools = [kt.pool_layer_tensor(kv, p, 1).raw.clone() for p in
                 ("fz_raw", "fz_client", "fz_torch", "fz_plain")]
        self.assertTrue(bool((pools[0] != 0).any()))
        self.assertTrue(torch.equal(pools[0], pools[1]))
        self.assertTrue(torch.equal(pools[0], pools[2]))
        self.assertFalse(torch.equal(pools[0], pools[3]))
        # Checked in the client: positions per token, a known RoPE style.
        bad = kvdepot.FusedStore(**{**fused.__dict__,
                                    "positions": positions[:-1]})
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "fused.positions: 8 int64 entries, slot_mapping 9",
                         kv.store, "fz_client", 1, slots, raw(x),
                         dtype="bf16", fused=bad)
        bad = kvdepot.FusedStore(**{**fused.__dict__, "rope": "gptj"})
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, "fused.rope",
                         kt.store, kv, "fz_client", 1, torch.tensor(
                             slots, dtype=torch.int32), x, fused=bad)

    def test_store_and_load_bit_identical_to_the_bytes_path(self):
        kv = self.kv
        for fmt, elements in (("V41", 0), ("BF16", 12)):
            with self.subTest(fmt=fmt):
                for name in (f"a_{fmt}", f"b_{fmt}", f"c_{fmt}"):
                    kv.create_pool(name, fmt, elements=elements,
                                   block_size=7, num_blocks=5, num_layers=2)
                L = kv.get_pool(f"a_{fmt}").layout
                n, e = 13, L.elements
                x = bf16_tensor(301, n, e)
                self.assertTrue(bool((x != 0).any()))
                slots = torch.tensor([3, 0, -1, 20, 34, 7, 8, 9, 10, 11, 12,
                                      13, 1], dtype=torch.int32)
                # Bytes path, a plain tensor (inline) and a buffer view.
                self.assertEqual(kv.store(f"a_{fmt}", 1, raw(slots),
                                          raw(x)), 12)
                self.assertEqual(kt.store(kv, f"b_{fmt}", 1, slots, x), 12)
                with kv.allocate_buffer(n * e * 2) as buf:
                    xb = kt.buffer_tensor(kv, buf, torch.bfloat16, (n, e))
                    xb.copy_(x)
                    # It travels as the buffer's slice, not inline.
                    self.assertEqual(kt._slice_of(kv, xb),
                                     buf.slice(0, n * e * 2))
                    self.assertEqual(kt.store(kv, f"c_{fmt}", 1, slots, xb),
                                     12)
                    del xb
                a, b, c = (kv.map_pool(f"{p}_{fmt}") for p in "abc")
                try:
                    self.assertEqual(bytes(a.view), bytes(b.view))
                    self.assertEqual(bytes(a.view), bytes(c.view))
                finally:
                    for m in (a, b, c):
                        m.close()
                # Loads: tensor result == the bytes path's rows.
                table = torch.tensor([[0, 1, 2], [4, 3, 0]],
                                     dtype=torch.int32)
                ref = kv.load(f"a_{fmt}", 1, seqlen_k=[15, 10],
                              block_table=[[0, 1, 2], [4, 3, 0]])
                got = kt.load(kv, f"a_{fmt}", 1,
                              seqlen_k=torch.tensor([15, 10],
                                                    dtype=torch.int32),
                              block_table=table)
                self.assertEqual((got.dtype, tuple(got.shape)),
                                 (torch.bfloat16, (25, e)))
                self.assertEqual(raw(got), ref.data)
                # Into a buffer view: written in place, no copy.
                with kv.allocate_buffer(25 * e * 2 + 64) as out:
                    o = kt.buffer_tensor(kv, out, torch.bfloat16,
                                         (25, e), offset=64)
                    got2 = kt.load(kv, f"a_{fmt}", 1,
                                   seqlen_k=torch.tensor(
                                       [15, 10], dtype=torch.int32),
                                   block_table=table, out=o)
                    self.assertEqual(got2.data_ptr(), o.data_ptr())
                    self.assertEqual(out.read(64, 25 * e * 2), ref.data)
                    del o, got2
                if fmt == "BF16":  # exact: sequence 0's rows are slots 0..14
                    where = {s: i for i, s in enumerate(slots.tolist())}
                    for s in range(15):
                        want = x[where[s]] if s in where else \
                            torch.zeros(e, dtype=torch.bfloat16)
                        self.assertTrue(torch.equal(got[s], want), s)

    def test_index_format_load_needs_scales(self):
        kv = self.kv
        kv.create_pool("idx", "FP4_INDEX", block_size=4, num_blocks=3,
                       num_layers=1)
        L = kv.get_pool("idx").layout
        x = bf16_tensor(302, 6, L.elements)
        kt.store(kv, "idx", 0, torch.arange(6, dtype=torch.int32), x)
        table = torch.tensor([[0, 1]], dtype=torch.int32)
        seq = torch.tensor([6], dtype=torch.int32)
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, "scales_out",
                         kt.load, kv, "idx", 0, seqlen_k=seq,
                         block_table=table)
        sc = torch.zeros(6, L.load_scale_row_bytes, dtype=torch.uint8)
        data = kt.load(kv, "idx", 0, seqlen_k=seq, block_table=table,
                       scales_out=sc)
        ref = kv.load("idx", 0, seqlen_k=[6], block_table=[[0, 1]],
                      scales=kvdepot.INLINE)
        self.assertEqual(raw(data), ref.data)
        self.assertEqual(raw(sc), ref.scales)

    def test_pool_made_again_with_another_layout(self):
        kv = self.kv
        one = torch.tensor([0], dtype=torch.int32)
        kv.create_pool("again", "BF16(4)", block_size=2, num_blocks=2,
                       num_layers=1)
        kt.store(kv, "again", 0, one, bf16_tensor(312, 1, 4))
        self.assertEqual(tuple(kt.load(kv, "again", 0, segments=torch.tensor(
            [[0, 0, 1, 0]], dtype=torch.int32), total_k=1).shape), (1, 4))
        kv.delete_pool("again")
        kv.create_pool("again", "BF16(8)", block_size=2, num_blocks=2,
                       num_layers=1)
        y = bf16_tensor(313, 1, 8)
        kv.store("again", 0, [0], raw(y))     # the cache still says 4
        got = kt.load(kv, "again", 0, segments=torch.tensor(
            [[0, 0, 1, 0]], dtype=torch.int32), total_k=1)
        self.assertTrue(torch.equal(got, y))
        self.assertEqual(kt.store(kv, "again", 0, one, y), 1)

    def test_cuda_array_interface_exported(self):
        # What torch.as_tensor(..., device="cuda") reads (CAI version 3).
        class FakeMapping:
            ptr = 0x7F0000000000

        owner = object()
        cai = kt._CudaArray(FakeMapping(), 4096, 512, owner)
        self.assertEqual(cai.__cuda_array_interface__, {
            "shape": (512,), "typestr": "|u1",
            "data": (0x7F0000001000, False), "strides": None,
            "version": 3, "stream": None})
        self.assertIs(cai.owner, owner)

    # ------------------------------------------------------------ pools

    def test_pool_layer_views_alias_the_pool(self):
        kv = self.kv
        for fmt in ("V41", "FP4_INDEX", "MXFP8_INDEX", "DS_MLA_FP8"):
            with self.subTest(fmt=fmt):
                name = f"view_{fmt}"
                kv.create_pool(name, fmt, block_size=5, num_blocks=4,
                               num_layers=3)
                L = kv.get_pool(name).layout
                x = bf16_tensor(303, 20, L.elements)
                kt.store(kv, name, 2, torch.arange(20, dtype=torch.int32), x)
                v = kt.pool_layer_tensor(kv, name, 2)
                self.assertEqual(tuple(v.data.shape),
                                 (4, 5, L.data_bytes))
                self.assertEqual(v.layout.format, L.format)
                m = kv.map_pool(name)
                try:
                    for slot in range(20):
                        b, t = divmod(slot, 5)
                        rec = raw(v.data[b, t]) + (
                            raw(v.scales[b, t]) if v.scales is not None
                            else b"") + (
                            raw(v.tail[b, t]) if v.tail is not None
                            else b"")
                        self.assertEqual(rec, record_bytes(m.view, L, 2,
                                                           slot), slot)
                        if v.records is not None:
                            self.assertEqual(raw(v.records[b, t]), rec)
                    # DS_MLA_FP8's tail: the input's 64 RoPE values as
                    # stored (BF16, unchanged).
                    self.assertEqual(v.tail is not None,
                                     fmt == "DS_MLA_FP8")
                    if v.tail is not None:
                        self.assertEqual(L.tail_bytes, 128)
                        self.assertEqual(L.scale_rounding, "pow2_ceil")
                        self.assertEqual(raw(v.tail[1, 2]),
                                         raw(x[7, 512:].contiguous()))
                    self.assertEqual(v.raw.numel(), L.layer_bytes)
                    self.assertEqual(raw(v.raw), bytes(
                        m.view[2 * L.layer_stride:
                               2 * L.layer_stride + L.layer_bytes]))
                finally:
                    m.close()

    def test_write_through_pool_view_read_by_load(self):
        kv = self.kv
        kv.create_pool("wv", "BF16", elements=8, block_size=3, num_blocks=4,
                       num_layers=2)
        v = kt.pool_layer_tensor(kv, "wv", 1)
        vals = bf16_tensor(304, 1, 8)[0]
        v.data.view(torch.bfloat16)[2, 1] = vals   # slot 7
        r = kv.load("wv", 1, segments=[[2, 1, 2, 0]], total_k=1)
        self.assertEqual(r.data, raw(vals))
        # And the other way: a store shows in the view at once.
        y = bf16_tensor(305, 1, 8)
        kt.store(kv, "wv", 1, torch.tensor([11], dtype=torch.int32), y)
        self.assertTrue(torch.equal(v.data.view(torch.bfloat16)[3, 2], y[0]))
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "layer = 2 is outside [0, 2)",
                         kt.map_pool_tensors(kv, "wv").layer, 2)

    # ------------------------------------------------------------ indices

    def test_index_calls_equal_the_array_path(self):
        kv = self.kv
        kv.create_pool("tswa", "BF16(4)", block_size=8, num_blocks=2,
                       num_layers=1)
        kv.create_pool("tmain", "BF16(4)", block_size=4, num_blocks=4,
                       num_layers=1)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        swa = kt.swa_decode_index(kv, "tswa", 5, i32([[1, 6, 5], [0, 3, 2]]))
        self.assertEqual(swa.tolist(), [[14, 15, 8, 9, 10],
                                        [3, 4, -1, -1, -1]])
        t = kt.convert_topk(kv, "tmain", i32([[0, 5, 2, 4]]), i32([3]),
                            i32([5]), i32([[3, 0]]))
        self.assertEqual(t.tolist(), [[12, -1, 14, -1]])
        self.assertEqual(t.dtype, torch.int32)
        pi, info = kt.prefill_index(kv, i32([10]), i32([3]), window=4,
                                    compress_ratio=2, compressed_index=i32(
                                        [[0, -1], [4, 2], [-1, 1]]))
        self.assertEqual(pi.tolist(), [[1, 2, 3, 4, 7, -1],
                                       [2, 3, 4, 5, 11, 9],
                                       [3, 4, 5, 6, -1, 8]])
        self.assertEqual(info.total_rows, 12)
        # PrefillLoad: the tensor call equals the bytes call on twin pools.
        rng = random.Random(306)
        ring, comp = random_bf16(rng, 32), random_bf16(rng, 20)
        for p in ("tswa", "tswa2"):
            if p == "tswa2":
                kv.create_pool(p, "BF16(4)", block_size=8, num_blocks=2,
                               num_layers=1)
            kv.store(p, 0, range(8, 16), ring)
        kv.store("tmain", 0, [12, 13, 14, 15, 0], comp)
        chunk = bf16_tensor(307, 3, 4)
        ref = kv.prefill_load("tswa", 0, "tmain", 0, seqlen_k=[10],
                              seqlen_q=[3], swa_state_id=[1], window=4,
                              compress_ratio=2, block_table=[[3, 0]],
                              chunk_kv=raw(chunk))
        rows, info = kt.prefill_load(
            kv, "tswa2", 0, "tmain", 0, seqlen_k=i32([10]),
            seqlen_q=i32([3]), swa_state_id=i32([1]), window=4,
            compress_ratio=2, block_table=i32([[3, 0]]), chunk_kv=chunk)
        self.assertEqual(tuple(rows.shape), (12, 4))
        self.assertEqual(raw(rows), ref.output)
        self.assertEqual(info.main_kv_offset, 7)
        # Both stored the chunk into their ring the same way.
        self.assertEqual(
            kv.load("tswa", 0, segments=[[1, 0, 8, 0]], total_k=8).data,
            kv.load("tswa2", 0, segments=[[1, 0, 8, 0]], total_k=8).data)

    # ------------------------------------------------------------ refusals

    def test_bad_inputs_are_refused_before_sending(self):
        kv = self.kv
        kv.create_pool("neg", "BF16", elements=4, block_size=4, num_blocks=2,
                       num_layers=1)
        m = kv.map_pool("neg")
        before = bytes(m.view)
        s2 = torch.tensor([0, 1], dtype=torch.int32)
        x = bf16_tensor(308, 2, 4)
        IA = grpc.StatusCode.INVALID_ARGUMENT
        calls = store_requests(kv)
        self.assertFails(IA, "kv: dtype torch.float16", kt.store, kv, "neg",
                         0, s2, x.to(torch.float16))
        self.assertFails(IA, "slot_mapping: dtype torch.int64", kt.store, kv,
                         "neg", 0, s2.long(), x)
        self.assertFails(IA, "kv: not contiguous", kt.store, kv, "neg", 0,
                         s2, bf16_tensor(309, 4, 2).t())
        self.assertFails(IA, "kv: device meta", kt.store, kv, "neg", 0, s2,
                         torch.empty(2, 4, dtype=torch.bfloat16,
                                     device="meta"))
        self.assertFails(IA, "kv has 3 rows, slot_mapping 2", kt.store, kv,
                         "neg", 0, s2, bf16_tensor(310, 3, 4))
        self.assertFails(IA, "kv has 6 columns", kt.store, kv, "neg", 0, s2,
                         bf16_tensor(311, 2, 6))
        self.assertFails(IA, "kv: 1 dimensions", kt.store, kv, "neg", 0, s2,
                         x.reshape(-1))
        self.assertFails(IA, "kv: expected a torch.Tensor", kt.store, kv,
                         "neg", 0, s2, raw(x))
        self.assertEqual(store_requests(kv), calls)
        # Too small, misaligned, another session's buffer.
        with kv.allocate_buffer(64) as buf:
            self.assertFails(IA, "is 128 bytes; from offset 0 buffer",
                             kt.buffer_tensor, kv, buf, torch.float32,
                             (32,))
            self.assertFails(IA, "offset = 2", kt.buffer_tensor, kv, buf,
                             torch.float32, None, 2)
            self.assertFails(IA, "out: 32 bytes, the rows need 64",
                             kt.load, kv, "neg", 0,
                             segments=torch.tensor([[0, 0, 4, 0],
                                                    [1, 0, 4, 4]],
                                                   dtype=torch.int32),
                             total_k=8,
                             out=kt.buffer_tensor(kv, buf, torch.bfloat16,
                                                  (4, 4)))
            with self.daemon.connect(client_name="other") as other:
                self.assertFails(IA, "belongs to another session",
                                 kt.buffer_tensor, other, buf)
                # A view of this session's buffer in the other's request is
                # not recognized as its buffer: it goes inline (a copy).
                xb = kt.buffer_tensor(kv, buf, torch.bfloat16, (2, 4))
                xb.copy_(x)
                self.assertIsNone(kt._slice_of(other, xb))
                self.assertIsNotNone(kt._slice_of(kv, xb))
                del xb
        self.assertEqual(bytes(m.view), before)
        m.close()
        # Legacy registration of a CPU tensor: refused, with the reason.
        self.assertFails(grpc.StatusCode.FAILED_PRECONDITION,
                         "not a memfd", kt.register_tensor, kv, x)

    def test_worker_library_not_found_names_where_it_looked(self):
        from kvdepot import _worker_lib

        if _worker_lib._lib is not None:
            self.skipTest("the worker library is loaded already")
        # Found elsewhere (a wheel carrying it, LD_LIBRARY_PATH: the GPU
        # host's bundle): the refusal cannot happen there.
        here = os.path.join(os.path.dirname(_worker_lib.__file__),
                            _worker_lib.LIBRARY_NAME)
        if os.path.exists(here):
            self.skipTest(f"{here} exists")
        try:
            ctypes.CDLL(_worker_lib.LIBRARY_NAME)
            self.skipTest("the dynamic loader finds "
                          + _worker_lib.LIBRARY_NAME)
        except OSError:
            pass
        env = dict(os.environ)
        try:
            os.environ["KVDEPOT_WORKER_LIB"] = "/nonexistent/libkvd.so"
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                _worker_lib.load_library()
        finally:
            os.environ.clear()
            os.environ.update(env)
        self.assertEqual(cm.exception.code,
                         grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("/nonexistent/libkvd.so: no such file",
                      cm.exception.message)
        self.assertIn("KVDEPOT_WORKER_LIB", cm.exception.message)

    def test_step_path_refusals_on_cpu(self):
        kv = self.kv
        self.assertEqual(kt.doorbell_bytes(1), 256)
        with kv.allocate_buffer(kt.doorbell_bytes(2)) as db:
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "3 layers need 512", kt.register_worker, kv,
                             doorbell=db, layers=[kt.layer()] * 3,
                             max_tokens=8, max_seqs=2)
            kv.create_or_get_pool("stepmain", "V41", block_size=4,
                                  num_blocks=2, num_layers=1)
            with kv.allocate_buffer(8 * 1024) as io:
                self.assertFails(
                    grpc.StatusCode.FAILED_PRECONDITION, "runs on the GPU",
                    kt.register_worker, kv, doorbell=db,
                    layers=[kt.layer(main=kt.cache("stepmain", 0, io,
                                                   row_stride=1024))],
                    max_tokens=8, max_seqs=2)
            # The worker side refuses a lazy-loading environment before it
            # loads any library.
            env = dict(os.environ)
            try:
                os.environ["CUDA_MODULE_LOADING"] = "LAZY"
                self.assertFails(grpc.StatusCode.FAILED_PRECONDITION,
                                 "not \"EAGER\"", kt.StepWorker, 3, 4096, 0,
                                 1)
                os.environ["CUDA_MODULE_LOADING"] = "EAGER"
                os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "2"
                self.assertFails(grpc.StatusCode.FAILED_PRECONDITION,
                                 "at least 8 hardware connections",
                                 kt.StepWorker, 3, 4096, 0, 1)
                # With the environment right, a torch without CUDA is said
                # plainly (not torch's own assertion).
                os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
                if not torch.cuda.is_available():
                    self.assertFails(grpc.StatusCode.FAILED_PRECONDITION,
                                     "sees no CUDA device", kt.StepWorker,
                                     3, 4096, 0, 1)
            finally:
                os.environ.clear()
                os.environ.update(env)
            # Every form of open() checks its source first.
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                kt.StepWorker.open(kv, db)
            self.assertIn("expected the Registration", cm.exception.message)
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                kt.StepWorker.open(db, 0, 2)
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("not a CUDA VMM descriptor", cm.exception.message)
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "fd_size= is required", kt.StepWorker.open, 3,
                             0, 2)
            self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                             "got str", kt.StepWorker.open, "3")
        self.assertEqual(kt.phase_a(0), 1)
        self.assertEqual(kt.phase_b(3), 8)
        # The RPC helpers pack and send (the daemon answers for the id).
        for call in (
                lambda: kt.step(kv, 12345, step_id=1, slot_mapping=[0, -1],
                                seq_lens=[2], query_lens=[2],
                                block_tables=[[0]], swa_state_ids=[0],
                                compressed_slot_mapping=[-1, -1]),
                lambda: kt.step_status(kv, 12345),
                lambda: kt.grant_registration(kv, 12345, uids=[1]),
                lambda: kt.unregister(kv, 12345)):
            self.assertFails(grpc.StatusCode.NOT_FOUND,
                             "no registration 12345", call)
        self.assertEqual(kt.list_registrations(kv), [])
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "slot_mapping[0] = 2147483648 does not fit int32",
                         kt.step, kv, 1, step_id=1, slot_mapping=[2**31],
                         seq_lens=[1], query_lens=[1])

    def test_step_fused_and_positions_are_packed(self):
        """Fused-store parameters of a cache (a compressed MLA main cache:
        RMSNorm [0, 512), interleaved RoPE on [512, 576)) and a step's
        positions, as the daemon receives them."""
        weight = struct.pack("<512H", *([0x3F80] * 512))
        cos_sin = torch.arange(3 * 64, dtype=torch.float32).numpy()
        f = kt.step_fused(norm_end=512, norm_weight=weight, eps=1e-6,
                          rope="interleaved", rope_offset=512, rope_dim=64,
                          cos_sin=cos_sin)
        self.assertEqual((f.norm_begin, f.norm_end, f.rope_style,
                          f.rope_offset, f.rope_dim), (0, 512, 2, 512, 64))
        self.assertEqual(f.norm_weight, weight)
        self.assertEqual(len(f.cos_sin), 3 * 64 * 4)
        self.assertEqual(struct.unpack("<f", f.cos_sin[4:8])[0], 1.0)
        with self.kv.allocate_buffer(4096) as io:
            c = kt.cache("main", 1, io, offset=1024, row_stride=1152,
                         fused=f)
            self.assertEqual(c.fused, f)
            self.assertFalse(kt.cache("main", 1, io, row_stride=1152)
                             .HasField("fused"))
            l = kt.layer(main=c, ratio=4)
            self.assertEqual((l.ratio, l.main.fused.rope_dim), (4, 64))
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT, "fused.rope",
                         kt.step_fused, rope="sideways")
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "fused.cos_sin: 6 bytes", kt.step_fused,
                         cos_sin=b"123456")
        self.assertFails(grpc.StatusCode.INVALID_ARGUMENT,
                         "positions: 1 int64 entries, slot_mapping 2",
                         kt.step, self.kv, 1, step_id=1,
                         slot_mapping=[0, 1], seq_lens=[2], query_lens=[2],
                         positions=[7])
        # Sent packed: the daemon answers for the registration id only.
        self.assertFails(grpc.StatusCode.NOT_FOUND, "no registration 777",
                         kt.step, self.kv, 777, step_id=1,
                         slot_mapping=[0, 1], seq_lens=[2], query_lens=[2],
                         compressed_slot_mapping=[-1, 5],
                         positions=[6, 7])


def store_requests(kv) -> int:
    """Store requests the daemon has seen (Stats counts every RPC)."""
    for r in kv.stats().rpcs:
        if r.rpc == "Store":
            return r.calls
    return 0


if __name__ == "__main__":
    unittest.main()
