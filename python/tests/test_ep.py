"""Expert parallelism from Python (moefuse.EpGroup, torch.ops.moefuse.ep_*), without GPUs.

The ctypes structs and prototypes against include/moefuse_ep.h; the arguments the binding
checks and those it hands to the library (whose messages come back); the exchange that passes
the unique id through a torch.distributed group, on its own and over a real gloo group of two
processes, where a CPU context fails on every rank with the library's message; the custom
operators' schemas and fake kernels. test_ep_gpu.py runs the layer on two GPUs.
"""

import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import moefuse
from moefuse import _capi, _capi_ep, _ep_pg, ep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER_DIR = os.path.join(ROOT, "include")
HEADER = os.path.join(HEADER_DIR, "moefuse_ep.h")
DOC = os.path.join(ROOT, "docs", "API.md")
EXAMPLE = os.path.join(ROOT, "python", "examples", "ep_two_gpus.py")
NO_NCCL_ON_CPU = "the cpu backend has no groups over NCCL (they need the cuda backend)"

STRUCTS = {
    "moefuse_ep_unique_id": (_capi_ep.UniqueId, ["bytes"]),
    "moefuse_ep_config": (_capi_ep.Config, ["rank", "world", "num_experts", "expert_owner",
                                            "reserved"]),
    "moefuse_ep_dispatch_options": (_capi_ep.DispatchOptions, ["mode", "quantize", "act",
                                                               "max_tokens", "reserved"]),
}


def _needs_header():
    if not os.path.exists(HEADER):
        pytest.skip("include/moefuse_ep.h is not beside the tests (run from the repository)")


# ---------------------------------------------------------------- the C mirror


