"""kvdepot with PyTorch tensors (docs/PYTHON.md, "PyTorch").

    import kvdepot, kvdepot.torch as kt

    kv = kvdepot.connect()
    buf = kv.allocate_buffer(n * 1024)
    x = kt.buffer_tensor(kv, buf, torch.bfloat16, (n, 512))  # no copy
    x.copy_(k_rows)
    kt.store(kv, "main", 0, slots, x)          # the daemon reads x in place
    layer = kt.pool_layer_tensor(kv, "main", 0)  # the pool itself

Memory: buffer_tensor and pool_layer_tensor alias memory the daemon handed
over (CPU backend: an mmap of its memfd, through torch.frombuffer; CUDA
backend: its VMM descriptor mapped by libkvdepot_worker.so's
kvd_map_vmm_fd, through __cuda_array_interface__ version 3). A tensor keeps
its mapping alive; the CUDA mapping is unmapped when the last tensor of it
is collected (synchronize first if kernels may still use it).

Ordering (CUDA): the interface's "stream" is None: nothing of this process
is pending on the memory when it is handed out. A tensor call (store, load)
on a CUDA buffer view records an interprocess event on
torch.cuda.current_stream() and the daemon waits for it before its kernels
(so the call follows the stream's earlier work: the kernels that wrote the
input, or read the output region last); the daemon replies after its
kernels finished, so everything enqueued after the call sees the result.
The call blocks the host until then. Index calls (convert_topk,
swa_decode_index, prefill_index) take and return host arrays: CUDA inputs
are copied to the host on the current stream (synchronously).

The step path (decode, GPU only): StepWorker, over libkvdepot_worker.so,
enqueues its marks and waits on the current torch stream (capturable in
torch.cuda.graph); register_worker, step and step_async (send step s + 1
while the GPU runs step s) are kvdepot.step's.

Every input is checked (dtype, device, contiguity, size, owning session)
before anything is sent; failures raise kvdepot.KVCacheError with
INVALID_ARGUMENT and the argument's name.
"""

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import grpc
import torch

from . import _worker_lib
from ._buffers import Buffer, PoolMapping, Slice
from ._errors import KVCacheError, invalid_argument
from ._worker_lib import (STATUS_CANCELLED, STATUS_DAEMON_ERROR,
                          STATUS_OUT_OF_RANGE, STATUS_STEP_MISMATCH,
                          STATUS_WORKER_WATCHDOG, WorkerReleased)
from .client import Client, FusedStore
from .step import (PlannedStep, Registration, RingStepFuture, StepFuture,
                   StepRing, buffer_ref, cache, doorbell_bytes,
                   grant_registration, layer, list_registrations, plan_step,
                   register_worker, step, step_async, step_fused,
                   step_request, step_status, unregister)

__all__ = [
    "PlannedStep", "PoolLayerView", "PoolTensors", "Registration",
    "RingStepFuture", "StepFuture", "StepRing",
    "StepStatus", "StepWorker", "WorkerReleased", "buffer_ref", "buffer_tensor", "cache",
    "convert_topk", "doorbell_bytes", "grant_registration", "layer",
    "list_registrations", "load", "map_pool_tensors", "phase_a", "phase_b",
    "plan_step",
    "pool_layer_tensor", "prefill_index", "prefill_load", "register_tensor",
    "register_worker", "step", "step_async", "step_fused", "step_request",
    "step_status", "store", "swa_decode_index",
    "unregister", "STATUS_CANCELLED", "STATUS_DAEMON_ERROR",
    "STATUS_OUT_OF_RANGE", "STATUS_STEP_MISMATCH", "STATUS_WORKER_WATCHDOG",
]

# ------------------------------------------------------------ tensor checks


def _element_size(dtype: "torch.dtype") -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_tensor(t: Any, field: str, dtypes: Sequence["torch.dtype"],
                  ndim: Optional[int] = None) -> "torch.Tensor":
    """A tensor of one of `dtypes`, contiguous, of `ndim` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(
            f"{field}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise invalid_argument(
            f"{field}: dtype {t.dtype} is not "
            + " or ".join(str(d) for d in dtypes))
    if ndim is not None and t.dim() != ndim:
        raise invalid_argument(
            f"{field}: {t.dim()} dimensions {tuple(t.shape)}, expected "
            f"{ndim}")
    if not t.is_contiguous():
        raise invalid_argument(
            f"{field}: not contiguous (strides {t.stride()}); pass "
            ".contiguous() (a copy) or a contiguous view")
    if t.device.type not in ("cpu", "cuda"):
        raise invalid_argument(f"{field}: device {t.device} is neither a "
                               "CPU nor a CUDA device")
    return t


def _host_bytes(t: "torch.Tensor") -> bytes:
    """The raw bytes of a contiguous tensor (a CUDA one is copied to the
    host on the current stream first, synchronously)."""
    if t.device.type != "cpu":
        t = t.cpu()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _int32(t: Any, field: str, ndim: int = 1) -> bytes:
    return _host_bytes(_check_tensor(t, field, (torch.int32,), ndim))


def _from_bytes(data: bytes, dtype: "torch.dtype",
                shape: Tuple[int, ...]) -> "torch.Tensor":
    """A CPU tensor owning a copy of `data`."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
        else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ------------------------------------------------------------ buffers

class _CudaArray:
    """Exports [ptr, ptr + nbytes) of a VMM mapping through
    __cuda_array_interface__ v3; torch.as_tensor keeps this object (and
    with it the mapping) alive as long as the tensor's storage."""

    def __init__(self, mapping: _worker_lib.VmmMapping, offset: int,
                 nbytes: int, owner: Any = None):
        self.mapping = mapping
        self.owner = owner   # the Buffer, kept alive by its tensors
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1",
            "data": (mapping.ptr + offset, False), "strides": None,
            "version": 3,
            # None: no work of this process is pending on the memory; the
            # daemon's writes are ordered by the requests (module doc).
            "stream": None,
        }


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{what} needs CUDA, and this torch ({torch.__version__}) sees "
            "no CUDA device")


