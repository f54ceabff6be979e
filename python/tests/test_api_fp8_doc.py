"""docs/API.md "An FP8 layer, end to end": the C program printed there is tools/example_fp8.c
(which meson builds and runs), and the Python block runs as printed on the CPU."""

import os
import re

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOC = os.path.join(ROOT, "docs", "API.md")
EXAMPLE = os.path.join(ROOT, "tools", "example_fp8.c")


def _section():
    if not os.path.exists(DOC) or not os.path.exists(EXAMPLE):
        pytest.skip("docs/API.md and tools/ are not beside the tests")
    text = open(DOC, encoding="utf-8").read()
    return text.split("## An FP8 layer, end to end", 1)[1].split("\n## ")[0]


def test_the_c_example_is_the_built_program():
    code = re.search(r"```c\n(.*?)```", _section(), re.S).group(1)
    assert code == open(EXAMPLE, encoding="utf-8").read()


def test_the_python_example_runs_as_printed(monkeypatch):
    monkeypatch.delenv("MOEFUSE_BACKEND", raising=False)  # numpy calls run on the cpu backend
    code = re.search(r"```python\n(.*?)```", _section(), re.S).group(1)
    scope = {}
    exec(compile(code, "API.md (An FP8 layer, end to end)", "exec"), scope)
    out, counts = scope["out"], scope["counts"]
    assert out.shape == (4, 256) and out.dtype.name == "bfloat16"
    assert np.isfinite(out.astype(np.float32)).all() and np.any(out.astype(np.float32) != 0)
    assert np.array_equal(out.view(np.uint16), scope["out_from_fp8"].view(np.uint16))
    local = scope["out_local"].astype(np.float32)
    for e, n in enumerate(counts):
        assert np.all(local[e, n:] == 0) and (n == 0 or np.any(local[e, :n] != 0))
