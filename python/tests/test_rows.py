"""act_quant, act_mul, quant and dequant on numpy arrays against the numpy reference."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import (activation_slack, assert_close_in_dtype, assert_codes_match,
                    assert_scales_match, codes_of, random_input)

# (activation, input dtype, codes, layout, group, ue8m0, scale dtype)
QUANT_CASES = [
    ("silu", "f32", "f8_e4m3", "row_major", 128, False, "f32"),
    ("gelu", "bf16", "f8_e4m3", "column_major", 64, False, "f32"),
    ("gelu_tanh", "f16", "i8", "row_major", 32, False, "f32"),
    ("silu", "bf16", "f8_e4m3", "packed_ue8m0", 32, True, "i32"),
    ("silu", "bf16", "f8_e4m3", "row_major", "H", True, "u8"),
    ("silu", "f32", "f8_e4m3", "column_major", 128, True, "f32"),
    ("silu", "f16", "i8", "column_major", 128, False, "f32"),
]


def _expected_scales(s, exps, layout, scale_dtype):
    return ref.scales_in_layout(s, exps, layout, as_u8=scale_dtype == "u8")


@pytest.mark.parametrize("act,xdtype,code,layout,group,ue8m0,sdtype", QUANT_CASES)
def test_act_quant(ctx, rng, act, xdtype, code, layout, group, ue8m0, sdtype):
    T, H = 7, 256  # T not a multiple of 4: the padded layouts have padding rows
    G = H if group == "H" else group
    x = random_input(rng, (T, 2 * H), xdtype)
    q, scales = moefuse.act_quant(x, activation=act, group_size=G, scale_layout=layout,
                                  ue8m0=ue8m0, dtype=code, scale_dtype=sdtype, ctx=ctx)
    codes, s, exps = ref.quantize(ref.gated(x, act), G, code, ue8m0)
    assert q.shape == (T, H) and q.dtype == (ref.FP8 if code == "f8_e4m3" else np.int8)
    assert_codes_match(q, codes, fp8=code == "f8_e4m3")
    assert_scales_match(scales, _expected_scales(s, exps, layout, sdtype))


@pytest.mark.parametrize("order,limit,intermediate", [
    ("up_first", 0.0, None), ("gate_first", 1.5, None), ("gate_first", 0.0, "bf16"),
    ("up_first", 0.75, "bf16")])
def test_act_quant_options_and_row_scale(ctx, rng, order, limit, intermediate):
    T, H = 6, 128
    x = random_input(rng, (T, 2 * H), "bf16")
    row_scale = rng.uniform(0.1, 2.0, T).astype(np.float32)
    q, scales = moefuse.act_quant(x, row_scale=row_scale, order=order, limit=limit,
                                  intermediate=intermediate, ctx=ctx)
    h = ref.gated(x, "silu", order, limit, intermediate, row_scale=row_scale)
    codes, s, _ = ref.quantize(h)
    assert_codes_match(q, codes)
    assert_scales_match(scales, s)


def test_quantize_specials(ctx):
    """NaN, +-Inf, saturation, an all-zero group and signed zero, per NUMERICS."""
    H = 32
    h = np.zeros((3, H), dtype=np.float32)
    h[0, :6] = [np.nan, -np.nan, np.inf, -np.inf, 3.0, -1.5]
    h[1, :4] = [1e30, -2.0, -0.0, 1e-3]
    q, scales = moefuse.quant(h, group_size=H, ctx=ctx)
    codes, s, _ = ref.quantize(h, group=H)
    np.testing.assert_array_equal(codes_of(q), codes)
    assert_scales_match(scales, s)
    qi, si = moefuse.quant(h, group_size=H, dtype="i8", ctx=ctx)
    icodes, isc, _ = ref.quantize(h, group=H, code="i8")
    np.testing.assert_array_equal(codes_of(qi), icodes)
    assert_scales_match(si, isc)
    assert codes_of(q)[0, 0] == 0x7F and codes_of(q)[0, 2] == 0x7E  # NaN code, +Inf -> 448
    assert scales[2, 0] == np.float32(np.float32(1e-10) / np.float32(448))  # eps / 448


@pytest.mark.parametrize("xdtype,code,layout,ue8m0,sdtype", [
    ("f32", "f8_e4m3", "row_major", False, "f32"),
    ("bf16", "i8", "column_major", False, "f32"),
    ("f16", "f8_e4m3", "packed_ue8m0", True, "i32"),
    ("bf16", "f8_e4m3", "column_major", True, "u8"),
])
def test_quant_and_dequant(ctx, rng, xdtype, code, layout, ue8m0, sdtype):
    T, H, G = 5, 256, 64
    x = random_input(rng, (T, H), xdtype, scale=10.0)
    q, scales = moefuse.quant(x, group_size=G, scale_layout=layout, ue8m0=ue8m0, dtype=code,
                              scale_dtype=sdtype, ctx=ctx)
    codes, s, exps = ref.quantize(x.astype(np.float32), G, code, ue8m0)
    assert_codes_match(q, codes, fp8=code == "f8_e4m3")
    assert_scales_match(scales, _expected_scales(s, exps, layout, sdtype))
    for out_dtype in ("f32", "bf16"):
        back = moefuse.dequant(q, scales, group_size=G, scale_layout=layout, dtype=out_dtype,
                               ctx=ctx)
        want = ref.dequantize(codes_of(q), s, G, code)  # from the codes the library wrote
        assert_close_in_dtype(back, want, out_dtype)


@pytest.mark.parametrize("xdtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_mul(ctx, rng, xdtype, act):
    T, H = 4, 96
    x = random_input(rng, (T, 2 * H), xdtype)
    row_scale = rng.uniform(0.5, 1.5, T).astype(np.float32)
    out = moefuse.act_mul(x, row_scale=row_scale, activation=act, ctx=ctx)
    assert out.dtype == x.dtype and out.shape == (T, H)
    slack = activation_slack(x, row_scale) if act != "silu" else 0.0
    assert_close_in_dtype(out, ref.gated(x, act, row_scale=row_scale), xdtype, slack)


@pytest.mark.parametrize("xdtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("alpha", [0.0, 1.702, 0.5])
def test_act_mul_gpt_oss(ctx, rng, xdtype, alpha):
    """gpt-oss's activation: gate * sigmoid(alpha * gate) * (up + 1), clamped at 7, on
    interleaved rows [g0 u0 g1 u1 ...]; alpha 0 means 1.702."""
    T, H = 5, 96
    x = random_input(rng, (T, 2 * H), xdtype, scale=6.0)  # across the clamp
    out = moefuse.act_mul(x, activation="silu_alpha", alpha=alpha, up_offset=1.0, limit=7.0,
                          order="interleaved", ctx=ctx)
    assert out.shape == (T, H) and out.dtype == x.dtype
    want = ref.gated(x, "silu_alpha", "interleaved", 7.0, alpha=alpha, up_offset=1.0)
    assert_close_in_dtype(out, want, xdtype)
    if alpha == 1.702:  # the default is gpt-oss's alpha: the same bits
        default = moefuse.act_mul(x, activation="silu_alpha", up_offset=1.0, limit=7.0,
                                  order="interleaved", ctx=ctx)
        np.testing.assert_array_equal(out.view(np.uint8), default.view(np.uint8))


@pytest.mark.parametrize("order", ["gate_first", "up_first", "interleaved"])
def test_act_quant_gpt_oss(ctx, rng, order):
    T, H = 7, 256
    x = random_input(rng, (T, 2 * H), "bf16", scale=6.0)
    row_scale = rng.uniform(0.1, 2.0, T).astype(np.float32)
    q, scales = moefuse.act_quant(x, row_scale=row_scale, activation="silu_alpha", alpha=1.702,
                                  up_offset=1.0, limit=7.0, order=order, group_size=64,
                                  scale_layout="column_major", ctx=ctx)
    h = ref.gated(x, "silu_alpha", order, 7.0, row_scale=row_scale, alpha=1.702, up_offset=1.0)
    codes, s, exps = ref.quantize(h, 64)
    assert_codes_match(q, codes)
    assert_scales_match(scales, _expected_scales(s, exps, "column_major", "f32"))


def test_up_offset_keeps_negative_zero_only_without_it(ctx):
    """up_offset 0 adds nothing (u = -0.0 gives act(g) * -0.0); any other offset is added."""
    x = np.zeros((1, 8), dtype=np.float32)
    x[0, :4] = [1.0, 2.0, -3.0, 0.5]  # gates
    x[0, 4:] = -0.0                   # up values
    plain = moefuse.act_mul(x, ctx=ctx)
    assert np.all(np.signbit(plain) == [True, True, False, True])
    shifted = moefuse.act_mul(x, up_offset=1.0, ctx=ctx)
    np.testing.assert_array_equal(shifted, ref.gated(x, up_offset=1.0))
    assert np.all(shifted != 0)


@pytest.mark.parametrize("kwargs,field", [
    ({"activation": "silu", "alpha": 1.702}, "alpha"),
    ({"activation": "silu_alpha", "alpha": -1.0}, "alpha"),
    ({"activation": "silu_alpha", "alpha": float("nan")}, "alpha"),
    ({"up_offset": float("inf")}, "up_offset"),
    ({"up_offset": float("nan")}, "up_offset"),
])
def test_gated_options_refused(ctx, rng, kwargs, field):
    x = random_input(rng, (2, 64), "f32")
    with pytest.raises(moefuse.InvalidArgumentError, match=field):
        moefuse.act_mul(x, ctx=ctx, **kwargs)
    with pytest.raises(moefuse.InvalidArgumentError, match=field):
        moefuse.act_quant(x, group_size=32, ctx=ctx, **kwargs)


def test_strided_views_in_and_out(ctx, rng):
    """Padded rows and slices go through without a copy; bytes between rows stay as they were."""
    T, H = 5, 128
    big = random_input(rng, (T, 2 * H + 64), "bf16")
    x = big[:, 32:32 + 2 * H]  # outer stride 2H + 64 elements
    q_mem = np.full((T, H + 16), 0x55, dtype=np.uint8).view(ref.FP8)
    q = q_mem[:, 8:8 + H]
    q_ret, scales = moefuse.act_quant(x, out=q, ctx=ctx)
    assert q_ret is q
    codes, s, _ = ref.quantize(ref.gated(x))
    assert_codes_match(q, codes)
    assert_scales_match(scales, s)
    gaps = np.concatenate([q_mem.view(np.uint8)[:, :8], q_mem.view(np.uint8)[:, 8 + H:]], axis=1)
    assert np.all(gaps == 0x55)


def test_out_arguments_are_written_in_place(ctx, rng):
    x = random_input(rng, (4, 256), "f32")
    q = np.zeros((4, 128), dtype=ref.FP8)
    s = np.zeros((4, 1), dtype=np.float32)
    q2, s2 = moefuse.act_quant(x, out=q, scales=s, ctx=ctx)
    assert q2 is q and s2 is s and np.all(s > 0)
