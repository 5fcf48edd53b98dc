"""Daemon mode vs library mode (issue 15 items 4-5): the reference worker
with its cache in a real kvdepotd (CPU backend) and the same worker with
kvdepot's kernels in-process (libkvdepot_kernels.so, CPU entry points),
stepped together. Run by //examples/ref_worker:libmode_test (Debian's
python3-torch); the library comes from the target's data."""

import os
import random
import sys
import types
import unittest

import torch

import kvdepot
import libmode
import libmode_oracle as oracle
import scenarios
from model import Config, make_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

CPU = torch.device("cpu")
STEPS = 64


def args(**kw) -> types.SimpleNamespace:
    a = dict(device="cpu", format="DS_MLA_FP8", layers=2, window=128,
             steps=STEPS, seed=1234, prefix="t.", step_mode="graph",
             library_speed=True)
    a.update(kw)
    return types.SimpleNamespace(**a)


class LibraryModeTest(unittest.TestCase):
    def setUp(self):
        lib, _, why = libmode.kernels()
        if lib is None:      # a data dependency of this target: never skip
            self.fail(why)
        self.daemon = run.OwnDaemon(os.environ["KVDEPOT_BIN"], [])

    def tearDown(self):
        rc = self.daemon.stop()
        if rc != 0:
            with open(self.daemon.log_path) as f:
                self.fail(f"kvdepotd exited {rc}:\n{f.read()[-4000:]}")

    def test_daemon_vs_library_mode_bit_identical(self):
        """run.py --scenario library: >= 64 decode steps of a batch of 3,
        every read, logit and token bit-identical, pools byte-identical,
        then both timed."""
        r = run.run_one("library", args(), self.daemon.socket, self.daemon,
                        CPU)
        print(r, flush=True)
        self.assertTrue(r["passed"], r)
        o = r["oracle"]
        self.assertGreaterEqual(o["decode_steps"], STEPS)
        self.assertEqual(o["decode_tokens"], 3 * STEPS)
        self.assertGreater(o["compared_entries"], 1000)
        self.assertGreater(o["compared_bytes"], 0)
        self.assertGreater(o["pool_bytes_identical"], 0)
        self.assertEqual(o["layout_fields_checked"], 3 * 15)
        for k in ("window_rows", "topk_slots", "prefill_index_rows",
                  "prefill_rows_bitexact"):
            self.assertGreater(o["checks_library"][k], 0, k)
        s = r["speed"]
        for side in ("daemon", "library"):
            self.assertGreater(s[side]["tokens_per_s"], 0)
        self.assertIn("daemon_overhead_ms_per_layer_step", s)

    def test_step_path_vs_library_step_bit_identical(self):
        """The step path's library-mode counterpart (LibraryStepWorker:
        the daemon's phases as in-process kernel calls at each doorbell
        point) against the step path with its daemon side stood in for by
        regular RPCs (stepsim; the CPU backend has no step path): static
        shapes (what graph mode captures), a compressed main cache at
        ratio 4 next to a per-token one, prompts ending inside a group and
        crossing a block of compressed rows; every step's logits and io
        rows, and the pools at the end, bit-identical."""
        import stepsim
        cfg = Config(layers=2, ratios=(4, 1))
        w = make_weights(cfg, CPU)
        lib, K, _ = libmode.kernels()
        rng = random.Random(3)
        prompts = [scenarios.prompt(rng, cfg, n) for n in (77, 261)]
        with kvdepot.connect(self.daemon.socket, client_name="stepsim") as kv:
            dw = stepsim.SimulatedStepWorker(kv, cfg, w, CPU, prefix="sp.",
                                             mode="static")
            lw = libmode.LibraryStepWorker(
                libmode.LibraryKernels(lib, K, CPU), cfg, w, CPU,
                prefix="sp.", mode="static")
            try:
                r = oracle.step_path_lockstep(dw, lw, prompts, 12)
            finally:
                dw.close()
                lw.close()
        print(r, flush=True)
        self.assertEqual(r["decode_steps"], 12)
        # The step path sent each next Step ahead, each once (stepsim).
        self.assertEqual((dw.step_rpcs, dw.begun), (12, 12))
        self.assertGreater(r["compared_io_bytes"], 0)
        self.assertGreater(r["pool_bytes_identical"], 0)
        self.assertGreater(lw.checks["topk_slots"], 0)

    def lockstep(self, seed: int):
        cfg = Config(layers=1, ratios=(1,))
        w = make_weights(cfg, CPU)
        lib, K, _ = libmode.kernels()
        kv = kvdepot.connect(self.daemon.socket, client_name=f"mut{seed}")
        dw = oracle.DaemonWorker(kv, cfg, w, CPU, prefix=f"m{seed}.")
        lw = oracle.RecordingLibraryWorker(
            libmode.LibraryKernels(lib, K, CPU), cfg, w, CPU,
            prefix=f"m{seed}.")
        ls = oracle.Lockstep(dw, lw)
        ls.start(0, scenarios.prompt(random.Random(seed), cfg, 70), 8)
        ls.step()
        return kv, ls

    def flip(self, worker, kind: str, slot: int, byte: int = 0) -> None:
        """XOR 1 into one byte of a record of layer 0, through the view."""
        g = worker.geo[worker.prefix + kind]
        b, t = divmod(slot, g.block_size)
        off = b * g.block_stride + t * (g.bytes_per_token if g.interleaved
                                        else g.data_bytes) + byte
        layer = worker.views[worker.prefix + kind].layer(0).raw
        layer[off] = int(layer[off]) ^ 1

    def test_one_byte_changed_on_either_side_is_caught(self):
        """The mutation check: one byte of the SWA ring record the next
        step reads, changed on one side only, fails that step; one byte
        nobody reads, changed in the daemon's pool, fails the end-of-run
        pool comparison."""
        for i, side in enumerate(("daemon", "library")):
            with self.subTest(side=side):
                kv, ls = self.lockstep(11 + i)
                try:
                    w = ls.dw if side == "daemon" else ls.lw
                    s = w.seqs[0]
                    p = s.cached - 1           # read again by the next step
                    self.flip(w, "swa", s.state_id * w.cfg.window +
                              p % w.cfg.window)
                    with self.assertRaisesRegex(
                            oracle.Mismatch,
                            "decode step 2: layer 0 swa dequantized rows"):
                        ls.step()
                finally:
                    ls.dw.close()
                    ls.lw.close()
                    kv.close()
        kv, ls = self.lockstep(21)
        try:
            for _ in range(3):
                ls.step()
            self.assertGreater(ls.finish_pools(), 0)      # identical so far
            w = ls.dw
            last = w.num_blocks * w.cfg.block_size - 1    # never used
            self.flip(w, "main", last)
            with self.assertRaisesRegex(oracle.Mismatch,
                                        "pool main layer 0: byte"):
                ls.finish_pools()
        finally:
            ls.dw.close()
            ls.lw.close()
            kv.close()


if __name__ == "__main__":
    unittest.main()
