"""Scenarios of the reference worker (issue 15 item 3), shared by run.py and
the Bazel test. Each drives a KVWorker against a daemon and the BF16 oracle
with the same tokens (teacher forcing: the worker samples greedily, the
oracle is fed the worker's tokens) and collects the agreement figures."""

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

import kvdepot
from model import Config, Weights
from oracle import Oracle
from worker import KVWorker

# Stated tolerances (docs/INTEGRATION.md, "The reference worker"). Two
# BF16 oracles are fed the worker's tokens:
# - "forced": also the worker's top-k choices, so the only difference left
#   is the cache's quantization (FP8 main/SWA records, MXFP8 index keys do
#   not enter): tight bounds;
# - "own": its own indexer over BF16 index keys, fully independent; the
#   MXFP8 index keys flip near-tied choices, so looser bounds, and the
#   worker's choices must mostly be ones the BF16 indexer makes too.
# Measured (CPU, seed 1234, 2-4 layers, 32-64 steps, DS_MLA_FP8 and V41):
# forced top-1 0.89-0.98, max 0.13-0.25, mean 0.019-0.030; own top-1
# 0.86-0.98, mean 0.022-0.044; overlap 0.971-0.979. Top-1 is the noisy one:
# a random model has many near-tied logits (a gap below the FP8 error).
# A wrong row anywhere (see CheckerTest) gives mean errors near 1.
FORCED_TOP1_MIN = 0.85        # greedy-token agreement, all compared steps
FORCED_REL_MAX = 0.40         # max |Δlogit| / std(oracle logits), any step
FORCED_MEAN_REL_MAX = 0.05    # mean |Δlogit| / std, over all steps
OWN_TOP1_MIN = 0.80
OWN_MEAN_REL_MAX = 0.08
TOPK_OVERLAP_MIN = 0.90       # worker's chosen rows the BF16 indexer chose


@dataclass
class Agreement:
    steps: int = 0
    top1: int = 0
    max_rel: float = 0.0
    sum_rel: float = 0.0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        std = float(want.std())
        d = (got - want).abs()
        self.steps += 1
        self.top1 += int(int(got.argmax()) == int(want.argmax()))
        self.max_rel = max(self.max_rel, float(d.max()) / std)
        self.sum_rel += float(d.mean()) / std

    def summary(self) -> Dict[str, float]:
        n = max(self.steps, 1)
        return {"compared_steps": self.steps, "top1_agreement":
                round(self.top1 / n, 4), "max_rel_logit_err":
                round(self.max_rel, 4), "mean_rel_logit_err":
                round(self.sum_rel / n, 5)}

    def ok(self, top1_min: float, mean_max: float,
           max_max: float = float("inf")) -> bool:
        return (self.steps > 0 and self.top1 / self.steps >= top1_min
                and self.max_rel <= max_max
                and self.sum_rel / self.steps <= mean_max)


