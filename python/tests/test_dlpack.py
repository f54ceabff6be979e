"""Objects known only through the DLPack protocol are read and written in place."""

import numpy as np

import moefuse
import reference as ref
from checks import random_input


class DLPackOnly:
    """An array known to moefuse only through the DLPack protocol."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_dlpack_objects_are_read_and_written_in_place(ctx, rng):
    x = random_input(rng, (3, 256), "f32")
    out = np.zeros((3, 128), np.float32)
    moefuse.act_mul(DLPackOnly(x), out=DLPackOnly(out), ctx=ctx)
    np.testing.assert_array_equal(out, moefuse.act_mul(x, ctx=ctx))
    q, s = moefuse.act_quant(DLPackOnly(x[:, :]), ctx=ctx)  # results: numpy, for host data
    assert isinstance(q, np.ndarray) and q.dtype == ref.FP8
