"""Zero-copy view of any object with __dlpack__ (legacy DLManagedTensor capsules).

The capsule is kept alive for the duration of the call and then dropped
unconsumed, which makes its destructor call the producer's deleter.
"""

import ctypes

from . import _dtypes, _tensors, errors

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def describe(obj, name):
    capsule = obj.__dlpack__()  # stream=None: the producer orders its work on the legacy stream
    # DLManagedTensor starts with its DLTensor.
    t = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    dtype = _dtypes.from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    if dtype is None:
        # DLPack codes 7 to 14 are the FP8 flavours; 10 (e4m3fn) is the one taken
        kind = "float8 " if 7 <= t.dtype.code <= 14 else ""
        raise _tensors._dtype_error(name, f"{kind}DLPack (code {t.dtype.code}, {t.dtype.bits} "
                                          f"bits, {t.dtype.lanes} lanes)")
    shape = [t.shape[d] for d in range(t.ndim)]
    if t.strides:
        strides = [t.strides[d] for d in range(t.ndim)]
    else:  # NULL strides: compact row-major
        strides, step = [0] * t.ndim, 1
        for d in reversed(range(t.ndim)):
            strides[d], step = step, step * max(shape[d], 1)
    kind = t.device.device_type
    if kind in (_KDL_CPU, _KDL_CUDA_HOST):
        device, index = _tensors.HOST, None
    elif kind in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        device, index = _tensors.CUDA, t.device.device_id
    else:
        raise errors.WrongDeviceError(errors.code_of("MOEFUSE_ERR_WRONG_DEVICE"),
                                      f"{name} is on DLPack device type {kind}; moefuse takes "
                                      f"host and CUDA memory")
    address = (t.data or 0) + t.byte_offset
    return _tensors.Operand(obj, name, address, dtype, shape, strides, device, index, "dlpack",
                            keepalive=capsule)
