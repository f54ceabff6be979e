"""Expert parallelism on two GPUs: two processes (torch.multiprocessing), a NCCL process group
on localhost, an EpGroup made from it, against single-process results.

Dispatch and combine are exact on every backend (docs/NUMERICS.md "Expert parallelism"): the
rows each expert receives, their FP8 codes and scales, and the combined sums are compared bit
for bit with what one process computes from every rank's data. The layers agree with the
one-GPU layer over all experts as two calls of different sizes do. Skipped, with the reason,
without torch, without the cuda backend or with fewer than 2 CUDA GPUs.
"""

import os
import subprocess
import sys
import traceback

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import moefuse  # noqa: E402
from test_ep import EXAMPLE, free_port, run_ranks  # noqa: E402


def _why_not():
    if "cuda" not in moefuse.built_backends():
        return f"the cuda backend is not built into {moefuse.library_path}"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "torch.distributed has no NCCL backend"
    count = torch.cuda.device_count()
    return None if count >= 2 else f"needs 2 CUDA GPUs, found {count}"


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

W, E, K, I, k = 2, 8, 256, 128, 2
MS = (12, 17)  # tokens per rank: not the same on both
FP8 = torch.float8_e4m3fn


class Data:
    """Every rank's tokens and routing, and the layer's weights, made alike on every rank (CPU,
    one seed); some slots are invalid (-1)."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(7)
        self.x, self.ids, self.w = [], [], []
        for M in MS:
            self.x.append(torch.randn(M, K, generator=g).to(torch.bfloat16))
            ids = torch.rand(M, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
            ids[::5, -1] = -1
            self.ids.append(ids)
            self.w.append(torch.rand(M, k, generator=g))
        self.w1 = (torch.randn(E, 2 * I, K, generator=g) * 0.05).to(torch.bfloat16).to(device)
        self.w2 = (torch.randn(E, K, I, generator=g) * 0.05).to(torch.bfloat16).to(device)
        self.f1 = (torch.randn(E, 2 * I, K, generator=g) * 0.5).to(FP8).to(device)
        self.f2 = (torch.randn(E, K, I, generator=g) * 0.5).to(FP8).to(device)
        self.s1 = (torch.rand(E, 2 * I // 128, K // 128, generator=g) * 3e-3 + 1e-3).to(device)
        self.s2 = (torch.rand(E, K // 128, I // 128, generator=g) * 3e-3 + 1e-3).to(device)

    def mine(self, rank, device):
        return self.x[rank].to(device), self.ids[rank].to(device), self.w[rank].to(device)

    def rows_of(self, gid, rows):
        """rows[s][m] for the slots of expert gid: by source rank, token, slot."""
        return [rows[s][m] for s in range(W) for m in range(MS[s]) for j in range(k)
                if self.ids[s][m, j] == gid]

    def combined(self, rank, owner_sums=False):
        """out of combine for y = recv_x * (global id + 1) in f32: the weighted slots summed in
        order from 0 in f32; owner_sums (low-latency): summed per owner rank first, then those
        sums in rank order."""
        x, ids, w = self.x[rank].float(), self.ids[rank], self.w[rank]
        per_rank = [torch.zeros_like(x) for _ in range(W if owner_sums else 1)]
        for j in range(k):
            valid = (ids[:, j] >= 0)[:, None]
            term = w[:, j:j + 1] * (x * (ids[:, j] + 1).float()[:, None])
            for p, acc in enumerate(per_rank):
                mask = valid & ((ids[:, j] // (E // W) == p)[:, None] if owner_sums else True)
                acc.copy_(torch.where(mask, acc + term, acc))
        total = torch.zeros_like(x)
        for acc in per_rank:
            total = total + acc
        return total


def bits(t):
    t = t.cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), f"{what}: not the same bits"


def close(got, want, what, tol):
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error < tol, f"{what}: relative error {error:.2e} against one GPU (over {tol})"


def _factors(group, device):
    """[E_local] f32: global id + 1 of each local expert, the experts' stand-in for combine."""
    return torch.tensor([g + 1 for g in group.local_expert_ids()], dtype=torch.float32,
                        device=device)


