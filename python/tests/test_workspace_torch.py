"""Torch CUDA calls take their scratch from torch's caching allocator, not from moefuse.

moe_gate, moe_final, moe_forward and act_quant_masked (the calls that can take scratch on CUDA)
ask the library for the exact size, allocate it with torch on the current stream and hand it to
the context for that call: torch counts every byte, and the context never grows scratch of its
own. Checked through the fast path and through ctypes. CUDA only.
"""

import pytest

torch = pytest.importorskip("torch", reason="the workspace comes from torch's allocator")

import moefuse  # noqa: E402
from torch_devices import NEEDS_CUDA  # noqa: E402
from moefuse import _fast  # noqa: E402

pytestmark = NEEDS_CUDA


@pytest.fixture(params=["fast", "ctypes"])
def path(request):
    if request.param == "fast" and _fast.call is None:
        pytest.skip(f"the fast path is not available: {_fast.problem}")
    was = _fast.set_enabled(request.param == "fast")
    yield request.param
    _fast.set_enabled(was)


def _layer(M, E=8, k=2, K=256, I=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, generator=g).to(bf16)
    w1 = (torch.randn(E, 2 * I, K, device=dev, generator=g) * 0.05).to(bf16)
    w2 = (torch.randn(E, K, I, device=dev, generator=g) * 0.05).to(bf16)
    ids = torch.randint(0, E, (M, k), device=dev, generator=g, dtype=torch.int32)
    wts = torch.rand(M, k, device=dev, generator=g)
    return x, w1, w2, ids, wts


def _allocations():
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.parametrize("M", [1, 96])
def test_moe_calls_allocate_their_workspace_with_torch(path, M):
    x, w1, w2, ids, wts = _layer(M)
    out = torch.empty_like(x)
    h = torch.empty(M, 2, 128, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(M, 2, 256, dtype=torch.bfloat16, device="cuda")
    # Decode-sized calls (16 slots or fewer) route nothing: their gate and un-reduced final
    # take no scratch, the whole layer (h) and the reduced final (its counters) still do.
    routed = M * 2 > 16
    calls = [
        ("moe_forward", 1, lambda: moefuse.moe_forward(x, w1, w2, ids, wts, out=out)),
        ("moe_gate", int(routed), lambda: moefuse.moe_gate(x, w1, ids, out=h)),
        ("moe_final", 1, lambda: moefuse.moe_final(h, w2, ids, wts, out=out)),
        ("moe_final un-reduced", int(routed),
         lambda: moefuse.moe_final(h, w2, ids, reduce=False, out=y)),
    ]
    for name, want, call in calls:
        call()  # warm: device tables, kernel attributes
        before = _allocations()
        call()
        # the outputs are given: an allocation is the call's workspace
        assert _allocations() - before == want, name
    before = _allocations()
    moefuse.topk_softmax(torch.randn(M, 8, device="cuda"), 2, ids=ids, weights=wts)
    assert _allocations() - before == 1  # the logits only: topk takes no workspace on CUDA


def test_results_match_the_gate_then_final_path(path):
    x, w1, w2, ids, wts = _layer(64, seed=3)
    whole = moefuse.moe_forward(x, w1, w2, ids, wts)
    h = moefuse.moe_gate(x, w1, ids)
    assert torch.equal(whole, moefuse.moe_final(h, w2, ids, wts))


def test_masked_act_quant_past_4096_experts_takes_torch_scratch(path):
    E, Tmax, H = 5000, 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(E, Tmax, 2 * H, device="cuda", generator=g).to(torch.bfloat16)
    counts = torch.randint(-1, Tmax + 2, (E,), device="cuda", generator=g, dtype=torch.int32)
    q = torch.empty(E, Tmax, H, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(E, Tmax, 1, device="cuda")
    moefuse.act_quant_masked(x, counts, zero_tail=True, out=q, scales=s)
    q0, s0 = q.clone(), s.clone()
    before = _allocations()
    moefuse.act_quant_masked(x, counts, zero_tail=True, out=q, scales=s)
    assert _allocations() - before == 1
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)


def test_a_refused_call_raises_its_own_error_and_leaves_no_workspace(path):
    x, w1, w2, ids, wts = _layer(8)
    bad = torch.empty(8, 2, 127, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(moefuse.ShapeError, match="moe_gate: h has shape"):
        moefuse.moe_gate(x, w1, ids, out=bad)
    # the context is usable and takes torch scratch again
    out = moefuse.moe_forward(x, w1, w2, ids, wts)
    assert torch.isfinite(out.float()).all()


def test_fp8_forward_takes_its_workspace_from_torch(path):
    """The FP8 layer keeps h and its scales in its workspace: one torch allocation a call."""
    x, _, _, ids, wts = _layer(32)
    g = torch.Generator(device="cuda").manual_seed(9)
    E, K, I = 8, 256, 128
    fp8 = torch.float8_e4m3fn
    w1 = (torch.randn(E, 2 * I, K, device="cuda", generator=g) * 0.5).to(fp8)
    w2 = (torch.randn(E, K, I, device="cuda", generator=g) * 0.5).to(fp8)
    w1s = torch.full((E, 2 * I // 128, K // 128), 0.01, device="cuda")
    w2s = torch.full((E, K // 128, I // 128), 0.01, device="cuda")
    out = torch.empty_like(x)
    try:
        moefuse.moe_forward_fp8(x, w1, w1s, w2, w2s, ids, wts, out=out)  # warm
    except moefuse.UnsupportedError as exc:
        pytest.skip(str(exc))
    before = _allocations()
    moefuse.moe_forward_fp8(x, w1, w1s, w2, w2s, ids, wts, out=out)
    assert _allocations() - before == 1
