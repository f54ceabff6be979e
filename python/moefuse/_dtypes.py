"""moefuse dtype names and their numpy (with ml_dtypes), torch and DLPack counterparts.

Frameworks are looked up in sys.modules: a caller who never imported torch never
pays for importing it here.
"""

import sys

from . import errors
from ._capi import DTYPE_NAMES

# numpy / ml_dtypes attribute names, torch attribute names, DLPack (code, bits)
_NUMPY = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f8_e4m3": "float8_e4m3fn",
          "i8": "int8", "i32": "int32", "u8": "uint8"}
_TORCH = _NUMPY  # torch spells them the same way
_DLPACK = {(2, 32): "f32", (2, 16): "f16", (4, 16): "bf16", (10, 8): "f8_e4m3",
           (0, 8): "i8", (0, 32): "i32", (1, 8): "u8"}

# Spellings accepted wherever a dtype is asked for, besides dtype objects.
_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "half": "f16",
            "bfloat16": "bf16", "fp8": "f8_e4m3", "float8_e4m3fn": "f8_e4m3", "e4m3": "f8_e4m3",
            "int8": "i8", "int32": "i32", "uint8": "u8", "ue8m0": "u8"}


def _numpy_type(attr):
    import numpy as np
    if hasattr(np, attr) and attr not in ("bfloat16", "float8_e4m3fn"):
        return np.dtype(getattr(np, attr))
    try:
        import ml_dtypes
    except ImportError:
        raise errors.DtypeError(errors.code_of("MOEFUSE_ERR_DTYPE"),
                                f"numpy has no {attr}: install ml_dtypes (pip install ml_dtypes)"
                                ) from None
    return np.dtype(getattr(ml_dtypes, attr))


def numpy_dtype(name):
    """numpy dtype of a moefuse dtype name (bf16 and f8_e4m3 come from ml_dtypes)."""
    return _numpy_type(_NUMPY[name])


def torch_dtype(name):
    import torch
    return getattr(torch, _TORCH[name])


def from_numpy(dtype):
    """moefuse name of a numpy dtype, or None."""
    if dtype.kind in "fiu" and dtype.isbuiltin:
        for name, attr in _NUMPY.items():
            if name not in ("bf16", "f8_e4m3") and dtype == _numpy_type(attr):
                return name
        return None
    # ml_dtypes registers its types under these names.
    return {"bfloat16": "bf16", "float8_e4m3fn": "f8_e4m3"}.get(dtype.name)


_TORCH_BY_STR = {f"torch.{attr}": name for name, attr in _TORCH.items()}


_TORCH_SEEN = {}  # torch dtype object -> moefuse name or None: str(dtype) costs on every call


def from_torch(dtype):
    """moefuse name of a torch dtype, or None."""
    try:
        return _TORCH_SEEN[dtype]
    except KeyError:
        name = _TORCH_SEEN[dtype] = _TORCH_BY_STR.get(str(dtype))
        return name


def from_dlpack(code, bits, lanes):
    return _DLPACK.get((code, bits)) if lanes == 1 else None


def resolve(dtype):
    """moefuse name of a dtype given as a moefuse name, an alias, or a numpy/torch dtype."""
    if isinstance(dtype, str):
        name = dtype if dtype in DTYPE_NAMES else _ALIASES.get(dtype.lower())
    elif type(dtype).__module__.startswith("torch"):
        name = from_torch(dtype)
    else:
        try:
            import numpy as np
            name = from_numpy(np.dtype(dtype))
        except TypeError:
            name = None
    if name is None:
        raise errors.DtypeError(errors.code_of("MOEFUSE_ERR_DTYPE"),
                                f"{dtype!r} is not a moefuse dtype ({', '.join(DTYPE_NAMES)})")
    return name


def is_torch_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_numpy_array(obj):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)