def test_struct_layout_matches_the_header(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    _needs_header()
    lines = ["#include <moefuse_ep.h>", "#include <stddef.h>", "#include <stdio.h>",
             "int main(void) {"]
    for cname, (_, fields) in STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        lines += [f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));' for f in fields]
    lines.append('printf("reserved count %zu\\n", sizeof ((moefuse_ep_dispatch_options *)0)'
                 '->reserved / sizeof(uint32_t));')
    for i, mode in enumerate(("NORMAL", "LOW_LATENCY", "MODE_COUNT_")):
        lines.append(f'printf("mode {i} %d\\n", (int)MOEFUSE_EP_{mode});')
    lines.append("return 0; }")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines))
    subprocess.run([cc, "-std=c11", "-I", HEADER_DIR, str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}
    for cname, (struct, fields) in STRUCTS.items():
        assert c[(cname, "sizeof")] == ctypes.sizeof(struct), cname
        for f in fields:
            assert c[(cname, f)] == getattr(struct, f).offset, f"{cname}.{f}"
    assert c[("reserved", "count")] == len(_capi_ep.DispatchOptions().reserved)
    assert [c[("mode", str(i))] for i in range(3)] == [0, 1, len(_capi_ep.MODES)]


def test_struct_sizes_are_those_the_header_implies():
    """The same without a compiler: the fields as the header lists them, C's alignment."""
    ptr = ctypes.sizeof(ctypes.c_void_p)
    assert ctypes.sizeof(_capi_ep.UniqueId) == 128
    owner = -(-12 // ptr) * ptr  # three int32, then the pointer at its alignment
    assert _capi_ep.Config.expert_owner.offset == owner
    assert ctypes.sizeof(_capi_ep.Config) == -(-(owner + ptr + 16) // ptr) * ptr
    quant = ctypes.sizeof(_capi.QuantOptions)  # int64, enum, int32, float, uint32[4]: 40
    d = _capi_ep.DispatchOptions
    assert (d.mode.offset, d.quantize.offset, d.act.offset) == (0, 4, 8)
    assert (d.max_tokens.offset, d.reserved.offset) == (8 + quant, 12 + quant)
    assert len(d().reserved) == 3 and ctypes.sizeof(d) == 24 + quant


def _declared_functions():
    """name -> number of parameters, for each MOEFUSE_API function of moefuse_ep.h."""
    _needs_header()
    text = re.sub(r"/\*.*?\*/", "", open(HEADER, encoding="utf-8").read(), flags=re.S)
    found = {}
    for m in re.finditer(r"MOEFUSE_API\s+[\w\s\*]+?\b(moefuse_ep_\w+)\s*\(([^)]*)\)\s*;", text):
        params = m.group(2).strip()
        found[m.group(1)] = 0 if params in ("", "void") else params.count(",") + 1
    return found


def test_prototypes_match_the_header():
    declared = _declared_functions()
    assert set(declared) == set(_capi_ep.PROTOTYPES)
    for name, count in declared.items():
        assert len(_capi_ep.PROTOTYPES[name][1]) == count, name
    assert _capi_ep.missing is None, _capi_ep.missing  # this library has them all


def test_dispatch_options_carry_every_field():
    opt = ep.dispatch_options("low_latency", True, "column_major", True, 1e-6, 64)
    assert (opt.mode, opt.quantize, opt.max_tokens, list(opt.reserved)) == (1, 1, 64, [0] * 3)
    assert (opt.act.group_size, opt.act.scale_layout, opt.act.ue8m0) == (128, 1, 1)
    assert opt.act.eps == pytest.approx(1e-6)
    assert ep.dispatch_options().mode == 0 and ep.dispatch_options(mode=7).mode == 7  # raw: C's
    with pytest.raises(moefuse.InvalidArgumentError, match="'fast' is not one of 'normal'"):
        ep.dispatch_options("fast")


# ---------------------------------------------------------------- groups on the CPU


def _refused(op):
    return pytest.raises(moefuse.UnsupportedError, match=re.escape(f"{op}: {NO_NCCL_ON_CPU}"))


def test_a_cpu_context_has_no_nccl_groups(cpu):
    with _refused("ep_unique_id_create"):
        moefuse.EpGroup.unique_id(cpu)
    with _refused("ep_group_create"):
        moefuse.EpGroup.create(cpu, bytes(128), 0, 2, 4)
    with _refused("ep_group_adopt"):
        moefuse.EpGroup.adopt("cpu", 0x1000, 0, 2, 4)  # never read: the backend refuses first


@pytest.mark.parametrize("args, message", [
    ((2, 2, 4, None), r"config\.rank is 2; it must be in \[0, world = 2\)"),
    ((0, 0, 4, None), r"config\.world is 0; it must be >= 1"),
    ((0, 3, 4, None), r"4 experts do not split into 3 equal blocks; pass config\.expert_owner"),
    ((0, 2, 4, [0, 5, 1, 1]), r"config\.expert_owner\[1\] is 5; ranks are \[0, 2\)"),
    ((0, 2, 4, np.array([0, 1, 1, -1])), r"config\.expert_owner\[3\] is -1"),
], ids=["rank", "world", "blocks", "owner", "owner-numpy"])
def test_the_config_reaches_the_library(cpu, args, message):
    """Each field of moefuse_ep_config arrives where C reads it: C's own message names it."""
    rank, world, experts, owner = args
    with pytest.raises(moefuse.InvalidArgumentError, match="ep_group_create: " + message):
        moefuse.EpGroup.create(cpu, bytes(128), rank, world, experts, expert_owner=owner)


def test_what_the_binding_checks_itself(cpu):
    with pytest.raises(moefuse.InvalidArgumentError, match="unique_id has 16 bytes"):
        moefuse.EpGroup.create(cpu, bytes(16), 0, 1, 4)
    with pytest.raises(moefuse.InvalidArgumentError, match="expert_owner has 3 entries"):
        moefuse.EpGroup.create(cpu, bytes(128), 0, 2, 4, expert_owner=[0, 1, 1])
    with pytest.raises(moefuse.InvalidArgumentError, match="num_experts is 4294967300"):
        moefuse.EpGroup.create(cpu, bytes(128), 0, 2, 2 ** 32 + 4)
    with pytest.raises(moefuse.NullPointerError, match="ep_group_adopt: nccl_comm is NULL"):
        moefuse.EpGroup.adopt(cpu, 0, 0, 2, 4)
    with pytest.raises(TypeError, match="not list"):
        moefuse.EpGroup.unique_id([0])


def test_contexts_from_devices_are_the_groups_own(cpu):
    assert ep.context_of(cpu) == (cpu, False)
    made, owned = ep.context_of("cpu")
    assert owned and made is not cpu and made.backend == "cpu"
    made.close()


@pytest.fixture
def null_group(cpu):
    """An EpGroup object around a NULL moefuse_ep_group (the CPU makes no real ones): what the
    binding does before C, and C's refusal of a NULL group through each prototype."""
    group = moefuse.EpGroup(cpu, False, ctypes.c_void_p(), 1, 2, (8, None))
    yield group
    group.close()


def test_a_group_is_found_by_id_until_it_is_closed(null_group, cpu):
    assert ep.group_by_id(null_group.id) is null_group
    assert null_group.local_expert_ids() == [4, 5, 6, 7]
    assert "rank 1 of 2" in repr(null_group)
    null_group.close()
    null_group.close()  # twice is fine
    assert null_group.closed and cpu.handle  # the caller's context stays open
    with pytest.raises(moefuse.InvalidArgumentError, match=f"no open moefuse.EpGroup has id "
                                                           f"{null_group.id}"):
        ep.group_by_id(null_group.id)
    with pytest.raises(moefuse.NullPointerError, match="is closed"):
        null_group.local_experts()


def test_local_expert_ids_follow_expert_owner(cpu):
    group = moefuse.EpGroup(cpu, False, ctypes.c_void_p(), 1, 3, (5, [2, 1, 0, 1, 1]))
    assert group.local_expert_ids() == [1, 3, 4]
    group.close()


def test_each_call_reaches_the_library(null_group):
    """Every call goes through its prototype to C, which refuses the NULL group by name."""
    x = np.zeros((2, 128), np.float32)
    ids = np.zeros((2, 1), np.int32)
    w = np.ones((2, 1), np.float32)
    with pytest.raises(TypeError, match="give recv_x, or tmax"):
        null_group.dispatch(x, ids, w)
    with pytest.raises(moefuse.NullPointerError, match="ep_dispatch: group is NULL"):
        null_group.dispatch(x, ids, w, tmax=4, quantize=True)
    y = np.zeros((0, 4, 128), np.float32)
    closed = moefuse.EpHandle(null_group, None, None, None, None, 2, 128, "normal")
    with pytest.raises(moefuse.NullPointerError, match="the EpHandle is closed"):
        null_group.combine(closed, y)
    null = moefuse.EpHandle(null_group, ctypes.c_void_p(), None, None, None, 2, 128, "normal")
    with pytest.raises(moefuse.NullPointerError, match="ep_combine: group is NULL"):
        null_group.combine(null, y)
    with pytest.raises(TypeError, match="EpHandle dispatch returned"):
        null_group.combine(object(), x)
    w1, w2 = np.zeros((4, 256, 128), np.float32), np.zeros((4, 128, 128), np.float32)
    with pytest.raises(moefuse.NullPointerError, match="ep_moe_forward: group is NULL"):
        null_group.moe_forward(x, w1, w2, ids, w)
    s1, s2 = np.ones((4, 2, 1), np.float32), np.ones((4, 1, 1), np.float32)
    with pytest.raises(moefuse.NullPointerError, match="ep_moe_forward_fp8: group is NULL"):
        null_group.moe_forward_fp8(x, w1, s1, w2, s2, ids, w)


# ---------------------------------------------------------------- the id's exchange


def _records(ctxs, placements):
    made = [_ep_pg.local_record(c, r, p) for r, (c, p) in enumerate(zip(ctxs, placements))]
    return [rec for rec, _ in made], [own for _, own in made]


class _FakeCuda:
    """A context that is not a CPU one: rank > 0 makes no id (rank 0 is the real CPU one)."""
    backend = "cuda"


def test_the_record_carries_the_id_whole():
    """An id with zero bytes survives: rank 0's 128 bytes, as they are."""
    uid = bytes(range(128))
    rec = _ep_pg._pack(_ep_pg.OK, 0, 8, _ep_pg.placement_checksum(None), uid, "")
    assert len(rec) == _ep_pg.RECORD_BYTES
    got = _ep_pg.decide(1, None, [rec, _ep_pg._pack(_ep_pg.OK, 0, 8, 0xFFFFFFFF,
                                                    bytes(128), "")])
    assert bytes(got) == uid


def test_every_rank_raises_when_one_refuses(cpu):
    recs, owns = _records([cpu, _FakeCuda()], [(4, None), (4, None)])
    with pytest.raises(moefuse.UnsupportedError, match=re.escape(NO_NCCL_ON_CPU)) as mine:
        _ep_pg.decide(0, owns[0], recs)
    assert "rank 0" not in str(mine.value)  # its own message, as the library wrote it
    with pytest.raises(moefuse.UnsupportedError,
                       match=r"rank 0 refused the group \(ep_unique_id_create: the cpu "
                             r"backend .*\); every rank of the group stops with it"):
        _ep_pg.decide(1, owns[1], recs)


def test_arguments_and_disagreement_come_first(cpu):
    bad = ValueError("expert_owner is nonsense")
    recs, owns = _records([cpu, _FakeCuda()], [(4, None), bad])
    with pytest.raises(ValueError, match="nonsense"):
        _ep_pg.decide(1, owns[1], recs)
    with pytest.raises(moefuse.InvalidArgumentError, match="rank 1 refused its arguments"):
        _ep_pg.decide(0, owns[0], recs)
    recs, owns = _records([cpu, _FakeCuda()], [(4, None), (4, [0, 0, 1, 1])])
    for rank in (0, 1):
        with pytest.raises(moefuse.InvalidArgumentError,
                           match="rank 1: num_experts 4, another expert_owner"):
            _ep_pg.decide(rank, owns[rank], recs)


# ---------------------------------------------------------------- a gloo group of two processes


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# name -> (num_experts, expert_owner) of rank r
GLOO_CASES = {
    "cpu": lambda r: (4, None),
    "disagree": lambda r: (4 + 2 * r, None),
    "bad_owner": lambda r: (4, [0, 1, 0, 1] if r == 0 else [0, 1]),
}


def _gloo_worker(rank, world, port, outdir):
    """One rank: each case's exception (type, status, message), into outdir/rank<r>.json."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    for name, case in GLOO_CASES.items():
        experts, owner = case(rank)
        try:
            moefuse.EpGroup.from_process_group("cpu", experts, expert_owner=owner).close()
            results[name] = ["no error", "", ""]
        except Exception as exc:
            results[name] = [type(exc).__name__, getattr(exc, "status", ""), str(exc)]
    sub = dist.new_group([0, 1])  # an explicit process group
    try:
        moefuse.EpGroup.from_process_group("cpu", 4, process_group=sub)
    except Exception as exc:
        results["subgroup"] = [type(exc).__name__, getattr(exc, "status", ""), str(exc)]
    dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run_ranks(worker, world, outdir, timeout, *args):
    """Spawn `world` processes of worker(rank, world, port, outdir, *args); kill them past
    timeout. Returns each rank's json (None for one that wrote none)."""
    mp = pytest.importorskip("torch.multiprocessing")
    procs = mp.start_processes(worker, args=(world, free_port(), str(outdir)) + args,
                               nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:  # only the processes this test started
                if p.is_alive():
                    p.kill()
            break
    out = []
    for r in range(world):
        path = os.path.join(str(outdir), f"rank{r}.json")
        out.append(json.load(open(path)) if os.path.exists(path) else None)
    return out


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    results = run_ranks(_gloo_worker, 2, tmp_path_factory.mktemp("gloo"), 180)
    assert all(r is not None for r in results), "a rank died or hung (killed after 180 s)"
    return results


def test_gloo_group_on_cpu_contexts_fails_on_every_rank(gloo_results):
    for rank in (0, 1):
        for case in ("cpu", "subgroup"):
            kind, status, message = gloo_results[rank][case]
            assert (kind, status) == ("UnsupportedError", "MOEFUSE_ERR_UNSUPPORTED"), message
            assert NO_NCCL_ON_CPU in message


def test_gloo_ranks_that_disagree_all_fail(gloo_results):
    for rank in (0, 1):
        kind, _, message = gloo_results[rank]["disagree"]
        assert kind == "InvalidArgumentError" and "disagree on the experts' placement" in message
    assert "expert_owner has 2 entries" in gloo_results[1]["bad_owner"][2]
    kind, _, message = gloo_results[0]["bad_owner"]
    assert kind == "InvalidArgumentError" and "rank 1 refused its arguments" in message


def test_from_process_group_needs_torch_distributed():
    dist = pytest.importorskip("torch.distributed", reason="torch is not installed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        moefuse.EpGroup.from_process_group("cpu", 4)


# ---------------------------------------------------------------- torch.ops.moefuse.ep_*


@pytest.fixture
def ops_ep():
    pytest.importorskip("torch", reason="torch is not installed")
    import moefuse.torch_ops  # noqa: F401 - defines torch.ops.moefuse.*, ep_* included
    from moefuse import torch_ops_ep
    return torch_ops_ep


@pytest.mark.parametrize("name", ["ep_moe_forward", "ep_moe_forward_fp8", "ep_dispatch",
                                  "ep_combine"])
def test_ep_schemas_take_the_methods_arguments(ops_ep, name):
    import inspect
    import torch
    assert name in ops_ep.SCHEMAS
    params = inspect.signature(getattr(moefuse.EpGroup, name[3:])).parameters
    schema = getattr(torch.ops.moefuse, name).default._schema
    assert schema.arguments[0].name == "group"
    for arg in schema.arguments[1:]:
        assert arg.name in params or (name, arg.name) == ("ep_combine", "tokens"), arg.name
        if arg.has_default_value():
            assert arg.default_value == params[arg.name].default, arg.name


class _StubGroup:
    """What the fake kernels and ep_combine ask of a group; registered under an id."""

    def __init__(self):
        self.id = -7
        self._op_handles = {}

    def local_experts(self):
        return 4


@pytest.fixture
def stub():
    group = _StubGroup()
    ep._open[group.id] = group
    yield group
    ep._open.pop(group.id, None)


def test_fake_kernels_give_the_results_shapes(ops_ep, stub):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.moefuse
    with FakeTensorMode():
        x = torch.empty(5, 256, dtype=torch.bfloat16)
        ids, w = torch.empty(5, 2, dtype=torch.int32), torch.empty(5, 2)
        rx, rs, rc, h = ops.ep_dispatch(stub.id, x, ids, w, 12)
        assert (rx.shape, rx.dtype, rs.shape) == ((4, 12, 256), torch.bfloat16, (0,))
        assert (rc.shape, rc.dtype, h.shape, h.dtype, h.device.type) == \
            ((4,), torch.int32, (), torch.int64, "cpu")
        rx, rs, _, _ = ops.ep_dispatch(stub.id, x, ids, w, 12, quantize=True,
                                       scale_layout="column_major")
        assert (rx.dtype, rs.shape, rs.dtype) == (torch.float8_e4m3fn, (4, 2, 12), torch.float32)
        out = ops.ep_combine(stub.id, h, torch.empty(4, 12, 256), 5, dtype="bf16")
        assert (out.shape, out.dtype) == ((5, 256), torch.bfloat16)
        w1, w2 = torch.empty(4, 256, 256, dtype=torch.bfloat16), torch.empty(4, 256, 128)
        assert ops.ep_moe_forward(stub.id, x, w1, w2, ids, w).shape == (5, 256)
        f1, f2 = w1.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        s1, s2 = torch.empty(4, 2, 2), torch.empty(4, 2, 1)
        y = ops.ep_moe_forward_fp8(stub.id, x.to(torch.float8_e4m3fn), f1, s1, f2, s2, ids, w,
                                   x_scales=torch.empty(5, 2))
        assert (y.shape, y.dtype) == ((5, 256), torch.bfloat16)


def test_operators_name_open_groups_and_waiting_handles(ops_ep, stub):
    import torch
    x, ids, w = torch.zeros(2, 128), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    with pytest.raises(moefuse.InvalidArgumentError, match="no open moefuse.EpGroup has id 0"):
        torch.ops.moefuse.ep_moe_forward(0, x, torch.zeros(4, 64, 128),
                                         torch.zeros(4, 128, 32), ids, w)
    with pytest.raises(moefuse.InvalidArgumentError, match="has no dispatch handle 3 waiting"):
        torch.ops.moefuse.ep_combine(stub.id, torch.tensor(3), torch.zeros(4, 1, 128), 2)


# ---------------------------------------------------------------- the docs


def _doc_section():
    if not os.path.exists(DOC) or not os.path.exists(EXAMPLE):
        pytest.skip("docs/API.md and python/examples/ are not beside the tests")
    text = open(DOC, encoding="utf-8").read()
    return text.split("## Expert parallelism from Python", 1)[1].split("\n## ")[0]


def test_the_docs_example_is_the_example_script():
    """docs/API.md prints python/examples/ep_two_gpus.py, which test_ep_gpu.py runs."""
    code = re.search(r"```python\n(.*?)```", _doc_section(), re.S).group(1)
    assert code == open(EXAMPLE, encoding="utf-8").read()


def test_the_docs_name_what_the_package_has():
    section = _doc_section()
    for method in set(re.findall(r"group\.(\w+)\(", section)):
        assert hasattr(moefuse.EpGroup, method), method
    for op in set(re.findall(r"torch\.ops\.moefuse\.(\w+)", section)):
        assert op.startswith("ep_") or hasattr(moefuse, op), op
