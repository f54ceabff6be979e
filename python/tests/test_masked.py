"""act_quant_masked: the 3-D expert-masked layout, counts clamping, untouched and zeroed tails."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import assert_codes_match, assert_scales_match, codes_of, random_input

CANARY = 0x5A


@pytest.mark.parametrize("layout,ue8m0,sdtype", [
    ("row_major", False, "f32"), ("column_major", False, "f32"),
    ("packed_ue8m0", True, "i32"), ("row_major", True, "u8")])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_act_quant_masked(ctx, rng, layout, ue8m0, sdtype, zero_tail):
    E, Tmax, H, G = 4, 6, 128, 32
    counts = np.array([-3, 9, 4, 0], dtype=np.int32)  # clamped to [0, Tmax]: 0, 6, 4, 0
    n = np.clip(counts, 0, Tmax)
    x = random_input(rng, (E, Tmax, 2 * H), "bf16")
    row_scale = rng.uniform(0.5, 2.0, (E, Tmax)).astype(np.float32)
    expert_scale = rng.uniform(0.5, 2.0, E).astype(np.float32).astype(ref.BF16)

    # Outputs full of a canary: rows past the counts must keep it unless zero_tail.
    q = np.full((E, Tmax, H), CANARY, dtype=np.uint8).view(ref.FP8)
    shape = {"row_major": (E, Tmax, H // G), "column_major": (E, H // G, 8),
             "packed_ue8m0": (E, 1, 8)}[layout]
    sdt = np.dtype({"f32": np.float32, "u8": np.uint8, "i32": np.int32}[sdtype])
    scales = np.full(shape[:-1] + (shape[-1] * sdt.itemsize,), CANARY, np.uint8).view(sdt)
    canary_scale = scales.flat[0]

    moefuse.act_quant_masked(x, counts, row_scale=row_scale, expert_scale=expert_scale,
                             group_size=G, scale_layout=layout, ue8m0=ue8m0,
                             zero_tail=zero_tail, out=q, scales=scales, ctx=ctx)

    for e in range(E):
        t = n[e]
        h = ref.gated(x[e, :t], row_scale=row_scale[e, :t], expert_scale=expert_scale[e:e + 1])
        codes, s, exps = ref.quantize(h, G, ue8m0=ue8m0)
        assert_codes_match(q[e, :t], codes)
        tail_codes = codes_of(q[e, t:])
        assert np.all(tail_codes == (0 if zero_tail else CANARY))
        want = ref.scales_in_layout(s, exps, layout, as_u8=sdtype == "u8")
        if layout == "row_major":
            assert_scales_match(scales[e, :t], want)
            assert np.all(scales[e, t:] == (0 if zero_tail else canary_scale))
        else:  # [.., Ta]: columns t..Tmax-1 are the tail, Tmax..Ta-1 the padding (always 0)
            assert_scales_match(scales[e, :, :t], want[:, :t])
            assert np.all(scales[e, :, t:Tmax] == (0 if zero_tail else canary_scale))
            assert np.all(scales[e, :, Tmax:] == 0)


def test_masked_allocates_zeroed_results(ctx, rng):
    E, Tmax, H = 2, 3, 128
    x = random_input(rng, (E, Tmax, 2 * H), "f32")
    q, scales = moefuse.act_quant_masked(x, np.array([1, 2], dtype=np.int32), ctx=ctx)
    assert q.shape == (E, Tmax, H) and scales.shape == (E, Tmax, 1)
    assert np.all(codes_of(q)[0, 1:] == 0) and np.all(scales[0, 1:] == 0)
    assert np.all(scales[1, :2] > 0)
