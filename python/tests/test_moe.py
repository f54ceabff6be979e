"""moe_gate, moe_final and moe_forward on numpy arrays against the float64 reference."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import NP_DTYPES, random_input

# ||out - ref|| / ||ref|| bounds of docs/NUMERICS.md, "Agreement between backends"
TOLERANCE = {"f32": 1e-5, "bf16": 8e-3, "f16": 2e-3}

M, K, I, E, TOPK = 6, 64, 32, 4, 2


def _problem(rng, dtype, bias=False, E_global=None):
    x = random_input(rng, (M, K), dtype, scale=1.0)
    w1 = random_input(rng, (E, 2 * I, K), dtype, scale=0.2)
    w2 = random_input(rng, (E, K, I), dtype, scale=0.2)
    ids = rng.integers(0, E_global or E, (M, TOPK)).astype(np.int32)
    ids[1, 1] = -1               # an empty slot
    ids[2, 0] = (E_global or E)  # out of range: invalid, never read
    weights = rng.uniform(0.1, 1.0, (M, TOPK)).astype(np.float32)
    b1 = random_input(rng, (E, 2 * I), dtype, 0.5) if bias else None
    b2 = random_input(rng, (E, K), dtype, 0.5) if bias else None
    return x, w1, w2, ids, weights, b1, b2


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("bias", [False, True])
def test_moe_forward(ctx, rng, dtype, bias):
    x, w1, w2, ids, weights, b1, b2 = _problem(rng, dtype, bias)
    out = moefuse.moe_forward(x, w1, w2, ids, weights, b1=b1, b2=b2, ctx=ctx)
    assert out.shape == (M, K) and out.dtype == NP_DTYPES[dtype]
    h = ref.to_dtype(ref.moe_gate(x, w1, ids, b1), dtype)  # h is kept in x's dtype
    want = ref.moe_final(h, w2, ids, weights, b2)
    assert ref.rel_error(out, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("act,order,limit", [("silu", "up_first", 0.0), ("gelu", "gate_first", 0.5),
                                             ("gelu_tanh", "gate_first", 0.0)])
def test_gate_then_final_equals_forward(ctx, rng, act, order, limit):
    x, w1, w2, ids, weights, b1, b2 = _problem(rng, "f32", bias=True)
    h = moefuse.moe_gate(x, w1, ids, b1=b1, activation=act, order=order, limit=limit, ctx=ctx)
    want_h = ref.moe_gate(x, w1, ids, b1, act=act, order=order, limit=limit)
    assert h.shape == (M, TOPK, I)
    assert ref.rel_error(h, want_h) <= TOLERANCE["f32"]
    assert np.all(h[1, 1] == 0) and np.all(h[2, 0] == 0)  # invalid slots give rows of 0
    out = moefuse.moe_final(h, w2, ids, weights, b2=b2, ctx=ctx)
    fwd = moefuse.moe_forward(x, w1, w2, ids, weights, b1=b1, b2=b2, activation=act,
                              order=order, limit=limit, ctx=ctx)
    np.testing.assert_array_equal(out, fwd)  # bit for bit on one backend, as documented


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("order", ["interleaved", "gate_first"])
def test_gpt_oss_experts(ctx, rng, dtype, order):
    """gpt-oss's experts: biases, silu_alpha (1.702), up offset 1, limit 7, w1 and b1 rows
    interleaved (2i gate, 2i + 1 up)."""
    x, w1, w2, ids, weights, b1, b2 = _problem(rng, dtype, bias=True)
    w1 = (np.asarray(w1).astype(np.float32) * 8).astype(NP_DTYPES[dtype])  # gates past 7
    gpt = dict(activation="silu_alpha", alpha=1.702, up_offset=1.0, limit=7.0, order=order)
    h = moefuse.moe_gate(x, w1, ids, b1=b1, ctx=ctx, **gpt)
    want_h = ref.moe_gate(x, w1, ids, b1, act="silu_alpha", order=order, limit=7.0,
                          alpha=1.702, up_offset=1.0)
    assert ref.rel_error(h, want_h) <= TOLERANCE[dtype]
    assert np.all(h[1, 1] == 0) and np.all(h[2, 0] == 0)
    out = moefuse.moe_final(h, w2, ids, weights, b2=b2, ctx=ctx)
    fwd = moefuse.moe_forward(x, w1, w2, ids, weights, b1=b1, b2=b2, ctx=ctx, **gpt)
    np.testing.assert_array_equal(out, fwd)
    want = ref.moe_final(ref.to_dtype(want_h, dtype), w2, ids, weights, b2)
    assert ref.rel_error(fwd, want) <= TOLERANCE[dtype]


def test_gpt_oss_options_refused(ctx, rng):
    x, w1, w2, ids, weights, *_ = _problem(rng, "f32")
    with pytest.raises(moefuse.InvalidArgumentError, match="alpha"):
        moefuse.moe_gate(x, w1, ids, alpha=1.702, ctx=ctx)  # silu takes no alpha
    with pytest.raises(moefuse.InvalidArgumentError, match="up_offset"):
        moefuse.moe_forward(x, w1, w2, ids, weights, up_offset=float("nan"), ctx=ctx)


def test_unreduced_final_and_expert_map(ctx, rng):
    """Expert parallelism: 6 global experts, 4 of them here (in another order), 2 elsewhere."""
    E_global = 6
    x, w1, w2, ids, weights, *_ = _problem(rng, "f32", E_global=E_global)
    expert_map = np.array([2, -1, 0, 3, -1, 1], dtype=np.int32)
    h = moefuse.moe_gate(x, w1, ids, expert_map=expert_map, ctx=ctx)
    np.testing.assert_allclose(h, ref.moe_gate(x, w1, ids, expert_map=expert_map),
                               rtol=1e-5, atol=1e-6)
    y = moefuse.moe_final(h, w2, ids, expert_map=expert_map, reduce=False, ctx=ctx)
    want_y = ref.moe_final(h, w2, ids, expert_map=expert_map, reduce=False)
    assert y.shape == (M, TOPK, K)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    remote = ref.local_experts(ids, E, expert_map) < 0
    assert np.all(y[remote] == 0)
    out = moefuse.moe_forward(x, w1, w2, ids, weights, expert_map=expert_map, ctx=ctx)
    want = ref.moe_final(ref.moe_gate(x, w1, ids, expert_map=expert_map), w2, ids, weights,
                         expert_map=expert_map)
    assert ref.rel_error(out, want) <= TOLERANCE["f32"]


def test_output_dtype_differs_from_input(ctx, rng):
    x, w1, w2, ids, weights, *_ = _problem(rng, "bf16")
    out = moefuse.moe_forward(x, w1, w2, ids, weights, dtype="f32", ctx=ctx)
    assert out.dtype == np.float32
    h = ref.to_dtype(ref.moe_gate(x, w1, ids), "bf16")
    assert ref.rel_error(out, ref.moe_final(h, w2, ids, weights)) <= TOLERANCE["bf16"]
