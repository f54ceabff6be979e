#!/usr/bin/env python3
"""Reads the FP8 decode kernel's timeline (a build with -DMOE_DEC_TRACE, run with
MOEFUSE_DEC_TRACE=PREFIX; src/cuda/moe_fp8_decode_trace.cuh) and prints, per role, the median
time of each step of an item over the blocks, for the first item (which waits for the kernel
before) and for the later ones (the steady state).

    meson setup build-trace -Dnvcc_targets=sm_90a -Dcuda_args=-DMOE_DEC_TRACE
    MOEFUSE_DEC_TRACE=/tmp/q32 build-trace/tools/moefuse bench --backend cuda \\
        --op moe_forward_fp8 --shape M=32,E=128,k=8,K=2048,I=768
    python3 tools/dec_trace.py /tmp/q32.final [--ghz 1.98]

Times are SM clock cycles turned into microseconds at --ghz (the H200's boost clock by
default); a block's stamps share one SM's clock.
"""
import argparse
import os
import re
import statistics
import struct


def trace_layout():
    """The buffer's sizes and the events' numbers, from the header that defines them."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "cuda",
                        "moe_fp8_decode_trace.cuh")
    text = open(path).read()
    names = {k: int(v) for k, v in re.findall(r"#define (DEC_TRACE_\w+) (\d+)", text)}
    body = re.search(r"enum dec_trace_event \{(.*?)\};", text, re.S).group(1)
    value = -1
    for name, expr in re.findall(r"^\s*(DT_\w+)\s*(?:=\s*([^,/\n]+?))?\s*(?:,|$)", body, re.M):
        value = eval(expr, {}, dict(names)) if expr else value + 1
        names[name] = value
    return names


L = trace_layout()
BLOCKS, ITEMS, STAGES = L["DEC_TRACE_BLOCKS"], L["DEC_TRACE_ITEMS"], L["DEC_TRACE_STAGES"]
C_TOP, C_TILE, C_WIN0, C_END, C_EPI, C_FULL = (L["DT_C_TOP"], L["DT_C_TILE"], L["DT_C_WIN0"],
                                               L["DT_C_END"], L["DT_C_EPI"], L["DT_C_FULL"])
P_START, P_TILE, P_EMPTY = L["DT_P_START"], L["DT_P_TILE"], L["DT_P_EMPTY"]
S_START, S_WAIT, S_GOT, S_FREED, S_END = (L["DT_S_START"], L["DT_S_WAIT"], L["DT_S_GOT"],
                                          L["DT_S_FREED"], L["DT_S_END"])
EVENTS = L["DT_EVENTS"]

# (name, from event, to event): the steps of an item, in order
STEPS = [
    ("consumers: loop top -> tile known", C_TOP, C_TILE),
    ("consumers: tile -> first scale window", C_TILE, C_WIN0),
    ("consumers: window -> stage 0 full", C_WIN0, C_FULL),
    ("consumers: stage 0 -> stage 5 full", C_FULL, C_FULL + STAGES - 1),
    ("consumers: stage 5 -> stream end", C_FULL + STAGES - 1, C_END),
    ("consumers: stream end -> epilogue done", C_END, C_EPI),
    ("producer: item start -> tile", P_START, P_TILE),
    ("producer: tile -> stage 0 free", P_TILE, P_EMPTY),
    ("producer: stage 0 -> stage 5 free", P_EMPTY, P_EMPTY + STAGES - 1),
    ("sums: start -> counted", S_START, S_WAIT),
    ("sums: wait for y", S_WAIT, S_GOT),
    ("sums: y -> counted arrivals", S_GOT, S_FREED),
    ("sums: -> top-k sums done", S_FREED, S_END),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--ghz", type=float, default=1.98)
    a = ap.parse_args()
    raw = open(a.file, "rb").read()
    grid, split, clusters, gate = struct.unpack("4i", raw[:16])
    n = BLOCKS * ITEMS * EVENTS
    stamps = struct.unpack("%dQ" % n, raw[16:16 + 8 * n])

    def at(b, i, e):
        return stamps[(b * ITEMS + i) * EVENTS + e]

    print("%s kernel: grid %d, split %d, clusters %d" % ("gate" if gate else "final", grid,
                                                          split, clusters))
    us = lambda cycles: cycles / a.ghz / 1000.0
    for label, items in (("first item", [0]), ("later items", range(1, ITEMS))):
        print("%s (median over blocks, us):" % label)
        for name, e0, e1 in STEPS:
            d = [at(b, i, e1) - at(b, i, e0) for b in range(min(grid, BLOCKS)) for i in items
                 if at(b, i, e0) and at(b, i, e1)]
            if d:
                print("  %-42s %7.2f  (p90 %6.2f, %d)" % (
                    name, us(statistics.median(d)), us(sorted(d)[int(0.9 * (len(d) - 1))]),
                    len(d)))
        period = [at(b, i, C_TOP) - at(b, i - 1, C_TOP) for b in range(min(grid, BLOCKS))
                  for i in items if i > 0 and at(b, i, C_TOP) and at(b, i - 1, C_TOP)]
        if period:
            print("  %-42s %7.2f" % ("consumers: item period", us(statistics.median(period))))


if __name__ == "__main__":
    main()
