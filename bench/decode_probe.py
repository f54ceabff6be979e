"""Times the FP8 MoE layer's steps at decode shapes, one line each, for profiling the decode
kernel: the gate (bf16 x and FP8 x), the final (reduced) and the whole layer, replayed from a
CUDA graph, with the weight bytes each reads and the rate. Usage on the GPU machine:
  MOEFUSE_LIBRARY=build-device/src/libmoefuse.so python3 bench/decode_probe.py [--models ...]
With --once it runs each call once (for ncu) instead of timing."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import moefuse as mf  # noqa: E402

MODELS = {"mixtral": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "deepseek-v3": (256, 8, 7168, 2048)}
ap = argparse.ArgumentParser()
ap.add_argument("--models", default=",".join(MODELS))
ap.add_argument("--Ms", default="1,32")
ap.add_argument("--once", action="store_true")
args = ap.parse_args()
dev = "cuda"
torch.manual_seed(0)


def graph_us(fn, n=10, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]


def e4m3(shape, scale_shape):
    q = (torch.randn(shape, device=dev) * 2).to(torch.float8_e4m3fn)
    return q, torch.rand(scale_shape, device=dev) * 1e-2 + 1e-3


for name in args.models.split(","):
    E, k, K, I = MODELS[name]
    w1, w1s = e4m3((E, 2 * I, K), (E, 2 * I // 128, K // 128))
    w2, w2s = e4m3((E, K, I), (E, K // 128, I // 128))
    for M in [int(m) for m in args.Ms.split(",")]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        xq, xs = mf.quant(x, group_size=128)
        ids = torch.rand(M, E, device=dev).topk(k, dim=1).indices.int()
        wts = torch.softmax(torch.randn(M, k, device=dev), -1)
        hit = int(ids.unique().numel())
        h, hs = mf.moe_gate_fp8(x, w1, w1s, ids)
        out = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
        calls = [
            ("gate bf16 x", hit * 2 * I * K, lambda: mf.moe_gate_fp8(x, w1, w1s, ids, h=h, h_scales=hs)),
            ("gate f8 x", hit * 2 * I * K,
             lambda: mf.moe_gate_fp8(xq, w1, w1s, ids, x_scales=xs, h=h, h_scales=hs)),
            ("final", hit * K * I, lambda: mf.moe_final_fp8(h, hs, w2, w2s, ids, wts, out=out)),
            ("layer bf16 x", hit * 3 * I * K,
             lambda: mf.moe_forward_fp8(x, w1, w1s, w2, w2s, ids, wts, out=out)),
        ]
        for what, nbytes, fn in calls:
            if args.once:
                fn()
                torch.cuda.synchronize()
                continue
            us = graph_us(fn)
            print(f"{name:14s} M={M:<3d} {what:13s} {us:9.1f} us  {nbytes / us / 1e3:8.1f} GB/s", flush=True)
