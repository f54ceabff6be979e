"""The PyTorch examples of docs/INTEGRATION.md run as printed (CUDA only): the compiled MoE
block, then its CUDA graph replayed on a new batch, against an eager call."""

import os
import re

import pytest

torch = pytest.importorskip("torch", reason="the examples are PyTorch's")

import moefuse  # noqa: E402
from torch_devices import NEEDS_CUDA  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "INTEGRATION.md")

pytestmark = NEEDS_CUDA


def _blocks(section):
    if not os.path.exists(DOC):
        pytest.skip("docs/INTEGRATION.md is not beside the tests")
    text = open(DOC, encoding="utf-8").read().split(f"### {section}", 1)[1].split("\n### ")[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_compile_then_graph_examples_run_as_printed():
    scope = {}
    for code in _blocks("torch.compile"):
        exec(compile(code, "INTEGRATION.md (torch.compile)", "exec"), scope)
    assert scope["y"].shape == (16, 2048)
    scope["next_batch"] = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    for code in _blocks("CUDA graphs"):
        exec(compile(code, "INTEGRATION.md (CUDA graphs)", "exec"), scope)
    torch.cuda.synchronize()
    with torch.inference_mode():
        want = scope["block"](scope["next_batch"])
    assert torch.equal(scope["static_y"], want)
