"""A CPU stand-in for the daemon's side of the step path, for testing
stepworker.py's plumbing (io-buffer offsets, phase order, the rows it reads
back) where there is no GPU: each doorbell phase is carried out with the
regular RPCs that do the same work (STEP_PATH.md: S = SWA decode index,
A_l = the fused stores into main (slot_mapping at ratio 1, the
compressed slot mapping of ratio R at ratio R > 1) and the SWA ring with the fused
parameters the worker registers, and the plain index store, B_l =
convert_topk over seq_len / R compressed rows, with the block tables of
the Step or, device-resident, of the io buffer's rows). It says nothing about the
real step path's kernels or handshake.

It does check the Steps as the daemon and the doorbell would see them:
step ids one apart (a step sent twice fails), at most two sent and not
yet finished (the daemon's RESOURCE_EXHAUSTED), each step begun on the
worker's stream only after its Step was sent (here the phases need its
arguments; on the GPU the stream would wait), and at close() none sent
and never run (the daemon's deadline would cancel it: a sticky error).
AssertionError otherwise."""

from typing import Any, Dict, List, Tuple

import torch

from kvd_adapter import fused_store
from stepworker import StepPathWorker


class SimulatedStepWorker(StepPathWorker):
    def _register(self) -> None:
        self.args: Dict[str, Any] = {}
        # Steps sent and not yet begun, in order; the last id sent and
        # the steps begun.
        self.sent: List[Tuple[int, Dict[str, Any]]] = []
        self.last_sent = 0
        self.begun = 0

    def _step_rpc(self, step_id: int, args: Dict[str, Any]) -> None:
        """What kvt.step would send, queued for the simulated phases (a
        synchronous stand-in: no future to collect)."""
        if step_id != self.step_id or step_id != self.last_sent + 1:
            raise AssertionError(
                f"Step {step_id} sent after Step {self.last_sent} "
                f"(worker step id {self.step_id}): sent twice or skipped")
        if len(self.sent) >= 2:
            raise AssertionError(
                f"Step {step_id}: a third step in flight (steps "
                f"{[i for i, _ in self.sent]} sent, not run)")
        self.sent.append((step_id, args))
        self.last_sent = step_id

    def status(self) -> Dict[str, int]:
        return {"status_bits": 0, "out_of_range": 0, "step_counter":
                self.step_id, "daemon_done": self.step_id}

    def close(self) -> None:
        try:
            self._collect()
            if self.sent or self.ahead is not None:
                raise AssertionError(
                    f"steps {[i for i, _ in self.sent]} were sent and "
                    "never run")
        finally:
            self.ahead = None
            self.io.release()
            super(StepPathWorker, self).close()

    def _db(self, op: str, phase: int = 0) -> None:
        if op == "begin":
            if not self.sent:
                raise AssertionError(
                    f"step {self.begun + 1} begun before its Step was sent")
            step_id, self.args = self.sent.pop(0)
            self.begun += 1
            if step_id != self.begun:
                raise AssertionError(f"step {self.begun} begun with the "
                                     f"arguments of Step {step_id}")
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
        o, R = self.layer_offsets(layer), cfg.ratio(layer)
        if which == 0:   # A: fused stores from the registered rows
            pos = r["positions"]
            rows = self._rows(o["kv"], B, D)
            main_rows = self._rows(o["comp"], B, D) if R > 1 else rows
            main_slots = (r["compressed_slot_mappings"][R] if R > 1
                          else slots)
            ring = [st * W + (n - 1) % W for st, n in zip(states, lens)]
            fp = self.fp[layer]
            fused_store(self.kv, self.main, layer, main_slots, main_rows,
                        pos, fp)
            fused_store(self.kv, self.swa, layer, ring, rows, pos, fp)
            ik = _raw(self._io(o["ik"], B * cfg.index_dim * 2))
            self.kv.store(self.idx, layer, main_slots, ik, dtype="bf16")
            return
        tk_off = o["topk"]
        topk = self._io(tk_off, B * K * 4).view(torch.int32).view(B, K)
        rows_c = [n // R for n in lens]
        res = self.kv.convert_topk(
            self.main, topk.tolist(), [min(K, n) for n in rows_c], rows_c,
            self._tables(r, B))
        self._io(tk_off + self.tk_bytes, B * K * 4).view(torch.int32).copy_(
            torch.tensor(list(res.slots), dtype=torch.int32))


    def _tables(self, r: Dict[str, Any], B: int) -> List[List[int]]:
        """The step's block tables as the daemon's convert_topk reads them:
        inline from the Step, or (block_tables_in_buffer) rows [0, B),
        columns [0, block_table_cols) of the io buffer's table rows, as the
        worker's stream wrote them before this phase."""
        if not r.get("block_tables_in_buffer"):
            return r["block_tables"]
        if "block_tables" in r:
            raise AssertionError("block_tables sent with "
                                 "block_tables_in_buffer")
        cols = r["block_table_cols"]
        rows = self._io(self.bt_off, B * self.bt_stride).view(
            torch.int32).view(B, self.bt_stride // 4)
        return rows[:, :cols].tolist()

    def _rows(self, offset: int, n: int, d: int) -> torch.Tensor:
        """BF16 rows [n, d] of the io buffer (as fp32 values)."""
        return self._io(offset, n * d * 2).view(torch.bfloat16).view(
            n, d).to(torch.float32)


def _raw(t: torch.Tensor) -> bytes:
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)
