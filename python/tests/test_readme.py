"""The Python example of README.md runs as printed."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_example_runs():
    if not os.path.exists(README):
        pytest.skip("README.md is not beside the tests")
    text = open(README, encoding="utf-8").read()
    section = text.split("## Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["q"].shape == (4, 256) and scope["scales"].shape == (2, 4)
    assert scope["out"].shape == (3, 64) and scope["ids"].shape == (3, 2)