def _scaled(group, recv_x, device, factors=None):
    factors = _factors(group, device) if factors is None else factors
    return recv_x.float() * factors[:, None, None]


def _check_rows(group, data, h, rows=None):
    for e, gid in enumerate(group.local_expert_ids()):
        want = data.rows_of(gid, rows or data.x)
        count = int(h.recv_counts[e])
        assert count == len(want), (gid, count, len(want))
        if want:
            same_bits(h.recv_x[e, :count], torch.stack(want), f"expert {gid}'s rows")


# Each check makes its collective calls first and compares after, so that a failed comparison
# on one rank leaves no rank waiting in a collective.

def check_dispatch_rows(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    h = group.dispatch(x, ids, w, tmax=sum(MS))
    torch.cuda.synchronize()
    assert h.recv_scales is None and h.recv_x.dtype == torch.bfloat16
    _check_rows(group, data, h)


def check_combine_sum(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    with group.dispatch(x, ids, w, tmax=sum(MS)) as h:
        y = _scaled(group, h.recv_x, device)
        out = group.combine(h, y)
        out_bf16 = group.combine(h, y, dtype="bf16")
    want = data.combined(rank)
    same_bits(out, want, "combine f32")
    same_bits(out_bf16, want.to(torch.bfloat16), "combine bf16")


def check_dispatch_quantize(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    h = group.dispatch(x, ids, w, tmax=sum(MS), quantize=True)
    quantized = [moefuse.quant(xs.to(device)) for xs in data.x]  # as each sender quantizes
    torch.cuda.synchronize()
    codes = [q.cpu() for q, _ in quantized]
    scales = [s.cpu() for _, s in quantized]
    _check_rows(group, data, h, codes)
    for e, gid in enumerate(group.local_expert_ids()):
        want = data.rows_of(gid, scales)
        if want:
            same_bits(h.recv_scales[e, :len(want)], torch.stack(want), f"expert {gid}'s scales")


def _experts(data, group, *names):
    mine = group.local_expert_ids()
    return [getattr(data, n)[mine] for n in names]


def check_layer_bf16(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    out = group.moe_forward(x, *_experts(data, group, "w1", "w2"), ids, w)
    close(out, moefuse.moe_forward(x, data.w1, data.w2, ids, w), "moe_forward", 1e-2)


def check_layer_fp8(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    out = group.moe_forward_fp8(x, *_experts(data, group, "f1", "s1", "f2", "s2"), ids, w)
    want = moefuse.moe_forward_fp8(x, data.f1, data.s1, data.f2, data.s2, ids, w)
    close(out, want, "moe_forward_fp8", 2e-2)


def check_steps_fp8(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    experts = _experts(data, group, "f1", "s1", "f2", "s2")
    with group.dispatch(x, ids, w, tmax=sum(MS), quantize=True) as h:
        y = moefuse.moe_masked_fp8(h.recv_x, h.recv_counts, *experts, x_scales=h.recv_scales)
        out = group.combine(h, y)
    want = moefuse.moe_forward_fp8(x, data.f1, data.s1, data.f2, data.s2, ids, w)
    close(out, want, "dispatch, moe_masked_fp8, combine", 2e-2)


def check_torch_ops(group, data, rank, device):
    ops = torch.ops.moefuse
    x, ids, w = data.mine(rank, device)
    experts = _experts(data, group, "f1", "s1", "f2", "s2")
    out_op = ops.ep_moe_forward_fp8(group.id, x, *experts, ids, w)
    out = group.moe_forward_fp8(x, *experts, ids, w)
    recv_x, recv_scales, counts, handle = ops.ep_dispatch(group.id, x, ids, w, sum(MS))
    y = _scaled(group, recv_x, device)
    combined = ops.ep_combine(group.id, handle, y, MS[rank])
    same_bits(out_op, out, "ep_moe_forward_fp8 against the method")
    assert recv_scales.numel() == 0 and not group._op_handles  # consumed by ep_combine
    same_bits(combined, data.combined(rank), "ep_dispatch, ep_combine")


def _low_latency(group, device, x, ids, w, recv_x, counts, out, factors):
    h = group.dispatch(x, ids, w, recv_x, counts, mode="low_latency", max_tokens=max(MS))
    group.combine(h, _scaled(group, recv_x, device, factors), out)
    return h


def _ll_buffers(group, rank, device):
    E_local = group.local_experts()
    return (torch.zeros(E_local, W * max(MS), K, dtype=torch.bfloat16, device=device),
            torch.zeros(E_local, dtype=torch.int32, device=device),
            torch.empty(MS[rank], K, device=device))


def check_low_latency(group, data, rank, device):
    x, ids, w = data.mine(rank, device)
    recv_x, counts, out = _ll_buffers(group, rank, device)
    h = _low_latency(group, device, x, ids, w, recv_x, counts, out, _factors(group, device))
    torch.cuda.synchronize()
    assert h.mode == "low_latency"
    _check_rows(group, data, h)  # the same rows in the same places as the normal mode
    same_bits(out, data.combined(rank, owner_sums=True), "low-latency combine")


def check_low_latency_graph(group, data, rank, device):
    """Dispatch and combine captured in a CUDA graph, replayed on other tokens."""
    x, ids, w = (t.clone() for t in data.mine(rank, device))
    recv_x, counts, out = _ll_buffers(group, rank, device)
    args = (group, device, x, ids, w, recv_x, counts, out, _factors(group, device))
    _low_latency(*args)  # outside the capture: sizes the group's memory
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kept = _low_latency(*args)
    original = data.x
    try:
        for trial in range(2):
            data.x = [t * (2 + trial) for t in original]  # exact in bf16
            x.copy_(data.x[rank].to(device))
            graph.replay()
            torch.cuda.synchronize()
            same_bits(out, data.combined(rank, owner_sums=True), f"replay {trial}")
    finally:
        data.x = original
        kept.close()


CHECKS = [name[len("check_"):] for name in list(globals()) if name.startswith("check_")]


def _worker(rank, world, port, outdir):
    """One rank: every check's outcome ("ok", "unsupported: ...", or "FAIL" and the
    traceback) into outdir/rank<r>.json, written after each check."""
    import json
    import torch.distributed as dist
    import moefuse.torch_ops  # noqa: F401 - torch.ops.moefuse.ep_*
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results, path = {}, os.path.join(outdir, f"rank{rank}.json")

    def run(name, fn):
        try:
            value = fn()
            results[name] = "ok"
        except moefuse.UnsupportedError as exc:
            value, results[name] = None, f"unsupported: {exc}"
        except Exception:
            value, results[name] = None, "FAIL\n" + traceback.format_exc()
        with open(path, "w") as f:
            json.dump(results, f)
        return value

    group = run("group", lambda: moefuse.EpGroup.from_process_group(device, E))
    if group is not None:
        data = Data(device)
        for name in CHECKS:
            run(name, lambda: globals()["check_" + name](group, data, rank, device))
        group.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, W, tmp_path_factory.mktemp("ep_gpu"), 420)


@pytest.mark.parametrize("check", ["group"] + CHECKS)
def test_two_gpus(results, check):
    for rank, got in enumerate(results):
        if got is None or check not in got:
            pytest.fail(f"rank {rank} did not finish {check!r} (it hung in a collective or "
                        f"died, and was killed after 420 s; the checks before it: "
                        f"{sorted(got or {})})")
        if got[check].startswith("unsupported"):
            pytest.skip(f"rank {rank}: {got[check]}")
        assert got[check] == "ok", f"rank {rank}: {got[check]}"


def test_the_example_script_runs():
    """python/examples/ep_two_gpus.py (printed in docs/API.md) as a user runs it."""
    if not os.path.exists(EXAMPLE):
        pytest.skip("python/examples/ is not beside the tests")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the moefuse under test
    run = subprocess.run([sys.executable, EXAMPLE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(W):
        assert run.stdout.count(f"rank {rank}: ") == 3, run.stdout
