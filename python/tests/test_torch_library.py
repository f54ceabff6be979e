"""torch.ops.moefuse.*: the custom operators of moefuse.torch_ops.

torch.library.opcheck runs every operator on sample inputs (no tokens among them) on the CPU
and, where there is a device and the cuda backend, on CUDA: schema, fake kernels against the
real ones, and AOT dispatch with dynamic shapes. Small blocks built on the operators compile
with torch.compile(fullgraph=True) without graph breaks and give the eager bits; on CUDA they
are captured in CUDA graphs, eager and compiled, and replayed on new inputs. Skipped without
torch.
"""

import inspect
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from torch._inductor.utils import run_and_get_code  # noqa: E402

import moefuse  # noqa: E402
import moefuse.torch_ops  # noqa: E402, F401 - defines torch.ops.moefuse.*
from moefuse import _fast  # noqa: E402

nn = torch.nn
OPS = torch.ops.moefuse


from torch_devices import DEVICES, cuda_ready as _cuda_ready  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def cuda():
    if not _cuda_ready():
        pytest.skip("needs a CUDA device and the cuda backend")
    return torch.device("cuda")


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def samples(device):
    """(name, args, kwargs) for every operator: options, layouts, M = 0."""
    gen = torch.Generator().manual_seed(13)

    def r(shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    out = []
    for M in (5, 0):
        logits = r((M, 32))
        out += [("topk_softmax", (logits, 4), {}),
                ("topk_softmax", (logits.to(torch.bfloat16), 3), {"renormalize": True}),
                ("topk_route", (logits, 4), dict(scoring="sigmoid", n_group=4, topk_group=2,
                                                 choice_bias=r((32,), torch.float32, 0.01),
                                                 renormalize=True, scale=2.5)),
                ("topk_route", (logits.to(torch.bfloat16), 3),
                 dict(scoring="topk_softmax", logit_bias=r((32,), torch.bfloat16))),
                ("routing_metadata",
                 (torch.randint(-1, 9, (M, 4), generator=gen, dtype=torch.int32).to(device), 8),
                 dict(block_size=16))]
        x = r((M, 512), torch.bfloat16, 3.0)
        row_scale = r((M,)).abs() + 0.5
        out += [("act_quant", (x,), {}),
                ("act_quant", (x,), dict(row_scale=row_scale, activation="gelu", group_size=64,
                                         scale_layout="column_major", ue8m0=True,
                                         scale_dtype="u8")),
                ("act_quant", (x,), dict(scale_layout="packed_ue8m0", ue8m0=True, limit=5.0,
                                         intermediate="bf16", order="up_first")),
                ("act_quant", (x.float(),), dict(dtype="i8", eps=1e-3)),
                ("act_mul", (x,), dict(activation="gelu_tanh", row_scale=row_scale)),
                ("quant", (x,), dict(scale_layout="column_major")),
                ("quant", (x,), dict(dtype="i8", group_size=32))]
        q, s = moefuse.quant(x, ue8m0=True, scale_dtype="u8")
        out += [("dequant", (q, s), {}),  # ue8m0=None: u8 scales are exponents
                ("dequant", tuple(moefuse.quant(x, scale_layout="column_major")),
                 dict(scale_layout="column_major", dtype="bf16"))]
        K, I, E, k = 128, 64, 6, 2
        xm = r((M, K), torch.bfloat16)
        w1, w2 = r((E, 2 * I, K), torch.bfloat16, 0.1), r((E, K, I), torch.bfloat16, 0.1)
        b1, b2 = r((E, 2 * I), torch.bfloat16), r((E, K), torch.float32)
        ids = torch.randint(-1, 9, (M, k), generator=gen, dtype=torch.int32).to(device)
        weights = r((M, k)).abs()
        emap = torch.tensor([3, -1, 0, 5, -1, 1, 2, -1, 4], dtype=torch.int32, device=device)
        h = moefuse.moe_gate(xm, w1, ids, expert_map=emap)
        out += [("moe_gate", (xm, w1, ids), dict(b1=b1, expert_map=emap, limit=4.0)),
                ("moe_gate", (xm, w1, ids.clamp(0, E - 1)), dict(activation="gelu", dtype="f32")),
                ("moe_final", (h, w2, ids, weights), dict(b2=b2, expert_map=emap)),
                ("moe_final", (h, w2, ids), dict(expert_map=emap, reduce=False, dtype="f32")),
                ("moe_forward", (xm, w1, w2, ids, weights), dict(expert_map=emap, b1=b1, b2=b2)),
                ("moe_forward", (xm, w1, w2, ids.clamp(0, E - 1), weights),
                 dict(order="up_first", dtype="bf16"))]
        # shared experts: the last of the E, a slot of every token after its k routed ones
        hs = moefuse.moe_gate(xm, w1, ids.clamp(0, E - 2), n_shared=1)
        out += [("moe_gate", (xm, w1, ids.clamp(0, E - 2)), dict(n_shared=1)),
                ("moe_final", (hs, w2, ids.clamp(0, E - 2), weights),
                 dict(n_shared=1, shared_scale=0.5, shared_weights=r((M,)).abs())),
                ("moe_forward", (xm, w1, w2, ids.clamp(0, E - 2), weights), dict(n_shared=1))]
        out += _fp8_samples(r, xm, ids, weights, emap, M)
    for E in (4, 0):
        x = r((E, 8, 512), torch.bfloat16, 2.0)
        counts = torch.tensor([0, 8, 3, 11][:E], dtype=torch.int32, device=device)
        out += [("act_quant_masked", (x, counts), {}),
                ("act_quant_masked", (x, counts), dict(expert_scale=r((E,)).abs() + 0.5,
                                                       zero_tail=True, scale_layout="column_major",
                                                       row_scale=r((E, 8)).abs()))]
    out += _fp8_masked_samples(r, device)
    return out


FP8 = torch.float8_e4m3fn


def _fp8_weights(r, E, N, D, ue8m0=False):
    """FP8 codes [E, N, D] and one scale per 128 x 128 block (f32, or u8 exponents)."""
    w = r((E, N, D), torch.float32, 0.5).to(FP8)
    blocks = (E, N // 128, D // 128)
    s = r(blocks).abs() * 0.01 + 0.001
    return w, (torch.full(blocks, 120, dtype=torch.uint8, device=w.device) if ue8m0 else s)


def _fp8_samples(r, xm, ids, weights, emap, M):
    K, I, E, k = 128, 128, 6, 2
    w1, w1s = _fp8_weights(r, E, 2 * I, K)
    w2, w2s = _fp8_weights(r, E, K, I, ue8m0=True)
    xq, xs = moefuse.quant(xm, scale_layout="column_major")
    hq, hs = moefuse.quant(r((M * k, I), torch.bfloat16))
    h = hq.reshape(M, k, I)
    b1 = r((E, 2 * I), torch.bfloat16)
    out = [("moe_gate_fp8", (xm, w1, w1s, ids), dict(b1=b1, expert_map=emap, limit=4.0)),
           ("moe_final_fp8", (h, hs, w2, w2s, ids, weights), dict(expert_map=emap)),
           ("moe_final_fp8", (h, hs, w2, w2s, ids), dict(expert_map=emap, reduce=False,
                                                         dtype="f32")),
           ("moe_forward_fp8", (xm, w1, w1s, w2, w2s, ids, weights),
            dict(expert_map=emap, ue8m0=True)),
           ("moe_gate_fp8", (xm, w1, w1s, ids.clamp(0, E - 2)), dict(n_shared=1)),
           ("moe_forward_fp8", (xm, w1, w1s, w2, w2s, ids.clamp(0, E - 2), weights),
            dict(n_shared=1, shared_scale=2.0))]
    if M:  # torch's empty x_scales has data_ptr 0, which the C API reads as "absent"
        out += [("moe_gate_fp8", (xq, w1, w1s, ids.clamp(0, E - 1)),
                 dict(x_scales=xs, scale_layout="column_major", activation="gelu")),
                ("moe_forward_fp8", (xq, w1, w1s, w2, w2s, ids.clamp(0, E - 1), weights),
                 dict(x_scales=xs, scale_layout="column_major", dtype="f32"))]
    return out


def _fp8_masked_samples(r, device):
    E, Tmax, K, I = 3, 8, 128, 128
    w1, w1s = _fp8_weights(r, E, 2 * I, K)
    w2, w2s = _fp8_weights(r, E, K, I)
    x = r((E, Tmax, K), torch.bfloat16, 2.0)
    xq, xs = moefuse.quant(x.reshape(E * Tmax, K), ue8m0=True, scale_dtype="u8")
    counts = torch.tensor([0, 8, 3], dtype=torch.int32, device=device)
    return [("moe_masked_fp8", (x, counts, w1, w1s, w2, w2s), {}),
            ("moe_masked_fp8", (xq.reshape(E, Tmax, K), counts, w1, w1s, w2, w2s),
             dict(x_scales=xs.reshape(E, Tmax, 1), order="up_first", dtype="f32"))]


# Operators the cuda backend refuses for now (MOEFUSE_ERR_UNSUPPORTED): their samples skip there.
NOT_ON_CUDA = set()


def _skip_where_unsupported(name, device):
    if name in NOT_ON_CUDA and torch.device(device).type == "cuda":
        pytest.skip(f"{name} is not on the cuda backend yet")


def _ids(value):
    return value if isinstance(value, str) else ""


SAMPLE_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(samples("cpu"))]


def test_every_operator_is_sampled():
    assert {name for name, _, _ in samples("cpu")} == set(moefuse.torch_ops.SCHEMAS)


@pytest.mark.parametrize("name", moefuse.torch_ops.SCHEMAS)
def test_schemas_take_the_moefuse_functions_arguments(name):
    """Each schema argument is the moefuse function's, with its default where it has one."""
    params = inspect.signature(getattr(moefuse, name)).parameters
    schema = getattr(OPS, name).default._schema
    assert schema.name == f"moefuse::{name}"
    for arg in schema.arguments:
        assert arg.name in params, arg.name
        if arg.has_default_value():
            assert arg.default_value == params[arg.name].default, arg.name
    leftover = set(params) - {a.name for a in schema.arguments}
    assert leftover <= {"out", "scales", "ids", "weights", "h", "h_scales", "ctx"}, leftover


def _tensors(args, kwargs):
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("index", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck(device, index):
    name, args, kwargs = samples(device)[index]
    _skip_where_unsupported(name, device)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if any(t.dtype == torch.float8_e4m3fn for t in _tensors(args, kwargs)):
        # SchemaCheckMode compares inputs with allclose, which has no FP8 kernel: what it
        # checks (no input written, no output aliasing one) is checked for every sample below
        tests = tests[1:]
    torch.library.opcheck(getattr(OPS, name).default, args, kwargs, test_utils=tests)


@pytest.mark.parametrize("index", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_operators_are_the_moefuse_functions(device, index):
    """Same bits as the moefuse function; through the fast path where it is built."""
    name, args, kwargs = samples(device)[index]
    _skip_where_unsupported(name, device)
    inputs = _tensors(args, kwargs)
    saved = [bits(t).clone() for t in inputs]
    before = _fast.call.calls() if _fast.call else 0
    got = getattr(OPS, name)(*args, **kwargs)
    # the FP8 calls, and calls with shared experts, take ctypes only
    if _fast.active() and hasattr(_fast.call, name) and not kwargs.get("n_shared"):
        assert _fast.call.calls() - before == 1, "torch.ops did not take the fast path"
    want = getattr(moefuse, name)(*args, **kwargs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(bits(a), bits(b))
    # functional: no input written, no result sharing memory with an input or another result
    assert all(torch.equal(bits(t), s) for t, s in zip(inputs, saved))
    storages = [t.untyped_storage().data_ptr() for t in got if t.numel()]
    assert len(set(storages)) == len(storages)
    assert not set(storages) & {t.untyped_storage().data_ptr() for t in inputs if t.numel()}


def test_operators_exist_once_moefuse_torch_ops_is_imported():
    code = ("import torch, moefuse; print(hasattr(torch.ops.moefuse, 'act_quant')); "
            "import moefuse.torch_ops; print(hasattr(torch.ops.moefuse, 'act_quant'))")
    where = os.path.dirname(os.path.dirname(os.path.abspath(moefuse.__file__)))
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path},
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]


def test_positional_renormalize():
    logits = torch.randn(4, 16)
    ids, w = OPS.topk_softmax(logits, 3, True)
    want_ids, want_w = moefuse.topk_softmax(logits, 3, renormalize=True)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


# ---------------------------------------------------------------- blocks


class MoEBlock(nn.Module):
    """router -> topk_softmax -> moe_forward."""

    def __init__(self, K=256, I=128, E=8, k=2, dtype=torch.float32):
        super().__init__()
        self.router = nn.Linear(K, E, bias=False, dtype=dtype)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, K, dtype=dtype) * 0.05)
        self.w2 = nn.Parameter(torch.randn(E, K, I, dtype=dtype) * 0.05)
        self.k = k

    def forward(self, x):
        ids, weights = OPS.topk_softmax(self.router(x), self.k, True)
        return OPS.moe_forward(x, self.w1, self.w2, ids, weights)