@dataclass
class Harness:
    worker: KVWorker
    oracle: Oracle            # its own indexer
    forced: Oracle            # the worker's top-k choices
    agree: Agreement = field(default_factory=Agreement)
    agree_own: Agreement = field(default_factory=Agreement)
    finished: List[int] = field(default_factory=list)
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    # Tell the worker (decode(..., next_same_batch=)) whether the next
    # decode step has the same batch: true unless a sequence finishes at
    # this step. Only where no sequence joins between steps (basic; not
    # churn's arrivals): a step path worker sends the next Step ahead.
    lookahead: bool = False

    def start(self, seq_id: int, prompt: List[int], max_new: int) -> None:
        s = self.worker.add(seq_id, prompt, max_new)
        got = self.worker.prefill(s)
        self.agree_own.add(got, self.oracle.prefill(seq_id, prompt))
        self.agree.add(got, self.forced.prefill(
            seq_id, prompt, [torch.cat(c) for c in s.prefill_topk]))
        s.tokens.append(int(got.argmax()))

    def step(self, hook: Optional[Callable[[int], None]] = None) -> None:
        ids = sorted(self.worker.seqs)
        t = time.perf_counter()
        if self.lookahead:
            assert hook is None, "lookahead: no sequences join mid-decode"
            same = all(self.worker.seqs[i].generated + 1 <
                       self.worker.seqs[i].max_new for i in ids)
            out = self.worker.decode(ids, next_same_batch=same)
        else:
            out = self.worker.decode(ids)
        self.decode_s += time.perf_counter() - t
        self.decode_steps += 1
        self.decode_tokens += len(ids)
        for i in ids:
            s = self.worker.seqs[i]
            self.agree_own.add(out[i], self.oracle.step(i, s.tokens[-1]))
            self.agree.add(out[i], self.forced.step(i, s.tokens[-1],
                                                    s.step_topk))
            s.generated += 1
            s.tokens.append(int(out[i].argmax()))
        for i in ids:
            s = self.worker.seqs[i]
            if s.generated >= s.max_new:
                self.worker.finish(i)
                self.oracle.drop(i)
                self.forced.drop(i)
                self.finished.append(i)
        if hook:
            hook(self.decode_steps)

    def report(self) -> Dict[str, object]:
        r: Dict[str, object] = {
            "forced_topk": self.agree.summary(),
            "own_indexer": self.agree_own.summary()}
        overlap = self.forced.overlap_hits / max(self.forced.overlap_total,
                                                 1)
        r["topk_overlap"] = round(overlap, 4)
        r["compared_steps"] = self.agree.steps
        r.update(self.worker.checks)
        r.update({"decode_steps": self.decode_steps,
                  "decode_tokens": self.decode_tokens,
                  "tokens_per_s": round(self.decode_tokens /
                                        max(self.decode_s, 1e-9), 2),
                  "rpc_calls": self.worker.rpcs,
                  "rpc_s": round(self.worker.rpc_s, 3),
                  "decode_s": round(self.decode_s, 3),
                  "decode_rpc_calls": self.worker.decode_rpcs,
                  "decode_rpc_s": round(self.worker.decode_rpc_s, 3),
                  "agreement_ok": self.agree.ok(
                      FORCED_TOP1_MIN, FORCED_MEAN_REL_MAX, FORCED_REL_MAX)
                  and self.agree_own.ok(OWN_TOP1_MIN, OWN_MEAN_REL_MAX)
                  and overlap >= TOPK_OVERLAP_MIN})
        return r


def prompt(rng: random.Random, cfg: Config, n: int) -> List[int]:
    return [rng.randrange(cfg.vocab) for _ in range(n)]


def make(client: kvdepot.Client, cfg: Config, w: Weights,
         device: torch.device, worker_cls: type = KVWorker,
         **kw) -> Harness:
    return Harness(worker_cls(client, cfg, w, device, **kw),
                   Oracle(cfg, w, device), Oracle(cfg, w, device))


def basic(h: Harness, steps: int, seed: int) -> None:
    """Prompts crossing block (64 compressed rows = 64·R tokens) and ratio
    boundaries and the chunk size; decode long enough that rings (W = 128)
    wrap several times."""
    rng = random.Random(seed)
    for i, n in enumerate((77, 130, 261)):
        h.start(i, prompt(rng, h.worker.cfg, n), max_new=steps)
    while h.worker.seqs:
        h.step()


def churn(h: Harness, steps: int, seed: int) -> None:
    """Continuous batching: sequences of different lengths finish, their
    blocks and rings are freed and poisoned with garbage, and new requests
    arrive mid-decode and reuse them."""
    rng = random.Random(seed)
    cfg = h.worker.cfg
    plan = [(0, 70, steps // 4), (1, 129, steps), (2, 40, steps // 2)]
    arrivals = [(steps // 4 + 1, 3, 200, steps // 2),
                (steps // 2 + 1, 4, 66, steps // 3),
                (steps // 2 + 3, 5, 255, steps // 4)]
    for i, n, m in plan:
        h.start(i, prompt(rng, cfg, n), m)
    poisoned = 0

    def poison_then_arrive(step: int) -> None:
        nonlocal poisoned
        while poisoned < len(h.finished):
            # The worker's free lists hold the finished blocks: poison them.
            h.worker.poison_blocks(sorted(h.worker.ever_used & set(
                h.worker.free_blocks)), h.worker.free_states[0], rng)
            poisoned += 1
        for at, i, n, m in arrivals:
            if at == step:
                h.start(i, prompt(rng, cfg, n), m)

    while h.worker.seqs:
        h.step(poison_then_arrive)
    h.worker.checks["poison_rounds"] = poisoned
