"""Library mode (issue 15 items 4-5, docs/LIBRARY_MODE.md): the reference
worker of worker.py with kvdepot's kernels in-process
(libkvdepot_kernels.so through ctypes, libkvdepot/kvdepot_kernels.py),.

The model code is worker.py's KVWorker, unchanged: only what it calls
through `self.kv` (and the fused store) is answered here, by
`LibraryKernels`:
  pools        plain torch uint8 tensors of kvdk_layout_get_info's
               total_bytes, layer l at l * layer_stride, read through the
               same zero-copy record views (codec.gather_records) as in
               daemon mode; the layout is checked field by field against
               the daemon's PoolInfo.layout (libmode_oracle.check_layouts)
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

The oracle that compares it with daemon mode: libmode_oracle.py."""

import ctypes
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

import kvdepot.torch as kvt

import kvd_adapter
import worker as worker_mod
from codec import LayerGeometry
from stepworker import StepPathWorker
from worker import KVWorker


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
        # kvdepot.torch's PoolLayerView over this tensor, as in daemon mode.
        self._layers = [kvt.layer_view(self.tensor, self.info, l)
                        for l in range(num_layers)]

    def layer(self, l: int) -> "kvt.PoolLayerView":
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


class LibraryWorker(KVWorker):
    """worker.KVWorker with LibraryKernels as its `kv`: the same model
    code, kvdepot's kernels in-process."""

    def __init__(self, kernels_: "LibraryKernels", *a, **kw):
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


