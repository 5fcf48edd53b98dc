"""Decode through the step path (SPEC §10, docs/STEP_PATH.md) on the CUDA
backend, all through kvdepot.torch: kvt.register_worker once, one kvt.step
(the scheduler's Step) per engine step, and the worker's stream ordered
against the daemon's by kvt.StepWorker (libkvdepot_worker.so's doorbell:
step_begin, mark, wait). Modes: eager, static shapes, or static captured in
a CUDA graph.

The main and SWA caches are registered with fused-store parameters (the
layer's RMSNorm weight over the latent [0, latent), eps, interleaved RoPE
on [latent, latent + 64) from the model's cos/sin cache: DS_MLA_FP8 0-512 /
512-576, V41 0-448 / 448-512), so the worker writes the RAW projected K
(pre-norm, pre-RoPE, BF16) and phase A normalizes, rotates and quantizes,
as the per-layer path's fused Store does. Every step carries the tokens'
positions.

Compressed main caches (ratio R > 1, SPEC §6): a layer's compressed row r
is the BF16 mean of the raw K of positions [rR, rR + R) (and of their
indexer keys for the index cache), stored at the position that completes
it. The worker keeps the last R raw rows of each sequence per layer of
ratio R on the device (indexed by the sequence's SWA state and p mod R, so
a CUDA graph updates them) and writes the mean into the layer's compressed
input rows every step. Layers may have different ratios (the model's
default is 4, 1, 4, 2): each Step carries one compressed slot mapping per
distinct ratio R > 1 (StepRequest.compressed, the client's
compressed_slot_mappings={R: mapping}; worker.compressed_row_slot, -1
where no row of ratio R completes), which tells the daemon which tokens to
store in the layers of that ratio.
Prefill stays on PrefillLoad / PrefillIndex (KVWorker); a prompt's
incomplete last group is handed to the device rows at its first decode.

Sending Steps (pipeline=): "lookahead" (default) sends each Step without
waiting for its reply (kvt.step_async), before the step's GPU work is
enqueued, and collects the reply before the next Step is sent; when the
caller says the next decode step has the same batch (decode(...,
next_same_batch=True)) it sends step s + 1's Step (blocks ensured,
positions + 1) right after enqueueing step s, so the daemon enqueues
s + 1's phases while the GPU runs s, and the next decode call does not
send it again. The doorbell makes the order irrelevant (the worker's stream
writes flag = 1 and waits done; the daemon's waits flag == 1 whenever it
is enqueued). A step is sent ahead only when the caller promised the next
decode step (an unrun step would be cancelled by the daemon's deadline,
a sticky error). "async": no lookahead; "sync": every Step waited for
before the step runs (the old way). step_rpc_s / step_rpcs /
step_retries: host time in Step sends and reply waits, Steps sent, sends
again after RESOURCE_EXHAUSTED.

Block tables (block_tables=): "device" (default) keeps them in the io
buffer, int32 [max_tokens][num_blocks] rows (registered as the
registration's block-table buffer, SPEC §10 "in device memory when
large"); the worker's stream writes the step's rows before step_begin,
so before mark(phase_b(0)), and the next step's only after this one's
last wait (the ordering contract, docs/STEP_PATH.md); each Step then
carries block_tables_in_buffer and the column count, no tables. "inline":
each Step carries them."""

import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

import kvdepot
import kvdepot.torch as kvt
from kvdepot.v1 import step_pb2

import kvd_adapter
from codec import dequant_mxfp8_index, gather_records
from model import (Config, Weights, attend, bf16, index_scores, logits, mlp,
                   project, select_topk)
from worker import KVWorker, compressed_row_slot


def compressed_ratios(cfg: Config) -> List[int]:
    """The distinct ratios > 1 of cfg's layers, ascending: one compressed
    slot mapping each per Step (the daemon takes at most 8)."""
    return sorted({cfg.ratio(l) for l in range(cfg.layers)} - {1})