def _cuda_bytes(obj: Any, fd: int, fd_size: int, device: int,
                nbytes: int, owner: Any = None) -> "torch.Tensor":
    """uint8[nbytes] aliasing the start of a VMM export, mapped once per
    object (`obj._kvd_vmm`, a weak reference: unmapped with its last
    tensor)."""
    ref = getattr(obj, "_kvd_vmm", None)
    mapping = ref() if ref is not None else None
    if mapping is None:
        _require_cuda("a CUDA VMM descriptor of the daemon")
        torch.cuda.init()
        with torch.cuda.device(device):
            mapping = _worker_lib.VmmMapping(fd, fd_size, device)
        obj._kvd_vmm = weakref.ref(mapping)
    return torch.as_tensor(_CudaArray(mapping, 0, nbytes, owner),
                           device=torch.device("cuda", device))


def _owned_buffer(client: Client, buffer: Any, field: str) -> Buffer:
    if not isinstance(client, Client):
        raise invalid_argument("client: expected a kvdepot.Client")
    if not isinstance(buffer, Buffer):
        raise invalid_argument(
            f"{field}: expected a kvdepot.Buffer (Client.allocate_buffer), "
            f"got {type(buffer).__name__}")
    client._check()
    if buffer._session is not client._session_token:
        raise invalid_argument(
            f"{field}: buffer {buffer.id} belongs to another session (another "
            "client, or this client before reconnect()); allocate it with "
            "this client")
    if buffer._invalid is not None:
        raise buffer._invalid
    return buffer


def _buffer_base(client: Client, buffer: Buffer) -> "torch.Tensor":
    """uint8[buffer.size] over the whole buffer; records its address so
    that tensor calls recognize views of it."""
    if buffer.vmm_fd is not None:
        base = _cuda_bytes(buffer, buffer.vmm_fd, buffer.fd_size,
                           buffer.device_ordinal, buffer.size, buffer)
    elif buffer.view is not None:
        # A ctypes array over the mmap carries the Buffer: the tensor keeps
        # both alive (the Buffer so that its views are recognized in
        # requests, and released only by release() or the session's end).
        holder = (ctypes.c_char * buffer.size).from_buffer(buffer.view)
        holder.owner = buffer   # type: ignore[attr-defined]
        base = torch.frombuffer(holder, dtype=torch.uint8)
    else:
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"buffer {buffer.id} has no descriptor here (a legacy CUDA IPC "
            "handle: open .ipc_handle as docs/PYTHON.md shows)")
    buffer._kvd_addr = (base.device, base.data_ptr())
    return base


