"""Fixtures: the backends to run on, and random data.

Run from the repository root with the package installed (pip install .), or
against a Meson build without installing (the binding then comes from python/):
    MOEFUSE_LIBRARY=build/src/libmoefuse.so pytest python/tests
"""

import os
import sys
import zlib

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # reference.py, checks.py
if os.environ.get("MOEFUSE_LIBRARY"):  # a build tree: the binding from the same tree
    sys.path.insert(0, os.path.join(HERE, ".."))

import moefuse  # noqa: E402

# The host-memory backends the numpy tests run on. cuda runs numpy arrays too
# (staged through device buffers) but its own tests use torch tensors.
HOST_BACKENDS = ["cpu", "opencl"]

_contexts = {}


def _context(name):
    if name not in _contexts:
        if name not in moefuse.built_backends():
            _contexts[name] = f"backend {name} is not built into {moefuse.library_path}"
        else:
            try:
                _contexts[name] = moefuse.Context(name)
            except moefuse.BackendUnavailableError as exc:
                _contexts[name] = f"backend {name} has no device: {exc}"
    ctx = _contexts[name]
    if isinstance(ctx, str):
        pytest.skip(ctx)
    return ctx


@pytest.fixture(params=HOST_BACKENDS)
def ctx(request):
    """A context on each host-array backend (skipped, with the reason, where unavailable)."""
    return _context(request.param)


@pytest.fixture
def cpu():
    return _context("cpu")


@pytest.fixture
def rng(request):
    # A fixed seed per test: failures reproduce, tests stay independent of order.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def pytest_report_header(config):
    return (f"moefuse: {moefuse.library_path} (backends built: "
            f"{', '.join(moefuse.built_backends())})")
