"""One Qwen3-30B-A3B experts layer (E=128, k=8, K=2048, I=768, bf16, random weights) through
transformers' experts backends, timed in one run: eager, batched_mm, grouped_mm and moefuse
(moefuse.integrations.transformers), at decode (1 token) and prefill (4096 tokens) by default.
Each call is timed back to back (CUDA events over --iters calls, median of --reps) and, where
the backend captures, replayed from a CUDA graph. Usage on the GPU machine:
  MOEFUSE_LIBRARY=build-device/src/libmoefuse.so python3 bench/transformers_experts.py
"""
import argparse
import os
import statistics
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import moefuse.integrations.transformers as mf_transformers  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", default="1,4096")
ap.add_argument("--impls", default="eager,batched_mm,grouped_mm," + mf_transformers.NAME)
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--reps", type=int, default=10)
args = ap.parse_args()

E, K_TOP, HIDDEN, INTER = 128, 8, 2048, 768
dev = "cuda"
config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                     num_experts=E, num_experts_per_tok=K_TOP, hidden_act="silu")
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

torch.manual_seed(0)
experts = modeling_qwen3_moe.Qwen3MoeExperts(config).to(dev, torch.bfloat16)
with torch.no_grad():
    for p in experts.parameters():
        p.normal_(0.0, 0.02)
router = torch.randn(E, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02


def back_to_back_us(fn):
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.iters)
    return statistics.median(times)


def graph_us(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.iters):
            fn()
    return back_to_back_us(graph.replay) / args.iters


print(f"# transformers {transformers.__version__}, torch {torch.__version__}, "
      f"{torch.cuda.get_device_name()}: Qwen3-30B-A3B experts (E={E} k={K_TOP} K={HIDDEN} "
      f"I={INTER}) bf16; us per call, median of {args.reps} runs of {args.iters}")
print("| tokens | backend | back to back, us | graph, us | max abs diff to eager |")
print("| ---: | --- | ---: | ---: | ---: |")
for tokens in (int(t) for t in args.tokens.split(",")):
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
    logits = (x @ router.t()).float()
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), K_TOP, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    reference = None
    for impl in args.impls.split(","):
        config._experts_implementation = impl
        with torch.no_grad():
            def call():
                return experts(x, ids, weights)
            try:
                out = call()
            except Exception as exc:  # a backend this transformers or torch lacks
                print(f"| {tokens} | {impl} | failed: {type(exc).__name__}: {exc} | | |")
                continue
            if impl == "eager":
                reference = out.float()
            diff = "" if reference is None else f"{(out.float() - reference).abs().max().item():.3g}"
            b2b = back_to_back_us(call)
            try:
                graph = f"{graph_us(call):.1f}"
            except Exception as exc:
                graph = f"no capture ({type(exc).__name__})"
        print(f"| {tokens} | {impl} | {b2b:.1f} | {graph} | {diff} |")
