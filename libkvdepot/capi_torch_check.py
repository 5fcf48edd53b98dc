"""Library mode from PyTorch on the GPU host (not a CI test: needs CUDA
torch). libkvdepot_kernels.so through ctypes (kvdepot_kernels.py) on torch
tensors and torch's current stream, the way the Python reference worker
uses it: the CUDA entry points against the CPU ones, byte for byte, for a
DS_MLA_FP8 fused store (norm, interleaved RoPE, cast_back) and a V41 store
+ load, once directly and once replayed from a torch.cuda.graph capture.

    LD_LIBRARY_PATH=gpu_bundle/lib python3 gpu_pack/capi_torch_check.py \\
        gpu_bundle/bin/libkvdepot_kernels.so

Prints one line per check and "capi_torch_check: OK" at the end; exits 1 on
the first difference.
"""

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdepot_kernels as K  # noqa: E402


def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def layout(lib, name, block_size, num_blocks, num_layers):
    h = ctypes.c_void_p()
    K.check(lib, lib.kvdk_layout_create(name, 0, block_size, num_blocks,
                                        num_layers, ctypes.byref(h)))
    info = K.LayoutInfo()
    K.check(lib, lib.kvdk_layout_get_info(h, ctypes.byref(info),
                                          ctypes.sizeof(info)))
    return h, info


def same(what, a, b):
    a = a.cpu().contiguous().view(torch.uint8)
    b = b.cpu().contiguous().view(torch.uint8)
    if not torch.equal(a, b):
        diff = (a != b).nonzero()
        print("%s: DIFFERENT at byte %d" % (what, int(diff[0][0])))
        sys.exit(1)
    print("%s: identical (%d bytes)" % (what, a.numel()))


def fused_params(norm_w, pos, cos_sin, max_pos):
    p = K.FusedParams()
    p.norm_begin, p.norm_end = 0, 512
    p.norm_weight = norm_w.data_ptr()
    p.eps = 1e-6
    p.rope_style = K.KVDK_ROPE_INTERLEAVED
    p.rope_offset, p.rope_dim = 512, 64
    p.positions = pos.data_ptr()
    p.cos_sin = cos_sin.data_ptr()
    p.max_position = max_pos
    p.hadamard_begin, p.hadamard_len = 0, 0
    return p


def main():
    lib = K.load(sys.argv[1])
    assert lib.kvdk_has_cuda() == 1
    torch.manual_seed(501)
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream

    # DS_MLA_FP8 fused store, block_size 64 (FlashMLA's readers).
    h, info = layout(lib, b"DS_MLA_FP8", 64, 16, 2)
    n, max_pos = 50, 4096
    x = torch.randn(n, 576, dtype=torch.bfloat16)
    norm_w = (torch.rand(512) + 0.5).to(torch.bfloat16)
    pos = torch.randint(0, max_pos, (n,), dtype=torch.int64)
    ang = torch.rand(max_pos, 32) * 6.28
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float().contiguous()
    slots = torch.randperm(info.num_slots)[:n].to(torch.int32)
    slots[3] = -1
    pool_h = torch.zeros(info.total_bytes, dtype=torch.uint8)
    cast_h = torch.zeros(n, 576, dtype=torch.bfloat16)
    K.check(lib, lib.kvdk_fused_store_cpu(
        h, ptr(pool_h), info.total_bytes, 1, ptr(x),
        ctypes.byref(fused_params(norm_w, pos, cos_sin, max_pos)),
        ptr(slots), n, ptr(cast_h)))
    xd, nwd, posd, csd, sd = (t.to(dev) for t in (x, norm_w, pos, cos_sin,
                                                  slots))
    pool_d = torch.zeros(info.total_bytes, dtype=torch.uint8, device=dev)
    cast_d = torch.zeros(n, 576, dtype=torch.bfloat16, device=dev)
    ws = torch.empty(lib.kvdk_cuda_workspace_bytes(K.KVDK_OP_FUSED_STORE, n),
                     dtype=torch.uint8, device=dev)
    bad = torch.zeros(1, dtype=torch.int64, device=dev)
    K.check(lib, lib.kvdk_fused_store_cuda(
        h, ptr(pool_d), info.total_bytes, 1, ptr(xd),
        ctypes.byref(fused_params(nwd, posd, csd, max_pos)), ptr(sd), n,
        ptr(cast_d), ptr(ws), ws.numel(), ptr(bad), stream))
    torch.cuda.synchronize()
    same("DS_MLA_FP8 fused store pool", pool_d, pool_h)
    same("DS_MLA_FP8 fused store cast_back", cast_d, cast_h)
    assert int(bad.item()) == 0

    # V41 store + load, captured into a torch CUDA graph.
    h2, info2 = layout(lib, b"V41", 133, 5, 1)
    n2 = 200
    kv = torch.randn(n2, 512, dtype=torch.bfloat16)
    s2 = torch.randperm(info2.num_slots)[:n2].to(torch.int32)
    seg = torch.tensor([[4, 0, 133, 0], [-1, 0, 7, 133], [0, 5, 50, 140]],
                       dtype=torch.int32)
    total_k = 185
    pool2_h = torch.zeros(info2.total_bytes, dtype=torch.uint8)
    out_h = torch.full((total_k, 512), 3, dtype=torch.bfloat16)
    K.check(lib, lib.kvdk_store_cpu(h2, ptr(pool2_h), info2.total_bytes, 0,
                                    ptr(kv), K.KVDK_DTYPE_BF16, ptr(s2), n2))
    K.check(lib, lib.kvdk_load_cpu(h2, ptr(pool2_h), info2.total_bytes, 0,
                                   ptr(seg), 3, total_k, ptr(out_h),
                                   out_h.numel() * 2, None, 0))
    kvd, s2d, segd = kv.to(dev), s2.to(dev), seg.to(dev)
    pool2_d = torch.zeros(info2.total_bytes, dtype=torch.uint8, device=dev)
    out_d = torch.full((total_k, 512), 3, dtype=torch.bfloat16, device=dev)
    ws1 = torch.empty(lib.kvdk_cuda_workspace_bytes(K.KVDK_OP_STORE, n2),
                      dtype=torch.uint8, device=dev)
    ws2 = torch.empty(lib.kvdk_cuda_workspace_bytes(K.KVDK_OP_LOAD, 3),
                      dtype=torch.uint8, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s = torch.cuda.current_stream().cuda_stream
        K.check(lib, lib.kvdk_store_cuda(
            h2, ptr(pool2_d), info2.total_bytes, 0, ptr(kvd),
            K.KVDK_DTYPE_BF16, ptr(s2d), n2, ptr(ws1), ws1.numel(),
            ptr(bad), s))
        K.check(lib, lib.kvdk_load_cuda(
            h2, ptr(pool2_d), info2.total_bytes, 0, ptr(segd), 3, total_k,
            ptr(out_d), out_d.numel() * 2, None, 0, ptr(ws2), ws2.numel(),
            ptr(bad), s))
    graph.replay()
    torch.cuda.synchronize()
    same("V41 store (graph replay) pool", pool2_d, pool2_h)
    same("V41 load (graph replay) rows", out_d, out_h)
    assert int(bad.item()) == 0
    lib.kvdk_layout_destroy(h)
    lib.kvdk_layout_destroy(h2)
    print("capi_torch_check: OK")


if __name__ == "__main__":
    main()
