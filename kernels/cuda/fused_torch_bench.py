#!/usr/bin/env python3
"""The fused store's math (SPEC §8) in PyTorch, eager and torch.compile, timed
the way kernels/cuda/fused_benchmark times kvdepot's kernel, for a side by
side in docs/BENCHMARKS.md. Run on the GPU host with its torch (2.11):

  python3 fused_torch_bench.py [--json out.json] [--iters 20]

Configs (the same as fused_benchmark):
  mla         DS_MLA_FP8: RMSNorm on [0, 512), interleaved RoPE on
              [512, 576), 4 tiles of 128 -> e4m3 with power-of-two fp32
              scales, BF16 tail; 656-byte records scattered by slot
  all_stages  V41: RMSNorm on [0, 512), NeoX RoPE on [448, 512), Hadamard
              512 (a matmul with the scaled Sylvester matrix), e4m3 with
              UE8M0 scales per 32; 528-byte records
Byte model (each counted once, as fused_benchmark): per token input 2D +
record + slot 4 + position 8 + cos/sin row 4 rope_dim; once the norm
weights. Bandwidth with the L2 flushed before each timed call; latency at
1..1024 tokens by CUDA-graph replay of both (torch.compile default mode;
a capture failure is reported, not fatal).
Not bit-exact with kvdepot (torch's rsqrt, pow and fp8 casts differ in the
last bit and in the NaN rules); this measures speed only.
"""

import argparse
import json
import math

import torch

D_MLA, D_V41 = 576, 512


def mla(kv, w, cos_sin, pos, pool, slots, eps=1e-6):
    n = kv.shape[0]
    x = kv.float()
    nope = x[:, :512]
    r = torch.rsqrt(nope.pow(2).mean(-1, keepdim=True) + eps)
    nope = nope * r * w.float()
    cs = cos_sin[pos]
    c, s = cs[:, :32], cs[:, 32:]
    pe = x[:, 512:].view(n, 32, 2)
    a, b = pe[..., 0], pe[..., 1]
    pe = torch.stack([a * c - b * s, b * c + a * s], -1).view(n, 64)
    y = torch.cat([nope, pe], 1).bfloat16()
    t = y[:, :512].float().view(n, 4, 128)
    amax = t.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4))))
    q = (t / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(n, 512)
    rec = torch.cat([q, scale.view(n, 4).contiguous().view(torch.uint8),
                     y[:, 512:].contiguous().view(torch.uint8)], 1)
    pool[slots] = rec


def all_stages(kv, w, cos_sin, pos, pool, slots, hmat, eps=1e-6):
    n = kv.shape[0]
    x = kv.float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = x * r * w.float()
    cs = cos_sin[pos]
    c, s = cs[:, :32], cs[:, 32:]
    a, b = x[:, 448:480], x[:, 480:512]
    x = torch.cat([x[:, :448], a * c - b * s, b * c + a * s], 1)
    y = (x @ hmat).bfloat16()
    t = y.float().view(n, 16, 32)
    amax = torch.clamp(t.abs().amax(-1, keepdim=True), min=1e-4)
    e = torch.ceil(torch.log2(amax / 448))
    q = (t * torch.exp2(-e)).to(torch.float8_e4m3fn).view(torch.uint8)
    sf = (e + 127).to(torch.uint8).view(n, 16)
    pool[slots] = torch.cat([q.view(n, 512), sf], 1)


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).cuda()


def make(config, n):
    g = torch.Generator(device="cuda").manual_seed(1408)
    d, rec = (D_MLA, 656) if config == "mla" else (D_V41, 528)
    args = dict(
        kv=torch.randn(n, d, device="cuda", generator=g).bfloat16(),
        w=(0.5 + torch.rand(512, device="cuda", generator=g)).bfloat16(),
        cos_sin=torch.rand(n, 64, device="cuda", generator=g) * 2 - 1,
        pos=torch.arange(n, device="cuda"),
        pool=torch.zeros(n, rec, dtype=torch.uint8, device="cuda"),
        slots=torch.randperm(n, device="cuda", generator=g),
    )
    if config != "mla":
        args["hmat"] = hadamard(512)
    model = n * (2 * d + rec + 4 + 8 + 4 * 64) + 2 * 512
    return args, model


def cold_seconds(fn, iters, flush):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    fn()
    for i in range(iters):
        flush.zero_()
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return sum(s.elapsed_time(e) for s, e in zip(start, end)) / iters * 1e-3


def graph_seconds(fn, launches):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e-3 / (5 * launches)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graph_launches", type=int, default=50)
    opt = ap.parse_args()
    torch.manual_seed(1408)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cold_seconds(lambda: dst.copy_(src), opt.iters, flush)
    copy_bw = 2 * src.numel() / copy_s
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"copy: {copy_bw / 1e9:.1f} GB/s (read + write)\n")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_gbps": copy_bw / 1e9, "bandwidth": [],
           "latency": []}
    fns = {"mla": mla, "all_stages": all_stages}
    print(f"{'config':12} {'mode':8} {'tokens':>8} {'us':>10} {'GB/s':>9} "
          f"{'of copy':>8}")
    for config, f in fns.items():
        compiled = torch.compile(f)
        for n in (1 << 16, 1 << 20):
            args, model = make(config, n)
            for mode, fn in (("eager", f), ("compile", compiled)):
                t = cold_seconds(lambda: fn(**args), opt.iters, flush)
                bw = model / t
                print(f"{config:12} {mode:8} {n:8d} {t * 1e6:10.1f} "
                      f"{bw / 1e9:9.1f} {100 * bw / copy_bw:7.1f}%")
                out["bandwidth"].append(dict(
                    config=config, mode=mode, tokens=n, seconds=t,
                    model_bytes=model, gbps=bw / 1e9,
                    fraction_of_copy=bw / copy_bw))
        for n in (1, 16, 128, 1024):
            args, _ = make(config, n)
            for mode, fn in (("eager", f), ("compile", compiled)):
                try:
                    t = graph_seconds(lambda: fn(**args), opt.graph_launches)
                except Exception as e:  # a compiled graph may refuse capture
                    print(f"{config:12} {mode:8} {n:8d} graph capture failed: "
                          f"{type(e).__name__}")
                    continue
                print(f"{config:12} {mode:8} {n:8d} {t * 1e6:10.2f} us "
                      "(graph replay)")
                out["latency"].append(dict(config=config, mode=mode,
                                           tokens=n, us=t * 1e6))
    if opt.json:
        with open(opt.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