class SplitMoEBlock(MoEBlock):
    """router -> topk_softmax -> moe_gate -> moe_final."""

    def forward(self, x):
        ids, weights = OPS.topk_softmax(self.router(x), self.k)
        h = OPS.moe_gate(x, self.w1, ids, activation="gelu")
        return OPS.moe_final(h, self.w2, ids, weights)


class GateQuantBlock(nn.Module):
    """gate/up projection -> act_quant (FP8 codes and scales for the next GEMM) -> dequant."""

    def __init__(self, K=256, H=256):
        super().__init__()
        self.gate_up = nn.Linear(K, 2 * H)

    def forward(self, x):
        q, scales = OPS.act_quant(self.gate_up(x), group_size=64, scale_layout="column_major")
        return q, scales, OPS.dequant(q, scales, group_size=64, scale_layout="column_major")


class FP8MoEBlock(nn.Module):
    """router -> topk_softmax -> moe_forward_fp8 on 128 x 128 block-scaled FP8 experts."""

    def __init__(self, K=256, I=128, E=8, k=2):
        super().__init__()
        self.router = nn.Linear(K, E, bias=False)
        for name, shape in (("w1", (E, 2 * I, K)), ("w2", (E, K, I))):
            self.register_buffer(name, (torch.randn(shape) * 0.5).to(FP8))
            blocks = (E, shape[1] // 128, shape[2] // 128)
            self.register_buffer(name + "_scales", torch.rand(blocks) * 0.01 + 0.001)
        self.k = k

    def forward(self, x):
        ids, weights = OPS.topk_softmax(self.router(x), self.k, True)
        return OPS.moe_forward_fp8(x, self.w1, self.w1_scales, self.w2, self.w2_scales, ids,
                                   weights)


BLOCKS = {"moe": MoEBlock, "split_moe": SplitMoEBlock, "gate_quant": GateQuantBlock,
          "fp8_moe": FP8MoEBlock}
BLOCK_OPS = {"moe": {"topk_softmax", "moe_forward"},
             "split_moe": {"topk_softmax", "moe_gate", "moe_final"},
             "gate_quant": {"act_quant", "dequant"},
             "fp8_moe": {"topk_softmax", "moe_forward_fp8"}}


def _block(name, device):
    torch.manual_seed(7)
    return BLOCKS[name]().to(device).requires_grad_(False)


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def assert_same_bits(got, want):
    for a, b in zip(_outputs(got), _outputs(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("block", BLOCKS)
def test_compiled_block_has_no_graph_breaks_and_the_eager_bits(device, block):
    torch._dynamo.reset()
    module = _block(block, device)
    x = torch.randn(7, 256, device=device)
    with torch.no_grad():
        explained = torch._dynamo.explain(module)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, \
            explained.break_reasons
        compiled = torch.compile(module, fullgraph=True)
        got, code = run_and_get_code(compiled, x)
        assert_same_bits(got, module(x))
        called = {op for op in moefuse.torch_ops.SCHEMAS if f"torch.ops.moefuse.{op}." in
                  "".join(code)}  # inductor's code calls the operators themselves
        assert called == BLOCK_OPS[block]
        if block == "moe":  # another M: recompiled with a dynamic M, through the fake kernels
            x = torch.randn(12, 256, device=device)
            assert_same_bits(compiled(x), module(x))
    torch._dynamo.reset()


# ---------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_graph_replays_the_block_on_new_inputs(cuda, block, compiled):
    torch._dynamo.reset()
    module = _block(block, cuda)
    run = torch.compile(module, fullgraph=True) if compiled else module
    static_x = torch.randn(16, 256, device=cuda)
    with torch.no_grad():
        side = torch.cuda.Stream()  # warm up (compile, contexts, scratch) as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run(static_x)
        for _ in range(3):
            x = torch.randn(16, 256, device=cuda)
            static_x.copy_(x)
            graph.replay()
            want = module(x)
            torch.cuda.synchronize()
            assert_same_bits(static_out, want)
    torch._dynamo.reset()
