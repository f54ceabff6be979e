"""Shared experts from Python: the same bits as the slots written out, and the routed layer
plus a dense MLP against the float64 reference (docs/NUMERICS.md, "MoE")."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import random_input

M, K, I, E, TOPK, S = 5, 64, 32, 5, 2, 1  # the last S of the E experts are shared


def _problem(rng, dtype):
    x = random_input(rng, (M, K), dtype, scale=1.0)
    w1 = random_input(rng, (E, 2 * I, K), dtype, scale=0.2)
    w2 = random_input(rng, (E, K, I), dtype, scale=0.2)
    ids = rng.integers(0, E - S, (M, TOPK)).astype(np.int32)
    ids[1, 1] = E - 1  # a routed id on the shared expert: invalid
    weights = rng.uniform(0.1, 1.0, (M, TOPK)).astype(np.float32)
    gate = rng.uniform(0.0, 1.0, (M,)).astype(np.float32)  # Qwen2-MoE's per-token factor
    return x, w1, w2, ids, weights, gate


def _written_out(ids, weights, gate, scale):
    """The k + S slots as ordinary ones: local ids (-1 invalid) and weights."""
    routed = np.where(ids < E - S, ids, -1).astype(np.int32)
    shared = np.tile(np.arange(E - S, E, dtype=np.int32), (M, 1))
    w_shared = (np.float32(scale) * gate).astype(np.float32)[:, None].repeat(S, axis=1)
    return (np.concatenate([routed, shared], axis=1),
            np.concatenate([weights, w_shared], axis=1).astype(np.float32))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_forward_equals_slots_written_out(ctx, rng, dtype):
    x, w1, w2, ids, weights, gate = _problem(rng, dtype)
    got = moefuse.moe_forward(x, w1, w2, ids, weights, n_shared=S, shared_scale=2.5,
                              shared_weights=gate, ctx=ctx)
    ids2, w2s = _written_out(ids, weights, gate, 2.5)
    want = moefuse.moe_forward(x, w1, w2, ids2, w2s, ctx=ctx)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_gate_and_final_take_the_shared_slots(ctx, rng):
    x, w1, w2, ids, weights, gate = _problem(rng, "f32")
    h = moefuse.moe_gate(x, w1, ids, n_shared=S, ctx=ctx)
    assert h.shape == (M, TOPK + S, I)
    assert np.all(h[1, 1] == 0)  # the routed slot on the shared expert is invalid
    out = moefuse.moe_final(h, w2, ids, weights, n_shared=S, ctx=ctx)  # weight 1 each
    ids2, w2s = _written_out(ids, weights, np.ones(M, np.float32), 1.0)
    # the routed layer plus the shared expert's dense MLP, in float64
    want = ref.moe_final(ref.moe_gate(x, w1, ids2), w2, ids2, w2s)
    assert ref.rel_error(out, want) <= 1e-5


def test_bad_shared_arguments_are_refused(ctx, rng):
    x, w1, w2, ids, weights, gate = _problem(rng, "f32")
    with pytest.raises(moefuse.InvalidArgumentError, match="n_shared"):
        moefuse.moe_forward(x, w1, w2, ids, weights, n_shared=E + 1, ctx=ctx)
    with pytest.raises(moefuse.ShapeError, match="shared_weights"):
        moefuse.moe_forward(x, w1, w2, ids, weights, n_shared=S, shared_weights=gate[:-1],
                            ctx=ctx)
