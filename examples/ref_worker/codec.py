"""Reading kvdepot records in torch, written from docs/FORMATS.md and SPEC
§2/§3 (not from the daemon's code): the e4m3 value table built by bit
arithmetic (torch 1.13 has no float8 dtypes), UE8M0 scales, fp32 scales and
the BF16 tail, and the byte offsets of one slot in a pool layer.

Everything here reads bytes that live in the pool (zero-copy views); the
only copies are the gathered rows of the slots asked for."""

from dataclasses import dataclass
from typing import Any, Tuple

import torch


def _e4m3_table() -> torch.Tensor:
    """float32[256]: the value of every e4m3 (OCP FN) code; 0x7F/0xFF NaN."""
    vals = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        man = code & 0x7
        if exp == 0xF and man == 0x7:
            vals.append(float("nan"))
        elif exp == 0:
            vals.append(sign * man * 2.0 ** -9)           # subnormal: m/8 * 2^-6
        else:
            vals.append(sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float32)


E4M3 = _e4m3_table()
_E4M3_ON: dict = {}


def e4m3_table(device: torch.device) -> torch.Tensor:
    """The table on `device`, copied once (no host copy inside a CUDA graph
    capture after the first use)."""
    key = str(device)
    if key not in _E4M3_ON:
        _E4M3_ON[key] = E4M3.to(device)
    return _E4M3_ON[key]


def ue8m0_to_f32(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes -> 2^(byte - 127), built in the fp32 exponent field
    (byte 0 gives 0.0 in this construction; never stored by kvdepot's math
    for finite inputs except at the clamp, where 2^-127 is subnormal: build it
    as a product so it stays exact)."""
    b = byte.to(torch.int32)
    bits = torch.clamp(b, min=1) << 23
    f = bits.view(torch.float32)
    return torch.where(b == 0, torch.full_like(f, 2.0 ** -127), f)


@dataclass(frozen=True)
class LayerGeometry:
    """What a pool's layout reply says about one layer (kvdepot.v1.PoolLayout)."""
    block_size: int
    num_blocks: int
    block_stride: int
    layer_stride: int
    bytes_per_token: int
    data_bytes: int
    sf_bytes: int
    interleaved: bool

    @staticmethod
    def of(layout) -> "LayerGeometry":
        return LayerGeometry(
            block_size=layout.block_size, num_blocks=layout.num_blocks,
            block_stride=layout.block_stride,
            layer_stride=layout.layer_stride,
            bytes_per_token=layout.bytes_per_token,
            data_bytes=layout.data_bytes, sf_bytes=layout.sf_bytes,
            interleaved=layout.token_interleaved)


def gather_records(layer: Any, g: LayerGeometry,
                   slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data uint8[n, data_bytes + tail], scales uint8[n, sf_bytes]) of the
    records at `slots` (int64[n], all >= 0) of one pool layer, a
    kvdepot.torch PoolLayerView (its [num_blocks, block_size, bytes] views:
    .records for interleaved layouts, else .data and .scales). Interleaved
    records are returned as [data | scales | tail] split at data_bytes:
    data, then the rest."""
    blk = torch.div(slots, g.block_size, rounding_mode="floor")
    tok = slots - blk * g.block_size
    if g.interleaved:
        rec = layer.records[blk, tok]
        return rec[:, :g.data_bytes], rec[:, g.data_bytes:]
    return layer.data[blk, tok], layer.scales[blk, tok]


def _u8_to_f32(b: torch.Tensor) -> torch.Tensor:
    """uint8[..., 4k] little-endian -> float32[..., k] (bit reinterpretation)."""
    b = b.to(torch.int64)
    w = b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (
        b[..., 3::4] << 24)
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return w.view(torch.float32)


def _u8_to_bf16_f32(b: torch.Tensor) -> torch.Tensor:
    """uint8[..., 2k] little-endian BF16 -> float32[..., k] (exact)."""
    b = b.to(torch.int32)
    w = (b[..., 0::2] | (b[..., 1::2] << 8)) << 16
    return w.view(torch.float32)


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest BF16 value (ties to even), kept as fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def dequant_ds_mla(data: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """DS_MLA_FP8 records (data uint8[n, 512]; rest uint8[n, 16 + 128] =
    4 fp32 scales | 64 BF16) -> float32[n, 576] holding the BF16 values a
    load returns: q × s per tile of 128 rounded to BF16, then the tail."""
    q = e4m3_table(data.device)[data.to(torch.int64)]              # [n, 512]
    s = _u8_to_f32(rest[:, :16])                                # [n, 4]
    x = bf16_rne(q.view(-1, 4, 128) * s[:, :, None]).view(-1, 512)
    tail = _u8_to_bf16_f32(rest[:, 16:16 + 128])                # [n, 64]
    return torch.cat([x, tail], dim=1)


def dequant_v41(data: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """V41 records (data uint8[n, 512] e4m3; rest uint8[n, 16] UE8M0 per 32)
    -> float32[n, 512] of BF16 values (q × 2^(e−127), rounded to BF16)."""
    q = e4m3_table(data.device)[data.to(torch.int64)]
    s = ue8m0_to_f32(rest[:, :16])
    return bf16_rne(q.view(-1, 16, 32) * s[:, :, None]).view(-1, 512)


def dequant_mxfp8_index(data: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """MXFP8_INDEX records (uint8[n, 128] e4m3, uint8[n, 4] UE8M0 per 32) ->
    float32[n, 128] (q × 2^(e−127); index formats load raw, so this is the
    indexer's own reading, kept in fp32)."""
    q = e4m3_table(data.device)[data.to(torch.int64)]
    s = ue8m0_to_f32(sf)
    return (q.view(-1, 4, 32) * s[:, :, None]).view(-1, 128)


def dequant_main(fmt: str, data: torch.Tensor,
                 rest: torch.Tensor) -> torch.Tensor:
    if fmt == "DS_MLA_FP8":
        return dequant_ds_mla(data, rest)
    if fmt == "V41":
        return dequant_v41(data, rest)
    if fmt.startswith("BF16("):
        return _u8_to_bf16_f32(data)
    raise ValueError(f"no reader for main format {fmt}")
