"""Contexts, default contexts, streams, and finding the library."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import moefuse


def test_context_names_and_lifetime():
    with moefuse.Context("cpu") as ctx:
        assert ctx.backend == "cpu" and ctx.device.startswith("CPU")
        assert "cpu" in repr(ctx)
        assert ctx.stream is None
        ctx.set_stream(None)
        ctx.synchronize()
    assert "closed" in repr(ctx)
    with pytest.raises(moefuse.NullPointerError, match="closed"):
        ctx.synchronize()
    ctx.close()  # twice is fine


def test_context_on_a_device():
    # the CPU has one device: naming one is refused, as is a device without a backend name
    with pytest.raises(moefuse.InvalidArgumentError, match="one device"):
        moefuse.Context("cpu", device=0)
    with pytest.raises(moefuse.InvalidArgumentError, match="needs a backend name"):
        moefuse.Context(None, device="0")
    if "opencl" in moefuse.built_backends():
        try:
            ctx = moefuse.Context("opencl", device="0:0")
        except moefuse.BackendUnavailableError:
            pytest.skip("no OpenCL device")
        with ctx:
            assert ctx.backend == "opencl"
        with pytest.raises(moefuse.BackendUnavailableError, match="999:0"):
            moefuse.Context("opencl", device="999:0")


def test_cpu_backend_takes_no_stream():
    with moefuse.Context("cpu") as ctx:
        with pytest.raises(moefuse.UnsupportedError, match="has no streams"):
            ctx.set_stream(0x1234)


def test_built_backends_and_default_contexts():
    assert "cpu" in moefuse.built_backends()
    a = moefuse.default_context("cpu")
    assert a is moefuse.default_context("cpu")
    other = []
    t = threading.Thread(target=lambda: other.append(moefuse.default_context("cpu")))
    t.start()
    t.join()
    assert other[0] is not a  # one context per thread


def test_host_arrays_run_on_cpu_by_default():
    x = np.ones((2, 256), np.float32)
    q, s = moefuse.act_quant(x)
    assert q.shape == (2, 128) and s.shape == (2, 1)
    q2, _ = moefuse.act_quant(x, ctx="cpu")
    np.testing.assert_array_equal(q.view(np.uint8), q2.view(np.uint8))


def _import_with(env):
    """`import moefuse` in a fresh interpreter, of the same package these tests import."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(moefuse.__file__)))
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", "import moefuse"],
                          env={**os.environ, "PYTHONPATH": path, **env},
                          capture_output=True, text=True)


def test_missing_library_says_where_to_look():
    run = _import_with({"MOEFUSE_LIBRARY": "/nonexistent/libmoefuse.so"})
    assert run.returncode != 0
    assert "cannot load libmoefuse" in run.stderr and "/nonexistent/libmoefuse.so" in run.stderr
