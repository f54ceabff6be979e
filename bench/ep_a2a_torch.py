#!/usr/bin/env python3
"""The torch peer of moefuse's low-latency dispatch + combine (bench/ep_bench.c --ll).

The same exchange through torch.distributed.all_to_all_single: two processes on two GPUs
(torch.multiprocessing, NCCL backend, localhost), DeepSeek-V3's shapes (K = 7168, k = 8
distinct experts a token, uniform over 256 experts, 128 a rank), M tokens a rank (default 128,
decode). Only torch is needed.

Dispatch, as an all-to-all engine does it: x quantized to FP8 (1 x 128 groups: e4m3 codes and
f32 scales, K + 4 K / 128 bytes a row), the counts exchanged with all_to_all_single and read
back to the host (.tolist(): the pipeline's one host sync), the rows exchanged with
all_to_all_single, and placed expert by expert (grouped, as a grouped GEMM reads them).
Combine: the experts' outputs (a fixed tensor: no expert runs) sent back with all_to_all_single
and summed with the top-k weights on the token's rank into a bf16 out. Two ways of sending:
  slot   one row per (token, slot); one output row per slot back, summed at home
         (moefuse's normal mode moves the same rows);
  token  one row per (token, rank holding any of its experts), with the token's local expert
         ids and weights, fanned out to the experts where it lands; each rank sums a token's
         slots it holds and sends one partial row back, summed at home over the ranks
         (moefuse's low-latency mode does this: the like-for-like peer);
each with f32 rows back and with bf16 rows back. Each pipeline is checked once (with y the
dequantized rows it delivered, out must be sum_j w_j dequant(x)), then timed back to back:
a barrier of the ranks, the pipeline, torch.cuda.synchronize; median of --iters.

  NCCL_NVLS_ENABLE=0 python3 bench/ep_a2a_torch.py [--tokens 128] [--iters 200] [--warmup 20]
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

K = 7168
KTOP = 8
W = 2
E = 256
EL = E // W  # experts a rank
G = K // 128  # scale groups a row
ROW = K + 4 * G  # bytes of an FP8 row: codes, then f32 scales
META = 8 * KTOP  # token style: the row's local expert ids (i32) and weights (f32)


def draw(rank, m):
    """Rank `rank`'s tokens: k distinct experts each, uniform over all E; weights; bf16 x."""
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.rand(m, E, generator=g).topk(KTOP, dim=1).indices
    w = 0.02 + torch.randint(0, 1000, (m, KTOP), generator=g).float() / 4000
    x = (torch.randn(m, K, generator=g) * 0.5).to(torch.bfloat16)
    return ids, w, x


def quantize(x):
    """x [M, K] -> [M, ROW] uint8: e4m3 codes with one f32 scale per 1 x 128 group."""
    xf = x.float().view(-1, G, 128)
    s = xf.abs().amax(-1).clamp_min(1e-10) / 448.0
    q = (xf / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8).view(-1, K), s.view(torch.uint8).view(-1, 4 * G)], 1)


def dequant(rows):
    """[R, >= ROW] uint8 rows -> [R, K] f32."""
    codes = rows[:, :K].contiguous().view(torch.float8_e4m3fn).float().view(-1, G, 128)
    scales = rows[:, K:ROW].contiguous().view(torch.float32)
    return (codes * scales.unsqueeze(-1)).view(-1, K)


def counts_of(index, n):
    """How many times each of 0..n-1 occurs in index (no host sync, unlike bincount)."""
    c = torch.zeros(n, dtype=torch.int64, device=index.device)
    return c.scatter_add_(0, index.reshape(-1), torch.ones_like(index.reshape(-1)))


