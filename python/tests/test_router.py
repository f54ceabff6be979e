"""topk_route against the reference of each model's router, and its defaults against
topk_softmax bit for bit."""

import numpy as np
import pytest

import moefuse
import reference as ref

CASES = {
    # name: (E, k, options)
    "deepseek-v3": (256, 8, dict(scoring="sigmoid", n_group=8, topk_group=4,
                                 renormalize=True, scale=2.5)),
    "deepseek-v2": (160, 6, dict(scoring="softmax", n_group=8, topk_group=3,
                                 group_scoring="max", scale=16.0)),
    "kimi-k2": (384, 8, dict(scoring="sigmoid", renormalize=True, scale=2.827)),
    "gpt-oss": (32, 4, dict(scoring="topk_softmax")),
}


def _clear_rows(rng, M, E):
    # A permutation of a grid a 1/E-th apart: every score differs from the next by far more
    # than its f32 rounding, and so do the group scores.
    return np.stack([rng.permutation(E) for _ in range(M)]).astype(np.float32) * (4.0 / E) - 2.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_models(ctx, rng, name):
    E, k, opt = CASES[name]
    M = 7
    logits = _clear_rows(rng, M, E)
    choice_bias = None
    logit_bias = None
    if name in ("deepseek-v3", "kimi-k2"):
        choice_bias = (rng.permutation(E).astype(np.float32) - E / 2) * np.float32(1e-5)
    if name == "gpt-oss":
        logit_bias = (rng.permutation(E).astype(np.float32) - E / 2) * np.float32(1e-3)
    ids, weights = moefuse.topk_route(logits, k, logit_bias=logit_bias,
                                      choice_bias=choice_bias, ctx=ctx, **opt)
    want_ids, want_w = ref.topk_route(logits, k, logit_bias, choice_bias, **opt)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=(E + 8 + k) * 2.0 ** -23)


def test_defaults_are_topk_softmax(ctx, rng):
    logits = rng.standard_normal((9, 24)).astype(np.float32)
    logits[2, 5] = np.nan
    logits[4, 1] = np.inf
    for renormalize in (False, True):
        a = moefuse.topk_softmax(logits, 5, renormalize=renormalize, ctx=ctx)
        b = moefuse.topk_route(logits, 5, renormalize=renormalize, ctx=ctx)
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1].tobytes() == b[1].tobytes()


def test_refusals_name_the_option(ctx):
    logits = np.zeros((2, 12), dtype=np.float32)
    with pytest.raises(moefuse.InvalidArgumentError, match="n_group"):
        moefuse.topk_route(logits, 2, n_group=5, topk_group=1, ctx=ctx)
    with pytest.raises(moefuse.InvalidArgumentError, match="topk_group"):
        moefuse.topk_route(logits, 2, n_group=4, topk_group=0, ctx=ctx)
    with pytest.raises(moefuse.InvalidArgumentError, match="scoring"):
        moefuse.topk_route(logits, 2, scoring="tanh", ctx=ctx)
    with pytest.raises(moefuse.ShapeError, match="choice_bias"):
        moefuse.topk_route(logits, 2, choice_bias=np.zeros(11, np.float32), ctx=ctx)
