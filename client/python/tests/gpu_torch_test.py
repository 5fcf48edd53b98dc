"""kvdepot.torch on the CUDA backend (GPU host; every test skips without
torch.cuda, as in CI). Run there from the GPU pack (docs/PYTHON.md):

    tar xJf gpu_pack/bundle.txz
    python3 -m zipfile -e gpu_pack/kvdepot-*.whl /tmp/kvwheel
    cd gpu_pack && PYTHONPATH=/tmp/kvwheel \
      LD_LIBRARY_PATH=$PWD/../gpu_bundle/lib \
      KVDEPOT_BIN=$PWD/../gpu_bundle/bin/kvdepotd \
      python3 -m unittest -v gpu_torch_test

(the wheel carries libkvdepot_worker.so; KVDEPOT_WORKER_LIB overrides it).

Each test starts its own kvdepotd --backend=cuda on a private socket, with
CUDA_MODULE_LOADING=EAGER (set here, before torch starts CUDA). Proves:
buffers and pool layers aliased as CUDA tensors (writes on one side seen
on the other), store/load from CUDA buffer views byte-identical to the
inline path, ordering after the current stream's pending work (a sleeping
kernel before the input is written), the mapping unmapped with its last
tensor (after the kernels still using it: no fault), the step path driven
from Python with the worker's side captured in torch.cuda.graph and
replayed 100 times (pools equal to inline stores of the same rows),
prefill_load from CUDA buffer views behind pending work on the stream,
record_event (the call returns while the stream still waits for the
daemon's kernels, and what follows on the stream sees their result),
library mode on PlanStep's metadata through libkvdepot_kernels.so (with
KVDEPOT_KERNELS_LIB set and kvdepot_kernels.py importable), and the legacy
register_tensor with --legacy_cuda_ipc.
"""

import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

# Before torch starts CUDA: the step path refuses anything else.
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import kvdepot  # noqa: E402

try:
    import torch  # noqa: E402

    import kvdepot.torch as kt  # noqa: E402
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None  # type: ignore[assignment]
    HAVE_CUDA = False

NEEDS_CUDA = unittest.skipUnless(
    HAVE_CUDA and os.environ.get("KVDEPOT_BIN"),
    "needs torch with CUDA and KVDEPOT_BIN (a CUDA-built kvdepotd)")


class CudaDaemon:
    def __init__(self, *flags: str):
        self.dir = tempfile.mkdtemp(prefix="kvgpu")
        os.chmod(self.dir, 0o700)
        self.socket = os.path.join(self.dir, "kv.sock")
        self.log = open(os.path.join(self.dir, "kvdepotd.log"), "wb")
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")
        self.proc = subprocess.Popen(
            [os.environ["KVDEPOT_BIN"], f"--listen={self.socket}",
             "--backend=cuda", *flags], stdout=self.log,
            stderr=subprocess.STDOUT, env=env)

    def connect(self, **kw) -> kvdepot.Client:
        kw.setdefault("connect_timeout", 60.0)
        return kvdepot.connect(self.socket, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


def rows(seed: int, n: int, e: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, e, generator=g) * 2).to(torch.bfloat16)


