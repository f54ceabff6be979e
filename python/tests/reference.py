"""An independent numpy model of docs/NUMERICS.md, to test the binding (and the library) against.

Written from the text, not from the C code: f32 arithmetic in the documented order
(numpy's float32 exp may differ from the C library's expf by an ulp, and erf comes
from float64), FP8/bf16/int8 encodings computed from their definitions, GEMMs in
float64.
"""

import math

import ml_dtypes
import numpy as np

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0
I8_MAX = 127.0

# ---------------------------------------------------------------- conversions


def bf16_round(x):
    """f32 -> nearest bf16 (ties to even), returned as f32. NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    out = rounded.astype(np.uint32).view(F32)
    return np.where(np.isnan(x), F32(np.nan), out).astype(F32)


def to_dtype(x, dtype):
    """Round f32 values once to a float dtype name ("f32", "f16", "bf16"), as numpy values."""
    x = np.asarray(x, dtype=F32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    return bf16_round(x).astype(BF16)  # exact: already bf16 values


def fp8_encode(v):
    """f32 -> e4m3fn codes (uint8): RNE, saturate to 448, Inf -> +-448, NaN -> 0x7F | sign."""
    v = np.asarray(v, dtype=np.float64)
    sign = np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    a = np.abs(v)
    finite = np.isfinite(a)
    a = np.where(finite, a, 0.0)
    _, e = np.frexp(np.where(a > 0, a, 1.0))  # a = f * 2^e, f in [0.5, 1)
    e = np.maximum(e - 1, -6)                 # unbiased exponent, subnormals share -6
    step = np.ldexp(1.0, e - 3)               # spacing of the codes at that exponent
    k = np.rint(a / step)                     # exact: a power-of-two scaling, ties to even
    value = k * step
    # k counts steps from 0 in [2^e, 2^(e+1)) (or from 0 for subnormals)
    exp_field = np.where(k >= 16, e + 8, np.where(k >= 8, e + 7, 0))
    mant = np.where(k >= 16, 0, np.where(k >= 8, k - 8, k))
    normal = (exp_field << 3 | mant.astype(np.int64))
    code = np.where(value >= FP8_MAX, 0x7E, normal).astype(np.uint8)
    code = np.where(finite, code, np.where(np.isnan(v), 0x7F, 0x7E)).astype(np.uint8)
    return code | sign


def fp8_decode(code):
    code = np.asarray(code, dtype=np.uint8)
    sign = np.where(code & 0x80, -1.0, 1.0)
    e = (code >> 3) & 0xF
    m = (code & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * np.ldexp(1.0, e.astype(np.int64) - 7))
    mag = np.where((code & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(F32)


def i8_encode(v):
    v = np.asarray(v, dtype=F32)
    out = np.clip(np.rint(np.where(np.isnan(v), 0, v)), -127, 127)
    return out.astype(np.int8)


# ------------------------------------------------------------ gated activation


def _erf32(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(F32)


SILU_ALPHA_DEFAULT = F32(1.702)  # silu_alpha's alpha when the option is 0 (gpt-oss's)


def activate(g, act, alpha=0.0):
    g = g.astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        if act == "silu":
            return g / (F32(1) + np.exp(-g))
        if act == "silu_alpha":
            a = (F32(alpha) if alpha else SILU_ALPHA_DEFAULT) * g
            return g / (F32(1) + np.exp(-a))
        if act == "gelu":
            return (F32(0.5) * g) * (F32(1) + _erf32(g * F32(0.70710678118654752)))
        if act == "gelu_tanh":
            inner = F32(0.7978845608028654) * (g + F32(0.044715) * ((g * g) * g))
            return (F32(0.5) * g) * (F32(1) + np.tanh(inner))
    raise ValueError(act)


def gated(x, act="silu", order="gate_first", limit=0.0, intermediate=None, row_scale=None,
          expert_scale=None, alpha=0.0, up_offset=0.0):
    """h [..., H] in f32 from x [..., 2H] (any float dtype), per NUMERICS 'Gated activation'."""
    x = np.asarray(x).astype(F32)
    H = x.shape[-1] // 2
    if order == "interleaved":
        g, u = x[..., 0::2], x[..., 1::2]
    else:
        g, u = (x[..., :H], x[..., H:]) if order == "gate_first" else (x[..., H:], x[..., :H])
    if limit > 0:
        lim = F32(limit)
        g = np.where(g > lim, lim, g)
        u = np.where(u > lim, lim, np.where(u < -lim, -lim, u))
    if up_offset:
        u = (u + F32(up_offset)).astype(F32)
    a = activate(g, act, alpha)
    if intermediate == "bf16":
        a = bf16_round(a)
    with np.errstate(over="ignore", invalid="ignore"):
        h = a * u
        if row_scale is not None:
            h = h * np.asarray(row_scale, F32)[..., None]
        if expert_scale is not None:
            h = h * np.asarray(expert_scale).astype(F32).reshape(-1, *([1] * (h.ndim - 1)))
    if intermediate == "bf16":
        h = bf16_round(h)
    return h.astype(F32)


# ---------------------------------------------------------------- quantization


def _ue8m0(s):
    bits = s.astype(F32).view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int64) + ((bits & 0x7FFFFF) != 0)
    return np.clip(e, 1, 254)


def quantize(h, group=128, code="f8_e4m3", ue8m0=False, eps=1e-10):
    """h [T, H] f32 -> codes [T, H] (uint8 for f8, int8), scales [T, Gn] f32, exponents or None."""
    T, H = h.shape
    groups = h.reshape(T, H // group, group)
    finite = np.where(np.isfinite(groups), np.abs(groups), 0).astype(F32)
    amax = np.maximum(finite.max(axis=2), F32(eps))
    s = (amax / F32(FP8_MAX if code == "f8_e4m3" else I8_MAX)).astype(F32)
    exps = None
    if ue8m0:
        exps = _ue8m0(s)
        s = np.ldexp(np.ones_like(s, dtype=np.float64), exps - 127).astype(F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scaled = (groups / s[:, :, None]).astype(F32)
    # Inf / s stays Inf and NaN / s NaN, so the encoders' rules for them apply unchanged.
    codes = fp8_encode(scaled) if code == "f8_e4m3" else i8_encode(scaled)
    return codes.reshape(T, H), s, exps


def scales_in_layout(s, exps, layout, as_u8=False):
    """Row-major scales [T, Gn] (and exponents) -> the tensor the C API writes."""
    T, Gn = s.shape
    Ta = (T + 3) // 4 * 4
    if layout == "packed_ue8m0":
        words = np.zeros(((Gn + 3) // 4, Ta), dtype=np.uint32)
        for g in range(Gn):
            words[g // 4, :T] |= exps[:, g].astype(np.uint32) << (8 * (g % 4))
        return words.view(np.int32)
    vals = exps.astype(np.uint8) if as_u8 else s
    if layout == "row_major":
        return vals
    out = np.zeros((Gn, Ta), dtype=vals.dtype)
    out[:, :T] = vals.T
    return out


def dequantize(codes, s, group=128, code="f8_e4m3"):
    vals = fp8_decode(codes) if code == "f8_e4m3" else codes.astype(F32)
    T, H = vals.shape
    return (vals.reshape(T, H // group, group) * s[:, :, None]).reshape(T, H).astype(F32)


# ------------------------------------------------------------------------- MoE


def local_experts(ids, E, expert_map=None):
    """Local expert per slot, -1 where the slot is invalid."""
    ids = np.asarray(ids, dtype=np.int64)
    if expert_map is None:
        return np.where((ids >= 0) & (ids < E), ids, -1)
    emap = np.asarray(expert_map, dtype=np.int64)
    inside = (ids >= 0) & (ids < len(emap))
    local = np.where(inside, emap[np.clip(ids, 0, len(emap) - 1)], -1)
    return np.where((local >= 0) & (local < E), local, -1)


def moe_gate(x, w1, ids, b1=None, expert_map=None, act="silu", order="gate_first", limit=0.0,
             alpha=0.0, up_offset=0.0):
    """h [M, k, I] in f64 (the caller rounds to h's dtype)."""
    x64 = np.asarray(x).astype(np.float64)
    w64 = np.asarray(w1).astype(np.float64)
    E, twoI, _ = w64.shape
    I = twoI // 2
    local = local_experts(ids, E, expert_map)
    M, k = local.shape
    h = np.zeros((M, k, I))
    for m in range(M):
        for j in range(k):
            e = local[m, j]
            if e < 0:
                continue
            a = w64[e] @ x64[m]
            if b1 is not None:
                a = a + np.asarray(b1[e]).astype(np.float64)
            a32 = a.astype(F32)[None, :]
            h[m, j] = gated(a32, act, order, limit, alpha=alpha, up_offset=up_offset)[0]
    return h


def moe_final(h, w2, ids, weights=None, b2=None, expert_map=None, reduce=True):
    h64 = np.asarray(h).astype(np.float64)
    w64 = np.asarray(w2).astype(np.float64)
    E, K, _ = w64.shape
    local = local_experts(ids, E, expert_map)
    M, k = local.shape
    y = np.zeros((M, k, K))
    for m in range(M):
        for j in range(k):
            e = local[m, j]
            if e >= 0:
                y[m, j] = w64[e] @ h64[m, j]
                if b2 is not None:
                    y[m, j] += np.asarray(b2[e]).astype(np.float64)
    if not reduce:
        return y
    wts = np.where(local >= 0, np.asarray(weights, dtype=np.float64), 0.0)
    return (wts[:, :, None] * y).sum(axis=1)


def rel_error(got, want):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    norm = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (norm if norm > 0 else 1.0)


# ---------------------------------------------------------------------- router


def topk_softmax(logits, k, renormalize=False):
    """(ids [M, k] i32, weights [M, k] f32), with the NaN and Inf rules of NUMERICS."""
    lg = np.asarray(logits).astype(np.float64)
    M, E = lg.shape
    ids = np.zeros((M, k), dtype=np.int32)
    wts = np.zeros((M, k), dtype=np.float64)
    for m in range(M):
        row = lg[m]
        nan = np.isnan(row)
        p = np.zeros(E)
        finite_or_inf = row[~nan]
        if finite_or_inf.size:
            mx = finite_or_inf.max()
            if mx == np.inf:
                p = np.where(row == np.inf, 1.0, 0.0)
            elif mx == -np.inf:
                p = np.where(~nan, 1.0, 0.0)
            else:
                p = np.where(nan, 0.0, np.exp(np.where(nan, 0, row) - mx))
            p = p / p.sum()
        order = sorted(range(E), key=lambda i: (bool(nan[i]), -p[i], i))[:k]
        ids[m] = order
        wts[m] = p[order]
        if renormalize and wts[m].sum() > 0:
            wts[m] /= wts[m].sum()
    return ids, wts.astype(F32)


def topk_route(logits, k, logit_bias=None, choice_bias=None, scoring="softmax", n_group=0,
               topk_group=0, group_scoring="top2_sum", renormalize=False, scale=1.0):
    """(ids, weights) of the grouped / biased routers, in float64, as the models' inference
    code forms them (DeepSeek-V3 noaux_tc, DeepSeek-V2 group_limited_greedy, gpt-oss), with
    NUMERICS' choices where they differ: dropped groups excluded, no 1e-20 in the division.
    Finite inputs only."""
    lg = np.asarray(logits).astype(np.float64)
    if logit_bias is not None:
        lg = lg + np.asarray(logit_bias).astype(np.float64)
    M, E = lg.shape
    if scoring == "softmax":
        e = np.exp(lg - lg.max(axis=1, keepdims=True))
        s = e / e.sum(axis=1, keepdims=True)
    elif scoring == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-lg))
    else:
        s = lg
    c = s + (np.asarray(choice_bias).astype(np.float64) if choice_bias is not None else 0.0)
    ids = np.zeros((M, k), dtype=np.int32)
    wts = np.zeros((M, k))
    G = n_group if n_group > 1 else 1
    per = E // G
    for m in range(M):
        cand = np.ones(E, dtype=bool)
        if G > 1:
            grp = c[m].reshape(G, per)
            top = -np.sort(-grp, axis=1)
            gs = top[:, 0] if group_scoring == "max" or per == 1 else top[:, 0] + top[:, 1]
            kept = sorted(range(G), key=lambda g: (-gs[g], g))[:topk_group]
            cand = np.zeros(E, dtype=bool)
            for g in kept:
                cand[g * per:(g + 1) * per] = True
        order = sorted(np.flatnonzero(cand), key=lambda i: (-c[m, i], i))[:k]
        ids[m] = order
        if scoring == "topk_softmax":
            v = lg[m, order]
            w = np.exp(v - v.max())
            wts[m] = w / w.sum()
        else:
            wts[m] = s[m, order]
        if renormalize:
            wts[m] /= wts[m].sum()
    return ids, (wts * scale).astype(F32)
