"""The block-scaled FP8 MoE calls (docs/NUMERICS.md "FP8 MoE"), one function per C call.

Weights are float8_e4m3fn codes with one scale per 128 x 128 block (f32, or uint8 UE8M0
exponents); activations are float8_e4m3fn codes with one scale per 1 x 128 group of a row, laid
out as `quant` writes them (scale_layout, f32 / uint8 / packed int32). An x of f32, f16 or bf16
is quantized inside the call; an FP8 x comes with its x_scales. The keyword arguments and the
way results are allocated are those of ops.py. These calls always go through ctypes: the
compiled fast path (_fastcall.c) does not take them.
"""

import ctypes

from . import _dtypes, _options, _tensors
from ._call import Call, resolve_context
from ._capi import lib
from .ops import _dims, _moe_final_shape, _ref, _result, _routing


def _given(t, operand):
    """x_scales when the caller gave it, even empty (an empty tensor's data pointer is 0)."""
    return ctypes.byref(t) if operand is not None else None

GROUP = 128  # the activation groups and weight blocks of the FP8 calls
FLOATS = ("f32", "f16", "bf16")


# Result shapes and dtypes, for Operands or (real or fake) tensors; torch_ops.py's fake kernels
# use them too.

def _name(dtype):
    return dtype if isinstance(dtype, str) else _dtypes.resolve(dtype)


def _out_dtype(dtype, x_dtype):
    """dtype when given, else x's when x is a float, else bf16 (an FP8 x or h)."""
    if dtype is not None:
        return dtype
    name = _name(x_dtype)
    return name if name in FLOATS else "bf16"


def _gate_shapes(x, w1, topk_ids, scale_layout, n_shared=0):
    """h [M, k, I] and its scales, laid out as those of a quantized [M * k, I] (k counts the
    shared experts' slots too)."""
    M, k, I = _dims(x, 2)[0], _dims(topk_ids, 2)[1] + int(n_shared), _dims(w1, 3)[1] // 2
    return (M, k, I), _options.scales_shape(scale_layout, M * k, I, GROUP)


def _h_scales_dtype(scale_layout, scale_dtype, x_scales):
    """The allocated h_scales' dtype: scale_dtype, else x_scales', else f32 (i32 packed)."""
    if scale_dtype is None and x_scales is not None and _options.layout_code(scale_layout) != 2:
        return _name(x_scales.dtype)
    return _options.scales_dtype(scale_layout, scale_dtype)


def _ue8m0(ue8m0, *scales):
    """ue8m0=None: on when activation scales given are u8 exponents."""
    if ue8m0 is not None:
        return ue8m0
    return any(s is not None and s.dtype == "u8" for s in scales)


def _operands(pairs):
    return [_tensors.describe(a, n) for a, n in pairs]


