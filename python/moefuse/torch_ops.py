"""moefuse's operations as PyTorch custom operators: torch.ops.moefuse.*.

    import moefuse.torch_ops      # imports torch, defines torch.ops.moefuse.*
    ids, weights = torch.ops.moefuse.topk_softmax(logits, 8)

`import moefuse` alone neither imports torch nor defines these. Each operator is functional
(it returns new tensors and writes none of its inputs), has CPU and CUDA kernels that call the
moefuse function of the same name (ops.py, through the fast path), and a fake kernel that
gives the results' shapes and dtypes from the same shape functions ops.py allocates with, so
torch.compile traces them without graph breaks and CUDA graphs capture them. There is no
autograd formula: use them for inference (torch.no_grad, torch.inference_mode).
Options are those of the moefuse functions, with dtypes as moefuse names ("f8_e4m3", "bf16").
The FP8 MoE operators (moe_*_fp8) call ops_fp8.py, which always goes through ctypes.
"""

import torch

from . import _fast, _options, ops, ops_fp8

NAMESPACE = "moefuse"

_GATED = ('str activation="silu", str order="gate_first", float limit=0.0, float alpha=0.0, '
          'float up_offset=0.0')
_ACT = _GATED + ', str? intermediate=None'
_FP8_ACT = 'str scale_layout="row_major", bool? ue8m0=None'
_FP8 = f'{_GATED}, {_FP8_ACT}, float? eps=None'
# shared experts (docs/API.md, "Shared experts"): the gate needs their count, the sums their weights
_SHARED_GATE = 'int n_shared=0'
_SHARED = 'int n_shared=0, float shared_scale=0.0, Tensor? shared_weights=None'
_QUANT = ('int group_size=128, str scale_layout="row_major", bool ue8m0=False, float? eps=None, '
          'str dtype="f8_e4m3", str? scale_dtype=None')

# name -> schema; the argument names and defaults are those of the moefuse functions.
SCHEMAS = {
    "topk_softmax":
        "(Tensor logits, int k, bool renormalize=False) -> (Tensor ids, Tensor weights)",
    "topk_route":
        '(Tensor logits, int k, *, Tensor? logit_bias=None, Tensor? choice_bias=None, '
        'str scoring="softmax", int n_group=0, int topk_group=0, str group_scoring="top2_sum", '
        'bool renormalize=False, float scale=1.0) -> (Tensor ids, Tensor weights)',
    "routing_metadata":
        "(Tensor topk_ids, int experts, *, int block_size=1, Tensor? expert_map=None) -> "
        "(Tensor counts, Tensor offsets, Tensor order, Tensor position, Tensor masked_row)",
    "act_quant":
        f"(Tensor x, *, Tensor? row_scale=None, {_ACT}, {_QUANT}) -> (Tensor q, Tensor scales)",
    "act_quant_masked":
        f"(Tensor x, Tensor counts, *, Tensor? row_scale=None, Tensor? expert_scale=None, "
        f"{_ACT}, {_QUANT}, bool zero_tail=False) -> (Tensor q, Tensor scales)",
    "act_mul":
        f"(Tensor x, *, Tensor? row_scale=None, {_ACT}) -> Tensor",
    "quant":
        f"(Tensor x, *, {_QUANT}) -> (Tensor q, Tensor scales)",
    "dequant":
        '(Tensor q, Tensor scales, *, int group_size=128, str scale_layout="row_major", '
        'bool? ue8m0=None, float? eps=None, str dtype="f32") -> Tensor',
    "moe_gate":
        f"(Tensor x, Tensor w1, Tensor topk_ids, *, Tensor? b1=None, Tensor? expert_map=None, "
        f"{_GATED}, str? dtype=None, {_SHARED_GATE}) -> Tensor",
    "moe_final":
        f"(Tensor h, Tensor w2, Tensor topk_ids, Tensor? topk_weights=None, *, Tensor? b2=None, "
        f"Tensor? expert_map=None, bool reduce=True, str? dtype=None, {_SHARED}) -> Tensor",
    "moe_forward":
        f"(Tensor x, Tensor w1, Tensor w2, Tensor topk_ids, Tensor topk_weights, *, "
        f"Tensor? b1=None, Tensor? b2=None, Tensor? expert_map=None, {_GATED}, "
        f"str? dtype=None, {_SHARED}) -> Tensor",
    "moe_gate_fp8":
        f"(Tensor x, Tensor w1, Tensor w1_scales, Tensor topk_ids, *, Tensor? x_scales=None, "
        f"Tensor? b1=None, Tensor? expert_map=None, {_FP8}, str? scale_dtype=None, "
        f"{_SHARED_GATE}) -> (Tensor h, Tensor h_scales)",
    "moe_final_fp8":
        f"(Tensor h, Tensor h_scales, Tensor w2, Tensor w2_scales, Tensor topk_ids, "
        f"Tensor? topk_weights=None, *, Tensor? b2=None, Tensor? expert_map=None, "
        f"bool reduce=True, {_FP8_ACT}, str? dtype=None, {_SHARED}) -> Tensor",
    "moe_forward_fp8":
        f"(Tensor x, Tensor w1, Tensor w1_scales, Tensor w2, Tensor w2_scales, Tensor topk_ids, "
        f"Tensor topk_weights, *, Tensor? x_scales=None, Tensor? b1=None, Tensor? b2=None, "
        f"Tensor? expert_map=None, {_FP8}, str? dtype=None, {_SHARED}) -> Tensor",
    "moe_masked_fp8":
        f"(Tensor x, Tensor counts, Tensor w1, Tensor w1_scales, Tensor w2, Tensor w2_scales, *, "
        f"Tensor? x_scales=None, Tensor? b1=None, Tensor? b2=None, {_FP8}, str? dtype=None) "
        f"-> Tensor",
}


