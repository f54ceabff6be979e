"""moefuse's expert-parallel calls as PyTorch custom operators: torch.ops.moefuse.ep_*.

    import moefuse.torch_ops      # defines these too
    group = moefuse.EpGroup.from_process_group("cuda:0", 64)
    out = torch.ops.moefuse.ep_moe_forward_fp8(group.id, x, w1, w1s, w2, w2s, ids, weights)

A custom operator takes tensors and numbers, not Python objects, so the group is its `id`, an int
naming an open EpGroup of this process (moefuse.ep.group_by_id): the id is a constant of a
traced graph, and a closed group's id raises InvalidArgumentError. As in torch_ops.py each
operator returns new tensors and writes none of its inputs, has CPU and CUDA kernels that call
the EpGroup method of the same name, and a fake kernel for torch.compile; the calls are
collective, so every rank runs the same operators in the same order.

ep_dispatch returns, besides the received rows, a 0-dim int64 CPU tensor naming the dispatch's
handle, which stays in the group until ep_combine consumes it (each is combined once; a group's
close() frees those never combined). Its recv_scales is an empty f32 tensor when the rows are
not FP8 (an operator cannot return None).
"""

import torch

from . import _fast, _options, ep, ops, ops_fp8
from .torch_ops import _FP8, _GATED, _SHARED, NAMESPACE

_DISPATCH = ('Tensor? x_scales=None, bool quantize=False, str scale_layout="row_major", '
             'bool? ue8m0=None, float? eps=None, str? scale_dtype=None, str mode="normal", '
             'int max_tokens=0')

# name -> schema; argument names and defaults are those of the EpGroup methods.
SCHEMAS = {
    "ep_moe_forward":
        f"(int group, Tensor x, Tensor w1, Tensor w2, Tensor topk_ids, Tensor topk_weights, *, "
        f"Tensor? b1=None, Tensor? b2=None, {_GATED}, str? dtype=None, {_SHARED}) -> Tensor",
    "ep_moe_forward_fp8":
        f"(int group, Tensor x, Tensor w1, Tensor w1_scales, Tensor w2, Tensor w2_scales, "
        f"Tensor topk_ids, Tensor topk_weights, *, Tensor? x_scales=None, Tensor? b1=None, "
        f"Tensor? b2=None, {_FP8}, str? dtype=None, {_SHARED}) -> Tensor",
    "ep_dispatch":
        f"(int group, Tensor x, Tensor topk_ids, Tensor topk_weights, SymInt tmax, *, "
        f"{_DISPATCH}) -> (Tensor recv_x, Tensor recv_scales, Tensor recv_counts, "
        f"Tensor handle)",
    "ep_combine":
        "(int group, Tensor handle, Tensor y, SymInt tokens, *, str? dtype=None) -> Tensor",
}


# ------------------------------------------------------------------ kernels


def _ep_moe_forward(group, *args, **options):
    return ep.group_by_id(group).moe_forward(*args, **options)


def _ep_moe_forward_fp8(group, *args, **options):
    return ep.group_by_id(group).moe_forward_fp8(*args, **options)


def _ep_dispatch(group, x, topk_ids, topk_weights, tmax, **options):
    g = ep.group_by_id(group)
    h = g.dispatch(x, topk_ids, topk_weights, tmax=tmax, **options)
    rows, scales, counts = h.recv_x, h.recv_scales, h.recv_counts
    h.recv_x = h.recv_scales = h.recv_counts = None  # the caller's now: the group keeps no rows
    key = next(g._op_keys)
    g._op_handles[key] = h
    if scales is None:
        scales = x.new_empty((0,), dtype=torch.float32)
    return rows, scales, counts, torch.tensor(key, dtype=torch.int64)


def _ep_combine(group, handle, y, tokens, *, dtype=None):
    g = ep.group_by_id(group)
    key = int(handle)
    h = g._op_handles.pop(key, None)
    if h is None:
        raise ep._error("MOEFUSE_ERR_INVALID_ARGUMENT",
                        f"ep_combine: EpGroup {group} has no dispatch handle {key} waiting "
                        f"(combined already, or from another group)")
    with h:  # consumed: freed whatever happens
        if int(tokens) != h.tokens:
            raise ep._error("MOEFUSE_ERR_SHAPE",
                            f"ep_combine: tokens is {int(tokens)} but the dispatch had "
                            f"{h.tokens}")
        return g.combine(h, y, dtype=dtype)


KERNELS = {
    "ep_moe_forward": _ep_moe_forward,
    "ep_moe_forward_fp8": _ep_moe_forward_fp8,
    "ep_dispatch": _ep_dispatch,
    "ep_combine": _ep_combine,
}


# ------------------------------------------------------------------ fake kernels
# The shapes and dtypes the kernels return, from the group's placement and the inputs.


def _fake_ep_moe_forward(group, x, *_args, dtype=None, **_):
    return _fast.empty(x, ops._dims(x, 2), dtype or x.dtype)


def _fake_ep_moe_forward_fp8(group, x, *_args, dtype=None, **_):
    return _fast.empty(x, ops._dims(x, 2), ops_fp8._out_dtype(dtype, x.dtype))


def _fake_ep_dispatch(group, x, topk_ids, topk_weights, tmax, *, x_scales=None, quantize=False,
                      scale_layout="row_major", scale_dtype=None, **_):
    E, K = ep.group_by_id(group).local_experts(), ops._dims(x, 2)[1]
    fp8 = quantize or x.dtype == torch.float8_e4m3fn
    recv_x = _fast.empty(x, (E, tmax, K), "f8_e4m3" if fp8 else x.dtype)
    if fp8:
        scales = _fast.empty(x, _options.scales_shape(scale_layout, tmax, K, ops_fp8.GROUP, E),
                             ops_fp8._h_scales_dtype(scale_layout, scale_dtype, x_scales))
    else:
        scales = _fast.empty(x, (0,), "f32")
    return recv_x, scales, _fast.empty(x, (E,), "i32"), torch.empty((), dtype=torch.int64)


def _fake_ep_combine(group, handle, y, tokens, *, dtype=None):
    return _fast.empty(y, (tokens, ops._dims(y, 3)[2]), dtype or y.dtype)


FAKES = {name: globals()[f"_fake_{name}"] for name in SCHEMAS}


# ------------------------------------------------------------------ registration

_library = torch.library.Library(NAMESPACE, "FRAGMENT")  # torch_ops.py holds the "DEF" one
for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)
    for _key in ("CPU", "CUDA"):
        _library.impl(_name, KERNELS[_name], _key)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", FAKES[_name], lib=_library)
