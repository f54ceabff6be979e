#!/usr/bin/env python3
"""Host time of one call: the Python binding against the bare C call, on one backend.

For decode-sized work the host, not the device, sets the pace of a call made from
Python without CUDA graphs. This splits that host time in two: the C library's own
(validation, pointer checks, launches: the C function called through ctypes with
prepared structs) and the binding's (describing tensors, building those structs).
Times are host wall clock per call, medians of 7 runs of --calls calls, with the
device drained before each run; enqueueing is measured, not the device work.

    MOEFUSE_LIBRARY=build/src/libmoefuse.so python3 bench/call_overhead.py [--backend cpu]
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("MOEFUSE_LIBRARY"):  # a build tree: the binding from the same tree
    sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import moefuse  # noqa: E402
from moefuse import _call, _capi, _options, _tensors  # noqa: E402


def per_call(fn, calls, sync):
    for _ in range(20):
        fn()
    runs = []
    for _ in range(7):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls)
    sync()
    return statistics.median(runs)


def bare(ctx, fn, operands, build):
    """fn(ctx.handle, *build(structs)) with the structs made once, as the binding makes them."""
    described = [_tensors.describe(a, f"arg{i}") for i, a in enumerate(operands)]
    with _call.Call(ctx, "bare") as call:
        structs = [call.tensor(o) for o in described]
        if any(o.device == _tensors.CUDA for o in described):
            call.run(lambda *a: 0)  # attaches torch's current stream, as the binding does
    args = build(structs)
    return lambda: fn(ctx.handle, *args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--calls", type=int, default=200, help="calls per run (cuda: keep < 1000, "
                    "the launch queue's depth)")
    args = ap.parse_args()
    dev = "cuda" if args.backend == "cuda" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ctx = moefuse.default_context(args.backend, 0 if dev == "cuda" else None)
    print(f"# host time per call, {ctx.device}; torch {torch.__version__}")
    print("| call | binding | C alone | binding's share |")
    print("| --- | ---: | ---: | ---: |")

    logits = torch.randn(1, 128, device=dev)
    ids = torch.empty(1, 8, dtype=torch.int32, device=dev)
    w = torch.empty(1, 8, device=dev)
    rows = [("topk_softmax M=1 E=128 k=8",
             lambda: moefuse.topk_softmax(logits, 8, ids=ids, weights=w, ctx=ctx),
             bare(ctx, _capi.lib.moefuse_topk_softmax, [logits, ids, w],
                  lambda t: (ctypes.byref(t[0]), 0, ctypes.byref(t[1]), ctypes.byref(t[2]))))]

    E, k, K, I = 128, 8, 2048, 768  # Qwen3-30B-A3B, decode
    x = torch.randn(1, K, device=dev).to(torch.bfloat16)
    w1 = torch.randn(E, 2 * I, K, device=dev).to(torch.bfloat16) * 0.02
    w2 = torch.randn(E, K, I, device=dev).to(torch.bfloat16) * 0.02
    tid = torch.randperm(E, device=dev)[:k].to(torch.int32).view(1, k)
    tw = torch.rand(1, k, device=dev)
    out = torch.empty(1, K, dtype=torch.bfloat16, device=dev)
    opt = _options.moe("silu", "gate_first", 0.0)

    def moe_args(t):
        route = _capi.Routing(topk_ids=t[3], topk_weights=t[4], expert_map=_capi.Tensor())
        return (ctypes.byref(t[0]), ctypes.byref(t[1]), ctypes.byref(t[2]), None, None,
                ctypes.byref(route), ctypes.byref(t[5]), ctypes.byref(opt))
    rows.append(("moe_forward Qwen3-30B-A3B M=1",
                 lambda: moefuse.moe_forward(x, w1, w2, tid, tw, out=out, ctx=ctx),
                 bare(ctx, _capi.lib.moefuse_moe_forward, [x, w1, w2, tid, tw, out], moe_args)))

    for name, binding, c_alone in rows:
        tb, tc = per_call(binding, args.calls, sync), per_call(c_alone, args.calls, sync)
        print(f"| {name} | {tb * 1e6:.1f} us | {tc * 1e6:.1f} us | {(tb - tc) * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
