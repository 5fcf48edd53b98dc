"""A CPU stand-in for the daemon's side of the step path, for testing
stepworker.py's plumbing (io-buffer offsets, phase order, the rows it reads
back) where there is no GPU: each doorbell phase is carried out with the
regular RPCs that do the same work (STEP_PATH.md: S = SWA decode index,
A_l = plain stores into main, SWA ring and index, B_l = convert_topk). It
says nothing about the real step path's kernels or handshake."""

from typing import Any, Dict

import torch

from stepworker import StepPathWorker


class SimulatedStepWorker(StepPathWorker):
    def _register(self) -> None:
        self.args: Dict[str, Any] = {}

    def _step_rpc(self, step_id: int, args: Dict[str, Any]) -> None:
        """What kvt.step would send, kept for the simulated phases."""
        if step_id != self.step_id:
            raise AssertionError(f"step id {step_id} != {self.step_id}")
        self.args = args

    def status(self) -> Dict[str, int]:
        return {"status_bits": 0, "out_of_range": 0, "step_counter":
                self.step_id, "daemon_done": self.step_id}

    def close(self) -> None:
        self.io.release()
        super(StepPathWorker, self).close()

    def _db(self, op: str, phase: int = 0) -> None:
        if op == "begin":
            return
        r = self.args
        cfg = self.cfg
        W, K, D = cfg.window, cfg.topk, cfg.kv_dim
        lens, states = r["seq_lens"], r["swa_state_ids"]
        slots = r["slot_mapping"]
        B = len(slots)
        if op == "wait" and phase == 0:
            q = [[st, max(0, n - W), min(n, W)] for st, n in zip(states, lens)]
            res = self.kv.swa_decode_index(self.swa, W, q)
            self._io(self.swa_off, B * W * 4).view(torch.int32).copy_(
                torch.tensor(list(res.slots), dtype=torch.int32))
            return
        if op != "mark":
            return
        layer, which = (phase - 1) // 2, (phase - 1) % 2
        base = layer * self.layer_bytes
        if which == 0:   # A: plain stores from the registered rows
            kv = _raw(self._io(base, B * D * 2))
            ring = [st * W + (n - 1) % W for st, n in zip(states, lens)]
            self.kv.store(self.main, layer, slots, kv, dtype="bf16")
            self.kv.store(self.swa, layer, ring, kv, dtype="bf16")
            ik = _raw(self._io(base + self.kv_bytes, B * cfg.index_dim * 2))
            self.kv.store(self.idx, layer, slots, ik, dtype="bf16")
            return
        tk_off = base + self.kv_bytes + self.ik_bytes
        topk = self._io(tk_off, B * K * 4).view(torch.int32).view(B, K)
        res = self.kv.convert_topk(
            self.main, topk.tolist(), [min(K, n) for n in lens], lens,
            r["block_tables"])
        self._io(tk_off + self.tk_bytes, B * K * 4).view(torch.int32).copy_(
            torch.tensor(list(res.slots), dtype=torch.int32))


def _raw(t: torch.Tensor) -> bytes:
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)
