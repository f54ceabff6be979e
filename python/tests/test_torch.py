"""torch tensors against PyTorch implementations of the same math (bench/torch_reference.py).

On a machine with a CUDA device and the cuda backend built, every test runs on CUDA
tensors (backend cuda, torch's current stream); everywhere torch is installed, the
same tests run on CPU tensors (backend cpu). Skipped without torch.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import moefuse  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import torch_reference as tref  # noqa: E402


from torch_devices import DEVICES, cuda_ready as _cuda_ready  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # f32 references in f32
    return torch.device(request.param)


@pytest.fixture
def gen(request, device):
    g = torch.Generator(device=device)
    g.manual_seed(sum(request.node.name.encode()))
    return g


def randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def assert_codes_match(q, want):
    """FP8 / int8 codes equal, or one code apart on at most 0.1% (+2) of them, no sign flip."""
    assert q.dtype == want.dtype and q.shape == want.shape
    if q.numel() == 0:
        return
    if q.dtype == tref.FP8:
        a, b = q.view(torch.uint8).int(), want.view(torch.uint8).int()
        zero = ((a & 0x7F) == 0) & ((b & 0x7F) == 0)
        assert torch.all(((a & 0x80) == (b & 0x80)) | zero), "sign flip"
        diff = ((a & 0x7F) - (b & 0x7F)).abs()
    else:
        diff = (q.int() - want.int()).abs()
    assert diff.max().item() <= 1
    assert (diff != 0).sum().item() <= max(2, diff.numel() // 1000)


def assert_scales_match(s, want):
    assert s.dtype == want.dtype and s.shape == want.shape, (s.dtype, s.shape, want.shape)
    if s.dtype == torch.float32:
        torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
    else:
        assert torch.equal(s, want)


def rel_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


# -------------------------------------------------------------- rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout,ue8m0,code", [
    ("row_major", False, tref.FP8), ("column_major", False, tref.FP8),
    ("packed_ue8m0", True, tref.FP8), ("column_major", True, tref.FP8),
    ("row_major", False, torch.int8)])
def test_act_quant(device, gen, dtype, layout, ue8m0, code):
    T, H = 67, 1024
    x = randn(gen, (T, 2 * H), dtype, device, 3.0)
    q, s = moefuse.act_quant(x, scale_layout=layout, ue8m0=ue8m0, dtype=code)
    assert q.device == x.device and s.device == x.device
    want_q, want_s = tref.act_quant(x, layout=layout, ue8m0=ue8m0, dtype=code)
    assert_codes_match(q, want_q)
    assert_scales_match(s, want_s)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_act_quant_strided_with_row_scale(device, gen, activation):
    T, H = 40, 512
    big = randn(gen, (T, 2 * H + 128), torch.bfloat16, device, 2.0)
    x = big[:, 64:64 + 2 * H]                 # padded rows: no copy
    row_scale = torch.rand(T, generator=gen, device=device) + 0.5
    q_mem = torch.zeros(T, H + 32, dtype=tref.FP8, device=device)
    q = q_mem[:, 16:16 + H]
    moefuse.act_quant(x, row_scale=row_scale, activation=activation, group_size=64, out=q)
    want_q, _ = tref.act_quant(x, group=64, activation=activation, row_scale=row_scale)
    assert_codes_match(q, want_q)
    assert torch.all(q_mem[:, :16].view(torch.uint8) == 0)


@pytest.mark.parametrize("zero_tail", [False, True])
def test_act_quant_masked(device, gen, zero_tail):
    E, Tmax, H = 8, 24, 512
    x = randn(gen, (E, Tmax, 2 * H), torch.bfloat16, device, 2.0)
    counts = torch.tensor([0, 24, 5, 30, -2, 17, 1, 23], dtype=torch.int32, device=device)
    expert_scale = (torch.rand(E, generator=gen, device=device) + 0.5).to(torch.bfloat16)
    q = torch.full((E, Tmax, H), 0x33, dtype=torch.uint8, device=device).view(tref.FP8)
    s = torch.full((E, H // 128, Tmax), -1.0, device=device)
    moefuse.act_quant_masked(x, counts, expert_scale=expert_scale, zero_tail=zero_tail,
                             scale_layout="column_major", out=q, scales=s)
    want_q, want_s = tref.act_quant_masked(x, counts, layout="column_major",
                                           expert_scale=expert_scale)
    n = counts.clamp(0, Tmax).tolist()
    for e in range(E):
        assert_codes_match(q[e, :n[e]], want_q[e, :n[e]])
        assert_scales_match(s[e, :, :n[e]], want_s[e, :, :n[e]])
        tail = q[e, n[e]:].view(torch.uint8)
        assert torch.all(tail == (0 if zero_tail else 0x33))
        assert torch.all(s[e, :, n[e]:] == (0.0 if zero_tail else -1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_act_mul(device, gen, dtype):
    x = randn(gen, (33, 2 * 768), dtype, device, 2.0)
    out = moefuse.act_mul(x)
    want = tref.act_mul(x)
    assert out.dtype == dtype
    # Within one ulp of the dtype (torch's silu is x * sigmoid(x), moefuse's g / (1 + e^-g)).
    tol = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("code", [tref.FP8, torch.int8])
def test_quant_and_dequant(device, gen, code):
    x = randn(gen, (19, 2048), torch.bfloat16, device, 30.0)
    q, s = moefuse.quant(x, dtype=code)
    want_q, want_s = tref.quant(x, dtype=code)
    assert_codes_match(q, want_q)
    assert_scales_match(s, want_s)
    back = moefuse.dequant(q, s, dtype=torch.float32)
    torch.testing.assert_close(back, tref.dequant(q, s), rtol=0, atol=0)


# -------------------------------------------------------------- router and MoE


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(device, gen, renormalize):
    M, E, k = 50, 64, 6
    # Logits a quarter apart: no ties within rounding.
    logits = torch.stack([torch.randperm(E, generator=gen, device=device) for _ in range(M)])
    logits = (logits.float() * 0.25 - 8).to(torch.bfloat16)
    ids, weights = moefuse.topk_softmax(logits, k, renormalize=renormalize)
    want_ids, want_w = tref.topk_softmax(logits, k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)


def _moe_problem(gen, device, dtype, M=37, K=256, I=128, E=8, k=2):
    x = randn(gen, (M, K), dtype, device)
    w1 = randn(gen, (E, 2 * I, K), dtype, device, 0.1)
    w2 = randn(gen, (E, K, I), dtype, device, 0.1)
    ids, weights = tref.topk_softmax(torch.randn(M, E, generator=gen, device=device), k)
    return x, w1, w2, ids, weights


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float32, 1e-5)])
def test_moe_forward(device, gen, dtype, tol):
    x, w1, w2, ids, weights = _moe_problem(gen, device, dtype)
    out = moefuse.moe_forward(x, w1, w2, ids, weights)
    want = tref.moe_forward(x, w1, w2, ids, weights, compute=torch.float32)
    assert out.dtype == dtype and rel_error(out, want) <= tol
    eager = tref.moe_forward(x, w1, w2, ids, weights)  # what the bench times
    assert rel_error(eager, want) <= 2 * tol


def test_no_tokens(device, gen):
    """An expert-parallel rank may get no tokens: torch's empty tensors (data_ptr() == 0)."""
    x, w1, w2, ids, weights = _moe_problem(gen, device, torch.bfloat16, M=0)
    assert x.data_ptr() == 0
    out = moefuse.moe_forward(x, w1, w2, ids, weights)
    assert out.shape == (0, x.shape[1]) and out.device == x.device
    q, s = moefuse.act_quant(torch.empty(0, 1024, device=device, dtype=torch.bfloat16))
    assert q.shape == (0, 512) and s.shape == (0, 4)
    back = moefuse.dequant(q, s)  # the empty scales have no data but are given
    assert back.shape == (0, 512) and back.dtype == torch.float32


