"""The kvdepot-backed worker: the model of model.py with its whole cache in
kvdepot pools, read in place.

Per layer three pools' layers are used (one pool per kind, all layers):
  <prefix>main  main_format (DS_MLA_FP8 or V41), block_size 64: compressed
                rows (ratio R per layer; R = 1 keeps every token)
  <prefix>swa   same format, one ring of W slots per state (block = ring)
  <prefix>idx   MXFP8_INDEX, block_size 64: the indexer's keys, same slots
                as main
A sequence owns one ring and one block table used by every layer (sized for
the smallest ratio; larger ratios use its prefix).

Prefill (per chunk, per layer): fused stores of the compressed rows that
complete in the chunk (main) and their index keys (idx), PrefillLoad (SWA
history + this chunk + compressed rows into one BF16 buffer, the chunk
stored into the ring), the indexer reading idx in place, PrefillIndex,
attention over the buffer rows. Decode (per step): one SWA decode index;
per layer the fused store into the ring (and main/idx when a group
completes), the indexer reading idx in place, ConvertTopk, attention
reading main and the ring in place (records dequantized in torch).

`check=True` verifies at every use, from positions in plain Python: every
window row and top-k slot the daemon returned, every PrefillIndex row, and
that the compressed rows PrefillLoad returned are bit-identical to the pool
records read in place."""

import math
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import kvdepot
from codec import (LayerGeometry, dequant_main, dequant_mxfp8_index,
                   gather_records)
from kvd_adapter import (FusedParams, HostBuffer, PoolView, bf16_bytes,
                         fused_store)
from model import (Config, Weights, attend, bf16, finish_key, index_scores,
                   logits, mlp, project, select_topk)


class CheckFailed(AssertionError):
    pass