def buffer_tensor(client: Client, buffer: Buffer,
                  dtype: "torch.dtype" = torch.uint8,
                  shape: Optional[Sequence[int]] = None,
                  offset: int = 0) -> "torch.Tensor":
    """A tensor aliasing bytes [offset, ...) of a buffer of this client's
    session, without a copy: CPU backend a CPU tensor over the buffer's
    mmap, CUDA backend a tensor on the buffer's device. shape None: the
    whole elements of dtype from offset to the end. The tensor keeps the
    Buffer object and the mapping alive; release() still gives the buffer
    back to the daemon (the memory stays mapped while tensors use it, but
    is no longer the daemon's buffer: do not pass them in requests)."""
    buffer = _owned_buffer(client, buffer, "buffer")
    if not isinstance(dtype, torch.dtype):
        raise invalid_argument(f"dtype: {dtype!r} is not a torch.dtype")
    item = _element_size(dtype)
    if offset < 0 or offset % item or offset > buffer.size:
        raise invalid_argument(
            f"offset = {offset} is outside [0, {buffer.size}] or not a "
            f"multiple of the {item}-byte {dtype}")
    if shape is None:
        shape = ((buffer.size - offset) // item,)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise invalid_argument(f"shape {shape} has a negative dimension")
    count = 1
    for d in shape:
        count *= d
    nbytes = count * item
    if offset + nbytes > buffer.size:
        raise invalid_argument(
            f"shape {shape} of {dtype} is {nbytes} bytes; from offset "
            f"{offset} buffer {buffer.id} has {buffer.size - offset}")
    base = _buffer_base(client, buffer)
    return base[offset:offset + nbytes].view(dtype).view(shape)


def _slice_of(client: Client, t: "torch.Tensor") -> Optional[Slice]:
    """The Slice of a buffer of the client's session that a contiguous
    tensor is a view of, or None."""
    start, n = t.data_ptr(), t.numel() * t.element_size()
    for obj in list(client._handed_out):
        addr = getattr(obj, "_kvd_addr", None)
        # Released buffers are skipped: their id is gone and their address
        # may be another buffer's now.
        if not isinstance(obj, Buffer) or addr is None or \
                obj._invalid is not None or obj._release_fn is None:
            continue
        device, base = addr
        if device == t.device and base <= start and \
                start + n <= base + obj.size:
            return obj.slice(start - base, n)
    return None


_events: Dict[int, Any] = {}


def _stream_event(device: "torch.device") -> bytes:
    """An interprocess event recorded on the device's current stream: its
    cudaIpcEventHandle_t, for the daemon to wait on. One event per device,
    re-recorded per call (the daemon awaited it before it replied)."""
    index = device.index if device.index is not None else \
        torch.cuda.current_device()
    ev = _events.get(index)
    if ev is None:
        with torch.cuda.device(index):
            ev = torch.cuda.Event(interprocess=True)
        _events[index] = ev
    ev.record(torch.cuda.current_stream(index))
    return bytes(ev.ipc_handle())


def _data_arg(client: Client, t: "torch.Tensor",
              field: str) -> Tuple[Any, bytes]:
    """(a buffer Slice or inline bytes, the wait event) for an input."""
    s = _slice_of(client, t)
    if s is None:
        return _host_bytes(t), b""   # CUDA: .cpu() synchronizes the stream
    return s, (_stream_event(t.device) if t.device.type == "cuda" else b"")


_KV_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _pool_info(client: Client, pool: str, fresh: bool = False) -> Any:
    """The pool's PoolInfo, cached per client session (fresh: asked
    again, e.g. when an input does not fit the cached layout: the pool may
    have been deleted and made again with another one)."""
    token, cache_ = client.__dict__.get("_kvd_layouts", (None, {}))
    if token is not client._session_token:
        cache_ = {}
        client.__dict__["_kvd_layouts"] = (client._session_token, cache_)
    if fresh or pool not in cache_:
        cache_[pool] = client.get_pool(pool)
    return cache_[pool]


def _layout(client: Client, pool: str, fresh: bool = False) -> Any:
    """The pool's PoolLayout (cached as _pool_info)."""
    return _pool_info(client, pool, fresh).layout


# The daemon's session events opened in this process, by (device, handle):
# a session keeps one event per device and re-records it per call, so this
# holds one entry per session and device (cleared when it grows past 64).
_daemon_events: Dict[Tuple[int, bytes], "torch.cuda.Event"] = {}


def _wait_recorded(client: Client, pool: str, handle: bytes) -> None:
    """With record_event: the current stream of the pool's device waits
    (on the GPU) for the daemon's event in the reply."""
    if not handle:
        return
    dev = torch.device(_pool_info(client, pool).device)
    if dev.type != "cuda":
        raise invalid_argument(
            f"record_event: pool \"{pool}\" is on {dev}, not a CUDA device")
    _wait_on_stream(dev, handle)


def _wait_on_stream(dev: "torch.device", handle: bytes) -> None:
    """The current stream of `dev` waits for the daemon's event `handle`."""
    index = dev.index if dev.index is not None else \
        torch.cuda.current_device()
    ev = _daemon_events.get((index, handle))
    if ev is None:
        if len(_daemon_events) >= 64:
            _daemon_events.clear()
        ev = torch.cuda.Event.from_ipc_handle(index, handle)
        _daemon_events[(index, handle)] = ev
    torch.cuda.current_stream(index).wait_event(ev)


# ------------------------------------------------------------ operations

def store(client: Client, pool: str, layer: int, slot_mapping: Any,
          kv: Any, *, fused: Optional[FusedStore] = None,
          record_event: bool = False) -> int:
    """Stores kv [num_tokens, elements] (bfloat16 or float32) into the slots
    of slot_mapping (int32 [num_tokens], -1 = padding). A view of a buffer
    (buffer_tensor) is read in place; any other CPU tensor goes inline.
    fused: a kvdepot.FusedStore (the daemon's RMSNorm/RoPE before storing,
    SPEC §8), as for Client.store. Returns the tokens written.

    record_event (CUDA backend): no host wait for the GPU. The daemon
    replies once its kernels are queued, and the current stream of the
    pool's device waits for them on the GPU: work queued on that stream
    afterwards sees the pool written and may overwrite kv. Without it the
    call returns when the store is done."""
    slots = _int32(slot_mapping, "slot_mapping")
    kv = _check_tensor(kv, "kv", tuple(_KV_DTYPES), 2)
    n = len(slots) // 4
    if kv.shape[0] != n:
        raise invalid_argument(
            f"kv has {kv.shape[0]} rows, slot_mapping {n} entries")
    elements = _layout(client, pool).elements
    if kv.shape[1] != elements:
        elements = _layout(client, pool, fresh=True).elements
        if kv.shape[1] != elements:
            raise invalid_argument(
                f"kv has {kv.shape[1]} columns; pool \"{pool}\" stores "
                f"{elements} elements per token")
    data, event = _data_arg(client, kv, "kv")
    r = client.store(pool, layer, slots, data, dtype=_KV_DTYPES[kv.dtype],
                     wait_event=event, record_event=record_event,
                     fused=fused)
    _wait_recorded(client, pool, r.recorded_event)
    return int(r)


def _out_arg(client: Client, out: Optional["torch.Tensor"], field: str,
             min_bytes: Optional[int]) -> Any:
    from ._buffers import INLINE
    if out is None:
        return INLINE
    out = _check_tensor(out, field, (out.dtype,) if isinstance(
        out, torch.Tensor) else ())
    if min_bytes is not None and out.numel() * out.element_size() < \
            min_bytes:
        raise invalid_argument(
            f"{field}: {out.numel() * out.element_size()} bytes, the rows "
            f"need {min_bytes}")
    s = _slice_of(client, out)
    return s if s is not None else INLINE


def load(client: Client, pool: str, layer: int, *, seqlen_k: Any = None,
         block_table: Any = None, segments: Any = None,
         total_k: Optional[int] = None, compress_ratio: int = 1,
         out: Optional["torch.Tensor"] = None,
         scales_out: Optional["torch.Tensor"] = None,
         record_event: bool = False) -> "torch.Tensor":
    """Loads rows of a pool layer by sequences (seqlen_k int32 [num_seqs],
    block_table int32 [num_seqs][cols]) or by an explicit plan (segments
    int32 [S][4] and total_k). Returns the rows: bfloat16 [total_k,
    elements] for cast formats, uint8 [total_k, load_data_row_bytes] for
    index formats (whose scale rows go to scales_out, required).

    out / scales_out: a buffer view (the daemon writes it in place; the
    result is a view of it), any other tensor (filled from the reply), or
    None (a new CPU tensor). record_event: as for store() (the stream
    waits for the rows written into buffer views)."""
    L = _layout(client, pool)
    if not L.do_cast and scales_out is None:
        raise invalid_argument(
            f"scales_out: pool \"{pool}\" ({L.format}) is an index format; "
            "pass a tensor for its scale rows")
    if L.do_cast and scales_out is not None:
        raise invalid_argument(
            f"scales_out: pool \"{pool}\" ({L.format}) has no scale rows")
    kwargs: Dict[str, Any] = {"compress_ratio": compress_ratio}
    rows_known = None
    if segments is not None:
        if total_k is None:
            raise invalid_argument("segments need total_k")
        kwargs.update(segments=_int32(segments, "segments", 2),
                      total_k=total_k)
        rows_known = total_k
    else:
        if seqlen_k is None or block_table is None:
            raise invalid_argument(
                "load needs seqlen_k + block_table, or segments + total_k")
        table = _check_tensor(block_table, "block_table", (torch.int32,), 2)
        kwargs.update(seqlen_k=_int32(seqlen_k, "seqlen_k"),
                      block_table=_host_bytes(table),
                      max_blocks_per_seq=table.shape[1])
    row = L.load_data_row_bytes
    out_ref = _out_arg(client, out, "out",
                       None if rows_known is None else rows_known * row)
    sc_ref = None if scales_out is None else _out_arg(
        client, scales_out, "scales_out", None if rows_known is None
        else rows_known * L.load_scale_row_bytes)
    event = b""
    for t, ref in ((out, out_ref), (scales_out, sc_ref)):
        if isinstance(ref, Slice) and t is not None and \
                t.device.type == "cuda" and not event:
            event = _stream_event(t.device)
    r = client.load(pool, layer, out=out_ref, scales=sc_ref,
                    wait_event=event, record_event=record_event, **kwargs)
    _wait_recorded(client, pool, r.recorded_event)
    if r.data is not None and len(r.data) != r.total_k * row:
        # The cached layout is stale (the pool was made again).
        L = _layout(client, pool, fresh=True)
        row = L.load_data_row_bytes
    shape = (r.total_k, row // 2) if L.do_cast else (r.total_k, row)
    dtype = torch.bfloat16 if L.do_cast else torch.uint8
    rows = _place(r.data, out, out_ref, dtype, shape, "out")
    if scales_out is not None:
        _place(r.scales, scales_out, sc_ref, torch.uint8,
               (r.total_k, L.load_scale_row_bytes), "scales_out")
    return rows


def _place(data: Optional[bytes], out: Optional["torch.Tensor"], ref: Any,
           dtype: "torch.dtype", shape: Tuple[int, int],
           field: str) -> "torch.Tensor":
    """The result rows: a view of `out` (written in place, or filled from
    the inline reply), or a new CPU tensor."""
    nbytes = shape[0] * shape[1] * _element_size(dtype)
    if out is None:
        return _from_bytes(data or b"", dtype, shape)
    flat = out.view(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise invalid_argument(
            f"{field}: {flat.numel()} bytes, the {shape[0]} rows need "
            f"{nbytes}")
    if not isinstance(ref, Slice):
        flat[:nbytes].copy_(_from_bytes(data or b"", torch.uint8,
                                        (nbytes,)))
    return flat[:nbytes].view(dtype).view(shape)


def _index_in(client: Client, t: "torch.Tensor") -> Any:
    """An index call's array input: its Slice when `t` is a view of a
    buffer of the session (the daemon reads it in place), else its bytes
    (a CUDA tensor copied to the host, synchronously)."""
    s = _slice_of(client, t)
    return s if s is not None else _host_bytes(t)


def _count_out(client: Client, t: Optional["torch.Tensor"]) -> Any:
    """invalid_count_out: None, or the Slice of one int64 in a buffer."""
    if t is None:
        return None
    t = _check_tensor(t, "invalid_count_out", (torch.int64,))
    s = _slice_of(client, t) if t.numel() == 1 else None
    if s is None:
        raise invalid_argument(
            "invalid_count_out: expected one int64 in a buffer of this "
            f"session (buffer_tensor), got {t.numel()} elements"
            + ("" if t.numel() != 1 else " outside every buffer"))
    return s


def _request_event(client: Client, *tensors: Optional["torch.Tensor"]
                   ) -> Tuple[bytes, Optional["torch.device"]]:
    """The wait event of a request whose operands include CUDA buffer views
    (recorded on the current stream of the first one's device; the current
    streams of other devices are synchronized on the host, one event per
    request), and that device; (b"", None) without any."""
    event, device = b"", None
    for t in tensors:
        if t is None or t.device.type != "cuda" or \
                _slice_of(client, t) is None:
            continue
        if device is None:
            device, event = t.device, _stream_event(t.device)
        elif t.device != device:
            torch.cuda.current_stream(t.device).synchronize()
    return event, device


def _index_out(client: Client, out: Optional["torch.Tensor"],
               min_bytes: Optional[int]) -> Any:
    """An index call's `out`: INLINE (None, or a tensor filled from the
    reply) or the Slice of a buffer view; int32 either way."""
    if out is not None:
        _check_tensor(out, "out", (torch.int32,))
    return _out_arg(client, out, "out", min_bytes)


def _index_result(r_values: Any, handle: bytes,
                  out: Optional["torch.Tensor"], out_ref: Any,
                  shape: Tuple[int, int], device: "torch.device",
                  field: str) -> "torch.Tensor":
    """An index call's int32 result: `out` (written in place by the daemon,
    after which the current stream of its device waits for the daemon's
    event with record_event, or filled from the reply), or a new tensor on
    `device`."""
    if isinstance(out_ref, Slice):
        if handle:
            _wait_on_stream(out.device, handle)
        return out.view(-1)[:shape[0] * shape[1]].view(shape)
    if out is None:
        return _ints_out(r_values, shape, device)
    return _place(bytes(r_values), out, out_ref, torch.int32, shape, field)


def convert_topk(client: Client, pool: str, topk: Any, valid_count: Any,
                 num_tokens: Any, block_table: Any, *,
                 out: Optional["torch.Tensor"] = None,
                 invalid_count_out: Optional["torch.Tensor"] = None,
                 record_event: bool = False) -> "torch.Tensor":
    """Decode top-k conversion (SPEC §7): topk int32 [batch][k] -> slots
    int32 [batch][k] (-1 = none), on the device of `topk`.

    topk and block_table: a buffer view (buffer_tensor) is read in place,
    on the GPU with the CUDA backend (entries out of range become -1 and
    are counted, not refused); any other tensor goes inline (a CUDA one is
    copied to the host first). out: a buffer view, written in place (the
    result is a view of it), another int32 tensor (filled from the reply),
    or None. invalid_count_out: one int64 in a buffer, set to the count of
    entries out of range when the kernel finished. record_event (CUDA
    backend, out a buffer view): the daemon replies once its kernel is
    queued and the current stream of out's device waits for it, as for
    store(). A call with CUDA buffer views waits for the current stream's
    work before them, as store() does."""
    t = _check_tensor(topk, "topk", (torch.int32,), 2)
    table = _check_tensor(block_table, "block_table", (torch.int32,), 2)
    batch, k = t.shape
    out_ref = _index_out(client, out, batch * k * 4)
    count_ref = _count_out(client, invalid_count_out)
    event, _ = _request_event(client, t, table, out, invalid_count_out)
    r = client.convert_topk(pool, _index_in(client, t),
                            _int32(valid_count, "valid_count"),
                            _int32(num_tokens, "num_tokens"),
                            _index_in(client, table), k=k,
                            max_blocks_per_seq=table.shape[1], out=out_ref,
                            invalid_count_out=count_ref, wait_event=event,
                            record_event=record_event)
    return _index_result(r.slots, r.recorded_event, out, out_ref,
                         (batch, k), t.device, "out")


def _ints_out(values: Any, shape: Tuple[int, int],
              device: "torch.device") -> "torch.Tensor":
    out = _from_bytes(bytes(values), torch.int32, shape)
    return out if device.type == "cpu" else out.to(device)


def swa_decode_index(client: Client, pool: str, window: int,
                     queries: Any, *, out: Optional["torch.Tensor"] = None,
                     record_event: bool = False) -> "torch.Tensor":
    """SWA decode index (SPEC §7): queries int32 [n][3] {state_id, start,
    valid_len} -> slots int32 [n][window], on the device of `queries`.
    The queries always go inline (checked on the host); out and
    record_event as for convert_topk()."""
    q = _check_tensor(queries, "queries", (torch.int32,), 2)
    if q.shape[1] != 3:
        raise invalid_argument(f"queries has {q.shape[1]} columns, not 3")
    n = q.shape[0]
    out_ref = _index_out(client, out, n * window * 4 if window > 0 else None)
    event, _ = _request_event(client, out)
    r = client.swa_decode_index(pool, window, _host_bytes(q), out=out_ref,
                                wait_event=event,
                                record_event=record_event)
    return _index_result(r.slots, r.recorded_event, out, out_ref,
                         (n, window), q.device, "out")


def prefill_index(client: Client, seqlen_k: Any, seqlen_q: Any, *,
                  window: int, compress_ratio: int, compressed_index: Any,
                  swa_valid_start: Any = None,
                  out: Optional["torch.Tensor"] = None,
                  invalid_count_out: Optional["torch.Tensor"] = None,
                  record_event: bool = False) -> Tuple["torch.Tensor", Any]:
    """Prefill index (SPEC §7): compressed_index int32 [sum seqlen_q][topk]
    -> (index int32 [sum seqlen_q][window + topk], the
    PrefillIndexResult). compressed_index, out, invalid_count_out and
    record_event as for convert_topk()."""
    ci = _check_tensor(compressed_index, "compressed_index",
                       (torch.int32,), 2)
    rows, width = ci.shape[0], max(window, 0) + ci.shape[1]
    out_ref = _index_out(client, out, rows * width * 4)
    count_ref = _count_out(client, invalid_count_out)
    event, _ = _request_event(client, ci, out, invalid_count_out)
    r = client.prefill_index(
        _int32(seqlen_k, "seqlen_k"), _int32(seqlen_q, "seqlen_q"),
        window=window, compress_ratio=compress_ratio,
        compressed_index=_index_in(client, ci), topk_k=ci.shape[1],
        swa_valid_start=None if swa_valid_start is None else _int32(
            swa_valid_start, "swa_valid_start"),
        out=out_ref, invalid_count_out=count_ref, wait_event=event,
        record_event=record_event)
    if not isinstance(out_ref, Slice):
        rows = len(r.index) // max(r.row_width, 1)
    return _index_result(r.index, r.recorded_event, out, out_ref,
                         (rows, r.row_width), ci.device, "out"), r


def prefill_load(client: Client, swa_pool: str, swa_layer: int,
                 main_pool: str, main_layer: int, *, seqlen_k: Any,
                 seqlen_q: Any, swa_state_id: Any, window: int,
                 compress_ratio: int, block_table: Any, chunk_kv: Any,
                 swa_valid_start: Any = None,
                 out: Optional["torch.Tensor"] = None,
                 record_event: bool = False
                 ) -> Tuple["torch.Tensor", Any]:
    """One prefill chunk (SPEC §6): chunk_kv [sum seqlen_q, elements]
    (bfloat16 or float32). Returns (rows bfloat16 [total_rows, elements],
    the PrefillLoadResult). out: as for load(). record_event: as for
    store() (the SWA pool's device's stream waits for the rows and the
    ring stores)."""
    chunk = _check_tensor(chunk_kv, "chunk_kv", tuple(_KV_DTYPES), 2)
    table = _check_tensor(block_table, "block_table", (torch.int32,), 2)
    # An event on the current stream (after what writes the chunk and what
    # still reads the output's rows, e.g. the previous layer's attention),
    # awaited by the daemon: no host synchronization here.
    data, event = _data_arg(client, chunk, "chunk_kv")
    out_ref = _out_arg(client, out, "out", None)
    if isinstance(out_ref, Slice) and out is not None and \
            out.device.type == "cuda":
        if not event:
            event = _stream_event(out.device)
        elif out.device != chunk.device:   # one event per request
            torch.cuda.current_stream(out.device).synchronize()
    r = client.prefill_load(
        swa_pool, swa_layer, main_pool, main_layer,
        seqlen_k=_int32(seqlen_k, "seqlen_k"),
        seqlen_q=_int32(seqlen_q, "seqlen_q"),
        swa_state_id=_int32(swa_state_id, "swa_state_id"), window=window,
        compress_ratio=compress_ratio, block_table=_host_bytes(table),
        max_blocks_per_seq=table.shape[1], chunk_kv=data,
        swa_valid_start=None if swa_valid_start is None else _int32(
            swa_valid_start, "swa_valid_start"),
        dtype=_KV_DTYPES[chunk.dtype], out=out_ref, wait_event=event,
        record_event=record_event)
    _wait_recorded(client, swa_pool, r.recorded_event)
    rows = _place(r.output, out, out_ref, torch.bfloat16,
                  (r.total_rows, chunk.shape[1]), "out")
    return rows, r


# ------------------------------------------------------------ pools

@dataclass
class PoolLayerView:
    """Zero-copy views of one pool layer (PoolLayout, SPEC §2):

    raw:     uint8 [layer_bytes], the layer's bytes
    records: uint8 [num_blocks, block_size, bytes_per_token] (interleaved
             layouts: data then scales per token), else None
    data:    uint8 [num_blocks, block_size, data_bytes], the tokens' data
             (e4m3 bytes, packed e2m1 pairs or BF16 bit patterns)
    scales:  uint8 [num_blocks, block_size, sf_bytes], or None (sf_bytes 0)
    tail:    uint8 [num_blocks, block_size, tail_bytes], the BF16 tail after
             the scales (DS_MLA_FP8's 64 RoPE values), or None (tail_bytes 0)
    Slot s is [s // block_size, s % block_size]. Reinterpret with
    .view(torch.bfloat16) (BF16 pools) or .view(torch.float8_e4m3fn)
    (torch >= 2.1).
    """

    layout: Any
    layer: int
    raw: "torch.Tensor"
    records: Optional["torch.Tensor"]
    data: "torch.Tensor"
    scales: Optional["torch.Tensor"]
    tail: Optional["torch.Tensor"] = None


class PoolTensors:
    """A pool mapped once (Client.map_pool) as uint8 [total_bytes] (`all`),
    with per-layer views by layer(l)."""

    def __init__(self, client: Client, name: str):
        if not isinstance(client, Client):
            raise invalid_argument("client: expected a kvdepot.Client")
        mapping: PoolMapping = client.map_pool(name)
        self.name = name
        self.layout = mapping.layout
        total = self.layout.total_bytes
        if mapping.vmm_fd is not None:
            self.all = _cuda_bytes(mapping, mapping.vmm_fd, mapping.fd_size,
                                   mapping.device_ordinal, total)
            mapping.close()   # mapped: the descriptor is not needed
        elif mapping.view is not None:
            self.all = torch.frombuffer(mapping.view, dtype=torch.uint8)
        else:
            mapping.close()
            raise KVCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pool \"{name}\" came as a legacy CUDA IPC handle; open "
                ".ipc_handle as docs/PYTHON.md shows")
        self._mapping = mapping

    def layer(self, layer: int) -> PoolLayerView:
        return layer_view(self.all, self.layout, layer)


def layer_view(base: "torch.Tensor", layout: Any,
               layer: int) -> PoolLayerView:
    """The PoolLayerView of layer `layer` of a pool whose bytes are `base`
    (uint8 [total_bytes]) laid out by `layout` (the daemon's PoolInfo
    layout, or any object with its field names, e.g. library mode's
    kvdk_layout_info): the same views map_pool_tensors() gives, over memory
    the caller owns."""
    L = layout
    if not 0 <= layer < L.num_layers:
        raise invalid_argument(
            f"layer = {layer} is outside [0, {L.num_layers})")
    if base.dtype != torch.uint8 or base.dim() != 1 or \
            base.numel() < L.total_bytes:
        raise invalid_argument(
            f"base: expected uint8 [>= {L.total_bytes}] bytes, got "
            f"{base.dtype} {tuple(base.shape)}")
    start = layer * L.layer_stride
    nb, bs = L.num_blocks, L.block_size

    def view(width: int, token_stride: int, offset: int) -> "torch.Tensor":
        return base.as_strided((nb, bs, width),
                               (L.block_stride, token_stride, 1),
                               base.storage_offset() + start + offset)

    # Layouts without the field (library mode's kvdk_layout_info) have no
    # tail.
    tail_bytes = getattr(L, "tail_bytes", 0)
    tail = None
    if L.token_interleaved:
        records = view(L.bytes_per_token, L.bytes_per_token, 0)
        data = view(L.data_bytes, L.bytes_per_token, 0)
        scales = view(L.sf_bytes, L.bytes_per_token, L.data_bytes) \
            if L.sf_bytes else None
        if tail_bytes:
            tail = view(tail_bytes, L.bytes_per_token,
                        L.data_bytes + L.sf_bytes)
    else:
        records = None
        data = view(L.data_bytes, L.data_bytes, 0)
        scales = view(L.sf_bytes, L.sf_bytes, bs * L.data_bytes) \
            if L.sf_bytes else None
    return PoolLayerView(layout=L, layer=layer,
                         raw=base[start:start + L.layer_bytes],
                         records=records, data=data, scales=scales,
                         tail=tail)


def map_pool_tensors(client: Client, pool_name: str) -> PoolTensors:
    """The whole pool as tensors (one mapping for all its layers)."""
    return PoolTensors(client, pool_name)


def pool_layer_tensor(client: Client, pool_name: str,
                      layer: int) -> PoolLayerView:
    """Zero-copy views of one layer of a pool (maps the pool; for many
    layers use map_pool_tensors(...).layer(l))."""
    return PoolTensors(client, pool_name).layer(layer)


# ------------------------------------------------------------ legacy

class RegisteredTensor:
    """A tensor imported as a buffer by its legacy CUDA IPC handle. Keeps
    the tensor alive; release() gives the buffer back (then drop it)."""

    def __init__(self, client: Client, tensor: "torch.Tensor", info: Any):
        self.tensor = tensor
        self.info = info
        self.id: int = info.buffer_id
        self.size: int = tensor.numel() * tensor.element_size()
        self._client: Optional[Client] = client

    def slice(self, offset: int = 0, length: Optional[int] = None) -> Slice:
        if length is None:
            length = self.size - offset
        return Slice(self.id, offset, length)

    def release(self) -> None:
        if self._client is not None:
            c, self._client = self._client, None
            c.release_buffer(self.id)


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _ipc_mem_handle(raw: bytes) -> bytes:
    """The cudaIpcMemHandle_t in what storage._share_cuda_() returns: the
    64 bytes themselves (older torch), or 2 + 64 bytes (newer torch: a
    format version byte and a kind byte, b"c" for a cudaMalloc block, then
    the handle). Anything else (b"e": an expandable segment, shared by its
    own mechanism) has no legacy handle to import."""
    if len(raw) == _IPC_HANDLE_BYTES:
        return raw
    if len(raw) == _IPC_HANDLE_BYTES + 2 and raw[1:2] == b"c":
        return raw[2:]
    raise KVCacheError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"register_tensor: storage._share_cuda_() gave a {len(raw)}-byte "
        f"handle of kind {raw[1:2]!r}, not a cudaMalloc block's "
        "cudaIpcMemHandle_t (expandable segments? set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or use "
        "buffer_tensor())")


def register_tensor(client: Client, tensor: "torch.Tensor"
                    ) -> RegisteredTensor:
    """LEGACY: lends an existing CUDA tensor's memory to the daemon by its
    cudaIpcMemHandle_t (ImportBuffer; only a daemon started with
    --legacy_cuda_ipc accepts it, SPEC §11: the handle is a bearer token).
    The handle names the caching allocator's whole block: the buffer is
    that block from the tensor's offset on. The returned object keeps the
    tensor alive until release(). CPU tensors are refused: their memory is
    not a memfd the daemon could map; allocate a buffer and work in
    buffer_tensor() instead (no copy either way)."""
    t = _check_tensor(tensor, "tensor", (tensor.dtype,) if isinstance(
        tensor, torch.Tensor) else ())
    if t.device.type != "cuda":
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "register_tensor: a CPU tensor's memory is private to this "
            "process (not a memfd), so the daemon cannot map it; use "
            "client.allocate_buffer() and kvdepot.torch.buffer_tensor() "
            "(also without a copy)")
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") \
        else t.storage()._untyped()
    share = getattr(storage, "_share_cuda_", None)
    if share is None:
        raise KVCacheError(grpc.StatusCode.UNIMPLEMENTED,
                           "this torch has no storage._share_cuda_()")
    shared = share()
    device, handle, _, storage_offset = shared[0], shared[1], shared[2], \
        shared[3]
    handle = _ipc_mem_handle(bytes(handle))
    nbytes = t.numel() * t.element_size()
    offset = storage_offset + t.storage_offset() * t.element_size()
    from kvdepot.v1 import kvdepot_pb2 as pb
    info = client._call("ImportBuffer", pb.ImportBufferRequest(
        session_id=client.session_id, handle=pb.SharedHandle(
            cuda_ipc_handle=bytes(handle), size=offset + nbytes,
            offset=offset, device_ordinal=int(device))))
    return RegisteredTensor(client, t, info)