def test_moe_gate_final_with_bias_map_and_invalid_ids(device, gen):
    x, w1, w2, ids, weights = _moe_problem(gen, device, torch.bfloat16, E=6)
    E_global = 10
    expert_map = torch.tensor([3, -1, 0, 5, -1, 1, 2, -1, 4, -1], dtype=torch.int32,
                              device=device)
    ids = torch.randint(-1, E_global + 1, ids.shape, generator=gen, device=device,
                        dtype=torch.int32)
    b1 = randn(gen, (6, w1.shape[1]), torch.bfloat16, device)
    b2 = randn(gen, (6, w2.shape[1]), torch.bfloat16, device)
    h = moefuse.moe_gate(x, w1, ids, b1=b1, expert_map=expert_map, limit=7.0)
    want_h = tref.moe_gate(x, w1, ids, b1, limit=7.0, expert_map=expert_map)
    assert rel_error(h, want_h) <= 8e-3
    assert torch.all(h[tref.local_ids(ids, 6, expert_map) < 0] == 0)
    y = moefuse.moe_final(h, w2, ids, b2=b2, expert_map=expert_map, reduce=False)
    assert rel_error(y, tref.moe_final(h, w2, ids, b2=b2, expert_map=expert_map,
                                       reduce=False)) <= 8e-3
    out = moefuse.moe_final(h, w2, ids, weights, b2=b2, expert_map=expert_map)
    assert rel_error(out, tref.moe_final(h, w2, ids, weights, b2, expert_map)) <= 8e-3


