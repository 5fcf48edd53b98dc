"""The one place the reference worker touches kvdepot's Python surface.

Two pieces of parallel work were not merged when this was written; their
names are used only here so they can be fixed in one file:

* `kvdepot.torch` (client/python/kvdepot/torch.py): zero-copy tensors over
  daemon buffers and pool layers, tensor-taking store/load/index calls, the
  step path's StepWorker. When it imports, pool and buffer views come from
  it; otherwise (CPU backend only) from the existing client:
  Client.map_pool / Client.allocate_buffer give mmaps wrapped with
  torch.frombuffer (still zero-copy).
* library mode (`libkvdepot_kernels.so`, `kvdepot_kernels.h`): kvdepot's
  kernels in-process through ctypes. `kernels_library()` finds it or says
  why not; callers skip (never fake) what needs it.

The fused store is sent as a Store RPC with `fused` set (the client's
`store()` has no such argument yet)."""

import ctypes
import os
import struct
from typing import Any, List, Optional, Tuple

import torch

import kvdepot
from kvdepot.v1 import kvdepot_pb2 as pb

try:  # the torch API of issue 15 item 2, when it has landed
    import kvdepot.torch as kvt  # type: ignore
except ImportError:  # pragma: no cover - depends on the merge
    kvt = None


def torch_api_available() -> bool:
    return kvt is not None


class PoolView:
    """uint8 view of a whole pool (all layers) with no copy, plus what keeps
    the mapping alive."""

    def __init__(self, client: kvdepot.Client, name: str,
                 device: torch.device):
        self.name = name
        self.info = client.get_pool(name)
        self.layout = self.info.layout
        self._mapping: Any = None
        self._layers: List[torch.Tensor] = []
        if device.type == "cpu" and kvt is None:
            self._mapping = client.map_pool(name)
            whole = torch.frombuffer(self._mapping.view, dtype=torch.uint8)
            st = self.layout.layer_stride
            self._layers = [whole[l * st:(l + 1) * st]
                            for l in range(self.layout.num_layers)]
        elif kvt is None:
            # CUDA without kvdepot.torch: the pool's VMM descriptor from the
            # companion socket, mapped by libkvdepot_worker.so.
            self._mapping = _VmmMapping(client, "map_pool", pb.CompanionRequest(
                map_pool=pb.MapPoolRequest(name=name)))
            st = self.layout.layer_stride
            whole = self._mapping.tensor
            self._layers = [whole[l * st:(l + 1) * st]
                            for l in range(self.layout.num_layers)]
        else:
            for l in range(self.layout.num_layers):
                t = kvt.pool_layer_tensor(client, name, l)
                # Assumed: a uint8 tensor of the layer's bytes, or a pair
                # (data, scales) whose first member spans the layer's bytes
                # from its start. Fix here at merge if the API differs.
                if isinstance(t, (tuple, list)):
                    t = t[0]
                self._layers.append(t.view(torch.uint8).reshape(-1))

    def layer(self, l: int) -> torch.Tensor:
        return self._layers[l]

    def close(self) -> None:
        self._layers = []
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None


class HostBuffer:
    """A daemon-allocated buffer (memfd on the CPU backend) seen as a uint8
    tensor without a copy; .slice() for requests."""

    def __init__(self, client: kvdepot.Client, size: int,
                 device: torch.device = torch.device("cpu")):
        self.client = client
        self._vmm: Optional[_VmmMapping] = None
        self.buf: Any = None
        if device.type == "cuda" and kvt is None:
            self._vmm = _VmmMapping(client, "allocate_buffer",
                                    pb.CompanionRequest(
                                        allocate_buffer=pb.AllocateBufferRequest(
                                            size=size)))
            self.id = self._vmm.reply.buffer.buffer_id
            self.tensor = self._vmm.tensor[:size]
            return
        self.buf = client.allocate_buffer(size)
        self.id = self.buf.id
        if kvt is not None and hasattr(kvt, "buffer_tensor"):
            self.tensor = kvt.buffer_tensor(client, self.buf)
        else:
            self.tensor = torch.frombuffer(self.buf.view, dtype=torch.uint8)

    def slice(self, offset: int = 0, length: Optional[int] = None):
        if self.buf is not None:
            return self.buf.slice(offset, length)
        n = self.tensor.numel() - offset if length is None else length
        return kvdepot.Slice(self.id, offset, n)

    def release(self) -> None:
        del self.tensor
        if self.buf is not None:
            self.buf.release()
        elif self._vmm is not None:
            self._vmm.close()
            self.client.release_buffer(self.id)


