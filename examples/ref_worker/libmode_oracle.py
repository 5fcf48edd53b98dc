"""Daemon mode vs library mode (issue 15 items 4-5): the oracle.

`Lockstep`: a daemon-mode worker (worker.KVWorker on kvdepotd) and a
library-mode worker (libmode.LibraryWorker, kvdepot's kernels in-process)
fed the same prompts, stepped together; at every prefill and decode step
the tokens, the logits and every attention input (the dequantized rows
each layer reads, the index rows it reads them at, the indexer's key rows,
the PrefillLoad buffer and PrefillIndex rows, the SWA decode and
ConvertTopk answers) must be bit-identical, and at the end every pool
layer byte-identical; the pools' layouts are compared field by field
first. `run_scenario` is run.py's `library` scenario."""

import time
from typing import Dict, List, Sequence, Tuple

import torch

import kvd_adapter
from codec import LayerGeometry
from libmode import LibraryKernels, LibraryWorker, kernels
from worker import KVWorker

# PoolInfo.layout fields that kvdk_layout_info reports under the same name
# (docs/LIBRARY_MODE.md, "Pools and layers").
LAYOUT_FIELDS = ("block_size", "num_blocks", "num_layers", "block_stride",
                 "layer_bytes", "layer_stride", "total_bytes",
                 "bytes_per_token", "data_bytes", "sf_bytes",
                 "load_data_row_bytes", "load_scale_row_bytes",
                 "elements_per_sf", "elements", "tail_bytes")


