"""The reference worker against a real kvdepotd (CPU backend): the
scenarios of issue 15 item 3 with the oracles of item 4 (BF16 teacher
forcing, brute-force window/top-k checks, records read in place vs Load).
Run by //examples/ref_worker:ref_worker_test (Debian's python3-torch)."""

import os
import random
import sys
import types
import unittest

import torch

import kvdepot.torch as kvt
import kvd_adapter
import scenarios
from codec import LayerGeometry, dequant_main, gather_records
from daemon import Daemon
from kvd_adapter import tensor_bytes
from model import Config, make_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

CPU = torch.device("cpu")


def spec_records(view: kvd_adapter.PoolView, g: LayerGeometry, layer: int,
                 slots) -> bytes:
    """The records at slots, addressed by FORMATS.md's arithmetic over the
    pool's bytes (layer_stride, block_stride, bytes_per_token), not by
    kvdepot.torch's views: data then scales per slot."""
    base = view.whole
    out = bytearray()
    for s in slots:
        b, t = divmod(s, g.block_size)
        at = layer * g.layer_stride + b * g.block_stride
        if g.interleaved:
            at += t * g.bytes_per_token
            out += tensor_bytes(base[at:at + g.bytes_per_token])
        else:
            sf = at + g.block_size * g.data_bytes + t * g.sf_bytes
            at += t * g.data_bytes
            out += tensor_bytes(base[at:at + g.data_bytes])
            out += tensor_bytes(base[sf:sf + g.sf_bytes])
    return bytes(out)
STEPS = 64        # decode steps per sequence (>= 64 compared steps)


def args(**kw) -> types.SimpleNamespace:
    a = dict(device="cpu", format="DS_MLA_FP8", layers=4, window=128,
             steps=STEPS, seed=1234, prefix="t.", step_mode="graph")
    a.update(kw)
    return types.SimpleNamespace(**a)