class SlotPipe:
    """One row per (token, slot) out, one output row per slot back."""

    name = "one row per (token, slot) out; one row per slot back, weighted sum at home"

    def __init__(self, ids, w, x, back_dtype):
        self.ids, self.w, self.x, self.dt = ids, w, x, back_dtype
        self.m = x.shape[0]
        self.dev = x.device

    def dispatch(self):
        flat = self.ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert (so by rank), then token, slot
        cnt = counts_of(flat, E)
        rcnt = torch.empty_like(cnt)
        dist.all_to_all_single(rcnt, cnt)  # [W * EL]: rank q's slots for each expert here
        both = torch.cat([cnt.view(W, EL).sum(1), rcnt.view(W, EL).sum(1)]).tolist()
        send, recv_n = both[:W], both[W:]
        rows = quantize(self.x)[order // KTOP]
        r = sum(recv_n)
        recv = torch.empty(r, ROW, dtype=torch.uint8, device=self.dev)
        dist.all_to_all_single(recv, rows, recv_n, send)
        # received by (source rank, expert); grouped by (expert, source rank)
        rc = rcnt.view(W, EL)
        starts = (torch.cumsum(rc.reshape(-1), 0) - rc.reshape(-1)).view(W, EL)
        sizes_t, starts_t = rc.t().reshape(-1), starts.t().reshape(-1)
        dst = torch.cumsum(sizes_t, 0) - sizes_t
        idx = torch.repeat_interleave(starts_t - dst, sizes_t, output_size=r)
        idx = idx + torch.arange(r, device=self.dev)
        return recv[idx], (order, send, recv_n, idx)

    def combine(self, y, st):
        order, send, recv_n, idx = st
        back = torch.empty_like(y)
        back[idx] = y  # back in the order received
        ret = torch.empty(self.m * KTOP, K, dtype=y.dtype, device=self.dev)
        dist.all_to_all_single(ret, back, send, recv_n)
        per_slot = torch.empty_like(ret)
        per_slot[order] = ret
        out = (per_slot.view(self.m, KTOP, K).float() * self.w.unsqueeze(-1)).sum(1)
        return out.to(torch.bfloat16)


class TokenPipe:
    """One row per (token, destination rank) out, fanned out there; one partial row back."""

    name = ("one row per (token, rank) out, fanned out to its experts there; one partial-sum "
            "row per (token, rank) back, summed at home")

    def __init__(self, ids, w, x, back_dtype):
        self.ids, self.w, self.x, self.dt = ids, w, x, back_dtype
        self.m = x.shape[0]
        self.dev = x.device

    def dispatch(self):
        m, dev = self.m, self.dev
        dest = self.ids // EL  # [M, k] the rank of each slot
        mask = torch.zeros(W, m, dtype=torch.bool, device=dev)
        mask[dest.t(), torch.arange(m, device=dev).expand(KTOP, m)] = True  # [W, M]
        cnt = torch.stack([mask.sum(1), counts_of(dest, W)], 1)  # [W, 2]: tokens, slots
        rcnt = torch.empty_like(cnt)
        dist.all_to_all_single(rcnt, cnt)
        both = torch.cat([cnt.reshape(-1), rcnt.reshape(-1)]).tolist()
        send, recv_n = both[0:2 * W:2], both[2 * W::2]
        recv_slots = sum(both[2 * W + 1::2])
        n_send = sum(send)
        at = torch.arange(W * m, device=dev).view(W, m)
        key = torch.where(mask, at, torch.full_like(at, W * m))
        pair = torch.argsort(key.reshape(-1))[:n_send]  # (rank, token), rank-major
        q_of, m_of = pair // m, pair % m
        lid = self.ids[m_of] - (q_of * EL).unsqueeze(1)
        lid = torch.where(dest[m_of] == q_of.unsqueeze(1), lid, torch.full_like(lid, -1))
        lid = lid.to(torch.int32)
        meta = torch.cat([lid.view(torch.uint8), self.w[m_of].contiguous().view(torch.uint8)], 1)
        rows = torch.cat([quantize(self.x)[m_of], meta], 1)
        rt = sum(recv_n)
        recv = torch.empty(rt, ROW + META, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv, rows, recv_n, send)
        rlid = recv[:, ROW:ROW + 4 * KTOP].contiguous().view(torch.int32)
        rw = recv[:, ROW + 4 * KTOP:].contiguous().view(torch.float32)
        # each received row's local slots, expert by expert (then source rank, token, slot)
        k2 = torch.where(rlid >= 0, rlid, torch.full_like(rlid, EL)).reshape(-1)
        slot = torch.argsort(k2, stable=True)[:recv_slots]
        row_of = slot // KTOP
        return recv[row_of, :ROW], (send, recv_n, m_of, row_of, rw.reshape(-1)[slot], rt)

    def combine(self, y, st):
        send, recv_n, m_of, row_of, wslot, rt = st
        partial = torch.zeros(rt, K, dtype=torch.float32, device=self.dev)
        partial.index_add_(0, row_of, y.float() * wslot.unsqueeze(1))
        partial = partial.to(y.dtype)
        ret = torch.empty(m_of.numel(), K, dtype=y.dtype, device=self.dev)
        dist.all_to_all_single(ret, partial, send, recv_n)
        out = torch.zeros(self.m, K, dtype=torch.float32, device=self.dev)
        out.index_add_(0, m_of, ret.float())
        return out.to(torch.bfloat16)


def barrier(flag):
    dist.all_reduce(flag)
    torch.cuda.synchronize()


def slowest(v, dev):
    t = torch.tensor([v], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, args, port):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    kw = dict(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    try:
        dist.init_process_group(device_id=dev, **kw)
    except TypeError:  # torch before 2.3
        dist.init_process_group(**kw)
    ids, w, x = (t.to(dev) for t in draw(rank, args.tokens))
    flag = torch.zeros(1, device=dev)
    if rank == 0:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        print(f"torch peer: M={args.tokens} tokens a rank, K={K}, k={KTOP}, {E} experts over {W} "
              f"ranks, FP8 rows (K + 4K/128 = {ROW} bytes); torch {torch.__version__}, "
              f"NCCL {nccl}, {torch.cuda.get_device_name(dev)}; median of {args.iters} after "
              f"{args.warmup}", flush=True)
    xdq = dequant(quantize(x))
    expect = w.sum(1, keepdim=True) * xdq  # every slot's expert returns the row it got
    for cls in (TokenPipe, SlotPipe):
        for dt in (torch.float32, torch.bfloat16):
            pipe = cls(ids, w, x, dt)
            grouped, st = pipe.dispatch()
            out = pipe.combine(dequant(grouped).to(dt), st).float()
            err = ((out - expect).abs().max() / expect.abs().max()).item()
            ok = err < 2e-2  # bf16 out (and bf16 y): a few 2^-8 roundings
            y = torch.randn(grouped.shape[0], K, device=dev).to(dt)

            def full():
                _, s = pipe.dispatch()
                pipe.combine(y, s)

            def disp():
                pipe.dispatch()

            times = {}
            for label, fn in (("dispatch+combine", full), ("dispatch", disp)):
                ts = []
                for i in range(args.warmup + args.iters):
                    barrier(flag)
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    if i >= args.warmup:
                        ts.append(time.perf_counter() - t0)
                times[label] = slowest(statistics.median(ts), dev)
            bad = slowest(0.0 if ok else 1.0, dev)
            if rank == 0:
                style = "token" if cls is TokenPipe else "slot"
                back = "f32" if dt is torch.float32 else "bf16"
                like = "  [like moefuse LL]" if style == "token" and back == "f32" else ""
                print(f"result: torch a2a M={args.tokens} {style}/{back}: dispatch+combine "
                      f"{times['dispatch+combine'] * 1e6:.1f} us, dispatch alone "
                      f"{times['dispatch'] * 1e6:.1f} us (slowest rank); rows: {cls.name}; "
                      f"{back} rows back; check {'ok' if not bad else 'FAILED'} (rel err "
                      f"{err:.1e}){like}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens a rank (default 128)")
    ap.add_argument("--iters", type=int, default=200, help="timed iterations (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed iterations first")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < W:
        print(f"ep_a2a_torch: needs {W} CUDA devices (found "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})", file=sys.stderr)
        return 77
    if not hasattr(torch, "float8_e4m3fn") or not dist.is_nccl_available():
        print("ep_a2a_torch: needs torch with float8_e4m3fn and NCCL", file=sys.stderr)
        return 77
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=W, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
