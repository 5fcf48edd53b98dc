"""A CPU stand-in for the daemon's side of the step path, for testing
stepworker.py's plumbing (io-buffer offsets, phase order, the rows it reads
back) where there is no GPU: each doorbell phase is carried out with the
regular RPCs that do the same work (STEP_PATH.md: S = SWA decode index,
A_l = plain stores into main, SWA ring and index, B_l = convert_topk). It
says nothing about the real step path's kernels or handshake."""

import struct
from typing import Any, Dict, List

import torch

from stepworker import StepPathWorker


class SimulatedStepWorker(StepPathWorker):
    def _register(self) -> None:
        self.stub: Any = self
        self.handle = None
        self.registration = 0
        self.req: Any = None

    # The stub's Step and Unregister.
    def Step(self, req: Any, timeout: float = 0,
             metadata: Any = ()) -> None:  # noqa: N802
        if req.step_id != self.step_id:
            raise AssertionError(f"step id {req.step_id} != {self.step_id}")
        self.req = req

    def Unregister(self, req: Any, timeout: float = 0,
                   metadata: Any = ()) -> None:  # noqa: N802
        pass

    def _stream(self) -> Any:
        return None

    def status(self) -> Dict[str, int]:
        return {"status_bits": 0, "out_of_range": 0, "step_counter":
                self.step_id, "daemon_done": self.step_id}

    def close(self) -> None:
        self.io.release()
        super(StepPathWorker, self).close()

    def _ints(self, field: bytes) -> List[int]:
        return list(struct.unpack(f"<{len(field) // 4}i", field))

    def _call(self, name: str, *a: Any) -> None:
        if name in ("kvd_step_begin", "kvd_status"):
            return
        phase = a[1]
        r = self.req
        B, cfg = r.num_tokens, self.cfg
        W, K, D = cfg.window, cfg.topk, cfg.kv_dim
        lens = self._ints(r.seq_lens)
        states = self._ints(r.swa_state_ids)
        slots = self._ints(r.slot_mapping)
        if name == "kvd_wait" and phase == 0:
            q = [[st, max(0, n - W), min(n, W)] for st, n in zip(states, lens)]
            res = self.kv.swa_decode_index(self.swa, W, q)
            self._io(self.swa_off, B * W * 4).view(torch.int32).copy_(
                torch.tensor(list(res.slots), dtype=torch.int32))
            return
        if name != "kvd_mark":
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
        cols = r.block_table_cols
        table = self._ints(r.block_tables)
        res = self.kv.convert_topk(
            self.main, topk.tolist(), [min(K, n) for n in lens], lens,
            [table[b * cols:(b + 1) * cols] for b in range(B)])
        self._io(tk_off + self.tk_bytes, B * K * 4).view(torch.int32).copy_(
            torch.tensor(list(res.slots), dtype=torch.int32))


def _raw(t: torch.Tensor) -> bytes:
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)
