"""Library mode (issue 15 items 4-5, docs/LIBRARY_MODE.md): the reference
worker of worker.py with kvdepot's kernels in-process
(libkvdepot_kernels.so through ctypes, libkvdepot/kvdepot_kernels.py),
and the daemon-vs-library oracle.

The model code is worker.py's KVWorker, unchanged: only what it calls
through `self.kv` (and the fused store) is answered here, by
`LibraryKernels`:
  pools        plain torch uint8 tensors of kvdk_layout_get_info's
               total_bytes, layer l at l * layer_stride, read through the
               same zero-copy record views (codec.gather_records) as in
               daemon mode; the layout is checked field by field against
               the daemon's PoolInfo.layout (check_layouts)
  stores       kvdk_fused_store (RMSNorm + interleaved RoPE, as the
               daemon's Store with `fused`) and kvdk_store (index keys)
  prefill      kvdk_build_swa_plan + kvdk_load (the SWA history),
               kvdk_build_compressed_plan + kvdk_load (compressed rows),
               kvdk_store of the chunk into the ring then kvdk_load of those
               ring slots (the chunk as stored: the daemon's cast-back);
               the index with the daemon's pivots (ComputeSwaPivots),
               kvdk_expand_swa_index + kvdk_kv_index_cat
  decode index kvdk_swa_decode_index, kvdk_convert_topk
CPU tensors use the *_cpu entry points; CUDA tensors the *_cuda ones on
torch's current stream, with a workspace per call from torch's allocator
(stream-ordered) and one device counter of invalid entries.

The oracle (`Lockstep`): a daemon-mode and a library-mode worker fed the
same prompts, stepped together; at every prefill and decode step the
tokens, the logits and every attention input (the dequantized rows each
layer reads, the index rows it reads them at, the indexer's key rows, the
PrefillLoad buffer and PrefillIndex rows) must be bit-identical, and at the
end every pool byte-identical."""

import ctypes
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import kvd_adapter
import worker as worker_mod
from codec import LayerGeometry
from worker import KVWorker

# PoolInfo.layout fields that kvdk_layout_info reports under the same name
# (docs/LIBRARY_MODE.md, "Pools and layers").
LAYOUT_FIELDS = ("block_size", "num_blocks", "num_layers", "block_stride",
                 "layer_bytes", "layer_stride", "total_bytes",
                 "bytes_per_token", "data_bytes", "sf_bytes",
                 "load_data_row_bytes", "load_scale_row_bytes",
                 "elements_per_sf", "elements")


class Mismatch(AssertionError):
    """Daemon and library mode differ (where, and the first differing
    element)."""


def kernels() -> Tuple[Optional[ctypes.CDLL], object, str]:
    """(lib, the kvdepot_kernels module, "") or (None, None, why not)."""
    lib, why = kvd_adapter.kernels_library()
    if lib is None:
        return None, None, why
    import kvdepot_kernels  # put on sys.path by kernels_library()
    return lib, kvdepot_kernels, ""


class LibPool:
    """One pool as a torch tensor laid out exactly as the daemon's: the
    layout handle, its info, and per-layer uint8 views (what PoolView
    gives in daemon mode)."""

    def __init__(self, lib, K, fmt: str, block_size: int, num_blocks: int,
                 num_layers: int, device: torch.device):
        self.lib, self.K, self.format = lib, K, fmt
        self.handle = ctypes.c_void_p()
        K.check(lib, lib.kvdk_layout_create(fmt.encode(), 0, block_size,
                                            num_blocks, num_layers,
                                            ctypes.byref(self.handle)))
        self.info = K.LayoutInfo()
        K.check(lib, lib.kvdk_layout_get_info(self.handle,
                                              ctypes.byref(self.info),
                                              ctypes.sizeof(self.info)))
        self.layout = self.info          # LayerGeometry.of reads it as is
        self.tensor = torch.zeros(self.info.total_bytes, dtype=torch.uint8,
                                  device=device)
        st, lb = self.info.layer_stride, self.info.layer_bytes
        self._layers = [self.tensor[l * st:l * st + lb]
                        for l in range(num_layers)]

    def layer(self, l: int) -> torch.Tensor:
        return self._layers[l]

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        if self.handle:
            self.lib.kvdk_layout_destroy(self.handle)
            self.handle = ctypes.c_void_p()


