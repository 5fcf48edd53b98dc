"""The reference model: DeepSeek-V3.2-like layer shapes in the style of the
seed's attention (MLA latent + interleaved RoPE keys, an SWA ring, a
compressed cache at ratio R per layer, an indexer choosing top-k compressed
rows, sparse attention over the window + the chosen rows), random weights
from a fixed seed, small hidden/vocab sizes. Cache shapes are the real ones:
576 = 512 latent + 64 RoPE (DS_MLA_FP8) or 512 = 448 + 64 (V41), index keys
of 128.

Dense math (projections, MLP, logits) lives here and is shared by the
kvdepot-backed worker (worker.py) and the BF16 oracle (oracle.py); how the
cache is written, indexed and read is not shared."""

import math
from dataclasses import dataclass, field
from typing import List, Tuple

import torch


@dataclass(frozen=True)
class Config:
    main_format: str = "DS_MLA_FP8"    # or "V41"
    layers: int = 4
    hidden: int = 128
    vocab: int = 512
    heads: int = 2
    index_heads: int = 2
    index_dim: int = 128
    rope_dim: int = 64
    window: int = 128                  # W; the SWA ring holds B = W slots
    topk: int = 16
    ratios: Tuple[int, ...] = (4, 1, 4, 2)
    block_size: int = 64               # main/index pools (FlashMLA's 64)
    max_position: int = 4096
    eps: float = 1e-6
    seed: int = 1234

    @property
    def latent(self) -> int:
        # BF16(576): the unquantized control (same shapes as DS_MLA_FP8).
        return 448 if self.main_format == "V41" else 512

    @property
    def kv_dim(self) -> int:
        return self.latent + self.rope_dim

    def ratio(self, layer: int) -> int:
        return self.ratios[layer % len(self.ratios)]


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    w_kv: torch.Tensor      # [H, D]
    kv_norm: torch.Tensor   # [latent]
    w_q: torch.Tensor       # [H, heads * D]
    w_o: torch.Tensor       # [heads * latent, H]
    w_iq: torch.Tensor      # [H, index_heads * 128]
    w_iw: torch.Tensor      # [H, index_heads]
    w_ik: torch.Tensor      # [H, 128]
    mlp_norm: torch.Tensor
    w_up: torch.Tensor      # [H, 2 * F]
    w_down: torch.Tensor    # [F, H]


