"""The torch devices the torch tests run on: the CPU always, CUDA where there is a device and the
cuda backend is built. Imported by test modules after pytest.importorskip("torch")."""

import pytest
import torch

import moefuse


def cuda_ready():
    return torch.cuda.is_available() and "cuda" in moefuse.built_backends()


NEEDS_CUDA = pytest.mark.skipif(not cuda_ready(),
                                reason="needs a CUDA device and the cuda backend")

DEVICES = [pytest.param("cuda", marks=NEEDS_CUDA), "cpu"]
