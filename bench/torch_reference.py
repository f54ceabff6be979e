"""moefuse's operations written in plain PyTorch, the way a PyTorch user would write them.

The reference the torch tests (python/tests/test_torch.py) check moefuse against, and
what bench/compare_torch.py times in eager mode and under torch.compile. Math as in
docs/NUMERICS.md; arithmetic order is PyTorch's own (silu is x * sigmoid(x), for
instance), so results agree with moefuse to rounding, not bit for bit.
"""

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
I8_MAX = 127.0
LAYOUTS = ("row_major", "column_major", "packed_ue8m0")

# ------------------------------------------------------------ gated activation


def gated(x, activation="silu", order="gate_first", limit=0.0, row_scale=None,
          expert_scale=None):
    """act(gate) * up [* row_scale] [* expert_scale] in f32, from x [..., 2H]."""
    H = x.shape[-1] // 2
    x = x.float()
    g, u = (x[..., :H], x[..., H:]) if order == "gate_first" else (x[..., H:], x[..., :H])
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    if activation == "silu":
        a = F.silu(g)
    elif activation == "gelu":
        a = F.gelu(g)
    else:
        a = F.gelu(g, approximate="tanh")
    h = a * u
    if row_scale is not None:
        h = h * row_scale.float()[..., None]
    if expert_scale is not None:
        h = h * expert_scale.float().reshape(-1, *([1] * (h.dim() - 1)))
    return h


def act_mul(x, activation="silu", order="gate_first", limit=0.0, row_scale=None):
    return gated(x, activation, order, limit, row_scale).to(x.dtype)


# ---------------------------------------------------------------- quantization


def ue8m0_exponent(s):
    """Biased exponent of s rounded up to a power of two, in [1, 254] (from the bits)."""
    bits = s.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return e.clamp(1, 254)


