"""ctypes mirror of include/moefuse.h: enums, structs and every function's prototype.

Field order and types follow the header one for one; python/tests/test_abi.py
compares sizes and offsets with what a C compiler gives for the same header.
"""

import ctypes
from ctypes import (POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_uint,
                    c_void_p)

from . import _library

MAX_RANK = 4

# moefuse_status
OK = 0
STATUS_NAMES = (
    "MOEFUSE_OK", "MOEFUSE_ERR_NULL_POINTER", "MOEFUSE_ERR_INVALID_ARGUMENT",
    "MOEFUSE_ERR_SHAPE", "MOEFUSE_ERR_DTYPE", "MOEFUSE_ERR_STRIDE", "MOEFUSE_ERR_ALIGNMENT",
    "MOEFUSE_ERR_WRONG_DEVICE", "MOEFUSE_ERR_UNSUPPORTED", "MOEFUSE_ERR_BACKEND_UNAVAILABLE",
    "MOEFUSE_ERR_OUT_OF_MEMORY", "MOEFUSE_ERR_BACKEND_FAILURE", "MOEFUSE_ERR_INTERNAL",
    "MOEFUSE_ERR_OUT_OF_BOUNDS", "MOEFUSE_ERR_OVERLAP", "MOEFUSE_ERR_CONTEXT_BUSY",
    "MOEFUSE_ERR_WORKSPACE_TOO_SMALL",
)

# moefuse_dtype, in enum order
DTYPE_NAMES = ("f32", "f16", "bf16", "f8_e4m3", "i8", "i32", "u8")
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}
DTYPE_SIZES = {"f32": 4, "f16": 2, "bf16": 2, "f8_e4m3": 1, "i8": 1, "i32": 4, "u8": 1}

# Option enums: the Python spelling of each value, in enum order.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "silu_alpha")
GATE_ORDERS = ("gate_first", "up_first", "interleaved")
ROUNDINGS = (None, "bf16")
SCALE_LAYOUTS = ("row_major", "column_major", "packed_ue8m0")

moefuse_enum = c_int  # C enums are ints on every ABI moefuse targets


class Tensor(ctypes.Structure):
    """moefuse_tensor."""
    _fields_ = [
        ("data", c_void_p),
        ("offset", c_int64),
        ("dtype", moefuse_enum),
        ("rank", c_int32),
        ("shape", c_int64 * MAX_RANK),
        ("stride", c_int64 * MAX_RANK),
    ]


class QuantOptions(ctypes.Structure):
    """moefuse_quant_options."""
    _fields_ = [
        ("group_size", c_int64),
        ("scale_layout", moefuse_enum),
        ("ue8m0", c_int32),
        ("eps", c_float),
        ("reserved", ctypes.c_uint32 * 4),
    ]


class ActOptions(ctypes.Structure):
    """moefuse_act_options."""
    _fields_ = [
        ("activation", moefuse_enum),
        ("order", moefuse_enum),
        ("limit", c_float),
        ("intermediate", moefuse_enum),
        ("alpha", c_float),
        ("up_offset", c_float),
        ("reserved", ctypes.c_uint32 * 2),
    ]


class ActQuantOptions(ctypes.Structure):
    """moefuse_act_quant_options."""
    _fields_ = [
        ("act", ActOptions),
        ("quant", QuantOptions),
        ("zero_tail", c_int32),
        ("reserved", ctypes.c_uint32 * 4),
    ]


class MoeOptions(ctypes.Structure):
    """moefuse_moe_options."""
    _fields_ = [
        ("activation", moefuse_enum),
        ("order", moefuse_enum),
        ("limit", c_float),
        ("alpha", c_float),
        ("up_offset", c_float),
        ("reserved", ctypes.c_uint32 * 2),
    ]


class Fp8MoeOptions(ctypes.Structure):
    """moefuse_fp8_moe_options."""
    _fields_ = [
        ("moe", MoeOptions),
        ("act", QuantOptions),
        ("reserved", ctypes.c_uint32 * 4),
    ]


ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORINGS = ("top2_sum", "max")


class RouterOptions(ctypes.Structure):
    """moefuse_router_options."""
    _fields_ = [
        ("scoring", moefuse_enum),
        ("n_group", ctypes.c_int32),
        ("topk_group", ctypes.c_int32),
        ("group_scoring", moefuse_enum),
        ("renormalize", ctypes.c_int32),
        ("scale", c_float),
        ("reserved", ctypes.c_uint32 * 4),
    ]


class Routing(ctypes.Structure):
    """moefuse_routing."""
    _fields_ = [
        ("topk_ids", Tensor),
        ("topk_weights", Tensor),
        ("expert_map", Tensor),
        ("n_shared", ctypes.c_int32),
        ("shared_scale", c_float),
        ("shared_weights", Tensor),
    ]


class RoutingMeta(ctypes.Structure):
    """moefuse_routing_meta."""
    _fields_ = [
        ("counts", Tensor),
        ("offsets", Tensor),
        ("order", Tensor),
        ("position", Tensor),
        ("masked_row", Tensor),
    ]


ctx_p = c_void_p
T = POINTER(Tensor)
status_t = moefuse_enum