class Mismatch(AssertionError):
    """Daemon and library mode differ (where, and the first differing
    element)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns on the CPU (NaNs compare equal to
    themselves, -0.0 differs from 0.0)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


class RecordingMixin:
    """Records what each layer reads, in order, into self.trace as
    (label, bits): the dequantized rows (and the index rows they were read
    at), the indexer's key rows, the PrefillLoad buffer rows, the
    PrefillIndex / SWA decode index / ConvertTopk answers."""

    trace: List[Tuple[str, torch.Tensor]]
    recording = True

    def __init__(self, *a, **kw):
        self.trace = []
        super().__init__(*a, **kw)

    def _rec(self, label: str, t) -> None:
        if self.recording:
            if not isinstance(t, torch.Tensor):
                t = torch.tensor(list(t), dtype=torch.int64)
            self.trace.append((label, _bits(t).clone()))

    def _timed(self, fn, *a, **k):
        r = super()._timed(fn, *a, **k)
        name = getattr(fn, "__name__", "")
        if not self.recording:
            return r
        if name == "prefill_load":
            D = self.cfg.kv_dim
            self._rec("prefill_load rows", self.prefill_buf.tensor[
                :r.total_rows * D * 2].view(torch.bfloat16))
            self._rec("prefill_load offsets", [r.total_rows,
                                               r.main_kv_offset])
        elif name == "prefill_index":
            self._rec("prefill_index", r.index)
        elif name == "swa_decode_index":
            self._rec("swa_decode_index", r.slots)
        elif name == "convert_topk":
            self._rec("convert_topk", list(r.slots) + [r.invalid_count])
        return r

    def _read_main(self, name: str, l: int, slots: torch.Tensor):
        out = super()._read_main(name, l, slots)
        kind = name[len(self.prefix):]
        self._rec(f"layer {l} {kind} index rows", slots)
        self._rec(f"layer {l} {kind} dequantized rows", out)
        return out

    def _index_keys(self, l: int, s, n: int):
        out = super()._index_keys(l, s, n)
        self._rec(f"layer {l} seq {s.seq_id} index keys", out)
        return out


class RecordingLibraryWorker(RecordingMixin, LibraryWorker):
    """libmode.LibraryWorker, recording."""


class DaemonWorker(RecordingMixin, KVWorker):
    """worker.KVWorker (the daemon's pools and RPCs), recording."""

    def _open(self) -> None:     # worker.KVWorker._open
        cfg, p = self.cfg, self.prefix
        self.main, self.swa, self.idx = p + "main", p + "swa", p + "idx"
        dev = ("" if self.device.type == "cpu"
               else f"cuda:{self.device.index or 0}")
        for name, fmt, bs, nb in (
                (self.main, cfg.main_format, cfg.block_size, self.num_blocks),
                (self.swa, cfg.main_format, cfg.window, self.num_states),
                (self.idx, "MXFP8_INDEX", cfg.block_size, self.num_blocks)):
            self.kv.create_or_get_pool(name, fmt, block_size=bs,
                                       num_blocks=nb, num_layers=cfg.layers,
                                       device=dev)
        self.views = {n: kvd_adapter.PoolView(self.kv, n, self.device)
                      for n in (self.main, self.swa, self.idx)}
        self.geo = {n: LayerGeometry.of(v.layout)
                    for n, v in self.views.items()}
        rows = cfg.window + self.chunk + self._max_rows() + 1
        self.prefill_buf = kvd_adapter.HostBuffer(
            self.kv, rows * cfg.kv_dim * 2, self.device)


def check_layouts(daemon: KVWorker, lib: LibraryWorker) -> int:
    """kvdk_layout_get_info of every pool == the daemon's PoolInfo.layout,
    field by field; returns the number of fields compared."""
    n = 0
    for kind in ("main", "swa", "idx"):
        dl = daemon.views[daemon.prefix + kind].layout
        ll = lib.views[lib.prefix + kind].layout
        for f in LAYOUT_FIELDS:
            if int(getattr(dl, f)) != int(getattr(ll, f)):
                raise Mismatch(f"pool {kind}: layout.{f}: daemon "
                               f"{getattr(dl, f)}, library {getattr(ll, f)}")
            n += 1
        if bool(dl.token_interleaved) != bool(ll.token_interleaved):
            raise Mismatch(f"pool {kind}: token_interleaved differs")
    return n


def compare_traces(a: Sequence, b: Sequence, where: str) -> int:
    """Every recorded entry bit-identical; returns the bytes compared."""
    if len(a) != len(b):
        raise Mismatch(f"{where}: daemon mode recorded {len(a)} reads, "
                       f"library mode {len(b)}")
    nbytes = 0
    for (la, ta), (lb, tb) in zip(a, b):
        if la != lb:
            raise Mismatch(f"{where}: read order differs ({la} / {lb})")
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            raise Mismatch(f"{where}: {la}: shape {tuple(ta.shape)} "
                           f"{ta.dtype} vs {tuple(tb.shape)} {tb.dtype}")
        if not torch.equal(ta, tb):
            i = int((ta != tb).reshape(-1).nonzero()[0])
            raise Mismatch(f"{where}: {la}: element {i} (flat) differs: "
                           f"daemon {int(ta.reshape(-1)[i])}, library "
                           f"{int(tb.reshape(-1)[i])} (bit patterns)")
        nbytes += ta.numel() * ta.element_size()
    return nbytes


def compare_pools(daemon: KVWorker, lib: LibraryWorker) -> int:
    """Every layer of every pool byte-identical; returns the bytes."""
    n = 0
    for kind in ("main", "swa", "idx"):
        dv = daemon.views[daemon.prefix + kind]
        lv = lib.views[lib.prefix + kind]
        for l in range(daemon.cfg.layers):
            a, b = dv.layer(l).raw, lv.layer(l).raw
            if a.numel() != b.numel():
                raise Mismatch(f"pool {kind} layer {l}: {a.numel()} vs "
                               f"{b.numel()} bytes")
            if not torch.equal(a.to(b.device), b):
                i = int((a.to(b.device) != b).nonzero()[0])
                raise Mismatch(f"pool {kind} layer {l}: byte {i} differs: "
                               f"daemon {int(a[i])}, library {int(b[i])}")
            n += a.numel()
    return n


class Lockstep:
    """A daemon-mode and a library-mode worker over the same prompts,
    stepped together. compare=True: every step's reads, logits and tokens
    bit-identical (Mismatch otherwise); False: timing only."""

    def __init__(self, dw: KVWorker, lw: LibraryWorker, compare: bool = True):
        self.dw, self.lw, self.compare = dw, lw, compare
        for w in (dw, lw):
            w.recording = compare
        self.steps = 0
        self.tokens = 0
        self.compared_entries = 0
        self.compared_bytes = 0
        self.time = {"daemon": 0.0, "library": 0.0}
        self.layout_fields = check_layouts(dw, lw)

    def _sync(self) -> None:
        if self.lw.device.type == "cuda":
            torch.cuda.synchronize(self.lw.device)

    def _check(self, where: str, got_d: Dict[int, torch.Tensor],
               got_l: Dict[int, torch.Tensor]) -> Dict[int, int]:
        toks = {}
        if self.compare:
            self.compared_bytes += compare_traces(self.dw.trace,
                                                  self.lw.trace, where)
            self.compared_entries += len(self.dw.trace)
        for i in got_d:
            td, tl = int(got_d[i].argmax()), int(got_l[i].argmax())
            if td != tl:
                raise Mismatch(f"{where}: seq {i}: token {td} (daemon) vs "
                               f"{tl} (library)")
            if self.compare and not torch.equal(_bits(got_d[i]),
                                                _bits(got_l[i])):
                raise Mismatch(f"{where}: seq {i}: logits differ")
            toks[i] = td
        self.dw.trace.clear()
        self.lw.trace.clear()
        return toks

    def start(self, seq_id: int, prompt: List[int], max_new: int) -> None:
        got = {}
        for key, w in (("daemon", self.dw), ("library", self.lw)):
            s = w.add(seq_id, prompt, max_new)
            got[key] = {seq_id: w.prefill(s)}
        tok = self._check(f"prefill of seq {seq_id}", got["daemon"],
                          got["library"])[seq_id]
        for w in (self.dw, self.lw):
            w.seqs[seq_id].tokens.append(tok)

    def step(self) -> None:
        ids = sorted(self.dw.seqs)
        if ids != sorted(self.lw.seqs):
            raise Mismatch("the two workers hold different sequences")
        got = {}
        order = [("daemon", self.dw), ("library", self.lw)]
        if self.steps % 2:      # alternate who goes first (timing bias)
            order.reverse()
        for key, w in order:
            self._sync()
            t = time.perf_counter()
            got[key] = w.decode(ids)
            self._sync()
            self.time[key] += time.perf_counter() - t
        toks = self._check(f"decode step {self.steps + 1}", got["daemon"],
                           got["library"])
        self.steps += 1
        self.tokens += len(ids)
        for w in (self.dw, self.lw):
            for i in ids:
                s = w.seqs[i]
                s.generated += 1
                s.tokens.append(toks[i])
            for i in ids:
                if w.seqs[i].generated >= w.seqs[i].max_new:
                    w.finish(i)

    def run(self, prompts: List[List[int]], steps: int) -> None:
        for i, p in enumerate(prompts):
            self.start(i, p, steps)
        while self.dw.seqs:
            self.step()

    def finish_pools(self) -> int:
        self._sync()
        return compare_pools(self.dw, self.lw)

    def report(self) -> Dict[str, object]:
        L = self.dw.cfg.layers
        ls = max(self.steps * L, 1)
        r: Dict[str, object] = {"decode_steps": self.steps,
                                "decode_tokens": self.tokens}
        for key, w in (("daemon", self.dw), ("library", self.lw)):
            t = self.time[key]
            r[key] = {
                "tokens_per_s": round(self.tokens / max(t, 1e-9), 2),
                "decode_s": round(t, 3),
                "ms_per_layer_step": round(1000 * t / ls, 3),
                "kvdepot_calls_per_layer_step": round(w.decode_rpcs / ls, 3),
                "kvdepot_call_ms_per_layer_step": round(
                    1000 * w.decode_rpc_s / ls, 3)}
        # The daemon path's cost over library mode per layer and step: in
        # the whole decode (noisy on a loaded machine: it includes the
        # model's own compute, timed separately on each side), and in the
        # kvdepot calls alone (RPCs vs in-process kernel calls).
        r["daemon_overhead_ms_per_layer_step"] = round(
            1000 * (self.time["daemon"] - self.time["library"]) / ls, 3)
        r["daemon_call_overhead_ms_per_layer_step"] = round(
            1000 * (self.dw.decode_rpc_s - self.lw.decode_rpc_s) / ls, 3)
        if self.compare:
            r["compared_entries"] = self.compared_entries
            r["compared_bytes"] = self.compared_bytes
        r["layout_fields_checked"] = self.layout_fields
        return r


# ------------------------------------------------------------ scenario

PROMPTS = (77, 130, 261)     # as scenarios.basic: blocks, ratios, chunks


def run_scenario(client, cfg, w, device: torch.device, *, steps: int,
                 seed: int, prefix: str, speed: bool = True,
                 check: bool = True) -> Dict[str, object]:
    """run.py's `library` scenario: the oracle (every step compared, the
    worker's brute-force index checks on both sides, pools at the end),
    then (speed=True) the same run again uncompared and unchecked, timed.
    Raises Mismatch at the first difference."""
    import random
    import scenarios
    lib, K, why = kernels()
    if lib is None:
        raise RuntimeError(why)
    out: Dict[str, object] = {"batch": len(PROMPTS),
                              "context_tokens": "%s prompts + %d steps" % (
                                  "/".join(map(str, PROMPTS)), steps),
                              "graph_mode": False,
                              "entry_points": "cuda" if device.type == "cuda"
                              else "cpu"}
    phases = [("oracle", True)] + ([("speed", False)] if speed else [])
    for phase, compare in phases:
        rng = random.Random(seed)
        prompts = [scenarios.prompt(rng, cfg, n) for n in PROMPTS]
        kern = LibraryKernels(lib, K, device)
        dw = DaemonWorker(client, cfg, w, device, prefix=f"{prefix}{phase}.",
                          check=check and compare)
        lw = RecordingLibraryWorker(kern, cfg, w, device,
                                    prefix=f"{prefix}{phase}.",
                                    check=check and compare)
        try:
            ls = Lockstep(dw, lw, compare=compare)
            ls.run(prompts, steps)
            r = ls.report()
            r["pool_bytes_identical"] = ls.finish_pools()
            if device.type == "cuda":
                r["device_invalid_count"] = kern.invalid_count()
                if r["device_invalid_count"]:
                    raise Mismatch("library mode's device checks replaced "
                                   f"{r['device_invalid_count']} entries")
            if compare:
                r["checks_daemon"] = dict(dw.checks)
                r["checks_library"] = dict(lw.checks)
                if dw.checks != lw.checks:
                    raise Mismatch(f"brute-force check counts differ: "
                                   f"{dw.checks} vs {lw.checks}")
        finally:
            dw.close()
            lw.close()
        out[phase] = r
    return out


def step_path_lockstep(dw, lw, prompts: Sequence[List[int]],
                       steps: int) -> Dict[str, int]:
    """The step path (dw: stepworker.StepPathWorker on kvdepotd, or
    stepsim's stand-in on the CPU) vs its library-mode counterpart (lw:
    libmode.LibraryStepWorker), same mode, same prompts, decoded together
    with dw's tokens: at every step the logits, the window and index rows
    the daemon (or the library) wrote into the io buffer and every layer's
    input rows (raw and compressed K, index keys) bit-identical, and at the
    end every pool byte-identical. Mismatch otherwise."""
    for i, p in enumerate(prompts):
        for w in (dw, lw):
            w.add(i, list(p), steps)
        a, b = dw.prefill(dw.seqs[i]), lw.prefill(lw.seqs[i])
        if not torch.equal(_bits(a), _bits(b)):
            raise Mismatch(f"prefill of sequence {i}: logits differ")
        for w in (dw, lw):
            w.seqs[i].tokens.append(int(a.argmax()))
    n = 0
    for step in range(1, steps + 1):
        ids = sorted(dw.seqs)
        # The batch stays the same until the last step: dw sends the next
        # Step ahead (stepworker.py, pipeline "lookahead").
        same = step < steps
        out_d = dw.decode(ids, next_same_batch=same)
        out_l = lw.decode(ids, next_same_batch=same)
        B, cfg = len(ids), dw.cfg
        regions = [("swa window rows", dw.swa_off, B * cfg.window * 4)]
        for l in range(cfg.layers):
            o = dw.layer_offsets(l)
            regions += [(f"layer {l} raw K rows", o["kv"], B * cfg.kv_dim * 2),
                        (f"layer {l} index rows", o["out"], B * cfg.topk * 4)]
            if cfg.ratio(l) > 1:
                regions.append((f"layer {l} compressed K rows", o["comp"],
                                B * cfg.kv_dim * 2))
            regions.append((f"layer {l} index key rows", o["ik"],
                            B * cfg.index_dim * 2))
        for what, off, size in regions:
            a, b = dw._io(off, size).cpu(), lw._io(off, size).cpu()
            if not torch.equal(a, b):
                i = int((a != b).nonzero()[0])
                raise Mismatch(f"decode step {step}: {what} differ at byte "
                               f"{i}")
            n += size
        for i in ids:
            if not torch.equal(_bits(out_d[i]), _bits(out_l[i])):
                raise Mismatch(f"decode step {step}: logits of sequence {i} "
                               "differ")
            tok = int(out_d[i].argmax())
            for w in (dw, lw):
                w.seqs[i].tokens.append(tok)
    return {"decode_steps": steps, "compared_io_bytes": n,
            "pool_bytes_identical": compare_pools(dw, lw)}
