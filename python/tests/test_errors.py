"""Error paths: the library's status and message reach Python, and nothing is written."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import random_input

CANARY = 0x5A


def _canary(shape, dtype):
    dtype = np.dtype(dtype)
    return np.full(shape[:-1] + (shape[-1] * dtype.itemsize,), CANARY, np.uint8).view(dtype)


def _untouched(*arrays):
    return all(np.all(a.view(np.uint8) == CANARY) for a in arrays)


def test_bad_shape_raises_the_library_message_and_writes_nothing(ctx, rng):
    x = random_input(rng, (3, 512), "f32")
    q = _canary((3, 255), ref.FP8)
    s = _canary((3, 2), np.float32)
    with pytest.raises(moefuse.ShapeError) as info:
        moefuse.act_quant(x, out=q, scales=s, ctx=ctx)
    err = info.value
    assert err.status == "MOEFUSE_ERR_SHAPE" and err.code == 3
    assert err.message == "act_quant: q has shape [3, 255] but x [T, 2H] requires [3, 256]"
    assert isinstance(err, moefuse.Error) and isinstance(err, ValueError)
    assert _untouched(q, s)


def test_wrong_scales_shape_for_layout(ctx, rng):
    x = random_input(rng, (5, 256), "bf16")
    s = _canary((2, 5), np.float32)  # column-major needs [Gn, round_up(T, 4)] = [2, 8]
    q = _canary((5, 256), ref.FP8)
    with pytest.raises(moefuse.ShapeError, match=r"scales has shape \[2, 5\].*column-major"):
        moefuse.quant(x, scale_layout="column_major", out=q, scales=s, ctx=ctx)
    assert _untouched(q, s)


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"group_size": 48}, moefuse.InvalidArgumentError, "group_size 48 is not one of"),
    ({"dtype": "i8", "ue8m0": True}, moefuse.InvalidArgumentError, "UE8M0 scales"),
    ({"limit": -1.0}, moefuse.InvalidArgumentError, "limit is -1"),
    ({"eps": -1.0}, moefuse.InvalidArgumentError, "eps is -1"),
    ({"scale_dtype": "u8"}, moefuse.DtypeError, "u8 .* but the ue8m0 option is off"),
    ({"dtype": "bf16"}, moefuse.DtypeError, "q has dtype bf16"),
])
def test_bad_options(ctx, rng, kwargs, error, pattern):
    x = random_input(rng, (2, 256), "f32")
    with pytest.raises(error, match=pattern):
        moefuse.act_quant(x, ctx=ctx, **kwargs)


def test_option_names_are_checked():
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(moefuse.InvalidArgumentError, match="activation 'swish' is not one of"):
        moefuse.act_mul(x, activation="swish")
    with pytest.raises(moefuse.InvalidArgumentError, match="scale_layout 'col'"):
        moefuse.quant(x, scale_layout="col")


def test_a_bool_is_no_enum_value_even_after_its_int():
    """Raw ints pass as enum values, bools do not, whatever was called before."""
    x = np.zeros((2, 256), np.float32)
    moefuse.act_mul(x, activation=1)
    with pytest.raises(moefuse.InvalidArgumentError, match="activation True is not one of"):
        moefuse.act_mul(x, activation=True)


def test_strides_and_alignment_are_judged_by_the_library(ctx, rng):
    x = random_input(rng, (4, 512), "f32")
    with pytest.raises(moefuse.StrideError, match="x innermost stride is 2"):
        moefuse.act_mul(x[:, ::2], ctx=ctx)
    with pytest.raises(moefuse.StrideError, match="negative stride"):
        moefuse.act_mul(x[::-1], ctx=ctx)
    raw = np.zeros(4 * 256 * 4 + 1, np.uint8)
    misaligned = raw[1:].view(np.float32).reshape(4, 256)
    if ctx.backend == "cpu":  # staged copies land aligned: only host pointers can be misaligned
        with pytest.raises(moefuse.AlignmentError, match="not aligned"):
            moefuse.act_mul(misaligned, ctx=ctx)


def test_wrong_dtypes(ctx, rng):
    x = random_input(rng, (4, 64), "f32")
    with pytest.raises(moefuse.DtypeError, match="x has dtype float64, which has no moefuse"):
        moefuse.act_mul(x.astype(np.float64), ctx=ctx)
    with pytest.raises(moefuse.DtypeError, match="x has dtype i32; expected one of: f32, f16"):
        moefuse.act_mul(x.astype(np.int32), ctx=ctx)
    w1 = random_input(rng, (2, 16, 64), "bf16")
    ids = np.zeros((4, 1), np.int32)
    with pytest.raises(moefuse.DtypeError, match="w1 is bf16 but x is f32"):
        moefuse.moe_gate(x, w1, ids, ctx=ctx)


def test_moe_shape_errors(ctx, rng):
    x = random_input(rng, (4, 64), "f32")
    w1 = random_input(rng, (2, 16, 63), "f32")
    ids = np.zeros((4, 2), np.int32)
    with pytest.raises(moefuse.ShapeError, match=r"w1 has shape \[2, 16, 63\] but x has K = 64"):
        moefuse.moe_gate(x, w1, ids, ctx=ctx)
    w1 = random_input(rng, (2, 16, 64), "f32")
    w2 = random_input(rng, (2, 64, 8), "f32")
    out = _canary((4, 64), np.float32)
    with pytest.raises(moefuse.ShapeError, match="topk_weights"):
        moefuse.moe_forward(x, w1, w2, ids, np.ones((4, 3), np.float32), out=out, ctx=ctx)
    assert _untouched(out)
    with pytest.raises(moefuse.ShapeError, match="1 <= k <= E"):
        moefuse.topk_softmax(np.zeros((2, 4), np.float32), 5, ctx=ctx)


def test_masked_counts_must_be_i32(ctx, rng):
    x = random_input(rng, (2, 4, 256), "f32")
    with pytest.raises(moefuse.DtypeError, match="counts has dtype"):
        moefuse.act_quant_masked(x, np.array([1, 2], np.int8), ctx=ctx)


def test_python_side_refusals(ctx):
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(TypeError, match="x is a list"):
        moefuse.act_mul([[0.0] * 256], ctx=ctx)
    ro = np.zeros((2, 128), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        moefuse.act_mul(x, out=ro, ctx=ctx)
    with pytest.raises(TypeError, match="ctx must be a Context"):
        moefuse.act_mul(x, ctx=3)
    with pytest.raises(TypeError, match="give k"):
        moefuse.topk_softmax(np.zeros((2, 4), np.float32))


def test_unknown_backend_lists_the_built_ones():
    with pytest.raises(moefuse.BackendUnavailableError) as info:
        moefuse.Context("tpu")
    assert "backend 'tpu' (from argument) is unknown; built backends: " in str(info.value)
    assert info.value.status == "MOEFUSE_ERR_BACKEND_UNAVAILABLE"


def test_empty_numpy_arrays_are_accepted(ctx):
    # numpy gives [0, N] arrays zero strides; the library once refused them for it
    x = np.zeros((0, 256), np.float32)
    assert x.strides == (0, 0)
    q, scales = moefuse.act_quant(x, ctx=ctx)
    assert q.shape == (0, 128) and scales.shape == (0, 1)
    assert moefuse.act_mul(x, ctx=ctx).shape == (0, 128)


def test_eps_below_the_minimum_is_refused(ctx, rng):
    x = np.zeros((2, 256), np.float32)  # all-zero groups: the case that gave NaN codes
    with pytest.raises(moefuse.InvalidArgumentError, match="eps is 9.99995e-41; it must be finite and at least 1e-35"):
        moefuse.quant(x, eps=1e-40, ctx=ctx)
    q, scales = moefuse.quant(x, eps=1e-35, ctx=ctx)
    assert not np.any(q.view(np.uint8) & 0x7F == 0x7F) and np.all(scales > 0)


def test_outputs_may_not_overlap(rng):
    # host pointers reach the library as they are on the cpu backend, so it sees the overlap
    x = random_input(rng, (4, 128), "f32")
    raw = np.zeros(4 * 128 + 64, np.uint8)
    q = raw[:4 * 128].view(moefuse_f8()).reshape(4, 128)
    scales = raw[4 * 128 - 32:4 * 128 - 16].view(np.float32).reshape(4, 1)  # inside q
    before = raw.copy()
    with pytest.raises(moefuse.OverlapError, match="output q shares memory with output scales"):
        moefuse.quant(x, out=q, scales=scales, ctx="cpu")
    assert np.array_equal(raw, before)


def moefuse_f8():
    import ml_dtypes
    return ml_dtypes.float8_e4m3fn
