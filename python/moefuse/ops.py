"""The operations, one function per C call, with keyword arguments and C defaults.

Every function takes numpy arrays, torch tensors (CPU or CUDA) or DLPack objects,
allocates the results it is not given (out=, scales=, ...) where its first input
lives, and returns them. `ctx` is a Context, a backend name, or None: the cuda
context of the inputs' device for CUDA tensors, else the cpu one.
Shapes, dtypes and strides are judged by the C API; its message is raised as a
moefuse.Error subclass (ShapeError, DtypeError, ...).

A call whose first input is a torch tensor is offered to the compiled fast path first
(_fast.py): the results it is not given are allocated here with torch, and `_fast.call.<op>`
runs the call, or returns False for whatever it does not take (an operand that is no torch
tensor, memory on another device, an option name it does not know, ...). Such calls, and
any exception while allocating, go on to the ctypes path below, which raises in its own order.
The shapes of results come from the _*_shape(s) functions, which torch_ops.py's fake kernels
use as well.
"""

import ctypes

from . import _capi, _dtypes, _fast, _options, _tensors
from ._call import Call, resolve_context
from ._capi import lib


def _dims(array, rank):
    """The shape of an array (an Operand, a tensor) when it has `rank` dims, else ones (the C API
    will refuse it)."""
    if array is not None and len(array.shape) == rank:
        return array.shape
    return (1,) * rank


# Result shapes, for x, w1, ... as Operands or tensors (real or fake).

def _quant_shapes(rows, hidden, group_size, scale_layout, experts=None):
    """q's shape and the scales' for `rows` rows of `hidden` values (per expert)."""
    lead = (rows, hidden) if experts is None else (experts, rows, hidden)
    return lead, _options.scales_shape(scale_layout, rows, hidden, group_size, experts)


