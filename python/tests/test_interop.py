"""The same calls on torch CPU tensors: no copies, the same results as on numpy arrays."""

import numpy as np
import pytest

import moefuse
import reference as ref
from checks import codes_of, random_input

torch = pytest.importorskip("torch", reason="torch is not installed (numpy covers the rest)")


def _t(a):
    """numpy (ml_dtypes included) -> torch CPU tensor with the same bits."""
    if a.dtype == ref.BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_torch_cpu_tensors_match_numpy(ctx, rng, dtype):
    x = random_input(rng, (5, 512), dtype)
    q_np, s_np = moefuse.act_quant(x, scale_layout="column_major", ctx=ctx)
    q_t, s_t = moefuse.act_quant(_t(x), scale_layout="column_major", ctx=ctx)
    assert q_t.dtype == torch.float8_e4m3fn and s_t.dtype == torch.float32
    np.testing.assert_array_equal(q_t.view(torch.uint8).numpy(), codes_of(q_np))
    np.testing.assert_array_equal(s_t.numpy(), s_np)
    qi, _ = moefuse.act_quant(_t(x), dtype=torch.int8, ctx=ctx)
    assert qi.dtype == torch.int8


def test_torch_views_are_written_in_place(ctx, rng):
    x = _t(random_input(rng, (4, 300), "bf16"))[:, 10:266]  # a slice: padded rows
    out_mem = torch.full((4, 140), 7.0, dtype=torch.bfloat16)
    out = out_mem[:, 4:132]
    assert moefuse.act_mul(x, out=out, ctx=ctx) is out
    want = ref.gated(x.float().numpy())
    np.testing.assert_allclose(out.float().numpy(), ref.bf16_round(want), rtol=2 ** -7)
    assert torch.all(out_mem[:, :4] == 7) and torch.all(out_mem[:, 132:] == 7)


def test_torch_moe_and_router(ctx, rng):
    M, K, I, E, k = 4, 32, 16, 3, 2
    x = _t(random_input(rng, (M, K), "bf16", 1.0))
    w1 = _t(random_input(rng, (E, 2 * I, K), "bf16", 0.2))
    w2 = _t(random_input(rng, (E, K, I), "bf16", 0.2))
    logits = torch.from_numpy(random_input(rng, (M, E), "f32"))
    ids, weights = moefuse.topk_softmax(logits, k, renormalize=True, ctx=ctx)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    out = moefuse.moe_forward(x, w1, w2, ids, weights, ctx=ctx)
    assert out.dtype == torch.bfloat16 and out.shape == (M, K)
    h = ref.to_dtype(ref.moe_gate(x.float().numpy(), w1.float().numpy(), ids.numpy()), "bf16")
    want = ref.moe_final(h, w2.float().numpy(), ids.numpy(), weights.numpy())
    assert ref.rel_error(out.float().numpy(), want) <= 8e-3