@NEEDS_CUDA
class GpuTorchTest(unittest.TestCase):
    def setUp(self):
        self.daemon = CudaDaemon()
        self.kv = self.daemon.connect(client_name="gpu_torch_test")

    def tearDown(self):
        self.kv.close()
        self.assertEqual(self.daemon.stop(), 0)

    def twin_pools(self, fmt: str, bs: int = 64, nb: int = 16,
                   layers: int = 2):
        for p in ("a", "b"):
            self.kv.create_pool(p, fmt, block_size=bs, num_blocks=nb,
                                num_layers=layers, device="cuda:0")
        return self.kv.get_pool("a").layout

    def test_buffer_views_store_load_and_ordering(self):
        kv = self.kv
        L = self.twin_pools("V41")
        n, e = 200, L.elements
        x = rows(401, n, e)
        slots = torch.tensor(random.Random(402).sample(range(16 * 64), n),
                             dtype=torch.int32)
        buf = kv.allocate_buffer(n * e * 2)
        self.assertIsNotNone(buf.vmm_fd)
        xb = kt.buffer_tensor(kv, buf, torch.bfloat16, (n, e))
        self.assertEqual(xb.device.type, "cuda")
        # Ordering: the input is written behind a ~50 ms sleep on the
        # current stream; store() must wait for it (interprocess event).
        src = x.cuda()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        xb.copy_(src)                     # device to device, behind the sleep
        self.assertEqual(kt.store(kv, "a", 1, slots, xb), n)
        self.assertEqual(kt.store(kv, "b", 1, slots, x), n)   # inline
        a = kt.pool_layer_tensor(kv, "a", 1)
        b = kt.pool_layer_tensor(kv, "b", 1)
        self.assertEqual(a.raw.device.type, "cuda")
        self.assertTrue(bool((a.raw != 0).any()))
        self.assertTrue(torch.equal(a.raw, b.raw))
        # Load into a CUDA buffer view == inline load.
        table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
        seq = torch.tensor([512, 300], dtype=torch.int32)
        ref = kt.load(kv, "a", 1, seqlen_k=seq, block_table=table)
        out_buf = kv.allocate_buffer(812 * e * 2)
        out = kt.buffer_tensor(kv, out_buf, torch.bfloat16, (812, e))
        out.fill_(7)   # pending on the stream: load() must follow it
        got = kt.load(kv, "a", 1, seqlen_k=seq, block_table=table, out=out)
        self.assertEqual(got.data_ptr(), out.data_ptr())
        self.assertTrue(torch.equal(got.cpu(), ref))
        # The view of the pool is the pool: a write shows in a load.
        a.data[0, 0].zero_()
        a.scales[0, 0].fill_(127)   # UE8M0 127 = scale 1.0
        torch.cuda.synchronize()
        r = kv.load("a", 1, segments=[[0, 0, 1, 0]], total_k=1)
        self.assertEqual(r.data, bytes(e * 2))
        # The mapping goes with its last tensor.
        ref_map = buf._kvd_vmm
        self.assertIsNotNone(ref_map())
        del xb
        gc.collect()
        self.assertIsNone(ref_map())
        del got, out
        gc.collect()
        buf.release()
        out_buf.release()

    def test_prefill_load_orders_after_the_stream(self):
        """kt.prefill_load with the output in a CUDA buffer view that the
        current stream still writes (behind a ~50 ms sleep): the daemon
        awaits the stream's event, no host synchronization in
        kvdepot.torch. Two variants: the chunk in a CUDA buffer view also
        written behind the sleep (the chunk's event covers both), and the
        chunk inline from host memory (only the output asks for the
        event). Rows and rings equal the inline path's on a twin SWA pool
        each time."""
        kv = self.kv
        e = 512
        kv.create_pool("t", "V41", block_size=64, num_blocks=4,
                       num_layers=1, device="cuda:0")
        kt.store(kv, "t", 0, torch.arange(256, dtype=torch.int32),
                 rows(411, 256, e))
        kv.create_pool("m", "V41", block_size=16, num_blocks=32,
                       num_layers=1, device="cuda:0")
        kt.store(kv, "m", 0, torch.arange(512, dtype=torch.int32),
                 rows(412, 512, e))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        args = dict(seqlen_k=i32([300, 90]), seqlen_q=i32([40, 90]),
                    swa_state_id=i32([2, 0]), window=48, compress_ratio=4,
                    block_table=torch.tensor([[7, 30, 1, 12, 25],
                                              [3, 19, 0, 0, 0]],
                                             dtype=torch.int32))
        chunk = rows(413, 130, e)
        want, ref = kt.prefill_load(kv, "t", 0, "m", 0, chunk_kv=chunk,
                                    **args)
        for s, variant in (("s0", "buffer chunk"), ("s1", "host chunk")):
            with self.subTest(variant=variant):
                kv.create_pool(s, "V41", block_size=64, num_blocks=4,
                               num_layers=1, device="cuda:0")
                kt.store(kv, s, 0, torch.arange(256, dtype=torch.int32),
                         rows(411, 256, e))
                in_buf = kv.allocate_buffer(130 * e * 2)
                out_buf = kv.allocate_buffer(ref.total_rows * e * 2)
                cb = kt.buffer_tensor(kv, in_buf, torch.bfloat16, (130, e))
                ob = kt.buffer_tensor(kv, out_buf, torch.bfloat16,
                                      (ref.total_rows, e))
                src = chunk.cuda()
                torch.cuda.synchronize()
                torch.cuda._sleep(100_000_000)
                cb.copy_(src)      # behind the sleep
                ob.fill_(7)        # a pending write to the output
                got, r = kt.prefill_load(
                    kv, s, 0, "m", 0,
                    chunk_kv=cb if variant == "buffer chunk" else chunk,
                    out=ob, **args)
                self.assertEqual(got.data_ptr(), ob.data_ptr())
                self.assertEqual(r.total_rows, ref.total_rows)
                self.assertTrue(torch.equal(got.cpu(), want))
                self.assertTrue(torch.equal(
                    kt.pool_layer_tensor(kv, s, 0).raw,
                    kt.pool_layer_tensor(kv, "t", 0).raw))
                del cb, ob, got
                gc.collect()
                in_buf.release()
                out_buf.release()

    def test_record_event_returns_before_the_daemon_is_done(self):
        """kt.store, kt.load and kt.prefill_load with record_event. The load
        writes 8M rows (8 GiB; about two milliseconds of the daemon's
        kernel, its request small): it returns while the current stream
        still waits for that kernel (after a plain call, or with no stream
        wait, the stream would be idle). Work queued on the stream after
        each call sees what the daemon wrote: the pool equal to a plain
        store of the same buffer on a twin, the rows equal to a plain load,
        prefill_load's rows and rings equal to the inline path's. (The
        daemon awaits the stream's event for a call's own operands on the
        host, so a call still returns after the stream's earlier work.)"""
        kv = self.kv
        n, bs, nb = 1 << 16, 64, 1 << 10
        L = self.twin_pools("V41", bs=bs, nb=nb, layers=1)
        e = L.elements
        stream = torch.cuda.current_stream()
        in_buf = kv.allocate_buffer(n * e * 2)
        xb = kt.buffer_tensor(kv, in_buf, torch.bfloat16, (n, e))
        xb.copy_(rows(431, n, e))
        slots = torch.randperm(
            n, generator=torch.Generator().manual_seed(432)).to(torch.int32)
        self.assertEqual(kt.store(kv, "a", 0, slots, xb, record_event=True),
                         n)
        after = kt.pool_layer_tensor(kv, "a", 0).raw.clone()
        kt.store(kv, "b", 0, slots, xb)   # plain: the reply means done
        self.assertTrue(torch.equal(after,
                                    kt.pool_layer_tensor(kv, "b", 0).raw))

        k = 1 << 23   # rows: every block 128 times over
        table = (torch.arange(k // bs, dtype=torch.int32) % nb).reshape(1, -1)
        seq = torch.tensor([k], dtype=torch.int32)
        out_bufs = [kv.allocate_buffer(k * e * 2) for _ in range(2)]
        ob, ref_rows = (kt.buffer_tensor(kv, b, torch.bfloat16, (k, e))
                        for b in out_bufs)
        ob.fill_(7)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = kt.load(kv, "a", 0, seqlen_k=seq, block_table=table, out=ob,
                      record_event=True)
        busy = not stream.query()
        print(f"[record_event] load returned after "
              f"{(time.perf_counter() - t0) * 1e3:.2f} ms, stream busy: "
              f"{busy}", file=sys.stderr)
        self.assertTrue(busy, "the stream was idle after load returned")
        first = got[:, 0].clone()   # queued at once: after the wait only
        kt.load(kv, "b", 0, seqlen_k=seq, block_table=table, out=ref_rows)
        self.assertTrue(torch.equal(first, ref_rows[:, 0]))
        self.assertTrue(torch.equal(got, ref_rows))
        del got, ref_rows, first

        kv.create_pool("m", "V41", block_size=16, num_blocks=32,
                       num_layers=1, device="cuda:0")
        kt.store(kv, "m", 0, torch.arange(512, dtype=torch.int32),
                 rows(423, 512, e))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        args = dict(seqlen_k=i32([300, 90]), seqlen_q=i32([40, 90]),
                    swa_state_id=i32([2, 0]), window=48, compress_ratio=4,
                    block_table=torch.tensor([[7, 30, 1, 12, 25],
                                              [3, 19, 0, 0, 0]],
                                             dtype=torch.int32),
                    chunk_kv=rows(424, 130, e))
        want, ref = kt.prefill_load(kv, "b", 0, "m", 0, **args)
        self.assertEqual(ref.recorded_event, b"")
        pt = ob[:ref.total_rows]
        pt.fill_(7)
        got, r = kt.prefill_load(kv, "a", 0, "m", 0, out=pt,
                                 record_event=True, **args)
        self.assertEqual(len(r.recorded_event), 64)
        self.assertTrue(torch.equal(got.clone().cpu(), want))
        self.assertTrue(torch.equal(kt.pool_layer_tensor(kv, "a", 0).raw,
                                    kt.pool_layer_tensor(kv, "b", 0).raw))
        del xb, ob, got, pt
        gc.collect()
        for b in [in_buf, *out_bufs]:
            b.release()

    def test_last_view_collected_while_a_kernel_uses_it(self):
        """The last tensor over a pool layer and over a buffer collected
        while a kernel queued behind a ~50 ms sleep still reads or writes
        the mapping: the unmapping waits for the device (kvd_unmap), so
        the kernels run to the end, no CUDA error (an unmapped range used
        to fault them: error 700, the process's context lost), and the
        next call's stream event completes."""
        kv = self.kv
        L = self.twin_pools("V41", bs=64, nb=64, layers=1)
        n = 64 * 64
        kt.store(kv, "a", 0, torch.arange(n, dtype=torch.int32),
                 rows(441, n, L.elements))
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        copy = kt.pool_layer_tensor(kv, "a", 0).raw.clone()
        gc.collect()                  # the view is gone: unmapped here
        buf = kv.allocate_buffer(1 << 20)
        t = kt.buffer_tensor(kv, buf)
        torch.cuda._sleep(100_000_000)
        t.fill_(3)
        del t
        gc.collect()
        torch.cuda.synchronize()      # raises on a fault
        self.assertTrue(torch.equal(copy,
                                    kt.pool_layer_tensor(kv, "a", 0).raw))
        self.assertTrue(bool((kt.buffer_tensor(kv, buf) == 3).all()))
        gc.collect()
        buf.release()

    def test_index_calls_on_buffer_views(self):
        """kt.convert_topk, kt.swa_decode_index and kt.prefill_index with
        their arrays in CUDA buffer views written behind a ~50 ms sleep on
        the current stream, their outputs in buffer views, record_event:
        equal to the inline path. A block-table entry out of range read
        from a buffer turns its slots into -1 and is counted in
        invalid_count_out (the inline form refuses it)."""
        kv = self.kv
        bs = 64
        kv.create_pool("c", "V41", block_size=bs, num_blocks=16,
                       num_layers=1, device="cuda:0")
        rng = random.Random(451)
        batch, k = 3, 8
        num_tokens = [200, 256, 90]
        valid = [8, 5, 6]
        topk = [[rng.randrange(-1, n) for _ in range(k)] for n in num_tokens]
        table = [[7, 3, 12, 5], [1, 2, 4, 6], [8, 9, 10, 11]]
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        want = kt.convert_topk(kv, "c", i32(topk), i32(valid),
                               i32(num_tokens), i32(table))
        buf = kv.allocate_buffer(1 << 20)
        view = lambda off, dt, shape: kt.buffer_tensor(  # noqa: E731
            kv, buf, dt, shape, offset=off)
        tb, tab = view(0, torch.int32, (batch, k)), view(
            4096, torch.int32, (batch, 4))
        ob, ic = view(8192, torch.int32, (batch, k)), view(
            12288, torch.int64, (1,))
        bad_table = [row[:] for row in table]
        bad_table[0][0] = 1 << 20
        for tbl in (table, bad_table):
            src_t, src_tab = i32(topk).cuda(), i32(tbl).cuda()
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)
            tb.copy_(src_t)
            tab.copy_(src_tab)
            ob.fill_(9)
            ic.fill_(-5)
            got = kt.convert_topk(kv, "c", tb, i32(valid), i32(num_tokens),
                                  tab, out=ob, invalid_count_out=ic,
                                  record_event=True)
            self.assertEqual(got.data_ptr(), ob.data_ptr())
            expect = want.clone()
            if tbl is bad_table:   # block 0 of sequence 0 is block 7
                gone = (expect[0] >= 7 * bs) & (expect[0] < 8 * bs)
                self.assertGreater(int(gone.sum()), 0)
                expect[0][gone] = -1
            self.assertTrue(torch.equal(got.cpu(), expect))
            self.assertEqual(int(ic.item()),
                             0 if tbl is table else int(gone.sum()))

        kv.create_pool("s", "V41", block_size=bs, num_blocks=8,
                       num_layers=1, device="cuda:0")
        q = i32([[1, 5, 40], [0, 60, 48], [3, 0, 10]])
        want = kt.swa_decode_index(kv, "s", 48, q)
        so = view(16384, torch.int32, (3, 48))
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        so.fill_(9)
        got = kt.swa_decode_index(kv, "s", 48, q, out=so,
                                  record_event=True)
        self.assertTrue(torch.equal(got.cpu(), want))

        seqlen_k, seqlen_q = i32([300, 90]), i32([40, 90])
        ci = i32([[rng.randrange(-1, 75 if r < 40 else 22)
                   for _ in range(16)] for r in range(130)])
        want, ref = kt.prefill_index(kv, seqlen_k, seqlen_q, window=48,
                                     compress_ratio=4, compressed_index=ci)
        cb = view(32768, torch.int32, (130, 16))
        po = view(65536, torch.int32, (130, 64))
        src = ci.cuda()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        cb.copy_(src)
        po.fill_(9)
        ic.fill_(-5)
        got, r = kt.prefill_index(kv, seqlen_k, seqlen_q, window=48,
                                  compress_ratio=4, compressed_index=cb,
                                  out=po, invalid_count_out=ic,
                                  record_event=True)
        self.assertEqual(r.row_width, ref.row_width)
        self.assertEqual(len(r.recorded_event), 64)
        self.assertTrue(torch.equal(got.cpu(), want))
        self.assertEqual(int(ic.item()), 0)
        del tb, tab, ob, ic, so, cb, po, got, view
        gc.collect()
        buf.release()

    def test_wrong_device_and_other_session(self):
        kv = self.kv
        self.twin_pools("V41", layers=1)
        buf = kv.allocate_buffer(1 << 16)
        with self.daemon.connect(client_name="other") as other:
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                kt.buffer_tensor(other, buf)
            self.assertIn("another session", cm.exception.message)
        buf.release()

    def test_step_path_from_python_under_cuda_graphs(self):
        kv = self.kv
        layers, n, steps = 2, 32, 100
        L = self.twin_pools("V41", bs=64, nb=128, layers=layers)
        e = L.elements
        row = e * 2
        io = kv.allocate_buffer(layers * n * row)
        inputs = kt.buffer_tensor(kv, io, torch.bfloat16, (layers, n, e))
        db = kv.allocate_buffer(kt.doorbell_bytes(layers))
        reg = kt.register_worker(
            kv, doorbell=db, layers=[
                kt.layer(main=kt.cache("a", l, io, offset=l * n * row,
                                       row_stride=row))
                for l in range(layers)],
            max_tokens=n, max_seqs=n, max_blocks_per_seq=1, name="pytest")
        self.assertEqual(reg.num_phases, 1 + 2 * layers)
        w = kt.StepWorker.open(kv, reg, watchdog_ms=20000)
        stream = torch.cuda.Stream()
        staging = torch.empty(layers, n, e, dtype=torch.bfloat16,
                              device="cuda")

        def worker_step():
            inputs.copy_(staging)          # "produce K/V" on the stream
            w.step_begin()
            w.wait(0)
            for l in range(layers):
                w.mark(w.phase_a(l))
                w.wait(w.phase_a(l))
                w.mark(w.phase_b(l))
                w.wait(w.phase_b(l))

        # Capture the worker's side once, replay it per step.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
            # thread_local: the worker library's watchdog thread keeps
            # using its own control stream during the capture.
            with torch.cuda.graph(graph, stream=stream,
                                  capture_error_mode="thread_local"):
                worker_step()
        rng = random.Random(403)
        for i in range(1, steps + 1):
            slots = rng.sample(range(128 * 64), n)
            x = rows(1000 + i, layers * n, e).reshape(layers, n, e)
            with torch.cuda.stream(stream):
                staging.copy_(x.cuda())
            kt.step(kv, reg.registration_id, step_id=i, slot_mapping=slots,
                    seq_lens=[1] * n, query_lens=[1] * n)
            graph.replay()
            stream.synchronize()
            for l in range(layers):   # the same rows, inline
                kt.store(kv, "b", l, torch.tensor(slots, dtype=torch.int32),
                         x[l].contiguous())
        st = w.status()
        self.assertEqual(st.status_bits, 0, st)
        self.assertEqual((st.step_counter, st.daemon_done), (steps, steps))
        info = kt.step_status(kv, reg.registration_id)
        self.assertEqual(info.completed_step_id, steps)
        for l in range(layers):
            self.assertTrue(torch.equal(kt.pool_layer_tensor(kv, "a", l).raw,
                                        kt.pool_layer_tensor(kv, "b",
                                                             l).raw), l)
        w.close()
        kt.unregister(kv, reg.registration_id)

    @unittest.skipUnless(os.environ.get("KVDEPOT_KERNELS_LIB"),
                         "needs KVDEPOT_KERNELS_LIB (libkvdepot_kernels.so) "
                         "and kvdepot_kernels.py on the path")
    def test_library_mode_on_plan_step_metadata(self):
        """docs/LIBRARY_MODE.md's Python path: plan_step, its metadata
        uploaded as one int32 tensor, kvdk_store_cuda on pointers into it
        on torch's stream; pool a equals inline stores of the same rows
        into pool b; no step id consumed."""
        import ctypes
        import kvdepot_kernels as K
        lib = K.load(os.environ["KVDEPOT_KERNELS_LIB"])
        kv = self.kv
        layers, n, bs, nb = 2, 24, 64, 32
        L = self.twin_pools("V41", bs=bs, nb=nb, layers=layers)
        e = L.elements
        row = e * 2
        io = kv.allocate_buffer(layers * n * row)
        db = kv.allocate_buffer(kt.doorbell_bytes(layers))
        reg = kt.register_worker(
            kv, doorbell=db, layers=[
                kt.layer(main=kt.cache("a", l, io, offset=l * n * row,
                                       row_stride=row))
                for l in range(layers)],
            max_tokens=n, max_seqs=n, max_blocks_per_seq=1, name="libplan")
        # One layer's bytes as library mode sees them (num_layers = 1).
        h = ctypes.c_void_p()
        K.check(lib, lib.kvdk_layout_create(b"V41", 0, bs, nb, 1,
                                            ctypes.byref(h)))
        ws = torch.empty(lib.kvdk_cuda_workspace_bytes(K.KVDK_OP_STORE, n),
                         dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        rng = random.Random(404)
        for i in range(20):
            slots = rng.sample(range(nb * bs), n)
            slots[rng.randrange(n)] = -1
            p = kvdepot.step.plan_step(kv, reg.registration_id,
                                       slot_mapping=slots, seq_lens=[1] * n,
                                       query_lens=[1] * n)
            self.assertEqual(p.array(p.slots(), n), slots)
            meta = torch.frombuffer(bytearray(p.metadata),
                                    dtype=torch.int32).cuda()
            x = rows(2000 + i, layers * n, e).reshape(layers, n, e)
            xd = x.cuda()
            for l in range(layers):
                layer = kt.pool_layer_tensor(kv, "a", l).raw
                K.check(lib, lib.kvdk_store_cuda(
                    h, layer.data_ptr(), layer.numel(), 0, xd[l].data_ptr(),
                    K.KVDK_DTYPE_BF16, meta.data_ptr() + 4 * p.slots(),
                    p.num_tokens, ws.data_ptr(), ws.numel(), None, stream))
                kt.store(kv, "b", l, torch.tensor(slots, dtype=torch.int32),
                         x[l].contiguous())
            torch.cuda.synchronize()
        lib.kvdk_layout_destroy(h)
        for l in range(layers):
            self.assertTrue(torch.equal(kt.pool_layer_tensor(kv, "a", l).raw,
                                        kt.pool_layer_tensor(kv, "b",
                                                             l).raw), l)
        info = kt.step_status(kv, reg.registration_id)
        self.assertEqual(info.last_step_id, 0)
        kt.unregister(kv, reg.registration_id)


@NEEDS_CUDA
class LegacyTest(unittest.TestCase):
    def test_register_tensor_with_legacy_ipc(self):
        d = CudaDaemon("--legacy_cuda_ipc")
        try:
            with d.connect(client_name="legacy") as kv:
                kv.create_pool("p", "V41", block_size=64, num_blocks=4,
                               num_layers=1, device="cuda:0")
                kv.create_pool("q", "V41", block_size=64, num_blocks=4,
                               num_layers=1, device="cuda:0")
                x = rows(404, 100, 512)
                t = torch.zeros(3, 100, 512, dtype=torch.bfloat16,
                                device="cuda")
                t[1].copy_(x)     # a view at an offset in its block
                torch.cuda.synchronize()
                h = kt.register_tensor(kv, t[1])
                slots = list(range(100))
                kv.store("p", 0, slots, h.slice(), dtype="bf16")
                kt.store(kv, "q", 0, torch.tensor(slots, dtype=torch.int32),
                         x)
                a = kv.load("p", 0, segments=[[0, 0, 64, 0], [1, 0, 36, 64]],
                            total_k=100)
                b = kv.load("q", 0, segments=[[0, 0, 64, 0], [1, 0, 36, 64]],
                            total_k=100)
                self.assertEqual(a.data, b.data)
                h.release()
        finally:
            self.assertEqual(d.stop(), 0)


if __name__ == "__main__":
    unittest.main()
