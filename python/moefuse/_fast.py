"""The compiled fast path for torch tensors: moefuse._fastcall (python/moefuse/_fastcall*.c).

ops.py offers each call whose first input is a torch tensor (torch.Tensor or nn.Parameter,
CPU or CUDA) to `call.<op>`, which does in C what _tensors.py and _call.py do per call and
returns False for anything it does not take; that call then goes through ctypes as before.
MOEFUSE_PY_FASTCALL=0 starts with the fast path off; set_enabled() switches it at run time.

Which extension: the package's own moefuse._fastcall (pip install .), or, when MOEFUSE_LIBRARY
names a library, the one built with that library: beside it, or in the python/ directory of
the Meson build tree it comes from (<build>/src/libmoefuse.so, <build>/python/_fastcall*.so),
so that the struct layouts it was compiled with are the loaded library's. bind() also refuses
a library of another version. Without an extension every call takes ctypes; `problem` says why.
"""

import ctypes
import importlib.machinery
import importlib.util
import os
import sys

from . import _capi, _dtypes, _library, errors
from .context import Context, default_context

SWITCH = "MOEFUSE_PY_FASTCALL"

call = None          # the bound extension module, or None
problem = None       # why there is none (str)
missing = False      # True when no extension file was found at all (rather than a broken one)
TENSORS = set()      # the exact types ops.py hands over: filled when torch is bound and enabled

_enabled = os.environ.get(SWITCH, "1") != "0"
_torch_types = ()    # (torch.Tensor, torch.nn.Parameter) once bound
_torch_tried = False

_FUNCTIONS = ("act_quant", "act_quant_masked", "act_mul", "quant", "dequant", "moe_gate",
              "moe_final", "moe_forward", "topk_softmax", "set_stream", "last_error",
              "set_workspace", "act_quant_masked_workspace_size", "moe_gate_workspace_size",
              "moe_final_workspace_size", "moe_forward_workspace_size")


def _find():
    """The extension module, not yet bound; ImportError when there is none."""
    explicit = os.environ.get(_library.LIBRARY_ENV)
    if not explicit:
        from . import _fastcall
        return _fastcall
    lib_dir = os.path.dirname(os.path.abspath(_capi.library_path))
    places = (lib_dir, os.path.join(os.path.dirname(lib_dir), "python"))
    for where in places:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(where, "_fastcall" + suffix)
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location(__package__ + "._fastcall", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[spec.name] = module
                return module
    raise ModuleNotFoundError(f"no _fastcall extension in {' or '.join(places)} "
                              f"(beside {_capi.library_path})")


def _context(ctx, cuda_index):
    """resolve_context (_call.py) for torch operands, for ctx None or a backend name."""
    backend = ctx if ctx is not None else ("cpu" if cuda_index is None else "cuda")
    return default_context(backend, cuda_index if backend == "cuda" else None)


def _load():
    global call, problem, missing
    try:
        module = _find()
    except ImportError as exc:
        problem, missing = f"moefuse._fastcall not found: {exc}", True
        return
    lib = _capi.lib
    addresses = {f"moefuse_{name}": ctypes.cast(getattr(lib, f"moefuse_{name}"),
                                                ctypes.c_void_p).value for name in _FUNCTIONS}
    try:
        module.bind(addresses, lib.moefuse_version(), Context, _context, errors.make,
                    _capi.ACTIVATIONS, _capi.GATE_ORDERS, ("none",) + _capi.ROUNDINGS[1:],
                    _capi.SCALE_LAYOUTS)
    except ImportError as exc:
        problem = f"{module.__file__}: {exc}"
        return
    call = module
    torch = sys.modules.get("torch")
    if torch is not None:
        _bind_torch(torch)


def _bind_torch(torch):
    """Hand the extension torch's tensor types, dtypes and CUDA device and stream functions."""
    global _torch_types, _torch_tried, problem
    _torch_tried = True
    c = torch._C
    dtypes = tuple(getattr(torch, _dtypes._TORCH[name], None) for name in _capi.DTYPE_NAMES)
    # Missing in a torch built without CUDA: CUDA tensors then take ctypes (there are none).
    cuda = [getattr(c, name, None) for name in ("_cuda_getDevice", "_cuda_setDevice",
                                                "_cuda_getCurrentRawStream")]
    types = (torch.Tensor, torch.nn.Parameter)
    try:
        call.bind_torch(types, dtypes, *cuda)
        call.bind_workspace(workspace_allocator(torch) if all(cuda) else None)
    except Exception as exc:  # a torch this code does not know: ctypes still works
        problem = f"binding torch {getattr(torch, '__version__', '?')}: {exc}"
        return
    _torch_types = types
    if _enabled:
        TENSORS.update(types)


def workspace_allocator(torch):
    """alloc(nbytes, device): scratch for a CUDA call from torch's caching allocator, on the
    current stream, so that torch counts it and reuses it in stream order."""
    uint8 = torch.uint8

    def alloc(nbytes, device):
        return torch.empty(nbytes, dtype=uint8, device=torch.device("cuda", device))
    return alloc


def first_torch(obj):
    """Whether obj is a torch tensor for the fast path, binding torch the first time one is
    met (moefuse may be imported before torch). Other objects cost a lookup or two."""
    if _torch_tried or call is None or not _enabled:
        return False
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return False
    _bind_torch(torch)
    return type(obj) in TENSORS


def active():
    """Whether torch tensors take the fast path now (the extension is bound and switched on)."""
    return call is not None and _enabled


def set_enabled(flag):
    """Switch the fast path on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    TENSORS.clear()
    if _enabled:
        TENSORS.update(_torch_types)
    return previous


_TORCH_DTYPES = {}  # dtype argument (name, alias, torch dtype) -> torch dtype


def empty(x, shape, dtype, zero=False):
    """A new tensor of `shape` and `dtype` on x's device, as the ctypes path allocates results."""
    try:
        torch_dtype = _TORCH_DTYPES[dtype]
    except KeyError:
        torch_dtype = _TORCH_DTYPES[dtype] = _dtypes.torch_dtype(_dtypes.resolve(dtype))
    return x.new_zeros(shape, dtype=torch_dtype) if zero else x.new_empty(shape, dtype=torch_dtype)


_load()
