"""moefuse: fused Mixture-of-Experts kernels (CPU, CUDA, OpenCL) for numpy and torch.

A thin ctypes binding over libmoefuse's C API (include/moefuse.h): every call
runs the C library, on numpy arrays, torch tensors (CPU or CUDA) or DLPack
objects, without copying them (host arrays given to a GPU backend are the one
exception: they are copied through backend memory; moefuse.Buffer avoids that).

    import numpy as np, moefuse
    x = np.random.randn(4, 512).astype(np.float32)   # [T, 2H]: gate | up
    q, scales = moefuse.act_quant(x)                   # FP8 e4m3 codes, groups of 128

Calls on torch tensors take a compiled fast path (_fast.py, _fastcall.c) where it is built;
`import moefuse.torch_ops` defines torch.ops.moefuse.* for torch.compile (it imports torch,
which `import moefuse` never does). moefuse.EpGroup runs a layer whose experts are spread over
the ranks of a group (ep.py; from a torch.distributed process group with
EpGroup.from_process_group). README.md's Python section has a fuller example;
docs/PYTHON.md has the reference.
"""

from ._capi import library_path
from .buffers import Buffer
from .context import Context, built_backends, default_context
from .ep import EpGroup, EpHandle
from .errors import (AlignmentError, BackendFailureError, BackendUnavailableError,
                     ContextBusyError, DtypeError, Error, InternalError, InvalidArgumentError,
                     NullPointerError, OutOfBoundsError, OutOfMemoryError, OverlapError,
                     ShapeError, StrideError, UnsupportedError, WorkspaceTooSmallError,
                     WrongDeviceError)
from .ops import (act_mul, act_quant, act_quant_masked, dequant, moe_final, moe_forward, moe_gate,
                  quant, routing_metadata, topk_route, topk_softmax)
from .ops_fp8 import moe_final_fp8, moe_forward_fp8, moe_gate_fp8, moe_masked_fp8

try:  # the installed distribution's version (meson.build's project version)
    from importlib.metadata import version as _version
    __version__ = _version("moefuse")
except Exception:  # run from the source tree (PYTHONPATH=python)
    __version__ = "0+source"

__all__ = [
    "Context", "Buffer", "built_backends", "default_context", "library_path",
    "act_quant", "act_quant_masked", "act_mul", "quant", "dequant",
    "moe_gate", "moe_final", "moe_forward", "topk_softmax", "topk_route", "routing_metadata",
    "moe_gate_fp8", "moe_final_fp8", "moe_forward_fp8", "moe_masked_fp8",
    "EpGroup", "EpHandle",
    "Error", "NullPointerError", "InvalidArgumentError", "ShapeError", "DtypeError",
    "StrideError", "AlignmentError", "WrongDeviceError", "UnsupportedError",
    "BackendUnavailableError", "OutOfMemoryError", "BackendFailureError", "InternalError",
    "OutOfBoundsError", "OverlapError", "ContextBusyError", "WorkspaceTooSmallError",
]
