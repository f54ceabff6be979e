"""The FP8 MoE calls on torch tensors (float8_e4m3fn weights, bf16 activations): the bits of the
numpy calls on the CPU; on CUDA within the bound docs/NUMERICS.md gives its Hopper path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import moefuse  # noqa: E402
import reference as ref  # noqa: E402
from test_moe_fp8 import problem  # noqa: E402
from torch_devices import DEVICES  # noqa: E402


def as_torch(a, device):
    """numpy (ml_dtypes bf16 / FP8 through their bits) -> torch on device; None stays None."""
    if a is None:
        return None
    special = {ref.FP8: (np.uint8, torch.float8_e4m3fn), ref.BF16: (np.int16, torch.bfloat16)}
    if a.dtype in special:
        bits, dtype = special[a.dtype]
        return torch.from_numpy(np.ascontiguousarray(a).view(bits)).view(dtype).to(device)
    return torch.from_numpy(a).to(device)


def bits(t):
    return t.cpu().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_inputs(rng, device):
    arrays = problem(rng, bias=True)
    x, w1, w1s, w2, w2s, ids, weights, b1, b2 = (as_torch(a, device) for a in arrays)
    want_h, want_hs = moefuse.moe_gate_fp8(*arrays[:3], arrays[5], b1=arrays[7], ctx="cpu")
    want = moefuse.moe_forward_fp8(*arrays[:7], b1=arrays[7], b2=arrays[8], ctx="cpu")
    try:
        h, hs = moefuse.moe_gate_fp8(x, w1, w1s, ids, b1=b1)
        out = moefuse.moe_forward_fp8(x, w1, w1s, w2, w2s, ids, weights, b1=b1, b2=b2)
    except moefuse.UnsupportedError as exc:
        if device == "cpu":
            raise
        pytest.skip(str(exc))
    assert h.dtype == torch.float8_e4m3fn and hs.dtype == torch.float32
    assert out.dtype == torch.bfloat16 and out.device.type == device
    if device == "cpu":
        assert np.array_equal(bits(h).numpy(), want_h.view(np.uint8))
        assert np.array_equal(bits(hs).numpy(), want_hs.view(np.int32))
        assert np.array_equal(bits(out).numpy(), want.view(np.int16))
    else:  # a Hopper path rounds block sums its own way (NUMERICS, "Agreement")
        got = out.float().cpu().numpy()
        assert ref.rel_error(got, want.astype(np.float32)) <= 2e-2


def test_other_float8_flavours_are_refused(rng):
    x, w1, w1s, _, _, ids, *_ = (as_torch(a, "cpu") for a in problem(rng))
    for flavour in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        other = w1.float().to(getattr(torch, flavour))
        with pytest.raises(moefuse.DtypeError, match="float8_e4m3fn only"):
            moefuse.moe_gate_fp8(x, other, w1s, ids)