def group_quant(h, group=128, dtype=FP8, ue8m0=False, eps=1e-10):
    """h [..., T, H] f32 -> codes [..., T, H], scales [..., T, H/G] f32, exponents or None."""
    groups = h.unflatten(-1, (h.shape[-1] // group, group))
    amax = torch.where(groups.isfinite(), groups.abs(), 0.0).amax(-1).clamp(min=eps)
    # A tensor divisor, not a Python number: PyTorch's CUDA division by a CPU scalar
    # multiplies by its reciprocal, one bit short of the IEEE quotient the spec asks for.
    s = amax / torch.full_like(amax, FP8_MAX if dtype == FP8 else I8_MAX)
    exps = None
    if ue8m0:
        exps = ue8m0_exponent(s)
        s = (exps << 23).view(torch.float32)  # 2^(e - 127)
    y = groups / s[..., None]
    if dtype == FP8:
        q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8)  # clamp keeps NaN: the NaN code
    else:
        q = torch.nan_to_num(y, nan=0.0).round().clamp(-I8_MAX, I8_MAX).to(torch.int8)
    return q.flatten(-2), s, exps


def scales_layout(s, exps, layout="row_major", as_u8=False):
    """Row-major scales [..., T, Gn] (and exponents) -> the tensor moefuse writes."""
    T, Gn = s.shape[-2:]
    Ta = (T + 3) // 4 * 4
    if layout == "packed_ue8m0":
        e = F.pad(exps.to(torch.int64), (0, (-Gn) % 4))       # [..., T, 4 * ceil(Gn / 4)]
        e = e.unflatten(-1, (e.shape[-1] // 4, 4))
        shifts = torch.arange(4, device=e.device) * 8
        words = (e << shifts).sum(-1)                          # little-endian bytes
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        return F.pad(words, (0, 0, 0, Ta - T)).transpose(-1, -2).contiguous()
    vals = exps.to(torch.uint8) if as_u8 else s
    if layout == "row_major":
        return vals
    return F.pad(vals, (0, 0, 0, Ta - T)).transpose(-1, -2).contiguous()


def act_quant(x, group=128, layout="row_major", ue8m0=False, dtype=FP8, activation="silu",
              order="gate_first", limit=0.0, row_scale=None, scale_u8=False):
    """x [T, 2H] -> (q [T, H], scales in `layout`), like moefuse.act_quant."""
    q, s, exps = group_quant(gated(x, activation, order, limit, row_scale), group, dtype,
                             ue8m0 or layout == "packed_ue8m0")
    return q, scales_layout(s, exps, layout, scale_u8)


def quant(x, group=128, layout="row_major", ue8m0=False, dtype=FP8):
    q, s, exps = group_quant(x.float(), group, dtype, ue8m0 or layout == "packed_ue8m0")
    return q, scales_layout(s, exps, layout)


def act_quant_masked(x, counts, group=128, layout="row_major", ue8m0=False, dtype=FP8,
                     row_scale=None, expert_scale=None):
    """x [E, Tmax, 2H]: every row computed, rows t >= counts[e] zeroed (moefuse's zero_tail)."""
    E, Tmax, _ = x.shape
    valid = torch.arange(Tmax, device=x.device)[None, :] < counts.clamp(0, Tmax)[:, None]
    # Rows are zeroed before quantizing (codes 0), their scales after (scale 0).
    h = torch.where(valid[..., None], gated(x, row_scale=row_scale, expert_scale=expert_scale),
                    0.0)
    q, s, exps = group_quant(h, group, dtype, ue8m0 or layout == "packed_ue8m0")
    s = torch.where(valid[..., None], s, 0.0)
    exps = None if exps is None else torch.where(valid[..., None], exps, 0)
    return q, scales_layout(s, exps, layout)


def dequant(q, s, group=128):
    """Row-major scales only: q [T, H] * s [T, H/G] in f32."""
    return (q.float().unflatten(-1, (q.shape[-1] // group, group)) * s[..., None]).flatten(-2)


# ---------------------------------------------------------------------- router


def topk_softmax(logits, k, renormalize=False):
    p = torch.softmax(logits.float(), dim=-1)
    weights, ids = p.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


# ------------------------------------------------------------------------- MoE


def local_ids(ids, E, expert_map=None):
    """Local expert per slot, -1 where the slot is invalid."""
    ids = ids.long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < E), ids, -1)


def _slots_by_expert(local, E):
    """(slot indices sorted by expert, per-expert counts on the host): one sync."""
    flat = local.flatten()
    order = torch.argsort(torch.where(flat >= 0, flat, E), stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=E).tolist()
    return order, counts


def expert_ffn(xs, w1e, w2e, activation="silu"):
    """One expert on its tokens: act(xs @ w1e^T) gated, in xs's dtype, @ w2e^T."""
    h = gated(xs @ w1e.T, activation).to(xs.dtype)
    return h @ w2e.T


def moe_forward(x, w1, w2, ids, weights, activation="silu", expert_map=None, compute=None,
                ffn=expert_ffn):
    """The MoE layer as an eager loop over the experts that got tokens (the usual PyTorch
    way). compute=torch.float32 upcasts the GEMMs: the precise reference; ffn replaces the
    per-expert body (bench: its torch.compile'd version)."""
    M, K = x.shape
    E, k = w1.shape[0], ids.shape[1]
    order, counts = _slots_by_expert(local_ids(ids, E, expert_map), E)
    out = torch.zeros(M, K, dtype=torch.float32, device=x.device)
    flat_w = weights.flatten().float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        rows = slots // k
        xs, w1e, w2e = x[rows], w1[e], w2[e]
        if compute is not None:
            xs, w1e, w2e = xs.to(compute), w1e.to(compute), w2e.to(compute)
        y = ffn(xs, w1e, w2e, activation)
        out.index_add_(0, rows, y.float() * flat_w[slots, None])
    return out.to(x.dtype)


def moe_gate(x, w1, ids, b1=None, activation="silu", order="gate_first", limit=0.0,
             expert_map=None, out_dtype=None):
    """h [M, k, I] like moefuse.moe_gate (f32 GEMMs, invalid slots 0)."""
    M, k = ids.shape
    E, I = w1.shape[0], w1.shape[1] // 2
    local = local_ids(ids, E, expert_map).flatten()
    h = torch.zeros(M * k, I, dtype=torch.float32, device=x.device)
    for e in local.unique().tolist():
        if e < 0:
            continue
        slots = (local == e).nonzero().squeeze(1)
        a = x[slots // k].float() @ w1[e].float().T
        if b1 is not None:
            a = a + b1[e].float()
        h[slots] = gated(a, activation, order, limit)
    return h.view(M, k, I).to(out_dtype or x.dtype)


def moe_final(h, w2, ids, weights=None, b2=None, expert_map=None, reduce=True, out_dtype=None):
    """out [M, K] (weighted sum over slots) or [M, k, K] like moefuse.moe_final."""
    M, k, _ = h.shape
    E, K = w2.shape[0], w2.shape[1]
    local = local_ids(ids, E, expert_map).flatten()
    y = torch.zeros(M * k, K, dtype=torch.float32, device=h.device)
    for e in local.unique().tolist():
        if e < 0:
            continue
        slots = (local == e).nonzero().squeeze(1)
        y[slots] = h.reshape(M * k, -1)[slots].float() @ w2[e].float().T
        if b2 is not None:
            y[slots] += b2[e].float()
    y = y.view(M, k, K)
    if not reduce:
        return y.to(out_dtype or h.dtype)
    w = torch.where(local.view(M, k) >= 0, weights.float(), 0.0)
    return (w[..., None] * y).sum(1).to(out_dtype or h.dtype)


def moe_forward_grouped_mm(x, w1, w2, ids, weights, activation="silu"):
    """The layer with torch._grouped_mm (bf16, CUDA, sm_80+): tokens sorted by expert, one
    grouped GEMM per projection, no host sync. Every id must be a valid expert."""
    M, K = x.shape
    E, k = w1.shape[0], ids.shape[1]
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    rows = order // k
    a = torch._grouped_mm(x[rows], w1.transpose(1, 2), offs=offs)
    h = gated(a, activation).to(x.dtype)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(M, K, dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * weights.flatten().float()[order, None])
    return out.to(x.dtype)