# ------------------------------------------------------------------ kernels


def _topk_softmax(logits, k, renormalize=False):
    return ops.topk_softmax(logits, k, renormalize=renormalize)


def _moe_call(op, *args, **kwargs):
    """Every MoE kernel goes through here: the one place to hand the library scratch memory
    from torch's allocator once the C API takes a caller's workspace."""
    return op(*args, **kwargs)


def _moe_gate(x, w1, topk_ids, **options):
    return _moe_call(ops.moe_gate, x, w1, topk_ids, **options)


def _moe_final(h, w2, topk_ids, topk_weights=None, **options):
    return _moe_call(ops.moe_final, h, w2, topk_ids, topk_weights, **options)


def _moe_forward(x, w1, w2, topk_ids, topk_weights, **options):
    return _moe_call(ops.moe_forward, x, w1, w2, topk_ids, topk_weights, **options)


def _moe_gate_fp8(*args, **options):
    return _moe_call(ops_fp8.moe_gate_fp8, *args, **options)


def _moe_final_fp8(*args, **options):
    return _moe_call(ops_fp8.moe_final_fp8, *args, **options)


def _moe_forward_fp8(*args, **options):
    return _moe_call(ops_fp8.moe_forward_fp8, *args, **options)


def _moe_masked_fp8(*args, **options):
    return _moe_call(ops_fp8.moe_masked_fp8, *args, **options)


# The row operations take the schema's keyword arguments as they are.
KERNELS = {
    "topk_softmax": _topk_softmax,
    "topk_route": ops.topk_route,
    "routing_metadata": ops.routing_metadata,
    "act_quant": ops.act_quant,
    "act_quant_masked": ops.act_quant_masked,
    "act_mul": ops.act_mul,
    "quant": ops.quant,
    "dequant": ops.dequant,
    "moe_gate": _moe_gate,
    "moe_final": _moe_final,
    "moe_forward": _moe_forward,
    "moe_gate_fp8": _moe_gate_fp8,
    "moe_final_fp8": _moe_final_fp8,
    "moe_forward_fp8": _moe_forward_fp8,
    "moe_masked_fp8": _moe_masked_fp8,
}


# ------------------------------------------------------------------ fake kernels
# Shapes from ops.py's shape functions, dtypes as ops.py resolves them: what the kernels return.


def _quant_results(x, shapes, dtype, scale_layout, scale_dtype):
    q_shape, s_shape = shapes
    return (_fast.empty(x, q_shape, dtype),
            _fast.empty(x, s_shape, _options.scales_dtype(scale_layout, scale_dtype)))


