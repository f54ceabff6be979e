"""What an array is, seen from C: address, dtype, shape, strides in elements, device.

numpy arrays are read through __array_interface__, torch tensors through
data_ptr()/stride(), anything else with __dlpack__ through a DLPack capsule.
Nothing is copied here, and nothing about shapes or strides is judged: the
C API does that, with its own messages.
"""

from . import _dtypes, errors
from .buffers import Buffer

HOST = "host"
CUDA = "cuda"
BUFFER = "buffer"  # a moefuse.Buffer: memory of one context's backend


class Operand:
    """One array argument as the C API will see it (before any staging)."""

    __slots__ = ("obj", "name", "address", "dtype", "shape", "strides", "device", "device_index",
                 "framework", "writable", "keepalive")

    def __init__(self, obj, name, address, dtype, shape, strides, device, device_index,
                 framework, writable=True, keepalive=None):
        self.obj = obj
        self.name = name
        self.address = address
        self.dtype = dtype
        self.shape = tuple(map(int, shape))
        self.strides = tuple(map(int, strides))
        self.device = device
        self.device_index = device_index
        self.framework = framework
        self.writable = writable
        self.keepalive = keepalive  # a DLPack capsule, released after the call

    def byte_span(self, itemsize):
        """(lowest, one past highest) byte offsets from `address` the elements cover."""
        if any(s == 0 for s in self.shape):
            return 0, 0
        low = sum((n - 1) * st for n, st in zip(self.shape, self.strides) if st < 0)
        high = sum((n - 1) * st for n, st in zip(self.shape, self.strides) if st > 0)
        return low * itemsize, (high + 1) * itemsize


def _dtype_error(name, what):
    if "float8" in str(what):  # e5m2, e4m3fnuz, ...: a neighbour of the one FP8 format taken
        return errors.DtypeError(errors.code_of("MOEFUSE_ERR_DTYPE"),
                                 f"{name} has dtype {what}; moefuse's FP8 is float8_e4m3fn only "
                                 f"(e4m3, max 448, no Inf): quantize to float8_e4m3fn instead")
    return errors.DtypeError(errors.code_of("MOEFUSE_ERR_DTYPE"),
                             f"{name} has dtype {what}, which has no moefuse dtype "
                             f"(f32, f16, bf16, f8_e4m3, i8, i32, u8)")


def _from_numpy(arr, name):
    dtype = _dtypes.from_numpy(arr.dtype)
    if dtype is None:
        raise _dtype_error(name, arr.dtype)
    itemsize = arr.dtype.itemsize
    if any(st % itemsize for st in arr.strides):
        raise errors.StrideError(errors.code_of("MOEFUSE_ERR_STRIDE"),
                                 f"{name} has byte strides {arr.strides}, not whole "
                                 f"{itemsize}-byte elements")
    address = arr.__array_interface__["data"][0]
    return Operand(arr, name, address, dtype, arr.shape, [st // itemsize for st in arr.strides],
                   HOST, None, "numpy", writable=arr.flags.writeable)


def _from_torch(t, name):
    dtype = _dtypes.from_torch(t.dtype)
    if dtype is None:
        raise _dtype_error(name, t.dtype)
    if t.is_cuda:
        index = t.get_device()
        return Operand(t, name, t.data_ptr(), dtype, t.shape, t.stride(), CUDA, index, "torch")
    if not t.is_cpu:
        raise errors.WrongDeviceError(errors.code_of("MOEFUSE_ERR_WRONG_DEVICE"),
                                      f"{name} is on torch device {t.device}; moefuse takes "
                                      f"CPU and CUDA tensors")
    return Operand(t, name, t.data_ptr(), dtype, t.shape, t.stride(), HOST, None, "torch")


_READERS = {}  # exact type -> reader, for the types met so far (skips the isinstance tests)


def describe(obj, name):
    """The Operand for `obj`, or None for None (an absent optional operand)."""
    if obj is None:
        return None
    reader = _READERS.get(type(obj))
    if reader is not None:
        return reader(obj, name)
    if isinstance(obj, Buffer):
        return Operand(obj, name, obj.handle, obj.dtype, obj.shape, obj.strides, BUFFER, None,
                       "buffer")
    if _dtypes.is_numpy_array(obj):
        _READERS[type(obj)] = _from_numpy
        return _from_numpy(obj, name)
    if _dtypes.is_torch_tensor(obj):
        _READERS[type(obj)] = _from_torch
        return _from_torch(obj, name)
    if hasattr(obj, "__dlpack__"):
        from . import _dlpack
        return _dlpack.describe(obj, name)
    raise TypeError(f"moefuse: {name} is a {type(obj).__name__}; pass a numpy array, a torch "
                    f"tensor, or an object with __dlpack__")


def empty_like(source, shape, dtype, zero=False):
    """A new array of `shape` and moefuse `dtype` where `source` lives (numpy for host data
    that is not torch, torch for torch and for CUDA data, a Buffer for a Buffer)."""
    if source is not None and source.device == BUFFER:
        buf = Buffer(source.obj.ctx, shape, dtype)
        if zero:
            import numpy as np
            buf.upload(np.zeros(shape, dtype=_dtypes.numpy_dtype(dtype)))
        return buf
    if source is not None and (source.framework == "torch" or source.device == CUDA):
        import torch
        make = torch.zeros if zero else torch.empty
        device = (torch.device("cuda", source.device_index) if source.device == CUDA
                  else torch.device("cpu"))
        return make(shape, dtype=_dtypes.torch_dtype(dtype), device=device)
    import numpy as np
    make = np.zeros if zero else np.empty
    return make(shape, dtype=_dtypes.numpy_dtype(dtype))
