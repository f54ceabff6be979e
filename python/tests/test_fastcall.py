"""The compiled fast path (moefuse._fastcall): present wherever it was built, and never in the
way of what it does not take. test_fastcall_torch.py compares it with the ctypes path.
"""

import os
import subprocess
import sys

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


def test_import_moefuse_does_not_import_torch():
    """Importing the package stays cheap: torch is read only when the caller already has it."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(moefuse.__file__)))
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", "import sys, moefuse; moefuse.act_mul("
                          "__import__('numpy').zeros((2, 256), 'float32')); "
                          "print('torch' in sys.modules)"],
                         env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"]