class RecordsTest(unittest.TestCase):
    """Our torch reading of DS_MLA_FP8 and V41 records (written from the
    spec) equals the daemon's Load of the same slots, bit for bit."""

    def test_records_read_in_place_equal_load(self):
        d = Daemon()
        try:
            with d.connect(client_name="records") as kv:
                for fmt in ("DS_MLA_FP8", "V41"):
                    cfg = Config(main_format=fmt, layers=1)
                    w = make_weights(cfg, CPU)
                    kv.create_pool(fmt, fmt, block_size=64, num_blocks=4,
                                   num_layers=2)
                    g = torch.Generator().manual_seed(7)
                    x = torch.randn(70, cfg.kv_dim, generator=g) * 3
                    x[3, :40] = 0.0                          # a zero tile
                    slots = list(range(60, 130))             # across blocks
                    fp = kvd_adapter.FusedParams(
                        cfg.latent, w.layers[0].kv_norm, cfg.latent, 64,
                        w.cos_sin, cfg.eps)
                    kvd_adapter.fused_store(kv, fmt, 1, slots, x,
                                            list(range(70)), fp)
                    view = kvd_adapter.PoolView(kv, fmt, CPU)
                    geo = LayerGeometry.of(view.layout)
                    layer = view.layer(1)
                    self.assertIsInstance(layer, kvt.PoolLayerView)
                    dat, rest = gather_records(layer, geo,
                                               torch.tensor(slots))
                    self.assertEqual(
                        tensor_bytes(torch.cat([dat, rest], 1)),
                        spec_records(view, geo, 1, slots),
                        f"{fmt}: kvdepot.torch's views are not at the "
                        "FORMATS.md offsets")
                    mine = dequant_main(fmt, dat, rest).to(torch.bfloat16)
                    segs = [[s // 64, s % 64, s % 64 + 1, r]
                            for r, s in enumerate(slots)]
                    r = kv.load(fmt, 1, segments=segs, total_k=70)
                    theirs = torch.frombuffer(bytearray(r.data),
                                              dtype=torch.bfloat16).view(
                                                  70, cfg.kv_dim)
                    self.assertTrue(torch.equal(mine.view(torch.int16),
                                                theirs.view(torch.int16)),
                                    f"{fmt}: records read in place differ "
                                    "from Load")
                    view.close()
        finally:
            self.assertEqual(d.stop(), 0, d.log_text())


class ScenarioTest(unittest.TestCase):
    """Each scenario against its own daemon; agreement with the BF16 oracle
    within scenarios.TOP1_MIN / LOGIT_*_MAX, every index checked."""

    def setUp(self):
        self.daemon = run.OwnDaemon(os.environ["KVDEPOT_BIN"], [])

    def tearDown(self):
        rc = self.daemon.stop()
        if rc != 0:
            with open(self.daemon.log_path) as f:
                self.fail(f"kvdepotd exited {rc}:\n{f.read()[-4000:]}")

    def run_scenario(self, name: str, **kw):
        r = run.run_one(name, args(**kw), self.daemon.socket, self.daemon,
                        CPU)
        print(r, flush=True)
        self.assertTrue(r.get("passed"), r)
        return r

    def check_counts(self, r):
        self.assertGreaterEqual(r["compared_steps"], STEPS)
        self.assertGreater(r["window_rows"], 0)
        self.assertGreater(r["topk_slots"], 0)
        self.assertGreater(r["prefill_index_rows"], 0)
        self.assertGreater(r["prefill_rows_bitexact"], 0)

    def test_basic_ds_mla_fp8(self):
        # The long oracle run: 4 layers (ratios 4, 1, 4, 2), 64 teacher-
        # forced decode steps per sequence, batch 3 (rings wrap).
        r = self.run_scenario("basic")
        self.check_counts(r)
        self.assertGreaterEqual(r["decode_steps"], STEPS)

    def test_basic_v41(self):
        # The second format's records and bounds: 2 layers (ratios 4, 1),
        # 32 steps x 3 sequences (99 compared). The 64-step, 4-layer
        # oracle run is test_basic_ds_mla_fp8.
        self.check_counts(self.run_scenario("basic", format="V41",
                                            layers=2, steps=32))

    def test_churn_poisoned_reuse_continuous_batching(self):
        # 2 layers, 32 steps: sequences of 8, 32 and 16 steps, arrivals at
        # steps 9, 17 and 19 into poisoned blocks and rings (102 compared).
        r = self.run_scenario("churn", layers=2, steps=32)
        self.check_counts(r)
        self.assertGreater(r["poison_rounds"], 0)
        self.assertGreater(r["reused_blocks"], 0)
        self.assertGreater(r["reused_rings"], 0)

    def test_killed_daemon_session_lost_then_recovered(self):
        r = self.run_scenario("kill_daemon", steps=16, layers=2)
        self.assertIn("SessionLost", r["error_after_kill"])

    def test_killed_worker_leaves_others_alone(self):
        r = self.run_scenario("kill_worker", steps=32, layers=2)
        self.assertEqual(r["sessions_after_kill"],
                         r["sessions_before_kill"] - 1)
        self.assertEqual(r["buffers_after_kill"],
                         r["buffers_before_kill"] - 1)
        self.assertEqual(len(r["victim_pools_after_kill"]), 3)

    def test_two_worker_processes(self):
        r = self.run_scenario("two_workers", steps=8, layers=2)
        self.assertEqual(len(r["workers"]), 2)


class CheckerTest(unittest.TestCase):
    """The brute-force checks fail when the daemon's answer is wrong: a
    worker whose idea of the block table differs from what it sends."""

    def test_wrong_slots_are_caught(self):
        d = Daemon()
        try:
            with d.connect(client_name="checker") as kv:
                cfg = Config(layers=1, ratios=(1,))
                w = make_weights(cfg, CPU)
                h = scenarios.make(kv, cfg, w, CPU, prefix="c.")
                rng = random.Random(3)
                h.start(0, scenarios.prompt(rng, cfg, 80), max_new=4)
                real = h.worker._slot
                h.worker._slot = lambda s, row: real(s, row) + 1
                with self.assertRaises(AssertionError):
                    h.step()
                h.worker.close()
        finally:
            self.assertEqual(d.stop(), 0, d.log_text())


class StepPathPlumbingTest(unittest.TestCase):
    """stepworker.py (the GPU step-path decode) with the daemon's side
    simulated by regular RPCs (stepsim.py): its io-buffer offsets, phase
    order and read-back rows agree with the brute-force checks and the
    oracles. The real step path runs only on the GPU host."""

    def test_step_path_worker_with_simulated_daemon_side(self):
        # static: what "graph" captures. ratios (4, 1): a compressed main
        # cache (its compressed slot mapping) next to a per-token one;
        # (4, 1, 2): layers of two ratios > 1, one mapping each; the
        # prompts (77, 130, 261) end inside a group of 4, so the first
        # decode steps complete groups begun in prefill. Steps sent ahead
        # (lookahead: the next step's Step while this one runs) or each
        # before its step (async). Block tables device-resident (the
        # default: stepsim reads the io buffer's rows the worker wrote) or
        # inline in the Step.
        for mode, ratios, pipeline, tables in (
                ("eager", (1,), "lookahead", "device"),
                ("static", (1,), "lookahead", "inline"),
                ("eager", (4, 1), "async", "inline"),
                ("static", (4, 1), "lookahead", "device"),
                ("eager", (4, 1, 2), "lookahead", "device")):
            with self.subTest(mode=mode, ratios=ratios, pipeline=pipeline,
                              tables=tables):
                self.run_mode(mode, ratios, pipeline, tables)

    def run_mode(self, mode: str, ratios, pipeline: str, tables: str):
        import stepsim
        d = Daemon()
        try:
            with d.connect(client_name="stepsim") as kv:
                layers = max(2, len(ratios))
                cfg = Config(layers=layers, ratios=ratios)
                w = make_weights(cfg, CPU)
                h = scenarios.make(kv, cfg, w, CPU,
                                   worker_cls=stepsim.SimulatedStepWorker,
                                   prefix="s.", mode=mode, pipeline=pipeline,
                                   block_tables=tables)
                h.lookahead = True
                self.check_registration(h.worker)
                wk = h.worker
                sent = []
                send = wk._step_rpc
                wk._step_rpc = lambda i, a: (sent.append(a), send(i, a))[1]
                scenarios.basic(h, 22, 5)
                r = h.report()
                print(r, flush=True)
                self.assertTrue(r["agreement_ok"], r)
                self.assertGreaterEqual(r["compared_steps"], 64)
                self.assertEqual(r["window_rows"], 66)
                self.assertEqual(r["topk_slots"], 66 * layers)
                # One Step per decode step, each run once (stepsim checks
                # the order; close() fails on a step sent and never run).
                self.assertEqual(h.worker.step_rpcs, 22)
                self.assertEqual(h.worker.begun, 22)
                # What each Step carried: the flag and the columns, or the
                # tables themselves.
                self.assertEqual(len(sent), 22)
                compressed = sorted(set(ratios) - {1})
                for a in sent:
                    # One compressed mapping per ratio > 1, one entry per
                    # token, none in the single-ratio field.
                    self.assertNotIn("compressed_slot_mapping", a)
                    got = a.get("compressed_slot_mappings", {})
                    self.assertEqual(sorted(got), compressed)
                    # Token i completes a compressed row of ratio R when
                    # its position + 1 is a multiple of R: a slot there,
                    # -1 elsewhere (a mapping of another ratio fails).
                    for R, m in got.items():
                        self.assertEqual(len(m), len(a["slot_mapping"]))
                        for p, slot in zip(a["positions"], m):
                            self.assertEqual(slot >= 0, (p + 1) % R == 0,
                                             (R, p, slot))
                    if tables == "device":
                        self.assertNotIn("block_tables", a)
                        self.assertEqual(
                            (a["block_tables_in_buffer"],
                             a["block_table_cols"]), (True, wk.num_blocks))
                    else:
                        self.assertNotIn("block_tables_in_buffer", a)
                        self.assertEqual(len(a["block_tables"]),
                                         len(a["seq_lens"]))
                h.worker.close()
        finally:
            self.assertEqual(d.stop(), 0, d.log_text())

    def test_steps_sent_ahead_are_run_once(self):
        """decode(next_same_batch=True) sends the next step's Step right
        after this one's work: each Step sent once and run, nothing sent
        for a step the caller did not promise; stepsim fails a step sent
        twice, begun unsent, or sent and never run."""
        import stepsim
        cfg = Config(layers=1, ratios=(1,))
        w = make_weights(cfg, CPU)
        rng = random.Random(8)
        prompts = [scenarios.prompt(rng, cfg, n) for n in (9, 14)]
        d = Daemon()
        try:
            with d.connect(client_name="lookahead") as kv:
                def worker(name):
                    wk = stepsim.SimulatedStepWorker(
                        kv, cfg, w, CPU, prefix=name + ".", mode="static")
                    for i, p in enumerate(prompts):
                        s = wk.add(i, list(p), 8)
                        s.tokens.append(int(wk.prefill(s).argmax()))
                    return wk

                def step(wk, ids, same):
                    out = wk.decode(ids, next_same_batch=same)
                    for i in ids:
                        wk.seqs[i].tokens.append(int(out[i].argmax()))

                wk = worker("a")
                step(wk, [0, 1], True)      # sends steps 1 and 2
                self.assertEqual((wk.step_rpcs, wk.begun), (2, 1))
                step(wk, [0, 1], True)      # runs 2, sends 3
                self.assertEqual((wk.step_rpcs, wk.begun), (3, 2))
                step(wk, [0, 1], False)     # runs 3, sends nothing
                self.assertEqual((wk.step_rpcs, wk.begun), (3, 3))
                step(wk, [0, 1], False)     # sends and runs 4
                self.assertEqual((wk.step_rpcs, wk.begun), (4, 4))
                # A Step sent again (same id) is refused.
                with self.assertRaisesRegex(AssertionError, "sent twice"):
                    wk._step_rpc(wk.step_id, {})
                wk.close()

                # The caller promised the same batch and changed it.
                wk = worker("b")
                step(wk, [0, 1], True)
                with self.assertRaisesRegex(RuntimeError, "sent ahead"):
                    wk.decode([0])
                wk.ahead = None
                with self.assertRaisesRegex(AssertionError, "never run"):
                    wk.close()

                # A promised step never decoded: close() says so.
                wk = worker("c")
                step(wk, [0, 1], True)
                with self.assertRaisesRegex(AssertionError, "never run"):
                    wk.close()

                # A lookahead that forgot it had sent the step (sends it
                # again under the next id): the extra one is never run.
                wk = worker("e")
                step(wk, [0, 1], True)
                wk.ahead = None
                step(wk, [0, 1], False)
                self.assertEqual(wk.step_rpcs, 3)
                with self.assertRaisesRegex(AssertionError, "never run"):
                    wk.close()
        finally:
            self.assertEqual(d.stop(), 0, d.log_text())

    def check_registration(self, wk):
        """What StepPathWorker registers: fused main and SWA caches (the
        layer's RMSNorm weight over the latent, eps, interleaved RoPE on
        [latent, latent + 64) from the model's cos/sin cache), the plain
        index cache, the ratio, and main's input rows (raw K at ratio 1,
        the compressed rows at ratio R)."""
        cfg = wk.cfg
        layers = wk.registration_layers(4242)
        self.assertEqual(len(layers), cfg.layers)
        for l, sl in enumerate(layers):
            o = wk.layer_offsets(l)
            self.assertEqual(sl.ratio, cfg.ratio(l))
            for c in (sl.main, sl.swa):
                f = c.fused
                self.assertEqual((f.norm_begin, f.norm_end, f.rope_style,
                                  f.rope_offset, f.rope_dim,
                                  f.hadamard_len),
                                 (0, cfg.latent, 2, cfg.latent,
                                  cfg.rope_dim, 0))
                self.assertEqual(f.norm_weight,
                                 kvd_adapter.bf16_bytes(
                                     wk.w.layers[l].kv_norm))
                self.assertEqual(len(f.cos_sin),
                                 4 * cfg.max_position * cfg.rope_dim)
                self.assertAlmostEqual(f.eps, cfg.eps, places=9)
                self.assertEqual(c.input.buffer_id, 4242)
            self.assertFalse(sl.index.HasField("fused"))
            self.assertEqual(sl.swa.input.offset, o["kv"])
            self.assertEqual(sl.main.input.offset,
                             o["comp"] if cfg.ratio(l) > 1 else o["kv"])
            self.assertEqual(sl.index.input.offset, o["ik"])
            self.assertEqual((sl.topk.offset, sl.index_out.offset),
                             (o["topk"], o["out"]))
        # Offsets inside the buffer, regions disjoint.
        ends = sorted((v, k) for l in range(cfg.layers)
                      for k, v in wk.layer_offsets(l).items())
        self.assertEqual(ends[0][0], 0)
        self.assertLessEqual(wk.layer_offsets(cfg.layers - 1)["out"]
                             + wk.tk_bytes, wk.swa_off)
        # The block-table rows after the SWA window rows, inside the io
        # buffer, registered with their stride only when device-resident.
        args = wk.registration_args(4242)
        self.assertEqual(args["max_blocks_per_seq"], wk.num_blocks)
        self.assertLessEqual(wk.swa_off + wk.max_tokens * cfg.window * 4,
                             wk.bt_off)
        self.assertEqual(wk.bt_stride, 4 * wk.num_blocks)
        self.assertLessEqual(wk.bt_off + args["max_seqs"] * wk.bt_stride,
                             wk.io.tensor.numel())
        if wk.device_tables:
            bt = args["block_tables"]
            self.assertEqual((bt.buffer_id, bt.offset, bt.row_stride),
                             (4242, wk.bt_off, wk.bt_stride))
        else:
            self.assertNotIn("block_tables", args)

    def test_compressed_row_slot_against_brute_force(self):
        """worker.compressed_row_slot (the step path's compressed_slot_
        mapping, prefill's compressed stores) against the definition: row
        r is positions [rR, rR + R), stored when its last position comes,
        at block_table[r // B] * B + r % B."""
        from worker import compressed_row_slot
        from stepworker import compressed_ratios
        rng = random.Random(7)
        for R in (1, 2, 4, 128):
            for B in (1, 4, 64):
                blocks = rng.sample(range(1000), 40)
                for p in range(0, 40 * B * R, max(1, R * B // 37)):
                    want = -1
                    r = 0
                    while r * R <= p:
                        last = r * R + R - 1
                        if last == p:
                            want = blocks[r // B] * B + r % B
                        r += 1
                    self.assertEqual(compressed_row_slot(blocks, p, R, B),
                                     want, (R, B, p))
        self.assertEqual(compressed_ratios(Config(ratios=(4, 1))), [4])
        self.assertEqual(compressed_ratios(Config(ratios=(1,))), [])
        self.assertEqual(compressed_ratios(Config(layers=4,
                                                  ratios=(4, 1, 4, 2))),
                         [2, 4])


# Daemon vs library mode: //examples/ref_worker:libmode_test (libmode_test.py).


# Bazel test sharding (BUILD shard_count = 2): each test's seconds as measured
# on the 2-core build machine under load; shards take them greedily, most
# expensive first, so that they end at about the same time.
COST = {
    "test_basic_ds_mla_fp8": 38,
    "test_step_path_worker_with_simulated_daemon_side": 56,
    "test_two_worker_processes": 27,
    "test_churn_poisoned_reuse_continuous_batching": 19,
    "test_killed_worker_leaves_others_alone": 17,
    "test_basic_v41": 12,
    "test_killed_daemon_session_lost_then_recovered": 8,
}


def load_tests(loader, standard_tests, pattern):
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    index = int(os.environ.get("TEST_SHARD_INDEX", "0"))
    if os.environ.get("TEST_SHARD_STATUS_FILE"):
        open(os.environ["TEST_SHARD_STATUS_FILE"], "a").close()
    tests = []

    def flatten(suite):
        for t in suite:
            if isinstance(t, unittest.TestSuite):
                flatten(t)
            else:
                tests.append(t)
    flatten(standard_tests)
    if total <= 1:
        return standard_tests
    load = [0] * total
    mine = unittest.TestSuite()
    for t in sorted(tests, key=lambda t: (-COST.get(t._testMethodName, 2),
                                          t.id())):
        shard = load.index(min(load))
        load[shard] += COST.get(t._testMethodName, 2)
        if shard == index:
            mine.addTest(t)
    return mine


if __name__ == "__main__":
    unittest.main()
