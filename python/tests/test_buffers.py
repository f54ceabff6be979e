"""moefuse.Buffer: operands kept in the backend's memory (cl_mem on OpenCL), results alike."""

import numpy as np
import pytest

import moefuse
from checks import codes_of, random_input


def test_buffers_in_buffers_out(ctx, rng):
    x = random_input(rng, (5, 512), "bf16")
    xb = moefuse.Buffer.from_array(x, ctx)
    assert xb.shape == (5, 512) and xb.dtype == "bf16" and xb.ctx is ctx
    q, s = moefuse.act_quant(xb, scale_layout="column_major")  # ctx taken from the Buffer
    assert isinstance(q, moefuse.Buffer) and q.dtype == "f8_e4m3" and s.shape == (2, 8)
    ctx.synchronize()
    q_host, s_host = moefuse.act_quant(x, scale_layout="column_major", ctx=ctx)
    np.testing.assert_array_equal(codes_of(q.download()), codes_of(q_host))
    np.testing.assert_array_equal(s.download(), s_host)
    np.testing.assert_array_equal(xb.download().view(np.uint16), x.view(np.uint16))


def test_moe_forward_on_buffers(ctx, rng):
    M, K, I, E, k = 3, 32, 16, 2, 2
    x = random_input(rng, (M, K), "f32", 1.0)
    w1 = random_input(rng, (E, 2 * I, K), "f32", 0.2)
    w2 = random_input(rng, (E, K, I), "f32", 0.2)
    ids = np.array([[0, 1], [1, -1], [0, 0]], np.int32)
    weights = np.full((M, k), 0.5, np.float32)
    up = [moefuse.Buffer.from_array(a, ctx) for a in (x, w1, w2, ids, weights)]
    out = moefuse.moe_forward(*up)
    np.testing.assert_array_equal(out.download(), moefuse.moe_forward(x, w1, w2, ids, weights,
                                                                       ctx=ctx))


def test_buffer_of_another_context_is_refused(rng):
    x = moefuse.Buffer.from_array(random_input(rng, (2, 256), "f32"), moefuse.Context("cpu"))
    with pytest.raises(moefuse.WrongDeviceError, match="x is a Buffer of another context"):
        moefuse.act_mul(x, ctx=moefuse.Context("cpu"))


def test_upload_checks_shape_and_dtype(cpu):
    buf = moefuse.Buffer(cpu, (2, 3), "f32")
    with pytest.raises(ValueError, match="upload"):
        buf.upload(np.zeros((3, 2), np.float32))
    with pytest.raises(moefuse.DtypeError):
        moefuse.Buffer.from_array(np.zeros(3, np.float64), cpu)
