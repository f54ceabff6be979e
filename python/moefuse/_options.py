"""Keyword arguments -> the C option structs.

Names map to enum values; whether a value is in range is the C API's to judge.
"""

import functools

from . import _capi, errors

DEFAULT_GROUP = 128


def _choice(value, names, what):
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # a raw enum value: the C API says if it is out of range
    if value in names:
        return names.index(value)
    raise errors.InvalidArgumentError(
        errors.code_of("MOEFUSE_ERR_INVALID_ARGUMENT"),
        f"{what} {value!r} is not one of {', '.join(repr(n) for n in names)}")


def _shared(build):
    """One struct per distinct set of keyword values: the C API only reads them, and
    building a ctypes struct on every call costs more than the lookup. Unhashable
    values (a list by mistake) are built afresh, so their error stays the usual one. Typed: True
    and 1 are equal keys otherwise, and True is refused where 1 is a raw enum value."""
    cached = functools.lru_cache(maxsize=64, typed=True)(build)

    @functools.wraps(build)
    def get(*args):
        try:
            return cached(*args)
        except TypeError:
            return build(*args)
    return get


def activation_code(value):
    return _choice(value, _capi.ACTIVATIONS, "activation")


def order_code(value):
    return _choice(value, _capi.GATE_ORDERS, "order")


def rounding_code(value):
    # None and "none": one f32 value per element
    return _choice("none" if value is None else value, ("none",) + _capi.ROUNDINGS[1:],
                   "intermediate")


def layout_code(value):
    return _choice(value, _capi.SCALE_LAYOUTS, "scale_layout")


@_shared
def act(activation, order, limit, intermediate, alpha=0.0, up_offset=0.0):
    """moefuse_act_options. alpha: silu_alpha's (0: 1.702); up_offset: added to up (0: none)."""
    return _capi.ActOptions(activation=activation_code(activation), order=order_code(order),
                            limit=float(limit or 0.0), intermediate=rounding_code(intermediate),
                            alpha=float(alpha or 0.0), up_offset=float(up_offset or 0.0))


@_shared
def quant(group_size, scale_layout, ue8m0, eps):
    # 0 is the C default for group_size (128) and eps (1e-10)
    return _capi.QuantOptions(group_size=int(group_size or 0),
                              scale_layout=layout_code(scale_layout),
                              ue8m0=int(bool(ue8m0)), eps=float(eps or 0.0))


@_shared
def moe(activation, order, limit, alpha=0.0, up_offset=0.0):
    return _capi.MoeOptions(activation=activation_code(activation), order=order_code(order),
                            limit=float(limit or 0.0), alpha=float(alpha or 0.0),
                            up_offset=float(up_offset or 0.0))


@_shared
def fp8_moe(activation, order, limit, scale_layout, ue8m0, eps, alpha=0.0, up_offset=0.0):
    """moefuse_fp8_moe_options: the MoE options, and the quantization of the activations (x when
    the call quantizes it, h) in groups of 128, the only size the FP8 calls take."""
    return _capi.Fp8MoeOptions(moe=moe(activation, order, limit, alpha, up_offset),
                               act=quant(DEFAULT_GROUP, scale_layout, ue8m0, eps))


@_shared
def scales_shape(layout, rows, hidden, group_size, experts=None):
    """Shape of the scales tensor the C API expects (for allocating it). Cached: it is worked
    out on every call that allocates scales (symbolic sizes, unhashable, are not cached)."""
    g = int(group_size or DEFAULT_GROUP)
    # Invalid sizes get some shape: the C API refuses the options before looking at it.
    groups = hidden // g if g > 0 and hidden % g == 0 else 1
    padded = (rows + 3) // 4 * 4
    code = layout_code(layout)
    if code == 1:
        inner = (groups, padded)
    elif code == 2:
        inner = ((groups + 3) // 4, padded)
    else:
        inner = (rows, groups)
    return inner if experts is None else (experts,) + inner


@_shared
def scales_dtype(layout, scale_dtype):
    if scale_dtype is not None:
        return scale_dtype
    return "i32" if layout_code(layout) == 2 else "f32"


@_shared
def router(scoring, n_group, topk_group, group_scoring, renormalize, scale):
    """moefuse_router_options (scale 1 is the C default, 0)."""
    return _capi.RouterOptions(scoring=_choice(scoring, _capi.ROUTER_SCORINGS, "scoring"),
                               n_group=int(n_group or 0), topk_group=int(topk_group or 0),
                               group_scoring=_choice(group_scoring, _capi.GROUP_SCORINGS,
                                                     "group_scoring"),
                               renormalize=int(bool(renormalize)), scale=float(scale))