class LibBuffer:
    """The prefill output buffer: a uint8 tensor (HostBuffer's surface)."""

    def __init__(self, size: int, device: torch.device):
        self.tensor = torch.zeros(size, dtype=torch.uint8, device=device)

    def slice(self, offset: int = 0, length: Optional[int] = None):
        n = self.tensor.numel() - offset if length is None else length
        return self.tensor[offset:offset + n]

    def release(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _i32(v, device) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32, device=device).contiguous()


class LibraryKernels:
    """What KVWorker calls through `self.kv`, answered by
    libkvdepot_kernels.so on torch tensors (CPU or CUDA)."""

    def __init__(self, lib, K, device: torch.device):
        self.lib, self.K, self.device = lib, K, device
        self.cuda = device.type == "cuda"
        self.pools: Dict[str, LibPool] = {}
        self._fused: Dict[int, tuple] = {}
        # CUDA: entries the device checks replaced (SPEC §9); must stay 0.
        self.invalid = torch.zeros(1, dtype=torch.int64, device=device)
        if self.cuda and not lib.kvdk_has_cuda():
            raise RuntimeError("libkvdepot_kernels.so was built without CUDA")

    # ------------------------------------------------------------ plumbing

    def _ok(self, code: int) -> None:
        self.K.check(self.lib, code)

    def _cuda_tail(self, op: int, count: int) -> list:
        """workspace, workspace_bytes, invalid_count, stream."""
        n = int(self.lib.kvdk_cuda_workspace_bytes(op, max(count, 1)))
        if n < 0:
            self._ok(n)
        ws = torch.empty(max(n, 16), dtype=torch.uint8, device=self.device)
        self._keep = ws     # freed in stream order by torch's allocator
        return [ws.data_ptr(), n, self.invalid.data_ptr(),
                torch.cuda.current_stream(self.device).cuda_stream]

    def invalid_count(self) -> int:
        return int(self.invalid.item())

    # ------------------------------------------------------------ pools

    def create_or_get_pool(self, name: str, fmt: str, *, block_size: int,
                           num_blocks: int, num_layers: int,
                           device: str = "") -> LibPool:
        if name not in self.pools:
            self.pools[name] = LibPool(self.lib, self.K, fmt, block_size,
                                       num_blocks, num_layers, self.device)
        return self.pools[name]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()

    # ------------------------------------------------------------ stores

    def _fused_params(self, fp) -> tuple:
        """kvd_adapter.FusedParams (bytes, for the RPC) -> tensors, once."""
        got = self._fused.get(id(fp))
        if got is None:
            nw = torch.frombuffer(bytearray(fp.norm_weight),
                                  dtype=torch.int16).to(self.device)
            cs = torch.frombuffer(bytearray(fp.cos_sin),
                                  dtype=torch.float32).to(self.device)
            got = (fp, nw, cs)
            self._fused[id(fp)] = got
        return got

    def fused_store(self, pool: str, layer: int, slots: List[int],
                    kv_bf16: torch.Tensor, positions: List[int],
                    fp) -> int:
        """kvd_adapter.fused_store's job: the fused store (fp given) or a
        plain BF16 store (fp None)."""
        K, lib, p = self.K, self.lib, self.pools[pool]
        n = len(slots)
        kv = kv_bf16.to(torch.bfloat16).contiguous()
        sl = _i32(slots, self.device)
        if fp is None:
            args = [p.handle, p.ptr, p.info.total_bytes, layer, kv.data_ptr(),
                    K.KVDK_DTYPE_BF16, sl.data_ptr(), n]
            if self.cuda:
                self._ok(lib.kvdk_store_cuda(
                    *args, *self._cuda_tail(K.KVDK_OP_STORE, n)))
            else:
                self._ok(lib.kvdk_store_cpu(*args))
            return n
        _, nw, cs = self._fused_params(fp)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        prm = K.FusedParams(
            norm_begin=0, norm_end=fp.norm_end, norm_weight=nw.data_ptr(),
            eps=fp.eps, rope_style=K.KVDK_ROPE_INTERLEAVED,
            rope_offset=fp.rope_offset, rope_dim=fp.rope_dim,
            positions=pos.data_ptr(), cos_sin=cs.data_ptr(),
            max_position=fp.max_position, hadamard_begin=0, hadamard_len=0)
        args = [p.handle, p.ptr, p.info.total_bytes, layer, kv.data_ptr(),
                ctypes.byref(prm), sl.data_ptr(), n, None]
        if self.cuda:
            self._ok(lib.kvdk_fused_store_cuda(
                *args, *self._cuda_tail(K.KVDK_OP_FUSED_STORE, n)))
        else:
            self._ok(lib.kvdk_fused_store_cpu(*args))
        return n

    def _load(self, p: LibPool, layer: int, segs: torch.Tensor, nseg: int,
              total_k: int, out: torch.Tensor) -> None:
        """SPEC §5 load of segments (host int32 [nseg][4]) into out (uint8,
        total_k rows of load_data_row_bytes, do_cast formats)."""
        if nseg == 0 or total_k == 0:
            return
        K, lib = self.K, self.lib
        segs = segs[:nseg].to(self.device).contiguous()
        args = [p.handle, p.ptr, p.info.total_bytes, layer, segs.data_ptr(),
                nseg, total_k, out.data_ptr(),
                total_k * p.info.load_data_row_bytes, None, 0]
        if self.cuda:
            self._ok(lib.kvdk_load_cuda(
                *args, *self._cuda_tail(K.KVDK_OP_LOAD, nseg)))
        else:
            self._ok(lib.kvdk_load_cpu(*args))

    # ------------------------------------------------------------ prefill

    @staticmethod
    def _layout(seqlen_k, seqlen_q, window: int, ratio: int):
        """ComputePrefillLayout (planner/prefill_layout.cc)."""
        hist = len(seqlen_k) * window
        chunk = sum(seqlen_q)
        comp = sum(max(k // ratio, 1) for k in seqlen_k) if ratio > 0 else 0
        return hist, chunk, comp, hist + chunk, hist + chunk + comp

    def _plan(self, build, *head) -> Tuple[torch.Tensor, int, int]:
        """Calls a plan builder, growing the segment array on CAPACITY."""
        cap = 64
        while True:
            segs = torch.zeros(cap, 4, dtype=torch.int32)
            ns, tk = ctypes.c_int64(), ctypes.c_int64()
            code = build(*head, segs.data_ptr(), cap, ctypes.byref(ns),
                         ctypes.byref(tk))
            if code == self.K.KVDK_ERR_CAPACITY:
                cap = max(2 * cap, ns.value)
                continue
            self._ok(code)
            return segs, ns.value, tk.value

    def prefill_load(self, swa_pool: str, swa_layer: int, main_pool: str,
                     main_layer: int, *, seqlen_k, seqlen_q, swa_state_id,
                     window: int, compress_ratio: int, block_table,
                     chunk_kv, dtype: str = "bf16", out=None,
                     **_unused) -> SimpleNamespace:
        """The daemon's PrefillLoad (server/prefill_load.cc) from library
        calls: history, compressed rows, then the chunk stored into the
        ring and its rows as stored."""
        if dtype != "bf16":
            raise ValueError("library mode: BF16 chunks only")
        swa, main = self.pools[swa_pool], self.pools[main_pool]
        W, R, B = window, compress_ratio, swa.info.block_size
        lib = self.lib
        hist, chunk, comp, main_off, total = self._layout(seqlen_k, seqlen_q,
                                                          W, R)
        row = swa.info.load_data_row_bytes
        assert row == main.info.load_data_row_bytes
        assert out.numel() >= total * row, "prefill buffer too small"
        sk, sq, st = (torch.tensor(v, dtype=torch.int32)
                      for v in (seqlen_k, seqlen_q, swa_state_id))
        n = len(seqlen_k)
        segs, ns, tk = self._plan(
            lambda *a: lib.kvdk_build_swa_plan(swa.handle, W, sk.data_ptr(),
                                               sq.data_ptr(), st.data_ptr(),
                                               None, n, *a))
        assert tk == hist
        self._load(swa, swa_layer, segs, ns, hist, out)
        cols = len(block_table[0])
        table = torch.tensor(block_table, dtype=torch.int32)
        cu = torch.zeros(n + 1, dtype=torch.int32)

        def compressed(*a):
            return lib.kvdk_build_compressed_plan(
                main.handle, R, sk.data_ptr(), n, table.data_ptr(), cols,
                *a, cu.data_ptr())
        segs, ns, tk = self._plan(compressed)
        assert tk == comp, (tk, comp)
        self._load(main, main_layer, segs, ns, comp, out[main_off * row:])
        # The chunk: stored into the rings (BuildSwaStoreSlots), then read
        # back from them (= the daemon's cast-back rows).
        slots, back = [], []
        r0 = 0            # rows relative to the chunk part
        for b in range(n):
            he = seqlen_k[b] - seqlen_q[b]
            assert seqlen_q[b] <= B, "chunk longer than the ring"
            for j in range(seqlen_q[b]):
                p = he + j
                slots.append(swa_state_id[b] * B + p % B)
                back.append([swa_state_id[b], p % B, p % B + 1, r0 + j])
            r0 += seqlen_q[b]
        kv = torch.frombuffer(bytearray(chunk_kv), dtype=torch.bfloat16)
        kv = kv.view(chunk, -1).to(self.device)
        self._store_bf16(swa, swa_layer, kv, slots)
        self._load(swa, swa_layer, torch.tensor(back, dtype=torch.int32),
                   len(back), chunk, out[hist * row:])
        return SimpleNamespace(total_k_swa=hist, chunk_offset=hist,
                               main_kv_offset=main_off, total_rows=total,
                               cu_compressed=cu.tolist())

    def _store_bf16(self, p: LibPool, layer: int, kv: torch.Tensor,
                    slots: List[int]) -> None:
        K, n = self.K, len(slots)
        if n == 0:
            return
        sl = _i32(slots, self.device)
        args = [p.handle, p.ptr, p.info.total_bytes, layer, kv.data_ptr(),
                K.KVDK_DTYPE_BF16, sl.data_ptr(), n]
        if self.cuda:
            self._ok(self.lib.kvdk_store_cuda(
                *args, *self._cuda_tail(K.KVDK_OP_STORE, n)))
        else:
            self._ok(self.lib.kvdk_store_cpu(*args))

    def prefill_index(self, seqlen_k, seqlen_q, *, window: int,
                      compress_ratio: int, compressed_index,
                      topk_k: Optional[int] = None,
                      **_unused) -> SimpleNamespace:
        """The daemon's PrefillIndex (server/service_index.cc): pivots as
        ComputeSwaPivots, then expand_swa_index and kv_index_cat."""
        K, lib, dev = self.K, self.lib, self.device
        W = window
        k = topk_k if topk_k is not None else len(compressed_index[0])
        hist, rows, comp, main_off, total = self._layout(seqlen_k, seqlen_q,
                                                         W, compress_ratio)
        piv = []
        base = hist
        for b, (sk, q) in enumerate(zip(seqlen_k, seqlen_q)):
            he = sk - q
            hb = b * W - (he - W)
            for j in range(q):
                p = he + j
                lo = max(p - W + 1, 0)
                if lo < he:
                    piv.append([hb + lo, he - lo, base, j + 1])
                elif lo <= p:
                    piv.append([base + lo - he, p - lo + 1, 0, 0])
                else:
                    piv.append([0, 0, 0, 0])
            base += q
        piv_t = _i32(piv, dev)
        swa = torch.full((rows, W), -1, dtype=torch.int32, device=dev)
        cidx = _i32(compressed_index, dev).view(rows, k)
        out = torch.full((rows, W + k), -1, dtype=torch.int32, device=dev)
        if self.cuda:
            self._ok(lib.kvdk_expand_swa_index_cuda(
                piv_t.data_ptr(), rows, W, main_off, swa.data_ptr(),
                *self._cuda_tail(K.KVDK_OP_EXPAND_SWA_INDEX, rows)))
            self._ok(lib.kvdk_kv_index_cat_cuda(
                swa.data_ptr(), W, cidx.data_ptr(), k, rows, main_off, comp,
                out.data_ptr(),
                *self._cuda_tail(K.KVDK_OP_KV_INDEX_CAT, rows * (W + k))))
        else:
            self._ok(lib.kvdk_expand_swa_index_cpu(
                piv_t.data_ptr(), rows, W, main_off, swa.data_ptr()))
            self._ok(lib.kvdk_kv_index_cat_cpu(
                swa.data_ptr(), W, cidx.data_ptr(), k, rows, main_off, comp,
                out.data_ptr()))
        return SimpleNamespace(index=out.view(-1).tolist(), row_width=W + k,
                               main_kv_offset=main_off, total_rows=total)

    # ------------------------------------------------------------ decode

    def swa_decode_index(self, pool: str, window: int,
                         queries) -> SimpleNamespace:
        p, dev = self.pools[pool], self.device
        q = _i32(queries, dev).view(-1, 3)
        n = q.shape[0]
        st, s0, vl = (q[:, i].contiguous() for i in range(3))
        out = torch.empty(n, window, dtype=torch.int32, device=dev)
        args = [p.handle, st.data_ptr(), s0.data_ptr(), vl.data_ptr(), n,
                window, out.data_ptr()]
        if self.cuda:
            self._ok(self.lib.kvdk_swa_decode_index_cuda(
                *args, *self._cuda_tail(self.K.KVDK_OP_SWA_DECODE_INDEX, n)))
        else:
            self._ok(self.lib.kvdk_swa_decode_index_cpu(*args))
        return SimpleNamespace(slots=out.view(-1).tolist(), rows=n,
                               cols=window)

    def convert_topk(self, pool: str, topk, valid_count, num_tokens,
                     block_table, **_unused) -> SimpleNamespace:
        p, dev = self.pools[pool], self.device
        t = _i32(topk, dev)
        b, k = t.shape
        cols = len(block_table[0])
        vc, nt, tb = (_i32(v, dev) for v in (valid_count, num_tokens,
                                             block_table))
        args = [p.handle, t.data_ptr(), b, k, vc.data_ptr(), nt.data_ptr(),
                tb.data_ptr(), cols, cols]
        if self.cuda:
            before = self.invalid.clone()
            self._ok(self.lib.kvdk_convert_topk_cuda(
                *args, self.invalid.data_ptr(),
                torch.cuda.current_stream(dev).cuda_stream))
            invalid = int((self.invalid - before).item())
        else:
            cnt = ctypes.c_int64(0)
            self._ok(self.lib.kvdk_convert_topk_cpu(*args,
                                                    ctypes.addressof(cnt)))
            invalid = cnt.value
        return SimpleNamespace(slots=t.view(-1).tolist(), rows=b, cols=k,
                               invalid_count=invalid)


# ------------------------------------------------------------ workers


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


class DaemonPoolView:
    """A daemon pool through kvdepot.torch.map_pool_tensors (one zero-copy
    mapping, CPU memfd or CUDA VMM): PoolView's surface, layer(l) = the
    layer's layer_bytes. kvd_adapter.PoolView when kvdepot.torch is absent.
    (kvd_adapter.PoolView's kvdepot.torch branch predates PoolLayerView and
    is being fixed in parallel; this keeps the oracle independent of it.)"""

    def __init__(self, client, name: str, device: torch.device):
        if kvd_adapter.kvt is None or not hasattr(kvd_adapter.kvt,
                                                  "map_pool_tensors"):
            self._inner = kvd_adapter.PoolView(client, name, device)
            self.layout = self._inner.layout
            self.layer = self._inner.layer
            return
        self._inner = None
        self._pool = kvd_adapter.kvt.map_pool_tensors(client, name)
        self.layout = self._pool.layout
        self._layers = [self._pool.layer(l).raw
                        for l in range(self.layout.num_layers)]

    def layer(self, l: int) -> torch.Tensor:   # noqa: F811 (see __init__)
        return self._layers[l]

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        self._layers = []
        self._pool = None


class DaemonWorker(RecordingMixin, KVWorker):
    """worker.KVWorker (the daemon's pools and RPCs), recording."""

    def __init__(self, *a, **kw):
        self.trace = []
        super().__init__(*a, **kw)

    def _open(self) -> None:     # worker.KVWorker._open, DaemonPoolViews
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
        self.views = {n: DaemonPoolView(self.kv, n, self.device)
                      for n in (self.main, self.swa, self.idx)}
        self.geo = {n: LayerGeometry.of(v.layout)
                    for n, v in self.views.items()}
        rows = cfg.window + self.chunk + self._max_rows() + 1
        self.prefill_buf = kvd_adapter.HostBuffer(
            self.kv, rows * cfg.kv_dim * 2, self.device)


class LibraryWorker(RecordingMixin, KVWorker):
    """worker.KVWorker with LibraryKernels as its `kv`: the same model
    code, kvdepot's kernels in-process."""

    def __init__(self, kernels_: LibraryKernels, *a, **kw):
        self.trace = []
        super().__init__(kernels_, *a, **kw)

    def _open(self) -> None:     # worker.KVWorker._open, on LibPools
        cfg, p = self.cfg, self.prefix
        self.main, self.swa, self.idx = p + "main", p + "swa", p + "idx"
        for name, fmt, bs, nb in (
                (self.main, cfg.main_format, cfg.block_size, self.num_blocks),
                (self.swa, cfg.main_format, cfg.window, self.num_states),
                (self.idx, "MXFP8_INDEX", cfg.block_size, self.num_blocks)):
            self.kv.create_or_get_pool(name, fmt, block_size=bs,
                                       num_blocks=nb, num_layers=cfg.layers)
        self.views = {n: self.kv.pools[n]
                      for n in (self.main, self.swa, self.idx)}
        self.geo = {n: LayerGeometry.of(v.layout)
                    for n, v in self.views.items()}
        rows = cfg.window + self.chunk + self._max_rows() + 1
        self.prefill_buf = LibBuffer(rows * cfg.kv_dim * 2, self.device)

    def _timed(self, fn, *a, **k):
        if fn is kvd_adapter.fused_store or fn is getattr(
                worker_mod, "fused_store", None):
            fn, a = self.kv.fused_store, a[1:]      # (client, pool, ...)
        return super()._timed(fn, *a, **k)

    def recover(self) -> None:
        raise NotImplementedError("library mode has no daemon to lose")

    def close(self) -> None:
        self.kv.close()


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
            a, b = dv.layer(l), lv.layer(l)
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
        lw = LibraryWorker(kern, cfg, w, device, prefix=f"{prefix}{phase}.",
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