# name: (restype, argtypes)
_PROTOTYPES = {
    "moefuse_status_name": (c_char_p, [status_t]),
    "moefuse_version": (c_uint, []),
    "moefuse_tensor_dense": (Tensor, [c_void_p, moefuse_enum, c_int32, POINTER(c_int64)]),
    "moefuse_tensor_strided": (Tensor, [c_void_p, moefuse_enum, c_int32, POINTER(c_int64),
                                        POINTER(c_int64)]),
    "moefuse_tensor_numel": (c_int64, [T]),
    "moefuse_tensor_span_bytes": (c_int64, [T]),
    "moefuse_dtype_size": (c_size_t, [moefuse_enum]),
    "moefuse_dtype_name": (c_char_p, [moefuse_enum]),
    "moefuse_context_create": (status_t, [POINTER(ctx_p), c_char_p]),
    "moefuse_context_create_on": (status_t, [POINTER(ctx_p), c_char_p, c_char_p]),
    "moefuse_context_create_opencl": (status_t, [POINTER(ctx_p), c_void_p, c_void_p]),
    "moefuse_context_destroy": (None, [ctx_p]),
    "moefuse_backend_name": (c_char_p, [ctx_p]),
    "moefuse_device_name": (c_char_p, [ctx_p]),
    "moefuse_last_error": (c_char_p, [ctx_p]),
    "moefuse_set_stream": (status_t, [ctx_p, c_void_p]),
    "moefuse_get_stream": (status_t, [ctx_p, POINTER(c_void_p)]),
    "moefuse_synchronize": (status_t, [ctx_p]),
    "moefuse_built_backends": (c_char_p, []),
    "moefuse_buffer_alloc": (status_t, [ctx_p, c_size_t, POINTER(c_void_p)]),
    "moefuse_buffer_free": (status_t, [ctx_p, c_void_p]),
    "moefuse_buffer_import": (status_t, [ctx_p, c_void_p]),
    "moefuse_buffer_write": (status_t, [ctx_p, c_void_p, c_size_t, c_void_p, c_size_t]),
    "moefuse_buffer_read": (status_t, [ctx_p, c_void_p, c_size_t, c_void_p, c_size_t]),
    "moefuse_act_quant": (status_t, [ctx_p, T, T, T, T, POINTER(ActQuantOptions)]),
    "moefuse_act_quant_masked": (status_t, [ctx_p, T, T, T, T, T, T, POINTER(ActQuantOptions)]),
    "moefuse_act_mul": (status_t, [ctx_p, T, T, T, POINTER(ActOptions)]),
    "moefuse_quant": (status_t, [ctx_p, T, T, T, POINTER(QuantOptions)]),
    "moefuse_dequant": (status_t, [ctx_p, T, T, T, POINTER(QuantOptions)]),
    "moefuse_moe_gate": (status_t, [ctx_p, T, T, T, POINTER(Routing), T, POINTER(MoeOptions)]),
    "moefuse_moe_final": (status_t, [ctx_p, T, T, T, POINTER(Routing), T, POINTER(MoeOptions)]),
    "moefuse_moe_forward": (status_t, [ctx_p, T, T, T, T, T, POINTER(Routing), T,
                                       POINTER(MoeOptions)]),
    # FP8 MoE: the scales follow the tensor they scale
    "moefuse_moe_gate_fp8": (status_t, [ctx_p, T, T, T, T, T, POINTER(Routing), T, T,
                                        POINTER(Fp8MoeOptions)]),
    "moefuse_moe_final_fp8": (status_t, [ctx_p, T, T, T, T, T, POINTER(Routing), T,
                                         POINTER(Fp8MoeOptions)]),
    "moefuse_moe_forward_fp8": (status_t, [ctx_p, T, T, T, T, T, T, T, T, POINTER(Routing), T,
                                           POINTER(Fp8MoeOptions)]),
    "moefuse_moe_masked_fp8": (status_t, [ctx_p, T, T, T, T, T, T, T, T, T, T,
                                          POINTER(Fp8MoeOptions)]),
    "moefuse_topk_softmax": (status_t, [ctx_p, T, c_int32, T, T]),
    "moefuse_topk_route": (status_t, [ctx_p, T, T, T, POINTER(RouterOptions), T, T]),
    "moefuse_routing_metadata": (status_t, [ctx_p, POINTER(Routing), c_int32,
                                            POINTER(RoutingMeta)]),
    "moefuse_set_workspace": (status_t, [ctx_p, T]),
}
# moefuse_<call>_workspace_size: the call's arguments, then size_t *bytes
_PROTOTYPES.update({
    name + "_workspace_size": (status_t, _PROTOTYPES[name][1] + [POINTER(c_size_t)])
    for name in ("moefuse_act_quant", "moefuse_act_quant_masked", "moefuse_act_mul",
                 "moefuse_quant", "moefuse_dequant", "moefuse_moe_gate", "moefuse_moe_final",
                 "moefuse_moe_forward", "moefuse_moe_gate_fp8", "moefuse_moe_final_fp8",
                 "moefuse_moe_forward_fp8", "moefuse_moe_masked_fp8", "moefuse_topk_softmax",
                 "moefuse_topk_route", "moefuse_routing_metadata")})


def _bind():
    lib, path = _library.load()
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib, path


lib, library_path = _bind()


def text(raw):
    """A C string from the library as str."""
    return raw.decode("utf-8", "replace") if raw is not None else ""
