"""The oracle: the same model with its cache unquantized (BF16 keys, BF16
index keys) in plain PyTorch lists, one token at a time. It shares the
dense math of model.py with the worker but none of kvdepot's formats, slot
arithmetic, plans or index conversion: the window is the last W positions
and the compressed rows are a Python list indexed by s."""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from model import (Config, Weights, attend, bf16, finish_key, index_scores,
                   logits, mlp, project, select_topk)


@dataclass
class _LayerCache:
    keys: List[torch.Tensor] = field(default_factory=list)        # [D] per pos
    raw: List[torch.Tensor] = field(default_factory=list)         # group
    ik_raw: List[torch.Tensor] = field(default_factory=list)
    comp: List[torch.Tensor] = field(default_factory=list)        # [D] per s
    ikeys: List[torch.Tensor] = field(default_factory=list)       # [128]


class Oracle:
    def __init__(self, cfg: Config, w: Weights, device: torch.device):
        self.cfg, self.w, self.device = cfg, w, device
        self.caches: Dict[int, List[_LayerCache]] = {}
        self.topk: Dict[int, List[List[int]]] = {}  # last step's choices
        # With forced choices: how many of them the oracle's own indexer
        # (BF16 keys) would also have chosen.
        self.overlap_hits = 0
        self.overlap_total = 0

    def _choose(self, sc: torch.Tensor, visible: torch.Tensor,
                forced: Optional[torch.Tensor]) -> torch.Tensor:
        """[n, topk] chosen rows (-1 = none): the oracle's own top-k, or the
        forced ones (then counted against its own)."""
        own, _ = select_topk(sc, visible, self.cfg.topk)
        if forced is None:
            return own
        forced = forced.to(own.device)
        for a, b in zip(own.tolist(), forced.tolist()):
            mine = {v for v in a if v >= 0}
            theirs = [v for v in b if v >= 0]
            self.overlap_total += len(theirs)
            self.overlap_hits += sum(1 for v in theirs if v in mine)
        return forced

    def drop(self, seq: int) -> None:
        self.caches.pop(seq, None)

    @torch.no_grad()
    def prefill(self, seq: int, tokens: List[int],
                forced: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Feeds a whole prompt at once (dense masks over all positions);
        the same results as step() token by token, faster. Returns the
        logits of the last position."""
        cfg, w, dev = self.cfg, self.w, self.device
        assert seq not in self.caches
        caches = [_LayerCache() for _ in range(cfg.layers)]
        self.caches[seq] = caches
        n = len(tokens)
        pos = torch.arange(n, device=dev)
        x = w.embed[torch.tensor(tokens, device=dev)]
        qpos, kpos = pos[:, None], pos[None, :]
        in_window = (kpos <= qpos) & (kpos > qpos - cfg.window)
        for l, lw in enumerate(w.layers):
            c, R = caches[l], cfg.ratio(l)
            pr = project(cfg, lw, x, pos, w.cos_sin)
            keys = finish_key(cfg, lw, pr.kv_raw, pos, w.cos_sin)
            c.keys = list(keys)
            m = n // R
            if m:
                D = cfg.kv_dim
                means = bf16(pr.kv_raw[:m * R].view(m, R, D).mean(dim=1))
                last = torch.arange(m, device=dev) * R + R - 1
                c.comp = list(finish_key(cfg, lw, means, last, w.cos_sin))
                c.ikeys = list(bf16(pr.ik_raw[:m * R].view(
                    m, R, cfg.index_dim).mean(dim=1)))
            c.raw = list(pr.kv_raw[m * R:])
            c.ik_raw = list(pr.ik_raw[m * R:])
            chosen = torch.zeros(n, max(m, 1), dtype=torch.bool, device=dev)
            if m:
                sc = index_scores(pr.iq, pr.iw, torch.stack(c.ikeys))
                idx = self._choose(
                    sc, torch.div(pos + 1, R, rounding_mode="floor"),
                    None if forced is None else forced[l])
                for j in range(idx.shape[1]):
                    col = idx[:, j]
                    hit = col >= 0
                    chosen[hit, col[hit]] = True
                comp = torch.stack(c.comp)
            else:
                comp = torch.zeros(1, cfg.kv_dim, device=dev)
            allk = torch.cat([keys, comp])
            valid = torch.cat([in_window, chosen], dim=1)
            sc = (pr.q @ allk.t()) * cfg.kv_dim ** -0.5
            sc = sc.masked_fill(~valid[:, None, :], -math.inf)
            o = torch.softmax(sc, dim=-1) @ allk[:, :cfg.latent]
            x = x + o.reshape(n, -1) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        return logits(cfg, w, x[-1:])[0]

    @torch.no_grad()
    def step(self, seq: int, token: int,
             forced: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Feeds `token` at the next position of `seq`; returns logits."""
        cfg, w = self.cfg, self.w
        caches = self.caches.setdefault(
            seq, [_LayerCache() for _ in range(cfg.layers)])
        p = len(caches[0].keys)
        pos = torch.tensor([p], device=self.device)
        x = w.embed[token][None, :]
        self.topk[seq] = []
        for l, lw in enumerate(w.layers):
            c, R = caches[l], cfg.ratio(l)
            pr = project(cfg, lw, x, pos, w.cos_sin)
            c.keys.append(finish_key(cfg, lw, pr.kv_raw, pos, w.cos_sin)[0])
            c.raw.append(pr.kv_raw[0])
            c.ik_raw.append(pr.ik_raw[0])
            if len(c.raw) == R:
                mean = bf16(torch.stack(c.raw).mean(dim=0))
                c.comp.append(finish_key(cfg, lw, mean[None, :], pos,
                                         w.cos_sin)[0])
                c.ikeys.append(bf16(torch.stack(c.ik_raw).mean(dim=0)))
                c.raw, c.ik_raw = [], []
            window = c.keys[max(0, p - cfg.window + 1):]
            rows = list(window)
            n = len(c.comp)
            if n:
                sc = index_scores(pr.iq, pr.iw, torch.stack(c.ikeys))
                idx = self._choose(sc, torch.tensor([n], device=self.device),
                                   None if forced is None else
                                   forced[l][None, :])
                chosen = [int(i) for i in idx[0] if int(i) >= 0]
                rows += [c.comp[i] for i in chosen]
            else:
                chosen = []
            self.topk[seq].append(chosen)
            keys = torch.stack(rows)[None]
            valid = torch.ones(1, keys.shape[1], dtype=torch.bool,
                               device=self.device)
            x = x + attend(cfg, pr.q, keys, valid) @ lw.w_o
            x = x + mlp(cfg, lw, x)
        return logits(cfg, w, x)[0]
