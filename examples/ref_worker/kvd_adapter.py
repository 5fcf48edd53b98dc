"""The one place the reference worker touches kvdepot's Python surface
beyond plain Client calls: pool and buffer tensors and the fused store,
all through `kvdepot.torch` (docs/PYTHON.md, "PyTorch"), on the CPU
backend (mmaps of memfds, torch.frombuffer) and the CUDA backend (VMM
descriptors mapped by libkvdepot_worker.so) alike; and library mode
(`libkvdepot_kernels.so`), which `kernels_library()` finds or says why
not (callers skip, never fake, what needs it)."""

import ctypes
import os
from typing import List, Optional, Tuple

import torch

import kvdepot
import kvdepot.torch as kvt


class PoolView:
    """A whole pool mapped once (kvt.map_pool_tensors), no copy; layer(l)
    is kvdepot.torch's PoolLayerView (.raw uint8 [layer_bytes], .records /
    .data / .scales [num_blocks, block_size, bytes])."""

    def __init__(self, client: kvdepot.Client, name: str,
                 device: torch.device):
        self.name = name
        self._pool: Optional[kvt.PoolTensors] = kvt.map_pool_tensors(
            client, name)
        self.layout = self._pool.layout
        if self._pool.all.device.type != device.type:
            raise RuntimeError(
                f"pool \"{name}\" is on {self._pool.all.device}, the worker "
                f"on {device}: is the daemon's backend the worker's device?")
        self._layers: List[kvt.PoolLayerView] = [
            self._pool.layer(l) for l in range(self.layout.num_layers)]

    @property
    def whole(self) -> torch.Tensor:
        """uint8 [total_bytes]: every layer, at l * layer_stride."""
        assert self._pool is not None, "closed"
        return self._pool.all

    def layer(self, l: int) -> "kvt.PoolLayerView":
        return self._layers[l]

    def close(self) -> None:
        """Drops the tensors: the mapping goes with the last of them (CUDA:
        after the kernels that may still read it)."""
        if self._pool is not None and self._pool.all.device.type == "cuda":
            torch.cuda.synchronize(self._pool.all.device)
        self._layers = []
        self._pool = None


class HostBuffer:
    """A daemon-allocated buffer as a uint8 tensor without a copy
    (kvt.buffer_tensor: CPU mmap or CUDA VMM mapping); .slice() for
    requests, .buf the kvdepot.Buffer."""

    def __init__(self, client: kvdepot.Client, size: int,
                 device: torch.device = torch.device("cpu")):
        self.buf = client.allocate_buffer(size)
        self.id = self.buf.id
        self.tensor = kvt.buffer_tensor(client, self.buf)
        if self.tensor.device.type != device.type:
            self.buf.release()
            raise RuntimeError(
                f"buffer {self.id} is on {self.tensor.device}, the worker on "
                f"{device}: is the daemon's backend the worker's device?")

    def slice(self, offset: int = 0, length: Optional[int] = None):
        return self.buf.slice(offset, length)

    def release(self) -> None:
        """Gives the buffer back (raises KVCacheError once the session is
        gone); the mapping goes with the last tensor."""
        if self.tensor.device.type == "cuda":
            torch.cuda.synchronize(self.tensor.device)
        del self.tensor
        self.buf.release()


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


class FusedParams:
    """Per-layer fused-store parameters (SPEC §8): the norm weight (BF16
    bytes) and the cos/sin cache (fp32 bytes), sent inline with each call
    (the step path registers them once instead)."""

    def __init__(self, norm_end: int, norm_weight: torch.Tensor,
                 rope_offset: int, rope_dim: int, cos_sin: torch.Tensor,
                 eps: float):
        self.norm_end = norm_end
        self.norm_weight = bf16_bytes(norm_weight)
        self.rope_offset = rope_offset
        self.rope_dim = rope_dim
        self.cos_sin = tensor_bytes(cos_sin.to(torch.float32))
        self.max_position = int(cos_sin.shape[0])
        self.eps = eps

    def options(self, positions: List[int]) -> kvdepot.FusedStore:
        return kvdepot.FusedStore(
            norm_end=self.norm_end, norm_weight=self.norm_weight,
            positions=positions, cos_sin=self.cos_sin,
            max_position=self.max_position, rope_dim=self.rope_dim,
            rope_offset=self.rope_offset, eps=self.eps, rope="interleaved")


def fused_store(client: kvdepot.Client, pool: str, layer: int,
                slots: List[int], kv: torch.Tensor, positions: List[int],
                fp: Optional[FusedParams]) -> int:
    """Stores kv ([n, elements], rounded to BF16 first) with the fused
    norm/RoPE (fp given) or as a plain store (fp None: index keys), through
    kvt.store (a CUDA tensor goes inline: it is not a buffer view)."""
    return kvt.store(client, pool, layer,
                     torch.tensor(slots, dtype=torch.int32),
                     kv.detach().to(torch.bfloat16).contiguous(),
                     fused=None if fp is None else fp.options(positions))


# ------------------------------------------------------------ CUDA

def worker_library_error() -> str:
    """"" when libkvdepot_worker.so (which kvdepot.torch needs for every
    CUDA mapping) loads, else why not, for run.py's "skipped" line. Uses
    kvdepot's own loader (a private module: the same search order as every
    CUDA call of kvdepot.torch, $KVDEPOT_WORKER_LIB first)."""
    from kvdepot import _worker_lib
    try:
        _worker_lib.load_library()
    except kvdepot.KVCacheError as e:
        return e.message
    return ""


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