# ------------------------------------------------------------ step path

def phase_a(layer_index: int) -> int:
    """The phase after layer l's K/V and indexer keys: 1 + 2 l."""
    return 1 + 2 * layer_index


def phase_b(layer_index: int) -> int:
    """The phase after layer l's top-k: 2 + 2 l."""
    return 2 + 2 * layer_index


@dataclass
class StepStatus:
    status_bits: int      # STATUS_* bits, sticky
    out_of_range: int     # device-resident entries turned into -1
    step_counter: int     # steps begun on the worker's stream
    daemon_done: int      # last step the daemon finished


class StepWorker:
    """The worker's side of the step path (libkvdepot_worker.so): every
    call enqueues on `stream` (default torch.cuda.current_stream(), so it
    works inside torch.cuda.graph capture) and returns at once. Capture
    with torch.cuda.graph(..., capture_error_mode="thread_local") (torch
    >= 2.1): the library's watchdog thread reads the doorbell on its own
    stream meanwhile, which the default "global" mode forbids. Never call
    status() during a capture.

        w = StepWorker.open(kv, reg, device=0)     # or StepWorker(fd, ...)
        w.step_begin(); w.wait(0)
        for l in range(L):
            ...; w.mark(w.phase_a(l)); w.wait(w.phase_a(l))
            ...; w.mark(w.phase_b(l)); w.wait(w.phase_b(l))

    Needs CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS unset
    or >= 8 in the environment before CUDA starts (refused otherwise)."""

    def __init__(self, fd: int, fd_size: int, device: int, num_layers: int,
                 watchdog_ms: int = 0):
        _worker_lib.check_environment()
        if fd < 0 or fd_size <= 0 or device < 0 or num_layers < 1 or \
                watchdog_ms < 0:
            raise invalid_argument(
                f"fd {fd}, fd_size {fd_size}, device {device}, num_layers "
                f"{num_layers}, watchdog_ms {watchdog_ms}: out of range")
        self._w: Optional[ctypes.c_void_p] = None
        _require_cuda("StepWorker")
        self._lib = _worker_lib.load_library()
        torch.cuda.init()
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            _worker_lib.check(self._lib, self._lib.kvd_worker_open(
                fd, fd_size, device, num_layers, watchdog_ms,
                ctypes.byref(handle)), "kvd_worker_open")
        self._w = handle
        self.device = device
        self.num_layers = num_layers

    @classmethod
    def open(cls, source: Any, *args: Any, **kwargs: Any) -> "StepWorker":
        """Opens a doorbell, from any of:

            open(client, registration, device=None, watchdog_ms=0)
                a registration this client made (register_worker);
            open(doorbell_buffer, device=None, num_layers=..., watchdog_ms=0)
                the doorbell Buffer (its VMM descriptor);
            open(fd, device, num_layers, watchdog_ms=0, *, fd_size=...)
                a doorbell descriptor from elsewhere (fd_size: the
                companion reply's; the fd is borrowed).
        """
        if isinstance(source, Client):
            return cls._open_registration(source, *args, **kwargs)
        if isinstance(source, Buffer):
            return cls._open_buffer(source, *args, **kwargs)
        if isinstance(source, int):
            return cls._open_fd(source, *args, **kwargs)
        raise invalid_argument(
            "StepWorker.open: pass a Client and its Registration, the "
            f"doorbell Buffer, or a descriptor; got {type(source).__name__}")

    @classmethod
    def _open_fd(cls, fd: int, device: int, num_layers: int,
                 watchdog_ms: int = 0, *,
                 fd_size: Optional[int] = None) -> "StepWorker":
        if fd_size is None:
            raise invalid_argument(
                "StepWorker.open(fd, ...): fd_size= is required (the "
                "companion reply's fd_size)")
        return cls(fd, fd_size, device, num_layers, watchdog_ms)

    @classmethod
    def _open_buffer(cls, doorbell: Buffer, device: Optional[int] = None,
                     num_layers: int = 0,
                     watchdog_ms: int = 0) -> "StepWorker":
        if doorbell._invalid is not None:
            raise doorbell._invalid
        if doorbell.vmm_fd is None:
            raise KVCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"doorbell buffer {doorbell.id} is not a CUDA VMM descriptor "
                "(the step path needs the CUDA backend)")
        return cls(doorbell.vmm_fd, doorbell.fd_size,
                   doorbell.device_ordinal if device is None else device,
                   num_layers, watchdog_ms)

    @classmethod
    def _open_registration(cls, client: Client, registration: Registration,
                           device: Optional[int] = None,
                           watchdog_ms: int = 0) -> "StepWorker":
        if not isinstance(registration, Registration):
            raise invalid_argument(
                "registration: expected the Registration of "
                "register_worker()")
        db = _owned_buffer(client, registration.doorbell, "doorbell")
        return cls._open_buffer(db, device, registration.num_layers,
                                watchdog_ms)

    phase_a = staticmethod(phase_a)
    phase_b = staticmethod(phase_b)

    def _handle(self) -> ctypes.c_void_p:
        if self._w is None:
            raise KVCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the StepWorker is closed")
        return self._w

    def _stream(self, stream: Any) -> ctypes.c_void_p:
        s = torch.cuda.current_stream(self.device) if stream is None \
            else stream
        return ctypes.c_void_p(s.cuda_stream if hasattr(s, "cuda_stream")
                               else int(s))

    def _phase(self, phase: int) -> int:
        if not 0 <= phase <= 2 * self.num_layers:
            raise invalid_argument(
                f"phase = {phase} is outside [0, {2 * self.num_layers}]")
        return phase

    def step_begin(self, stream: Any = None) -> None:
        _worker_lib.check(self._lib, self._lib.kvd_step_begin(
            self._handle(), self._stream(stream)), "kvd_step_begin")

    def mark(self, phase: int, stream: Any = None) -> None:
        _worker_lib.check(self._lib, self._lib.kvd_mark(
            self._handle(), self._stream(stream), self._phase(phase)),
            f"kvd_mark({phase})")

    def wait(self, phase: int, stream: Any = None) -> None:
        _worker_lib.check(self._lib, self._lib.kvd_wait(
            self._handle(), self._stream(stream), self._phase(phase)),
            f"kvd_wait({phase})")

    def status(self) -> StepStatus:
        v = [ctypes.c_uint64() for _ in range(4)]
        _worker_lib.check(self._lib, self._lib.kvd_status(
            self._handle(), *(ctypes.byref(x) for x in v)), "kvd_status")
        return StepStatus(*(x.value for x in v))

    def doorbell_ptr(self) -> int:
        return int(self._lib.kvd_doorbell_ptr(self._handle()) or 0)

    def close(self) -> None:
        """REQUIRES: the streams finished the enqueued waits."""
        if self._w is not None:
            w, self._w = self._w, None
            self._lib.kvd_worker_close(w)

    def __enter__(self) -> "StepWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
