"""ctypes mirror of include/moefuse_ep.h: the expert-parallel structs, enum and prototypes.

Field order and types follow the header one for one; python/tests/test_ep.py compares sizes
and offsets with what a C compiler gives for the same header. The functions are bound on the
library _capi loaded; a library without them (built before moefuse_ep.h) leaves `missing`
saying so, and `import moefuse` still works: only the EP calls then refuse.
"""

import ctypes
from ctypes import POINTER, c_char, c_int32, c_uint32, c_void_p

from . import _capi
from ._capi import QuantOptions, Routing, Tensor, moefuse_enum

UNIQUE_ID_BYTES = 128

# moefuse_ep_mode, in enum order
MODES = ("normal", "low_latency")


class UniqueId(ctypes.Structure):
    """moefuse_ep_unique_id: NCCL's id, made on one rank and passed to every rank."""
    _fields_ = [("bytes", c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """moefuse_ep_config."""
    _fields_ = [
        ("rank", c_int32),
        ("world", c_int32),
        ("num_experts", c_int32),
        ("expert_owner", POINTER(c_int32)),
        ("reserved", c_uint32 * 4),
    ]


class DispatchOptions(ctypes.Structure):
    """moefuse_ep_dispatch_options."""
    _fields_ = [
        ("mode", moefuse_enum),
        ("quantize", c_int32),
        ("act", QuantOptions),
        ("max_tokens", c_int32),
        ("reserved", c_uint32 * 3),
    ]


ctx_p = c_void_p
group_p = c_void_p
handle_p = c_void_p
T = POINTER(Tensor)
R = POINTER(Routing)
status_t = moefuse_enum

# name: (restype, argtypes)
PROTOTYPES = {
    "moefuse_ep_unique_id_create": (status_t, [ctx_p, POINTER(UniqueId)]),
    "moefuse_ep_group_create": (status_t, [ctx_p, POINTER(UniqueId), POINTER(Config),
                                           POINTER(group_p)]),
    "moefuse_ep_group_adopt": (status_t, [ctx_p, c_void_p, POINTER(Config), POINTER(group_p)]),
    "moefuse_ep_local_experts": (c_int32, [group_p]),
    "moefuse_ep_group_destroy": (None, [group_p]),
    "moefuse_ep_dispatch": (status_t, [ctx_p, group_p, T, T, R, T, T, T,
                                       POINTER(DispatchOptions), POINTER(handle_p)]),
    "moefuse_ep_combine": (status_t, [ctx_p, group_p, handle_p, T, T]),
    "moefuse_ep_handle_destroy": (None, [handle_p]),
    "moefuse_ep_moe_forward": (status_t, [ctx_p, group_p, T, T, T, T, T, R, T,
                                          POINTER(_capi.MoeOptions)]),
    "moefuse_ep_moe_forward_fp8": (status_t, [ctx_p, group_p, T, T, T, T, T, T, T, T, R, T,
                                              POINTER(_capi.Fp8MoeOptions)]),
}


def _bind():
    """The bound functions by name, and why any are missing (None when none is)."""
    lib, found, absent = _capi.lib, {}, []
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            absent.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
        found[name] = fn
    why = (f"{_capi.library_path} has no {', '.join(absent)} (a library built before "
           f"moefuse_ep.h): rebuild it") if absent else None
    return found, why


functions, missing = _bind()