def row_slot(blocks: List[int], row: int, block_size: int) -> int:
    """The slot of logical row `row` through a block table."""
    return blocks[row // block_size] * block_size + row % block_size


def compressed_row_slot(blocks: List[int], p: int, ratio: int,
                        block_size: int) -> int:
    """The slot of the compressed row that position p completes (the R
    positions [rR, rR + R) make row r; p = rR + R - 1 completes it), or -1
    when p completes none: one entry of the step path's
    compressed_slot_mapping, and where prefill and the per-layer path store
    a compressed row (KVWorker._compress)."""
    if (p + 1) % ratio:
        return -1
    return row_slot(blocks, (p + 1) // ratio - 1, block_size)


@dataclass
class Sequence:
    seq_id: int
    tokens: List[int]
    state_id: int
    blocks: List[int] = field(default_factory=list)
    cached: int = 0                      # positions already in the cache
    raw: List[List[torch.Tensor]] = field(default_factory=list)
    ik_raw: List[List[torch.Tensor]] = field(default_factory=list)
    max_new: int = 0
    generated: int = 0
    # The indexer's choices (logical compressed rows, -1 = none), per layer:
    # of the last prefill (all chunks, [n, topk]) and of the last decode step
    # ([topk]); the forced-selection oracle replays them.
    prefill_topk: List[List[torch.Tensor]] = field(default_factory=list)
    step_topk: List[torch.Tensor] = field(default_factory=list)


@dataclass
class StepRecord:
    """What a step fed attention, per layer (for daemon-vs-library
    comparisons): the keys [n, m, D] and validity."""
    keys: List[torch.Tensor] = field(default_factory=list)
    valid: List[torch.Tensor] = field(default_factory=list)


class KVWorker:
    def __init__(self, client: kvdepot.Client, cfg: Config, w: Weights,
                 device: torch.device, *, prefix: str = "rw.",
                 num_blocks: int = 64, num_states: int = 8,
                 chunk: int = 96, check: bool = True, record: bool = False):
        self.kv, self.cfg, self.w, self.device = client, cfg, w, device
        self.prefix, self.check, self.record = prefix, check, record
        self.num_blocks, self.num_states, self.chunk = (num_blocks,
                                                        num_states, chunk)
        self.seqs: Dict[int, Sequence] = {}
        self.free_blocks = list(range(num_blocks))
        self.free_states = list(range(num_states))
        self.checks = {"window_rows": 0, "topk_slots": 0,
                       "prefill_index_rows": 0, "prefill_rows_bitexact": 0,
                       "reused_blocks": 0, "reused_rings": 0}
        self.ever_used: set = set()
        self.ever_used_states: set = set()
        self.last_record: Optional[StepRecord] = None
        self.fp = [FusedParams(cfg.latent, lw.kv_norm, cfg.latent,
                               cfg.rope_dim, w.cos_sin, cfg.eps)
                   for lw in w.layers]
        self.rpc_s = 0.0
        self.rpcs = 0
        self.decode_rpc_s = 0.0      # of which in decode steps
        self.decode_rpcs = 0
        self._open()

    # ------------------------------------------------------------ pools

    def _open(self) -> None:
        cfg, p = self.cfg, self.prefix
        self.main = p + "main"
        self.swa = p + "swa"
        self.idx = p + "idx"
        dev = "" if self.device.type == "cpu" else f"cuda:{self.device.index or 0}"
        for name, fmt, bs, nb in (
                (self.main, cfg.main_format, cfg.block_size, self.num_blocks),
                (self.swa, cfg.main_format, cfg.window, self.num_states),
                (self.idx, "MXFP8_INDEX", cfg.block_size, self.num_blocks)):
            self.kv.create_or_get_pool(name, fmt, block_size=bs,
                                       num_blocks=nb, num_layers=cfg.layers,
                                       device=dev)
        self.views = {n: PoolView(self.kv, n, self.device)
                      for n in (self.main, self.swa, self.idx)}
        self.geo = {n: LayerGeometry.of(v.layout)
                    for n, v in self.views.items()}
        rows = self.cfg.window + self.chunk + self._max_rows() + 1
        self.prefill_buf = HostBuffer(self.kv, rows * cfg.kv_dim * 2,
                                      self.device)

    def _max_rows(self) -> int:
        return self.num_blocks * self.cfg.block_size

    def close(self) -> None:
        for v in self.views.values():
            v.close()
        self.prefill_buf.release()

    def recover(self) -> None:
        """After SessionLost: a new session, the pools again (a restarted
        daemon has none), and every live sequence prefilled again from its
        tokens (its cache is gone)."""
        for v in self.views.values():
            v.close()
        try:
            self.prefill_buf.release()   # unmaps; the buffer died with the
        except kvdepot.KVCacheError:     # session
            pass
        self.kv.reconnect()
        self._open()
        for s in self.seqs.values():
            s.cached = 0
            s.raw = [[] for _ in range(self.cfg.layers)]
            s.ik_raw = [[] for _ in range(self.cfg.layers)]
            self.prefill(s, upto=len(s.tokens) - 1)

    def poison_blocks(self, blocks: List[int], state: int,
                      rng: random.Random) -> None:
        """Fill freed blocks (every layer of main and idx) and a freed ring
        with garbage bytes, NaN/Inf patterns included, through the views."""
        for name, ids in ((self.main, blocks), (self.idx, blocks),
                          (self.swa, [state])):
            g = self.geo[name]
            for l in range(self.cfg.layers):
                layer = self.views[name].layer(l).raw
                for b in ids:
                    n = g.block_stride
                    junk = torch.tensor(
                        [rng.randrange(256) for _ in range(64)],
                        dtype=torch.uint8, device=layer.device)
                    layer[b * n:(b + 1) * n] = junk.repeat(n // 64 + 1)[:n]
        if self.device.type == "cuda":
            torch.cuda.synchronize()   # the daemon's kernels come next

    # ------------------------------------------------------------ sequences

    def add(self, seq_id: int, prompt: List[int], max_new: int) -> Sequence:
        if not self.free_states:
            raise RuntimeError("no free SWA ring")
        s = Sequence(seq_id, list(prompt), self.free_states.pop(0),
                     max_new=max_new)
        if s.state_id in self.ever_used_states:
            self.checks["reused_rings"] += 1
        s.raw = [[] for _ in range(self.cfg.layers)]
        s.ik_raw = [[] for _ in range(self.cfg.layers)]
        self.seqs[seq_id] = s
        return s

    def finish(self, seq_id: int) -> Sequence:
        """Frees the sequence's blocks and ring; they are handed out next
        (LIFO), so reuse happens at once."""
        s = self.seqs.pop(seq_id)
        self.free_blocks = s.blocks + self.free_blocks
        self.free_states.insert(0, s.state_id)
        self.ever_used.update(s.blocks)
        self.ever_used_states.add(s.state_id)
        return s

    def _ensure_blocks(self, s: Sequence, positions: int) -> None:
        rmin = min(self.cfg.ratio(l) for l in range(self.cfg.layers))
        need = max(1, math.ceil((positions // rmin) / self.cfg.block_size))
        while len(s.blocks) < need:
            if not self.free_blocks:
                raise RuntimeError("out of cache blocks")
            b = self.free_blocks.pop(0)
            if b in self.ever_used:
                self.checks["reused_blocks"] += 1
            s.blocks.append(b)

    def _slot(self, s: Sequence, row: int) -> int:
        return row_slot(s.blocks, row, self.cfg.block_size)

    def _timed(self, fn, *a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.rpc_s += time.perf_counter() - t
            self.rpcs += 1

    # ------------------------------------------------------------ shared

    def _compress(self, s: Sequence, l: int, kv_raw: torch.Tensor,
                  ik_raw: torch.Tensor, p0: int):
        """Feeds positions p0.. of this layer into the compressor; returns
        (slots, means, index means, positions) of the rows that complete."""
        R = self.cfg.ratio(l)
        slots, means, imeans, pos = [], [], [], []
        for i in range(kv_raw.shape[0]):
            s.raw[l].append(kv_raw[i])
            s.ik_raw[l].append(ik_raw[i])
            p = p0 + i
            slot = compressed_row_slot(s.blocks, p, R, self.cfg.block_size)
            if slot >= 0:
                assert len(s.raw[l]) == R
                slots.append(slot)
                means.append(bf16(torch.stack(s.raw[l]).mean(dim=0)))
                imeans.append(bf16(torch.stack(s.ik_raw[l]).mean(dim=0)))
                pos.append(p)
                s.raw[l], s.ik_raw[l] = [], []
        return slots, means, imeans, pos

    def _store_compressed(self, l: int, slots, means, imeans, pos) -> None:
        if not slots:
            return
        self._timed(fused_store, self.kv, self.main, l, slots,
                    torch.stack(means), pos, self.fp[l])
        self._timed(fused_store, self.kv, self.idx, l, slots,
                    torch.stack(imeans), pos, None)

    def _index_keys(self, l: int, s: Sequence, n: int) -> torch.Tensor:
        """The indexer's keys of compressed rows [0, n), read in place."""
        if n == 0:
            return torch.zeros(0, self.cfg.index_dim, device=self.device)
        slots = torch.tensor([self._slot(s, r) for r in range(n)],
                             device=self.device)
        d, sf = gather_records(self.views[self.idx].layer(l),
                               self.geo[self.idx], slots)
        return dequant_mxfp8_index(d, sf)

    def _read_main(self, name: str, l: int,
                   slots: torch.Tensor) -> torch.Tensor:
        """Records at slots (-1 allowed: read slot 0, masked later) -> fp32
        [*, D] holding BF16 values."""
        flat = slots.reshape(-1).clamp(min=0)
        d, rest = gather_records(self.views[name].layer(l), self.geo[name],
                                 flat)
        return dequant_main(self.cfg.main_format, d, rest).view(
            *slots.shape, self.cfg.kv_dim)

    def _fail(self, what: str) -> None:
        raise CheckFailed(what)

    # ------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(self, s: Sequence, upto: Optional[int] = None) -> torch.Tensor:
        """Caches positions [s.cached, upto) (default: all tokens) in chunks;
        returns the logits of the last one."""
        end = len(s.tokens) if upto is None else upto
        out = torch.empty(0)
        s.prefill_topk = [[] for _ in range(self.cfg.layers)]
        while s.cached < end:
            c1 = min(end, s.cached + self.chunk)
            out = self._prefill_chunk(s, s.cached, c1)
            s.cached = c1
        return out

    def _prefill_chunk(self, s: Sequence, c0: int, c1: int) -> torch.Tensor:
        cfg, w, dev = self.cfg, self.w, self.device
        self._ensure_blocks(s, c1)
        nq, W = c1 - c0, cfg.window
        pos = torch.arange(c0, c1, device=dev)
        x = w.embed[torch.tensor(s.tokens[c0:c1], device=dev)]
        D = cfg.kv_dim
        for l, lw in enumerate(w.layers):
            R = cfg.ratio(l)
            pr = project(cfg, lw, x, pos, w.cos_sin)
            chunk_keys = finish_key(cfg, lw, pr.kv_raw, pos, w.cos_sin)
            self._store_compressed(l, *self._compress(s, l, pr.kv_raw,
                                                      pr.ik_raw, c0))
            n = c1 // R
            res = self._timed(
                self.kv.prefill_load, self.swa, l, self.main, l,
                seqlen_k=[c1], seqlen_q=[nq], swa_state_id=[s.state_id],
                window=W, compress_ratio=R, block_table=[s.blocks],
                chunk_kv=bf16_bytes(chunk_keys), dtype="bf16",
                out=self.prefill_buf.slice(0, (W + nq + max(n, 1)) * D * 2))
            rows = self.prefill_buf.tensor[:res.total_rows * D * 2].view(
                torch.bfloat16).view(res.total_rows, D).to(torch.float32)
            if self.check:
                self._check_prefill_rows(s, l, rows, res, n)
            # Indexer over the index keys in place.
            ik = self._index_keys(l, s, n)
            vis = torch.div(pos + 1, R, rounding_mode="floor")
            if n:
                idx, _ = select_topk(index_scores(pr.iq, pr.iw, ik), vis,
                                     cfg.topk)
            else:
                idx = torch.full((nq, cfg.topk), -1, dtype=torch.int64,
                                 device=dev)
            s.prefill_topk[l].append(idx)
            pi = self._timed(self.kv.prefill_index, [c1], [nq], window=W,
                             compress_ratio=R, compressed_index=[
                                 [int(v) for v in r] for r in idx.tolist()],
                             topk_k=cfg.topk)
            index = torch.tensor(list(pi.index), dtype=torch.int64,
                                 device=dev).view(nq, pi.row_width)
            if self.check:
                self._check_prefill_index(c0, c1, index, idx,
                                          pi.main_kv_offset)
            valid = index >= 0
            keys = rows[index.clamp(min=0)]
            x = x + attend(cfg, pr.q, keys, valid) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        return logits(cfg, w, x[-1:])[0]

    def _check_prefill_rows(self, s: Sequence, l: int, rows: torch.Tensor,
                            res, n: int) -> None:
        """The compressed rows PrefillLoad returned must be the pool's
        records (read in place, dequantized here) bit for bit."""
        if n == 0:
            return
        slots = torch.tensor([self._slot(s, r) for r in range(n)],
                             device=self.device)
        mine = self._read_main(self.main, l, slots)
        got = rows[res.main_kv_offset:res.main_kv_offset + n]
        if not torch.equal(mine.view(torch.int32), got.view(torch.int32)):
            bad = (mine != got).any(dim=1).nonzero()[:4].flatten().tolist()
            self._fail(f"layer {l}: PrefillLoad compressed rows {bad} differ "
                       "from the pool records read in place")
        self.checks["prefill_rows_bitexact"] += n

    def _check_prefill_index(self, c0: int, c1: int, index: torch.Tensor,
                             topk: torch.Tensor, main_off: int) -> None:
        W = self.cfg.window
        hist0 = c0 - W          # position of history row 0
        got = index.tolist()
        tk = topk.tolist()
        for j, p in enumerate(range(c0, c1)):
            want = []
            for q in range(max(0, p - W + 1), p + 1):
                want.append(q - hist0 if q < c0 else W + (q - c0))
            want += [-1] * (W - len(want))
            want += [main_off + v if v >= 0 else -1 for v in tk[j]]
            if got[j] != want:
                self._fail(f"PrefillIndex row of position {p}: got "
                           f"{got[j]}, want {want}")
        self.checks["prefill_index_rows"] += c1 - c0

    # ------------------------------------------------------------ decode

    @torch.no_grad()
    def decode(self, seq_ids: List[int]) -> Dict[int, torch.Tensor]:
        """One step: the last token of each sequence at its next position."""
        cfg, w, dev = self.cfg, self.w, self.device
        seqs = [self.seqs[i] for i in seq_ids]
        B, W = len(seqs), cfg.window
        rpc0, calls0 = self.rpc_s, self.rpcs
        for s in seqs:
            assert s.cached == len(s.tokens) - 1
            self._ensure_blocks(s, s.cached + 1)
        P = [s.cached for s in seqs]
        pos = torch.tensor(P, device=dev)
        x = w.embed[torch.tensor([s.tokens[-1] for s in seqs], device=dev)]
        # The window of every query (SWA decode index, once per step).
        queries = [[s.state_id, max(0, p - W + 1), min(p + 1, W)]
                   for s, p in zip(seqs, P)]
        sw = self._timed(self.kv.swa_decode_index, self.swa, W, queries)
        win = torch.tensor(list(sw.slots), dtype=torch.int64,
                           device=dev).view(B, W)
        if self.check:
            for b, (s, p) in enumerate(zip(seqs, P)):
                want = [s.state_id * W + q % W
                        for q in range(max(0, p - W + 1), p + 1)]
                want += [-1] * (W - len(want))
                if win[b].tolist() != want:
                    self._fail(f"SWA decode index of seq {s.seq_id} at "
                               f"{p}: got {win[b].tolist()}, want {want}")
            self.checks["window_rows"] += B
        rec = StepRecord() if self.record else None
        table_cols = max(len(s.blocks) for s in seqs)
        table = [s.blocks + [0] * (table_cols - len(s.blocks)) for s in seqs]
        for l, lw in enumerate(w.layers):
            R = cfg.ratio(l)
            pr = project(cfg, lw, x, pos, w.cos_sin)
            self._timed(fused_store, self.kv, self.swa, l,
                        [s.state_id * W + p % W for s, p in zip(seqs, P)],
                        pr.kv_raw, P, self.fp[l])
            comp = [[], [], [], []]
            for b, s in enumerate(seqs):
                for acc, v in zip(comp, self._compress(
                        s, l, pr.kv_raw[b:b + 1], pr.ik_raw[b:b + 1], P[b])):
                    acc += v
            self._store_compressed(l, *comp)
            # Indexer, per sequence, over its index keys in place.
            topk = torch.full((B, cfg.topk), -1, dtype=torch.int64)
            counts = []
            for b, s in enumerate(seqs):
                n = (P[b] + 1) // R
                if n:
                    ik = self._index_keys(l, s, n)
                    t, c = select_topk(index_scores(
                        pr.iq[b:b + 1], pr.iw[b:b + 1], ik),
                        torch.tensor([n], device=dev), cfg.topk)
                    topk[b] = t[0].cpu()
                    counts.append(int(c[0]))
                else:
                    counts.append(0)
            for b, s in enumerate(seqs):
                if l == 0:
                    s.step_topk = []
                s.step_topk.append(topk[b].clone())
            ct = self._timed(self.kv.convert_topk, self.main, topk.tolist(),
                             counts, [(p + 1) // R for p in P], table)
            slots = torch.tensor(list(ct.slots), dtype=torch.int64,
                                 device=dev).view(B, cfg.topk)
            if self.check:
                for b, s in enumerate(seqs):
                    want = [self._slot(s, int(v)) if v >= 0 else -1
                            for v in topk[b].tolist()]
                    if slots[b].tolist() != want:
                        self._fail(f"ConvertTopk seq {s.seq_id} layer {l}: "
                                   f"got {slots[b].tolist()}, want {want}")
                if ct.invalid_count:
                    self._fail(f"ConvertTopk counted {ct.invalid_count} "
                               "invalid entries")
                self.checks["topk_slots"] += B
            wk = self._read_main(self.swa, l, win)
            mk = self._read_main(self.main, l, slots)
            keys = torch.cat([wk, mk], dim=1)
            valid = torch.cat([win >= 0, slots >= 0], dim=1)
            if rec is not None:
                rec.keys.append(torch.where(valid[:, :, None], keys,
                                            torch.zeros_like(keys)))
                rec.valid.append(valid)
            x = x + attend(cfg, pr.q, keys, valid) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        for s in seqs:
            s.cached += 1
        self.decode_rpc_s += self.rpc_s - rpc0
        self.decode_rpcs += self.rpcs - calls0
        self.last_record = rec
        out = logits(cfg, w, x)
        return {s.seq_id: out[b] for b, s in enumerate(seqs)}