class LibraryStepWorker(StepPathWorker, LibraryWorker):
    """The library-mode counterpart of stepworker.StepPathWorker: the same
    decode (eager, static or graph: the same model code, input rows and
    reads), with what the daemon's step-path phases do run in-process on
    the worker's own stream at each doorbell point, by the same kernels
    (libkvdepot_kernels.so):
      S    kvdk_swa_decode_index (the step's windows)
      A_l  kvdk_fused_store of main (slot_mapping at ratio 1, the
           compressed slot mapping of ratio R at ratio R, from the raw or
           compressed rows) and of the SWA ring (ring slots), with the fused
           parameters the step path registers; kvdk_store of the index
           keys at main's slots
      B_l  the top-k rows copied to the index rows, kvdk_convert_topk there
           over seq_len / R compressed rows (block tables: the io buffer's
           rows when device-resident, as the daemon reads them)
    The step's metadata (what the Step RPC carries) is copied into device
    tensors before the step, outside a graph; the calls only enqueue on
    torch's current stream with preallocated workspaces, so "graph" mode
    captures them (kvdepot_kernels.h: capturable). Prefill is LibraryWorker's
    (in-process PrefillLoad / PrefillIndex). CPU tensors use the *_cpu
    entry points (the CPU test, against stepsim.py)."""

    def __init__(self, kernels_: "LibraryKernels", cfg, w, device, **kw):
        # Its "Step" is the metadata copied into device tensors at once
        # (_step_rpc): nothing to overlap, so never sent ahead (the
        # baseline stays what it was; next_same_batch is accepted).
        kw["pipeline"] = "sync"
        StepPathWorker.__init__(self, kernels_, cfg, w, device, **kw)

    def _buffer(self, size: int) -> LibBuffer:
        return LibBuffer(size, self.device)

    def _register(self) -> None:
        cfg, T, dev = self.cfg, self.max_tokens, self.device
        K, lib = self.kv.K, self.kv.lib
        self.cuda = dev.type == "cuda"

        def i32(*shape):
            return torch.zeros(*shape, dtype=torch.int32, device=dev)
        self.m = {k: i32(T) for k in ("slots", "ring", "state", "start",
                                       "valid")}
        self.m["pos"] = torch.zeros(T, dtype=torch.int64, device=dev)
        # The compressed slot mapping of each ratio R > 1.
        self.m_cslots = {R: i32(T) for R in self.ratios}
        self.m_count = {R: (i32(T), i32(T))
                        for R in {cfg.ratio(l) for l in range(cfg.layers)}}
        self.m_table = i32(T, self.num_blocks)
        # The fused parameters as device tensors (LibraryKernels keeps
        # them), one kvdk_fused_params per layer with m["pos"].
        self.prm = []
        for l in range(cfg.layers):
            fp, nw, cs = self.kv._fused_params(self.fp[l])
            self.prm.append(K.FusedParams(
                norm_begin=0, norm_end=fp.norm_end, norm_weight=nw.data_ptr(),
                eps=fp.eps, rope_style=K.KVDK_ROPE_INTERLEAVED,
                rope_offset=fp.rope_offset, rope_dim=fp.rope_dim,
                positions=self.m["pos"].data_ptr(), cos_sin=cs.data_ptr(),
                max_position=fp.max_position, hadamard_begin=0,
                hadamard_len=0))
        self.ws = {}
        if self.cuda:
            for op in (K.KVDK_OP_STORE, K.KVDK_OP_FUSED_STORE,
                       K.KVDK_OP_SWA_DECODE_INDEX):
                n = int(lib.kvdk_cuda_workspace_bytes(op, T))
                if n < 0:
                    self.kv._ok(n)
                self.ws[op] = torch.empty(max(n, 16), dtype=torch.uint8,
                                          device=dev)
        self.n = 0
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None

    def _step_rpc(self, step_id: int, args) -> None:
        """What the daemon's step plan holds, into the device tensors."""
        W = self.cfg.window
        P = args["positions"]
        n = len(P)
        states = args["swa_state_ids"]
        host = {"slots": args["slot_mapping"],
                "ring": [st * W + p % W for st, p in zip(states, P)],
                "state": states, "start": [max(0, p - W + 1) for p in P],
                "valid": [min(p + 1, W) for p in P]}
        for k, v in host.items():
            self.m[k][:n].copy_(torch.tensor(v, dtype=torch.int32))
        cslots = args.get("compressed_slot_mappings", {})
        for R, t in self.m_cslots.items():
            t[:n].copy_(torch.tensor(cslots[R], dtype=torch.int32))
        self.m["pos"][:n].copy_(torch.tensor(P, dtype=torch.int64))
        lens = args["seq_lens"]
        for R, (vc, nt) in self.m_count.items():
            rows = [x // R for x in lens]
            nt[:n].copy_(torch.tensor(rows, dtype=torch.int32))
            vc[:n].copy_(torch.tensor([min(self.cfg.topk, x) for x in rows],
                                      dtype=torch.int32))
        if "block_tables" in args:  # else the io buffer's rows
            self.m_table[:n].copy_(torch.tensor(args["block_tables"],
                                                dtype=torch.int32))
        self.n = n

    def _tail(self, op: int) -> list:
        ws = self.ws[op]
        return [ws.data_ptr(), ws.numel(), self.kv.invalid.data_ptr(),
                torch.cuda.current_stream(self.device).cuda_stream]

    def _fused(self, pool: LibPool, l: int, rows: int, slots) -> None:
        K, lib = self.kv.K, self.kv.lib
        args = [pool.handle, pool.ptr, pool.info.total_bytes, l,
                self.io.tensor.data_ptr() + rows, ctypes.byref(self.prm[l]),
                slots.data_ptr(), self.n, None]
        if self.cuda:
            self.kv._ok(lib.kvdk_fused_store_cuda(
                *args, *self._tail(K.KVDK_OP_FUSED_STORE)))
        else:
            self.kv._ok(lib.kvdk_fused_store_cpu(*args))

    def _db(self, op: str, phase: int = 0) -> None:
        K, lib, cfg, n = self.kv.K, self.kv.lib, self.cfg, self.n
        pools = self.kv.pools
        if op == "wait" and phase == 0:
            ring = pools[self.swa]
            args = [ring.handle, self.m["state"].data_ptr(),
                    self.m["start"].data_ptr(), self.m["valid"].data_ptr(),
                    n, cfg.window, self.io.tensor.data_ptr() + self.swa_off]
            if self.cuda:
                self.kv._ok(lib.kvdk_swa_decode_index_cuda(
                    *args, *self._tail(K.KVDK_OP_SWA_DECODE_INDEX)))
            else:
                self.kv._ok(lib.kvdk_swa_decode_index_cpu(*args))
            return
        if op != "mark":
            return
        l, which = (phase - 1) // 2, (phase - 1) % 2
        o, R = self.layer_offsets(l), cfg.ratio(l)
        slots = self.m_cslots[R] if R > 1 else self.m["slots"]
        if which == 0:
            self._fused(pools[self.main], l, o["comp"] if R > 1 else o["kv"],
                        slots)
            self._fused(pools[self.swa], l, o["kv"], self.m["ring"])
            idx = pools[self.idx]
            args = [idx.handle, idx.ptr, idx.info.total_bytes, l,
                    self.io.tensor.data_ptr() + o["ik"], K.KVDK_DTYPE_BF16,
                    slots.data_ptr(), n]
            if self.cuda:
                self.kv._ok(lib.kvdk_store_cuda(
                    *args, *self._tail(K.KVDK_OP_STORE)))
            else:
                self.kv._ok(lib.kvdk_store_cpu(*args))
            return
        k = cfg.topk
        out = self._io(o["out"], n * k * 4)
        out.copy_(self._io(o["topk"], n * k * 4))
        vc, nt = self.m_count[R]
        cols = self.num_blocks
        # The step path's tables: device-resident in the io buffer (rows
        # bt_stride bytes apart, written by the worker's stream) or the
        # Step's, copied into m_table.
        table, stride = ((self.io.tensor.data_ptr() + self.bt_off,
                          self.bt_stride // 4) if self.device_tables
                         else (self.m_table.data_ptr(), cols))
        args = [pools[self.idx].handle, out.data_ptr(), n, k, vc.data_ptr(),
                nt.data_ptr(), table, cols, stride]
        if self.cuda:
            self.kv._ok(lib.kvdk_convert_topk_cuda(
                *args, self.kv.invalid.data_ptr(),
                torch.cuda.current_stream(self.device).cuda_stream))
        else:
            cnt = ctypes.c_int64(0)
            self.kv._ok(lib.kvdk_convert_topk_cpu(*args,
                                                  ctypes.addressof(cnt)))

    def status(self):
        """As the doorbell's: out_of_range = entries the kernels' checks
        turned into -1 (LibraryKernels.invalid, must stay 0)."""
        return {"status_bits": 0, "out_of_range": self.kv.invalid_count(),
                "step_counter": self.step_id, "daemon_done": self.step_id}

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        LibraryWorker.close(self)
