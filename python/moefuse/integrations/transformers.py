"""moefuse as a Hugging Face transformers experts backend.

    import moefuse.integrations.transformers        # registers "moefuse"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moefuse")
    # or: model.set_experts_implementation("moefuse")

transformers (5.x, the releases whose `ExpertsInterface` takes registered names) calls
`experts_forward(experts_module, hidden_states, top_k_index, top_k_weights)` for every experts
module built with `use_experts_implementation`. This runs the module's whole layer as one
`moefuse.moe_forward` on the module's own weights, with the model's router output as given:
- the weights are read in place, never copied per call. A transposed layout ([E, K, 2I] and
  [E, I, K], gpt-oss) is laid out once so that its transpose is dense (`prepare`); the
  parameters keep their shape and values;
- gate/up concatenated or interleaved, biases, and the activations moefuse has (silu, gelu,
  gelu tanh, gpt-oss's clamped silu with alpha); anything else raises
  `moefuse.errors.UnsupportedError` naming it, never a wrong answer;
- fine-grained FP8 checkpoints (transformers' FP8Experts: e4m3 weights, one f32 or UE8M0 scale
  per 128 x 128 block, dynamic activation scales) run `moe_forward_fp8` on the FP8 weights;
- the top-k ids go to int32 and the weights to f32 (a copy of [tokens, k]); ids past the
  experts (transformers' expert-parallel sentinel) contribute nothing, as eager's skip;
- torch tensors on the CPU run on moefuse's CPU backend, CUDA tensors on its CUDA backend, on
  torch's current stream; the call is `torch.ops.moefuse.moe_forward`, so it traces under
  `torch.compile` and records into CUDA graphs (call `prepare(model)` first in both cases).
"""

import torch
from transformers import activations as hf_act
from transformers.integrations import moe as hf_moe

from .. import errors, torch_ops  # noqa: F401  (torch_ops registers torch.ops.moefuse)

NAME = "moefuse"


def _unsupported(what):
    return errors.make(errors.code_of("MOEFUSE_ERR_UNSUPPORTED"),
                       f"experts_implementation={NAME!r}: {what}")


def _activation(module):
    """moe_forward's activation keywords for the module's gate (act(gate) * up by default)."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is not hf_moe._default_apply_gate:
        # gpt-oss: (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = min(gate, l)
        if type(module).__name__.startswith("GptOss") and hasattr(module, "alpha") and \
                hasattr(module, "limit"):
            return {"activation": "silu_alpha", "alpha": float(module.alpha),
                    "limit": float(module.limit), "up_offset": 1.0}
        raise _unsupported(f"the gate of {type(module).__name__} (its own _apply_gate)")
    return _act_fn_keywords(module)


def _act_fn_keywords(module):
    """The activation keyword for module.act_fn: silu, gelu (erf) or gelu's tanh form."""
    act = getattr(module, "act_fn", None)
    if isinstance(act, (hf_act.SiLUActivation, torch.nn.SiLU)):
        return {"activation": "silu"}
    if isinstance(act, hf_act.GELUTanh):
        return {"activation": "gelu_tanh"}
    if type(act) is hf_act.GELUActivation and act.act is torch.nn.functional.gelu:
        return {"activation": "gelu"}
    raise _unsupported(f"the activation {type(act).__name__} of {type(module).__name__}")


def _dense_transpose(param):
    """param [E, a, b] as a dense [E, b, a] view. A transposed parameter's storage is laid out
    once (in place: same shape and values, other strides) so that the view is dense."""
    view = param.transpose(1, 2)
    if view.stride(2) != 1:
        with torch.no_grad():
            param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
        view = param.transpose(1, 2)
    return view


def _weights(module):
    """w1 [E, 2I, K], w2 [E, K, I], b1, b2 and the gate order of an experts module."""
    if not getattr(module, "has_gate", True):
        raise _unsupported(f"{type(module).__name__} has no gate (up_proj only)")
    if getattr(module, "has_post_expert_norm", False):
        raise _unsupported(f"{type(module).__name__} normalises each expert's output")
    w1, w2 = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        w1, w2 = _dense_transpose(w1), _dense_transpose(w2)
    b1 = b2 = None
    if getattr(module, "has_bias", False):
        b1, b2 = module.gate_up_proj_bias, module.down_proj_bias
    order = "gate_first" if getattr(module, "is_concatenated", True) else "interleaved"
    return w1, w2, b1, b2, order


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The experts of one layer: out [T, K] = sum over each token's k experts of its weight
    times the expert's gated MLP, in moefuse (docs/NUMERICS.md: f32 accumulation)."""
    w1, w2, b1, b2, order = _weights(module)
    ids, weights = _routing(top_k_index, top_k_weights, w1.shape[0])
    return torch.ops.moefuse.moe_forward(hidden_states, w1, w2, ids, weights, b1=b1, b2=b2,
                                         order=order, **_activation(module))


