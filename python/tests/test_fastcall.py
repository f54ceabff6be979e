"""The compiled fast path (moefuse._fastcall): present wherever it was built, and never in the
way of what it does not take. test_fastcall_torch.py compares it with the ctypes path.
"""

import os

import numpy as np
import pytest

import moefuse
from moefuse import _fast


def test_extension_is_loaded_where_it_was_built():
    """A package from pip install . always has the fast path; a Meson build tree has it when
    Meson found Python's headers (its summary says). A broken one fails here either way."""
    if _fast.call is None:
        if _fast.missing and os.environ.get("MOEFUSE_LIBRARY"):
            pytest.skip(f"no fast path in this build tree: {_fast.problem}")
        pytest.fail(f"the fast path is not available: {_fast.problem}")
    assert _fast.call.__name__ == "moefuse._fastcall"
    assert isinstance(_fast.call.calls(), int)


def test_numpy_arrays_take_the_ctypes_path():
    if _fast.call is None:
        pytest.skip(f"the fast path is not available: {_fast.problem}")
    before = _fast.call.calls()
    q, s = moefuse.act_quant(np.ones((2, 256), np.float32))
    assert q.shape == (2, 128) and s.shape == (2, 1)
    assert _fast.call.calls() == before