def moe_gate_fp8(x, w1, w1_scales, topk_ids, *, x_scales=None, b1=None, expert_map=None,
                 activation="silu", order="gate_first", limit=0.0, scale_layout="row_major",
                 ue8m0=None, eps=None, scale_dtype=None, h=None, h_scales=None, alpha=0.0,
                 up_offset=0.0, n_shared=0, ctx=None):
    """h [M, k, I] f8_e4m3 and h_scales = quant(act(x @ w1[e]^T + b1[e])) per routed slot
    (activation, order, limit, alpha and up_offset as in moefuse.moe_gate), and, with
    n_shared, per shared slot after them: k counts both.

    x [M, K] float (quantized here), or f8_e4m3 with x_scales; w1 [E, 2I, K] f8_e4m3 with
    w1_scales [E, 2I/128, K/128]. h_scales lie as the scales of a quantized [M * k, I] in
    scale_layout; they are f32 unless scale_dtype (or, when given, x_scales) says u8.
    Invalid slots get codes and scale bytes 0. Returns (h, h_scales)."""
    ops = _operands(((x, "x"), (x_scales, "x_scales"), (w1, "w1"), (w1_scales, "w1_scales"),
                     (b1, "b1"), (topk_ids, "topk_ids"), (expert_map, "expert_map")))
    xo, xso, wo, wso, bo, io, mo = ops
    c = resolve_context(ctx, ops)
    h_shape, s_shape = _gate_shapes(xo, wo, io, scale_layout, n_shared)
    h, ho = _result(h, "h", xo, h_shape, "f8_e4m3")
    h_scales, hso = _result(h_scales, "h_scales", xo, s_shape,
                            _h_scales_dtype(scale_layout, scale_dtype, xso))
    opt = _options.fp8_moe(activation, order, limit, scale_layout,
                           _ue8m0(ue8m0, xso, hso), eps, alpha, up_offset)
    with Call(c, "moe_gate_fp8") as call:
        tx, txs, tw, tws, tb = (call.tensor(o) for o in (xo, xso, wo, wso, bo))
        route = _routing(call, io, None, mo, n_shared)
        th, ths = call.tensor(ho, output=True), call.tensor(hso, output=True)
        call.run(lib.moefuse_moe_gate_fp8, ctypes.byref(tx), _given(txs, xso), ctypes.byref(tw),
                 ctypes.byref(tws), _ref(tb), ctypes.byref(route), ctypes.byref(th),
                 ctypes.byref(ths), ctypes.byref(opt))
    return h, h_scales