def _up(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class StepPathWorker(KVWorker):
    # The worker's own CUDA stream, set by _register (None on the CPU).
    stream: Optional["torch.cuda.Stream"] = None

    def __init__(self, client: kvdepot.Client, cfg: Config, w: Weights,
                 device: torch.device, *, max_tokens: int = 8,
                 watchdog_ms: int = 10000, mode: str = "eager",
                 pipeline: str = "lookahead", block_tables: str = "device",
                 transport: str = "unary", **kw):
        """mode: "eager" (per-sequence indexer, host reads between phases),
        "static" (fixed shapes, no host reads inside a step: what a graph
        needs), "graph" (static, captured in a CUDA graph at the second
        step and replayed while the batch stays the same). pipeline:
        "lookahead", "async" or "sync" (the module's docstring).
        block_tables: "device" or "inline" (the module's docstring).
        transport: "unary" (a Step call each, kvt.step_async) or "ring"
        (kvt.StepRing: shared memory with the daemon, no gRPC call per
        step; opened at registration, closed by close())."""
        if mode not in ("eager", "static", "graph"):
            raise ValueError(f"mode {mode}")
        if pipeline not in ("sync", "async", "lookahead"):
            raise ValueError(f"pipeline {pipeline}")
        self.mode = mode
        self.pipeline = pipeline
        if block_tables not in ("device", "inline"):
            raise ValueError(f"block_tables {block_tables}")
        self.device_tables = block_tables == "device"
        if transport not in ("unary", "ring"):
            raise ValueError(f"transport {transport}")
        self.transport = transport
        self.ring: Any = None
        # The last Step sent whose reply was not collected (a StepFuture;
        # None once collected or where _step_rpc is synchronous), and the
        # (seq_ids, positions) of a step sent ahead, not yet run.
        self.pending: Any = None
        self.ahead: Optional[Tuple[List[int], List[int]]] = None
        self.step_rpcs = 0
        self.step_rpc_s = 0.0
        self.step_retries = 0
        self.graph: Any = None
        self.graph_batch: List[int] = []
        self.replays = 0
        self.ratios = compressed_ratios(cfg)
        self.max_tokens = max_tokens
        self.watchdog_ms = watchdog_ms
        self.step_id = 0
        super().__init__(client, cfg, w, device, **kw)
        self._alloc_io()
        self._register()

    def _alloc_io(self) -> None:
        cfg, T, K, W = self.cfg, self.max_tokens, self.cfg.topk, self.cfg.window
        # The io buffer: per layer [raw K rows | compressed K rows | index
        # rows | top-k | index out] (offsets in layer_offsets), then the SWA
        # decode index rows.
        D = cfg.kv_dim
        self.kv_bytes = _up(T * D * 2)
        self.ik_bytes = _up(T * cfg.index_dim * 2)
        self.tk_bytes = _up(T * K * 4)
        self.layer_bytes = (2 * self.kv_bytes + self.ik_bytes
                            + 2 * self.tk_bytes)
        # Then the block tables (block_tables="device"): int32 rows of
        # num_blocks entries, row r = sequence r of the step.
        self.swa_off = cfg.layers * self.layer_bytes
        self.bt_off = self.swa_off + _up(T * W * 4)
        self.bt_stride = 4 * self.num_blocks
        size = self.bt_off + _up(T * self.bt_stride)
        self.io = self._buffer(size)
        # The last R raw K / indexer-key rows per SWA state and layer of
        # ratio R > 1 (fp32 holding BF16 values), row p mod R.
        self.acc: Dict[int, Any] = {}
        for l in range(cfg.layers):
            R = cfg.ratio(l)
            if R > 1:
                self.acc[l] = (
                    torch.zeros(self.num_states, R, D, device=self.device),
                    torch.zeros(self.num_states, R, cfg.index_dim,
                                device=self.device))

    def _buffer(self, size: int):
        return kvd_adapter.HostBuffer(self.kv, size, self.device)

    def layer_offsets(self, l: int) -> Dict[str, int]:
        """Byte offsets of layer l's rows in the io buffer."""
        base = l * self.layer_bytes
        comp = base + self.kv_bytes
        ik = comp + self.kv_bytes
        tk = ik + self.ik_bytes
        return {"kv": base, "comp": comp, "ik": ik, "topk": tk,
                "out": tk + self.tk_bytes}

    def fused_params(self, l: int) -> "step_pb2.StepFused":
        """Layer l's fused-store parameters (SPEC §8) for its main and SWA
        caches: RMSNorm [0, latent) with the layer's kv_norm weight, eps,
        interleaved RoPE on [latent, latent + rope_dim) from the model's
        cos/sin cache, no Hadamard: what the per-layer path's fused Store
        sends (kvd_adapter.FusedParams), registered once."""
        fp = self.fp[l]
        return kvt.step_fused(
            norm_begin=0, norm_end=fp.norm_end, norm_weight=fp.norm_weight,
            eps=fp.eps, rope="interleaved", rope_offset=fp.rope_offset,
            rope_dim=fp.rope_dim, cos_sin=fp.cos_sin)

    def registration_layers(self, io: Any) -> List["step_pb2.StepLayer"]:
        """The StepLayers of RegisterWorker over io buffer `io` (a Buffer
        or its id): main (fused; raw K rows at ratio 1, compressed rows at
        ratio R), SWA (fused, raw K rows), index (plain; the indexer keys,
        or their group means at ratio R), top-k and index rows."""
        cfg, K, W, D = self.cfg, self.cfg.topk, self.cfg.window, self.cfg.kv_dim
        layers = []
        for l in range(cfg.layers):
            o, R = self.layer_offsets(l), cfg.ratio(l)
            f = self.fused_params(l)
            layers.append(kvt.layer(
                main=kvt.cache(self.main, l, io,
                               offset=o["comp"] if R > 1 else o["kv"],
                               row_stride=D * 2, fused=f),
                swa=kvt.cache(self.swa, l, io, offset=o["kv"],
                              row_stride=D * 2, fused=f),
                index=kvt.cache(self.idx, l, io, offset=o["ik"],
                                row_stride=cfg.index_dim * 2),
                ratio=R, window=W,
                topk=kvt.buffer_ref(io, o["topk"], K * 4),
                index_out=kvt.buffer_ref(io, o["out"], K * 4)))
        return layers

    def registration_args(self, io: Any) -> Dict[str, Any]:
        """register_worker's arguments over io buffer `io` (a Buffer or
        its id), but the doorbell: the layers, the SWA decode index, the
        bounds and, with device-resident tables, the block-table rows."""
        cfg, T, K, W = self.cfg, self.max_tokens, self.cfg.topk, self.cfg.window
        args = dict(
            layers=self.registration_layers(io),
            swa_index=step_pb2.StepSwaIndex(
                pool=self.swa, window=W,
                out=kvt.buffer_ref(io, self.swa_off, W * 4)),
            max_tokens=T, max_seqs=T, max_top_k=K,
            max_blocks_per_seq=self.num_blocks, name=self.prefix + "step")
        if self.device_tables:
            args["block_tables"] = kvt.buffer_ref(io, self.bt_off,
                                                  self.bt_stride)
        return args

    def _write_tables(self, table: torch.Tensor) -> None:
        """The step's block tables ([B, num_blocks] int64 on the device,
        -1 past each sequence's blocks) into the io buffer's rows, on the
        current stream (capturable), before step_begin: the daemon's
        convert_topk reads them after mark(phase_b(0)). Inline tables:
        nothing."""
        if not self.device_tables:
            return
        B = table.shape[0]
        self._io(self.bt_off, B * self.bt_stride).view(torch.int32).copy_(
            table.reshape(-1).to(torch.int32))

    def _flush_pending(self, seqs) -> None:
        """Hands a prompt's incomplete last group (KVWorker keeps it in
        s.raw / s.ik_raw after prefill) to the device rows, before the
        sequence's first decode step."""
        for s in seqs:
            for l, (kv_acc, ik_acc) in self.acc.items():
                if not s.raw[l]:
                    continue
                R = self.cfg.ratio(l)
                p0 = s.cached - len(s.raw[l])
                for i, (k, ik) in enumerate(zip(s.raw[l], s.ik_raw[l])):
                    kv_acc[s.state_id, (p0 + i) % R] = k
                    ik_acc[s.state_id, (p0 + i) % R] = ik
                s.raw[l], s.ik_raw[l] = [], []

    def _write_inputs(self, l: int, pr, states: torch.Tensor,
                      pos: torch.Tensor) -> None:
        """Layer l's input rows of this step (no host reads: capturable):
        raw K; at ratio R > 1 the group means of K and of the indexer keys
        (meaningful where the token completes a group, the only rows the
        daemon stores), else the indexer keys."""
        B, D, I = pr.kv_raw.shape[0], self.cfg.kv_dim, self.cfg.index_dim
        o = self.layer_offsets(l)
        self._io(o["kv"], B * D * 2).view(torch.bfloat16).copy_(
            pr.kv_raw.reshape(-1).to(torch.bfloat16))
        ik = pr.ik_raw
        if l in self.acc:
            kv_acc, ik_acc = self.acc[l]
            j = pos % self.cfg.ratio(l)
            kv_acc[states, j] = pr.kv_raw
            ik_acc[states, j] = pr.ik_raw
            self._io(o["comp"], B * D * 2).view(torch.bfloat16).copy_(
                bf16(kv_acc[states].mean(dim=1)).reshape(-1).to(
                    torch.bfloat16))
            ik = bf16(ik_acc[states].mean(dim=1))
        self._io(o["ik"], B * I * 2).view(torch.bfloat16).copy_(
            ik.reshape(-1).to(torch.bfloat16))

    def _register(self) -> None:
        """RegisterWorker (kvt.register_worker) over the io buffer, then the
        worker's side of the doorbell (kvt.StepWorker, on
        libkvdepot_worker.so)."""
        cfg, io = self.cfg, self.io.buf
        self.doorbell = self.kv.allocate_buffer(kvt.doorbell_bytes(cfg.layers))
        self.reg = kvt.register_worker(
            self.kv, doorbell=self.doorbell, **self.registration_args(io))
        self.sw = kvt.StepWorker.open(self.kv, self.reg,
                                      device=self.device.index or 0,
                                      watchdog_ms=self.watchdog_ms)
        # The worker's own stream: the doorbell calls refuse the legacy
        # default stream (it cannot be captured), and torch's current
        # stream is that one unless a caller chose another.
        self.stream = (torch.cuda.Stream(device=self.device)
                       if self.device.type == "cuda" else None)

    def _step_rpc(self, step_id: int, args: Dict[str, Any]) -> Any:
        """Sends the Step without waiting: its StepFuture or
        RingStepFuture (a stand-in that does the step's work at once
        returns None)."""
        if self.transport == "unary":
            return kvt.step_async(self.kv, self.reg.registration_id,
                                  step_id=step_id, **args)
        request = kvt.step_request(self.kv, self.reg.registration_id,
                                   step_id=step_id, **args)
        if self.ring is None:
            # Room for the largest Step this worker sends, twice over: per
            # token its int32 and int64 fields, per sequence a row of
            # inline block tables. At least the default 1 MiB.
            bound = self.max_tokens * (64 + 4 * self.num_blocks) + 4096
            size = max(1 << 20, (2 * bound + 63) // 64 * 64)
            self.ring = kvt.StepRing(self.kv, slots=2,
                                     request_bytes=min(size, 16 << 20))
        return self.ring.step_async(request)

    def _db(self, op: str, phase: int = 0) -> None:
        """The doorbell on the current stream: "begin" (step_begin), "mark"
        or "wait" at a phase (0 = S, phase_a(l), phase_b(l))."""
        if op == "begin":
            self.sw.step_begin()
        elif op == "mark":
            self.sw.mark(phase)
        else:
            self.sw.wait(phase)

    def _io(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.io.tensor[offset:offset + nbytes]

    def status(self) -> Dict[str, int]:
        st = self.sw.status()
        return {"status_bits": st.status_bits, "out_of_range":
                st.out_of_range, "step_counter": st.step_counter,
                "daemon_done": st.daemon_done}

    def _unrun_warning(self) -> None:
        """Closing with a step sent ahead and never run: the caller passed
        next_same_batch=True and did not decode that step."""
        if self.ahead is not None:
            warnings.warn(f"step {self.step_id} was sent ahead (sequences "
                          f"{self.ahead[0]}) and never run")
            self.ahead = None

    def close(self) -> None:
        self._unrun_warning()
        try:
            self._collect()
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            try:
                if self.ring is not None:
                    self.ring.close()
                kvt.unregister(self.kv, self.reg.registration_id)
            finally:
                self.sw.close()
                self.io.release()
                self.doorbell.release()
                super().close()

    @torch.no_grad()
    def decode(self, seq_ids: List[int],
               next_same_batch: bool = False) -> Dict[int, torch.Tensor]:
        """One decode step of seq_ids. next_same_batch: the caller's
        promise that the next decode call is for the same seq_ids (none
        finishes or joins); pipeline "lookahead" then sends that step's
        Step now."""
        if self.stream is None:
            return self._decode_on_stream(seq_ids, next_same_batch)
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            out = self._decode_on_stream(seq_ids, next_same_batch)
        caller.wait_stream(self.stream)
        return out

    def _decode_on_stream(self, seq_ids: List[int],
                          next_same_batch: bool = False
                          ) -> Dict[int, torch.Tensor]:
        if self.mode != "eager":
            return self._decode_static(seq_ids, next_same_batch)
        cfg, w, dev = self.cfg, self.w, self.device
        seqs = [self.seqs[i] for i in seq_ids]
        B, W, K, D = len(seqs), cfg.window, cfg.topk, cfg.kv_dim
        assert B <= self.max_tokens
        for s in seqs:
            assert s.cached == len(s.tokens) - 1
            self._ensure_blocks(s, s.cached + 1)
        P = [s.cached for s in seqs]
        pos = torch.tensor(P, device=dev)
        states = torch.tensor([s.state_id for s in seqs], device=dev)
        self._flush_pending(seqs)
        self._step_for(seq_ids, seqs, P)
        if self.device_tables:
            tab = torch.full((B, self.num_blocks), -1, dtype=torch.int64)
            for b, s in enumerate(seqs):
                tab[b, :len(s.blocks)] = torch.tensor(s.blocks)
            self._write_tables(tab.to(dev))
        self._db("begin")
        self._db("wait", 0)
        win = self._io(self.swa_off, B * W * 4).view(torch.int32).view(
            B, W).to(torch.int64)
        x = w.embed[torch.tensor([s.tokens[-1] for s in seqs], device=dev)]
        for l, lw in enumerate(w.layers):
            R = cfg.ratio(l)
            pr = project(cfg, lw, x, pos, w.cos_sin)
            self._write_inputs(l, pr, states, pos)
            self._db("mark", 1 + 2 * l)
            self._db("wait", 1 + 2 * l)
            topk = torch.full((B, K), -1, dtype=torch.int64, device=dev)
            for b, s in enumerate(seqs):
                n = (P[b] + 1) // R
                ik = self._index_keys(l, s, n)
                t, _ = select_topk(index_scores(pr.iq[b:b + 1],
                                                pr.iw[b:b + 1], ik),
                                   torch.tensor([n], device=dev), K)
                topk[b] = t[0]
            for b, s in enumerate(seqs):
                if l == 0:
                    s.step_topk = []
                s.step_topk.append(topk[b].clone())
            tk_off = self.layer_offsets(l)["topk"]
            self._io(tk_off, B * K * 4).view(torch.int32).copy_(
                topk.reshape(-1).to(torch.int32))
            self._db("mark", 2 + 2 * l)
            self._db("wait", 2 + 2 * l)
            slots = self._io(tk_off + self.tk_bytes, B * K * 4).view(
                torch.int32).view(B, K).to(torch.int64)
            if self.check:
                self._check_rows(seqs, P, win, slots, topk, l)
            wk = self._read_main(self.swa, l, win)
            mk = self._read_main(self.main, l, slots)
            keys = torch.cat([wk, mk], dim=1)
            valid = torch.cat([win >= 0, slots >= 0], dim=1)
            x = x + attend(cfg, pr.q, keys, valid) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        self._after_launch(seq_ids, seqs, P, next_same_batch)
        for s in seqs:
            s.cached += 1
        st = self.status()
        if st["status_bits"] or st["out_of_range"]:
            self._fail(f"step {self.step_id}: doorbell status {st}")
        out = logits(cfg, w, x)
        return {s.seq_id: out[b] for b, s in enumerate(seqs)}

    def _check_rows(self, seqs, P, win, slots, topk, l) -> None:
        W = self.cfg.window
        for b, (s, p) in enumerate(zip(seqs, P)):
            want = [s.state_id * W + q % W
                    for q in range(max(0, p - W + 1), p + 1)]
            want += [-1] * (W - len(want))
            if win[b].tolist() != want:
                self._fail(f"step path SWA rows of seq {s.seq_id} at {p}: "
                           f"got {win[b].tolist()}, want {want}")
            want = [self._slot(s, int(v)) if v >= 0 else -1
                    for v in topk[b].tolist()]
            if slots[b].tolist() != want:
                self._fail(f"step path index rows seq {s.seq_id} layer {l}: "
                           f"got {slots[b].tolist()}, want {want}")
        if l == 0:
            self.checks["window_rows"] += len(seqs)
        self.checks["topk_slots"] += len(seqs)

    # ------------------------------------------------------------ static

    def _step_for(self, seq_ids: List[int], seqs, P: List[int]) -> None:
        """Before the step's GPU work: its Step, unless it was sent ahead
        (then checked to be this step)."""
        if self.ahead is None:
            self._send_step(seqs, P)
            return
        want, self.ahead = self.ahead, None
        if want != (list(seq_ids), list(P)):
            raise RuntimeError(
                f"step {self.step_id} was sent ahead for sequences "
                f"{want[0]} at positions {want[1]}, but the decode call is "
                f"for {list(seq_ids)} at {list(P)}: pass next_same_batch="
                "True only when the next decode step has the same batch")

    def _after_launch(self, seq_ids: List[int], seqs, P: List[int],
                      next_same_batch: bool) -> None:
        """After the step's GPU work is enqueued: with next_same_batch
        (pipeline "lookahead") the next step's Step is sent now (its blocks
        ensured, positions P + 1; this step's reply collected first), so
        the daemon enqueues it while the GPU runs this one; else this
        step's reply is collected (its error raised before the host waits
        for the step's results)."""
        if next_same_batch and self.pipeline == "lookahead":
            for s in seqs:
                self._ensure_blocks(s, s.cached + 2)
            P1 = [p + 1 for p in P]
            self._send_step(seqs, P1)
            self.ahead = (list(seq_ids), P1)
        else:
            self._collect()

    def _collect(self) -> None:
        """Waits for the reply of the last Step sent, if not yet collected
        (a RESOURCE_EXHAUSTED is sent again meanwhile: StepFuture), raising
        its error."""
        f, self.pending = self.pending, None
        if f is None:
            return
        t = time.perf_counter()
        try:
            f.result()
        finally:
            self.step_rpc_s += time.perf_counter() - t
            self.step_retries += f.retries

    def _send_step(self, seqs, P) -> None:
        """One Step (the scheduler's side, kvt.step_async) for the decode
        step of seqs at positions P, after collecting the previous one's
        reply; pipeline "sync" waits for its reply too."""
        self._collect()
        t = time.perf_counter()
        self.step_id += 1
        args = dict(
            slot_mapping=[self._slot(s, p) for s, p in zip(seqs, P)],
            seq_lens=[p + 1 for p in P], query_lens=[1] * len(seqs),
            swa_state_ids=[s.state_id for s in seqs],
            top_k=self.cfg.topk, positions=list(P))
        if self.device_tables:
            # The worker's stream writes them (_write_tables).
            args.update(block_tables_in_buffer=True,
                        block_table_cols=self.num_blocks)
        else:
            args["block_tables"] = [
                s.blocks + [-1] * (self.num_blocks - len(s.blocks))
                for s in seqs]
        if self.ratios:
            args["compressed_slot_mappings"] = {
                R: [compressed_row_slot(s.blocks, p, R, self.cfg.block_size)
                    for s, p in zip(seqs, P)]
                for R in self.ratios}
        self.pending = self._step_rpc(self.step_id, args)
        self.step_rpcs += 1
        self.step_rpc_s += time.perf_counter() - t
        if self.pipeline == "sync":
            self._collect()

    def _static_inputs(self, B: int) -> None:
        dev, C = self.device, self.num_blocks
        self.st_tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.st_pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.st_state = torch.zeros(B, dtype=torch.int64, device=dev)
        self.st_table = torch.full((B, C), -1, dtype=torch.int64, device=dev)
        self.st_topk = [torch.zeros(B, self.cfg.topk, dtype=torch.int64,
                                    device=dev) for _ in range(self.cfg.layers)]
        self.st_logits = torch.zeros(B, self.cfg.vocab, device=dev)
        self.st_batch = B

    def _static_body(self) -> None:
        """One decode step with fixed shapes and no host reads: what a CUDA
        graph captures. Reads st_tokens/st_pos/st_state/st_table, writes
        st_topk, st_logits and the compressed rows' device state."""
        cfg, w, dev = self.cfg, self.w, self.device
        B, W, K, D = self.st_batch, cfg.window, cfg.topk, cfg.kv_dim
        bs = cfg.block_size
        pos = self.st_pos
        self._write_tables(self.st_table)
        self._db("begin")
        self._db("wait", 0)
        win = self._io(self.swa_off, B * W * 4).view(torch.int32).view(
            B, W).to(torch.int64)
        rows = torch.arange(self.num_blocks * bs, device=dev)
        blk = self.st_table[:, rows // bs]                       # [B, N]
        islots = blk.clamp(min=0) * bs + rows % bs
        x = w.embed[self.st_tokens]
        for l, lw in enumerate(w.layers):
            pr = project(cfg, lw, x, pos, w.cos_sin)
            self._write_inputs(l, pr, self.st_state, pos)
            self._db("mark", 1 + 2 * l)
            self._db("wait", 1 + 2 * l)
            d, sf = gather_records(self.views[self.idx].layer(l),
                                   self.geo[self.idx], islots.reshape(-1))
            ik = dequant_mxfp8_index(d, sf).view(B, -1, cfg.index_dim)
            dots = (pr.iq @ ik.transpose(1, 2)).clamp(min=0)  # [B, h, N]
            sc = (dots * pr.iw[:, :, None]).sum(dim=1)
            topk, _ = select_topk(sc, (pos + 1) // cfg.ratio(l), K)
            self.st_topk[l].copy_(topk)
            tk_off = self.layer_offsets(l)["topk"]
            self._io(tk_off, B * K * 4).view(torch.int32).copy_(
                topk.reshape(-1).to(torch.int32))
            self._db("mark", 2 + 2 * l)
            self._db("wait", 2 + 2 * l)
            slots = self._io(tk_off + self.tk_bytes, B * K * 4).view(
                torch.int32).view(B, K).to(torch.int64)
            wk = self._read_main(self.swa, l, win)
            mk = self._read_main(self.main, l, slots)
            keys = torch.cat([wk, mk], dim=1)
            valid = torch.cat([win >= 0, slots >= 0], dim=1)
            x = x + attend(cfg, pr.q, keys, valid) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        self.st_logits.copy_(logits(cfg, w, x))

    def _decode_static(self, seq_ids: List[int],
                       next_same_batch: bool = False
                       ) -> Dict[int, torch.Tensor]:
        seqs = [self.seqs[i] for i in seq_ids]
        B = len(seqs)
        assert B <= self.max_tokens
        for s in seqs:
            assert s.cached == len(s.tokens) - 1
            self._ensure_blocks(s, s.cached + 1)
        P = [s.cached for s in seqs]
        if self.graph_batch != seq_ids:
            self.graph, self.graph_batch = None, list(seq_ids)
            self._static_inputs(B)
            fresh = True
        else:
            fresh = False
        self._flush_pending(seqs)
        self.st_tokens.copy_(torch.tensor([s.tokens[-1] for s in seqs]))
        self.st_pos.copy_(torch.tensor(P))
        self.st_state.copy_(torch.tensor([s.state_id for s in seqs]))
        tab = torch.full((B, self.num_blocks), -1, dtype=torch.int64)
        for b, s in enumerate(seqs):
            tab[b, :len(s.blocks)] = torch.tensor(s.blocks)
        self.st_table.copy_(tab)
        self._step_for(seq_ids, seqs, P)
        if self.mode == "graph" and not fresh and self.graph is None:
            # Captured at the second step of a batch (the first ran eagerly:
            # the warm-up); capturing runs nothing, the replay below does.
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            # thread_local: libkvdepot_worker.so's watchdog thread keeps
            # reading the doorbell on its own stream meanwhile.
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                self._static_body()
            self.graph = g
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
        else:
            self._static_body()
        self._after_launch(seq_ids, seqs, P, next_same_batch)
        # After the step: the checks and the records, on the host.
        W = self.cfg.window
        win = self._io(self.swa_off, B * W * 4).view(torch.int32).view(
            B, W).to(torch.int64)
        for l in range(self.cfg.layers):
            tk_off = self.layer_offsets(l)["topk"]
            slots = self._io(tk_off + self.tk_bytes,
                             B * self.cfg.topk * 4).view(torch.int32).view(
                                 B, self.cfg.topk).to(torch.int64)
            topk = self.st_topk[l]
            for b, s in enumerate(seqs):
                if l == 0:
                    s.step_topk = []
                s.step_topk.append(topk[b].clone())
            if self.check:
                self._check_rows(seqs, P, win, slots, topk, l)
        for s in seqs:
            s.cached += 1
        st = self.status()
        if st["status_bits"] or st["out_of_range"]:
            self._fail(f"step {self.step_id}: doorbell status {st}")
        return {s.seq_id: self.st_logits[b].clone()
                for b, s in enumerate(seqs)}
