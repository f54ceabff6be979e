"""topk_softmax against the reference: order, ties, NaN and Inf logits, renormalisation."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import NP_DTYPES


def _distinct_logits(rng, M, E, dtype):
    # Logits a quarter apart: no two probabilities within rounding of each other.
    logits = np.stack([rng.permutation(E) for _ in range(M)]).astype(np.float32) * 0.25 - 4
    return logits.astype(NP_DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(ctx, rng, dtype, renormalize):
    M, E, k = 9, 16, 4
    logits = _distinct_logits(rng, M, E, dtype)
    ids, weights = moefuse.topk_softmax(logits, k, renormalize=renormalize, ctx=ctx)
    want_ids, want_w = ref.topk_softmax(logits, k, renormalize)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6)


def test_ties_nan_and_inf(ctx):
    nan, inf = np.nan, np.inf
    logits = np.array([
        [1.0, 3.0, 3.0, nan, 3.0, -1.0],     # ties to the lower id; NaN ranks last
        [nan, -inf, 2.0, inf, 0.0, inf],     # two +Inf share the probability
        [-inf, nan, -inf, -inf, nan, -inf],  # all numbers -Inf: they share it equally
        [nan, nan, nan, 0.5, nan, nan],
    ], dtype=np.float32)
    ids, weights = moefuse.topk_softmax(logits, 5, ctx=ctx)
    want_ids, want_w = ref.topk_softmax(logits, 5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6)


def test_k_from_given_outputs(ctx, rng):
    logits = _distinct_logits(rng, 3, 8, "f32")
    ids = np.zeros((3, 2), dtype=np.int32)
    weights = np.zeros((3, 2), dtype=np.float32)
    got_ids, got_w = moefuse.topk_softmax(logits, ids=ids, weights=weights, ctx=ctx)
    assert got_ids is ids and got_w is weights
    np.testing.assert_array_equal(ids, ref.topk_softmax(logits, 2)[0])