def moe_final_fp8(h, h_scales, w2, w2_scales, topk_ids, topk_weights=None, *, b2=None,
                  expert_map=None, reduce=True, scale_layout="row_major", ue8m0=None, dtype=None,
                  out=None, n_shared=0, shared_scale=0.0, shared_weights=None, ctx=None):
    """y = h[m, j] @ w2[e]^T + b2[e] per slot, from h's codes and scales as moe_gate_fp8 wrote
    them; w2 [E, K, I] f8_e4m3 with w2_scales [E, K/128, I/128]. reduce=True: out [M, K], the
    weighted top-k sum; reduce=False: out [M, k, K]. dtype: out's, default bf16."""
    ops = _operands(((h, "h"), (h_scales, "h_scales"), (w2, "w2"), (w2_scales, "w2_scales"),
                     (b2, "b2"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights"),
                     (expert_map, "expert_map"), (shared_weights, "shared_weights")))
    ho, hso, wo, wso, bo, io, wto, mo, swo = ops
    c = resolve_context(ctx, ops)
    out, oo = _result(out, "out", ho, _moe_final_shape(ho, wo, reduce),
                      _out_dtype(dtype, ho.dtype))
    opt = _options.fp8_moe("silu", "gate_first", 0.0, scale_layout, _ue8m0(ue8m0, hso), None)
    with Call(c, "moe_final_fp8") as call:
        th, ths, tw, tws, tb = (call.tensor(o) for o in (ho, hso, wo, wso, bo))
        route = _routing(call, io, wto, mo, n_shared, shared_scale, swo)
        to = call.tensor(oo, output=True)
        call.run(lib.moefuse_moe_final_fp8, ctypes.byref(th), ctypes.byref(ths),
                 ctypes.byref(tw), ctypes.byref(tws), _ref(tb), ctypes.byref(route),
                 ctypes.byref(to), ctypes.byref(opt))
    return out


def moe_forward_fp8(x, w1, w1_scales, w2, w2_scales, topk_ids, topk_weights, *, x_scales=None,
                    b1=None, b2=None, expert_map=None, activation="silu", order="gate_first",
                    limit=0.0, scale_layout="row_major", ue8m0=None, eps=None, dtype=None,
                    out=None, alpha=0.0, up_offset=0.0, n_shared=0, shared_scale=0.0,
                    shared_weights=None, ctx=None):
    """The whole FP8 layer: moe_gate_fp8 then moe_final_fp8, h kept in FP8 in the call's
    workspace. out [M, K]; dtype: out's, default x's when x is a float, else bf16.
    n_shared, shared_scale, shared_weights: shared experts, as moe_forward takes them."""
    ops = _operands(((x, "x"), (x_scales, "x_scales"), (w1, "w1"), (w1_scales, "w1_scales"),
                     (w2, "w2"), (w2_scales, "w2_scales"), (b1, "b1"), (b2, "b2"),
                     (topk_ids, "topk_ids"), (topk_weights, "topk_weights"),
                     (expert_map, "expert_map"), (shared_weights, "shared_weights")))
    xo, xso, w1o, w1so, w2o, w2so, b1o, b2o, io, wto, mo, swo = ops
    c = resolve_context(ctx, ops)
    out, oo = _result(out, "out", xo, _dims(xo, 2), _out_dtype(dtype, xo.dtype))
    opt = _options.fp8_moe(activation, order, limit, scale_layout, _ue8m0(ue8m0, xso), eps,
                           alpha, up_offset)
    with Call(c, "moe_forward_fp8") as call:
        tensors = [call.tensor(o) for o in (xo, xso, w1o, w1so, w2o, w2so, b1o, b2o)]
        tx, txs, t1, t1s, t2, t2s, tb1, tb2 = tensors
        route = _routing(call, io, wto, mo, n_shared, shared_scale, swo)
        to = call.tensor(oo, output=True)
        call.run(lib.moefuse_moe_forward_fp8, ctypes.byref(tx), _given(txs, xso), ctypes.byref(t1),
                 ctypes.byref(t1s), ctypes.byref(t2), ctypes.byref(t2s), _ref(tb1), _ref(tb2),
                 ctypes.byref(route), ctypes.byref(to), ctypes.byref(opt))
    return out


def moe_masked_fp8(x, counts, w1, w1_scales, w2, w2_scales, *, x_scales=None, b1=None,
                   b2=None, activation="silu", order="gate_first", limit=0.0,
                   scale_layout="row_major", ue8m0=None, eps=None, dtype=None, out=None,
                   alpha=0.0, up_offset=0.0, ctx=None):
    """The whole FP8 layer in the 3-D expert-masked layout of expert parallelism: x [E, Tmax, K]
    (f8_e4m3 with x_scales in act_quant_masked's 3-D layout, or a float), counts [E] i32
    (clamped to [0, Tmax]); out [E, Tmax, K], row t of expert e computed for t < counts[e] only
    (rows past it are left as they are: 0 in an out this function allocates)."""
    ops = _operands(((x, "x"), (x_scales, "x_scales"), (counts, "counts"), (w1, "w1"),
                     (w1_scales, "w1_scales"), (w2, "w2"), (w2_scales, "w2_scales"),
                     (b1, "b1"), (b2, "b2")))
    xo, xso, co, w1o, w1so, w2o, w2so, b1o, b2o = ops
    c = resolve_context(ctx, ops)
    out, oo = _result(out, "out", xo, _dims(xo, 3), _out_dtype(dtype, xo.dtype), zero=True)
    opt = _options.fp8_moe(activation, order, limit, scale_layout, _ue8m0(ue8m0, xso), eps,
                           alpha, up_offset)
    with Call(c, "moe_masked_fp8") as call:
        tensors = [call.tensor(o) for o in (xo, xso, co, w1o, w1so, w2o, w2so, b1o, b2o)]
        tx, txs, tc, t1, t1s, t2, t2s, tb1, tb2 = tensors
        to = call.tensor(oo, output=True)
        call.run(lib.moefuse_moe_masked_fp8, ctypes.byref(tx), _given(txs, xso), ctypes.byref(tc),
                 ctypes.byref(t1), ctypes.byref(t1s), ctypes.byref(t2), ctypes.byref(t2s),
                 _ref(tb1), _ref(tb2), ctypes.byref(to), ctypes.byref(opt))
    return out
