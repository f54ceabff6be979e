"""moe_gate_fp8, moe_final_fp8, moe_forward_fp8 and moe_masked_fp8 on numpy arrays against the
model of docs/NUMERICS.md "FP8 MoE" (reference_fp8.py), and the refusals. Torch inputs:
test_moe_fp8_torch.py."""

import numpy as np
import pytest

import moefuse
import reference as ref
import reference_fp8 as fp8
from checks import assert_codes_match, assert_scales_match, codes_of, random_input

M, K, I, E, TOPK = 6, 256, 256, 4, 2  # two 128-deep blocks in each GEMM


def run(ctx, fn, *args, **kwargs):
    """fn(...) on ctx; a backend other than the CPU (the reference one) that has no FP8 MoE yet
    is skipped, with the library's message."""
    try:
        return fn(*args, ctx=ctx, **kwargs)
    except moefuse.UnsupportedError as exc:
        if ctx.backend == "cpu":
            raise
        pytest.skip(str(exc))


def fp8_weights(rng, shape, u8_scales=False):
    """Codes of normal values, and one scale per 128 x 128 block (f32, or u8 exponents)."""
    w = (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(ref.FP8)
    blocks = (shape[0], shape[1] // 128, shape[2] // 128)
    if u8_scales:
        return w, rng.integers(118, 124, blocks).astype(np.uint8)  # 2^-9 .. 2^-4
    return w, rng.uniform(0.005, 0.05, blocks).astype(np.float32)


def problem(rng, u8_weights=False, bias=False):
    x = random_input(rng, (M, K), "bf16", scale=1.0)
    w1, w1s = fp8_weights(rng, (E, 2 * I, K), u8_weights)
    w2, w2s = fp8_weights(rng, (E, K, I), u8_weights)
    ids = rng.integers(0, E, (M, TOPK)).astype(np.int32)
    ids[1, 1] = -1  # an empty slot
    ids[2, 0] = E   # out of range: invalid
    weights = rng.uniform(0.1, 1.0, (M, TOPK)).astype(np.float32)
    b1 = random_input(rng, (E, 2 * I), "bf16", 0.5) if bias else None
    b2 = random_input(rng, (E, K), "f32", 0.5) if bias else None
    return x, w1, w1s, w2, w2s, ids, weights, b1, b2


def want_gate(x_codes, x_vals, w1, w1s, ids, b1=None, ue8m0=False, **act):
    """(codes [M * k, I] uint8, scale values [M * k, I/128], exponents) of h; invalid slots 0."""
    local = ref.local_experts(ids, E)
    h = np.zeros((M * TOPK, I), np.float32)
    for t, e in enumerate(local.reshape(-1)):
        if e >= 0:
            m = t // TOPK
            h[t] = fp8.gate(x_codes[m:m + 1], x_vals[m:m + 1], w1[e], w1s[e],
                            None if b1 is None else b1[e], **act)[0]
    codes, s, exps = ref.quantize(h, 128, ue8m0=ue8m0)
    invalid = local.reshape(-1) < 0
    codes[invalid], s[invalid] = 0, 0
    if exps is not None:
        exps[invalid] = 0
    return codes, s, exps


@pytest.mark.parametrize("x_kind", ["bf16", "f32", "f8"])
@pytest.mark.parametrize("layout,ue8m0,sdtype", [
    ("row_major", False, "f32"), ("column_major", False, "f32"), ("row_major", True, "u8"),
    ("packed_ue8m0", True, "i32")])
def test_gate_fp8(ctx, rng, x_kind, layout, ue8m0, sdtype):
    x, w1, w1s, _, _, ids, _, b1, _ = problem(rng, u8_weights=ue8m0, bias=True)
    if x_kind == "f32":
        x = x.astype(np.float32)
    x_codes, x_vals = fp8.quantize_x(x, ue8m0=ue8m0)
    kwargs = dict(b1=b1, scale_layout=layout, ue8m0=ue8m0,
                  scale_dtype=sdtype if sdtype == "u8" else None)
    if x_kind == "f8":  # already quantized, as a dispatch would hand it over
        xq, xs = moefuse.quant(x, scale_layout=layout, ue8m0=ue8m0,
                               scale_dtype=kwargs["scale_dtype"])
        np.testing.assert_array_equal(codes_of(xq), x_codes)
        x, kwargs["x_scales"] = xq, xs
    h, hs = run(ctx, moefuse.moe_gate_fp8, x, w1, w1s, ids, **kwargs)
    assert h.shape == (M, TOPK, I) and h.dtype == ref.FP8
    codes, s, exps = want_gate(x_codes, x_vals, w1, w1s, ids, b1, ue8m0)
    assert_codes_match(h.reshape(M * TOPK, I), codes)
    assert_scales_match(hs, ref.scales_in_layout(s, exps, layout, as_u8=sdtype == "u8"))
    assert np.all(codes_of(h)[1, 1] == 0) and np.all(codes_of(h)[2, 0] == 0)


@pytest.mark.parametrize("act,order,limit", [("gelu", "up_first", 0.0),
                                             ("silu", "gate_first", 0.7)])
def test_gate_fp8_options(ctx, rng, act, order, limit):
    x, w1, w1s, _, _, ids, *_ = problem(rng)
    h, hs = run(ctx, moefuse.moe_gate_fp8, x, w1, w1s, ids, activation=act, order=order,
                limit=limit)
    x_codes, x_vals = fp8.quantize_x(x)
    codes, s, _ = want_gate(x_codes, x_vals, w1, w1s, ids, act=act, order=order, limit=limit)
    assert_codes_match(h.reshape(M * TOPK, I), codes)
    assert_scales_match(hs, s)


def _h_of_the_library(ctx, rng, **kwargs):
    x, w1, w1s, w2, w2s, ids, weights, b1, b2 = problem(rng, **kwargs)
    h, hs = run(ctx, moefuse.moe_gate_fp8, x, w1, w1s, ids, b1=b1)
    return h, hs, w2, w2s, ids, weights, b2


def _want_y(h, hs, w2, w2s, ids, b2=None):
    """The un-reduced y [M, k, K] in f32 from the library's h, 0 for invalid slots."""
    local = ref.local_experts(ids, E)
    rows = codes_of(h).reshape(M * TOPK, I)
    vals = fp8.row_scales(hs, "row_major", M * TOPK)
    y = np.zeros((M * TOPK, K), np.float32)
    for t, e in enumerate(local.reshape(-1)):
        if e >= 0:
            y[t] = fp8.final(rows[t:t + 1], vals[t:t + 1], w2[e], w2s[e],
                             None if b2 is None else b2[e])[0]
    return y.reshape(M, TOPK, K)


@pytest.mark.parametrize("u8_weights,bias", [(False, True), (True, False)])
def test_final_fp8_unreduced_is_exact(ctx, rng, u8_weights, bias):
    h, hs, w2, w2s, ids, _, b2 = _h_of_the_library(ctx, rng, u8_weights=u8_weights, bias=bias)
    y = run(ctx, moefuse.moe_final_fp8, h, hs, w2, w2s, ids, b2=b2, reduce=False, dtype="f32")
    assert y.shape == (M, TOPK, K) and y.dtype == np.float32
    # every block sum is exact and every rounding documented: the same bits as the model
    np.testing.assert_array_equal(y, _want_y(h, hs, w2, w2s, ids, b2))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_final_fp8_reduced(ctx, rng, dtype):
    h, hs, w2, w2s, ids, weights, _ = _h_of_the_library(ctx, rng)
    out = run(ctx, moefuse.moe_final_fp8, h, hs, w2, w2s, ids, weights, dtype=dtype)
    assert out.shape == (M, K) and out.dtype == (np.float32 if dtype == "f32" else ref.BF16)
    y = _want_y(h, hs, w2, w2s, ids).astype(np.float64)
    valid = ref.local_experts(ids, E) >= 0
    terms = np.where(valid, weights, 0)[:, :, None] * y
    want, size = terms.sum(axis=1), np.abs(terms).sum(axis=1)
    ulp = 2.0 ** -23 if dtype == "f32" else 2.0 ** -8
    bound = 4 * 2.0 ** -24 * size + ulp * np.abs(want)  # the f32 sum, then one rounding
    assert np.all(np.abs(out.astype(np.float64) - want) <= bound)


@pytest.mark.parametrize("dtype", [None, "f32"])
def test_forward_fp8_is_gate_then_final(ctx, rng, dtype):
    x, w1, w1s, w2, w2s, ids, weights, b1, b2 = problem(rng, bias=True)
    out = run(ctx, moefuse.moe_forward_fp8, x, w1, w1s, w2, w2s, ids, weights, b1=b1, b2=b2,
              dtype=dtype)
    assert out.dtype == (ref.BF16 if dtype is None else np.float32)  # default: x's dtype
    h, hs = moefuse.moe_gate_fp8(x, w1, w1s, ids, b1=b1, ctx=ctx)
    two = moefuse.moe_final_fp8(h, hs, w2, w2s, ids, weights, b2=b2, dtype=out.dtype, ctx=ctx)
    np.testing.assert_array_equal(out.view(np.uint8), two.view(np.uint8))
    want = ref.moe_final(fp8_dequant(h, hs), fp8_weight_values(w2, w2s), ids, weights, b2)
    assert ref.rel_error(out, want) <= 8e-3  # bf16 output, against the dequantized math


def fp8_dequant(h, hs):
    vals = ref.fp8_decode(codes_of(h).reshape(M * TOPK, I)).reshape(M * TOPK, I // 128, 128)
    return (vals * hs[:, :, None]).reshape(M, TOPK, I)


def fp8_weight_values(w, ws):
    vals = ref.fp8_decode(codes_of(w)).astype(np.float64)
    s = np.repeat(np.repeat(fp8.scale_values(ws), 128, axis=1), 128, axis=2)
    return vals * s


@pytest.mark.parametrize("x_kind", ["bf16", "f8"])
def test_masked_fp8(ctx, rng, x_kind):
    """Each row t < n[e] is a slot of expert e: the routed gate then un-reduced final, bit for
    bit; counts are clamped to [0, Tmax] and rows past them are not written."""
    Em, Tmax = 3, 5
    counts = np.array([-2, 9, 3], dtype=np.int32)  # n = 0, 5, 3
    n = np.clip(counts, 0, Tmax)
    x = random_input(rng, (Em, Tmax, K), "bf16", scale=1.0)
    w1, w1s = fp8_weights(rng, (Em, 2 * I, K))
    w2, w2s = fp8_weights(rng, (Em, K, I))
    kwargs = {}
    if x_kind == "f8":  # per-expert row-major scales [E, Tmax, K/128]
        xq, xs = moefuse.quant(x.reshape(Em * Tmax, K))
        x, kwargs["x_scales"] = xq.reshape(Em, Tmax, K), xs.reshape(Em, Tmax, K // 128)
    out = np.full((Em, Tmax, K), np.nan, np.float32)
    run(ctx, moefuse.moe_masked_fp8, x, counts, w1, w1s, w2, w2s, dtype="f32", out=out,
        **kwargs)
    for e in range(Em):
        assert np.all(np.isnan(out[e, n[e]:]))  # not written
        if n[e] == 0:
            continue
        ids = np.full((n[e], 1), e, np.int32)
        xe = x[e, :n[e]]
        se = {"x_scales": kwargs["x_scales"][e, :n[e]]} if kwargs else {}
        h, hs = moefuse.moe_gate_fp8(xe, w1, w1s, ids, ctx=ctx, **se)
        y = moefuse.moe_final_fp8(h, hs, w2, w2s, ids, reduce=False, dtype="f32", ctx=ctx)
        np.testing.assert_array_equal(out[e, :n[e]], y[:, 0])
        # and the model: x quantized per row, h per 1 x 128 group
        codes, vals = ((codes_of(xe), fp8.row_scales(se["x_scales"], "row_major", n[e]))
                       if se else fp8.quantize_x(xe))
        hq, hsv, _ = ref.quantize(fp8.gate(codes, vals, w1[e], w1s[e]), 128)
        want = fp8.final(hq, hsv, w2[e], w2s[e])
        assert ref.rel_error(out[e, :n[e]], want) <= 2e-3


def test_masked_fp8_allocates_zeroed_rows(ctx, rng):
    x = random_input(rng, (2, 3, K), "bf16", scale=1.0)
    w1, w1s = fp8_weights(rng, (2, 2 * I, K))
    w2, w2s = fp8_weights(rng, (2, K, I))
    out = run(ctx, moefuse.moe_masked_fp8, x, np.array([1, 0], np.int32), w1, w1s, w2, w2s)
    assert out.shape == (2, 3, K) and out.dtype == ref.BF16
    assert np.all(out.astype(np.float32)[0, 1:] == 0) and np.all(out.astype(np.float32)[1] == 0)
    assert np.any(out.astype(np.float32)[0, 0] != 0)


# ---------------------------------------------------------------- refusals


def test_other_float8_flavours_are_refused(cpu, rng):
    import ml_dtypes
    x, w1, w1s, _, _, ids, *_ = problem(rng)
    for flavour in ("float8_e5m2", "float8_e4m3fnuz", "float8_e4m3b11fnuz"):
        other = w1.astype(np.float32).astype(getattr(ml_dtypes, flavour))
        with pytest.raises(moefuse.DtypeError, match="float8_e4m3fn only"):
            moefuse.moe_gate_fp8(x, other, w1s, ids, ctx=cpu)


def test_an_fp8_x_needs_its_scales(cpu, rng):
    x, w1, w1s, _, _, ids, *_ = problem(rng)
    xq, xs = moefuse.quant(x)
    h = np.full((M, TOPK, I), 0x5A, np.uint8).view(ref.FP8)
    hs = np.full((M * TOPK, I // 128), 7.0, np.float32)
    with pytest.raises(moefuse.NullPointerError, match="x_scales is absent"):
        moefuse.moe_gate_fp8(xq, w1, w1s, ids, h=h, h_scales=hs, ctx=cpu)
    with pytest.raises(moefuse.InvalidArgumentError, match="x_scales must be absent"):
        moefuse.moe_gate_fp8(x, w1, w1s, ids, x_scales=xs, h=h, h_scales=hs, ctx=cpu)
    # a refused call writes nothing
    assert np.all(codes_of(h) == 0x5A) and np.all(hs == 7.0)


def test_shapes_the_blocks_do_not_fit_are_refused(cpu, rng):
    x, w1, w1s, w2, w2s, ids, weights, *_ = problem(rng)
    with pytest.raises(moefuse.ShapeError, match="w1_scales"):
        moefuse.moe_gate_fp8(x, w1, w1s[:, :1], ids, ctx=cpu)
    small, small_s = fp8_weights(rng, (E, 2 * 64, K))  # I = 64: not a multiple of 128
    with pytest.raises(moefuse.ShapeError, match="multiple of 128"):
        moefuse.moe_gate_fp8(x, small, small_s, ids, ctx=cpu)
    with pytest.raises(moefuse.DtypeError):  # bf16 weights are moe_forward's
        moefuse.moe_forward_fp8(x, w1.astype(ref.BF16), w1s, w2, w2s, ids, weights, ctx=cpu)


def test_an_fp8_x_of_no_rows(ctx, rng):
    """Zero tokens: the scales of an empty FP8 x have no data (torch and numpy give NULL or
    any pointer); the call has nothing to do and returns an empty output."""
    x, w1, w1s, w2, w2s, _, _, *_ = problem(rng)
    xq, xs = moefuse.quant(x[:0])
    ids = np.zeros((0, TOPK), np.int32)
    weights = np.zeros((0, TOPK), np.float32)
    out = run(ctx, moefuse.moe_forward_fp8, xq, w1, w1s, w2, w2s, ids, weights, x_scales=xs)
    assert out.shape == (0, x.shape[1])
