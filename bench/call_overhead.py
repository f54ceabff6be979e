#!/usr/bin/env python3
"""Host time of one call: the Python binding's paths against the bare C call, on one backend.

For decode-sized work the host, not the device, sets the pace of a call made from Python
without CUDA graphs. This splits that host time: the C library's own (validation, pointer
checks, launches: the C function called through ctypes with structs prepared once) and the
binding's, through each of its paths:
  fast path   moefuse.<op> on torch tensors through the compiled moefuse._fastcall
  ctypes      the same call with the fast path switched off (as MOEFUSE_PY_FASTCALL=0 does)
  torch.ops   torch.ops.moefuse.<op> (import moefuse.torch_ops), functional: it allocates
each with the results given (out=...) and with the results allocated by the call.
Times are host wall clock per call: the variants of a row take turns, 7 runs of --calls calls
each, the median run of each is reported, and the device is drained before each run;
enqueueing is measured, not the device work. On the CPU backend the C column includes the
work itself: OMP_NUM_THREADS=1 keeps it small and steady.

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
import moefuse.torch_ops  # noqa: E402, F401 - torch.ops.moefuse.*
from moefuse import _call, _capi, _fast, _options, _tensors  # noqa: E402

RUNS = 7


def per_call(variants, calls, sync):
    """{name: seconds per call} for variants {name: (path, fn)}, taking turns run by run."""
    times = {name: [] for name in variants}
    for path, fn in variants.values():
        _fast.set_enabled(path == "fast")
        for _ in range(min(20, calls)):
            fn()
    for _ in range(RUNS):
        for name, (path, fn) in variants.items():
            _fast.set_enabled(path == "fast")
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    sync()
    _fast.set_enabled(True)
    return {name: statistics.median(runs) for name, runs in times.items()}


def bare(ctx, fn, operands, build):
    """fn(ctx.handle, *build(structs)) with the structs made once, as the binding makes them."""
    described = [_tensors.describe(a, f"arg{i}") for i, a in enumerate(operands)]
    with _call.Call(ctx, "bare") as call:
        structs = [call.tensor(o) for o in described]
        if any(o.device == _tensors.CUDA for o in described):
            call.run(lambda *a: 0)  # attaches torch's current stream, as the binding does
    args = build(structs)
    return lambda: fn(ctx.handle, *args)


def ref(t):
    return ctypes.byref(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--calls", type=int, default=200, help="calls per run (cuda: keep < 1000, "
                    "the launch queue's depth)")
    ap.add_argument("--moe-calls", type=int, help="moe_forward's calls per run (default: "
                    "--calls on cuda, 2 on cpu, where one call computes for tens of ms)")
    args = ap.parse_args()
    dev = "cuda" if args.backend == "cuda" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ctx = moefuse.default_context(args.backend, 0 if dev == "cuda" else None)
    fast = _fast.active()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"# host time per call, {ctx.device}; torch {torch.__version__}; "
          f"OMP_NUM_THREADS {threads}; fast path: "
          f"{'on' if fast else 'unavailable (' + str(_fast.problem) + ')'}")
    print("| call | results | fast path | ctypes | torch.ops | C alone | fast path - C |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ops = torch.ops.moefuse
    rows = []

    # router: topk_softmax M=1 E=128 k=8
    logits = torch.randn(1, 128, device=dev)
    ids = torch.empty(1, 8, dtype=torch.int32, device=dev)
    w = torch.empty(1, 8, device=dev)
    topk_c = bare(ctx, _capi.lib.moefuse_topk_softmax, [logits, ids, w],
                  lambda t: (ref(t[0]), 0, ref(t[1]), ref(t[2])))
    rows.append(("topk_softmax M=1 E=128 k=8", "given",
                 lambda: moefuse.topk_softmax(logits, 8, ids=ids, weights=w, ctx=ctx),
                 None, topk_c))
    rows.append(("topk_softmax M=1 E=128 k=8", "allocated",
                 lambda: moefuse.topk_softmax(logits, 8, ctx=ctx),
                 lambda: ops.topk_softmax(logits, 8), topk_c))

    # act_quant: x [T, 2H] bf16 -> FP8 codes, groups of 128, H = 2048
    H = 2048
    opt = _capi.ActQuantOptions(act=_options.act("silu", "gate_first", 0.0, None),
                                quant=_options.quant(128, "row_major", False, None))
    for T in (1, 4, 16):
        x = torch.randn(T, 2 * H, device=dev).to(torch.bfloat16)
        q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty(T, H // 128, device=dev)
        c_alone = bare(ctx, _capi.lib.moefuse_act_quant, [x, q, s],
                       lambda t: (ref(t[0]), None, ref(t[1]), ref(t[2]), ref(opt)))
        name = f"act_quant T={T} H={H} bf16 -> f8"
        rows.append((name, "given",
                     lambda x=x, q=q, s=s: moefuse.act_quant(x, out=q, scales=s, ctx=ctx),
                     None, c_alone))
        rows.append((name, "allocated", lambda x=x: moefuse.act_quant(x, ctx=ctx),
                     lambda x=x: ops.act_quant(x), c_alone))

    E, k, K, I = 128, 8, 2048, 768  # Qwen3-30B-A3B, decode
    x = torch.randn(1, K, device=dev).to(torch.bfloat16)
    w1 = torch.randn(E, 2 * I, K, device=dev).to(torch.bfloat16) * 0.02
    w2 = torch.randn(E, K, I, device=dev).to(torch.bfloat16) * 0.02
    tid = torch.randperm(E, device=dev)[:k].to(torch.int32).view(1, k)
    tw = torch.rand(1, k, device=dev)
    out = torch.empty(1, K, dtype=torch.bfloat16, device=dev)
    moe_opt = _options.moe("silu", "gate_first", 0.0)

    def moe_args(t):
        route = _capi.Routing(topk_ids=t[3], topk_weights=t[4], expert_map=_capi.Tensor())
        return (ref(t[0]), ref(t[1]), ref(t[2]), None, None, ref(route), ref(t[5]),
                ref(moe_opt))
    moe_c = bare(ctx, _capi.lib.moefuse_moe_forward, [x, w1, w2, tid, tw, out], moe_args)
    name = "moe_forward Qwen3-30B-A3B M=1"
    moe_calls = args.moe_calls or (args.calls if dev == "cuda" else 2)
    rows.append((name, "given", lambda: moefuse.moe_forward(x, w1, w2, tid, tw, out=out, ctx=ctx),
                 None, moe_c, moe_calls))
    rows.append((name, "allocated", lambda: moefuse.moe_forward(x, w1, w2, tid, tw, ctx=ctx),
                 lambda: ops.moe_forward(x, w1, w2, tid, tw), moe_c, moe_calls))

    def us(seconds):
        return f"{seconds * 1e6:.1f} us" if seconds is not None else "-"

    for name, results, binding, torch_op, c_alone, *calls in rows:
        variants = {"ctypes": ("ctypes", binding), "c": ("ctypes", c_alone)}
        if fast:
            variants["fast"] = ("fast", binding)
        if torch_op is not None:
            variants["torch.ops"] = ("fast", torch_op)
        t = per_call(variants, calls[0] if calls else args.calls, sync)
        share = t["fast"] - t["c"] if fast else None
        print(f"| {name} | {results} | {us(t.get('fast'))} | {us(t['ctypes'])} | "
              f"{us(t.get('torch.ops'))} | {us(t['c'])} | {us(share)} |")


if __name__ == "__main__":
    main()