def _routing(top_k_index, top_k_weights, experts):
    """The router's output as moefuse takes it: ids [T, k] int32, weights [T, k] f32."""
    tokens, k = top_k_index.shape
    ids = top_k_index.to(torch.int32)
    if top_k_weights.shape == (tokens, k):
        return ids, top_k_weights.to(torch.float32)
    if top_k_weights.dim() == 2 and top_k_weights.shape == (tokens, experts):
        # a router that returns every expert's weight (DeepSeek-V2 style): the picked ones
        picked = torch.gather(top_k_weights, 1, top_k_index.clamp(max=experts - 1))
        return ids, picked.to(torch.float32)
    raise errors.make(errors.code_of("MOEFUSE_ERR_SHAPE"),
                      f"experts_implementation={NAME!r}: top_k_weights "
                      f"{tuple(top_k_weights.shape)} is neither [tokens, k] = {(tokens, k)} "
                      "nor [tokens, experts]")


def _fp8_activation(module):
    """moe_forward_fp8's activation keywords for transformers' FP8Experts (its own _apply_gate:
    the clamped silu with alpha of gpt-oss when swiglu_alpha is set, a clamp when only a limit
    is, softcaps, else act(gate) * up)."""
    if getattr(module, "gate_softcap", None) is not None:
        raise _unsupported(f"the softcapped gate of {type(module).__name__}")
    alpha = getattr(module, "swiglu_alpha", None)
    limit = getattr(module, "swiglu_limit", None) or getattr(module, "limit", None)
    if alpha is not None:
        return {"activation": "silu_alpha", "alpha": float(alpha), "limit": float(limit or 0.0),
                "up_offset": 1.0}
    keywords = _act_fn_keywords(module)
    if limit:
        keywords["limit"] = float(limit)
    return keywords


def fp8_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The experts of one fine-grained FP8 layer (transformers' FP8Experts: e4m3 weights with
    one scale per 128 x 128 block, f32 or UE8M0) through moe_forward_fp8: the weights stay FP8,
    x is quantized per 128 columns in the call, as transformers' dynamic scheme does."""
    name = type(module).__name__
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise _unsupported(f"{name}'s static activation scales")
    if not getattr(module, "has_gate", True):
        raise _unsupported(f"{name} has no gate (up_proj only)")
    if getattr(module, "has_bias", False):
        raise _unsupported(f"{name}'s biases")
    if tuple(getattr(module, "block_size", None) or ()) != (128, 128):
        raise _unsupported(f"{name}'s weight blocks {getattr(module, 'block_size', None)} "
                           "(moefuse takes 128 x 128)")
    w1, w2 = module.gate_up_proj, module.down_proj
    if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise _unsupported(f"{name}'s weights of {w1.dtype} (moefuse takes float8_e4m3fn)")
    # UE8M0 scales are powers of two: their f32 values are exact (a copy of the small scales)
    s1 = module.gate_up_proj_scale_inv.to(torch.float32)
    s2 = module.down_proj_scale_inv.to(torch.float32)
    ids, weights = _routing(top_k_index, top_k_weights, w1.shape[0])
    return torch.ops.moefuse.moe_forward_fp8(hidden_states, w1, s1, w2, s2, ids, weights,
                                             order="gate_first", **_fp8_activation(module))


def prepare(model):
    """Lays out every transposed experts module of `model` once (see `_dense_transpose`) and
    checks each module's gate, before `torch.compile` or a CUDA graph capture. Returns model."""
    for module in model.modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
            continue
        if module.gate_up_proj.dtype == torch.float8_e4m3fn:
            _fp8_activation(module)
        elif hasattr(module, "is_transposed"):
            _weights(module)
            _activation(module)
    return model


def register():
    """Registers NAME with transformers' experts interfaces, the FP8 one where this
    transformers has it (done on import)."""
    hf_moe.ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:
        return
    interface = getattr(finegrained_fp8, "FP8ExpertsInterface", None)
    if interface is not None:
        interface.register(NAME, fp8_experts_forward)


register()