@dataclass
class Weights:
    embed: torch.Tensor
    layers: List[LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor = torch.empty(0)
    w_out: torch.Tensor = torch.empty(0)
    cos_sin: torch.Tensor = torch.empty(0)   # fp32 [max_position, 64]


def make_weights(cfg: Config, device: torch.device) -> Weights:
    """Random weights from cfg.seed, rounded to BF16 values (kept fp32)."""
    g = torch.Generator().manual_seed(cfg.seed)

    def n(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return bf16(torch.randn(*shape, generator=g) * scale)

    def gain(dim: int) -> torch.Tensor:
        return bf16(1.0 + 0.1 * torch.randn(dim, generator=g))

    H, D, F = cfg.hidden, cfg.kv_dim, 2 * cfg.hidden
    w = Weights(embed=n(cfg.vocab, H))
    for _ in range(cfg.layers):
        w.layers.append(LayerWeights(
            attn_norm=gain(H), w_kv=n(H, D, scale=H ** -0.5),
            kv_norm=gain(cfg.latent),
            w_q=n(H, cfg.heads * D, scale=2.0 * H ** -0.5),
            w_o=n(cfg.heads * cfg.latent, H,
                  scale=(cfg.heads * cfg.latent) ** -0.5),
            w_iq=n(H, cfg.index_heads * cfg.index_dim, scale=H ** -0.5),
            w_iw=n(H, cfg.index_heads, scale=H ** -0.5),
            w_ik=n(H, cfg.index_dim, scale=H ** -0.5),
            mlp_norm=gain(H), w_up=n(H, 2 * F, scale=H ** -0.5),
            w_down=n(F, H, scale=F ** -0.5)))
    w.final_norm = gain(H)
    w.w_out = n(H, cfg.vocab, scale=H ** -0.5)
    w.cos_sin = cos_sin_cache(cfg.max_position, cfg.rope_dim)
    for name in ("embed", "final_norm", "w_out", "cos_sin"):
        setattr(w, name, getattr(w, name).to(device))
    for lw in w.layers:
        for k, v in vars(lw).items():
            setattr(lw, k, v.to(device))
    return w


def cos_sin_cache(max_position: int, rope_dim: int,
                  base: float = 10000.0) -> torch.Tensor:
    """fp32 [max_position, rope_dim] laid out [cos half | sin half]."""
    half = rope_dim // 2
    inv = 1.0 / (base ** (torch.arange(half, dtype=torch.float64) * 2.0
                          / rope_dim))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(torch.float32)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * r * w


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor,
                     cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x[..., rope_dim] by the angles of `pos`
    (shape x.shape[:-1] broadcastable)."""
    half = x.shape[-1] // 2
    cs = cos_sin[pos]
    c, s = cs[..., :half], cs[..., half:]
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.stack([a * c - b * s, b * c + a * s], dim=-1)
    return out.flatten(-2)


@dataclass
class Projections:
    kv_raw: torch.Tensor   # [n, D] BF16 values: what the fused store gets
    q: torch.Tensor        # [n, heads, D], RoPE applied to the tail
    iq: torch.Tensor       # [n, index_heads, 128]
    iw: torch.Tensor       # [n, index_heads]
    ik_raw: torch.Tensor   # [n, 128] BF16 values


def project(cfg: Config, lw: LayerWeights, x: torch.Tensor,
            pos: torch.Tensor, cos_sin: torch.Tensor) -> Projections:
    a = rms_norm(x, lw.attn_norm, cfg.eps)
    q = (a @ lw.w_q).view(-1, cfg.heads, cfg.kv_dim)
    q = torch.cat([q[..., :cfg.latent],
                   rope_interleaved(q[..., cfg.latent:], pos, cos_sin)], -1)
    return Projections(
        kv_raw=bf16(a @ lw.w_kv), q=q,
        iq=(a @ lw.w_iq).view(-1, cfg.index_heads, cfg.index_dim),
        iw=a @ lw.w_iw, ik_raw=bf16(a @ lw.w_ik))


def finish_key(cfg: Config, lw: LayerWeights, kv_raw: torch.Tensor,
               pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """SPEC §8 steps 1, 2, 4 in torch: RMSNorm of the latent, interleaved
    RoPE of the tail, rounded to BF16 (the oracle's keys, and the worker's
    prefill chunk K/V)."""
    lat = rms_norm(kv_raw[..., :cfg.latent], lw.kv_norm, cfg.eps)
    rope = rope_interleaved(kv_raw[..., cfg.latent:], pos, cos_sin)
    return bf16(torch.cat([lat, rope], dim=-1))


def index_scores(iq: torch.Tensor, iw: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
    """V3.2's lightning indexer: score[q, s] = Σ_h w[q,h] relu(iq[q,h]·k[s]).
    iq [n, h, 128], iw [n, h], keys [m, 128] -> [n, m]."""
    dots = (iq @ keys.t()).clamp(min=0)
    return (dots * iw[:, :, None]).sum(dim=1)


def select_topk(scores: torch.Tensor, visible: torch.Tensor,
                k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the visible columns of scores [n, m] (visible int64[n]:
    columns < visible[i] may be chosen). Returns (idx int64[n, k] ascending
    with -1 padding, count int64[n]). Ties broken by the lower index."""
    n, m = scores.shape
    cols = torch.arange(m, device=scores.device)
    masked = torch.where(cols[None, :] < visible[:, None], scores,
                         torch.full_like(scores, -math.inf))
    kk = min(k, m)
    out = torch.full((n, k), -1, dtype=torch.int64, device=scores.device)
    count = torch.clamp(visible, max=k)
    if kk == 0:
        return out, count
    # Stable order: sort by (-score, index).
    order = torch.sort(-masked, dim=1, stable=True).indices[:, :kk]
    keep = torch.arange(kk, device=scores.device)[None, :] < count[:, None]
    chosen = torch.where(keep, order, torch.full_like(order, m + 1))
    chosen = torch.sort(chosen, dim=1).values
    chosen = torch.where(chosen > m, torch.full_like(chosen, -1), chosen)
    out[:, :kk] = chosen
    return out, count


def attend(cfg: Config, q: torch.Tensor, keys: torch.Tensor,
           valid: torch.Tensor) -> torch.Tensor:
    """q [n, heads, D]; keys [n, m, D] (rows where valid is False are never
    used: they are zeroed first, so poisoned memory cannot leak in);
    -> [n, heads * latent]."""
    keys = torch.where(valid[:, :, None], keys, torch.zeros_like(keys))
    s = (q @ keys.transpose(1, 2)) * cfg.kv_dim ** -0.5
    s = torch.where(valid[:, None, :], s, torch.full_like(s, -math.inf))
    p = torch.softmax(s, dim=-1)
    o = p @ keys[..., :cfg.latent]
    return o.reshape(o.shape[0], -1)


def mlp(cfg: Config, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    a = rms_norm(x, lw.mlp_norm, cfg.eps)
    u, g = (a @ lw.w_up).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ lw.w_down


def logits(cfg: Config, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w.final_norm, cfg.eps) @ w.w_out