def _act_quant_shapes(x, group_size, scale_layout):
    T, width = _dims(x, 2)
    return _quant_shapes(T, width // 2, group_size, scale_layout)


def _act_quant_masked_shapes(x, group_size, scale_layout):
    E, Tmax, width = _dims(x, 3)
    return _quant_shapes(Tmax, width // 2, group_size, scale_layout, experts=E)


def _quant_shapes_of(x, group_size, scale_layout):
    T, H = _dims(x, 2)
    return _quant_shapes(T, H, group_size, scale_layout)


def _act_mul_shape(x):
    T, width = _dims(x, 2)
    return T, width // 2


def _topk_shape(logits, k):
    return _dims(logits, 2)[0], k


def _moe_gate_shape(x, w1, topk_ids, n_shared=0):
    return _dims(x, 2)[0], _dims(topk_ids, 2)[1] + int(n_shared), _dims(w1, 3)[1] // 2


def _moe_final_shape(h, w2, reduce):
    M, k, _ = _dims(h, 3)
    K = _dims(w2, 3)[1]
    return (M, K) if reduce else (M, k, K)


def _fast_result(given, x, shape, dtype, zero=False):
    return given if given is not None else _fast.empty(x, shape, dtype, zero)


def _fast_codes(out, scales, x, shapes, dtype, scale_layout, scale_dtype, zero=False):
    """The codes and scales of a quantizing call in the fast path: the given ones, or new ones
    of shapes() = (codes' shape, scales' shape) on x's device."""
    if out is not None and scales is not None:
        return out, scales
    q_shape, s_shape = shapes()
    return (_fast_result(out, x, q_shape, dtype, zero),
            _fast_result(scales, x, s_shape, _options.scales_dtype(scale_layout, scale_dtype),
                         zero))


def _ref(t):
    return ctypes.byref(t) if t.data else None


def _result(given, name, source, shape, dtype, zero=False):
    """Describe `given`, or allocate it like `source`. Returns (object, Operand)."""
    if given is None:
        given = _tensors.empty_like(source, shape, _dtypes.resolve(dtype), zero)
    return given, _tensors.describe(given, name)


def act_quant(x, *, row_scale=None, activation="silu", order="gate_first", limit=0.0,
              intermediate=None, group_size=128, scale_layout="row_major", ue8m0=False, eps=None,
              dtype="f8_e4m3", scale_dtype=None, out=None, scales=None, alpha=0.0, up_offset=0.0,
              ctx=None):
    """q, scales = quantize(act(gate) * (up + up_offset) [* row_scale]) for x [T, 2H].

    dtype: the codes, "f8_e4m3" or "i8". scale_layout: "row_major" [T, H/G],
    "column_major" [H/G, round_up(T, 4)] or "packed_ue8m0" [ceil(H/G/4), round_up(T, 4)] i32.
    Scales are f32 unless scale_dtype="u8" (UE8M0 exponents, with ue8m0=True).
    intermediate="bf16" rounds act(gate) and h to bf16 as unfused engines do.
    activation "silu_alpha" is gate * sigmoid(alpha * gate) (alpha 0: 1.702, gpt-oss's);
    order "interleaved" reads gate i from channel 2i and up i from 2i + 1.
    """
    if type(x) in _fast.TENSORS or _fast.first_torch(x):
        try:
            q, s = _fast_codes(out, scales, x,
                               lambda: _act_quant_shapes(x, group_size, scale_layout), dtype,
                               scale_layout, scale_dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.act_quant(ctx, x, row_scale, q, s, activation, order, limit,
                                    intermediate, alpha, up_offset, group_size, scale_layout,
                                    ue8m0, eps):
                return q, s
    xo = _tensors.describe(x, "x")
    rs = _tensors.describe(row_scale, "row_scale")
    c = resolve_context(ctx, [xo, rs])
    q_shape, s_shape = _act_quant_shapes(xo, group_size, scale_layout)
    out, qo = _result(out, "q", xo, q_shape, dtype)
    scales, so = _result(scales, "scales", xo, s_shape,
                         _options.scales_dtype(scale_layout, scale_dtype))
    opt = _capi.ActQuantOptions(act=_options.act(activation, order, limit, intermediate, alpha,
                                                 up_offset),
                                quant=_options.quant(group_size, scale_layout, ue8m0, eps))
    with Call(c, "act_quant") as call:
        tx, tr = call.tensor(xo), call.tensor(rs)
        tq, ts = call.tensor(qo, output=True), call.tensor(so, output=True)
        call.run(lib.moefuse_act_quant, ctypes.byref(tx), _ref(tr), ctypes.byref(tq),
                 ctypes.byref(ts), ctypes.byref(opt))
    return out, scales


def act_quant_masked(x, counts, *, row_scale=None, expert_scale=None, activation="silu",
                     order="gate_first", limit=0.0, intermediate=None, group_size=128,
                     scale_layout="row_major", ue8m0=False, eps=None, zero_tail=False,
                     dtype="f8_e4m3", scale_dtype=None, out=None, scales=None, alpha=0.0,
                     up_offset=0.0, ctx=None):
    """The expert-masked 3-D layout: x [E, Tmax, 2H], counts [E] i32 (clamped to [0, Tmax]).

    Rows t >= counts[e] are left as they are (0 in results this function allocates)
    unless zero_tail=True. Scales get a leading E: [E, Tmax, H/G], [E, H/G, Ta], ...
    """
    if type(x) in _fast.TENSORS or _fast.first_torch(x):
        try:
            q, s = _fast_codes(out, scales, x,
                               lambda: _act_quant_masked_shapes(x, group_size, scale_layout),
                               dtype, scale_layout, scale_dtype, zero=True)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.act_quant_masked(ctx, x, counts, row_scale, expert_scale, q, s,
                                           activation, order, limit, intermediate, alpha,
                                           up_offset, group_size, scale_layout, ue8m0, eps,
                                           zero_tail):
                return q, s
    xo = _tensors.describe(x, "x")
    co = _tensors.describe(counts, "counts")
    rs = _tensors.describe(row_scale, "row_scale")
    es = _tensors.describe(expert_scale, "expert_scale")
    c = resolve_context(ctx, [xo, co, rs, es])
    q_shape, s_shape = _act_quant_masked_shapes(xo, group_size, scale_layout)
    out, qo = _result(out, "q", xo, q_shape, dtype, zero=True)
    scales, so = _result(scales, "scales", xo, s_shape,
                         _options.scales_dtype(scale_layout, scale_dtype), zero=True)
    opt = _capi.ActQuantOptions(act=_options.act(activation, order, limit, intermediate, alpha,
                                                 up_offset),
                                quant=_options.quant(group_size, scale_layout, ue8m0, eps),
                                zero_tail=int(bool(zero_tail)))
    with Call(c, "act_quant_masked") as call:
        tx, tc, tr, te = (call.tensor(o) for o in (xo, co, rs, es))
        tq, ts = call.tensor(qo, output=True), call.tensor(so, output=True)
        call.run(lib.moefuse_act_quant_masked, ctypes.byref(tx), ctypes.byref(tc), _ref(tr),
                 _ref(te), ctypes.byref(tq), ctypes.byref(ts), ctypes.byref(opt))
    return out, scales


def act_mul(x, *, row_scale=None, activation="silu", order="gate_first", limit=0.0,
            intermediate=None, out=None, alpha=0.0, up_offset=0.0, ctx=None):
    """act(gate) * (up + up_offset) [* row_scale] for x [T, 2H], in x's dtype: out [T, H]
    (SwiGLU, GeGLU; gpt-oss: activation="silu_alpha", order="interleaved", limit=7,
    up_offset=1)."""
    if type(x) in _fast.TENSORS or _fast.first_torch(x):
        try:
            o = _fast_result(out, x, _act_mul_shape(x), x.dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.act_mul(ctx, x, row_scale, o, activation, order, limit, intermediate,
                                  alpha, up_offset):
                return o
    xo = _tensors.describe(x, "x")
    rs = _tensors.describe(row_scale, "row_scale")
    c = resolve_context(ctx, [xo, rs])
    out, oo = _result(out, "out", xo, _act_mul_shape(xo), xo.dtype)
    opt = _options.act(activation, order, limit, intermediate, alpha, up_offset)
    with Call(c, "act_mul") as call:
        tx, tr, to = call.tensor(xo), call.tensor(rs), call.tensor(oo, output=True)
        call.run(lib.moefuse_act_mul, ctypes.byref(tx), _ref(tr), ctypes.byref(to),
                 ctypes.byref(opt))
    return out


def quant(x, *, group_size=128, scale_layout="row_major", ue8m0=False, eps=None,
          dtype="f8_e4m3", scale_dtype=None, out=None, scales=None, ctx=None):
    """Per-token-group quantization of x [T, H]: returns (q [T, H], scales)."""
    if type(x) in _fast.TENSORS or _fast.first_torch(x):
        try:
            q, s = _fast_codes(out, scales, x,
                               lambda: _quant_shapes_of(x, group_size, scale_layout), dtype,
                               scale_layout, scale_dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.quant(ctx, x, q, s, group_size, scale_layout, ue8m0, eps):
                return q, s
    xo = _tensors.describe(x, "x")
    c = resolve_context(ctx, [xo])
    q_shape, s_shape = _quant_shapes_of(xo, group_size, scale_layout)
    out, qo = _result(out, "q", xo, q_shape, dtype)
    scales, so = _result(scales, "scales", xo, s_shape,
                         _options.scales_dtype(scale_layout, scale_dtype))
    opt = _options.quant(group_size, scale_layout, ue8m0, eps)
    with Call(c, "quant") as call:
        tx, tq, ts = call.tensor(xo), call.tensor(qo, output=True), call.tensor(so, output=True)
        call.run(lib.moefuse_quant, ctypes.byref(tx), ctypes.byref(tq), ctypes.byref(ts),
                 ctypes.byref(opt))
    return out, scales


def dequant(q, scales, *, group_size=128, scale_layout="row_major", ue8m0=None, eps=None,
            dtype="f32", out=None, ctx=None):
    """out [T, H] = q * scale, in `dtype` (f32, f16 or bf16). ue8m0=None: True when the
    scales are u8 exponents."""
    if type(q) in _fast.TENSORS or _fast.first_torch(q):
        try:
            o = _fast_result(out, q, _dims(q, 2), dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.dequant(ctx, q, scales, o, group_size, scale_layout, ue8m0, eps):
                return o
    qo = _tensors.describe(q, "q")
    so = _tensors.describe(scales, "scales")
    c = resolve_context(ctx, [qo, so])
    if ue8m0 is None:
        ue8m0 = so is not None and so.dtype == "u8"
    out, oo = _result(out, "out", qo, _dims(qo, 2), dtype)
    opt = _options.quant(group_size, scale_layout, ue8m0, eps)
    with Call(c, "dequant") as call:
        tq, ts, to = call.tensor(qo), call.tensor(so), call.tensor(oo, output=True)
        # scales is required: NULL only when not given (an empty one may have no data)
        call.run(lib.moefuse_dequant, ctypes.byref(tq), ctypes.byref(ts) if so else None,
                 ctypes.byref(to), ctypes.byref(opt))
    return out


def _routing(call, ids, weights, expert_map, n_shared=0, shared_scale=0.0,
             shared_weights=None):
    """moefuse_routing; shared experts: the last n_shared of the weights (docs/API.md)."""
    return _capi.Routing(topk_ids=call.tensor(ids), topk_weights=call.tensor(weights),
                         expert_map=call.tensor(expert_map), n_shared=int(n_shared),
                         shared_scale=float(shared_scale),
                         shared_weights=call.tensor(shared_weights))


def moe_gate(x, w1, topk_ids, *, b1=None, expert_map=None, activation="silu",
             order="gate_first", limit=0.0, dtype=None, out=None, alpha=0.0, up_offset=0.0,
             n_shared=0, ctx=None):
    """h [M, k, I] = act(x @ w1[e]^T + b1[e]) gated, per routed slot. x [M, K],
    w1 [E, 2I, K], topk_ids [M, k] i32, expert_map optional [E_global] i32.
    Invalid slots (bad id, or mapped to -1) give rows of 0. dtype: h's, default x's.
    alpha, up_offset: as in act_mul (order "interleaved": w1 and b1 rows 2i gate, 2i + 1 up).
    n_shared: the last n_shared experts of w1 are shared, slots k.. of every token
    (h [M, k + n_shared, I]; docs/API.md, "Shared experts")."""
    if not n_shared and (type(x) in _fast.TENSORS or _fast.first_torch(x)):
        try:
            h = _fast_result(out, x, _moe_gate_shape(x, w1, topk_ids), dtype or x.dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.moe_gate(ctx, x, w1, b1, topk_ids, expert_map, h, activation, order,
                                   limit, alpha, up_offset):
                return h
    ops = [_tensors.describe(a, n) for a, n in ((x, "x"), (w1, "w1"), (b1, "b1"),
                                                (topk_ids, "topk_ids"), (expert_map, "expert_map"))]
    xo, wo, bo, io, mo = ops
    c = resolve_context(ctx, ops)
    out, ho = _result(out, "h", xo, _moe_gate_shape(xo, wo, io, n_shared), dtype or xo.dtype)
    opt = _options.moe(activation, order, limit, alpha, up_offset)
    with Call(c, "moe_gate") as call:
        tx, tw, tb = call.tensor(xo), call.tensor(wo), call.tensor(bo)
        route = _routing(call, io, None, mo, n_shared)
        th = call.tensor(ho, output=True)
        call.run(lib.moefuse_moe_gate, ctypes.byref(tx), ctypes.byref(tw), _ref(tb),
                 ctypes.byref(route), ctypes.byref(th), ctypes.byref(opt))
    return out


def moe_final(h, w2, topk_ids, topk_weights=None, *, b2=None, expert_map=None, reduce=True,
              dtype=None, out=None, n_shared=0, shared_scale=0.0, shared_weights=None,
              ctx=None):
    """y = h[m, j] @ w2[e]^T + b2[e] per slot; reduce=True: out [M, K] = sum over j in order of
    topk_weights[m, j] * y (f32, rounded once); reduce=False: out [M, k, K] = y.
    A given out decides by its rank. dtype: out's, default h's. n_shared, shared_scale (0: 1)
    and shared_weights ([M] f32, optional): the shared experts' slots, last in the sum."""
    if not n_shared and (type(h) in _fast.TENSORS or _fast.first_torch(h)):
        try:
            o = _fast_result(out, h, _moe_final_shape(h, w2, reduce), dtype or h.dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.moe_final(ctx, h, w2, b2, topk_ids, topk_weights, expert_map, o):
                return o
    ops = [_tensors.describe(a, n) for a, n in ((h, "h"), (w2, "w2"), (b2, "b2"),
                                                (topk_ids, "topk_ids"),
                                                (topk_weights, "topk_weights"),
                                                (expert_map, "expert_map"),
                                                (shared_weights, "shared_weights"))]
    ho, wo, bo, io, wto, mo, swo = ops
    c = resolve_context(ctx, ops)
    out, oo = _result(out, "out", ho, _moe_final_shape(ho, wo, reduce), dtype or ho.dtype)
    opt = _options.moe("silu", "gate_first", 0.0)
    with Call(c, "moe_final") as call:
        th, tw, tb = call.tensor(ho), call.tensor(wo), call.tensor(bo)
        route = _routing(call, io, wto, mo, n_shared, shared_scale, swo)
        to = call.tensor(oo, output=True)
        call.run(lib.moefuse_moe_final, ctypes.byref(th), ctypes.byref(tw), _ref(tb),
                 ctypes.byref(route), ctypes.byref(to), ctypes.byref(opt))
    return out


def moe_forward(x, w1, w2, topk_ids, topk_weights, *, b1=None, b2=None, expert_map=None,
                activation="silu", order="gate_first", limit=0.0, dtype=None, out=None,
                alpha=0.0, up_offset=0.0, n_shared=0, shared_scale=0.0, shared_weights=None,
                ctx=None):
    """The whole MoE layer: out [M, K] = sum over the k routed experts of
    topk_weights * (act(x @ w1^T + b1) gated @ w2^T + b2). dtype: out's, default x's.
    n_shared: the last n_shared experts are shared, every token's slots after its k routed
    ones, each weighted shared_scale (0: 1) times shared_weights[m] ([M] f32, optional)."""
    if not n_shared and (type(x) in _fast.TENSORS or _fast.first_torch(x)):
        try:
            o = _fast_result(out, x, _dims(x, 2), dtype or x.dtype)
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.moe_forward(ctx, x, w1, w2, b1, b2, topk_ids, topk_weights, expert_map,
                                      o, activation, order, limit, alpha, up_offset):
                return o
    ops = [_tensors.describe(a, n) for a, n in ((x, "x"), (w1, "w1"), (w2, "w2"), (b1, "b1"),
                                                (b2, "b2"), (topk_ids, "topk_ids"),
                                                (topk_weights, "topk_weights"),
                                                (expert_map, "expert_map"),
                                                (shared_weights, "shared_weights"))]
    xo, w1o, w2o, b1o, b2o, io, wto, mo, swo = ops
    c = resolve_context(ctx, ops)
    out, oo = _result(out, "out", xo, _dims(xo, 2), dtype or xo.dtype)
    opt = _options.moe(activation, order, limit, alpha, up_offset)
    with Call(c, "moe_forward") as call:
        tx, t1, t2 = call.tensor(xo), call.tensor(w1o), call.tensor(w2o)
        tb1, tb2 = call.tensor(b1o), call.tensor(b2o)
        route = _routing(call, io, wto, mo, n_shared, shared_scale, swo)
        to = call.tensor(oo, output=True)
        call.run(lib.moefuse_moe_forward, ctypes.byref(tx), ctypes.byref(t1), ctypes.byref(t2),
                 _ref(tb1), _ref(tb2), ctypes.byref(route), ctypes.byref(to),
                 ctypes.byref(opt))
    return out


def _router_results(op, lo, k, ids, weights):
    """A router's ids [M, k] i32 and weights [M, k] f32: the given ones, or new ones like the
    logits (Operand lo); k defaults to the given ids' width. Returns (ids, Operand, weights,
    Operand)."""
    io = _tensors.describe(ids, "ids")
    if k is None:
        if io is None:
            raise TypeError(f"moefuse {op}: give k, or ids to write into")
        k = _dims(io, 2)[1]
    shape = _topk_shape(lo, k)
    ids, io = (ids, io) if ids is not None else _result(None, "ids", lo, shape, "i32")
    weights, wo = _result(weights, "weights", lo, shape, "f32")
    return ids, io, weights, wo


def topk_softmax(logits, k=None, *, renormalize=False, ids=None, weights=None, ctx=None):
    """Router: softmax over logits [M, E] in f32, the k largest in descending order
    (ties to the lower id). Returns (ids [M, k] i32, weights [M, k] f32); k defaults
    to ids' width when ids is given."""
    if (type(logits) in _fast.TENSORS or _fast.first_torch(logits)) and \
            (k is not None or ids is not None):
        try:
            i, w = ids, weights
            if i is None or w is None:
                shape = _topk_shape(logits, k if k is not None else _dims(ids, 2)[1])
                i = _fast_result(i, logits, shape, "i32")
                w = _fast_result(w, logits, shape, "f32")
        except Exception:  # the ctypes path raises it, after its own checks
            pass
        else:
            if _fast.call.topk_softmax(ctx, logits, renormalize, i, w):
                return i, w
    lo = _tensors.describe(logits, "logits")
    c = resolve_context(ctx, [lo])
    ids, io, weights, wo = _router_results("topk_softmax", lo, k, ids, weights)
    with Call(c, "topk_softmax") as call:
        tl, ti, tw = call.tensor(lo), call.tensor(io, output=True), call.tensor(wo, output=True)
        call.run(lib.moefuse_topk_softmax, ctypes.byref(tl), int(bool(renormalize)),
                 ctypes.byref(ti), ctypes.byref(tw))
    return ids, weights


def topk_route(logits, k=None, *, logit_bias=None, choice_bias=None, scoring="softmax",
               n_group=0, topk_group=0, group_scoring="top2_sum", renormalize=False, scale=1.0,
               ids=None, weights=None, ctx=None):
    """The routers of today's MoE models (docs/NUMERICS.md, "Router (topk_route)"): scores of
    logits [M, E] by `scoring` ("softmax", "sigmoid", or "topk_softmax": the choice on the
    logits, softmax over the k), `logit_bias` [E] added to the logits, `choice_bias` [E] added
    to the scores for the choice only, the choice limited to the best `topk_group` of `n_group`
    groups ("top2_sum" or "max"), `renormalize`, then `scale` (routed_scaling_factor).
    Returns (ids [M, k] i32, weights [M, k] f32); k defaults to ids' width."""
    lo = _tensors.describe(logits, "logits")
    lbo = _tensors.describe(logit_bias, "logit_bias")
    cbo = _tensors.describe(choice_bias, "choice_bias")
    c = resolve_context(ctx, [lo, lbo, cbo])
    ids, io, weights, wo = _router_results("topk_route", lo, k, ids, weights)
    opt = _options.router(scoring, n_group, topk_group, group_scoring, renormalize, scale)
    with Call(c, "topk_route") as call:
        tl, tlb, tcb = call.tensor(lo), call.tensor(lbo), call.tensor(cbo)
        ti, tw = call.tensor(io, output=True), call.tensor(wo, output=True)
        call.run(lib.moefuse_topk_route, ctypes.byref(tl), _ref(tlb), _ref(tcb),
                 ctypes.byref(opt), ctypes.byref(ti), ctypes.byref(tw))
    return ids, weights


def _order_length(topk_ids, experts, block_size):
    M, k = _dims(topk_ids, 2)
    return M * k + experts * (max(int(block_size), 1) - 1)


def routing_metadata(topk_ids, experts, *, block_size=1, expert_map=None, ctx=None):
    """What expert-parallel dispatch and the masked layout need, from topk_ids [M, k] i32 (and
    expert_map [E_global]) for `experts` local experts (docs/NUMERICS.md, "Routing metadata"):
    (counts [E], offsets [E + 1], order [M k + E (block_size - 1)], position [M, k],
    masked_row [M, k]), all i32: the valid slots per expert; where each expert's list starts,
    padded to block_size; the slots m * k + j expert by expert, ascending, -1 in the padding;
    each slot's index in order and its rank within its expert (-1 when invalid)."""
    io = _tensors.describe(topk_ids, "topk_ids")
    mo = _tensors.describe(expert_map, "expert_map")
    c = resolve_context(ctx, [io, mo])
    E = int(experts)
    results = {}
    for name, shape in (("counts", (E,)), ("offsets", (E + 1,)),
                        ("order", (_order_length(io, E, block_size),)),
                        ("position", _dims(io, 2)), ("masked_row", _dims(io, 2))):
        results[name] = _result(None, name, io, shape, "i32")
    with Call(c, "routing_metadata") as call:
        route = _routing(call, io, None, mo)
        meta = _capi.RoutingMeta(**{name: call.tensor(op, output=True)
                                    for name, (_, op) in results.items()})
        call.run(lib.moefuse_routing_metadata, ctypes.byref(route), int(block_size),
                 ctypes.byref(meta))
    return tuple(obj for obj, _ in results.values())