def tensor_bytes(x: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (copied once into a bytearray; no NumPy:
    Debian's torch in CI runs without it)."""
    x = x.detach().to("cpu").contiguous().reshape(-1)
    out = bytearray(x.numel() * x.element_size())
    if out:
        torch.frombuffer(out, dtype=x.dtype).copy_(x)
    return bytes(out)


def bf16_bytes(x: torch.Tensor) -> bytes:
    """float tensor -> little-endian BF16 bit patterns (RNE)."""
    return tensor_bytes(x.to(torch.bfloat16))


def i64_bytes(v: List[int]) -> bytes:
    return struct.pack(f"<{len(v)}q", *v)


def f32_bytes(x: torch.Tensor) -> bytes:
    return tensor_bytes(x.to(torch.float32))


class FusedParams:
    """Per-layer fused-store parameters (SPEC §8) as the request wants them:
    the norm weight (BF16 bytes), the cos/sin cache (fp32 bytes) sent once
    per call (inline; the step path registers them once instead)."""

    def __init__(self, norm_end: int, norm_weight: torch.Tensor,
                 rope_offset: int, rope_dim: int, cos_sin: torch.Tensor,
                 eps: float):
        self.norm_end = norm_end
        self.norm_weight = bf16_bytes(norm_weight)
        self.rope_offset = rope_offset
        self.rope_dim = rope_dim
        self.cos_sin = f32_bytes(cos_sin)
        self.max_position = int(cos_sin.shape[0])
        self.eps = eps


def fused_store(client: kvdepot.Client, pool: str, layer: int,
                slots: List[int], kv_bf16: torch.Tensor, positions: List[int],
                fp: Optional[FusedParams]) -> int:
    """Store kv (BF16 [n, elements]) with the fused norm/RoPE (fp given) or
    as a plain store (fp None: index keys)."""
    req = pb.StoreRequest(
        session_id=client.session_id, pool=pool, layer=layer,
        num_tokens=len(slots), slot_mapping=struct.pack(
            f"<{len(slots)}i", *slots),
        dtype=pb.INPUT_DTYPE_BF16,
        kv=pb.DataRef(inline_data=bf16_bytes(kv_bf16)))
    if fp is not None:
        req.fused.CopyFrom(pb.FusedStoreOptions(
            norm_begin=0, norm_end=fp.norm_end,
            norm_weight=pb.DataRef(inline_data=fp.norm_weight), eps=fp.eps,
            rope=pb.ROPE_STYLE_INTERLEAVED, rope_offset=fp.rope_offset,
            rope_dim=fp.rope_dim,
            positions=pb.DataRef(inline_data=i64_bytes(positions)),
            cos_sin=pb.DataRef(inline_data=fp.cos_sin),
            max_position=fp.max_position))
    # Client._call maps gRPC errors to KVCacheError / SessionLost like every
    # wrapped call; kvdepot.torch's store() replaces this at merge.
    return client._call("Store", req).tokens_written  # noqa: SLF001


# ------------------------------------------------------------ CUDA fallback

_WORKER_CANDIDATES = (
    "gpu_bundle/bin/libkvdepot_worker.so",
    "bazel-bin/worker/libkvdepot_worker.so",
    "libkvdepot_worker.so",
)
_worker_lib: Optional[ctypes.CDLL] = None


def worker_library() -> ctypes.CDLL:
    """libkvdepot_worker.so ($KVDEPOT_WORKER_LIB first), for kvd_map_vmm_fd."""
    global _worker_lib
    if _worker_lib is not None:
        return _worker_lib
    paths = [os.environ["KVDEPOT_WORKER_LIB"]] if os.environ.get(
        "KVDEPOT_WORKER_LIB") else list(_WORKER_CANDIDATES)
    errors = []
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError as e:
            errors.append(f"{p}: {e}")
            continue
        lib.kvd_map_vmm_fd.argtypes = [
            ctypes.c_int, ctypes.c_int64, ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.kvd_map_vmm_fd.restype = ctypes.c_int
        lib.kvd_unmap.argtypes = [ctypes.c_void_p]
        lib.kvd_last_error.restype = ctypes.c_char_p
        _worker_lib = lib
        return lib
    raise RuntimeError("CUDA pool views without kvdepot.torch need "
                       "libkvdepot_worker.so (set KVDEPOT_WORKER_LIB); tried "
                       + "; ".join(errors))


class _CudaArray:
    """__cuda_array_interface__ v3 over raw device bytes."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "|u1", "data": (ptr, False),
            "version": 3, "strides": None}


class _VmmMapping:
    """A descriptor from the companion socket (CUDA VMM export) mapped on
    its device by kvd_map_vmm_fd, as a uint8 CUDA tensor (no copy)."""

    def __init__(self, client: kvdepot.Client, what: str,
                 request: "pb.CompanionRequest"):
        lib = worker_library()
        # Client._companion_call returns (reply, fd): the private path the
        # client's own map_pool/allocate_buffer take (they mmap memfds only).
        self.reply, fd = client._companion_call(what, request)  # noqa: SLF001
        try:
            dev = self.reply.fd_device
            if not dev.startswith("cuda:"):
                raise RuntimeError(f"{what}: the daemon handed over a {dev} "
                                   "descriptor; is it the CUDA backend?")
            ordinal = int(dev.split(":")[1])
            ptr, handle = ctypes.c_void_p(), ctypes.c_void_p()
            rc = lib.kvd_map_vmm_fd(fd, self.reply.fd_size, ordinal,
                                    ctypes.byref(ptr), ctypes.byref(handle))
            if rc != 0:
                raise RuntimeError(f"kvd_map_vmm_fd: {rc}: "
                                   f"{lib.kvd_last_error().decode()}")
        finally:
            os.close(fd)
        self._handle = handle
        self.tensor = torch.as_tensor(_CudaArray(ptr.value, self.reply.fd_size),
                                      device=f"cuda:{ordinal}")

    def close(self) -> None:
        if self._handle is not None:
            torch.cuda.synchronize()
            del self.tensor
            worker_library().kvd_unmap(self._handle)
            self._handle = None


# ------------------------------------------------------------ library mode

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))   # repo; gpu_pack/..: bundle


def _kernels_candidates() -> List[str]:
    """The Bazel output, the runfiles copy (data of a test), the GPU
    bundle; $KVDEPOT_KERNELS_LIB alone when set."""
    if os.environ.get("KVDEPOT_KERNELS_LIB"):
        return [os.environ["KVDEPOT_KERNELS_LIB"]]
    return [os.path.join(_ROOT, rel) for rel in (
        "bazel-bin/libkvdepot/libkvdepot_kernels.so",
        "libkvdepot/libkvdepot_kernels.so",
        "gpu_bundle/bin/libkvdepot_kernels.so")]


_kernels_lib: Optional[ctypes.CDLL] = None


def kernels_library() -> Tuple[Optional[ctypes.CDLL], str]:
    """(the library, "") or (None, why not): libkvdepot_kernels.so loaded by
    libkvdepot/kvdepot_kernels.py's load() (every signature declared, the
    ABI version checked; found beside this folder's parent, as in the repo,
    or in gpu_pack/). $KVDEPOT_KERNELS_LIB first."""
    global _kernels_lib
    if _kernels_lib is not None:
        return _kernels_lib, ""
    import sys
    for d in (os.path.join(_ROOT, "libkvdepot"), os.path.dirname(_HERE)):
        if os.path.isfile(os.path.join(d, "kvdepot_kernels.py")):
            if d not in sys.path:
                sys.path.append(d)
            break
    try:
        import kvdepot_kernels  # type: ignore
    except ImportError as e:
        return None, f"library mode unavailable: kvdepot_kernels.py: {e}"
    errors = []
    for p in _kernels_candidates():
        try:
            _kernels_lib = kvdepot_kernels.load(p)
            return _kernels_lib, ""
        except (OSError, AttributeError, kvdepot_kernels.KernelsError) as e:
            errors.append(f"{p}: {e}")
    return None, ("library mode unavailable: libkvdepot_kernels.so (bazel "
                  "build //libkvdepot:libkvdepot_kernels.so, or set "
                  "KVDEPOT_KERNELS_LIB) was not loaded; tried "
                  + "; ".join(errors))
