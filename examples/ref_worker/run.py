#!/usr/bin/env python3
"""The reference worker's driver (docs/INTEGRATION.md, "The reference
worker"). Starts its own kvdepotd (--daemon, or $KVDEPOT_BIN, or
bazel-bin/server/kvdepotd) unless --address names a running one, runs the
scenarios asked for, prints one JSON summary line per scenario and writes
them all to --summary. Exit 0 when every scenario passed, 1 when one failed,
0 with "skipped" when the device asked for is not there.

    python3 examples/ref_worker/run.py --device cpu --scenario all
    python3 examples/ref_worker/run.py --device cuda --scenario basic
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "client", "python", "kvdepot")):
    sys.path.insert(1, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import kvdepot  # noqa: E402
import kvd_adapter  # noqa: E402
import scenarios  # noqa: E402
from model import Config, make_weights  # noqa: E402

SCENARIOS = ("basic", "churn", "kill_daemon", "kill_worker", "two_workers",
             "library", "speed", "step")


class OwnDaemon:
    """A kvdepotd child on a private socket."""

    def __init__(self, binary: str, extra: List[str]):
        self.dir = tempfile.mkdtemp(prefix="refworker")
        os.chmod(self.dir, 0o700)
        self.socket = os.path.join(self.dir, "kv.sock")
        self.binary, self.extra = binary, extra
        self.log_path = os.path.join(self.dir, "kvdepotd.log")
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        log = open(self.log_path, "ab")
        return subprocess.Popen([self.binary, f"--listen={self.socket}",
                                 *self.extra], stdout=log,
                                stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.proc = self._start()

    def stop(self) -> int:
        # A daemon still starting may not handle SIGTERM yet: wait for its
        # socket first (at most 20 s).
        deadline = time.time() + 20
        while (self.proc.poll() is None and not os.path.exists(self.socket)
               and time.time() < deadline):
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def find_daemon(flag: Optional[str]) -> str:
    for p in (flag, os.environ.get("KVDEPOT_BIN"),
              os.path.join(ROOT, "bazel-bin", "server", "kvdepotd"),
              os.path.join(ROOT, "kvdepotd")):
        if p and os.access(p, os.X_OK):
            return p
    raise SystemExit("no kvdepotd: pass --daemon PATH or set KVDEPOT_BIN")


def config(args: argparse.Namespace) -> Config:
    return Config(main_format=args.format, layers=args.layers,
                  window=args.window, seed=args.seed)


def step_config(args: argparse.Namespace) -> Config:
    """The step path's model: the layers' ratios (--step_ratios, repeated
    over the layers; several ratios > 1 each get their compressed slot
    mapping in every Step)."""
    ratios = tuple(int(r) for r in getattr(args, "step_ratios",
                                           "4,1,4,2").split(","))
    return Config(main_format=args.format, layers=args.layers,
                  window=args.window, seed=args.seed, ratios=ratios)


def step_vs_library(args: argparse.Namespace, address: str,
                    device: torch.device) -> Dict[str, object]:
    """The speed scenario's second part (CUDA): the step path
    (stepworker.StepPathWorker on kvdepotd) and its library-mode
    counterpart (libmode.LibraryStepWorker: the same model code and
    kernels in-process), both in graph mode with the same model (ratios
    --step_ratios), prompts (77/130/261 tokens: batch 3), --steps decode
    steps and seed; first stepped together with every step's logits, io
    rows and the pools compared bit for bit (libmode_oracle.
    step_path_lockstep), then each timed alone on the scenario (its decode
    calls only). Overhead = (step-path decode time - library decode time)
    per decode step, divided by the layers and by the phases (1 + 2 per
    layer: S, A_l, B_l). The step path sends its Steps as --step_pipeline
    says (default lookahead: step s + 1's Step sent while step s runs;
    stepworker.py); "Step host us" is the host time per decode step spent
    in Step sends and reply waits (library mode: its in-process metadata
    copies). Prints one table.

    On the CPU (no step path, no graphs) the same code runs as a smoke test:
    static shapes, the daemon's side stood in for by regular RPCs
    (stepsim.py); its times mean nothing."""
    import libmode
    import libmode_oracle
    import stepworker
    lib, K, why = libmode.kernels()
    if lib is None:
        return {"skipped": why}
    cuda = device.type == "cuda"
    if cuda and not lib.kvdk_has_cuda():
        return {"skipped": "libkvdepot_kernels.so was built without CUDA"}
    cfg = step_config(args)
    w = make_weights(cfg, device)
    mode = "graph" if cuda else "static"
    pipeline = getattr(args, "step_pipeline", "lookahead")
    transport = getattr(args, "step_transport", "ring")
    step_cls = stepworker.StepPathWorker
    if not cuda:
        import stepsim
        step_cls = stepsim.SimulatedStepWorker
    res: Dict[str, object] = {
        "mode": mode, "pipeline": pipeline, "transport": transport,
        "batch": 3,
        "steps": args.steps, "layers": cfg.layers,
        "ratios": list(cfg.ratios[:cfg.layers]), "format": cfg.main_format,
        "context_tokens": f"77/130/261 prompts + {args.steps} steps"}
    with kvdepot.connect(address, client_name="refworker-speed-step") as kv:
        # 1. Bit-identical, stepped together.
        tables = getattr(args, "step_block_tables", "device")
        dw = step_cls(kv, cfg, w, device, mode=mode, pipeline=pipeline,
                      prefix=args.prefix + "spc.", block_tables=tables,
                      transport=transport)
        lw = libmode.LibraryStepWorker(
            libmode.LibraryKernels(lib, K, device), cfg, w, device,
            mode=mode, prefix=args.prefix + "spc.", block_tables=tables)
        rng = random.Random(args.seed)
        prompts = [scenarios.prompt(rng, cfg, n) for n in (77, 130, 261)]
        try:
            res["lockstep"] = libmode_oracle.step_path_lockstep(
                dw, lw, prompts, args.steps)
            ok = True
        except libmode_oracle.Mismatch as e:
            res["mismatch"] = str(e)
            ok = False
        finally:
            dw.close()
            lw.close()
        # 2. Each timed alone on the same scenario (no checks).
        times = {}
        for side in ("step path", "library"):
            if side == "step path":
                h = scenarios.make(kv, cfg, w, device,
                                   worker_cls=step_cls,
                                   prefix=args.prefix + "sps.", mode=mode,
                                   pipeline=pipeline, check=False,
                                   transport=transport)
            else:
                h = scenarios.make(libmode.LibraryKernels(lib, K, device),
                                   cfg, w, device,
                                   worker_cls=libmode.LibraryStepWorker,
                                   prefix=args.prefix + "spl.", mode=mode,
                                   check=False)
            h.lookahead = True   # the batch changes only at the end
            scenarios.basic(h, args.steps, args.seed)
            r = h.report()
            wk = h.worker
            times[side] = {"decode_s": r["decode_s"],
                           "decode_steps": r["decode_steps"],
                           "tokens_per_s": r["tokens_per_s"],
                           "graph_replays": wk.replays,
                           "agreement_ok": r["agreement_ok"],
                           "step_rpcs": wk.step_rpcs,
                           "step_retries": wk.step_retries,
                           "step_host_us_per_step": round(
                               1e6 * wk.step_rpc_s
                               / max(int(r["decode_steps"]), 1), 1)}
            h.worker.close()
        res.update(times)
    sp, lb = times["step path"], times["library"]
    steps = max(int(sp["decode_steps"]), 1)
    d_ms = 1000 * (float(sp["decode_s"]) - float(lb["decode_s"])) / steps
    phases = 1 + 2 * cfg.layers
    res["overhead_ms_per_step"] = round(d_ms, 4)
    res["overhead_us_per_layer"] = round(1000 * d_ms / cfg.layers, 2)
    res["overhead_us_per_phase"] = round(1000 * d_ms / phases, 2)
    res["passed"] = ok and sp["agreement_ok"] and lb["agreement_ok"] and (
        not cuda or (sp["graph_replays"] > 0 and lb["graph_replays"] > 0))
    if not cuda:
        res["note"] = ("CPU smoke run: static shapes, the daemon's side "
                       "simulated by regular RPCs; the times mean nothing")
    print(f"speed, {mode} mode: batch 3, context 77/130/261 + {args.steps} "
          f"steps, {cfg.layers} layers, ratios "
          f"{list(cfg.ratios[:cfg.layers])}, {cfg.main_format}\n"
          f"step path pipeline: {pipeline}\n"
          f"{'path':<10} {'tokens/s':>10} {'ms/step':>9} "
          f"{'ovh us/layer':>13} {'ovh us/phase':>13} "
          f"{'Step host us/step':>18} {'retries':>8}\n"
          f"{'library':<10} {lb['tokens_per_s']:>10} "
          f"{1000 * float(lb['decode_s']) / steps:>9.3f} {'-':>13} "
          f"{'-':>13} {lb['step_host_us_per_step']:>18} {'-':>8}\n"
          f"{'step path':<10} {sp['tokens_per_s']:>10} "
          f"{1000 * float(sp['decode_s']) / steps:>9.3f} "
          f"{res['overhead_us_per_layer']:>13} "
          f"{res['overhead_us_per_phase']:>13} "
          f"{sp['step_host_us_per_step']:>18} "
          f"{sp['step_retries']:>8}", file=sys.stderr, flush=True)
    return res


def child_cmd(args: argparse.Namespace, address: str, scenario: str,
              prefix: str) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), "--address", address,
            "--device", args.device, "--format", args.format, "--layers",
            str(args.layers), "--steps", str(args.steps), "--scenario",
            scenario, "--prefix", prefix, "--seed", str(args.seed)]


def run_one(name: str, args: argparse.Namespace, address: str,
            daemon: Optional[OwnDaemon],
            device: torch.device) -> Dict[str, object]:
    cfg = config(args)
    w = make_weights(cfg, device)
    out: Dict[str, object] = {"scenario": name, "device": str(device),
                              "format": cfg.main_format,
                              "layers": cfg.layers, "window": cfg.window,
                              "ratios": list(cfg.ratios[:cfg.layers]),
                              "topk": cfg.topk, "graph_mode": False,
                              "path": "per-layer RPCs (regular)"}
    if name in ("basic", "churn", "speed"):
        with kvdepot.connect(address, client_name=f"refworker-{name}") as kv:
            h = scenarios.make(kv, cfg, w, device, prefix=args.prefix + name
                               + ".", check=name != "speed")
            t = time.perf_counter()
            if name == "churn":
                scenarios.churn(h, args.steps, args.seed)
            else:
                scenarios.basic(h, args.steps, args.seed)
            out["wall_s"] = round(time.perf_counter() - t, 2)
            out.update(h.report())
            out["batch"] = 3
            h.worker.close()
        out["passed"] = bool(out["agreement_ok"])
        if name == "speed":
            # Per layer and decode step: the time inside kvdepot calls (the
            # daemon path's cost over computing in-process), and the whole.
            ls = max(int(out["decode_steps"]) * cfg.layers, 1)
            out["rpc_ms_per_layer_step"] = round(
                1000 * float(out["decode_rpc_s"]) / ls, 3)
            out["ms_per_layer_step"] = round(
                1000 * float(out["decode_s"]) / ls, 3)
            out["context_tokens"] = "77/130/261 prompts + 64 steps"
            lib, why = kvd_adapter.kernels_library()
            out["library_mode"] = "available" if lib else why
            # The step path (graph) vs library mode (graph), same batch,
            # context, steps and ratios: tokens/s of both and the step
            # path's overhead per layer and per phase.
            out["step_vs_library"] = step_vs_library(args, address, device)
            if "skipped" not in out["step_vs_library"]:
                out["passed"] = out["passed"] and bool(
                    out["step_vs_library"]["passed"])
        return out
    if name == "step":
        # Decode through the step path (CUDA backend only): fused main and
        # SWA stores, main caches of ratio 1 and of one ratio R > 1
        # (--step_ratios; see stepworker.py).
        if device.type != "cuda":
            return {**out, "passed": True, "skipped": "the CPU backend has "
                    "no step path (RegisterWorker is FAILED_PRECONDITION)"}
        import stepworker
        cfg = step_config(args)
        w = make_weights(cfg, device)
        out.update({"ratios": list(cfg.ratios[:cfg.layers]),
                    "path": f"step path, {args.step_mode}",
                    "graph_mode": args.step_mode == "graph"})
        with kvdepot.connect(address, client_name="refworker-step") as kv:
            h = scenarios.make(kv, cfg, w, device,
                               worker_cls=stepworker.StepPathWorker,
                               prefix=args.prefix + "step.",
                               mode=args.step_mode,
                               pipeline=args.step_pipeline,
                               block_tables=args.step_block_tables,
                               transport=args.step_transport)
            h.lookahead = True   # the batch changes only at the end
            t = time.perf_counter()
            scenarios.basic(h, args.steps, args.seed)
            out["wall_s"] = round(time.perf_counter() - t, 2)
            out.update(h.report())
            out["doorbell"] = h.worker.status()
            out["graph_replays"] = h.worker.replays
            out["step_pipeline"] = args.step_pipeline
            out["step_transport"] = args.step_transport
            out["step_block_tables"] = args.step_block_tables
            out["step_rpcs"] = h.worker.step_rpcs
            out["step_retries"] = h.worker.step_retries
            out["step_host_us_per_step"] = round(
                1e6 * h.worker.step_rpc_s
                / max(int(out["decode_steps"]), 1), 1)
            out["ms_per_layer_step"] = round(1000 * float(out["decode_s"]) / max(
                int(out["decode_steps"]) * cfg.layers, 1), 3)
            h.worker.close()
        out["passed"] = bool(out["agreement_ok"]) and (
            args.step_mode != "graph" or out["graph_replays"] > 0)
        return out
    if name == "library":
        # Daemon mode vs library mode (libmode.py): bit-identical reads,
        # tokens and pools, then both timed.
        import libmode
        import libmode_oracle
        lib, _, why = libmode.kernels()
        if lib is None:
            return {**out, "passed": True, "skipped": why}
        if device.type == "cuda" and not lib.kvdk_has_cuda():
            return {**out, "passed": True, "skipped": "libkvdepot_kernels.so "
                    "was built without CUDA"}
        out["path"] = "per-layer RPCs vs libkvdepot_kernels.so in-process"
        with kvdepot.connect(address, client_name="refworker-library") as kv:
            t = time.perf_counter()
            try:
                out.update(libmode_oracle.run_scenario(
                    kv, cfg, w, device, steps=args.steps, seed=args.seed,
                    prefix=args.prefix + "library.",
                    speed=getattr(args, "library_speed", True)))
                out["passed"] = True
            except libmode_oracle.Mismatch as e:
                out.update({"passed": False, "mismatch": str(e)})
            out["wall_s"] = round(time.perf_counter() - t, 2)
        return out
    if name == "two_workers":
        procs = [subprocess.Popen(child_cmd(args, address, "basic",
                                            f"{args.prefix}w{i}."),
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
                 for i in range(2)]
        results = []
        for p in procs:
            text = p.communicate(timeout=540)[0].decode(errors="replace")
            line = [ln for ln in text.splitlines() if ln.startswith("{")]
            results.append(json.loads(line[-1]) if line else {
                "passed": False, "output": text[-2000:]})
            results[-1]["exit"] = p.returncode
        out["workers"] = results
        out["passed"] = all(r.get("passed") and r["exit"] == 0
                            for r in results)
        return out
    if name == "kill_worker":
        # A worker killed mid-decode: its session ends (companion socket
        # closes), its buffers are released; the daemon and a second
        # client's worker are unaffected.
        victim = subprocess.Popen(child_cmd(args, address, "basic",
                                            f"{args.prefix}victim."),
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        with kvdepot.connect(address, client_name="refworker-survivor") as kv:
            deadline = time.time() + 120
            while time.time() < deadline:
                pools = [p.name for p in kv.list_pools()]
                if f"{args.prefix}victim.basic.idx" in pools:
                    break
                time.sleep(0.2)
            time.sleep(2.0)  # let it get into decode
            before = kv.stats()
            victim.kill()
            victim.wait()
            time.sleep(0.5)
            after = kv.stats()
            sessions_before, sessions_after = before.sessions, after.sessions
            pools_left = sorted(p.name for p in kv.list_pools()
                                if ".victim." in p.name)
            h = scenarios.make(kv, cfg, w, device,
                               prefix=args.prefix + "survivor.")
            scenarios.basic(h, max(args.steps // 2, 16), args.seed + 1)
            out.update(h.report())
            h.worker.close()
        out.update({"victim_exit": victim.returncode,
                    "sessions_before_kill": sessions_before,
                    "sessions_after_kill": sessions_after,
                    "buffers_before_kill": before.buffers,
                    "buffers_after_kill": after.buffers,
                    "victim_pools_after_kill": pools_left})
        # Its session and its buffer (the prefill buffer) are gone; its
        # pools stay (they belong to the uid, not the session).
        out["passed"] = bool(out["agreement_ok"]) and (
            sessions_after == sessions_before - 1) and (
            after.buffers == before.buffers - 1)
        return out
    if name == "kill_daemon":
        if daemon is None:
            return {**out, "passed": True,
                    "skipped": "needs a daemon of its own (no --address)"}
        with kvdepot.connect(address, client_name="refworker-kd",
                             connect_timeout=30.0) as kv:
            h = scenarios.make(kv, cfg, w, device,
                               prefix=args.prefix + "kd.")
            rng_seed = args.seed + 2
            import random
            rng = random.Random(rng_seed)
            for i, n in enumerate((90, 140)):
                h.start(i, scenarios.prompt(rng, cfg, n), args.steps)
            for _ in range(args.steps // 2):
                h.step()
            daemon.kill()
            err = ""
            try:
                h.step()
            except kvdepot.SessionLost as e:
                err = f"{type(e).__name__}: {e}"
            except kvdepot.KVCacheError as e:
                err = f"{type(e).__name__}: {e}"
            daemon.restart()
            h.worker.recover()   # reconnect, pools again, re-prefill
            while h.worker.seqs:
                h.step()
            out.update(h.report())
            out["error_after_kill"] = err
            h.worker.close()
        out["passed"] = bool(out["agreement_ok"]) and err.startswith(
            "SessionLost")
        return out
    raise SystemExit(f"unknown scenario {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--scenario", default="basic",
                    help="one of %s, a comma list, or all" % ",".join(
                        SCENARIOS))
    ap.add_argument("--format", default="DS_MLA_FP8",
                    choices=("DS_MLA_FP8", "V41", "BF16(576)"),
                    help="BF16(576): unquantized pools, a control run")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--address", default="")
    ap.add_argument("--daemon", default=None)
    ap.add_argument("--daemon_flags", default="")
    ap.add_argument("--prefix", default="rw.")
    ap.add_argument("--summary", default="")
    ap.add_argument("--step_mode", default="graph",
                    choices=("eager", "static", "graph"),
                    help="scenario step: eager, static shapes, or static "
                    "captured in a CUDA graph (default)")
    ap.add_argument("--step_transport", default="ring",
                    choices=("unary", "ring"),
                    help="how the step path's Steps travel (stepworker.py): "
                    "a step ring (shared memory, no gRPC call per step; "
                    "the default: 1.74-1.76x library mode's tokens/s on "
                    "the GPU host against 1.29-1.40x unary), or a Step "
                    "call each")
    ap.add_argument("--step_pipeline", default="lookahead",
                    choices=("lookahead", "async", "sync"),
                    help="how the step path sends Steps (stepworker.py): "
                    "step s + 1's sent while step s runs (default), each "
                    "sent without waiting before its step, or each waited "
                    "for before its step")
    ap.add_argument("--step_block_tables", default="device",
                    choices=("device", "inline"),
                    help="the step path's block tables (stepworker.py): "
                    "in the worker's io buffer on the GPU, registered once, "
                    "written by its stream each step (default), or carried "
                    "by every Step")
    ap.add_argument("--step_ratios", default="4,1,4,2",
                    help="the layers' ratios in the step scenarios (step, "
                    "speed's step-vs-library part), repeated over the "
                    "layers: 1 or any R > 1 (at most 8 distinct R > 1)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.device == "cuda" and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"skipped": "CUDA not available"}))
            return 0
        why = kvd_adapter.worker_library_error()
        if why:   # kvdepot.torch maps CUDA memory through it
            print(json.dumps({"skipped": why}))
            return 0
    device = torch.device(args.device)
    names = SCENARIOS if args.scenario == "all" else tuple(
        args.scenario.split(","))
    daemon = None
    address = args.address
    if not address:
        daemon = OwnDaemon(find_daemon(args.daemon),
                           args.daemon_flags.split())
        address = daemon.socket
    results = []
    try:
        for n in names:
            r = run_one(n, args, address, daemon, device)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        if daemon is not None:
            rc = daemon.stop()
            if rc != 0:
                print(f"kvdepotd exited {rc}; log {daemon.log_path}")
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("passed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