# -------------------------------------------------------------- CUDA specifics


@pytest.fixture
def cuda():
    if not _cuda_ready():
        pytest.skip("needs a CUDA device and the cuda backend")
    return torch.device("cuda")


def test_runs_on_torchs_current_stream(cuda):
    x = torch.randn(256, 2 * 4096, device=cuda, dtype=torch.bfloat16)
    ctx = moefuse.default_context("cuda", torch.cuda.current_device())
    moefuse.act_mul(x)
    assert ctx.stream == torch.cuda.current_stream().cuda_stream or ctx.stream == 1  # legacy
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2                       # produced on the side stream...
        out = moefuse.act_mul(y)        # ...consumed on it, in order
        assert ctx.stream == side.cuda_stream
        want = tref.act_mul(y)
    side.synchronize()
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("M", [1, 96])  # decode (direct) and routed paths
def test_calls_replay_in_a_cuda_graph(cuda, M):
    """Captured with no eager call before (a fresh context, no scratch yet), replayed after
    the inputs change and after an eager call regrew the context's scratch: same bits as
    eager calls."""
    gen = torch.Generator(device=cuda)
    gen.manual_seed(M)
    x, w1, w2, ids, weights = _moe_problem(gen, cuda, torch.bfloat16, M=M)
    xa = randn(gen, (M, 2 * 512), torch.bfloat16, cuda, 3.0)
    out = torch.empty_like(x)
    q = torch.empty(M, 512, dtype=tref.FP8, device=cuda)
    s = torch.empty(M, 4, dtype=torch.float32, device=cuda)
    with moefuse.Context("cuda") as ctx:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moefuse.moe_forward(x, w1, w2, ids, weights, out=out, ctx=ctx)
            moefuse.act_quant(xa, out=q, scales=s, ctx=ctx)
        for step in range(2):
            graph.replay()
            want = moefuse.moe_forward(x, w1, w2, ids, weights, ctx=ctx)
            want_q, want_s = moefuse.act_quant(xa, ctx=ctx)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), step
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), step
            assert torch.equal(s, want_s), step
            # new inputs, and a large eager call that regrows the context's scratch
            x.copy_(randn(gen, x.shape, torch.bfloat16, cuda))
            xa.copy_(randn(gen, xa.shape, torch.bfloat16, cuda, 3.0))
            ids.copy_(torch.randint(-1, 9, ids.shape, generator=gen, device=cuda,
                                    dtype=torch.int32))
            moefuse.moe_forward(*_moe_problem(gen, cuda, torch.bfloat16, M=2048), ctx=ctx)


def test_cuda_tensors_on_other_backends_are_refused(cuda):
    x = torch.zeros(4, 256, device=cuda)
    with pytest.raises(moefuse.WrongDeviceError, match="x is CUDA memory but the context's "
                                                       "backend is cpu"):
        moefuse.act_mul(x, ctx="cpu")


def test_host_arrays_on_the_cuda_backend_are_staged(cuda):
    x = torch.randn(8, 512)
    out = moefuse.act_mul(x, ctx="cuda")
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, tref.act_mul(x), rtol=1e-6, atol=1e-6)


def test_errors_carry_the_library_message(cuda):
    x = torch.zeros(3, 512, device=cuda)
    q = torch.zeros(3, 255, device=cuda, dtype=tref.FP8)
    with pytest.raises(moefuse.ShapeError, match=r"q has shape \[3, 255\]"):
        moefuse.act_quant(x, out=q)
