"""Comparisons with the reference, at the agreement docs/NUMERICS.md allows, and test data."""

import numpy as np

import reference as ref

NP_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": ref.BF16}


def random_input(rng, shape, dtype="f32", scale=2.0):
    """Normal values in a float dtype name."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(NP_DTYPES[dtype])


def codes_of(q):
    """Quantized codes as integers: uint8 bit patterns for FP8, int8 values for i8."""
    q = np.asarray(q)
    return q.view(np.uint8) if q.dtype == ref.FP8 else q.view(np.int8)


def assert_codes_match(got, want, fp8=True):
    """Codes equal, or (an ulp of f32 apart upstream) one code apart on few elements;
    never a sign flip."""
    got = codes_of(got).astype(np.int64)
    want = np.asarray(want).astype(np.int64)
    assert got.shape == want.shape
    if fp8:
        same_sign = (got & 0x80) == (want & 0x80)
        zero = ((got & 0x7F) == 0) & ((want & 0x7F) == 0)
        assert np.all(same_sign | zero), "sign flip"
        diff = np.abs((got & 0x7F) - (want & 0x7F))
    else:
        diff = np.abs(got - want)
    assert diff.max(initial=0) <= 1, f"codes differ by {diff.max()} at {np.argwhere(diff > 1)[:5]}"
    assert np.count_nonzero(diff) <= max(2, diff.size // 1000), \
        f"{np.count_nonzero(diff)} of {diff.size} codes one apart"


def assert_scales_match(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype,
                                                                 want.shape, want.dtype)
    if got.dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)
    else:  # exponents and packed words: exact
        np.testing.assert_array_equal(got, want)


def assert_close_in_dtype(got, want, dtype, slack=0.0):
    """Within one ulp of the output dtype of the reference's f32 `want` rounded once (f32:
    4 ulp, as numpy's expf and the C library's may differ by one), plus an absolute
    `slack` per element for what the reference cannot reproduce to the ulp (erf, tanh)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(ref.to_dtype(want, dtype)).astype(np.float64)
    ulps = {"f32": 4 * 2.0 ** -23, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype]
    tiny = {"f32": 2.0 ** -149, "f16": 2.0 ** -24, "bf16": 2.0 ** -133}[dtype]
    allowed = ulps * 1.01 * np.abs(want) + tiny + slack
    bad = ~((np.abs(got - want) <= allowed) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), (f"{np.count_nonzero(bad)} elements off, e.g. got {got[bad][:4]} "
                           f"want {want[bad][:4]} at {np.argwhere(bad)[:4].tolist()}")


def activation_slack(x, row_scale=None):
    """What an ulp of 1 in (1 + erf) or (1 + tanh) becomes in act(g) * u * row_scale."""
    x = np.asarray(x).astype(np.float64)
    H = x.shape[-1] // 2
    slack = 2.0 ** -21 * np.abs(x[..., :H] * x[..., H:])
    return slack * (np.abs(row_scale)[..., None] if row_scale is not None else 1.0)