def _fake_topk_softmax(logits, k, renormalize=False):
    shape = ops._topk_shape(logits, k)
    return _fast.empty(logits, shape, "i32"), _fast.empty(logits, shape, "f32")


def _fake_topk_route(logits, k, **_):
    shape = ops._topk_shape(logits, k)
    return _fast.empty(logits, shape, "i32"), _fast.empty(logits, shape, "f32")


def _fake_routing_metadata(topk_ids, experts, *, block_size=1, **_):
    slots = ops._dims(topk_ids, 2)
    return tuple(_fast.empty(topk_ids, shape, "i32") for shape in (
        (experts,), (experts + 1,), (ops._order_length(topk_ids, experts, block_size),), slots,
        slots))


def _fake_act_quant(x, *, group_size=128, scale_layout="row_major", dtype="f8_e4m3",
                    scale_dtype=None, **_):
    return _quant_results(x, ops._act_quant_shapes(x, group_size, scale_layout), dtype,
                          scale_layout, scale_dtype)


def _fake_act_quant_masked(x, counts, *, group_size=128, scale_layout="row_major",
                           dtype="f8_e4m3", scale_dtype=None, **_):
    return _quant_results(x, ops._act_quant_masked_shapes(x, group_size, scale_layout), dtype,
                          scale_layout, scale_dtype)


def _fake_act_mul(x, **_):
    return _fast.empty(x, ops._act_mul_shape(x), x.dtype)


def _fake_quant(x, *, group_size=128, scale_layout="row_major", dtype="f8_e4m3",
                scale_dtype=None, **_):
    return _quant_results(x, ops._quant_shapes_of(x, group_size, scale_layout), dtype,
                          scale_layout, scale_dtype)


def _fake_dequant(q, scales, *, dtype="f32", **_):
    return _fast.empty(q, ops._dims(q, 2), dtype)


def _fake_moe_gate(x, w1, topk_ids, *, dtype=None, n_shared=0, **_):
    return _fast.empty(x, ops._moe_gate_shape(x, w1, topk_ids, n_shared), dtype or x.dtype)


def _fake_moe_final(h, w2, topk_ids, topk_weights=None, *, reduce=True, dtype=None, **_):
    return _fast.empty(h, ops._moe_final_shape(h, w2, reduce), dtype or h.dtype)


def _fake_moe_forward(x, w1, w2, topk_ids, topk_weights, *, dtype=None, **_):
    return _fast.empty(x, ops._dims(x, 2), dtype or x.dtype)


def _fake_moe_gate_fp8(x, w1, w1_scales, topk_ids, *, x_scales=None, scale_layout="row_major",
                       scale_dtype=None, n_shared=0, **_):
    h_shape, s_shape = ops_fp8._gate_shapes(x, w1, topk_ids, scale_layout, n_shared)
    return (_fast.empty(x, h_shape, "f8_e4m3"),
            _fast.empty(x, s_shape, ops_fp8._h_scales_dtype(scale_layout, scale_dtype, x_scales)))


def _fake_moe_final_fp8(h, h_scales, w2, w2_scales, topk_ids, topk_weights=None, *,
                        reduce=True, dtype=None, **_):
    return _fast.empty(h, ops._moe_final_shape(h, w2, reduce), ops_fp8._out_dtype(dtype, h.dtype))


def _fake_moe_forward_fp8(x, *_args, dtype=None, **_):
    return _fast.empty(x, ops._dims(x, 2), ops_fp8._out_dtype(dtype, x.dtype))


def _fake_moe_masked_fp8(x, *_args, dtype=None, **_):
    return _fast.empty(x, ops._dims(x, 3), ops_fp8._out_dtype(dtype, x.dtype))


FAKES = {name: globals()[f"_fake_{name}"] for name in SCHEMAS}


# ------------------------------------------------------------------ registration

_library = torch.library.Library(NAMESPACE, "DEF")  # kept: the definitions live as long as it
for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)
    for _key in ("CPU", "CUDA"):
        _library.impl(_name, KERNELS[_name], _key)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", FAKES[_name], lib=_library)

# The expert-parallel operators (torch.ops.moefuse.ep_*), defined in the same namespace.
from . import torch_ops_ep  # noqa: E402,F401
