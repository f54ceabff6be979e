"""A numpy model of docs/NUMERICS.md "FP8 MoE", written from the text: e4m3 codes and scales
decoded, each 128-deep block summed exactly in float64 and rounded once to f32, the block's
scales multiplied in f32 and added with one f32 fused multiply-add, h quantized per 1 x 128
group as `quant` does (reference.quantize)."""

import numpy as np

import reference as ref

F32, F64 = np.float32, np.float64
BLOCK = 128


def scale_values(s):
    """f32 scales as they are; u8 exponents e as 2^(e - 127) (255: NaN)."""
    s = np.asarray(s)
    if s.dtype == np.uint8:
        v = np.ldexp(1.0, s.astype(np.int64) - 127)
        return np.where(s == 255, np.nan, v).astype(F32)
    return s.astype(F32)


def row_scales(s, layout, rows):
    """Activation scales in `layout` -> [rows, Gn] f32 values (row-major)."""
    s = np.asarray(s)
    if layout == "row_major":
        return scale_values(s[:rows])
    if layout == "column_major":
        return scale_values(s[:, :rows].T)
    words = s.view(np.uint32)[:, :rows].T  # packed: byte g % 4 of word (g / 4, t)
    exps = np.stack([(words >> (8 * b)) & 0xFF for b in range(4)], axis=2)
    return scale_values(exps.reshape(rows, -1).astype(np.uint8))


def fma_f32(a, b, c):
    """fmaf(a, b, c) for f32 arrays: a * b is exact in double, and the one rounding to f32 of
    the exact sum is recovered from the double sum and its error (TwoSum)."""
    p = a.astype(F64) * b.astype(F64)
    c = c.astype(F64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    r = s.astype(F32)
    # Only a double sum lying exactly halfway between two f32 values can round the wrong way.
    other = np.nextafter(r, np.where(s > r.astype(F64), F32(np.inf), F32(-np.inf)))
    halfway = (s == (r.astype(F64) + other.astype(F64)) / 2) & (err != 0)
    toward_other = np.sign(err) == np.sign(other.astype(F64) - r.astype(F64))
    return np.where(halfway & toward_other, other, r).astype(F32)


def block_gemm(a_codes, a_scales, w_codes, w_scales):
    """acc [R, N] f32 for activation rows (codes [R, D], scale values [R, D/128]) against one
    expert's weight (codes [N, D], block scale values [N/128, D/128]), blocks in order."""
    a = ref.fp8_decode(np.asarray(a_codes).view(np.uint8)).astype(F64)
    w = ref.fp8_decode(np.asarray(w_codes).view(np.uint8)).astype(F64)
    sw = np.repeat(scale_values(w_scales), BLOCK, axis=0)  # [N, D/128]
    acc = np.zeros((a.shape[0], w.shape[0]), F32)
    for b in range(a.shape[1] // BLOCK):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        with np.errstate(invalid="ignore"):
            p = (a[:, cols] @ w[:, cols].T).astype(F32)  # exact sum, rounded once
        s = scale_values(a_scales)[:, b][:, None] * sw[:, b][None, :]  # f32 product
        acc = fma_f32(p, s, acc)
    return acc


def quantize_x(x, ue8m0=False):
    """An f32/f16/bf16 x [R, K] as `quant` quantizes it: (codes uint8, scale values [R, K/128])."""
    codes, s, _ = ref.quantize(np.asarray(x).astype(F32), BLOCK, ue8m0=ue8m0)
    return codes, s


def gate(x_codes, x_scales, w1, w1_scales, b1=None, act="silu", order="gate_first", limit=0.0):
    """h in f32 [R, I] for rows of one expert (w1 [2I, K] codes, w1_scales [2I/128, K/128])."""
    a = block_gemm(x_codes, x_scales, w1, w1_scales)
    if b1 is not None:
        a = (a + np.asarray(b1).astype(F32)).astype(F32)
    return ref.gated(a, act, order, limit)


def final(h_codes, h_scales, w2, w2_scales, b2=None):
    """y in f32 [R, K] for rows of h of one expert."""
    y = block_gemm(h_codes, h_scales, w2, w2_scales)
    if b2 is not None:
        y = (y + np.asarray(b2).astype(F32)).astype(F32)
    return y
